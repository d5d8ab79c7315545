/* Every block of a one-token decode step in one call: the lean step's layers without Python.
 *
 * Between its weight reads a decode step runs a dozen small operations per layer. From Python
 * each costs a dispatch or a ctypes call of several microseconds on this machine, together 20-25%
 * of a one-row step over fp16 panels. Here the whole stack runs in C, calling the very functions
 * the Python step calls (panel_rows.c's products, row_ops.c's RMSNorm, rotation and SiLU,
 * attention_rows.c's attention into the cache slot) on the same buffers in the same order, so
 * the residual stream it leaves is the Python step's bit for bit, and a row's tokens do not
 * depend on which of the two ran it.
 *
 * It serves the Llama-shaped block: RMSNorm, fused q/k/v without bias or per-head norms, rotary
 * embedding over the whole head, attention, output, RMSNorm, SiLU-gated MLP. The Python side
 * (`eager_step.LayerStack`) decides when, and builds the arguments once per model.
 *
 * Built with the other sources by minengine/model/cpu_kernels.py.
 */
#include <stdint.h>

#include "attention_rows.h"

/* panel_rows.c and row_ops.c */
void f32_panels(const float *x, long M, long K, float *xp, const float *P, long panels, float *y, long ldy,
                int threads);
void f16_panels(const float *x, long M, long K, float *xp, const uint16_t *P, long panels, float *y, long ldy,
                int threads);
void q8_0_panels(const float *x, long M, long K, const int8_t *Q, const float *S, long panels, float *y, long ldy,
                 int threads);
void rms_norm_rows(const float *x, long T, long H, long d, long sxt, long sxh, const float *w, float eps,
                   float *y, long syt, long syh);
void rope_rows(const float *x, long T, long H, long d, long sxt, long sxh, const float *cos_t, const float *sin_t,
               float *y, long syt, long syh);
void silu_mul_rows(const float *gate, const float *up, float *out, long T, long n, long sg, long su, long so);

enum { F32 = 0, F16 = 1, Q8_0 = 2 };

/* One projection's panels (panel_kernels.PanelLinear): out a whole number of panels. */
typedef struct {
    long kind, in, panels;
    const void *weights;
    const float *scales;  /* q8_0 only */
} Proj;

typedef struct {
    const float *input_norm, *post_norm;
    Proj qkv, o, gate_up, down;
    float *kc, *vc;  /* the cache's K and V for this layer (attention_rows' kc/vc) */
} LayerArgs;

typedef struct {
    long layers, hidden, heads, d, ff;  /* heads: query and KV heads, rotated together */
    float eps;
    int threads;
    const LayerArgs *layer;
    float *x;                             /* [hidden], the residual stream, added to in place */
    float *h, *qkv, *rotated, *o, *gate_up, *down;  /* the step's scratch (transformer.Scratch) */
    const float *cos, *sin;               /* the position's rotary rows [d] (cos, signed sin) */
    AttendArgs *attend;                   /* q, k, v, out in the scratch; kc, vc set per layer */
} StackArgs;

static void project(const Proj *p, const float *x, float *y, int threads) {
    long ldy = p->panels * 8;
    if (p->kind == F32) f32_panels(x, 1, p->in, (float *)x, p->weights, p->panels, y, ldy, threads);
    else if (p->kind == F16) f16_panels(x, 1, p->in, (float *)x, p->weights, p->panels, y, ldy, threads);
    else q8_0_panels(x, 1, p->in, p->weights, p->scales, p->panels, y, ldy, threads);
}

static void add(float *x, const float *y, long n) {
    for (long i = 0; i < n; i++) x[i] += y[i];
}

void decode_layers(const StackArgs *a) {
    long n = a->hidden;
    for (long i = 0; i < a->layers; i++) {
        const LayerArgs *l = a->layer + i;
        rms_norm_rows(a->x, 1, 1, n, n, 0, l->input_norm, a->eps, a->h, n, 0);
        project(&l->qkv, a->h, a->qkv, a->threads);
        rope_rows(a->qkv, 1, a->heads, a->d, 0, a->d, a->cos, a->sin, a->rotated, 0, a->d);
        a->attend->kc = l->kc;
        a->attend->vc = l->vc;
        attend_rows(a->attend);
        project(&l->o, a->attend->out, a->o, a->threads);
        add(a->x, a->o, n);
        rms_norm_rows(a->x, 1, 1, n, n, 0, l->post_norm, a->eps, a->h, n, 0);
        project(&l->gate_up, a->h, a->gate_up, a->threads);
        silu_mul_rows(a->gate_up, a->gate_up + a->ff, a->gate_up, 1, a->ff, 0, 0, 0);
        project(&l->down, a->gate_up, a->down, a->threads);
        add(a->x, a->down, n);
    }
}
