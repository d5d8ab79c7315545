/* Projections over "panels": y[M, N] = x[M, K] @ W, with W stored as N/16 panels of [K][16].
 *
 * A decode step multiplies each weight by a few rows, so the weight must stream from memory
 * once for all of them. A panel is 16 output columns over the whole input, contiguous, so the
 * hardware prefetcher follows it; one pass over a panel keeps 4 rows x 16 columns of sums in
 * registers, and further rows re-read the panel from L1/L2, not from memory. Every output is
 * one FMA chain over k = 0..K-1 in order, whatever M and the thread count, so a row's product is
 * the same bits alone or beside others (batch invariance by construction).
 *
 * q8_0 panels hold int8 weights and one float32 scale per 32 inputs and column (llama.cpp's
 * Q8_0 blocks, with a float32 scale): a quarter of float32's bytes. Each weight vector is
 * dequantized once per k and shared by every row, so the activations stay float32.
 *
 * Built by minengine/model/panel_kernels.py with -O3 -mavx2 -mfma -fopenmp; OpenMP is the
 * runtime torch already loaded (same soname), and the thread count is the caller's.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define PW 16   /* columns per panel: two AVX2 vectors */
#define RB 64   /* rows per block: a block of x stays in L2 while every panel passes over it */
#define QB 32   /* inputs per q8_0 scale */

#define F32_TILE(RT)                                                                            \
static inline void f32_tile_##RT(const float *x, long K, const float *P, float *y, long ldy) { \
    __m256 a0[RT], a1[RT];                                                                      \
    for (int r = 0; r < RT; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }  \
    for (long k = 0; k < K; k++) {                                                              \
        __m256 w0 = _mm256_loadu_ps(P + k * PW), w1 = _mm256_loadu_ps(P + k * PW + 8);          \
        for (int r = 0; r < RT; r++) {                                                          \
            __m256 b = _mm256_broadcast_ss(x + r * K + k);                                      \
            a0[r] = _mm256_fmadd_ps(b, w0, a0[r]);                                              \
            a1[r] = _mm256_fmadd_ps(b, w1, a1[r]);                                              \
        }                                                                                       \
    }                                                                                           \
    for (int r = 0; r < RT; r++) {                                                              \
        _mm256_storeu_ps(y + r * ldy, a0[r]);                                                   \
        _mm256_storeu_ps(y + r * ldy + 8, a1[r]);                                               \
    }                                                                                           \
}
F32_TILE(1)
F32_TILE(2)
F32_TILE(3)
F32_TILE(4)
F32_TILE(5)
F32_TILE(6)

/* Rows r0.. of a row block against one float32 panel, six at a time (12 sums in registers). */
static inline void f32_panel_rows(const float *x, long r, long end, long K, const float *Pp, float *y, long ldy) {
    while (r < end) {
        long left = end - r;
        const float *xr = x + r * K;
        float *yr = y + r * ldy;
        switch (left >= 6 ? 6 : left) {
            case 6: f32_tile_6(xr, K, Pp, yr, ldy); break;
            case 5: f32_tile_5(xr, K, Pp, yr, ldy); break;
            case 4: f32_tile_4(xr, K, Pp, yr, ldy); break;
            case 3: f32_tile_3(xr, K, Pp, yr, ldy); break;
            case 2: f32_tile_2(xr, K, Pp, yr, ldy); break;
            default: f32_tile_1(xr, K, Pp, yr, ldy); break;
        }
        r += left >= 6 ? 6 : left;
    }
}

#define Q8_TILE(RT)                                                                             \
static inline void q8_tile_##RT(const float *x, long K, const int8_t *Q, const float *S, float *y, long ldy) { \
    __m256 a0[RT], a1[RT];                                                                      \
    for (int r = 0; r < RT; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }  \
    for (long kb = 0; kb < K; kb += QB) {                                                       \
        const float *s = S + (kb / QB) * PW;                                                    \
        __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);                            \
        for (long k = kb; k < kb + QB; k++) {                                                   \
            __m128i q = _mm_loadu_si128((const __m128i *)(Q + k * PW));                         \
            __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s0);         \
            __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), s1); \
            for (int r = 0; r < RT; r++) {                                                      \
                __m256 b = _mm256_broadcast_ss(x + r * K + k);                                  \
                a0[r] = _mm256_fmadd_ps(b, w0, a0[r]);                                          \
                a1[r] = _mm256_fmadd_ps(b, w1, a1[r]);                                          \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int r = 0; r < RT; r++) {                                                              \
        _mm256_storeu_ps(y + r * ldy, a0[r]);                                                   \
        _mm256_storeu_ps(y + r * ldy + 8, a1[r]);                                               \
    }                                                                                           \
}
Q8_TILE(1)
Q8_TILE(2)
Q8_TILE(3)
Q8_TILE(4)

/* x [M, K] contiguous; P [panels][K][16]; y rows of stride ldy (>= panels * 16). */
void f32_panels(const float *x, long M, long K, const float *P, long panels, float *y, long ldy, int threads) {
#pragma omp parallel num_threads(threads)
    for (long r0 = 0; r0 < M; r0 += RB) {
        long end = M - r0 < RB ? M : r0 + RB;
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) f32_panel_rows(x, r0, end, K, P + p * K * PW, y + p * PW, ldy);
    }
}

static void dequantize_panel(long K, const int8_t *Q, const float *S, float *out) {
    for (long kb = 0; kb < K; kb += QB) {
        const float *s = S + (kb / QB) * PW;
        __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        for (long k = kb; k < kb + QB; k++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(Q + k * PW));
            _mm256_storeu_ps(out + k * PW, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s0));
            _mm256_storeu_ps(out + k * PW + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), s1));
        }
    }
}

/* Q [panels][K][16] int8; S [panels][K/32][16] float32; K a multiple of 32.
 * Up to Q8_DIRECT rows dequantize in registers as they go; more rows dequantize each panel once
 * into a float32 copy (in L1/L2) and run the float32 tiles over it: the same products (w = q*s
 * rounded to float32, then one FMA chain per output), so the bits do not depend on M either. */
#define Q8_DIRECT 4
void q8_0_panels(const float *x, long M, long K, const int8_t *Q, const float *S, long panels, float *y, long ldy,
                 int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *panel = M > Q8_DIRECT ? (float *)aligned_alloc(64, (size_t)K * PW * sizeof(float)) : 0;
        for (long r0 = 0; r0 < M; r0 += RB) {
            long end = M - r0 < RB ? M : r0 + RB;
#pragma omp for schedule(static)
            for (long p = 0; p < panels; p++) {
                const int8_t *Qp = Q + p * K * PW;
                const float *Sp = S + p * (K / QB) * PW;
                float *yp = y + p * PW;
                if (panel) {
                    dequantize_panel(K, Qp, Sp, panel);
                    f32_panel_rows(x, r0, end, K, panel, yp, ldy);
                    continue;
                }
                for (long r = r0; r < end;) {
                    long left = end - r;
                    float *yr = yp + r * ldy;
                    const float *xr = x + r * K;
                    if (left >= 4) { q8_tile_4(xr, K, Qp, Sp, yr, ldy); r += 4; }
                    else if (left == 3) { q8_tile_3(xr, K, Qp, Sp, yr, ldy); r += 3; }
                    else if (left == 2) { q8_tile_2(xr, K, Qp, Sp, yr, ldy); r += 2; }
                    else { q8_tile_1(xr, K, Qp, Sp, yr, ldy); r += 1; }
                }
            }
        }
        free(panel);
    }
}
