/* A model's blocks as the C stacks take them (decode_layers.c: a decode step's rows; prompt_layers.c: one
 * sequence's prompt chunk): each block's weights and cache, the kernels they call, and the steps both stacks
 * take row by row inside their one parallel region. */
#ifndef REQSCOPE_STACK_LAYERS_H
#define REQSCOPE_STACK_LAYERS_H
#include <stdint.h>

/* panel_rows.c and row_ops.c */
void f32_panels(const float *x, long M, long K, float *xp, const float *P, long panels, float *y, long ldy,
                int threads);
void f16_panels(const float *x, long M, long K, float *xp, const uint16_t *P, long panels, float *y, long ldy,
                int threads);
void q8_0_panels(const float *x, long M, long K, const uint8_t *Q, long panels, float *y, long ldy, int threads);
void q4_1_panels(const float *x, long M, long K, const uint8_t *Q, long panels, float *y, long ldy, int threads);
void q8_0_dot8(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy, int threads);
void q4_1_dot8(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy, int threads);
void q8_0_dot16(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy, int threads);
void q4_1_dot16(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy, int threads);
/* row_ops.c; the last argument is the threads a prompt's rows may go to: 1 here, inside a step's team */
void rms_norm_rows(const float *x, long T, long H, long d, long sxt, long sxh, const float *w, float eps,
                   float *y, long syt, long syh, int threads);
void rope_rows(const float *x, long T, long H, long d, long sxt, long sxh, const float *cos_t, const float *sin_t,
               float *y, long syt, long syh, int threads);
void silu_mul_rows(const float *gate, const float *up, float *out, long T, long n, long sg, long su, long so,
                   int threads);
/* dot8_rows.c: the DOT8 products inside one parallel region */
void *dot8_acts(long M, long K);
void dot8_round_row(void *a, const float *x, long K, long r, int wide);
void dot8_team(const void *a, int q8, int wide, long M, long K, const uint8_t *V, long panels, float *y, long ldy);
void *dot8_acts_next(long M, long K);
void dot8_team_gated(const void *a, int q8, int wide, long M, long K, const uint8_t *V, long panels, void *next,
                     int next_wide);

/* DOT8: the DOT8 copy, rows rounded to int8; DOT16: to int16 (dot8_rows.c) */
enum { F32 = 0, F16 = 1, Q8_0 = 2, Q4_1 = 3, Q8_0_DOT8 = 4, Q4_1_DOT8 = 5, Q8_0_DOT16 = 6, Q4_1_DOT16 = 7 };

/* One projection's panels (panel_kernels.PanelLinear): out a whole number of panels. */
typedef struct {
    long kind, in, panels;
    const void *weights;  /* float32 or fp16 panels; q8_0's and q4_1's groups (their scales inside), or their
                           * DOT8 copy (dot8_rows.c) */
} Proj;

typedef struct {
    const float *input_norm, *post_norm;
    Proj qkv, o, gate_up, down;
    float *kc, *vc;  /* the cache's K and V for this layer (attention_rows' kc/vc) */
} LayerArgs;

static inline void add(float *x, const float *y, long n) {
    for (long i = 0; i < n; i++) x[i] += y[i];
}

static inline int dot8_kind(long kind) { return kind >= Q8_0_DOT8; }

/* Row r of x (K inputs a row) rounded for p; then, once every row is, p's products over the rows into y. */
static inline void round_for(void *acts, const Proj *p, const float *x, long r) {
    dot8_round_row(acts, x, p->in, r, p->kind >= Q8_0_DOT16);
}
static inline void team_project(const void *acts, const Proj *p, long rows, float *y) {
    dot8_team(acts, p->kind == Q8_0_DOT8 || p->kind == Q8_0_DOT16, p->kind >= Q8_0_DOT16, rows, p->in, p->weights,
              p->panels, y, p->panels * 8);
}
/* The gate/up product gating its own sums, silu(gate) * up, each gated row rounded for `down` into `down_acts`
 * (`dot8_acts_next`) as it is made: the rows `round_for(down_acts, down, gated, r)` would give, bit for bit,
 * with no [rows, p->panels * 4] floats written and read back. */
static inline void team_gated(const void *acts, const Proj *p, long rows, void *down_acts, const Proj *down) {
    dot8_team_gated(acts, p->kind == Q8_0_DOT8 || p->kind == Q8_0_DOT16, p->kind >= Q8_0_DOT16, rows, p->in,
                    p->weights, p->panels, down_acts, down->kind >= Q8_0_DOT16);
}

#endif
