/* Softmax over the rows of a float32 matrix, in place: the step between a consumer's scores and
 * its context (softmax.pyx).
 *
 *   t_i = s_i * scale;  m = max_i t_i;  e_i = exp(t_i - m);  w_i = e_i / sum_i e_i
 *
 * Each step is numpy's float32 step (the product and the division correctly rounded), except:
 *   - exp is computed here (kvq_sm_exp1 below): Cody-Waite reduction x = n ln 2 + r and a
 *     degree-7 polynomial for e^r on |r| <= ln(2)/2, with the constants of Cephes' expf
 *     (S. L. Moshier, "Methods and Programs for Mathematical Functions", 1989); no FMA, so every
 *     path and compiler gives the same bits. Results below FLT_MIN are rounded once to the
 *     subnormal (2^n is applied as 2^(n+32) and then 2^-32); x < -104 gives 0.
 *   - the sum is in a fixed order, independent of the thread count: a row is cut in chunks of
 *     KVQ_SM_CHUNK elements; in a chunk, lane j (of 16) adds the elements j, j + 16, ... in order
 *     from +0 and the lanes are combined by the tree (j + j+8, j + j+4, j + j+2, j + j+1); the
 *     chunks' sums are added in chunk order, starting from the first.
 * NaN and infinities behave as in numpy's softmax: a row with a NaN, or with +inf, or whose
 * entries are all -inf, becomes NaN; -inf entries of other rows get weight 0.
 *
 * Paths: the kernels are written once over GCC/Clang vector extensions (softmax_lanes.h) and
 * compiled at 16, 8 and 4 lanes (AVX-512, AVX2, the baseline); without the extensions a scalar
 * loop does the same operations. */
#ifndef KVQ_SOFTMAX_H
#define KVQ_SOFTMAX_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "tree16.h"

#define KVQ_SM_CHUNK 4096                 /* elements per unit of work (a multiple of 16) */

#define KVQ_SM_LOWEST (-104.0f)           /* exp(x) < 2^-150 below: 0 */
#define KVQ_SM_LOG2E 1.44269504088896341f
#define KVQ_SM_ROUNDER 12582912.0f        /* 1.5 * 2^23: adding it rounds to an integer */
#define KVQ_SM_LN2_HI 0.693359375f        /* ln 2 = HI + LO; n * HI is exact for |n| < 2^15 */
#define KVQ_SM_LN2_LO (-2.12194440e-4f)
#define KVQ_SM_P0 1.9875691500e-4f
#define KVQ_SM_P1 1.3981999507e-3f
#define KVQ_SM_P2 8.3334519073e-3f
#define KVQ_SM_P3 4.1665795894e-2f
#define KVQ_SM_P4 1.6666665459e-1f
#define KVQ_SM_P5 5.0000001201e-1f
#define KVQ_SM_SHIFT 32u                  /* 2^(n + 32) is a normal number for n >= -150 */
#define KVQ_SM_UNSHIFT 0x1p-32f

#if defined(__GNUC__) || defined(__clang__)
#define KVQ_SM_INLINE static inline __attribute__((always_inline))
#else
#define KVQ_SM_INLINE static inline
#endif

/* exp(x) for x <= 0, -inf or NaN (one element; the vector kernels do the same per lane). */
KVQ_SM_INLINE float kvq_sm_exp1(float x)
{
    const int under = x < KVQ_SM_LOWEST;
    const float xc = under ? KVQ_SM_LOWEST : x;
    const float v = xc * KVQ_SM_LOG2E + KVQ_SM_ROUNDER;
    const float nf = v - KVQ_SM_ROUNDER;
    uint32_t vb, rb, eb;
    const float rounder = KVQ_SM_ROUNDER;
    memcpy(&vb, &v, 4);
    memcpy(&rb, &rounder, 4);
    const float r = (xc - nf * KVQ_SM_LN2_HI) - nf * KVQ_SM_LN2_LO;
    float p = KVQ_SM_P0;
    p = p * r + KVQ_SM_P1;
    p = p * r + KVQ_SM_P2;
    p = p * r + KVQ_SM_P3;
    p = p * r + KVQ_SM_P4;
    p = p * r + KVQ_SM_P5;
    p = (p * (r * r) + r) + 1.0f;
    eb = ((vb - rb) + (127u + KVQ_SM_SHIFT)) << 23;
    float up;
    memcpy(&up, &eb, 4);
    const float e = (p * up) * KVQ_SM_UNSHIFT;
    return under ? 0.0f : e;
}

#if !defined(KVQ_NO_VECTOR_EXT) && ((defined(__GNUC__) && __GNUC__ >= 12) || defined(__clang__))
#define KVQ_SM_VEC 1
#else
#define KVQ_SM_VEC 0
#endif
/* the 8- and 16-lane instances carry their own targets (as rowops.h's encoders) */
#if KVQ_SM_VEC && defined(__GNUC__) && (defined(__x86_64__) || defined(_M_X64))
#define KVQ_SM_X86 1
#else
#define KVQ_SM_X86 0
#endif

#if KVQ_SM_VEC
#define KVQ_SN(x) x##_w4
#define KVQ_SW 4
#define KVQ_STARGET
#include "softmax_lanes.h"
#undef KVQ_SN
#undef KVQ_SW
#undef KVQ_STARGET
#endif
#if KVQ_SM_X86
#define KVQ_SN(x) x##_w8
#define KVQ_SW 8
#define KVQ_STARGET __attribute__((target("avx2")))
#include "softmax_lanes.h"
#undef KVQ_SN
#undef KVQ_SW
#undef KVQ_STARGET
#define KVQ_SN(x) x##_w16
#define KVQ_SW 16
#define KVQ_STARGET __attribute__((target("avx512f")))
#include "softmax_lanes.h"
#undef KVQ_SN
#undef KVQ_SW
#undef KVQ_STARGET
#endif

#if !KVQ_SM_VEC
/* The scalar kernels: the same operations as softmax_lanes.h's, element by element. */
static void kvq_sm_scale_max_w1(float *s, int64_t n, float scale, float *max_out, int *nan_out)
{
    float best = -INFINITY;
    int any_nan = 0;
    for (int64_t i = 0; i < n; i++) {
        const float t = s[i] * scale;
        s[i] = t;
        if (t > best)
            best = t;
        any_nan |= t != t;
    }
    *max_out = best;
    *nan_out = any_nan;
}

static void kvq_sm_exp_sum_w1(float *s, int64_t n, float mx, float lanes[16])
{
    for (int j = 0; j < 16; j++)
        lanes[j] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float e = kvq_sm_exp1(s[i] - mx);
        s[i] = e;
        lanes[i & 15] = lanes[i & 15] + e;
    }
}

static void kvq_sm_divide_w1(float *s, int64_t n, float total)
{
    for (int64_t i = 0; i < n; i++)
        s[i] = s[i] / total;
}
#endif

/* The row kernels of one path: 0 the baseline, 1 AVX2, 2 AVX-512 (the caller passes one the CPU
 * runs); a build without them takes the one it has. */
typedef struct {
    void (*scale_max)(float *s, int64_t n, float scale, float *max_out, int *nan_out);
    void (*exp_sum)(float *s, int64_t n, float mx, float lanes[16]);
    void (*divide)(float *s, int64_t n, float total);
} kvq_sm_kernels;

static kvq_sm_kernels kvq_sm_pick(int path)
{
    kvq_sm_kernels K;
#if KVQ_SM_X86
    if (path >= 2) {
        K.scale_max = kvq_sm_scale_max_w16; K.exp_sum = kvq_sm_exp_sum_w16;
        K.divide = kvq_sm_divide_w16;
        return K;
    }
    if (path == 1) {
        K.scale_max = kvq_sm_scale_max_w8; K.exp_sum = kvq_sm_exp_sum_w8;
        K.divide = kvq_sm_divide_w8;
        return K;
    }
#endif
    (void)path;
#if KVQ_SM_VEC
    K.scale_max = kvq_sm_scale_max_w4; K.exp_sum = kvq_sm_exp_sum_w4; K.divide = kvq_sm_divide_w4;
#else
    K.scale_max = kvq_sm_scale_max_w1; K.exp_sum = kvq_sm_exp_sum_w1; K.divide = kvq_sm_divide_w1;
#endif
    return K;
}

/* Pass 1 on elements [a, b) of one row (a a multiple of 16): scale, max, NaN. A last group
 * shorter than 16 goes through a buffer padded with copies of its first element (they change
 * neither the max nor the NaN flag). */
static void kvq_sm_chunk_scale_max(const kvq_sm_kernels *K, float *s, int64_t a, int64_t b,
                                   float scale, float *mx, int *nan)
{
    const int64_t full = a + ((b - a) & ~(int64_t)15);
    float m1 = -INFINITY, m2 = -INFINITY;
    int n1 = 0, n2 = 0;
    if (full > a)
        K->scale_max(s + a, full - a, scale, &m1, &n1);
    if (b > full) {
        float buf[16];
        int64_t k;
        for (k = 0; k < 16; k++) buf[k] = full + k < b ? s[full + k] : s[full];
        K->scale_max(buf, 16, scale, &m2, &n2);
        for (k = 0; k < b - full; k++) s[full + k] = buf[k];
    }
    *mx = m2 > m1 ? m2 : m1;
    *nan = n1 | n2;
}

/* Pass 2 on elements [a, b): exp and the chunk's sum. A short last group is padded with -inf
 * (exp gives +0, which leaves a lane's sum as it was). */
static float kvq_sm_chunk_exp_sum(const kvq_sm_kernels *K, float *s, int64_t a, int64_t b,
                                  float mx)
{
    const int64_t full = a + ((b - a) & ~(int64_t)15);
    float lanes[16];
    int64_t k;
    for (k = 0; k < 16; k++) lanes[k] = 0.0f;
    if (full > a)
        K->exp_sum(s + a, full - a, mx, lanes);
    if (b > full) {
        float buf[16], more[16];
        for (k = 0; k < 16; k++) buf[k] = full + k < b ? s[full + k] : -INFINITY;
        K->exp_sum(buf, 16, mx, more);
        for (k = 0; k < 16; k++) lanes[k] = lanes[k] + more[k];
        for (k = 0; k < b - full; k++) s[full + k] = buf[k];
    }
    return kvq_tree16(lanes);
}

static void kvq_sm_chunk_divide(const kvq_sm_kernels *K, float *s, int64_t a, int64_t b,
                                float total)
{
    const int64_t full = a + ((b - a) & ~(int64_t)15);
    if (full > a)
        K->divide(s + a, full - a, total);
    for (int64_t k = full; k < b; k++)
        s[k] = s[k] / total;
}

/* Softmax of each of the m rows of S (row stride n) in place, on up to n_threads threads.
 * Returns 0, or -1 when memory for the chunks' partials cannot be had (S untouched). */
static int kvq_softmax_rows(float *S, int64_t m, int64_t n, float scale, int n_threads, int path)
{
    const int64_t per_row = (n + KVQ_SM_CHUNK - 1) / KVQ_SM_CHUNK, items = m * per_row;
    int64_t it, r, c;
    if (items == 0)
        return 0;
    const kvq_sm_kernels K = kvq_sm_pick(path);
    float *cmax = (float *)malloc((size_t)items * 2 * sizeof(float));
    int *cnan = (int *)malloc((size_t)items * sizeof(int));
    float *rowv = (float *)malloc((size_t)m * sizeof(float));
    if (cmax == NULL || cnan == NULL || rowv == NULL) {
        free(cmax); free(cnan); free(rowv);
        return -1;
    }
    float *csum = cmax + items;
    if (n_threads > items)
        n_threads = (int)items;
    if (n_threads < 1)
        n_threads = 1;
    (void)n_threads;   /* without OpenMP the loops below run on the calling thread */

#pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (it = 0; it < items; it++) {
        const int64_t row = it / per_row, a = (it % per_row) * KVQ_SM_CHUNK;
        const int64_t b = a + KVQ_SM_CHUNK < n ? a + KVQ_SM_CHUNK : n;
        kvq_sm_chunk_scale_max(&K, S + row * n, a, b, scale, &cmax[it], &cnan[it]);
    }
    for (r = 0; r < m; r++) {
        float mx = -INFINITY;
        int nan = 0;
        for (c = 0; c < per_row; c++) {
            if (cmax[r * per_row + c] > mx) mx = cmax[r * per_row + c];
            nan |= cnan[r * per_row + c];
        }
        rowv[r] = nan ? NAN : mx;
    }
#pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (it = 0; it < items; it++) {
        const int64_t row = it / per_row, a = (it % per_row) * KVQ_SM_CHUNK;
        const int64_t b = a + KVQ_SM_CHUNK < n ? a + KVQ_SM_CHUNK : n;
        csum[it] = kvq_sm_chunk_exp_sum(&K, S + row * n, a, b, rowv[row]);
    }
    for (r = 0; r < m; r++) {
        float total = csum[r * per_row];
        for (c = 1; c < per_row; c++)
            total = total + csum[r * per_row + c];
        rowv[r] = total;
    }
#pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (it = 0; it < items; it++) {
        const int64_t row = it / per_row, a = (it % per_row) * KVQ_SM_CHUNK;
        const int64_t b = a + KVQ_SM_CHUNK < n ? a + KVQ_SM_CHUNK : n;
        kvq_sm_chunk_divide(&K, S + row * n, a, b, rowv[row]);
    }
    free(cmax); free(cnan); free(rowv);
    return 0;
}

#endif /* KVQ_SOFTMAX_H */
