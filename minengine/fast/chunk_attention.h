/* chunk_attention.c's arguments and entry point. */
#ifndef REQSCOPE_CHUNK_ATTENTION_H
#define REQSCOPE_CHUNK_ATTENTION_H

/* Consecutive cached positions [start, start + tokens) of a request: position p of head h in layer
 * l at k + l * k_ls + h * k_hs + (p - start) * d (and the same for v). A contiguous cache is one run. */
typedef struct {
    const float *k, *v;
    long start, tokens;
    long k_hs, v_hs;           /* head strides, in floats */
    long k_ls, v_ls;           /* layer strides, in floats (0 where k, v already point at the layer) */
} ChunkRun;

/* One layer of one prompt chunk: `length` query positions from `start`, over keys 0 .. start + length - 1. */
typedef struct {
    long length, start;        /* the chunk's query positions: start .. start + length - 1 */
    long hq, hkv, d;           /* query and KV heads; head size */
    float scale;               /* applied to q.k */
    int threads;
    const float *q;            /* position i's heads at q + i * q_rs, heads d apart */
    long q_rs;
    const ChunkRun *runs;      /* where the keys lie, in order, covering 0 .. start + length - 1 */
    long n_runs;
    long layer;                /* the layer the runs' strides reach */
    float *out;                /* position i's attended heads at out + i * out_rs, heads d apart */
    long out_rs;
    int rounded;               /* scores and weighted values as int16 dot products (chunk_attention_rounded) */
} ChunkArgs;

int chunk_attention(const ChunkArgs *a); /* 0, or why not: see chunk_attention.c */
int chunk_attention_rounded(long d);

/* The same attention inside a caller's parallel region (prompt_layers.c): before the region the calling
 * thread readies its room for the rounded twin's keys and values (chunk_attention_room: 0, or
 * chunk_attention's 1 or 2), then every thread of the region calls chunk_attention_team with the same
 * arguments. Ends with a barrier. */
typedef struct {
    int *kq, *vq;
    float *ks, *vs;
} ChunkRounded;
int chunk_attention_room(const ChunkArgs *a, ChunkRounded *x);
void chunk_attention_team(const ChunkArgs *a, const ChunkRounded *x);

#endif
