/* Every block of a decode step in one call: the lean step's layers, or a shared step's decode rows, without Python.
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
 * (`eager_step.LayerStack`) decides when, and builds the arguments once per model. Several rows
 * (a shared step's decode rows, attended together in the block pool) run each product over all
 * of them, as the Python batched step does, so each weight is read once a step. Where every
 * projection reads a DOT8 copy (int16 or int8 rows, dot8_rows.c) the whole stack runs in one
 * parallel region (`team_stack`), the small operations shared out by rows.
 *
 * Built with the other sources by minengine/fast/cpu_kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "attention_rows.h"
#include "stack_layers.h"

typedef struct {
    long rows, layers, hidden, heads, d, ff;  /* heads: query and KV heads, rotated together */
    float eps;
    int threads;
    const LayerArgs *layer;
    float *x;                             /* [rows, hidden], the residual stream, added to in place */
    /* The step's scratch, row after row: h [hidden], qkv [qkv.panels * 8], rotated [heads * d],
     * attended [attend->hq * d], o and down [hidden], gate_up [2 * ff], gated [ff] (may be
     * gate_up for one row); xp room for the rows repacked (panel_rows.c, several rows). */
    float *h, *qkv, *rotated, *attended, *o, *gate_up, *gated, *down, *xp;
    const float *cos, *sin;               /* each row's rotary rows [rows, d] (cos, signed sin) */
    AttendArgs *attend;                   /* its rows, shapes and positions; q, k, v, out and the
                                           * cache's kc, vc are set here, per layer */
    const float *final_norm;              /* with logits: the model's last RMSNorm, then the head */
    Proj head;
    float *logits;                        /* [rows, head.panels * 8], or NULL: the caller runs the head */
} StackArgs;

static void project(const Proj *p, long rows, const float *x, float *xp, float *y, int threads) {
    long ldy = p->panels * 8;
    if (rows == 1) xp = (float *)x;  /* one row is its own k-major layout */
    if (p->kind == F32) f32_panels(x, rows, p->in, xp, p->weights, p->panels, y, ldy, threads);
    else if (p->kind == F16) f16_panels(x, rows, p->in, xp, p->weights, p->panels, y, ldy, threads);
    else if (p->kind == Q8_0) q8_0_panels(x, rows, p->in, p->weights, p->panels, y, ldy, threads);
    else if (p->kind == Q4_1) q4_1_panels(x, rows, p->in, p->weights, p->panels, y, ldy, threads);
    else if (p->kind == Q8_0_DOT8) q8_0_dot8(x, rows, p->in, p->weights, p->panels, y, ldy, threads);
    else if (p->kind == Q4_1_DOT8) q4_1_dot8(x, rows, p->in, p->weights, p->panels, y, ldy, threads);
    else if (p->kind == Q8_0_DOT16) q8_0_dot16(x, rows, p->in, p->weights, p->panels, y, ldy, threads);
    else q4_1_dot16(x, rows, p->in, p->weights, p->panels, y, ldy, threads);
}


/* Whether every projection reads a DOT8 copy (dot8_rows.c), which the stack can run in one region. */
static int all_dot8(const StackArgs *a) {
    for (long i = 0; i < a->layers; i++) {
        const LayerArgs *l = a->layer + i;
        if (!dot8_kind(l->qkv.kind) || !dot8_kind(l->o.kind) || !dot8_kind(l->gate_up.kind) || !dot8_kind(l->down.kind))
            return 0;
    }
    return 1;
}


/* The stack over DOT8 copies in one parallel region. Opened per product, as the other formats' stack
 * does, a region left the second thread waiting while the first ran a layer's norms, rotation,
 * gating and residual adds alone, and woke it 5 times a layer (perf on 8-row steps: the worker
 * idle in libgomp for 15% of its time). Here each of those runs row by row on both threads,
 * fused with rounding the next product's rows, and the threads meet at one barrier per stage. Every
 * row, block, group and attention unit is computed as in `decode_layers`' loop of calls below, by
 * whichever thread: the same bits. */
static void team_stack(const StackArgs *a, void *acts) {
    long m = a->rows, n = a->hidden, d = a->d;
    long qkv_w = a->layer[0].qkv.panels * 8, rot_w = a->heads * d, ff = a->ff;
    AttendArgs *at = a->attend;
    long taken = 0, room = attend_scratch(at);
#pragma omp parallel num_threads(a->threads)
    {
        float *s = malloc(sizeof(float) * room);
        for (long i = 0; i < a->layers; i++) {
            const LayerArgs *l = a->layer + i;
#pragma omp for schedule(static)
            for (long r = 0; r < m; r++) {
                if (i) add(a->x + r * n, a->down + r * n, n);  /* the layer before's MLP, into the residual */
                rms_norm_rows(a->x + r * n, 1, 1, n, n, 0, l->input_norm, a->eps, a->h + r * n, n, 0, 1);
                round_for(acts, &l->qkv, a->h, r);
            }
            team_project(acts, &l->qkv, m, a->qkv);
#pragma omp for schedule(static)
            for (long r = 0; r < m; r++)
                rope_rows(a->qkv + r * qkv_w, 1, a->heads, d, qkv_w, d, a->cos + r * d, a->sin + r * d,
                          a->rotated + r * rot_w, rot_w, d, 1);
#pragma omp single
            at->kc = l->kc, at->vc = l->vc, taken = 0;
            attend_units(at, &taken, s);
#pragma omp barrier
#pragma omp for schedule(static)
            for (long r = 0; r < m; r++) round_for(acts, &l->o, a->attended, r);
            team_project(acts, &l->o, m, a->o);
#pragma omp for schedule(static)
            for (long r = 0; r < m; r++) {
                add(a->x + r * n, a->o + r * n, n);
                rms_norm_rows(a->x + r * n, 1, 1, n, n, 0, l->post_norm, a->eps, a->h + r * n, n, 0, 1);
                round_for(acts, &l->gate_up, a->h, r);
            }
            team_project(acts, &l->gate_up, m, a->gate_up);
#pragma omp for schedule(static)
            for (long r = 0; r < m; r++) {
                silu_mul_rows(a->gate_up + r * 2 * ff, a->gate_up + r * 2 * ff + ff, a->gated + r * ff, 1, ff, 2 * ff,
                              2 * ff, ff, 1);
                round_for(acts, &l->down, a->gated, r);
            }
            team_project(acts, &l->down, m, a->down);
        }
#pragma omp for schedule(static)
        for (long r = 0; r < m; r++) {
            add(a->x + r * n, a->down + r * n, n);
            if (a->logits) {
                rms_norm_rows(a->x + r * n, 1, 1, n, n, 0, a->final_norm, a->eps, a->h + r * n, n, 0, 1);
                round_for(acts, &a->head, a->h, r);
            }
        }
        if (a->logits) team_project(acts, &a->head, m, a->logits);
        free(s);
    }
}

void decode_layers(const StackArgs *a) {
    long m = a->rows, n = a->hidden, d = a->d, hq = a->attend->hq;
    long qkv_w = a->layer[0].qkv.panels * 8, rot_w = a->heads * d, ff = a->ff;
    AttendArgs *at = a->attend;
    at->q = a->rotated, at->q_rs = rot_w;  /* q and k rotated together, v as projected */
    at->k = a->rotated + hq * d, at->k_rs = rot_w;
    at->v = a->qkv + a->heads * d, at->v_rs = qkv_w;
    at->out = a->attended, at->out_rs = hq * d;
    long widest = ff > n ? ff : n;  /* the projections' inputs: hidden, attended heads, MLP */
    widest = hq * d > widest ? hq * d : widest;
    void *acts = all_dot8(a) && (!a->logits || dot8_kind(a->head.kind)) ? dot8_acts(m, widest) : NULL;
    if (acts != NULL) {
        team_stack(a, acts);
        return;
    }
    for (long i = 0; i < a->layers; i++) {
        const LayerArgs *l = a->layer + i;
        rms_norm_rows(a->x, m, 1, n, n, 0, l->input_norm, a->eps, a->h, n, 0, 1);
        project(&l->qkv, m, a->h, a->xp, a->qkv, a->threads);
        rope_rows(a->qkv, m, a->heads, d, qkv_w, d, a->cos, a->sin, a->rotated, rot_w, d, 1);
        at->kc = l->kc, at->vc = l->vc;
        attend_rows(at);
        project(&l->o, m, a->attended, a->xp, a->o, a->threads);
        add(a->x, a->o, m * n);
        rms_norm_rows(a->x, m, 1, n, n, 0, l->post_norm, a->eps, a->h, n, 0, 1);
        project(&l->gate_up, m, a->h, a->xp, a->gate_up, a->threads);
        silu_mul_rows(a->gate_up, a->gate_up + ff, a->gated, m, ff, 2 * ff, 2 * ff, ff, 1);
        project(&l->down, m, a->gated, a->xp, a->down, a->threads);
        add(a->x, a->down, m * n);
    }
    if (a->logits) {
        rms_norm_rows(a->x, m, 1, n, n, 0, a->final_norm, a->eps, a->h, n, 0, 1);
        project(&a->head, m, a->h, a->xp, a->logits, a->threads);
    }
}
