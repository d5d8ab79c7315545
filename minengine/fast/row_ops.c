/* A block's small row operations in one call each: RMSNorm, the rotary embedding, SiLU-gating.
 *
 * Between its projections a decode step runs, per layer, two RMSNorms and one rotation of q
 * and k: a few thousand flops each, yet through torch four or five dispatches and an
 * allocation each, about 10% of a one-row step on the CPU (py-spy, fp16 panels). Here each is
 * one call over every row of the step.
 *
 * Rows are addressed as [T][H][d] with strides for T and H (d contiguous), so q and k heads
 * viewed inside a fused q/k/v row need no copy. Every row is computed alone, in one fixed
 * order, whatever T, H and the rows beside it: a row's result is the same bits alone or in a
 * batch. A decode step's rows are too small to share out; a prompt's (SHARED_ROWS or more) go
 * to `threads` threads, each row still computed alone, so the same bits whichever thread takes it.
 *
 * Built with panel_rows.c by minengine/fast/cpu_kernels.py.
 */
#include <immintrin.h>
#include <math.h>

#include "exp_le0.h"

/* Rows from which a call shares them out: below, a team's wake-up costs more than the rows. They go
 * out in runs of ROW_RUN, one run at a time: the two cores of a shared host can differ 2x in rate
 * (scripts/core_rates), and an even split then keeps the faster waiting for the slower's half. */
#define SHARED_ROWS 256
#define ROW_RUN 16
/* Whether a call shares its rows out. Otherwise no parallel region opens at all: an `if(0)` region is still
 * a team of one that GNU OpenMP sets up and ends with a barrier and a futex wake, and the C stacks call these
 * row by row from inside their own region (docs/lab/prefill-profile.md, "A futex wake for every row"). */
#define SHARED(threads, T) ((threads) > 1 && (T) >= SHARED_ROWS)

/* y = w * (x * 1 / sqrt(eps + sum(x^2) / d)) per row (Hugging Face's order: normalise, then
 * scale). The sum runs in 8 lanes over d, then the lanes are added in a fixed order. */
static inline void norm_row(const float *x, long t, long H, long d, long sxt, long sxh, const float *w, float eps,
                            float *y, long syt, long syh) {
    for (long h = 0; h < H; h++) {
        const float *xr = x + t * sxt + h * sxh;
        float *yr = y + t * syt + h * syh;
        __m256 acc = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= d; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float lanes[8], sum = 0.0f;
        _mm256_storeu_ps(lanes, acc);
        for (int l = 0; l < 8; l++) sum += lanes[l];
        for (; i < d; i++) sum += xr[i] * xr[i];
        float r = 1.0f / sqrtf(eps + sum / (float)d);
        __m256 vr = _mm256_set1_ps(r);
        for (i = 0; i + 8 <= d; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), vr)));
        for (; i < d; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

void rms_norm_rows(const float *x, long T, long H, long d, long sxt, long sxh, const float *w, float eps,
                   float *y, long syt, long syh, int threads) {
    if (SHARED(threads, T)) {
#pragma omp parallel for schedule(dynamic, ROW_RUN) num_threads(threads)
        for (long t = 0; t < T; t++) norm_row(x, t, H, d, sxt, sxh, w, eps, y, syt, syh);
    } else {
        for (long t = 0; t < T; t++) norm_row(x, t, H, d, sxt, sxh, w, eps, y, syt, syh);
    }
}

/* y = x * cos + swap_halves(x) * signed_sin per head row, cos/signed_sin [T][d] (rope's
 * `rotate`): two products and a sum, each rounded, so the result is torch's `rotate` bit for
 * bit; contraction into a fused multiply-add is switched off for that. x and y must not overlap. */
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#define NO_CONTRACT
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif
NO_CONTRACT static inline void rope_row(const float *x, long t, long H, long d, long sxt, long sxh, const float *cos_t,
                                        const float *sin_t, float *y, long syt, long syh) {
    long half = d / 2;
    const float *c = cos_t + t * d, *s = sin_t + t * d;
    for (long h = 0; h < H; h++) {
        const float *xr = x + t * sxt + h * sxh;
        float *yr = y + t * syt + h * syh;
        for (long i = 0; i < half; i++) yr[i] = xr[i] * c[i] + xr[i + half] * s[i];
        for (long i = half; i < d; i++) yr[i] = xr[i] * c[i] + xr[i - half] * s[i];
    }
}

NO_CONTRACT void rope_rows(const float *x, long T, long H, long d, long sxt, long sxh, const float *cos_t,
                           const float *sin_t, float *y, long syt, long syh, int threads) {
    if (SHARED(threads, T)) {
#pragma omp parallel for schedule(dynamic, ROW_RUN) num_threads(threads)
        for (long t = 0; t < T; t++) rope_row(x, t, H, d, sxt, sxh, cos_t, sin_t, y, syt, syh);
    } else {
        for (long t = 0; t < T; t++) rope_row(x, t, H, d, sxt, sxh, cos_t, sin_t, y, syt, syh);
    }
}

/* out = silu(gate) * up, T rows of n values (row strides sg, su, so; out may be gate): the MLP's
 * gating. silu(g) = g * sigmoid(g), the sigmoid from e^-|g| so the exponential never overflows.
 * Each value on its own: 16 lanes where the build has AVX-512, then 8 (the same operations on each
 * lane, so the same bits in either), a row's tail through the 8 lanes, padded. `silu_mul_row` is
 * also the gating dot8_rows.c applies to a gate/up product's sums where the product gates them
 * itself: one definition, so the same bits either way. */
void silu_mul_row(const float *gate, const float *up, float *out, long n) {
    long i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    const __m512 one16 = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 e = exp16_le0(_mm512_or_ps(g, _mm512_set1_ps(-0.0f)));  /* e^-|g| */
        __m512 inv = _mm512_div_ps(one16, _mm512_add_ps(one16, e));
        /* g's sign bit picks e / (1 + e), as _mm256_blendv_ps does below */
        __m512 sig = _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(g)), inv, _mm512_mul_ps(e, inv));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_loadu_ps(up + i)));
    }
#endif
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8_le0(_mm256_or_ps(g, sign));  /* e^-|g| */
        __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), g);  /* g < 0: e / (1 + e) */
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
    if (i < n) {
        float g[8] = {0}, u[8] = {0}, y[8];
        for (long j = 0; j < n - i; j++) g[j] = gate[i + j], u[j] = up[i + j];
        silu_mul_row(g, u, y, 8);
        for (long j = 0; j < n - i; j++) out[i + j] = y[j];
    }
}

void silu_mul_rows(const float *gate, const float *up, float *out, long T, long n, long sg, long su, long so,
                   int threads) {
    if (SHARED(threads, T)) {
#pragma omp parallel for schedule(dynamic, ROW_RUN) num_threads(threads)
        for (long t = 0; t < T; t++) silu_mul_row(gate + t * sg, up + t * su, out + t * so, n);
    } else {
        for (long t = 0; t < T; t++) silu_mul_row(gate + t * sg, up + t * su, out + t * so, n);
    }
}
