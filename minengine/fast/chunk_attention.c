/* A prompt chunk's attention, grouped-query and key-blocked: flash-attention's online softmax on the CPU.
 *
 * A chunk of T query positions from `start` attends causally over the start + T positions of its
 * cache (query i sees keys 0 .. start + i). Through SDPA that is a gather of the paged cache into
 * one tensor, then a product over every (query head, key) with the K/V of a KV head read once per
 * query head. Here one call per layer attends the whole chunk where the keys lie:
 *
 * - the work is cut into units (KV head x a run of its group's rows, a row being one query head at one
 *   position), shared out by OpenMP; a unit's rows lie across the lanes of up to 3 vectors, so a
 *   key of the block is read once for every query head of the group, and each row's softmax is
 *   lane-wise arithmetic (no reduction across lanes);
 * - keys are read where they lie, by position (`ChunkRun`: a paged cache's runs of blocks, or one
 *   run for a contiguous cache), 64 to a block: scored against the unit's rows, then folded in by
 *   the online softmax (a running maximum and sum per row, the accumulated values rescaled when
 *   the maximum grows).
 *
 * Key blocks start at multiples of 64 positions whatever the chunk, and a row's arithmetic depends
 * only on its own query and the keys up to it (a key past it weighs exactly 0 and leaves the
 * row's maximum, sum and values as they were), so a position's output is the same bits however
 * the prompt was cut into chunks, whichever unit or thread ran it, and whether the cache was
 * paged or contiguous.
 *
 * The arithmetic is GCC's vector extensions: 16 floats (a zmm) where the build has AVX-512, 8 (a ymm)
 * under AVX2 (16 there, two ymm each, spilled the passes and ran far slower). The lanes change which
 * rows share a vector, never a row's arithmetic. Built with the other kernels by
 * minengine/fast/cpu_kernels.py.
 */
#pragma GCC diagnostic ignored "-Wpsabi" /* vf helpers are static inline: no ABI crosses a call */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunk_attention.h"

#if defined(__AVX512F__)
#define LANES 16          /* tile rows a vector holds: a zmm */
#else
#define LANES 8           /* a ymm */
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int vi __attribute__((vector_size(4 * LANES)));
typedef float vfu __attribute__((vector_size(4 * LANES), aligned(4)));

#define VECS 3            /* vectors of rows a unit holds at most: 48 rows (24 under AVX2) */
#define KEYS 64           /* keys a block */
#if defined(__AVX512F__)
#define STEP 8            /* keys scored, or head floats weighed, a pass: STEP x VECS accumulators (24 zmm) */
#else
#define STEP 2            /* 16 ymm registers, not 32: 6 accumulators */
#endif

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf x) { *(vfu *)p = x; }
static inline vf splat(float x) { return (vf){0} + x; }
static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }
static inline vf vmax(vf a, vf b) { return pick(a > b, a, b); }

/* e^x for x <= 0 (scores less their row's maximum; -inf for a masked key): Cephes' expf, the
 * polynomial of attention_rows.c's exp_le0, exactly 0 below -87. */
static inline vf expv_le0(vf x) {
    const vf lo = splat(-87.0f);
    vi under = x < lo;
    x = pick(under, lo, x);
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to the nearest integer */
    vf n = (x * splat(1.44269504088896341f) + magic) - magic;
    vf r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * (r * r) + r + splat(1.0f);
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(y * (vf)e) & ~under);
}

/* One thread's room. A unit's rows (a query head's query at one position each) lie across vectors'
 * lanes, so a row's softmax is lane-wise arithmetic: qt[c][row], st[key][row] (scores, then
 * weights), ot[c][row]; each row's position, running maximum, sum and rescale; where each key of
 * the block lies, and a row of zeros for the keys that pad a block to a whole pass. */
typedef struct {
    float *qt, *st, *ot, *zeros;
    vf pos[VECS], m[VECS], l[VECS], alpha[VECS];
    const float **kp, **vp;
} Room;

static Room room(long d) {
    long w = VECS * LANES, floats = d * w + KEYS * w + d * w + d;
    Room r;
    r.qt = aligned_alloc(64, sizeof(float) * ((floats + 15) & ~15L));
    r.st = r.qt + d * w;
    r.ot = r.st + KEYS * w;
    r.zeros = r.ot + d * w;
    memset(r.zeros, 0, sizeof(float) * d);
    r.kp = malloc(sizeof(float *) * 2 * (KEYS + STEP));
    r.vp = r.kp + KEYS + STEP;
    return r;
}

/* Where keys [first, first + n) of head h lie (runs walked in order), then zeros up to a whole pass. */
static long locate(const ChunkArgs *a, long h, long first, long n, Room *r) {
    long run = 0, d = a->d;
    for (long j = 0; j < n; j++) {
        long p = first + j;
        while (run + 1 < a->n_runs && p >= a->runs[run].start + a->runs[run].tokens) run++;
        const ChunkRun *u = a->runs + run;
        r->kp[j] = u->k + a->layer * u->k_ls + h * u->k_hs + (p - u->start) * d;
        r->vp[j] = u->v + a->layer * u->v_ls + h * u->v_hs + (p - u->start) * d;
    }
    long padded = (n + STEP - 1) / STEP * STEP;
    for (long j = n; j < padded; j++) r->kp[j] = r->vp[j] = r->zeros;
    return padded;
}

/* st[j][row] = q(row) . key j for the block's keys, STEP keys a pass: each score one chain over the head in order. */
static inline __attribute__((always_inline)) void score(const Room *r, long keys, long d, int nv) {
    long w = nv * LANES;
    for (long j = 0; j < keys; j += STEP) {
        vf acc[STEP][VECS];
        for (int u = 0; u < STEP; u++)
            for (int t = 0; t < nv; t++) acc[u][t] = (vf){0};
        for (long c = 0; c < d; c++) {
            vf q[VECS];
            for (int t = 0; t < nv; t++) q[t] = loadv(r->qt + c * w + LANES * t);
            for (int u = 0; u < STEP; u++) {
                vf k = splat(r->kp[j + u][c]);
                for (int t = 0; t < nv; t++) acc[u][t] += k * q[t];
            }
        }
        for (int u = 0; u < STEP; u++)
            for (int t = 0; t < nv; t++) storev(r->st + (j + u) * w + LANES * t, acc[u][t]);
    }
}

/* Fold the block's scores into each row's running maximum and sum (lane-wise): st becomes the
 * weights e^(s - max), alpha the rescale of what the rows had. A key past a row's position weighs 0. */
static inline __attribute__((always_inline)) void fold(const ChunkArgs *a, Room *r, long first, long keys,
                                                        int nv, int mask) {
    long w = nv * LANES;
    const vf scale = splat(a->scale), none = splat(-INFINITY);
    vf top[VECS];
    for (int t = 0; t < nv; t++) top[t] = none;
    for (long j = 0; j < keys; j++) {
        vf at = splat((float)(first + j));
        for (int t = 0; t < nv; t++) {
            vf s = loadv(r->st + j * w + LANES * t) * scale;
            if (mask) s = pick(at > r->pos[t], none, s);
            storev(r->st + j * w + LANES * t, s);
            top[t] = vmax(top[t], s);
        }
    }
    for (int t = 0; t < nv; t++) {
        vf now = vmax(r->m[t], top[t]);
        r->alpha[t] = expv_le0(r->m[t] - now);
        r->m[t] = now;
        top[t] = r->l[t] * r->alpha[t];
    }
    for (long j = 0; j < keys; j++)
        for (int t = 0; t < nv; t++) {
            vf e = expv_le0(loadv(r->st + j * w + LANES * t) - r->m[t]);
            storev(r->st + j * w + LANES * t, e);
            top[t] += e;
        }
    for (int t = 0; t < nv; t++) r->l[t] = top[t];
}

/* ot[c][row] = ot[c][row] * alpha + sum_j st[j][row] * value j [c], STEP head floats a pass: each
 * output one chain over the block's keys in order. */
static inline __attribute__((always_inline)) void weigh(const Room *r, long keys, long d, int nv) {
    long w = nv * LANES, c = 0;
    for (; c + STEP <= d; c += STEP) {
        vf acc[STEP][VECS];
        for (int u = 0; u < STEP; u++)
            for (int t = 0; t < nv; t++) acc[u][t] = loadv(r->ot + (c + u) * w + LANES * t) * r->alpha[t];
        for (long j = 0; j < keys; j++) {
            vf p[VECS];
            for (int t = 0; t < nv; t++) p[t] = loadv(r->st + j * w + LANES * t);
            for (int u = 0; u < STEP; u++) {
                vf v = splat(r->vp[j][c + u]);
                for (int t = 0; t < nv; t++) acc[u][t] += v * p[t];
            }
        }
        for (int u = 0; u < STEP; u++)
            for (int t = 0; t < nv; t++) storev(r->ot + (c + u) * w + LANES * t, acc[u][t]);
    }
    for (; c < d; c++) { /* a head size that is not a whole number of passes: the same chains, one float a pass */
        vf acc[VECS];
        for (int t = 0; t < nv; t++) acc[t] = loadv(r->ot + c * w + LANES * t) * r->alpha[t];
        for (long j = 0; j < keys; j++)
            for (int t = 0; t < nv; t++) acc[t] += splat(r->vp[j][c]) * loadv(r->st + j * w + LANES * t);
        for (int t = 0; t < nv; t++) storev(r->ot + c * w + LANES * t, acc[t]);
    }
}

/* Unit (KV head h, rows [r0, r1) of its group's rows, position-major: row i * groups + g is query head
 * h * groups + g at position start + i), over every key its last row sees, KEYS at a time. */
static inline __attribute__((always_inline)) void attend_rows_of(const ChunkArgs *a, long h, long r0, long r1,
                                                                  Room *r, int nv) {
    long d = a->d, groups = a->hq / a->hkv, w = nv * LANES, rows = r1 - r0;
    long last = a->start + (r1 - 1) / groups, lowest = a->start + r0 / groups;
    memset(r->qt, 0, sizeof(float) * d * w);
    memset(r->ot, 0, sizeof(float) * d * w);
    for (long x = 0; x < w; x++) {
        long row = r0 + (x < rows ? x : rows - 1); /* padding lanes repeat the last row, never written out */
        const float *q = a->q + (row / groups) * a->q_rs + (h * groups + row % groups) * d;
        if (x < rows)
            for (long c = 0; c < d; c++) r->qt[c * w + x] = q[c];
        r->pos[x / LANES][x % LANES] = (float)(a->start + row / groups);
    }
    for (int t = 0; t < nv; t++) r->m[t] = splat(-INFINITY), r->l[t] = (vf){0};
    for (long first = 0; first <= last; first += KEYS) {
        long n = last + 1 - first < KEYS ? last + 1 - first : KEYS;
        long keys = locate(a, h, first, n, r);
        score(r, keys, d, nv);
        fold(a, r, first, keys, nv, first + keys - 1 > lowest);
        weigh(r, keys, d, nv);
    }
    for (long x = 0; x < rows; x++) {
        long row = r0 + x;
        float inv = 1.0f / r->l[x / LANES][x % LANES];
        float *out = a->out + (row / groups) * a->out_rs + (h * groups + row % groups) * d;
        for (long c = 0; c < d; c++) out[c] = r->ot[c * w + x] * inv;
    }
}

static void attend_unit(const ChunkArgs *a, long h, long r0, long r1, Room *r) {
    long nv = (r1 - r0 + LANES - 1) / LANES;
    if (nv == 1) attend_rows_of(a, h, r0, r1, r, 1);
    else if (nv == 2) attend_rows_of(a, h, r0, r1, r, 2);
    else attend_rows_of(a, h, r0, r1, r, 3);
}

/* How many units a KV head's rows make: at most VECS vectors of rows each, and where a few more units
 * make their count a multiple of the threads, that many (11 positions of 3 query heads, 3 KV heads,
 * 2 threads: two units a head, not one). */
static long units_per_head(long rows, long hkv, int threads) {
    long vectors = (rows + LANES - 1) / LANES, units = (vectors + VECS - 1) / VECS;
    for (long more = units; more <= vectors && more < 2 * units + 2; more++)
        if (hkv * more % threads == 0) return more;
    return units;
}

/* Whether the build has AVX-512, where the kernel was measured faster than SDPA and its cost set
 * the step planner's (docs/lab/long-prompt.md); under AVX2 alone it ran about as fast as SDPA, and
 * the binding keeps SDPA there (asked once, at load). */
int chunk_attention_wide(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

void chunk_attention(const ChunkArgs *a) {
    if (a->length <= 0) return;
    long groups = a->hq / a->hkv, rows = a->length * groups;
    long work = a->length * (a->start + a->length) * a->hq * a->d;
    /* Below some 64k multiply-adds a second thread's wake-up costs more than it saves. */
    int threads = work >= (1L << 16) && a->threads > 1 ? a->threads : 1;
    long per_head = units_per_head(rows, a->hkv, threads);
    /* A unit's rows: whole vectors, shared as evenly as they go. */
    long vectors = (rows + LANES - 1) / LANES, units = per_head * a->hkv;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Room r = room(a->d);
        /* The last rows see the most keys: taken first, so that no thread is left with them at the end. */
#pragma omp for schedule(dynamic, 1)
        for (long u = 0; u < units; u++) {
            long b = per_head - 1 - u / a->hkv, h = u % a->hkv;
            long v0 = vectors * b / per_head, v1 = vectors * (b + 1) / per_head;
            long r0 = v0 * LANES, r1 = v1 * LANES < rows ? v1 * LANES : rows;
            if (r1 > r0) attend_unit(a, h, r0, r1, &r);
        }
        free(r.qt);
        free(r.kp);
    }
}
