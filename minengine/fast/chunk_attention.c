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
 * Where the build has AVX-512 VNNI the int16 activations' arithmetic has a rounded twin beside this
 * one (`rounded`, chosen by the caller): queries and keys rounded to int16 so that a score is one
 * exact integer dot product (`VPDPWSSD`, 32 multiply-adds an instruction against an FMA's 16), and
 * each block's weights rounded so that the weighted values are another. See the section below.
 *
 * The arithmetic is GCC's vector extensions: 16 floats (a zmm) where the build has AVX-512, 8 (a ymm)
 * under AVX2 (16 there, two ymm each, spilled the passes and ran far slower). The lanes change which
 * rows share a vector, never a row's arithmetic. Built with the other kernels by
 * minengine/fast/cpu_kernels.py.
 */
#pragma GCC diagnostic ignored "-Wpsabi" /* vf helpers are static inline: no ABI crosses a call */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunk_attention.h"
#include <omp.h>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define ROUNDED 1
#else
#define ROUNDED 0
#endif

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
#define STEP 4            /* 12 accumulators, 3 vectors of rows and a broadcast key: the 16 ymm registers */
#endif

static inline vf loadv(const float *p) { return *(const vfu *)p; }
static inline void storev(float *p, vf x) { *(vfu *)p = x; }
/* x in every lane. Not `(vf){0} + x`: that is an add (0 + -0 is +0) and a broadcast from a register,
 * two operations on the FP pipes beside the FMAs for every key a pass; set1 of a float read from
 * memory is one broadcast load (docs/lab/prefill-profile.md). */
#if defined(__AVX512F__)
static inline vf splat(float x) { return (vf)_mm512_set1_ps(x); }
#else
static inline vf splat(float x) { return (vf)_mm256_set1_ps(x); }
#endif
static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }
/* a > b ? a : b, lane-wise: exactly MAXPS's rule (b where they are equal or either is NaN), in one
 * instruction where `pick` over a comparison takes three. */
#if defined(__AVX512F__)
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#else
static inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
#endif

/* |x|, the sign bit cleared (a zero's sign aside, `pick(x < 0, -x, x)` in one instruction). */
static inline vf vabs(vf x) { return (vf)((vi)x & 0x7FFFFFFF); }

/* e^x for x <= 0 (scores less their row's maximum; -inf for a masked key): Cephes' expf, the
 * polynomial of exp_le0.h's, exactly 0 below -87. */
static inline vf expv_le0(vf x) {
    const vf lo = splat(-87.0f);
    vi under = x < lo;
    x = vmax(lo, x); /* x < lo ? lo : x */
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

#if ROUNDED
/* ---- The rounded twin: int16 dot products for the scores and the weighted values. ----
 *
 * A key (one KV head at one position, d floats) is rounded to int16 with a scale of its own, once a
 * call for every position (`round_block`), and a query likewise once a unit; a score is then
 * (q's scale x k's scale) x the exact integer sum of their products. `VPDPWSSD` wraps in int32, so
 * the sum is exact wherever the true sum fits: each vector is scaled to an L2 norm of at most
 * NORM (and no element past 32767), and |q.k| <= |q| |k| < 2^31 (Cauchy-Schwarz; NORM leaves room
 * for the rounding, half a step an element). A value vector is rounded by its largest element.
 *
 * The weighted values: a block's weights e^(s - max) times each value's scale are rounded per row,
 * by the smaller of two scales (32767 over the largest, 65500 over their sum, so that their rounded
 * sum x 32767 stays under 2^31), and summed against the int16 values in one integer dot product per
 * output, which the row's scale brings back. Every rounding depends only on the row's own query or on one
 * position's key or value, never on which rows share a vector or where the prompt was cut, so the
 * twin keeps the float kernel's invariance. A rounding is half a step of 1/46000 of a vector's norm
 * or of 1/32767 of its largest element: the same order as the int16 activations' products.
 */
#define NORM 46000.0f
typedef int vw __attribute__((vector_size(64)));  /* 16 int32 lanes: pairs of int16 */
typedef int vwu __attribute__((vector_size(64), aligned(4)));

static inline vw dp16(vw acc, vw a, vw b) { return (vw)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)a, (__m512i)b); }
static inline vw splat_pair(int x) { return (vw){0} + x; }
static inline vf to_float(vw x) { return __builtin_convertvector(x, vf); }
static inline vw to_int(vf x) { return (vw)_mm512_cvtps_epi32((__m512)x); } /* nearest, ties to even */

/* x's d floats rounded to int16 into out (pairs), by the smaller of the two scales above; its
 * scale back (0 for a vector of zeros). d is a multiple of 32. A NaN or infinite element (which the
 * largest element may drop, as MAXPS does) makes the sum of squares NaN or infinite: the scale is
 * then NaN, so what reads the vector comes out NaN, as float32's arithmetic would, not a number. */
static float round16(const float *x, long d, int *out) {
    vf amax = (vf){0}, ss = (vf){0};
    for (long c = 0; c < d; c += LANES) {
        vf v = loadv(x + c);
        amax = vmax(amax, vabs(v));
        ss += v * v;
    }
    float top = _mm512_reduce_max_ps((__m512)amax), sum = _mm512_reduce_add_ps((__m512)ss);
    if (top == 0.0f || !(sum <= FLT_MAX)) {
        memset(out, 0, sizeof(int) * (d / 2));
        return top == 0.0f ? 0.0f : NAN;
    }
    float s = 32767.0f / top, by_norm = NORM / sqrtf(sum);
    s = by_norm < s ? by_norm : s;
    for (long c = 0; c < d; c += 2 * LANES) {
        vw lo = to_int(loadv(x + c) * s), hi = to_int(loadv(x + c + LANES) * s);
        /* pair (c + 2i, c + 2i + 1) in lane i of the 32 rounded values */
        __m512i idx_even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        __m512i idx_odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        vw even = (vw)_mm512_permutex2var_epi32((__m512i)lo, idx_even, (__m512i)hi);
        vw odd = (vw)_mm512_permutex2var_epi32((__m512i)lo, idx_odd, (__m512i)hi);
        *(vwu *)(out + c / 2) = (even & 0xFFFF) | (odd << 16);
    }
    return 1.0f / s;
}

/* The call's rounded keys and values, for keys 0 .. span - 1 of every KV head (span a whole
 * number of blocks; positions past the chunk's last are zeros): keys as d / 2 pairs a position,
 * values as pairs of positions (2i, 2i + 1) for each of the d floats. Grown, never shrunk, per
 * calling thread. */
typedef ChunkRounded Rounded;

static __thread void *rounded_room;
static __thread size_t rounded_bytes;

static Rounded rounded_of(long hkv, long span, long d) {
    size_t ints = (size_t)(hkv * span * d), floats = (size_t)(2 * hkv * span);
    size_t bytes = sizeof(int) * ints + sizeof(float) * floats;
    if (bytes > rounded_bytes) {
        free(rounded_room);
        rounded_room = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        rounded_bytes = rounded_room ? bytes : 0;
    }
    Rounded r = {0};
    if (!rounded_room) return r;
    r.kq = rounded_room;
    r.vq = r.kq + hkv * span * d / 2;
    r.ks = (float *)(r.vq + hkv * span * d / 2);
    r.vs = r.ks + hkv * span;
    return r;
}

/* Where position p of head h lies (runs are in order; a binary search). */
static const ChunkRun *run_of(const ChunkArgs *a, long p) {
    long lo = 0, hi = a->n_runs - 1;
    while (lo < hi) {
        long mid = (lo + hi + 1) / 2;
        if (a->runs[mid].start <= p) lo = mid;
        else hi = mid - 1;
    }
    return a->runs + lo;
}

/* A value's scale: its largest element over 32767 (0 for zeros); `by` is the scale it is rounded by.
 * A NaN or infinite element makes e - e NaN: the scale is then NaN (round16 says why), `by` 0. */
static float value_scale(const float *v, long d, float *by) {
    vf amax = (vf){0}, bad = (vf){0};
    for (long c = 0; c < d; c += LANES) {
        vf e = loadv(v + c);
        amax = vmax(amax, vabs(e));
        bad += e - e;
    }
    float top = _mm512_reduce_max_ps((__m512)amax);
    if (_mm512_reduce_add_ps((__m512)bad) != 0.0f) return *by = 0.0f, NAN;
    *by = top > 0.0f ? 32767.0f / top : 0.0f;
    return top > 0.0f ? 1.0f / *by : 0.0f;
}

/* Round block b (KEYS positions) of head h: its keys, and its values paired by position. */
static void round_block(const ChunkArgs *a, const Rounded *x, long span, long h, long b) {
    long d = a->d, seen = a->start + a->length, first = b * KEYS;
    for (long j = 0; j < KEYS; j += 2) {
        const float *v[2];
        float by[2];
        for (int e = 0; e < 2; e++) {
            long p = first + j + e;
            int *kq = x->kq + (h * span + p) * d / 2;
            float *ks = x->ks + h * span + p, *vs = x->vs + h * span + p;
            if (p >= seen) {
                memset(kq, 0, sizeof(int) * (d / 2));
                *ks = *vs = by[e] = 0.0f;
                v[e] = NULL;
                continue;
            }
            const ChunkRun *u = run_of(a, p);
            *ks = round16(u->k + a->layer * u->k_ls + h * u->k_hs + (p - u->start) * d, d, kq);
            v[e] = u->v + a->layer * u->v_ls + h * u->v_hs + (p - u->start) * d;
            *vs = value_scale(v[e], d, &by[e]);
        }
        /* positions first + j and first + j + 1 as the low and high halves of each float's pair */
        int *out = x->vq + (h * span + first + j) * d / 2;
        for (long c = 0; c < d; c += LANES) {
            vw even = v[0] ? to_int(loadv(v[0] + c) * by[0]) : (vw){0};
            vw odd = v[1] ? to_int(loadv(v[1] + c) * by[1]) : (vw){0};
            *(vwu *)(out + c) = (even & 0xFFFF) | (odd << 16);
        }
    }
}

/* A unit's rounded queries and scales: qw[c2][row] holds row's floats 2 c2 and 2 c2 + 1. */
typedef struct {
    int *qw, *pw;   /* queries [d/2][w]; a block's rounded weights [KEYS/2][w] */
    int *q16;       /* one query's pairs */
    vf qs[VECS];    /* each row's query scale */
} Room16;

static Room16 room16(long d) {
    long w = VECS * LANES;
    Room16 r;
    r.qw = aligned_alloc(64, sizeof(int) * ((d / 2 * w + KEYS / 2 * w + d / 2 + 15) & ~15L));
    r.pw = r.qw + d / 2 * w;
    r.q16 = r.pw + KEYS / 2 * w;
    return r;
}

/* st[j][row] = the score of row against key j, STEP keys a pass: one integer sum over the head each. */
static inline __attribute__((always_inline)) void score16(Room *r, const Room16 *z, const int *kq, const float *ks,
                                                           long keys, long d, int nv) {
    long w = nv * LANES, pairs = d / 2;
    for (long j = 0; j < keys; j += STEP) {
        vw acc[STEP][VECS];
        for (int u = 0; u < STEP; u++)
            for (int t = 0; t < nv; t++) acc[u][t] = (vw){0};
        for (long c = 0; c < pairs; c++) {
            vw q[VECS];
            for (int t = 0; t < nv; t++) q[t] = *(const vwu *)(z->qw + c * w + LANES * t);
            for (int u = 0; u < STEP; u++) {
                vw k = splat_pair(kq[(j + u) * pairs + c]);
                for (int t = 0; t < nv; t++) acc[u][t] = dp16(acc[u][t], q[t], k);
            }
        }
        for (int u = 0; u < STEP; u++)
            for (int t = 0; t < nv; t++)
                storev(r->st + (j + u) * w + LANES * t, to_float(acc[u][t]) * z->qs[t] * splat(ks[j + u]));
    }
}

/* ot[c][row] = ot[c][row] * alpha + the block's weights (st) times the values, the weights times each
 * value's scale rounded per row first (see the section's comment), STEP floats of the head a pass. */
static inline __attribute__((always_inline)) void weigh16(Room *r, Room16 *z, const int *vq, const float *vs,
                                                           long keys, long d, int nv) {
    long w = nv * LANES;
    vf top[VECS], sum[VECS], s[VECS], back[VECS];
    for (int t = 0; t < nv; t++) top[t] = sum[t] = (vf){0};
    for (long j = 0; j < keys; j++)
        for (int t = 0; t < nv; t++) {
            vf x = loadv(r->st + j * w + LANES * t) * splat(vs[j]);
            storev(r->st + j * w + LANES * t, x);
            top[t] = vmax(top[t], x);
            sum[t] += x;
        }
    for (int t = 0; t < nv; t++) {
        vi some = top[t] > (vf){0};
        vf by_top = splat(32767.0f) / pick(some, top[t], splat(1.0f));
        vf by_sum = splat(65500.0f) / pick(some, sum[t], splat(1.0f));
        s[t] = pick(some, pick(by_sum < by_top, by_sum, by_top), (vf){0});
        /* A value whose scale is NaN (value_scale) makes the row's sum NaN, which the largest weight may
         * drop: sum - sum, 0 for a finite sum, then takes the row's outputs to NaN and leaves others' bits. */
        back[t] = pick(some, splat(1.0f) / pick(some, s[t], splat(1.0f)), (vf){0}) + (sum[t] - sum[t]);
    }
    for (long j = 0; j < keys; j += 2)
        for (int t = 0; t < nv; t++) {
            vw even = to_int(loadv(r->st + j * w + LANES * t) * s[t]);
            vw odd = to_int(loadv(r->st + (j + 1) * w + LANES * t) * s[t]);
            *(vwu *)(z->pw + j / 2 * w + LANES * t) = (even & 0xFFFF) | (odd << 16);
        }
    for (long c = 0; c < d; c += STEP) {
        vw acc[STEP][VECS];
        for (int u = 0; u < STEP; u++)
            for (int t = 0; t < nv; t++) acc[u][t] = (vw){0};
        for (long j = 0; j < keys / 2; j++) {
            vw p[VECS];
            for (int t = 0; t < nv; t++) p[t] = *(const vwu *)(z->pw + j * w + LANES * t);
            for (int u = 0; u < STEP; u++) {
                vw v = splat_pair(vq[j * d + c + u]);
                for (int t = 0; t < nv; t++) acc[u][t] = dp16(acc[u][t], p[t], v);
            }
        }
        for (int u = 0; u < STEP; u++)
            for (int t = 0; t < nv; t++) {
                float *o = r->ot + (c + u) * w + LANES * t;
                storev(o, loadv(o) * r->alpha[t] + to_float(acc[u][t]) * back[t]);
            }
    }
}

/* attend_rows_of, rounded: the same unit, blocks and online softmax over the call's rounded keys. */
static inline __attribute__((always_inline)) void attend_rows16_of(const ChunkArgs *a, const Rounded *x, long span,
                                                                    long h, long r0, long r1, Room *r, Room16 *z,
                                                                    int nv) {
    long d = a->d, groups = a->hq / a->hkv, w = nv * LANES, rows = r1 - r0, pairs = d / 2;
    long last = a->start + (r1 - 1) / groups, lowest = a->start + r0 / groups;
    memset(z->qw, 0, sizeof(int) * pairs * w);
    memset(r->ot, 0, sizeof(float) * d * w);
    for (long i = 0; i < w; i++) {
        long row = r0 + (i < rows ? i : rows - 1); /* padding lanes: the last row's position, a zero query */
        float scale = 0.0f;
        if (i < rows) {
            const float *q = a->q + (row / groups) * a->q_rs + (h * groups + row % groups) * d;
            scale = round16(q, d, z->q16);
            for (long c = 0; c < pairs; c++) z->qw[c * w + i] = z->q16[c];
        }
        z->qs[i / LANES][i % LANES] = scale;
        r->pos[i / LANES][i % LANES] = (float)(a->start + row / groups);
    }
    for (int t = 0; t < nv; t++) r->m[t] = splat(-INFINITY), r->l[t] = (vf){0};
    const int *kq = x->kq + h * span * pairs, *vq = x->vq + h * span * pairs;
    const float *ks = x->ks + h * span, *vs = x->vs + h * span;
    for (long first = 0; first <= last; first += KEYS) {
        long n = last + 1 - first < KEYS ? last + 1 - first : KEYS;
        long keys = (n + STEP - 1) / STEP * STEP; /* the keys past n are the rounded zeros */
        score16(r, z, kq + first * pairs, ks + first, keys, d, nv);
        fold(a, r, first, keys, nv, first + keys - 1 > lowest);
        weigh16(r, z, vq + first * pairs, vs + first, keys, d, nv);
    }
    for (long i = 0; i < rows; i++) {
        long row = r0 + i;
        float inv = 1.0f / r->l[i / LANES][i % LANES];
        float *out = a->out + (row / groups) * a->out_rs + (h * groups + row % groups) * d;
        for (long c = 0; c < d; c++) out[c] = r->ot[c * w + i] * inv;
    }
}

static void attend_unit16(const ChunkArgs *a, const Rounded *x, long span, long h, long r0, long r1, Room *r,
                          Room16 *z) {
    long nv = (r1 - r0 + LANES - 1) / LANES;
    if (nv == 1) attend_rows16_of(a, x, span, h, r0, r1, r, z, 1);
    else if (nv == 2) attend_rows16_of(a, x, span, h, r0, r1, r, z, 2);
    else attend_rows16_of(a, x, span, h, r0, r1, r, z, 3);
}
#endif

/* How many units a KV head's rows make: at most VECS vectors of rows each, and where a few more units
 * make their count a multiple of the threads, that many (11 positions of 3 query heads, 3 KV heads,
 * 2 threads: two units a head, not one). */
static long units_per_head(long rows, long hkv, int threads) {
    long vectors = (rows + LANES - 1) / LANES, units = (vectors + VECS - 1) / VECS;
    for (long more = units; more <= vectors && more < 2 * units + 2; more++)
        if (hkv * more % threads == 0) return more;
    return units;
}

/* Whether the rounded twin runs for a head of d floats: built with VNNI, and d a whole number of
 * 32-float halves of a rounding pass. */
int chunk_attention_rounded(long d) {
    return ROUNDED && d > 0 && d % 32 == 0 && d <= 512;
}

/* Unit u's KV head and rows [*r0, *r1): the last rows, which see the most keys, first, so that no
 * thread is left with them at the end; a unit's rows whole vectors, shared as evenly as they go. */
static void unit_rows(const ChunkArgs *a, long u, long per_head, long vectors, long rows, long *h, long *r0,
                      long *r1) {
    long b = per_head - 1 - u / a->hkv, v0 = vectors * b / per_head, v1 = vectors * (b + 1) / per_head;
    *h = u % a->hkv;
    *r0 = v0 * LANES;
    *r1 = v1 * LANES < rows ? v1 * LANES : rows;
}

/* The call's work, inside a parallel region every thread of it enters (orphaned loops): the rounded twin's
 * keys and values first where it runs (x), then the units, one at a time (the cores' rates may differ 2x).
 * Ends with the units loop's barrier. */
static void attend_in_team(const ChunkArgs *a, const ChunkRounded *x, int threads) {
    long groups = a->hq / a->hkv, rows = a->length * groups;
    long per_head = units_per_head(rows, a->hkv, threads);
    long vectors = (rows + LANES - 1) / LANES, units = per_head * a->hkv;
    Room r = room(a->d);
#if ROUNDED
    if (a->rounded) {
        long blocks = (a->start + a->length + KEYS - 1) / KEYS, span = blocks * KEYS;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < a->hkv * blocks; i++) round_block(a, x, span, i / blocks, i % blocks);
        Room16 z = room16(a->d);
#pragma omp for schedule(dynamic, 1)
        for (long u = 0; u < units; u++) {
            long h, r0, r1;
            unit_rows(a, u, per_head, vectors, rows, &h, &r0, &r1);
            if (r1 > r0) attend_unit16(a, x, span, h, r0, r1, &r, &z);
        }
        free(z.qw);
        free(r.qt);
        free(r.kp);
        return;
    }
#endif
    (void)x;
#pragma omp for schedule(dynamic, 1)
    for (long u = 0; u < units; u++) {
        long h, r0, r1;
        unit_rows(a, u, per_head, vectors, rows, &h, &r0, &r1);
        if (r1 > r0) attend_unit(a, h, r0, r1, &r);
    }
    free(r.qt);
    free(r.kp);
}

int chunk_attention_room(const ChunkArgs *a, ChunkRounded *x) {
    *x = (ChunkRounded){0};
    if (a->rounded && !chunk_attention_rounded(a->d)) return 1;
#if ROUNDED
    if (a->rounded && a->length > 0) {
        long blocks = (a->start + a->length + KEYS - 1) / KEYS;
        *x = rounded_of(a->hkv, blocks * KEYS, a->d);
        if (!x->kq) return 2;
    }
#endif
    return 0;
}

void chunk_attention_team(const ChunkArgs *a, const ChunkRounded *x) {
    if (a->length > 0) attend_in_team(a, x, omp_get_num_threads());
}

/* 0 once attended; 1 where the rounded twin was asked for a head size it does not take (or a build
 * without VNNI), 2 where there was no room for its rounded keys: the caller says so, since the float
 * arithmetic in its place would be another kernel than the one the model was built with. */
int chunk_attention(const ChunkArgs *a) {
    if (a->length <= 0) return 0;
    ChunkRounded x;
    int status = chunk_attention_room(a, &x);
    if (status) return status;
    long work = a->length * (a->start + a->length) * a->hq * a->d;
    /* Below some 64k multiply-adds a second thread's wake-up costs more than it saves. */
    int threads = work >= (1L << 16) && a->threads > 1 ? a->threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    attend_in_team(a, &x, threads);
    return 0;
}
