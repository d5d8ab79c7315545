/* One sequence's prompt chunk through every block in one call: decode_layers.c's one parallel region, for
 * the T positions of a chunk rather than a step's decode rows.
 *
 * From Python a chunk's block is a dozen calls (two norms, four products, the rotation, the K/V written
 * into the cache, the attention, two residual adds), each opening its own parallel region, with the
 * second thread waiting while Python walks to the next. Here the threads stay in one region and meet at a
 * barrier per stage; the norms, the residual adds, the rotation and the cache write run row by row,
 * fused with rounding the next product's rows, and the gate/up product rounds down's rows as it gates its
 * sums (`dot8_team_gated`), so the gated floats are never written out and read back. Every value is
 * computed by the function the Python block calls for it (dot8_rows.c's rounding and groups, row_ops.c's
 * norm and rotation, chunk_attention.c's kernel), on the same inputs in the same order, so the residual
 * stream and the cache it leaves are the Python block's bit for bit (tests/engine/test_prompt_stack.py).
 *
 * As `Transformer.forward` does, the last layer takes only the chunk's last position past its K/V write.
 * It serves what `prompt_stack.PromptStack` admits: decode_layers.c's block shape, every projection over a
 * DOT8 copy, the gate/up product gating its own sums, and a cache whose layers hold K/V as computed, a
 * head's positions d apart.
 *
 * Built with the other sources by minengine/fast/cpu_kernels.py.
 */
#include <stdint.h>
#include <string.h>

#include "chunk_attention.h"
#include "stack_layers.h"

typedef struct {
    long rows, start;                 /* the chunk: positions start .. start + rows - 1 */
    long layers, hidden, hq, hkv, d, ff;
    float eps, scale;
    int threads;
    int rounded;                      /* its attention the chunk kernel's rounded twin (the model's) */
    const LayerArgs *layer;           /* kc/vc: each layer's cache, head h position p at kc + h * kc_hs + p * d */
    long kc_hs, vc_hs;
    float *x;                         /* [rows, hidden], the residual stream, added to in place */
    /* scratch, [rows, width] each: h [hidden], qkv [qkv.panels * 8], rotated [(hq + hkv) * d], attended
     * [hq * d], o [hidden], down [hidden] */
    float *h, *qkv, *rotated, *attended, *o, *down;
    const float *cos, *sin;           /* each position's rotary rows [rows, d] (cos, signed sin) */
} PromptArgs;

/* A prompt's rows go to the threads in runs, one run at a time (dot8_rows.c's ROUND_RUN says why). */
#define RUN 16

/* 0 once run; 1 or 2 where the chunk kernel refused (chunk_attention's: a head size the rounded twin does not
 * take, or no room for its keys), 2 where there was no room for the rounded rows; nothing then is written. */
int prompt_layers(const PromptArgs *a) {
    long T = a->rows, n = a->hidden, d = a->d, hq = a->hq, hkv = a->hkv, heads = hq + hkv;
    long qkv_w = a->layer[0].qkv.panels * 8, rot_w = heads * d, att_w = hq * d, last = T - 1;
    long widest = a->ff > n ? a->ff : n;
    widest = att_w > widest ? att_w : widest;
    void *acts = dot8_acts(T, widest), *down_acts = dot8_acts_next(T, a->ff);
    if (acts == NULL || down_acts == NULL) return 2;
    /* The chunk's attention over the cache's positions 0 .. start + T - 1, one run (the layer's, set per layer). */
    ChunkRun run = {.start = 0, .tokens = a->start + T, .k_hs = a->kc_hs, .v_hs = a->vc_hs};
    ChunkArgs chunk = {.length = T, .start = a->start, .hq = hq, .hkv = hkv, .d = d, .scale = a->scale,
                       .threads = a->threads, .q = a->rotated, .q_rs = rot_w, .runs = &run, .n_runs = 1,
                       .out = a->attended, .out_rs = att_w, .rounded = a->rounded};
    ChunkRounded room;
    int status = chunk_attention_room(&chunk, &room);
    if (status) return status;
    /* The last layer's one query, the chunk's last position, over every key: the same kernel (its room the
     * same keys'), as `CacheAttention` attends it. */
    ChunkArgs one = chunk;
    one.length = 1, one.start = a->start + last;
    one.q = a->rotated + last * rot_w, one.out = a->attended + last * att_w;
#pragma omp parallel num_threads(a->threads)
    {
        for (long i = 0; i < a->layers; i++) {
            const LayerArgs *l = a->layer + i;
            int final = i == a->layers - 1;
#pragma omp for schedule(dynamic, RUN)
            for (long r = 0; r < T; r++) {
                if (i) add(a->x + r * n, a->down + r * n, n);  /* the layer before's MLP, into the residual */
                rms_norm_rows(a->x + r * n, 1, 1, n, n, 0, l->input_norm, a->eps, a->h + r * n, n, 0, 1);
                round_for(acts, &l->qkv, a->h, r);
            }
            team_project(acts, &l->qkv, T, a->qkv);
#pragma omp for schedule(dynamic, RUN)
            for (long r = 0; r < T; r++) {  /* q and k rotated together; k and v into the cache (`cache.update`) */
                const float *row = a->qkv + r * qkv_w, *k = a->rotated + r * rot_w + hq * d, *v = row + heads * d;
                rope_rows(row, 1, heads, d, qkv_w, d, a->cos + r * d, a->sin + r * d, a->rotated + r * rot_w, rot_w,
                          d, 1);
                for (long h = 0; h < hkv; h++) {
                    memcpy(l->kc + h * a->kc_hs + (a->start + r) * d, k + h * d, sizeof(float) * d);
                    memcpy(l->vc + h * a->vc_hs + (a->start + r) * d, v + h * d, sizeof(float) * d);
                }
            }
            /* Past the attention: every position, or in the last layer its last alone (rows r0 ..). */
            long r0 = final ? last : 0, rows = T - r0;
#pragma omp single
            run.k = l->kc, run.v = l->vc;
            chunk_attention_team(final ? &one : &chunk, &room);
            const float *attended = a->attended + r0 * att_w;
#pragma omp for schedule(dynamic, RUN)
            for (long r = 0; r < rows; r++) round_for(acts, &l->o, attended, r);
            team_project(acts, &l->o, rows, a->o);
#pragma omp for schedule(dynamic, RUN)
            for (long r = 0; r < rows; r++) {
                float *x = a->x + (r0 + r) * n;
                add(x, a->o + r * n, n);
                rms_norm_rows(x, 1, 1, n, n, 0, l->post_norm, a->eps, a->h + r * n, n, 0, 1);
                round_for(acts, &l->gate_up, a->h, r);
            }
            /* down's rows rounded as the gate/up product gates them, never written out as floats */
            team_gated(acts, &l->gate_up, rows, down_acts, &l->down);
            team_project(down_acts, &l->down, rows, a->down);
        }
#pragma omp single
        add(a->x + last * n, a->down, n);  /* the last layer's MLP, into the last position's residual */
    }
    return 0;
}
