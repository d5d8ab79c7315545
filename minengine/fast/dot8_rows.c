/* Projections over q4_1 and q8_0 panels with rounded activations and integer dot products.
 *
 * panel_rows.c multiplies the blocks' float32 weights by float32 rows: one FMA per weight and row.
 * A shared step of 8 rows is then bound by the FMA pipes (on a Zen 4 EPYC an 8-row q4_1 step's
 * products ran at 90-95% of their peak). Here each row is first rounded to integers, 32 inputs at
 * a time with a scale of its own, and a block's 32 products of a column are one integer sum, exact:
 *
 * - int8 (llama.cpp's arithmetic: its Q8_1 rows for q4_1 weights, Q8_0's for q8_0): scale
 *   max |x| / 127; AVX-512 VNNI's VPDPBUSD adds 4 byte products into each of 16 int32 lanes, 64
 *   multiply-adds an instruction against an FMA's 16. The rounding (0.4% of a value) moves the
 *   logits visibly: opt-in.
 * - int16: scale max |x| / 32767; VPDPWSSD adds 2 products of 16-bit pairs a lane, 32 an
 *   instruction. The rounding is 2^-16 of a block's largest value, below an fp16 weight's own
 *   (2^-11 of it), and the logits stay within 1e-7 nats of float32's.
 *
 * The sums then take a block's two float terms:
 *
 *   y[r][c] = sum over blocks b, in order, of  fma(S, d[c] * dx[r], acc)  then  fma(m[c], sx[r], acc)
 *
 * with S the integer sum of q[c] * xq[r] over the block, dx the row's block scale, sx = dx * the
 * sum of its xq (q4_1's minimum m; q8_0 has none). A row's result is that one chain whatever
 * rows share the call: the same bits alone or in a batch. `*_reference` computes the same
 * chain one column at a time in plain C, for builds without VNNI and for the tests.
 *
 * DOT8 LAYOUT: the panels' groups (block_layout.h) laid out again for the dot products, a group
 * of GP panels (DW columns; the last group padded with zero columns) one run of blocks of QB
 * inputs. A lane of VPDPBUSD is one column over 4 consecutive inputs, so a block holds, for each
 * half v of the columns (16 each) and each quad of inputs, 16 x 4 bytes:
 *   q4_1 (D4_BLOCK bytes): DW fp16 d, DW fp16 m, then per half v and quad pair j4 (0..3) 64 bytes,
 *     byte 4l + t of them column 16v + l at input 4 j4 + t (low nibble) and 4 (j4 + 4) + t (high);
 *   q8_0 (D8_BLOCK bytes): DW float32 d, then per half v and quad j (0..7) 64 bytes, byte 4l + t
 *     column 16v + l at input 4j + t, stored + 128 (VPDPBUSD takes unsigned weights; a block's
 *     sum then carries 128 times the row's, taken back out exactly).
 * int16 reads the same bytes: a lane's 4 weights split into its even and odd 16-bit halves (inputs
 * 4j, 4j + 2 and 4j + 1, 4j + 3) by a mask and a shift, so its rows are stored quad by quad in that
 * order (INT16 ORDER: x0, x2, x1, x3), each pair one int32 to broadcast.
 *
 * Built with the other sources by minengine/fast/cpu_kernels.py; the VNNI tiles where the
 * compiler was given -mavx512vnni (`dot8_native`).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_rows.h"
#include "block_layout.h"

#define DW (GP * PW)                      /* columns of a group: two zmm of int32 lanes */
_Static_assert(DW == 32 && QB == 32, "a gated group is one block of the next product's rows (dot8_gated_groups)");
#define D4_BLOCK (DW * 2 * 2 + DW * QB / 2) /* 640 bytes */
#define D8_BLOCK (DW * 4 + DW * QB)         /* 1152 bytes */
#define D4_BITS(blk) ((blk) + DW * 2 * 2)
#define D8_BITS(blk) ((blk) + DW * 4)
#define DOT8_AHEAD 16 /* blocks a tile asks for ahead of the one it reads, as panel_rows.c's */
/* From this many blocks the threads round a call's rows together: an 8-row step's rows rounded by the
 * calling thread kept the other waiting for 15% of the step (perf); a row's few blocks (18-48) take
 * less than the barrier that sharing them adds. */
#define ROUND_TOGETHER 64
/* The byte of a DOT8 block's weights that holds column col at input i: q4_1's low nibble for inputs
 * 0..15, high for 16..31 (D4_HIGH); q8_0's whole byte. */
#define D4_AT(col, i) (((col) / 16) * 256 + ((i) / 4 % 4) * 64 + 4 * ((col) % 16) + (i) % 4)
#define D4_HIGH(i) ((i) >= 16)
#define D8_AT(col, i) (((col) / 16) * 512 + ((i) / 4) * 64 + 4 * ((col) % 16) + (i) % 4)

/* A call's rows rounded to integers: q [M][K] (int8, or int16 in INT16 ORDER), per row and block its
 * scale d, d * the sum of its q (s) and that sum (n). Kept per calling thread and grown as needed.
 * With `split` (int16 rows, from AMX_ROWS rows where the tiles run) each row also as its low bytes
 * and high bytes in input order, amx_rows.c's operands, rows rounded up to a tile's 16. */
typedef struct {
    int8_t *q;  /* int8 rows, or int16's bytes (ROWS16) */
    float *d, *s;
    int32_t *n;
    long cap_q, cap_b;  /* cap_q in bytes */
    uint8_t *lo;
    int8_t *hi;
    long cap_split;
    int split;
} Acts;

/* The calling thread's rounded rows, and a second set (`dot8_acts_next`) that the gate/up product fills with
 * down's rows while its own are still read. */
static __thread Acts acts, acts_next;
#define ROWS16(a) ((const int16_t *)(a)->q)  /* the rows as int16, where they were rounded so */

static int reserve(Acts *x, long M, long K, long width) {
    long nq = M * K * width, nb = M * (K / QB);
    if (nq > x->cap_q) {
        free(x->q);
        x->q = aligned_alloc(64, (size_t)((nq + 63) / 64 * 64));
        x->cap_q = x->q ? nq : 0;
    }
    if (nb > x->cap_b) {
        free(x->d), free(x->s), free(x->n);
        x->d = malloc(sizeof(float) * nb), x->s = malloc(sizeof(float) * nb);
        x->n = malloc(sizeof(int32_t) * nb);
        x->cap_b = x->d && x->s && x->n ? nb : 0;
    }
    x->split = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    long ns = (M + 15) / 16 * 16 * K;
    if (width == 2 && M >= AMX_ROWS && amx_on()) {
        if (ns > x->cap_split) {
            free(x->lo), free(x->hi);
            x->lo = aligned_alloc(64, (size_t)((ns + 63) / 64 * 64));
            x->hi = aligned_alloc(64, (size_t)((ns + 63) / 64 * 64));
            x->cap_split = x->lo && x->hi ? ns : 0;
        }
        x->split = x->cap_split >= ns;  /* no memory for them: the VNNI tiles, the same bits */
    }
#endif
    return x->cap_q >= nq && x->cap_b >= nb;
}

/* A block's largest |x| and its 32 values times 1 / (that / top), rounded to nearest (ties to even, the
 * vector conversion's mode), with their sum; returns the scale. AVX2, for builds without the VNNI
 * tiles; quantize_block's AVX-512 path gives the same values. */
static inline float round_block(const float *xb, float top, __m256i q[4], int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], big = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i), big = _mm256_max_ps(big, _mm256_andnot_ps(sign, v[i]));
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    t4 = _mm_max_ss(t4, _mm_movehdup_ps(t4));
    float amax = _mm_cvtss_f32(t4), d = amax / top, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *sum = _mm_cvtsi128_si32(t);
    return d;
}

/* Block b of row r (of K inputs), its 32 floats at xb, rounded into a: int8 (llama.cpp's quantize_row_q8_1: d = max
 * |x| / 127, s = d * sum(xq)) or int16 (d = max |x| / 32767, each quad in INT16 ORDER). A block's bits are its own,
 * whichever thread rounds it. A NaN or infinite value converts to INT32_MIN, which no finite one reaches (|x| / d
 * is at most the top); the block's scale is then NaN, so the row's sums come out NaN, as float32's would, rather
 * than numbers. */
static void quantize_at(Acts *a, const float *xb, long K, long r, long b, int wide) {
    long blocks = K / QB;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* The same values in half the instructions: round_block's arithmetic, 16 lanes at a time (the
     * maximum and the integer sum are exact in any order; each value is one multiply and one
     * conversion in the same rounding mode). */
    __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    float d = amax / (wide ? 32767.0f : 127.0f), id = d != 0.0f ? 1.0f / d : 0.0f;
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    int32_t n = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    const __m512i lost = _mm512_set1_epi32(INT32_MIN);
    if (_mm512_cmpeq_epi32_mask(q0, lost) | _mm512_cmpeq_epi32_mask(q1, lost)) d = NAN;
    if (wide) {  /* each quad in INT16 ORDER */
        int16_t *o = (int16_t *)a->q + r * K + b * QB;
        _mm256_storeu_si256((__m256i *)o, _mm512_cvtsepi32_epi16(_mm512_shuffle_epi32(q0, _MM_SHUFFLE(3, 1, 2, 0))));
        _mm256_storeu_si256((__m256i *)(o + 16), _mm512_cvtsepi32_epi16(_mm512_shuffle_epi32(q1, _MM_SHUFFLE(3, 1, 2, 0))));
        if (a->split) {  /* x = 256 hi + lo: vpmovdb keeps each lane's low byte */
            long at = r * K + b * QB;
            _mm_storeu_si128((__m128i *)(a->lo + at), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(a->lo + at + 16), _mm512_cvtepi32_epi8(q1));
            _mm_storeu_si128((__m128i *)(a->hi + at), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q0, 8)));
            _mm_storeu_si128((__m128i *)(a->hi + at + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q1, 8)));
        }
    } else {
        _mm_storeu_si128((__m128i *)(a->q + r * K + b * QB), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(a->q + r * K + b * QB + 16), _mm512_cvtsepi32_epi8(q1));
    }
#else
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), quad = _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7);
    __m256i q[4];
    int32_t n;
    float d = round_block(xb, wide ? 32767.0f : 127.0f, q, &n);
    __m256i lost = _mm256_set1_epi32(INT32_MIN), any = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) any = _mm256_or_si256(any, _mm256_cmpeq_epi32(q[i], lost));
    if (!_mm256_testz_si256(any, any)) d = NAN;
    if (wide) {
        int16_t *o = (int16_t *)a->q + r * K + b * QB;
        for (int i = 0; i < 4; i++) q[i] = _mm256_permutevar8x32_epi32(q[i], quad);
        _mm256_storeu_si256((__m256i *)o, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)(o + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
    } else {
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(a->q + r * K + b * QB), _mm256_permutevar8x32_epi32(packed, order));
    }
#endif
    a->d[r * blocks + b] = d, a->s[r * blocks + b] = d * (float)n, a->n[r * blocks + b] = n;
}
/* Block b of row r of x [., K], as `quantize_at` rounds it from wherever its 32 floats lie. */
static inline void quantize_block(Acts *a, const float *x, long K, long r, long b, int wide) {
    quantize_at(a, x + r * K + b * QB, K, r, b, wide);
}

/* Row r's rounded input i: int8 in order; int16 with each quad in INT16 ORDER. */
static inline int act(const Acts *a, int wide, long r, long K, long i) {
    return wide ? ROWS16(a)[r * K + (i & ~3L) + ((i & 1) << 1) + ((i & 2) >> 1)] : a->q[r * K + i];
}

/* One column's q4_1 weight at input i of a DOT8 block, and q8_0's (unbiased). */
static inline int d4_weight(const uint8_t *blk, int c, int i) {
    uint8_t byte = D4_BITS(blk)[D4_AT(c, i)];
    return D4_HIGH(i) ? byte >> 4 : byte & 15;
}
static inline int d8_weight(const uint8_t *blk, int c, int i) { return (int)D8_BITS(blk)[D8_AT(c, i)] - 128; }

static inline float half(uint16_t h) { return _cvtsh_ss(h); }

/* The reference: rows [r0, r0 + M) of a group's DW columns into t [M][DW], one column at a time; q8_0's
 * blocks (float32 scales, no minimum) or q4_1's (fp16 scales and minimums). */
static void reference(const Acts *a, int q8, int wide, long M, long r0, long K, const uint8_t *G, float *t, long ldt) {
    long blocks = K / QB;
    for (long r = 0; r < M; r++)
        for (int c = 0; c < DW; c++) {
            float acc = 0.0f;
            for (long b = 0; b < blocks; b++) {
                const uint8_t *blk = G + b * (q8 ? D8_BLOCK : D4_BLOCK);
                long row = (r0 + r) * blocks + b;
                int32_t S = 0;
                for (int i = 0; i < QB; i++)
                    S += (q8 ? d8_weight(blk, c, i) : d4_weight(blk, c, i)) * act(a, wide, r0 + r, K, b * QB + i);
                float d = q8 ? ((const float *)blk)[c] : half(((const uint16_t *)blk)[c]);
                acc = fmaf((float)S, d * a->d[row], acc);
                if (!q8) acc = fmaf(half(((const uint16_t *)blk)[DW + c]), a->s[row], acc);
            }
            t[r * ldt + c] = acc;
        }
}
static void d4_reference_rows(const Acts *a, long M, long r0, long K, const uint8_t *G, float *t, long ldt, int around) { (void)around; reference(a, 0, 0, M, r0, K, G, t, ldt); }
static void d8_reference_rows(const Acts *a, long M, long r0, long K, const uint8_t *G, float *t, long ldt, int around) { (void)around; reference(a, 1, 0, M, r0, K, G, t, ldt); }
static void d4_reference16_rows(const Acts *a, long M, long r0, long K, const uint8_t *G, float *t, long ldt, int around) { (void)around; reference(a, 0, 1, M, r0, K, G, t, ldt); }
static void d8_reference16_rows(const Acts *a, long M, long r0, long K, const uint8_t *G, float *t, long ldt, int around) { (void)around; reference(a, 1, 1, M, r0, K, G, t, ldt); }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DOT8_NATIVE 1
/* RT rows (at most 8) x a group's DW columns over the whole input: 2 x RT float sums in registers,
 * each block's integer sums 4 rows at a time (8 x 2 int32 sums would not fit beside them). With `around`
 * the sums go from the registers to t around the caches (whole 64-byte-aligned lines: dot8_groups). */
#define D_TILE(NAME, BLOCK, WEIGHTS, FINISH)                                                     \
static inline __attribute__((always_inline)) void NAME(const Acts *a, long RT, long r0, long K, const uint8_t *G, \
                                                       float *t, long ldt, int around) {         \
    long blocks = K / QB;                                                                        \
    __m512 acc[8][2];                                                                            \
    for (int r = 0; r < RT; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                    \
    for (long b = 0; b < blocks; b++) {                                                          \
        const uint8_t *blk = G + b * (BLOCK);                                                    \
        for (int at = 0; at < (BLOCK); at += 64)                                                 \
            _mm_prefetch((const char *)((uintptr_t)blk + DOT8_AHEAD * (BLOCK) + at), _MM_HINT_T0); \
        for (int h = 0; h < RT; h += 4) {                                                        \
            const int n = RT - h < 4 ? RT - h : 4;                                               \
            __m512i s[4][2];                                                                     \
            for (int r = 0; r < n; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();              \
            WEIGHTS                                                                              \
            for (int r = 0; r < n; r++) {                                                        \
                long row = (r0 + h + r) * blocks + b;                                            \
                __m512 dx = _mm512_set1_ps(a->d[row]);                                           \
                FINISH                                                                           \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < RT; r++)                                                                 \
        for (int v = 0; v < 2; v++) {                                                            \
            if (around) _mm512_stream_ps(t + r * ldt + 16 * v, acc[r][v]);                       \
            else _mm512_storeu_ps(t + r * ldt + 16 * v, acc[r][v]);                              \
        }                                                                                        \
}
/* Quad `quad` of the block's inputs (its 4 bytes of each row, broadcast) into the n rows' sums. */
#define DOT_QUAD(w0, w1, quad)                                                                   \
    for (int r = 0; r < n; r++) {                                                                \
        __m512i xq = _mm512_set1_epi32(*(const int32_t *)(a->q + (r0 + h + r) * K + b * QB + 4 * (quad))); \
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, xq);                                          \
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, xq);                                          \
    }
/* Block `blk`'s weight lanes for quads 4j..4j+3: columns 0..15 in v0, 16..31 in v1. */
#define LANES(BITS, AT, j)                                                                       \
    __m512i v0 = _mm512_loadu_si512(BITS(blk) + AT(0, 4 * (j)));                                \
    __m512i v1 = _mm512_loadu_si512(BITS(blk) + AT(16, 4 * (j)));
#define D4_WEIGHTS                                                                               \
    const __m512i low = _mm512_set1_epi8(15);                                                    \
    for (int j4 = 0; j4 < 4; j4++) {                                                             \
        LANES(D4_BITS, D4_AT, j4)                                                                \
        DOT_QUAD(_mm512_and_si512(v0, low), _mm512_and_si512(v1, low), j4)                       \
        DOT_QUAD(_mm512_and_si512(_mm512_srli_epi16(v0, 4), low), _mm512_and_si512(_mm512_srli_epi16(v1, 4), low), j4 + 4) \
    }
#define D4_FINISH                                                                                \
    __m512 sx = _mm512_set1_ps(a->s[row]);                                                       \
    for (int v = 0; v < 2; v++) {                                                                \
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32 * v)));         \
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * DW + 32 * v))); \
        acc[h + r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][v]), _mm512_mul_ps(d, dx), acc[h + r][v]); \
        acc[h + r][v] = _mm512_fmadd_ps(m, sx, acc[h + r][v]);                                   \
    }
#define D8_WEIGHTS                                                                               \
    for (int j = 0; j < 8; j++)                                                                  \
        DOT_QUAD(_mm512_loadu_si512(D8_BITS(blk) + D8_AT(0, 4 * j)), _mm512_loadu_si512(D8_BITS(blk) + D8_AT(16, 4 * j)), j)
#define D8_FINISH                                                                                \
    __m512i bias = _mm512_set1_epi32(128 * a->n[row]);                                           \
    for (int v = 0; v < 2; v++) {                                                                \
        __m512 d = _mm512_loadu_ps((const float *)blk + 16 * v);                                 \
        __m512 S = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[r][v], bias));                          \
        acc[h + r][v] = _mm512_fmadd_ps(S, _mm512_mul_ps(d, dx), acc[h + r][v]);                 \
    }
/* acc += w's 16-bit pairs times the pair at xp, broadcast by the dot product's own memory operand: a separate
 * broadcast into a register for each pair and row was measurably slower (docs/lab/prefill-profile.md). The
 * same instruction and sum either way. */
#define EMB_DOT(acc, w, xp) __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(xp)))
/* int16: quad `quad` of the rows' inputs, its even pair (x0, x2) and odd pair (x1, x3) broadcast, into
 * the n rows' sums against the weights' even (e) and odd (o) halves of columns 0..15 and 16..31. */
#define PAIR_QUAD(e0, o0, e1, o1, quad)                                                          \
    for (int r = 0; r < n; r++) {                                                                \
        const int32_t *xp = (const int32_t *)(ROWS16(a) + (r0 + h + r) * K + b * QB + 4 * (quad));    \
        EMB_DOT(s[r][0], e0, xp); EMB_DOT(s[r][0], o0, xp + 1);                                  \
        EMB_DOT(s[r][1], e1, xp); EMB_DOT(s[r][1], o1, xp + 1);                                  \
    }
/* A lane's bytes t = 0..3 as 16-bit weights: mask m keeps bits [0, w) of bytes 0 and 2 after a shift. */
#define HALF(v, shift, m) _mm512_and_si512(_mm512_srli_epi32(v, shift), m)
#define W4_WEIGHTS                                                                               \
    const __m512i nib = _mm512_set1_epi32(0x000F000F);                                           \
    for (int j4 = 0; j4 < 4; j4++) {                                                             \
        LANES(D4_BITS, D4_AT, j4)                                                                \
        PAIR_QUAD(HALF(v0, 0, nib), HALF(v0, 8, nib), HALF(v1, 0, nib), HALF(v1, 8, nib), j4)    \
        PAIR_QUAD(HALF(v0, 4, nib), HALF(v0, 12, nib), HALF(v1, 4, nib), HALF(v1, 12, nib), j4 + 4) \
    }
#define W8_WEIGHTS                                                                               \
    const __m512i byte = _mm512_set1_epi32(0x00FF00FF);                                          \
    for (int j = 0; j < 8; j++) {                                                                \
        LANES(D8_BITS, D8_AT, j)                                                                 \
        PAIR_QUAD(HALF(v0, 0, byte), HALF(v0, 8, byte), HALF(v1, 0, byte), HALF(v1, 8, byte), j) \
    }
D_TILE(d4_tile, D4_BLOCK, D4_WEIGHTS, D4_FINISH)
D_TILE(d8_tile, D8_BLOCK, D8_WEIGHTS, D8_FINISH)
D_TILE(w4_tile, D4_BLOCK, W4_WEIGHTS, D4_FINISH)
D_TILE(w8_tile, D8_BLOCK, W8_WEIGHTS, D8_FINISH)
/* A constant row count for each call, so the loops over rows unroll. */
#define D_ROWS(TILE)                                                                             \
    static void TILE##_rows(const Acts *a, long RT, long r0, long K, const uint8_t *G, float *t, long ldt, int around) { \
        switch (RT) {                                                                            \
            case 1: TILE(a, 1, r0, K, G, t, ldt, around); break;                                 \
            case 2: TILE(a, 2, r0, K, G, t, ldt, around); break;                                 \
            case 3: TILE(a, 3, r0, K, G, t, ldt, around); break;                                 \
            case 4: TILE(a, 4, r0, K, G, t, ldt, around); break;                                 \
            case 5: TILE(a, 5, r0, K, G, t, ldt, around); break;                                 \
            case 6: TILE(a, 6, r0, K, G, t, ldt, around); break;                                 \
            case 7: TILE(a, 7, r0, K, G, t, ldt, around); break;                                 \
            default: TILE(a, 8, r0, K, G, t, ldt, around); break;                                \
        }                                                                                        \
    }
D_ROWS(d4_tile)
D_ROWS(d8_tile)
D_ROWS(w4_tile)
D_ROWS(w8_tile)
#else
#define DOT8_NATIVE 0
#endif

/* Whether the VNNI tiles were built (else the products run the reference, correct but slow). */
int dot8_native(void) { return DOT8_NATIVE; }

/* Rows [r0, r0 + rows) of a group's DW columns into t, rows ldt floats apart; with `around` (the VNNI
 * tiles: t's rows whole 64-byte-aligned lines) written around the caches. */
typedef void (*GroupRows)(const Acts *a, long rows, long r0, long K, const uint8_t *G, float *t, long ldt, int around);

/* A long prompt's product is shared out as (group, span of rows) items where its groups alone are too few
 * for the threads: at least ITEMS_PER_THREAD items a thread, spans a whole number of ROW_SPAN rows (the AMX
 * tiles' windows and the 8-row passes start where they would over all the rows). The o and down projections
 * of the default model have 18 groups: 16 threads took them in two rounds, half of them idle in the second. */
#define ROW_SPAN AMX_MAX_ROWS
#define STREAM_ROWS 64 /* from this many rows (and AMX_STREAM_BYTES of y) the VNNI tiles' sums are streamed */
#define ITEMS_PER_THREAD 4

/* From this many rows a product's items go to the threads one at a time, below it in shrinking runs
 * (`guided`). A run hands its thread up to half the items at once, and on a shared host two cores' rates
 * can differ 2x from one moment to the next (a hyperthread whose sibling another tenant uses:
 * scripts/core_rates), so the faster core waited at the loop's end for the slower one's half. A decode
 * step streams its weights from memory, and there the runs stay: a thread's next item is then the
 * group after its last, which its prefetch (DOT8_AHEAD) already asked for, and one at a time was
 * slower (at 1-4 rows, and served at 16 streams). Which thread takes an item never changes its sums.
 * The figures: docs/lab/prefill-profile.md, "A prompt's items one at a time". */
#define ONE_AT_A_TIME_ROWS 64
#define ROUND_RUN 16 /* rows a prompt's rounding hands a thread at a time */
/* The items [0, n) of a product over M rows, shared out among the enclosing team (an orphaned loop)
 * as above; `ITEM(item)` does one. Ends with the loop's barrier. */
#define SHARE_ITEMS(M, n, ITEM)                                                                  \
    if ((M) >= ONE_AT_A_TIME_ROWS) {                                                             \
        _Pragma("omp for schedule(dynamic, 1)") for (long item = 0; item < (n); item++) ITEM(item); \
    } else {                                                                                     \
        _Pragma("omp for schedule(guided)") for (long item = 0; item < (n); item++) ITEM(item);  \
    }

/* How a call's M rows are cut beside `items` column items (groups, or pairs of them) for the enclosing
 * team: as many spans of whole ROW_SPAN rows as give each thread ITEMS_PER_THREAD items, one where the
 * column items alone do, none for no rows. Returns the spans; *span their rows. */
static long row_spans(long M, long items, long *span) {
    *span = 0;
    if (M <= 0) return 0;  /* no rows: no items (a span of 0 rows would divide by zero) */
    long want = ((long)ITEMS_PER_THREAD * omp_get_num_threads() + items - 1) / items;
    long most = (M + ROW_SPAN - 1) / ROW_SPAN, spans = want < most ? want : most;
    if (spans < 1) spans = 1;
    *span = ((M + spans - 1) / spans + ROW_SPAN - 1) / ROW_SPAN * ROW_SPAN;
    return (M + *span - 1) / *span;
}

/* The groups of y [M, ldy] = the rounded rows of a times the DOT8 groups V of `panels` panels, block
 * bytes `block`, shared out among the threads of the enclosing parallel region (an orphaned loop):
 * each group (its weights in L1 for every 8 rows), or for a long prompt over few groups each group's
 * span of rows, goes to a thread (`SHARE_ITEMS`: one at a time for a prompt's rows, in shrinking runs
 * for a decode step's). Where the rows were split for the tiles (int16 rows, `a->split`), amx_rows.c's
 * tiles take them, q8_0's blocks (`q8`) or q4_1's: the same bits. A row's sums are its own whichever
 * item and thread take it. Ends with the loop's barrier. */
static void dot8_groups(const Acts *a, long M, long K, const uint8_t *V, long panels, float *y, long ldy, long block,
                        GroupRows rows_of, int wide, int q8) {
    long groups = (panels + GP - 1) / GP, per_group = K / QB * block, span, spans = row_spans(M, groups, &span);
    float t[8 * DW] __attribute__((aligned(64)));
    int tiles = wide && a->split;
    /* y's old lines are only overwritten: where y outgrows the caches, reading each line in before
     * writing it is most of what a prompt's products lose against their arithmetic, on the AMX tiles
     * and the VNNI tiles alike (docs/performance.md, "AMX tiles under the int16 products";
     * docs/lab/prefill-profile.md). The VNNI tiles stream only a prompt's rows (STREAM_ROWS): a decode
     * step's logits are read straight back by the sampler, and streaming them gained nothing. */
    int stream = M * ldy * (long)sizeof(float) >= AMX_STREAM_BYTES;
    int stream_whole = stream && M >= STREAM_ROWS && DOT8_NATIVE
                       && (((uintptr_t)y | (uintptr_t)(ldy * sizeof(float))) & 63) == 0;
    if (tiles) amx_begin();
#define GROUP_ITEM(item)                                                                         \
    {                                                                                            \
        long g = (item) / spans, first = (item) % spans * span, last = M - first < span ? M : first + span; \
        long columns = (panels - g * GP < GP ? panels - g * GP : GP) * PW;                       \
        for (long r0 = first; tiles && r0 < last; r0 += AMX_MAX_ROWS) {                          \
            long rows = last - r0 < AMX_MAX_ROWS ? last - r0 : AMX_MAX_ROWS;                     \
            amx_group(q8, a->lo, a->hi, a->d, a->s, a->n, rows, r0, K, V + g * per_group, y + r0 * ldy + g * DW, ldy, \
                      columns, stream);                                                          \
        }                                                                                        \
        for (long r0 = first; !tiles && r0 < last; r0 += 8) {                                    \
            long rows = last - r0 < 8 ? last - r0 : 8;                                           \
            if (columns == DW) { /* a whole group: straight into y (around the caches where stream_whole) */ \
                rows_of(a, rows, r0, K, V + g * per_group, y + r0 * ldy + g * DW, ldy, stream_whole); \
                continue;                                                                        \
            }                                                                                    \
            rows_of(a, rows, r0, K, V + g * per_group, t, DW, 0); /* the last group's padding columns stay in t */ \
            for (long r = 0; r < rows; r++) memcpy(y + (r0 + r) * ldy + g * DW, t + r * DW, sizeof(float) * columns); \
        }                                                                                        \
        if (stream_whole) _mm_sfence(); /* before another thread reads them */                   \
    }
    SHARE_ITEMS(M, groups * spans, GROUP_ITEM)
#undef GROUP_ITEM
    if (tiles) amx_end();
}

/* silu(gate) * up over n values: row_ops.c's gating, the one definition of it. */
void silu_mul_row(const float *gate, const float *up, float *out, long n);

/* The MLP's gating inside its gate/up product (`*_gated`): V's first half of groups are the gate's
 * columns, its second half the up's, and y [M, ldy] = silu(gate) * up, panels / 2 panels wide. An item
 * takes the gate's group g and the up's group g over a span of rows (as `dot8_groups` cuts them), 8 rows
 * at a time (AMX_MAX_ROWS on the tiles): both groups' sums into the thread's scratch, then gated into y.
 * The product's sums are never written out and read back (2 x 6 MiB at 1,000 tokens of the default
 * model, then read by the gating from memory). Each sum is the product's and the gating row_ops.c's:
 * the same bits as the product, then `silu_mul_rows` over its two halves. With `next`, y is not written:
 * group g of the gated values is exactly block g of the next product's rows (DW = QB), so each row's block
 * is rounded into next (ldy its rows' width) from registers, by `quantize_at`, as `dot8_round_row` would
 * round it from y. */
static void dot8_gated_groups(const Acts *a, long M, long K, const uint8_t *V, long panels, float *y, long ldy,
                              long block, GroupRows rows_of, int wide, int q8, Acts *next, int next_wide) {
    long pairs = panels / GP / 2, per_group = K / QB * block, span, spans = row_spans(M, pairs, &span);
    float gate[AMX_MAX_ROWS * DW] __attribute__((aligned(64))), up[AMX_MAX_ROWS * DW] __attribute__((aligned(64)));
    int tiles = wide && a->split;
    long step = tiles ? AMX_MAX_ROWS : 8;
    if (tiles) amx_begin();
#define GATED_ITEM(item)                                                                         \
    {                                                                                            \
        long g = (item) / spans, first = (item) % spans * span, last = M - first < span ? M : first + span; \
        const uint8_t *G = V + g * per_group, *U = V + (g + pairs) * per_group;                  \
        for (long r0 = first; r0 < last; r0 += step) {                                           \
            long rows = last - r0 < step ? last - r0 : step;                                     \
            if (tiles) {                                                                         \
                amx_group(q8, a->lo, a->hi, a->d, a->s, a->n, rows, r0, K, G, gate, DW, DW, 0);  \
                amx_group(q8, a->lo, a->hi, a->d, a->s, a->n, rows, r0, K, U, up, DW, DW, 0);    \
            } else {                                                                             \
                rows_of(a, rows, r0, K, G, gate, DW, 0);                                         \
                rows_of(a, rows, r0, K, U, up, DW, 0);                                           \
            }                                                                                    \
            for (long r = 0; r < rows; r++) {                                                    \
                if (!next) {                                                                     \
                    silu_mul_row(gate + r * DW, up + r * DW, y + (r0 + r) * ldy + g * DW, DW);   \
                    continue;                                                                    \
                }                                                                                \
                float gated[DW] __attribute__((aligned(64)));                                    \
                silu_mul_row(gate + r * DW, up + r * DW, gated, DW);                             \
                quantize_at(next, gated, ldy, r0 + r, g, next_wide);                             \
            }                                                                                    \
        }                                                                                        \
    }
    SHARE_ITEMS(M, pairs * spans, GATED_ITEM)
#undef GATED_ITEM
    if (tiles) amx_end();
}

void dot8_round_row(void *a, const float *x, long K, long r, int wide);

/* y [M, ldy] = x [M, K] times the DOT8 groups V of `panels` panels (with `gated`, that product's gating). The
 * rows are rounded once, into the calling thread's Acts; then `dot8_groups` (`dot8_gated_groups`) shares the
 * groups out. */
static void dot8_panels(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy,
                        int threads, long block, int wide, GroupRows rows_of, int may_tile, int gated) {
    int q8 = block == D8_BLOCK, ok = reserve(&acts, M, K, wide ? 2 : 1);
    if (!may_tile) acts.split = 0;  /* the references' rows never take the tiles */
    if (!ok) {  /* no memory for the rounded rows: NaN, never another call's numbers */
        for (long r = 0; r < M; r++)
            for (long c = 0; c < panels * PW / (gated ? 2 : 1); c++) y[r * ldy + c] = NAN;
        return;
    }
    long blocks = K / QB;
    Acts *a = &acts;  /* the caller's rows (thread-local, so its address is taken once), shared by every thread */
    int together = M * blocks >= ROUND_TOGETHER;
    for (long rb = 0; !together && rb < M * blocks; rb++) quantize_block(a, x, K, rb / blocks, rb % blocks, wide);
#pragma omp parallel num_threads(threads)
    {
        /* then multiply once every block is rounded (the loop's barrier). A prompt's rows go out in runs
         * of ROUND_RUN, one at a time, as its groups do (SHARE_ITEMS says why); a step's, in halves. */
        if (together && M >= ONE_AT_A_TIME_ROWS) {
#pragma omp for schedule(dynamic, 1)
            for (long run = 0; run < (M + ROUND_RUN - 1) / ROUND_RUN; run++)
                for (long r = run * ROUND_RUN; r < M && r < (run + 1) * ROUND_RUN; r++) dot8_round_row(a, x, K, r, wide);
        } else if (together) {
#pragma omp for schedule(static)
            for (long rb = 0; rb < M * blocks; rb++) quantize_block(a, x, K, rb / blocks, rb % blocks, wide);
        }
        if (gated) dot8_gated_groups(a, M, K, V, panels, y, ldy, block, rows_of, wide, q8, NULL, 0);
        else dot8_groups(a, M, K, V, panels, y, ldy, block, rows_of, wide, q8);
    }
}

/* x [M, K] (K a multiple of 32) times q4_1 or q8_0 panels in DOT8 LAYOUT (q4_1_dot8_pack, q8_0_dot8_pack):
 * y rows of stride ldy, the rows rounded to int8 (`*_dot8`) or int16 (`*_dot16`); `*_reference` by the
 * plain C reference, one column at a time (the tests hold the tiles to it). */
#if DOT8_NATIVE
#define TILE_OR_REFERENCE(tile, reference) tile
#else
#define TILE_OR_REFERENCE(tile, reference) reference
#endif
/* Each entry point, and its gated twin (`*_gated`: `dot8_gated_groups`, y panels / 2 panels wide). The
 * twin takes panels in whole pairs of groups, the gate's and the up's, and returns 1, computing nothing,
 * for any other count; 0 once computed. */
#define DOT8_ENTRY(NAME, BLOCK, WIDE, TILE, REFERENCE)                                                  \
void NAME(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy, int threads) { \
    dot8_panels(x, M, K, V, panels, y, ldy, threads, BLOCK, WIDE, TILE_OR_REFERENCE(TILE, REFERENCE), 1, 0); \
}                                                                                                     \
int NAME##_gated(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy, int threads) { \
    if (panels % (2 * GP)) return 1;                                                                  \
    dot8_panels(x, M, K, V, panels, y, ldy, threads, BLOCK, WIDE, TILE_OR_REFERENCE(TILE, REFERENCE), 1, 1); \
    return 0;                                                                                         \
}
DOT8_ENTRY(q4_1_dot8, D4_BLOCK, 0, d4_tile_rows, d4_reference_rows)
DOT8_ENTRY(q8_0_dot8, D8_BLOCK, 0, d8_tile_rows, d8_reference_rows)
DOT8_ENTRY(q4_1_dot16, D4_BLOCK, 1, w4_tile_rows, d4_reference16_rows)
DOT8_ENTRY(q8_0_dot16, D8_BLOCK, 1, w8_tile_rows, d8_reference16_rows)
/* The same products inside a parallel region that every thread of it enters (decode_layers.c's stack,
 * one region for a whole step): `dot8_acts` readies the calling thread's Acts for M rows of up to K
 * inputs (NULL where memory runs out) before the region; in it, each row is rounded by whichever
 * thread `dot8_round_row` is called on, and once every row is (a barrier), every thread calls
 * `dot8_team` to share out the groups of the q8_0 (`q8`) or q4_1 weights V, rows rounded to int16
 * (`wide`) or int8. A block's rounding and a group's sums are the ones `*_dot8` and `*_dot16` compute:
 * the same bits. */
void *dot8_acts(long M, long K) { return reserve(&acts, M, K, 2) ? &acts : NULL; }
/* The second set, for down's rows as `dot8_team_gated` rounds them (NULL where memory runs out). */
void *dot8_acts_next(long M, long K) { return reserve(&acts_next, M, K, 2) ? &acts_next : NULL; }

void dot8_round_row(void *a, const float *x, long K, long r, int wide) {
    for (long b = 0; b < K / QB; b++) quantize_block(a, x, K, r, b, wide);
}

static GroupRows team_rows(int q8, int wide) {
    return q8 ? (wide ? TILE_OR_REFERENCE(w8_tile_rows, d8_reference16_rows)
                      : TILE_OR_REFERENCE(d8_tile_rows, d8_reference_rows))
              : (wide ? TILE_OR_REFERENCE(w4_tile_rows, d4_reference16_rows)
                      : TILE_OR_REFERENCE(d4_tile_rows, d4_reference_rows));
}

void dot8_team(const void *a, int q8, int wide, long M, long K, const uint8_t *V, long panels, float *y, long ldy) {
    dot8_groups(a, M, K, V, panels, y, ldy, q8 ? D8_BLOCK : D4_BLOCK, team_rows(q8, wide), wide, q8);
}

/* `dot8_team` for the gate/up product gating its own sums (`*_gated`, whose panel count it takes as given: whole
 * pairs of groups), its gated rows (panels / 2 panels wide) not written out but rounded into `next`
 * (`dot8_acts_next`), int16 where `next_wide`, for the product that reads them (the MLP's down): each gated
 * block while it is in registers, by the same arithmetic `dot8_round_row` would apply to the rows. */
void dot8_team_gated(const void *a, int q8, int wide, long M, long K, const uint8_t *V, long panels, void *next,
                     int next_wide) {
    dot8_gated_groups(a, M, K, V, panels, NULL, panels * PW / 2, q8 ? D8_BLOCK : D4_BLOCK, team_rows(q8, wide),
                      wide, q8, next, next_wide);
}

void q4_1_dot8_reference(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy) {
    dot8_panels(x, M, K, V, panels, y, ldy, 1, D4_BLOCK, 0, d4_reference_rows, 0, 0);
}
void q8_0_dot8_reference(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy) {
    dot8_panels(x, M, K, V, panels, y, ldy, 1, D8_BLOCK, 0, d8_reference_rows, 0, 0);
}
void q4_1_dot16_reference(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy) {
    dot8_panels(x, M, K, V, panels, y, ldy, 1, D4_BLOCK, 1, d4_reference16_rows, 0, 0);
}
void q8_0_dot16_reference(const float *x, long M, long K, const uint8_t *V, long panels, float *y, long ldy) {
    dot8_panels(x, M, K, V, panels, y, ldy, 1, D8_BLOCK, 1, d8_reference16_rows, 0, 0);
}

/* Bytes of the DOT8 copy of `panels` panels over K inputs. */
long dot8_bytes(int q8, long panels, long K) {
    return (panels + GP - 1) / GP * (K / QB) * (q8 ? D8_BLOCK : D4_BLOCK);
}

/* One block of a group of gp panels (its source block blk, panel_rows.c's layout) into DOT8 block o. */
typedef void (*PackBlock)(const uint8_t *blk, long gp, uint8_t *o);

/* Both walk the block in its own order (lanes of a half, then quads), writing through D4_AT / D8_AT:
 * in column order the scattered writes took 2-4x as long. */
static void d4_pack_block(const uint8_t *blk, long gp, uint8_t *o) {
    const uint16_t *dm = (const uint16_t *)blk;  /* d then m, panel j's 8 at j * PW: column order */
    unsigned columns = (unsigned)gp * PW;
    if (gp < GP) memset(o, 0, D4_BLOCK);  /* a whole group writes every byte below */
    for (unsigned col = 0; col < columns; col++) ((uint16_t *)o)[col] = dm[col], ((uint16_t *)o)[DW + col] = dm[columns + col];
    for (unsigned v = 0; v < 2; v++)
        for (unsigned i4 = 0; i4 < QB / 2; i4 += 4)
            for (unsigned col = 16 * v; col < 16 * v + 16 && col < columns; col++) {
                const uint8_t *panel = Q4_PAIR(blk, gp, 0, col / PW) + col % PW;  /* its pairs gp * PW apart */
                for (unsigned i = i4; i < i4 + 4; i++) {  /* input i in the low nibble, i + 16 in the high */
                    uint8_t lo = panel[i / 2 * gp * PW], hi = panel[(i + 16) / 2 * gp * PW];
                    D4_BITS(o)[D4_AT(col, i)] = (uint8_t)(((lo >> (4 * (i & 1))) & 15) | (((hi >> (4 * (i & 1))) & 15) << 4));
                }
            }
}

static void d8_pack_block(const uint8_t *blk, long gp, uint8_t *o) {
    unsigned columns = (unsigned)gp * PW;
    if (gp < GP) memset(o, 0, DW * 4), memset(D8_BITS(o), 128, DW * QB);  /* padding columns: weight 0 */
    for (unsigned col = 0; col < columns; col++) ((float *)o)[col] = ((const float *)blk)[col];
    for (unsigned v = 0; v < 2; v++)
        for (unsigned i4 = 0; i4 < QB; i4 += 4)
            for (unsigned col = 16 * v; col < 16 * v + 16 && col < columns; col++) {
                const int8_t *panel = Q8_AT(blk, gp, 0, col / PW) + col % PW;  /* its inputs gp * PW apart */
                for (unsigned i = i4; i < i4 + 4; i++) D8_BITS(o)[D8_AT(col, i)] = (uint8_t)(panel[i * gp * PW] + 128);
            }
}

/* Groups Q of `panels` panels, src_block bytes a panel per block (block_layout.h), into DOT8 LAYOUT at V
 * (dot8_bytes), block after block: each source block is read from L1 while its DOT8 block is written. */
static void dot8_pack(const uint8_t *Q, long panels, long K, uint8_t *V, int threads, long src_block, long block,
                      PackBlock pack_block) {
    long groups = (panels + GP - 1) / GP, blocks = K / QB;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long g = 0; g < groups; g++) {
        long gp = panels - g * GP < GP ? panels - g * GP : GP;
        const uint8_t *G = Q + g * GP * blocks * src_block;  /* every group before the last is whole */
        for (long b = 0; b < blocks; b++) pack_block(G + b * gp * src_block, gp, V + (g * blocks + b) * block);
    }
}

void q4_1_dot8_pack(const uint8_t *Q, long panels, long K, uint8_t *V, int threads) {
    dot8_pack(Q, panels, K, V, threads, Q4_PANEL_BLOCK, D4_BLOCK, d4_pack_block);
}
void q8_0_dot8_pack(const uint8_t *Q, long panels, long K, uint8_t *V, int threads) {
    dot8_pack(Q, panels, K, V, threads, Q8_PANEL_BLOCK, D8_BLOCK, d8_pack_block);
}
