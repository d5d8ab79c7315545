/* Decode attention read in place: one query position per row over its cached keys and values.
 *
 * A decode row's attention is a few thousand multiply-adds, yet through torch it is a dozen
 * dispatches (K/V copied into the slot, narrows, two batched matmuls, a softmax), and rows in
 * a block pool first need their keys gathered into one padded tensor: together most of a
 * shared step outside the projections. Here one call per layer writes every row's new K/V
 * into its slot and attends each row over its positions where they lie, by index.
 *
 * Each (row, KV head) is one unit of work, done by one thread with the same arithmetic
 * whatever the other rows and the thread count: a row's output is the same bits alone or in a
 * batch, and whether its positions are consecutive (a request's own cache) or listed (a block
 * table). The query heads sharing a KV head (grouped-query attention) are scored together,
 * so each key is read once per group.
 *
 * Built with panel_rows.c by minengine/fast/cpu_kernels.py (-O3 -mavx2 -mfma -fopenmp).
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "attention_rows.h"
#include "exp_le0.h"


static inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

static inline float hmax(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* hsum of each of 8 vectors, as one vector [hsum(a[0]), ..., hsum(a[7])]: the same additions in
 * the same order as hsum's (lane l + lane l+4, then 0+2 and 1+3, then 0+1), so the same bits, in
 * 12 operations instead of 8 dependent chains of 5. */
static inline __m256 hsum8(const __m256 *a) {
    __m256 b[4];
    for (int p = 0; p < 4; p++)
        b[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
    __m256 c0 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 c1 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));  /* [0 2 4 6 | 1 3 5 7] */
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* a . b over d: 8 lanes at a time when d allows (then the lanes summed in a fixed order). */
static inline float dot(const float *a, const float *b, long d) {
    if ((d & 7) == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (long i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        return hsum(acc);
    }
    float s = 0.0f;
    for (long i = 0; i < d; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* How many positions ahead of the ones it scores a unit asks for their keys and values. A row's
 * positions lie in blocks of the pool scattered over the store, 16 positions (4 KiB a head) at
 * a time, and the hardware prefetcher does not follow a unit from one block to the next; asked
 * for 16 positions ahead (and for the first 16 at the start), the values are in cache too by
 * the time `weigh` reads them. Into L2 (T1), which measured faster than L1. The same arithmetic:
 * the same bits. The figures: docs/performance.md, "How far ahead the kernels ask for memory". */
#define AHEAD 16

/* Ask for the keys and values of positions [from, to) of a unit (d floats each, a cache line at a time). */
static inline void prefetch_positions(const float *kh, const float *vh, const long *pos, long from, long to, long d) {
    for (long t = from; t < to; t++) {
        const char *k = (const char *)(kh + (pos ? pos[t] : t) * d), *v = (const char *)(vh + (pos ? pos[t] : t) * d);
        for (long b = 0; b < d * (long)sizeof(float); b += 64) {
            _mm_prefetch(k + b, _MM_HINT_T1);
            _mm_prefetch(v + b, _MM_HINT_T1);
        }
    }
}

/* The unit a thread takes after this one, asked for a position at a time while this one weighs its
 * values. Scoring and weighing a unit work from cache once its positions are in, and took as long
 * as reading them: with each unit asking only for its own positions, memory sat idle while a unit
 * weighed and the arithmetic while the next one's first keys came in. Spread over the weighing,
 * the next unit's reads run beside it (measured: docs/performance.md, "How far ahead the kernels
 * ask for memory"). The same arithmetic: the same bits. */
typedef struct {
    const float *kh, *vh;
    const long *pos;      /* as attend_unit's: NULL for consecutive positions */
    long len, d;
    long asked, every, count;  /* positions asked for; one every `every` weighing steps */
} NextUnit;

/* One step of a unit's weighing: every `every` of them, ask for the next unit's next position. */
static inline void next_unit_step(NextUnit *n) {
    if (n == NULL || n->asked >= n->len || ++n->count < n->every) return;
    n->count = 0;
    prefetch_positions(n->kh, n->vh, n->pos, n->asked, n->asked + 1, n->d);
    n->asked++;
}

/* out[j] = inv * sum_i p[i] * v(i)[j] over j in [0, d): 8 vectors at a time where they fit, then 4.
 * Each output is one FMA chain over i in order however many are computed together; 8 at once keep
 * both FMA pipes busy where 4 chains left them waiting on each FMA's latency. */
static void weigh(const float *p, long len, const float *vh, const long *pos, long d, float inv, float *out,
                  NextUnit *next) {
    long j = 0;
    if ((d & 7) == 0) {
        for (; j + 64 <= d; j += 64) {
            __m256 acc[8];
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (long i = 0; i < len; i++) {
                next_unit_step(next);
                const float *v = vh + (pos ? pos[i] : i) * d + j;
                __m256 w = _mm256_broadcast_ss(p + i);
                for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * t), acc[t]);
            }
            __m256 s = _mm256_set1_ps(inv);
            for (int t = 0; t < 8; t++) _mm256_storeu_ps(out + j + 8 * t, _mm256_mul_ps(acc[t], s));
        }
        for (; j + 32 <= d; j += 32) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (long i = 0; i < len; i++) {
                next_unit_step(next);
                const float *v = vh + (pos ? pos[i] : i) * d + j;
                __m256 w = _mm256_broadcast_ss(p + i);
                a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
            }
            __m256 s = _mm256_set1_ps(inv);
            _mm256_storeu_ps(out + j, _mm256_mul_ps(a0, s));
            _mm256_storeu_ps(out + j + 8, _mm256_mul_ps(a1, s));
            _mm256_storeu_ps(out + j + 16, _mm256_mul_ps(a2, s));
            _mm256_storeu_ps(out + j + 24, _mm256_mul_ps(a3, s));
        }
        for (; j < d; j += 8) {
            __m256 a = _mm256_setzero_ps();
            for (long i = 0; i < len; i++) {
                next_unit_step(next);
                a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i), _mm256_loadu_ps(vh + (pos ? pos[i] : i) * d + j), a);
            }
            _mm256_storeu_ps(out + j, _mm256_mul_ps(a, _mm256_set1_ps(inv)));
        }
        return;
    }
    for (; j < d; j++) {
        float a = 0.0f;
        for (long i = 0; i < len; i++) a = fmaf(p[i], vh[(pos ? pos[i] : i) * d + j], a);
        out[j] = a * inv;
    }
}

/* Row r's positions: where they start in `pos` (and `ends`), and how many. */
static inline long row_first(const AttendArgs *a, long r) { return r ? a->ends[r - 1] : 0; }
static inline long row_length(const AttendArgs *a, long r) { return a->ends[r] - row_first(a, r); }

/* Row r, KV head h: write its new K/V, then its query heads over the row's positions; `next` asked
 * for as they are weighed (NULL: no unit follows on this thread). */
static void attend_unit(const AttendArgs *a, long r, long h, float *s, long padded, NextUnit *next) {
    long d = a->d, groups = a->hq / a->hkv, first = row_first(a, r), len = row_length(a, r);
    float *kh = a->kc + h * a->kc_hs, *vh = a->vc + h * a->vc_hs;
    if (a->k) {
        long at = a->kv_at ? a->kv_at[r] : r;
        const float *k = a->k + at * a->k_rs + h * d, *v = a->v + at * a->v_rs + h * d;
        float *kd = kh + a->slots[r] * d, *vd = vh + a->slots[r] * d;
        for (long j = 0; j < d; j++) kd[j] = k[j], vd[j] = v[j];
    }
    const long *pos = a->pos ? a->pos + first : NULL;
    const float *q = a->q + (a->q_at ? a->q_at[r] : r) * a->q_rs + h * groups * d;
    long i = 0;
    prefetch_positions(kh, vh, pos, 0, len < AHEAD ? len : AHEAD, d);
    if ((d & 7) == 0) {  /* 8 positions at a time: 8 independent chains, one reduction (hsum8) */
        const __m256 scale = _mm256_set1_ps(a->scale);
        for (; i + 8 <= len; i += 8) {
            const float *k8[8];
            for (int t = 0; t < 8; t++) k8[t] = kh + (pos ? pos[i + t] : i + t) * d;
            if (i + AHEAD < len) prefetch_positions(kh, vh, pos, i + AHEAD, i + AHEAD + 8 < len ? i + AHEAD + 8 : len, d);
            for (long g = 0; g < groups; g++) {
                const float *qg = q + g * d;
                __m256 acc[8];
                for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
                for (long c = 0; c < d; c += 8) {
                    __m256 qv = _mm256_loadu_ps(qg + c);
                    for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k8[t] + c), acc[t]);
                }
                _mm256_storeu_ps(s + g * padded + i, _mm256_mul_ps(hsum8(acc), scale));
            }
        }
    }
    for (; i < len; i++) {
        const float *k = kh + (pos ? pos[i] : i) * d;
        for (long g = 0; g < groups; g++) s[g * padded + i] = dot(q + g * d, k, d) * a->scale;
    }
    float *out = a->out + r * a->out_rs + h * groups * d;
    for (long g = 0; g < groups; g++) {
        float *sg = s + g * padded;
        for (long i = len; i < padded; i++) sg[i] = -INFINITY;
        __m256 m = _mm256_set1_ps(-INFINITY);
        for (long i = 0; i < padded; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sg + i));
        __m256 top = _mm256_set1_ps(hmax(m)), sum = _mm256_setzero_ps();
        for (long i = 0; i < padded; i += 8) {
            __m256 e = exp8_le0(_mm256_sub_ps(_mm256_loadu_ps(sg + i), top));
            _mm256_storeu_ps(sg + i, e);
            sum = _mm256_add_ps(sum, e);
        }
        weigh(sg, len, vh, pos, d, 1.0f / hsum(sum), out + g * d, next);
    }
}

/* Unit u = (row, KV head) as the one to ask for while unit `now` weighs its values. */
static NextUnit next_unit(const AttendArgs *a, long u, long now) {
    long r = u / a->hkv, h = u % a->hkv, len = row_length(a, r);
    /* The weighing steps of `now`: its query heads x its positions x d's 64-wide (or narrower) parts. */
    long steps = a->hq / a->hkv * row_length(a, now / a->hkv) * ((a->d + 63) / 64);
    NextUnit n = {a->kc + h * a->kc_hs, a->vc + h * a->vc_hs, a->pos ? a->pos + row_first(a, r) : NULL, len, a->d,
                  0, len ? steps / len : 1, 0};
    if (n.every < 1) n.every = 1;
    return n;
}

/* Floats of scores a thread's units need: each query head of a group over the longest row, padded to 8. */
static long padded_length(const AttendArgs *a) {
    long longest = 0;
    for (long r = 0; r < a->rows; r++) longest = row_length(a, r) > longest ? row_length(a, r) : longest;
    return (longest + 7) & ~7L;
}
long attend_scratch(const AttendArgs *a) {
    long padded = padded_length(a);
    return a->hq / a->hkv * (padded ? padded : 8);
}

/* The units, taken from *taken (shared, 0 at first) as threads free up: rows of a shared step differ
 * in length several times over, and a static split left one thread with the long ones. A thread
 * takes its next unit as it starts one, so that it can ask for its positions meanwhile (NextUnit).
 * A unit's arithmetic is the same on any thread. s: attend_scratch(a) floats of the thread's own. */
void attend_units(const AttendArgs *a, long *taken, float *s) {
    long units = a->rows * a->hkv, padded = padded_length(a);
    long u = __atomic_fetch_add(taken, 1, __ATOMIC_RELAXED);
    while (u < units) {
        long after = __atomic_fetch_add(taken, 1, __ATOMIC_RELAXED);
        NextUnit next;
        if (after < units) next = next_unit(a, after, u);
        attend_unit(a, u / a->hkv, u % a->hkv, s, padded, after < units ? &next : NULL);
        u = after;
    }
}

void attend_rows(const AttendArgs *a) {
    long work = 0;
    for (long r = 0; r < a->rows; r++) work += row_length(a, r);
    /* Below some 64k multiply-adds a second thread's wake-up costs more than it saves. */
    int threads = work * a->hq * a->d >= (1L << 16) && a->rows * a->hkv > 1 ? a->threads : 1;
    long taken = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *s = malloc(sizeof(float) * attend_scratch(a));
        attend_units(a, &taken, s);
        free(s);
    }
}
