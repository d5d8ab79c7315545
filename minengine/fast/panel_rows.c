/* Projections over "panels": y[M, N] = x[M, K] @ W, with W stored as N/8 panels of [K][8].
 *
 * A decode step multiplies each weight by a few rows, so the weight must stream from memory
 * once for all of them. A panel is 8 output columns (one AVX2 vector) over the whole input,
 * contiguous, so the hardware prefetcher follows it. A pass keeps up to 8 rows' sums in
 * registers (8 rows x 1 panel, 4 x 2, 2 x 4 or 1 x 4 panels at once; q8_0 holds its scales too,
 * so 4 x 1 and 2 x 2), so up to 8 rows read each
 * panel once: a second pass would read it again from L2, which is barely faster than memory
 * here (measured: 5 rows in two passes cost 1.2x 4 rows in one). float32 tiles read their rows
 * repacked k-major (`pack_rows`), so a k's broadcasts share a cache line. Every output is
 * one FMA chain over k = 0..K-1 in order, whatever M and the thread count, so a row's product is
 * the same bits alone or beside others (batch invariance by construction).
 *
 * fp16 panels hold the weights in IEEE half precision: half of float32's bytes, each vector
 * converted exactly to float32 once per k (F16C) and shared by the rows, so the products are
 * float32's arithmetic on the rounded weights.
 *
 * q8_0 panels hold int8 weights and one float32 scale per 32 inputs and column (llama.cpp's
 * Q8_0 blocks, with a float32 scale): a quarter of float32's bytes. Each weight vector is
 * dequantized once per k and shared by every row, so the activations stay float32. Like q4_1's,
 * a group of GP panels is one stream (Q8_0 LAYOUT below).
 *
 * q4_1 panels hold llama.cpp's Q4_1 blocks: per 32 inputs and column a 4-bit q, an fp16 scale d
 * and an fp16 minimum m, the weight q * d + m: 0.625 bytes a weight. q * d needs at most 15
 * significant bits, so one FMA gives gguf's dequantized float32 exactly (it computes q * d, then
 * + m): where a checkpoint came from a Q4_1 GGUF, these tiles multiply by its very float32
 * weights, in float32 panels' order, and give their bits. A group of GP panels is one stream,
 * block after block (Q4_1 LAYOUT below): a tile reading 4 panels' weights and scales from 8
 * places at once kept a one-row step's products at 12 GB/s where the 2 cores read 27-41 GB/s.
 * A block-format product takes the groups alone (their scales are inside).
 *
 * Built by minengine/fast/cpu_kernels.py with -O3 -mavx2 -mfma -mf16c -fopenmp, and the AVX-512
 * flags where torch finds AVX-512 (the tiles then take zmm, below: the same bits); OpenMP is the
 * runtime torch already loaded (same soname), and the thread count is the caller's.
 */
#include <immintrin.h>
#include <stdint.h>

#include "block_layout.h"

#define PF_BYTES 2048  /* how far ahead of its panel a float32 tile of several rows prefetches */

/* A float32 tile of several rows computes for a while on each cache line of its panel, and the
 * hardware prefetcher falls behind: it asks for the line PF_BYTES ahead itself, once per line
 * (8 rows: about 10% faster a sweep). One row streams fast enough without (measured slower with
 * it), and q8_0's tiles are bound by dequantizing, not by memory. The figures: docs/performance.md,
 * "How far ahead the kernels ask for memory". */
#define PREFETCH(RT, BASE, K_BYTES)                                                              \
    if ((RT) > 1 && ((k * (K_BYTES)) & 63) == 0) _mm_prefetch((const char *)(BASE) + PF_BYTES, _MM_HINT_T0);

/* RT rows x NP panels, the whole input: RT*NP sums in registers, each one FMA chain in k order.
 * One macro for float32 and fp16 panels: LOAD turns 8 stored weights into a float32 vector (fp16:
 * one F16C conversion, exact, shared by the tile's rows), so both kinds sum the same products in
 * the same order. Inlined: GCC 12 left out of line keeps the 2 x 4 and 4 x 2 tiles' sums in
 * memory, a store of each sum every k (4 rows: 11% slower a sweep). */
#define LOAD_F32(P, at) _mm256_loadu_ps((P) + (at))
#define LOAD_F16(P, at) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((P) + (at))))
/* A tile's RT x NP float32 accumulators `a`: zeroed, fed row r's broadcast input (at XAT) times
 * the NP weight vectors `w` of one k, and stored to y's rows. */
#define ACC_ZERO(RT, NP)                                                                         \
    for (int r = 0; r < RT; r++)                                                                 \
        for (int p = 0; p < NP; p++) a[r][p] = _mm256_setzero_ps();
#define ACC_FMA(RT, NP, XAT, w)                                                                  \
    for (int r = 0; r < RT; r++) {                                                               \
        __m256 b = _mm256_broadcast_ss(XAT);                                                     \
        for (int p = 0; p < NP; p++) a[r][p] = _mm256_fmadd_ps(b, w[p], a[r][p]);                \
    }
#define ACC_STORE(RT, NP)                                                                        \
    for (int r = 0; r < RT; r++)                                                                 \
        for (int p = 0; p < NP; p++) _mm256_storeu_ps(y + r * ldy + p * PW, a[r][p]);
#define TILE(KIND, WT, LOAD, RT, NP)                                                             \
static inline __attribute__((always_inline)) void KIND##_##RT##x##NP(const float *x, long K, const WT *P, float *y, long ldy) { \
    __m256 a[RT][NP];                                                                            \
    ACC_ZERO(RT, NP)                                                                             \
    for (long k = 0; k < K; k++) {                                                               \
        __m256 w[NP];                                                                            \
        for (int p = 0; p < NP; p++) {                                                           \
            PREFETCH(RT, P + (p * K + k) * PW, PW * (long)sizeof(WT))                            \
            w[p] = LOAD(P, (p * K + k) * PW);                                                    \
        }                                                                                        \
        ACC_FMA(RT, NP, x + k * RT + r, w)                                                       \
    }                                                                                            \
    ACC_STORE(RT, NP)                                                                            \
}
#define F32_TILE(RT, NP) TILE(f32, float, LOAD_F32, RT, NP)
#define F16_TILE(RT, NP) TILE(f16, uint16_t, LOAD_F16, RT, NP)

#ifdef __AVX512F__
/* With AVX-512 a zmm holds two neighbouring panels' 8 columns at one k (the panels lie K * 8 apart:
 * two loads and an insert), so a tile of RT rows x NP panels keeps RT * NP / 2 sums and spends
 * half the FMAs and broadcasts on the same products. Each lane is still one FMA chain in k order,
 * the AVX2 tiles' bits: a product is the same on either build (tests/engine/test_panel_kernels.py). */
#define LOAD2_F32(P, at, gap)                                                                    \
    _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((P) + (at))), _mm256_loadu_ps((P) + (at) + (gap)), 1)
#define LOAD2_F16(P, at, gap)                                                                    \
    _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((P) + (at)))), \
                                            _mm_loadu_si128((const __m128i *)((P) + (at) + (gap))), 1))
/* A block-format wide tile asks, at each block of QB inputs, for its group's block BLOCKS_AHEAD
 * blocks ahead (one stream: Q4_1 and Q8_0 LAYOUT): left to itself, the hardware prefetcher fell
 * behind the tiles, and 16 blocks ahead served the q8_0 head better than 8. The ask runs on past
 * the group's last block into the next group's first: the groups lie one after another and a
 * thread takes consecutive ones, so that is what it reads next, and stopping at the group's end
 * left 16 of a 576-wide input's 18 blocks (the model's q/k/v, gate/up and head) to the hardware
 * prefetcher at every group's start. Past the last group's end it asks for bytes no one reads: a
 * prefetch never faults. The figures: docs/performance.md, "How far ahead the kernels ask for
 * memory". */
#define BLOCKS_AHEAD 16
#define PREFETCH_GROUP(blk, BLOCK_BYTES)                                                         \
    for (int at = 0; at < GP * (BLOCK_BYTES); at += 64)                                          \
        _mm_prefetch((const char *)((uintptr_t)(blk) + BLOCKS_AHEAD * GP * (BLOCK_BYTES) + at), _MM_HINT_T0);
/* A wide tile's RT x NV zmm sums back into 2 * NV panels of y's rows (two 8-column stores each). */
#define STORE_WIDE(RT, NV)                                                                       \
    for (int r = 0; r < RT; r++)                                                                 \
        for (int v = 0; v < NV; v++) {                                                           \
            _mm256_storeu_ps(y + r * ldy + 2 * v * PW, _mm512_castps512_ps256(a[r][v]));         \
            _mm256_storeu_ps(y + r * ldy + (2 * v + 1) * PW, _mm512_extractf32x8_ps(a[r][v], 1)); \
        }
#define WIDE_TILE(KIND, WT, LOAD2, RT, NP)                                                       \
static inline __attribute__((always_inline)) void KIND##_w##RT##x##NP(const float *x, long K, const WT *P, float *y, long ldy) { \
    __m512 a[RT][NP / 2];                                                                        \
    for (int r = 0; r < RT; r++)                                                                 \
        for (int v = 0; v < NP / 2; v++) a[r][v] = _mm512_setzero_ps();                          \
    for (long k = 0; k < K; k++) {                                                               \
        __m512 w[NP / 2];                                                                        \
        for (int v = 0; v < NP / 2; v++) {                                                       \
            PREFETCH(RT, P + (2 * v * K + k) * PW, PW * (long)sizeof(WT))                        \
            PREFETCH(RT, P + ((2 * v + 1) * K + k) * PW, PW * (long)sizeof(WT))                  \
            w[v] = LOAD2(P, (2 * v * K + k) * PW, K * PW);                                       \
        }                                                                                        \
        for (int r = 0; r < RT; r++) {                                                           \
            __m512 b = _mm512_set1_ps(x[k * RT + r]);                                            \
            for (int v = 0; v < NP / 2; v++) a[r][v] = _mm512_fmadd_ps(b, w[v], a[r][v]);        \
        }                                                                                        \
    }                                                                                            \
    STORE_WIDE(RT, NP / 2)                                                                       \
}
#define WIDE_TILES(KIND, WT, LOAD2)                                                              \
    WIDE_TILE(KIND, WT, LOAD2, 1, 4) WIDE_TILE(KIND, WT, LOAD2, 2, 4) WIDE_TILE(KIND, WT, LOAD2, 3, 4)       \
    WIDE_TILE(KIND, WT, LOAD2, 4, 4) WIDE_TILE(KIND, WT, LOAD2, 5, 4) WIDE_TILE(KIND, WT, LOAD2, 6, 4)       \
    WIDE_TILE(KIND, WT, LOAD2, 7, 4) WIDE_TILE(KIND, WT, LOAD2, 8, 4)
WIDE_TILES(f32, float, LOAD2_F32)
WIDE_TILES(f16, uint16_t, LOAD2_F16)
WIDE_TILE(f16, uint16_t, LOAD2_F16, 1, 8)
/* q4_1 in zmm: a whole group (gp == GP), a pair of panels' 8 bytes a k-pair side by side in one load,
 * their scales and minimums too; the group's next blocks asked for BLOCKS_AHEAD ahead (one stream). */
#define WIDE_Q4_TILE(RT)                                                                         \
static inline void q4_w##RT##x4(const float *x, long K, const uint8_t *G, long gp, long j0, float *y, long ldy) { \
    __m512 a[RT][2];                                                                             \
    const __m512i low = _mm512_set1_epi32(15);                                                   \
    (void)gp, (void)j0;                                                                          \
    for (int r = 0; r < RT; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();                        \
    for (long kb = 0; kb < K; kb += QB) {                                                        \
        const uint8_t *blk = Q4_BLOCK(G, GP, kb);                                                \
        PREFETCH_GROUP(blk, Q4_PANEL_BLOCK)                                                      \
        const uint16_t *dm = (const uint16_t *)blk;                                              \
        __m512 d[2], m[2];                                                                       \
        for (int v = 0; v < 2; v++) {                                                            \
            d[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + 2 * v * PW)));      \
            m[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dm + (GP + 2 * v) * PW))); \
        }                                                                                        \
        for (long k = kb; k < kb + QB; k += 2) {                                                 \
            __m512 w0[2], w1[2];                                                                 \
            for (int v = 0; v < 2; v++) {                                                        \
                __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)Q4_PAIR(blk, GP, k - kb, 2 * v))); \
                w0[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d[v], m[v]); \
                w1[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d[v], m[v]);  \
            }                                                                                    \
            for (int r = 0; r < RT; r++) {                                                       \
                __m512 b0 = _mm512_set1_ps(x[r * K + k]), b1 = _mm512_set1_ps(x[r * K + k + 1]); \
                for (int v = 0; v < 2; v++) a[r][v] = _mm512_fmadd_ps(b0, w0[v], a[r][v]);       \
                for (int v = 0; v < 2; v++) a[r][v] = _mm512_fmadd_ps(b1, w1[v], a[r][v]);       \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    STORE_WIDE(RT, 2)                                                                            \
}
/* q8_0 in zmm: a whole group (gp == GP), a pair of panels' 8 int8 at one k in one load, their scales
 * side by side; the group's next blocks asked for BLOCKS_AHEAD ahead (one stream). */
#define WIDE_Q8_TILE(RT)                                                                         \
static inline void q8_w##RT##x4(const float *x, long K, const uint8_t *G, long gp, long j0, float *y, long ldy) { \
    __m512 a[RT][2];                                                                             \
    (void)gp, (void)j0;                                                                          \
    for (int r = 0; r < RT; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();                        \
    for (long kb = 0; kb < K; kb += QB) {                                                        \
        const uint8_t *blk = Q8_BLOCK(G, GP, kb);                                                \
        PREFETCH_GROUP(blk, Q8_PANEL_BLOCK)                                                      \
        __m512 s[2];                                                                             \
        for (int v = 0; v < 2; v++) s[v] = _mm512_loadu_ps((const float *)blk + 2 * v * PW);     \
        for (long k = kb; k < kb + QB; k++) {                                                    \
            __m512 w[2];                                                                         \
            for (int v = 0; v < 2; v++) {                                                        \
                __m128i qq = _mm_loadu_si128((const __m128i *)Q8_AT(blk, GP, k - kb, 2 * v));    \
                w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qq)), s[v]);        \
            }                                                                                    \
            for (int r = 0; r < RT; r++) {                                                       \
                __m512 b = _mm512_set1_ps(x[r * K + k]);                                         \
                for (int v = 0; v < 2; v++) a[r][v] = _mm512_fmadd_ps(b, w[v], a[r][v]);         \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    STORE_WIDE(RT, 2)                                                                            \
}
WIDE_Q8_TILE(1) WIDE_Q8_TILE(2) WIDE_Q8_TILE(3) WIDE_Q8_TILE(4)
WIDE_Q8_TILE(5) WIDE_Q8_TILE(6) WIDE_Q8_TILE(7) WIDE_Q8_TILE(8)
WIDE_Q4_TILE(1) WIDE_Q4_TILE(2) WIDE_Q4_TILE(3) WIDE_Q4_TILE(4)
WIDE_Q4_TILE(5) WIDE_Q4_TILE(6) WIDE_Q4_TILE(7) WIDE_Q4_TILE(8)
/* A whole group of GP panels in one wide tile, whatever its rows (up to 8 x 2 zmm sums). */
#define WIDE_BLOCK_GROUP(KIND, ARGS)                                                             \
    if (n == GP) {                                                                               \
        switch (rows) {                                                                          \
            case 1: KIND##_w1x4(xr, K, ARGS(0), yr, ldy); break;                                 \
            case 2: KIND##_w2x4(xr, K, ARGS(0), yr, ldy); break;                                 \
            case 3: KIND##_w3x4(xr, K, ARGS(0), yr, ldy); break;                                 \
            case 4: KIND##_w4x4(xr, K, ARGS(0), yr, ldy); break;                                 \
            case 5: KIND##_w5x4(xr, K, ARGS(0), yr, ldy); break;                                 \
            case 6: KIND##_w6x4(xr, K, ARGS(0), yr, ldy); break;                                 \
            case 7: KIND##_w7x4(xr, K, ARGS(0), yr, ldy); break;                                 \
            default: KIND##_w8x4(xr, K, ARGS(0), yr, ldy); break;                                \
        }                                                                                        \
        p = n;                                                                                   \
    }
#define WIDE_GROUP(KIND) WIDE_BLOCK_GROUP(KIND, FLOAT_ARGS)
#define WIDE_Q4_GROUP(KIND) WIDE_BLOCK_GROUP(q4, Q4_ARGS)
#define WIDE_Q8_GROUP(KIND) WIDE_BLOCK_GROUP(q8, Q8_ARGS)
#else
#define WIDE_GROUP(KIND)
#define WIDE_Q4_GROUP(KIND)
#define WIDE_Q8_GROUP(KIND)
#endif

/* The same over q8_0 panels: NP panels from j0 of a group of gp (Q8_0 LAYOUT), each weight vector
 * dequantized once per k and shared by the rows. */
#define Q8_TILE(RT, NP)                                                                          \
static inline void q8_##RT##x##NP(const float *x, long K, const uint8_t *G, long gp, long j0, float *y, long ldy) { \
    __m256 a[RT][NP];                                                                            \
    ACC_ZERO(RT, NP)                                                                             \
    for (long kb = 0; kb < K; kb += QB) {                                                        \
        const uint8_t *blk = Q8_BLOCK(G, gp, kb);                                                \
        __m256 s[NP];                                                                            \
        for (int p = 0; p < NP; p++) s[p] = _mm256_loadu_ps((const float *)blk + (j0 + p) * PW); \
        for (long k = kb; k < kb + QB; k++) {                                                    \
            __m256 w[NP];                                                                        \
            for (int p = 0; p < NP; p++) {                                                       \
                __m128i q = _mm_loadl_epi64((const __m128i *)Q8_AT(blk, gp, k - kb, j0 + p));    \
                w[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s[p]);         \
            }                                                                                    \
            ACC_FMA(RT, NP, x + r * K + k, w)                                                    \
        }                                                                                        \
    }                                                                                            \
    ACC_STORE(RT, NP)                                                                            \
}

/* The same over q4_1 panels: NP panels from j0 of a group of gp (Q4_1 LAYOUT). Each pair of weight
 * vectors is dequantized once per k and shared by the rows. */
#define Q4_TILE(RT, NP)                                                                          \
static inline void q4_##RT##x##NP(const float *x, long K, const uint8_t *G, long gp, long j0, float *y, long ldy) { \
    __m256 a[RT][NP];                                                                            \
    const __m256i low = _mm256_set1_epi32(15);                                                   \
    ACC_ZERO(RT, NP)                                                                             \
    for (long kb = 0; kb < K; kb += QB) {                                                        \
        const uint8_t *blk = Q4_BLOCK(G, gp, kb);                                                \
        const uint16_t *dm = (const uint16_t *)blk;                                              \
        __m256 d[NP], m[NP];                                                                     \
        for (int p = 0; p < NP; p++) d[p] = LOAD_F16(dm, (j0 + p) * PW), m[p] = LOAD_F16(dm, (gp + j0 + p) * PW); \
        for (long k = kb; k < kb + QB; k += 2) {                                                 \
            __m256 w0[NP], w1[NP];                                                               \
            for (int p = 0; p < NP; p++) {                                                       \
                __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)Q4_PAIR(blk, gp, k - kb, j0 + p))); \
                w0[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), d[p], m[p]);  \
                w1[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d[p], m[p]);   \
            }                                                                                    \
            for (int r = 0; r < RT; r++) {                                                       \
                __m256 b0 = _mm256_broadcast_ss(x + r * K + k), b1 = _mm256_broadcast_ss(x + r * K + k + 1); \
                for (int p = 0; p < NP; p++) a[r][p] = _mm256_fmadd_ps(b0, w0[p], a[r][p]);      \
                for (int p = 0; p < NP; p++) a[r][p] = _mm256_fmadd_ps(b1, w1[p], a[r][p]);      \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    ACC_STORE(RT, NP)                                                                            \
}

F32_TILE(1, 4) F32_TILE(2, 4) F32_TILE(3, 2) F32_TILE(4, 2)
F32_TILE(1, 1) F32_TILE(2, 1) F32_TILE(3, 1) F32_TILE(4, 1)
F32_TILE(5, 1) F32_TILE(6, 1) F32_TILE(7, 1) F32_TILE(8, 1)
F16_TILE(1, 8) F16_TILE(1, 4) F16_TILE(2, 4) F16_TILE(3, 2) F16_TILE(4, 2)
F16_TILE(1, 1) F16_TILE(2, 1) F16_TILE(3, 1) F16_TILE(4, 1)
F16_TILE(5, 1) F16_TILE(6, 1) F16_TILE(7, 1) F16_TILE(8, 1)
Q8_TILE(1, 4) Q8_TILE(2, 2)
Q8_TILE(1, 1) Q8_TILE(2, 1) Q8_TILE(3, 1) Q8_TILE(4, 1)
Q8_TILE(5, 1) Q8_TILE(6, 1) Q8_TILE(7, 1) Q8_TILE(8, 1)
Q4_TILE(1, 4) Q4_TILE(2, 2)
Q4_TILE(1, 1) Q4_TILE(2, 1) Q4_TILE(3, 1) Q4_TILE(4, 1)
Q4_TILE(5, 1) Q4_TILE(6, 1) Q4_TILE(7, 1) Q4_TILE(8, 1)

/* Rows [r, end) (at most 8 a pass) against panels [p, p + n) of one group (n <= GP). */
#define GROUP_ROWS(KIND, ARGS, N2, N4, WIDE)                                                     \
    for (long r = r0; r < end;) {                                                                \
        long rows = end - r < 8 ? end - r : 8;                                                   \
        const float *xr = x + r * K;                                                             \
        float *yr = y + r * ldy + p0 * PW;                                                       \
        long p = 0;                                                                              \
        WIDE(KIND)                                                                               \
        if (rows == 1) for (; p + 4 <= n; p += 4) KIND##_1x4(xr, K, ARGS(p), yr + p * PW, ldy);  \
        if (rows == 2) for (; p + N2 <= n; p += N2) KIND##_2x##N2(xr, K, ARGS(p), yr + p * PW, ldy); \
        if (rows == 3) for (; p + N4 <= n; p += N4) KIND##_3x##N4(xr, K, ARGS(p), yr + p * PW, ldy); \
        if (rows == 4) for (; p + N4 <= n; p += N4) KIND##_4x##N4(xr, K, ARGS(p), yr + p * PW, ldy); \
        for (; p < n; p++) switch (rows) {                                                       \
            case 1: KIND##_1x1(xr, K, ARGS(p), yr + p * PW, ldy); break;                         \
            case 2: KIND##_2x1(xr, K, ARGS(p), yr + p * PW, ldy); break;                         \
            case 3: KIND##_3x1(xr, K, ARGS(p), yr + p * PW, ldy); break;                         \
            case 4: KIND##_4x1(xr, K, ARGS(p), yr + p * PW, ldy); break;                         \
            case 5: KIND##_5x1(xr, K, ARGS(p), yr + p * PW, ldy); break;                         \
            case 6: KIND##_6x1(xr, K, ARGS(p), yr + p * PW, ldy); break;                         \
            case 7: KIND##_7x1(xr, K, ARGS(p), yr + p * PW, ldy); break;                         \
            default: KIND##_8x1(xr, K, ARGS(p), yr + p * PW, ldy); break;                        \
        }                                                                                        \
        r += rows;                                                                               \
    }

/* x [M, K] row-major into xp: each group of up to 8 rows [8g, 8g + n) as [K][n] at xp + 8g * K, so a
 * tile's broadcasts for one k are adjacent (one cache line) instead of n streams K apart. A
 * group of one row is the row itself. */
static void pack_rows(const float *x, long M, long K, float *xp) {
    for (long g = 0; g < M; g += 8) {
        long n = M - g < 8 ? M - g : 8;
        const float *src = x + g * K;
        float *dst = xp + g * K;
        for (long k = 0; k < K; k++)
            for (long r = 0; r < n; r++) dst[k * n + r] = src[r * K + k];
    }
}

#define FLOAT_ARGS(p) (P + (p0 + (p)) * K * PW)
#define Q4_ARGS(p) Q4_GROUP(Q, g, K), n, (p)
#define Q8_ARGS(p) Q8_GROUP(Q, g, K), n, (p)

/* Every product's loop: blocks of RB rows, each against every group of panels, the groups shared
 * out to the threads by SCHEDULE (static for float32 and fp16, guided for the block formats: below). */
#define OMP(directive) _Pragma(#directive)
#define PANEL_GROUPS(KIND, ARGS, N2, N4, WIDE, SCHEDULE)                                         \
    long groups = (panels + GP - 1) / GP;                                                        \
    OMP(omp parallel num_threads(threads))                                                       \
    for (long r0 = 0; r0 < M; r0 += RB) {                                                        \
        long end = M - r0 < RB ? M : r0 + RB;                                                    \
        OMP(omp for schedule(SCHEDULE))                                                          \
        for (long g = 0; g < groups; g++) {                                                      \
            long p0 = g * GP, n = panels - p0 < GP ? panels - p0 : GP;                           \
            GROUP_ROWS(KIND, ARGS, N2, N4, WIDE)                                                 \
        }                                                                                        \
    }

/* The float32 and fp16 products: the rows repacked, then blocks of RB rows against every group. */
#define FLOAT_PANELS(KIND)                                                                       \
    if (xp != x) pack_rows(x, M, K, xp);                                                         \
    x = xp;                                                                                      \
    PANEL_GROUPS(KIND, FLOAT_ARGS, 4, 2, WIDE_GROUP, static)

/* x [M, K] contiguous; xp room for M * K floats (the rows repacked, see pack_rows); P [panels][K][8];
 * y rows of stride ldy (>= panels * 8). */
void f32_panels(const float *x, long M, long K, float *xp, const float *P, long panels, float *y, long ldy,
                int threads) {
    FLOAT_PANELS(f32)
}

/* The same with P [panels][K][8] IEEE half-precision weights (F16C), computed in float32. One row
 * takes 8 panels at a time: its 1 x 4 tile converts too little per broadcast to keep the stream
 * busy (1 x 8: 9% faster a sweep of the model's matrices, the 576-wide ones split 5:4 between two
 * threads included). Each output is still one FMA chain in k order: the same bits as in a group of 4. */
void f16_panels(const float *x, long M, long K, float *xp, const uint16_t *P, long panels, float *y, long ldy,
                int threads) {
    if (M == 1) {
        long groups = (panels + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long g = 0; g < groups; g++) {
            long p = g * 8;
#ifdef __AVX512F__
            if (p + 8 <= panels) f16_w1x8(x, K, P + p * K * PW, y + p * PW, ldy);
#else
            if (p + 8 <= panels) f16_1x8(x, K, P + p * K * PW, y + p * PW, ldy);
#endif
            else for (; p < panels; p++) f16_1x1(x, K, P + p * K * PW, y + p * PW, ldy);
        }
        return;
    }
    FLOAT_PANELS(f16)
}

/* The block formats' groups go to the threads in shrinking runs (OpenMP's guided schedule: half
 * of what is left, then half of the rest, ...), not in two fixed halves. In a serving process the
 * requests' threads and the OS take a core from the step now and then, and with fixed halves
 * the other thread then waited at the region's end (measured: docs/history.md, "The Zen 4 EPYC,
 * a later session: two prefetches"). The runs stay long, so a thread still reads consecutive
 * groups, one stream (BLOCKS_AHEAD); each group's arithmetic is the same on either thread: the
 * same bits. */

/* Q: the panels' Q8_0 groups (Q8_0 LAYOUT); K a multiple of 32. */
void q8_0_panels(const float *x, long M, long K, const uint8_t *Q, long panels, float *y, long ldy, int threads) {
    PANEL_GROUPS(q8, Q8_ARGS, 2, 1, WIDE_Q8_GROUP, guided)  /* q8_0's scales take registers: narrower tiles */
}

/* Q: the panels' Q4_1 groups (Q4_1 LAYOUT); K a multiple of 32. */
void q4_1_panels(const float *x, long M, long K, const uint8_t *Q, long panels, float *y, long ldy, int threads) {
    PANEL_GROUPS(q4, Q4_ARGS, 2, 1, WIDE_Q4_GROUP, guided)
}

/* q4_1 panels laid back out as a dense float32 [panels * 8, K] matrix (row n the weights of output n),
 * for MKL's GEMM over a long prompt chunk (panel_kernels.UNPACK_ROWS): the values the tiles multiply by. */
void q4_1_unpack(const uint8_t *Q, long panels, long K, float *out, int threads) {
    const __m256i low = _mm256_set1_epi32(15);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < panels; p++) {
        long g = p / GP, j = p % GP, gp = panels - g * GP < GP ? panels - g * GP : GP;
        const uint8_t *G = Q4_GROUP(Q, g, K);
        float block[QB][PW];
        for (long kb = 0; kb < K; kb += QB) {
            const uint8_t *blk = Q4_BLOCK(G, gp, kb);
            const uint16_t *dm = (const uint16_t *)blk;
            __m256 d = LOAD_F16(dm, j * PW), m = LOAD_F16(dm, (gp + j) * PW);
            for (long i = 0; i < QB; i += 2) {
                __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)Q4_PAIR(blk, gp, i, j)));
                _mm256_storeu_ps(block[i], _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low)), d, m));
                _mm256_storeu_ps(block[i + 1], _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d, m));
            }
            for (long c = 0; c < PW; c++)
                for (long i = 0; i < QB; i++) out[(p * PW + c) * K + kb + i] = block[i][c];
        }
    }
}
