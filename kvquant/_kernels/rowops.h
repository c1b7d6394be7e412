/* Row operations of the rotated codecs (Walsh-Hadamard transform, rotation, sums of squares,
 * nearest levels, packing), in C so that GCC can clone them per instruction set (target_clones:
 * the loader picks AVX-512, AVX2 or the baseline at run time). Every operation is element-wise, a
 * comparison or a reduction in a fixed order, and the build forbids FMA contraction, so all clones
 * give the same bits: they differ in speed only. */
#ifndef KVQ_ROWOPS_H
#define KVQ_ROWOPS_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KVQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVQ_CLONES
#endif

/* Sum of squares in double. The engine adds in index order (kept for compat); otherwise eight
 * interleaved partial sums, combined in a fixed order, let the adds run in parallel. Both orders are
 * fixed, so results never depend on threads or on the instruction set. */
KVQ_CLONES
static double kvq_sum_squares(const float *x, int64_t n, int in_index_order)
{
    int64_t i;
    int k;
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (in_index_order || n % 8) {
        double s = 0.0;
        for (i = 0; i < n; i++)
            s += (double)x[i] * (double)x[i];
        return s;
    }
    for (i = 0; i < n; i += 8)
        for (k = 0; k < 8; k++)
            acc[k] += (double)x[i + k] * (double)x[i + k];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* y = H(D x) (unnormalized, natural order), then y *= inv_sqrt_n, then y *= to_unit: the same
 * float operations, in the same order, as the engine's encoder. */
/* Unnormalized Walsh-Hadamard transform in natural (Sylvester) order, in place: butterflies with
 * h = 1, 2, 4, ... The first three stages stay inside groups of 8 elements; doing them group by
 * group performs exactly the same float operations as stage by stage. */
KVQ_CLONES
static void kvq_fwht(float *y, int64_t n)
{
    int64_t i, j, h = 1, g;
    if (n >= 8) {
        for (g = 0; g < n; g += 8) {
            float a0 = y[g], a1 = y[g + 1], a2 = y[g + 2], a3 = y[g + 3];
            float a4 = y[g + 4], a5 = y[g + 5], a6 = y[g + 6], a7 = y[g + 7];
            float b0 = a0 + a1, b1 = a0 - a1, b2 = a2 + a3, b3 = a2 - a3;
            float b4 = a4 + a5, b5 = a4 - a5, b6 = a6 + a7, b7 = a6 - a7;
            float c0 = b0 + b2, c2 = b0 - b2, c1 = b1 + b3, c3 = b1 - b3;
            float c4 = b4 + b6, c6 = b4 - b6, c5 = b5 + b7, c7 = b5 - b7;
            y[g] = c0 + c4; y[g + 4] = c0 - c4;
            y[g + 1] = c1 + c5; y[g + 5] = c1 - c5;
            y[g + 2] = c2 + c6; y[g + 6] = c2 - c6;
            y[g + 3] = c3 + c7; y[g + 7] = c3 - c7;
        }
        h = 8;
    }
    for (; h < n; h *= 2) {
        for (i = 0; i < n; i += 2 * h) {
            for (j = i; j < i + h; j++) {
                float a = y[j], b = y[j + h];
                y[j] = a + b;
                y[j + h] = a - b;
            }
        }
    }
}

/* y = ((H(D x)) * inv_sqrt_n) * to_unit: the engine's encoder rotation followed by its scaling
 * to unit variance, two separate roundings. */
KVQ_CLONES
static void kvq_rotate_scale_row(const float *x, const float *signs, int64_t n, float inv_sqrt_n,
                                 float to_unit, float *y)
{
    int64_t i;
    for (i = 0; i < n; i++)
        y[i] = x[i] * signs[i];
    kvq_fwht(y, n);
    for (i = 0; i < n; i++)
        y[i] = (y[i] * inv_sqrt_n) * to_unit;
}

/* ---- magnitudes (docs/engine-arithmetic.md §8) ----------------------------------------------
 * KVQ_ROW_LIMIT is the engine's inert threshold, the float literal 3.4e38f = 3.39999995e38 (a
 * little below FLT_MAX): a row whose norm (fp8: amax) is above it is never stored live. The float32
 * butterflies of a row whose largest magnitude is big enough can overflow even below it (partial
 * sums reach sqrt(n) times the norm); such rows are computed on a copy scaled by 2^-64 and scaled
 * back. A power-of-two scale commutes with every rounding away from subnormals, so the result is
 * the same bits as the plain arithmetic wherever the plain arithmetic is finite. */
#define KVQ_ROW_LIMIT 3.4e38f
#define KVQ_PRESCALE 5.42101086242752217e-20f   /* 2^-64 */
#define KVQ_UNSCALE 18446744073709551616.0f      /* 2^64 */

/* 1 when every element is finite. */
KVQ_CLONES
static int kvq_all_finite(const float *y, int64_t n)
{
    int64_t i;
    int ok = 1;
    for (i = 0; i < n; i++)
        ok &= fabsf(y[i]) <= FLT_MAX;
    return ok;
}

/* The largest |y_i| (0 for NaN elements). */
KVQ_CLONES
static float kvq_max_abs(const float *y, int64_t n)
{
    int64_t i;
    float m = 0.0f;
    for (i = 0; i < n; i++) {
        float a = fabsf(y[i]);
        m = a > m ? a : m;
    }
    return m;
}

/* y = ((H(D (x * pre))) * inv_sqrt_n) * to_unit: kvq_rotate_scale_row on the row scaled by pre
 * (2^-64, for rows whose butterflies overflow; the caller scales to_unit to match). */
KVQ_CLONES
static void kvq_rotate_scale_row_prescaled(const float *x, const float *signs, int64_t n,
                                           float inv_sqrt_n, float to_unit, float pre, float *y)
{
    int64_t i;
    for (i = 0; i < n; i++)
        y[i] = (x[i] * signs[i]) * pre;
    kvq_fwht(y, n);
    for (i = 0; i < n; i++)
        y[i] = (y[i] * inv_sqrt_n) * to_unit;
}

/* y = D (H y) * inv_sqrt_n in place (the engine's unrotation: butterflies, x 1/sqrtf(n), signs).
 * When the butterflies could overflow (max|y| > FLT_MAX / (4 n)) and do, the row is recomputed
 * from a copy scaled by 2^-64 and scaled back: the same bits whenever the plain arithmetic is
 * finite, the exact result (as long as it is below FLT_MAX) otherwise. `copy` holds n floats.
 * Returns 1 when the scaled path ran. */
KVQ_CLONES
static int kvq_unrotate_row_safe(float *y, const float *signs, int64_t n, float inv_sqrt_n,
                                 float *copy)
{
    int64_t i;
    /* (no copy: memory was short; the row is left as the plain arithmetic gives it) */
    const int risky = copy != NULL && kvq_max_abs(y, n) > (FLT_MAX / 4.0f) / (float)n;
    if (risky)
        memcpy(copy, y, (size_t)n * sizeof(float));
    kvq_fwht(y, n);
    for (i = 0; i < n; i++)
        y[i] = y[i] * inv_sqrt_n * signs[i];
    if (!risky || kvq_all_finite(y, n))
        return 0;
    for (i = 0; i < n; i++)
        y[i] = copy[i] * KVQ_PRESCALE;
    kvq_fwht(y, n);
    for (i = 0; i < n; i++)
        y[i] = ((y[i] * inv_sqrt_n) * signs[i]) * KVQ_UNSCALE;
    return 1;
}

/* out = H (D x) * inv_sqrt_n (the engine's rotation: signs, butterflies, x 1/sqrtf(n)), with the
 * guard of kvq_unrotate_row_safe: a row whose butterflies overflow is recomputed from x scaled by
 * 2^-64 and scaled back (the same bits wherever the plain arithmetic is finite). */
KVQ_CLONES
static void kvq_rotate_row_safe(const float *x, const float *signs, int64_t n, float inv_sqrt_n,
                                float *out)
{
    int64_t i;
    for (i = 0; i < n; i++)
        out[i] = x[i] * signs[i];
    kvq_fwht(out, n);
    for (i = 0; i < n; i++)
        out[i] = out[i] * inv_sqrt_n;
    if (kvq_all_finite(out, n) || !(kvq_max_abs(x, n) > (FLT_MAX / 4.0f) / (float)n))
        return;
    for (i = 0; i < n; i++)
        out[i] = (x[i] * signs[i]) * KVQ_PRESCALE;
    kvq_fwht(out, n);
    for (i = 0; i < n; i++)
        out[i] = (out[i] * inv_sqrt_n) * KVQ_UNSCALE;
}

/* Codes of `bits` bits, LSB first through a bit cursor (element i at bits [i*bits, (i+1)*bits));
 * byte-aligned widths get straight-line loops. */
KVQ_CLONES
static void kvq_pack_codes(const uint8_t *code, int64_t n, int bits, uint8_t *out)
{
    int64_t i, o = 0;
    if (bits == 8) {
        for (i = 0; i < n; i++)
            out[i] = code[i];
        return;
    }
    if (bits == 4 && n % 2 == 0) {
        for (i = 0; i < n / 2; i++)
            out[i] = (uint8_t)(code[2 * i] | (code[2 * i + 1] << 4));
        return;
    }
    if (bits == 2 && n % 4 == 0) {
        for (i = 0; i < n / 4; i++)
            out[i] = (uint8_t)(code[4 * i] | (code[4 * i + 1] << 2) | (code[4 * i + 2] << 4) |
                               (code[4 * i + 3] << 6));
        return;
    }
    {
        uint64_t acc = 0;
        int filled = 0;
        for (i = 0; i < n; i++) {
            acc |= (uint64_t)code[i] << filled;
            filled += bits;
            while (filled >= 8) {
                out[o++] = (uint8_t)(acc & 0xFF);
                acc >>= 8;
                filled -= 8;
            }
        }
        if (filled > 0)
            out[o] = (uint8_t)(acc & 0xFF);
    }
}

/* code[i] = number of boundaries strictly below y[i] (ties go to the lower level). Counting
 * compares branch-free vectorizes well for up to 15 boundaries (4 bits); wider codebooks use a
 * binary search. */
KVQ_CLONES
static void kvq_nearest_codes(const float *y, int64_t n, const float *bnd, int n_bnd,
                              uint8_t *code)
{
    int64_t i;
    int k;
    if (n_bnd <= 15) {
        for (i = 0; i < n; i++)
            code[i] = 0;
        for (k = 0; k < n_bnd; k++) {
            float b = bnd[k];
            for (i = 0; i < n; i++)
                code[i] += (uint8_t)(y[i] > b);
        }
        return;
    }
    for (i = 0; i < n; i++) {
        int lo = 0, hi = n_bnd;
        float v = y[i];
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if (bnd[mid] < v)
                lo = mid + 1;
            else
                hi = mid;
        }
        code[i] = (uint8_t)lo;
    }
}

/* Inverse of kvq_pack_codes. */
KVQ_CLONES
static void kvq_unpack_codes(const uint8_t *packed, int64_t n, int bits, uint8_t *code)
{
    int64_t i, o = 0;
    if (bits == 8) {
        for (i = 0; i < n; i++)
            code[i] = packed[i];
        return;
    }
    if (bits == 4 && n % 2 == 0) {
        for (i = 0; i < n / 2; i++) {
            code[2 * i] = packed[i] & 0xF;
            code[2 * i + 1] = packed[i] >> 4;
        }
        return;
    }
    if (bits == 2 && n % 4 == 0) {
        for (i = 0; i < n / 4; i++) {
            code[4 * i] = packed[i] & 3;
            code[4 * i + 1] = (packed[i] >> 2) & 3;
            code[4 * i + 2] = (packed[i] >> 4) & 3;
            code[4 * i + 3] = packed[i] >> 6;
        }
        return;
    }
    {
        uint64_t acc = 0;
        uint32_t mask = (1u << bits) - 1u;
        int filled = 0;
        for (i = 0; i < n; i++) {
            while (filled < bits) {
                acc |= (uint64_t)packed[o++] << filled;
                filled += 8;
            }
            code[i] = (uint8_t)(acc & mask);
            acc >>= bits;
            filled -= bits;
        }
    }
}

/* x = D (H (levels[code] * step)) * inv_sqrt_n: the engine's decoder (level times radius/sqrt(n),
 * then the butterflies, the 1/sqrt(n) and the signs), overflow-safe (kvq_unrotate_row_safe;
 * `copy` holds n floats). */
KVQ_CLONES
static void kvq_decode_row(const uint8_t *code, int64_t n, const float *levels, float step,
                           const float *signs, float inv_sqrt_n, float *out, float *copy)
{
    int64_t i;
    for (i = 0; i < n; i++)
        out[i] = levels[code[i]] * step;
    kvq_unrotate_row_safe(out, signs, n, inv_sqrt_n, copy);
}

/* The engine's rule: the first level at the strictly smallest float distance (ties go down). */
KVQ_CLONES
static void kvq_nearest_by_distance(const float *y, int64_t n, const float *levels,
                                    int n_levels, float *best_d, uint8_t *code)
{
    int64_t i;
    int k;
    for (i = 0; i < n; i++) {
        best_d[i] = 1e30f;
        code[i] = 0;
    }
    for (k = 0; k < n_levels; k++) {
        float lev = levels[k];
        for (i = 0; i < n; i++) {
            float d = fabsf(y[i] - lev);
            int better = d < best_d[i];
            best_d[i] = better ? d : best_d[i];
            code[i] = better ? (uint8_t)k : code[i];
        }
    }
}
#endif
