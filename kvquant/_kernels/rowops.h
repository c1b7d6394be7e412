/* Row operations of the rotated codecs (Walsh-Hadamard transform, rotation, sums of squares,
 * nearest levels, packing), in C so that GCC can clone them per instruction set (target_clones:
 * the loader picks AVX-512, AVX2 or the baseline at run time). Every operation is element-wise, a
 * comparison or a reduction in a fixed order, and the build forbids FMA contraction, so all clones
 * give the same bits: they differ in speed only. */
#ifndef KVQ_ROWOPS_H
#define KVQ_ROWOPS_H
#if defined(__GNUC__) || defined(__clang__)
/* the 16-lane helpers below are always inlined: the ABI note about passing them is moot */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KVQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVQ_CLONES
#endif

/* Helpers of the cloned functions are forced inline, so that each clone compiles them for its own
 * instruction set. */
#if defined(__GNUC__)
#define KVQ_INLINE static inline __attribute__((always_inline))
#else
#define KVQ_INLINE static inline
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

/* kvq_sum_squares(x + i n, n, 1) of the m (1..4) consecutive rows of n floats at x, into out[i]:
 * the engine's order, one chain of adds a row, the chains side by side (one row's chain alone
 * waits on every add). The same bits as row by row. */
KVQ_CLONES
static void kvq_sum_squares_rows(const float *x, int64_t m, int64_t n, double *out)
{
    const float *x1 = x + (m > 1 ? n : 0), *x2 = x + (m > 2 ? 2 * n : 0);
    const float *x3 = x + (m > 3 ? 3 * n : 0);
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i;
    for (i = 0; i < n; i++) {
        s0 += (double)x[i] * (double)x[i];
        s1 += (double)x1[i] * (double)x1[i];
        s2 += (double)x2[i] * (double)x2[i];
        s3 += (double)x3[i] * (double)x3[i];
    }
    out[0] = s0;
    if (m > 1)
        out[1] = s1;
    if (m > 2)
        out[2] = s2;
    if (m > 3)
        out[3] = s3;
}

/* ---- vectors ---------------------------------------------------------------------------------
 * GCC (12+) and Clang vector extensions. The row kernels of every path are written once, at the
 * register width of each path (rowops_lanes.h, included per path below): GCC compiles a vector
 * wider than the target's registers to scalar code for its compares and permutations. The
 * 16-float vectors here are one AVX-512 register: the AVX-512-only kernels (the search tree
 * below, polar_encode.h) use them. Loads and stores go through memcpy (no alignment assumed).
 * Without the extensions (KVQ_VEC 0; -DKVQ_NO_VECTOR_EXT forces it, as in simd.h) the scalar loops
 * run instead: the same float operations on the same operands, so the same bits. */
#if !defined(KVQ_NO_VECTOR_EXT) && ((defined(__GNUC__) && __GNUC__ >= 12) || defined(__clang__))
#define KVQ_VEC 1
typedef float kvq_v16f __attribute__((vector_size(64)));
typedef int32_t kvq_v16i __attribute__((vector_size(64)));

/* Macros, not functions: they serve kernels of every target (the AVX-512 ones and the 8-lane
 * baseline loops of polar_encode.h), and Clang rejects passing a 64-byte vector between functions
 * of different targets (an ABI change), even inlined. */
#define kvq_load16(p) __extension__({ kvq_v16f v16_; memcpy(&v16_, (p), sizeof v16_); v16_; })
#define kvq_store16(p, v)                                                                      \
    do {                                                                                       \
        const kvq_v16f v16_ = (v);                                                             \
        memcpy((p), &v16_, sizeof v16_);                                                       \
    } while (0)

#else
#define KVQ_VEC 0
#endif

/* ---- which vector path runs ------------------------------------------------------------------
 * 0: the baseline (4 lanes: SSE2 on x86-64, NEON on ARM), 1: AVX2 (8 lanes), 2: AVX-512 (16
 * lanes): the numbers of simd.h's KVQ_SIMD_*. The best the CPU runs, or a lower one forced by the
 * environment variable KVQUANT_SIMD (portable, avx2; avx512 and avx512vbmi are path 2; read once;
 * consumers.pyx checks its value at import) or by kvq_rowops_set_path (the encoders follow the
 * consumers' set_simd). All paths give the same bits. */
#if KVQ_VEC && defined(__GNUC__) && (defined(__x86_64__) || defined(_M_X64))
#define KVQ_X86_PATHS 1
#include <stdlib.h>
#else
#define KVQ_X86_PATHS 0
#endif

static int kvq_rowops_forced = -2;   /* -2: not read yet, -1: none */
static int kvq_rowops_cpu = -1;      /* -1: not asked yet */

/* The best path the CPU runs (asked once; a second thread asking too finds the same). */
static int kvq_rowops_cpu_path(void)
{
    int cpu = kvq_rowops_cpu;
    if (cpu < 0) {
        cpu = 0;
#if KVQ_X86_PATHS
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f"))
            cpu = 2;
        else if (__builtin_cpu_supports("avx2"))
            cpu = 1;
#endif
        kvq_rowops_cpu = cpu;
    }
    return cpu;
}

/* The path the vector kernels take now. */
static int kvq_rowops_path(void)
{
    const int cpu = kvq_rowops_cpu_path();
    int forced = kvq_rowops_forced;
    if (forced == -2) {
        /* read once; one store, so a thread reading meanwhile finds -2 and reads it too.
         * Case and surrounding blanks are ignored, as consumers.pyx does. */
        const char *e = getenv("KVQUANT_SIMD");
        char word[16];
        int n = 0;
        for (; e != NULL && *e != '\0' && n < 15; e++)
            if (*e != ' ' && *e != '\t' && *e != '\n')
                word[n++] = (char)(*e >= 'A' && *e <= 'Z' ? *e - 'A' + 'a' : *e);
        word[n] = '\0';
        forced = -1;
        if (strcmp(word, "portable") == 0)
            forced = 0;
        else if (strcmp(word, "avx2") == 0)
            forced = 1;
        kvq_rowops_forced = forced;
    }
    return forced >= 0 && forced < cpu ? forced : cpu;
}

/* Force a path (0, 1, 2: used only where the CPU runs it) or, with -1, the best one. Returns the
 * path that runs. */
static int kvq_rowops_set_path(int path)
{
    kvq_rowops_forced = path < 0 ? -1 : path;
    return kvq_rowops_path();
}

#if KVQ_VEC
#define KVQ_LN(x) x##_w4
#define KVQ_LW 4
#define KVQ_LTARGET
#include "rowops_lanes.h"
#undef KVQ_LN
#undef KVQ_LW
#undef KVQ_LTARGET
#endif
#if KVQ_X86_PATHS
#define KVQ_LN(x) x##_w8
#define KVQ_LW 8
#define KVQ_LTARGET __attribute__((target("avx2")))
#include "rowops_lanes.h"
#undef KVQ_LN
#undef KVQ_LW
#undef KVQ_LTARGET
#define KVQ_LN(x) x##_w16
#define KVQ_LW 16
#define KVQ_LTARGET __attribute__((target("avx512f")))
#include "rowops_lanes.h"
#undef KVQ_LN
#undef KVQ_LW
#undef KVQ_LTARGET
#endif

/* Stages h = 1, 2, 4 of the transform, group of 8 by group of 8 (rows narrower than 16, and the
 * scalar build). */
KVQ_INLINE void kvq_fwht_groups8(float *y, int64_t n)
{
    int64_t g;
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
}

/* Unnormalized Walsh-Hadamard transform in natural (Sylvester) order, in place: butterflies with
 * h = 1, 2, 4, ... (y[j], y[j + h]) -> (y[j] + y[j + h], y[j] - y[j + h]). Every element goes
 * through the same float operations on the same operands whatever the grouping (a register's
 * lanes for small h, two stages per pass above), so every path gives the same bits. */
static void kvq_fwht(float *y, int64_t n)
{
    int64_t i;
    if (n < 16 || !KVQ_VEC) {
        int64_t h = 1, j;
        if (n >= 8) {
            kvq_fwht_groups8(y, n);
            h = 8;
        }
        for (; h < n; h *= 2)
            for (i = 0; i < n; i += 2 * h)
                for (j = i; j < i + h; j++) {
                    float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        return;
    }
#if KVQ_X86_PATHS
    switch (kvq_rowops_path()) {
    case 2:
        kvq_fwht_w16(y, n);
        return;
    case 1:
        kvq_fwht_w8(y, n);
        return;
    }
#endif
#if KVQ_VEC
    kvq_fwht_w4(y, n);
#endif
    (void)i;
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

/* Byte order: the packers below move groups of 8 codes through a uint64 read and written with
 * memcpy, which is the packed layout only on a little-endian host (elsewhere the bit cursor runs). */
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define KVQ_LITTLE_ENDIAN 1
#else
#define KVQ_LITTLE_ENDIAN 0
#endif

/* Eight codes of `bits` bits (1..7), one per byte of v (byte k = code k, little endian), into
 * their 8 * bits packed bits, LSB first: pairs of bytes, then pairs of 16-bit lanes, then the two
 * halves are joined by shifting each upper part down over the gap. Codes must be below 2^bits. */
KVQ_INLINE uint64_t kvq_squeeze8(uint64_t v, int bits)
{
    v = (v & 0x00FF00FF00FF00FFull) | ((v & 0xFF00FF00FF00FF00ull) >> (8 - bits));
    v = (v & 0x0000FFFF0000FFFFull) | ((v & 0xFFFF0000FFFF0000ull) >> (16 - 2 * bits));
    return (v & 0x00000000FFFFFFFFull) | ((v & 0xFFFFFFFF00000000ull) >> (32 - 4 * bits));
}

/* The inverse of kvq_squeeze8: 8 * bits packed bits (higher bits of v ignored) to one code per
 * byte. */
KVQ_INLINE uint64_t kvq_spread8(uint64_t v, int bits)
{
    const uint64_t m4 = (1ull << (4 * bits)) - 1u, m2 = (1ull << (2 * bits)) - 1u;
    const uint64_t m1 = (1ull << bits) - 1u;
    v = (v & m4) | (((v >> (4 * bits)) & m4) << 32);
    v = (v & (m2 * 0x0000000100000001ull)) | (((v >> (2 * bits)) & (m2 * 0x0000000100000001ull)) << 16);
    return (v & (m1 * 0x0001000100010001ull)) | (((v >> bits) & (m1 * 0x0001000100010001ull)) << 8);
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
#if KVQ_LITTLE_ENDIAN
    if (n % 8 == 0) {
        /* other widths: 8 codes fill `bits` whole bytes, written little endian; a group is
         * stored as 8 bytes (the next groups overwrite the spare ones) while those stay inside
         * the row, the last ones as their own bytes */
        const int64_t n_bytes = n / 8 * bits;
        int64_t g;
        uint64_t v;
        for (g = 0; g * bits + 8 <= n_bytes; g++) {
            memcpy(&v, code + 8 * g, 8);
            v = kvq_squeeze8(v, bits);
            memcpy(out + g * bits, &v, 8);
        }
        for (; g < n / 8; g++) {
            memcpy(&v, code + 8 * g, 8);
            v = kvq_squeeze8(v, bits);
            memcpy(out + g * bits, &v, (size_t)bits);
        }
        return;
    }
#endif
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

/* ---- nearest level: the code of v is the number of boundaries strictly below it ---------------
 * (ties go to the lower level; NaN gets code 0). Up to 31 boundaries (5 bits) the compares are
 * counted, 16 lanes at a time. Wider codebooks use a bucket table (built once per codebook by
 * kvq_code_table_build): v falls in bucket b = floor((v - lo) * scale), clamped to
 * [0, n_buckets), whose entry holds a lower bound `start` of the code and the `window`
 * boundaries from there, so code = start + #{those boundaries < v}. No branch, no search.
 *
 * Why it is exact: the bucket is computed with two float roundings, which move t = (v - lo) *
 * scale by a relative 2^-23 at most, less than 2^-10 bucket for t < 4096. So a v that lands in
 * bucket b lies in [lo + (b - 1/256) / scale, lo + (b + 1 + 1/256) / scale] (in exact arithmetic,
 * whatever its float rounding); the builder takes start = #{boundaries below that interval} and
 * window = the most boundaries any bucket's interval holds, so every boundary below v is among the
 * first start + window (boundaries ascend). The same bits as a search on every ISA and clone.
 *
 * Table layout, float32 (counts are small integers, exact in a float): [0] lo, [1] scale,
 * [2] n_buckets, [3] window, then n_buckets starts, then n_buckets * window boundaries (+inf past
 * the last). */
#define KVQ_CODE_TABLE_HEADER 4
#define KVQ_CODE_TABLE_MAX_BUCKETS 4096
#define KVQ_CODE_TABLE_SLACK (1.0 / 256.0)

/* #{k : bnd[k] < v} and #{k : bnd[k] <= v} over ascending boundaries, by binary search. */
static int64_t kvq_count_below(const float *bnd, int64_t n_bnd, double v, int or_equal)
{
    int64_t lo = 0, hi = n_bnd;
    while (lo < hi) {
        const int64_t mid = (lo + hi) >> 1;
        if ((double)bnd[mid] < v || (or_equal && (double)bnd[mid] == v))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The bucket interval of b (module comment) as counts: *start and *end bound the code of every v
 * that lands in bucket b. */
static void kvq_code_bucket_span(const float *bnd, int64_t n_bnd, double lo, double scale,
                                 int64_t b, int64_t n_buckets, int64_t *start, int64_t *end)
{
    *start = b == 0 ? 0
                    : kvq_count_below(bnd, n_bnd, lo + ((double)b - KVQ_CODE_TABLE_SLACK) / scale, 0);
    *end = b == n_buckets - 1
               ? n_bnd
               : kvq_count_below(bnd, n_bnd, lo + ((double)b + 1.0 + KVQ_CODE_TABLE_SLACK) / scale, 1);
}

/* Plans the table of n_bnd ascending finite boundaries (n_bnd >= 1): the fewest buckets (a power
 * of two, 16 .. 4096) whose window is 1, else 4096 buckets and their window. Returns the table's
 * length in floats and sets its parameters. */
static int64_t kvq_code_table_plan(const float *bnd, int64_t n_bnd, int64_t *n_buckets,
                                   int64_t *window, float *lo_f, float *scale_f)
{
    const double lo = (double)bnd[0], span = (double)bnd[n_bnd - 1] - lo;
    int64_t nb, b, st, en, w = 0;
    for (nb = 16; nb <= KVQ_CODE_TABLE_MAX_BUCKETS; nb *= 2) {
        /* the float scale the lookup multiplies by (any positive value is correct) */
        const float sc = span > 0.0 ? (float)((double)nb / span) : 1.0f;
        w = 0;
        for (b = 0; b < nb; b++) {
            kvq_code_bucket_span(bnd, n_bnd, lo, (double)sc, b, nb, &st, &en);
            w = en - st > w ? en - st : w;
        }
        *n_buckets = nb;
        *window = w;
        *lo_f = bnd[0];
        *scale_f = sc;
        if (w <= 1)
            break;
    }
    if (*n_buckets > KVQ_CODE_TABLE_MAX_BUCKETS)
        *n_buckets = KVQ_CODE_TABLE_MAX_BUCKETS;
    return KVQ_CODE_TABLE_HEADER + *n_buckets * (1 + *window);
}

/* Fills a table planned by kvq_code_table_plan (`table` holds its length). */
static void kvq_code_table_build(const float *bnd, int64_t n_bnd, float *table)
{
    int64_t nb, w, b, k, st, en;
    float lo, sc;
    float *start = table + KVQ_CODE_TABLE_HEADER, *bval;
    kvq_code_table_plan(bnd, n_bnd, &nb, &w, &lo, &sc);
    table[0] = lo;
    table[1] = sc;
    table[2] = (float)nb;
    table[3] = (float)w;
    bval = start + nb;
    for (b = 0; b < nb; b++) {
        kvq_code_bucket_span(bnd, n_bnd, (double)lo, (double)sc, b, nb, &st, &en);
        start[b] = (float)st;
        for (k = 0; k < w; k++)
            bval[b * w + k] = st + k < n_bnd ? bnd[st + k] : INFINITY;
    }
}

/* The bucket of v (NaN and everything below lo: bucket 0). */
KVQ_INLINE int32_t kvq_code_bucket(const float *table, float v)
{
    float t = (v - table[0]) * table[1];
    const float top = table[2] - 1.0f;
    t = t > 0.0f ? t : 0.0f;
    t = t < top ? t : top;
    return (int32_t)t;
}

/* The code of v through a table (layout above). */
KVQ_INLINE int kvq_code_lookup(const float *table, float v)
{
    const int32_t b = kvq_code_bucket(table, v), w = (int32_t)table[3];
    const float *bval = table + KVQ_CODE_TABLE_HEADER + (int32_t)table[2] + (int64_t)b * w;
    int32_t k, code = (int32_t)table[KVQ_CODE_TABLE_HEADER + b];
    for (k = 0; k < w; k++)
        code += bval[k] < v;
    return code;
}

/* ---- nearest level by a search tree in vector registers (16 to 255 boundaries) ---------------
 * With the boundaries padded by +inf (which no value exceeds) to 2^k - 1 (k = 5..8), the code
 * #{boundaries < v} is found level by level. After levels 1 .. L-1 every lane holds the index p of
 * its group of S consecutive codes (p S <= code < (p + 1) S); level L cuts the group into f_L
 * parts of S / f_L codes and counts the cuts bnd[p S + q S / f_L - 1], q = 1 .. f_L - 1, below v.
 * Boundaries ascend, so the cuts below v are the first ones and p f_L + count is the lane's index
 * at the next level; after the last level S = 1 and the index is the code. The cuts of one q for
 * every p form a table of P = f_1 ... f_{L-1} entries, read with a lane permutation (16 entries in
 * one register, 32 in two); P = 1 is a broadcast. Exact compares only, so the codes are those of
 * the count and of the bucket table (NaN compares false everywhere: code 0).
 * The permutations need GCC's __builtin_shuffle and run under AVX-512 (vpermps / vpermt2ps); the
 * plan is only built where both are there, and the other paths run elsewhere. */
#define KVQ_CODE_PLAN_LEVELS 4
#define KVQ_CODE_PLAN_TABLES 16
typedef struct {
    int n_levels;
    int factor[KVQ_CODE_PLAN_LEVELS];    /* f_L */
    int entries[KVQ_CODE_PLAN_LEVELS];   /* P of the level's tables: 1, <= 16 or <= 32 */
    float tab[KVQ_CODE_PLAN_TABLES][32]; /* the cut tables, level by level, q by q */
} kvq_code_plan;

#if KVQ_VEC && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KVQ_CODE_PLAN 1
#else
#define KVQ_CODE_PLAN 0
#endif

/* Fills the plan of n_bnd ascending boundaries; 0 when it cannot run here (fewer than 16 or more
 * than 255 boundaries, no AVX-512, or a compiler without the permutations): use the other paths.
 * Level factors (fastest measured for each k; every table within 32 entries): k = 5: 4 4 2,
 * k = 6: 4 4 4, k = 7: 2 4 4 4, k = 8: 4 4 2 8. */
static int kvq_code_plan_build(const float *bnd, int64_t n_bnd, kvq_code_plan *p)
{
    static const int factors[4][KVQ_CODE_PLAN_LEVELS] = {
        {4, 4, 2, 0}, {4, 4, 4, 0}, {2, 4, 4, 4}, {4, 4, 2, 8}};
    int64_t n_codes = 32, S;
    int k = 5, L, q, e, t = 0, P = 1;
    memset(p, 0, sizeof *p);
#if KVQ_CODE_PLAN
    if (n_bnd < 16 || n_bnd > 255 || kvq_rowops_path() != 2)
        return 0;
#else
    (void)factors, (void)n_codes, (void)S, (void)k, (void)L, (void)q, (void)e, (void)t, (void)P;
    (void)bnd;
    return 0;
#endif
    while (n_codes - 1 < n_bnd) {
        n_codes *= 2;
        k++;
    }
    S = n_codes;
    for (L = 0; L < KVQ_CODE_PLAN_LEVELS && factors[k - 5][L]; L++) {
        const int f = factors[k - 5][L];
        p->factor[L] = f;
        p->entries[L] = P;
        for (q = 1; q < f; q++, t++)
            for (e = 0; e < 32; e++) {
                const int64_t j = (int64_t)e * S + q * (S / f) - 1;
                p->tab[t][e] = e < P && j < n_bnd ? bnd[j] : INFINITY;
            }
        P *= f;
        S /= f;
    }
    p->n_levels = L;
    return 1;
}

#if KVQ_CODE_PLAN
/* The codes of y[0 .. n) by the plan, n a multiple of 16. */
__attribute__((target("avx512f"))) static void kvq_nearest_codes_plan(const float *y, int64_t n,
                                                                     const kvq_code_plan *p,
                                                                     uint8_t *code)
{
    typedef uint8_t kvq_v16u8 __attribute__((vector_size(16)));
    int64_t i;
    int L, q;
    for (i = 0; i + 16 <= n; i += 16) {
        const kvq_v16f v = kvq_load16(y + i);
        const float *t = &p->tab[0][0];
        kvq_v16i idx = {0};
        kvq_v16u8 c8;
        for (L = 0; L < p->n_levels; L++) {
            const int f = p->factor[L], P = p->entries[L];
            kvq_v16i c = idx * f;
            if (P == 1)
                for (q = 1; q < f; q++, t += 32)
                    c -= v > t[0];                                /* true is -1 */
            else if (P <= 16)
                for (q = 1; q < f; q++, t += 32)
                    c -= v > __builtin_shuffle(kvq_load16(t), idx);
            else
                for (q = 1; q < f; q++, t += 32)
                    c -= v > __builtin_shuffle(kvq_load16(t), kvq_load16(t + 16), idx);
            idx = c;
        }
        c8 = __builtin_convertvector(idx, kvq_v16u8);
        memcpy(code + i, &c8, 16);
    }
}
#endif

/* code[i] = number of boundaries strictly below y[i]: by `plan` (when not NULL: one built by
 * kvq_code_plan_build for these boundaries; the AVX-512 path) sixteen at a time, otherwise by
 * counted compares up to 31 boundaries (15 on the narrower paths, where the table is faster for
 * 5 bits) and `table` (kvq_code_table_build of the same boundaries) above, sixteen at a time in
 * the vectors of the path that runs, the last n % 16 one by one. */
static void kvq_nearest_codes(const float *y, int64_t n, const float *bnd, int n_bnd,
                              const float *table, const kvq_code_plan *plan, uint8_t *code)
{
    int64_t i;
    int k;
    int64_t m = KVQ_VEC ? n - n % 16 : 0;   /* elements the vector kernels take */
    const int path = kvq_rowops_path();
#if KVQ_CODE_PLAN
    if (plan != NULL && path == 2 && m > 0) {
        kvq_nearest_codes_plan(y, m, plan, code);
        y += m;
        code += m;
        n -= m;
        m = 0;
    }
#else
    (void)plan;
#endif
    if (n_bnd <= (path == 2 ? 31 : 15)) {
        if (m > 0) {
#if KVQ_X86_PATHS
            if (path == 2)
                kvq_codes_counted_w16(y, m, bnd, n_bnd, code);
            else if (path == 1)
                kvq_codes_counted_w8(y, m, bnd, n_bnd, code);
            else
#endif
#if KVQ_VEC
                kvq_codes_counted_w4(y, m, bnd, n_bnd, code);
#endif
            y += m;
            code += m;
            n -= m;
        }
        for (i = 0; i < n; i++) {
            int c = 0;
            for (k = 0; k < n_bnd; k++)
                c += y[i] > bnd[k];
            code[i] = (uint8_t)c;
        }
        return;
    }
    if (table[3] == 1.0f) {
        /* the common case: buckets in vectors, then two table reads per element */
        const float *start = table + KVQ_CODE_TABLE_HEADER;
        const float *bval = start + (int32_t)table[2];
        if (m > 0) {
            const float lo = table[0], scale = table[1], top = table[2] - 1.0f;
#if KVQ_X86_PATHS
            if (path == 2)
                kvq_codes_bucket1_w16(y, m, lo, scale, top, start, bval, code);
            else if (path == 1)
                kvq_codes_bucket1_w8(y, m, lo, scale, top, start, bval, code);
            else
#endif
#if KVQ_VEC
                kvq_codes_bucket1_w4(y, m, lo, scale, top, start, bval, code);
#endif
            y += m;
            code += m;
            n -= m;
        }
        for (i = 0; i < n; i++) {
            const int32_t b = kvq_code_bucket(table, y[i]);
            code[i] = (uint8_t)((int32_t)start[b] + (bval[b] < y[i]));
        }
        return;
    }
    for (i = 0; i < n; i++)
        code[i] = (uint8_t)kvq_code_lookup(table, y[i]);
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
#if KVQ_LITTLE_ENDIAN
    if (n % 8 == 0) {
        /* 8 bytes read per group while they stay inside the row, then only a group's own */
        const int64_t n_bytes = n / 8 * bits;
        int64_t g;
        uint64_t v;
        for (g = 0; g * bits + 8 <= n_bytes; g++) {
            memcpy(&v, packed + g * bits, 8);
            v = kvq_spread8(v, bits);
            memcpy(code + 8 * g, &v, 8);
        }
        for (; g < n / 8; g++) {
            v = 0;
            memcpy(&v, packed + g * bits, (size_t)bits);
            v = kvq_spread8(v, bits);
            memcpy(code + 8 * g, &v, 8);
        }
        return;
    }
#endif
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
