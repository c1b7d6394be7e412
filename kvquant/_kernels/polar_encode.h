/* The polar encoder's row operations (kvquant/_kernels/polar.pyx): the forward transform without
 * per-angle libm calls, the Lloyd codes of a level from bucket tables, the variable-width packing.
 *
 * One level maps the pairs (a, c) = (x[2j], x[2j+1]) to radii r[j] = hypotf(a, c) and angles
 * atan2f(c, a). The codes only need each angle's code, and every quantizer of the codec (the
 * engine's floor-and-clamp grids, the Lloyd boundaries) is a monotone function of the float
 * angle. So the angle is computed approximately, in float vectors (in double where the compiler
 * has no vector extensions), with a proven error bound, and the float interval [lo, hi] around
 * it certainly holds libm's atan2f(c, a):
 * when the quantizer gives one code at both ends, that is the code of atan2f(c, a); otherwise
 * (about once in 10^4 angles, near a code boundary) the encoder calls atan2f itself. The codes are
 * those of the libm angle, bit for bit.
 *
 * The radii feed the next level and must be libm's bits: glibc computes hypotf of finite floats
 * as (float) sqrt((double) a * a + (double) c * c) (both squares are exact in double), which is
 * what is done here, for finite pairs; a level with a non-finite value is redone with libm.
 *
 * The approximation: t = min(|a|, |c|) / max(|a|, |c|) in [0, 1]; above tan(pi/8) it is mapped
 * to u = (t - 1) / (t + 1) and atan(t) = pi/4 + atan(u), so |u| <= tan(pi/8) = 0.4142 (one
 * division either way); atan(u) is its Taylor series to u^13 (an alternating series of
 * decreasing terms: the rest is below the first term left out, |u|^15 / 15 <= 0.1716^7 / 15 |u|
 * < 3e-7 |u|); then the octant and the signs. Each step keeps a relative error below 4e-7 of
 * the angle (|u| <= 1.06 atan|u|, and a subtraction only happens where the angle is at least
 * pi/8), libm's atan2f is within a few float ulps (a relative 2^-21 < 5e-7), rounding the ends
 * to float moves them by a relative 2^-24, and the interval is padded by a relative
 * 2^-16 = 1.5e-5 plus 2^-140 (float subnormals): it holds atan2f(c, a) with a margin of more
 * than ten times the sum. Pairs with a zero or a non-finite element (where the signs of
 * zeros decide between 0 and pi, and between pi and -pi) always go to libm. That is the double
 * computation (kvq_atan2_approx); the vectors run the same steps in float, whose bound (below
 * 2e-6 of the angle, inside the same pad) is given with the AVX-512 forward level.
 */
#ifndef KVQ_POLAR_ENCODE_H
#define KVQ_POLAR_ENCODE_H
#include <math.h>
#include <stdint.h>

#include "polarops.h"
#include "rowops.h"

/* The bracket of an angle only libm may decide: wider than [-pi, pi], so every quantizer gives
 * different codes at its ends (and finite, so that the grids' float-to-int conversions hold). */
#define KVQ_ANGLE_OPEN 4.0f
#define KVQ_ANGLE_PAD_REL 1.52587890625e-05   /* 2^-16 */
#define KVQ_ANGLE_PAD_ABS 7.174648137343064e-43 /* 2^-140 */

/* atan2(c, a) in double for finite, nonzero a and c (the header comment's bound). */
KVQ_INLINE double kvq_atan2_approx(double a, double c)
{
    const double ax = fabs(a), ac = fabs(c);
    const int swap = ac > ax;
    const double num = swap ? ax : ac, den = swap ? ac : ax;   /* t = num / den in [0, 1] */
    const int reduce = num > 0.41421356237309503 * den;
    /* (t - 1) / (t + 1) = (num - den) / (num + den); both are exact in double (float inputs
     * within a factor 3 of each other), so u has a single rounding */
    const double u = reduce ? (num - den) / (num + den) : num / den;
    const double u2 = u * u;
    double p = 1.0 / 13.0;
    double th;
    p = p * u2 - 1.0 / 11.0;
    p = p * u2 + 1.0 / 9.0;
    p = p * u2 - 1.0 / 7.0;
    p = p * u2 + 1.0 / 5.0;
    p = p * u2 - 1.0 / 3.0;
    th = u + u * (u2 * p);
    th = reduce ? 0.78539816339744828 + th : th;          /* atan(t), in [0, pi/4] */
    th = swap ? 1.5707963267948966 - th : th;             /* [0, pi/2] */
    th = a < 0.0 ? 3.1415926535897931 - th : th;          /* [0, pi] */
    return c < 0.0 ? -th : th;
}

#if KVQ_VEC
typedef double kvq_v8d __attribute__((vector_size(64)));
typedef float kvq_v8f __attribute__((vector_size(32)));
typedef int32_t kvq_v8i __attribute__((vector_size(32)));

/* The angle in float arithmetic (its bound: the comment of the AVX-512 forward level below),
 * one definition for 8 lanes (every vector path's kvq_polar_forward_level) and 16 (AVX-512);
 * ATTR: the instance's target attribute, if any. */
#define KVQ_DEFINE_ATAN2F(NAME, VF, VI, SEL, ATTR)                                               \
    ATTR KVQ_INLINE VF NAME(VF a, VF c)                                                          \
    {                                                                                            \
        const VI abs_mask = (VI){0} + 0x7fffffff;                                                \
        const VF ax = (VF)((VI)a & abs_mask), ac = (VF)((VI)c & abs_mask);                       \
        const VI swap = ac > ax;                                                                 \
        const VF num = SEL(swap, ax, ac), den = SEL(swap, ac, ax);                               \
        /* scaled by a power of two (exact): big pairs halved, tiny ones made normal */          \
        const VF scale = SEL(den > 1e38f, (VF){0} + 0.5f,                                        \
                             SEL(den < 1e-30f, (VF){0} + 18446744073709551616.0f, (VF){0} + 1.0f)); \
        const VF ns = num * scale, ds = den * scale;                                             \
        const VI reduce = ns > 0.41421356237309503f * ds;                                        \
        const VF u = SEL(reduce, ns - ds, ns) / SEL(reduce, ns + ds, ds);                        \
        const VF u2 = u * u;                                                                     \
        VF p = (VF){0} + (float)(1.0 / 13.0), th;                                                \
        p = p * u2 - (float)(1.0 / 11.0);                                                        \
        p = p * u2 + (float)(1.0 / 9.0);                                                         \
        p = p * u2 - (float)(1.0 / 7.0);                                                         \
        p = p * u2 + (float)(1.0 / 5.0);                                                         \
        p = p * u2 - (float)(1.0 / 3.0);                                                         \
        th = u + u * (u2 * p);                                                                   \
        th = SEL(reduce, 0.78539816339744828f + th, th);                                         \
        th = SEL(swap, 1.5707963267948966f - th, th);                                            \
        th = SEL(a < 0.0f, 3.1415926535897931f - th, th);                                        \
        return SEL(c < 0.0f, -th, th);                                                           \
    }

KVQ_INLINE kvq_v8f kvq_sel8f(kvq_v8i m, kvq_v8f a, kvq_v8f b)
{
    return (kvq_v8f)((m & (kvq_v8i)a) | (~m & (kvq_v8i)b));
}

KVQ_DEFINE_ATAN2F(kvq_atan2_approx8f, kvq_v8f, kvq_v8i, kvq_sel8f, )
#endif

/* One level of the forward transform: r[j] = hypotf(x[2j], x[2j+1]) and [lo[j], hi[j]] around
 * atan2f(x[2j+1], x[2j]) (lo = -4, hi = 4 for the pairs libm must decide: a zero element).
 * Returns 1 when a value is not finite: the caller redoes the level with libm. */
/* r[j] = (float) sqrt(r2[j]): glibc's hypotf of finite floats once r2 holds a^2 + c^2. C has no
 * vector square root that the compiler may use without -fno-math-errno (the scalar sqrt must be
 * able to set errno), so on x86-64 the packed instructions are called directly, picked at run
 * time; IEEE square roots are correctly rounded, so every path gives the same bits. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

__attribute__((target("avx512f"))) static void kvq_sqrt_to_float_avx512(const double *r2,
                                                                         int64_t n, float *r)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(r + j, _mm512_cvtpd_ps(_mm512_sqrt_pd(_mm512_loadu_pd(r2 + j))));
    for (; j < n; j++)
        r[j] = (float)sqrt(r2[j]);
}

__attribute__((target("avx"))) static void kvq_sqrt_to_float_avx(const double *r2, int64_t n,
                                                                 float *r)
{
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        _mm_storeu_ps(r + j, _mm256_cvtpd_ps(_mm256_sqrt_pd(_mm256_loadu_pd(r2 + j))));
    for (; j < n; j++)
        r[j] = (float)sqrt(r2[j]);
}

static void kvq_sqrt_to_float(const double *r2, int64_t n, float *r)
{
    int64_t j = 0;
    if (__builtin_cpu_supports("avx512f")) {
        kvq_sqrt_to_float_avx512(r2, n, r);
        return;
    }
    if (__builtin_cpu_supports("avx")) {
        kvq_sqrt_to_float_avx(r2, n, r);
        return;
    }
    for (; j + 2 <= n; j += 2) {   /* SSE2: the x86-64 baseline */
        const __m128 f = _mm_cvtpd_ps(_mm_sqrt_pd(_mm_loadu_pd(r2 + j)));
        r[j] = _mm_cvtss_f32(f);
        r[j + 1] = _mm_cvtss_f32(_mm_shuffle_ps(f, f, 1));
    }
    for (; j < n; j++)
        r[j] = (float)sqrt(r2[j]);
}
#else
static void kvq_sqrt_to_float(const double *r2, int64_t n, float *r)
{
    int64_t j;
    for (j = 0; j < n; j++)
        r[j] = (float)sqrt(r2[j]);
}
#endif

KVQ_INLINE int kvq_polar_forward_pair(const float *x, int64_t j, double *r2, float *lo,
                                      float *hi)
{
    const float a = x[2 * j], c = x[2 * j + 1];
    const double ad = (double)a, cd = (double)c;
    const double th = kvq_atan2_approx(ad, cd);
    const double pad = fabs(th) * KVQ_ANGLE_PAD_REL + KVQ_ANGLE_PAD_ABS;
    const int exact = (a != 0.0f) & (c != 0.0f);
    r2[j] = ad * ad + cd * cd;
    lo[j] = exact ? (float)(th - pad) : -KVQ_ANGLE_OPEN;
    hi[j] = exact ? (float)(th + pad) : KVQ_ANGLE_OPEN;
    return !(fabsf(a) <= FLT_MAX) | !(fabsf(c) <= FLT_MAX);
}

#if KVQ_X86_PATHS
/* ---- the AVX-512 forward level: the angles in float, 16 pairs a vector ---------------------
 * The same steps as kvq_atan2_approx in float arithmetic (KVQ_DEFINE_ATAN2F: 8 lanes on every
 * vector path, 16 here).
 * Its error, to first order in the float unit roundoff e = 2^-24: u carries at most 3e (two
 * roundings for the reduced ratio's terms, one for the division), u*u and the series' terms
 * computed from it (coefficients rounded to float) add at most 12e to the term u * (u2 * p),
 * which is at most 0.06 |u|, plus e for the last add; the series itself is 3e-7 |u| from atan(u)
 * (|u| <= 0.4143, the float compare's rounding included); adding pi/4 (rounded), taking pi/2 -
 * and pi - (each result at least as large as what it took) adds 2e each. Altogether below 2e-6
 * of the angle, with the ends' rounding and libm's 2^-21 far inside the 2^-16 pad. Range: the
 * pair's magnitudes are first scaled by a power of two (exact), 1/2 above 1e38 (num + den stays
 * finite) and 2^64 below 1e-30 (the test of tan(pi/8) and the ratio see normal floats, as the
 * bound assumes); a quotient that still underflows moves by at most 2^-150, inside the 2^-140
 * absolute pad. Pairs with a zero or a non-finite element are handled as in the
 * double path (libm decides them; a non-finite value redoes the level). */
/* (AVX-512's target on the helpers too: Clang lets 64-byte vectors pass only between functions
 * compiled for it) */
__attribute__((target("avx512f"))) KVQ_INLINE kvq_v16f
kvq_sel16f(kvq_v16i m, kvq_v16f a, kvq_v16f b)
{
    return (kvq_v16f)((m & (kvq_v16i)a) | (~m & (kvq_v16i)b));
}

KVQ_DEFINE_ATAN2F(kvq_atan2_approx16f, kvq_v16f, kvq_v16i, kvq_sel16f,
                  __attribute__((target("avx512f"))))

/* The brackets of 16 pairs (a, c) (the AVX-512 path of kvq_polar_forward_level). Compiled for
 * AVX-512 itself: GCC would otherwise lower its float compares lane by lane before inlining. */
__attribute__((target("avx512f"))) KVQ_INLINE void kvq_polar_brackets16(kvq_v16f af, kvq_v16f cf, kvq_v16f *out_lo, kvq_v16f *out_hi)
{
    const kvq_v16f th = kvq_atan2_approx16f(af, cf);
    const kvq_v16f pad = (kvq_v16f)((kvq_v16i)th & ((kvq_v16i){0} + 0x7fffffff))
                         * (float)KVQ_ANGLE_PAD_REL + (float)KVQ_ANGLE_PAD_ABS;
    const kvq_v16i exact = (af != 0.0f) & (cf != 0.0f);
    const kvq_v16f open = (kvq_v16f){0} + KVQ_ANGLE_OPEN;
    *out_lo = kvq_sel16f(exact, th - pad, -open);
    *out_hi = kvq_sel16f(exact, th + pad, open);
}

/* The forward level (see kvq_polar_forward_level) 16 pairs at a time, a short last block from
 * a copy padded with finite pairs (their results are dropped); returns half and sets *bad when
 * a value is not finite. */
__attribute__((target("avx512f"))) static int64_t
kvq_polar_forward16_avx512(const float *x, int64_t half, float *lo, float *hi, double *r2,
                           int *bad)
{
    typedef double kvq_v8d_ __attribute__((vector_size(64)));
    typedef float kvq_v8f_ __attribute__((vector_size(32)));
    int64_t j;
    kvq_v16i all_finite = (kvq_v16i){0} - 1;
    for (j = 0; j < half; j += 16) {
        const int64_t m = half - j < 16 ? half - j : 16;
        float in[32], t_lo[16], t_hi[16];
        double t_r2[16];
        const float *src = x + 2 * j;
        float *d_lo = lo + j, *d_hi = hi + j;
        double *d_r2 = r2 + j;
        int i;
        if (m < 16) {
            for (i = 0; i < 32; i++)
                in[i] = 1.0f;
            memcpy(in, src, (size_t)(2 * m) * sizeof(float));
            src = in;
            d_lo = t_lo;
            d_hi = t_hi;
            d_r2 = t_r2;
        }
        const kvq_v16f v0 = kvq_load16(src), v1 = kvq_load16(src + 16);
        const kvq_v16f af = __builtin_shufflevector(v0, v1, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18,
                                                    20, 22, 24, 26, 28, 30);
        const kvq_v16f cf = __builtin_shufflevector(v0, v1, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19,
                                                    21, 23, 25, 27, 29, 31);
        kvq_v16f out_lo, out_hi;
        const kvq_v8f_ a0 = __builtin_shufflevector(af, af, 0, 1, 2, 3, 4, 5, 6, 7);
        const kvq_v8f_ a1 = __builtin_shufflevector(af, af, 8, 9, 10, 11, 12, 13, 14, 15);
        const kvq_v8f_ c0 = __builtin_shufflevector(cf, cf, 0, 1, 2, 3, 4, 5, 6, 7);
        const kvq_v8f_ c1 = __builtin_shufflevector(cf, cf, 8, 9, 10, 11, 12, 13, 14, 15);
        const kvq_v8d_ ad0 = __builtin_convertvector(a0, kvq_v8d_);
        const kvq_v8d_ ad1 = __builtin_convertvector(a1, kvq_v8d_);
        const kvq_v8d_ cd0 = __builtin_convertvector(c0, kvq_v8d_);
        const kvq_v8d_ cd1 = __builtin_convertvector(c1, kvq_v8d_);
        const kvq_v8d_ sq0 = ad0 * ad0 + cd0 * cd0, sq1 = ad1 * ad1 + cd1 * cd1;
        all_finite &= (af <= FLT_MAX) & (af >= -FLT_MAX) & (cf <= FLT_MAX) & (cf >= -FLT_MAX);
        kvq_polar_brackets16(af, cf, &out_lo, &out_hi);
        kvq_store16(d_lo, out_lo);
        kvq_store16(d_hi, out_hi);
        memcpy(d_r2, &sq0, sizeof sq0);
        memcpy(d_r2 + 8, &sq1, sizeof sq1);
        if (m < 16) {
            memcpy(lo + j, t_lo, (size_t)m * sizeof(float));
            memcpy(hi + j, t_hi, (size_t)m * sizeof(float));
            memcpy(r2 + j, t_r2, (size_t)m * sizeof(double));
        }
    }
    {
        int32_t f[16];
        int k;
        memcpy(f, &all_finite, sizeof f);
        for (k = 0; k < 16; k++)
            *bad |= !f[k];
    }
    return half;
}
#endif

/* One level of the forward transform: r[j] = hypotf(x[2j], x[2j+1]) and [lo[j], hi[j]] around
 * atan2f(x[2j+1], x[2j]) (lo = -4, hi = 4 for the pairs libm must decide: a zero element).
 * `r2` is scratch for `half` doubles. Returns 1 when a value is not finite: the caller redoes the
 * level with libm. */
KVQ_CLONES
static int kvq_polar_forward_level(const float *x, int64_t half, float *r, float *lo, float *hi,
                                   double *r2)
{
    int64_t j = 0;
    int bad = 0;
#if KVQ_X86_PATHS
    if (!kvq_polar_portable && __builtin_cpu_supports("avx512f"))
        j = kvq_polar_forward16_avx512(x, half, lo, hi, r2, &bad);
#endif
#if KVQ_VEC
    kvq_v8i all_finite = (kvq_v8i){0} - 1;   /* lanes stay -1 while every value is finite */
    for (; j < half; j += 8) {
        /* a short last block from a copy padded with finite pairs (their results dropped): every
         * pair gets the float bracket, wherever it sits */
        const int64_t m = half - j < 8 ? half - j : 8;
        float in[16], t_lo[8], t_hi[8];
        double t_r2[8];
        const float *src = x + 2 * j;
        float *d_lo = lo + j, *d_hi = hi + j;
        double *d_r2 = r2 + j;
        int i;
        if (m < 8) {
            for (i = 0; i < 16; i++)
                in[i] = 1.0f;
            memcpy(in, src, (size_t)(2 * m) * sizeof(float));
            src = in;
            d_lo = t_lo;
            d_hi = t_hi;
            d_r2 = t_r2;
        }
        const kvq_v16f v = kvq_load16(src);
        const kvq_v8f af = __builtin_shufflevector(v, v, 0, 2, 4, 6, 8, 10, 12, 14);
        const kvq_v8f cf = __builtin_shufflevector(v, v, 1, 3, 5, 7, 9, 11, 13, 15);
        const kvq_v8d ad = __builtin_convertvector(af, kvq_v8d);
        const kvq_v8d cd = __builtin_convertvector(cf, kvq_v8d);
        const kvq_v8f th = kvq_atan2_approx8f(af, cf);
        const kvq_v8f pad = (kvq_v8f)((kvq_v8i)th & ((kvq_v8i){0} + 0x7fffffff))
                            * (float)KVQ_ANGLE_PAD_REL + (float)KVQ_ANGLE_PAD_ABS;
        const kvq_v8i exact = (af != 0.0f) & (cf != 0.0f);
        const kvq_v8i finite = (af <= FLT_MAX) & (af >= -FLT_MAX) & (cf <= FLT_MAX)
                               & (cf >= -FLT_MAX);
        const kvq_v8f th_lo = th - pad;
        const kvq_v8f th_hi = th + pad;
        const kvq_v8f open = (kvq_v8f){0} + KVQ_ANGLE_OPEN;
        const kvq_v8d sq = ad * ad + cd * cd;
        kvq_v8f out_lo, out_hi;
        out_lo = (kvq_v8f)((exact & (kvq_v8i)th_lo) | (~exact & (kvq_v8i)(-open)));
        out_hi = (kvq_v8f)((exact & (kvq_v8i)th_hi) | (~exact & (kvq_v8i)open));
        memcpy(d_lo, &out_lo, sizeof out_lo);
        memcpy(d_hi, &out_hi, sizeof out_hi);
        memcpy(d_r2, &sq, sizeof sq);
        all_finite &= finite;
        if (m < 8) {
            memcpy(lo + j, t_lo, (size_t)m * sizeof(float));
            memcpy(hi + j, t_hi, (size_t)m * sizeof(float));
            memcpy(r2 + j, t_r2, (size_t)m * sizeof(double));
        }
    }
    {
        int32_t f[8];
        int k;
        memcpy(f, &all_finite, sizeof f);
        for (k = 0; k < 8; k++)
            bad |= !f[k];
    }
#endif
    for (; j < half; j++)   /* without vector extensions: the double computation */
        bad |= kvq_polar_forward_pair(x, j, r2, lo, hi);
    kvq_sqrt_to_float(r2, half, r);
    return bad;
}

#if KVQ_X86_PATHS
/* kvq_polar_forward_row under AVX-512: the radii level by level (each level's inputs are the
 * radii of the one before), 16 pairs a vector, then the brackets of every level in one pass over
 * the tree: a pair's bracket depends on its own two values only, so the levels' short blocks
 * share vectors. Returns a bit per level (bit l: level l) holding a non-finite value. */
__attribute__((target("avx512f"))) static uint32_t
kvq_polar_forward_row_avx512(float *tree, int64_t n, float *lo, float *hi)
{
    typedef double kvq_v8d_ __attribute__((vector_size(64)));
    typedef float kvq_v8f_ __attribute__((vector_size(32)));
    int64_t rlen, in_off = 0, j;
    uint32_t bad_levels = 0;
    int level = 1;
    for (rlen = n; rlen > 16; rlen >>= 1, level++) {
        const int64_t half = rlen >> 1;
        const float *x = tree + in_off;
        float *r = tree + in_off + rlen;
        kvq_v16i all_finite = (kvq_v16i){0} - 1;
        for (j = 0; j < half; j += 16) {
            const int64_t m = half - j < 16 ? half - j : 16;
            float in[32], out[16];
            const float *src = x + 2 * j;
            int i;
            if (m < 16) {
                /* a short block from a copy padded with finite pairs (results dropped) */
                for (i = 0; i < 32; i++)
                    in[i] = 1.0f;
                memcpy(in, src, (size_t)(2 * m) * sizeof(float));
                src = in;
            }
            {
                const kvq_v16f v0 = kvq_load16(src), v1 = kvq_load16(src + 16);
                const kvq_v16f af = __builtin_shufflevector(v0, v1, 0, 2, 4, 6, 8, 10, 12, 14, 16,
                                                            18, 20, 22, 24, 26, 28, 30);
                const kvq_v16f cf = __builtin_shufflevector(v0, v1, 1, 3, 5, 7, 9, 11, 13, 15, 17,
                                                            19, 21, 23, 25, 27, 29, 31);
                const kvq_v8d_ ad0 = __builtin_convertvector(
                    __builtin_shufflevector(af, af, 0, 1, 2, 3, 4, 5, 6, 7), kvq_v8d_);
                const kvq_v8d_ ad1 = __builtin_convertvector(
                    __builtin_shufflevector(af, af, 8, 9, 10, 11, 12, 13, 14, 15), kvq_v8d_);
                const kvq_v8d_ cd0 = __builtin_convertvector(
                    __builtin_shufflevector(cf, cf, 0, 1, 2, 3, 4, 5, 6, 7), kvq_v8d_);
                const kvq_v8d_ cd1 = __builtin_convertvector(
                    __builtin_shufflevector(cf, cf, 8, 9, 10, 11, 12, 13, 14, 15), kvq_v8d_);
                /* glibc's hypotf of finite floats: (float) sqrt(a^2 + c^2) in double */
                const __m256 r0 = _mm512_cvtpd_ps(_mm512_sqrt_pd((__m512d)(ad0 * ad0 + cd0 * cd0)));
                const __m256 r1 = _mm512_cvtpd_ps(_mm512_sqrt_pd((__m512d)(ad1 * ad1 + cd1 * cd1)));
                all_finite &= (af <= FLT_MAX) & (af >= -FLT_MAX) & (cf <= FLT_MAX)
                              & (cf >= -FLT_MAX);
                if (m == 16) {
                    _mm256_storeu_ps(r + j, r0);
                    _mm256_storeu_ps(r + j + 8, r1);
                } else {
                    _mm256_storeu_ps(out, r0);
                    _mm256_storeu_ps(out + 8, r1);
                    memcpy(r + j, out, (size_t)m * sizeof(float));
                }
            }
        }
        if (_mm512_cmpneq_epi32_mask((__m512i)all_finite, _mm512_set1_epi32(-1)) != 0) {
            /* libm's radii for a level holding a non-finite value */
            bad_levels |= 1u << level;
            for (j = 0; j < half; j++)
                r[j] = hypotf(x[2 * j], x[2 * j + 1]);
        }
        in_off += rlen;
    }
    if (rlen > 1) {
        /* the levels of 8 pairs or fewer in one register, each level's radii the next one's
         * pairs (lanes past a level's values hold 1: finite, results dropped) */
        const kvq_v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const kvq_v16f ones = (kvq_v16f){0} + 1.0f;
        kvq_v16f x = (kvq_v16f)_mm512_mask_loadu_ps((__m512)ones, (__mmask16)((1u << rlen) - 1u),
                                                   tree + in_off);
        for (; rlen > 1; rlen >>= 1, level++) {
            const int64_t half = rlen >> 1;
            const kvq_v8f_ af = __builtin_shufflevector(x, x, 0, 2, 4, 6, 8, 10, 12, 14);
            const kvq_v8f_ cf = __builtin_shufflevector(x, x, 1, 3, 5, 7, 9, 11, 13, 15);
            const kvq_v8d_ ad = __builtin_convertvector(af, kvq_v8d_);
            const kvq_v8d_ cd = __builtin_convertvector(cf, kvq_v8d_);
            const __m256 r8 = _mm512_cvtpd_ps(_mm512_sqrt_pd((__m512d)(ad * ad + cd * cd)));
            const __mmask16 live = (__mmask16)((1u << rlen) - 1u);
            float *r = tree + in_off + rlen;
            if (_mm512_mask_cmp_ps_mask(live, _mm512_abs_ps((__m512)x),
                                        _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ) != 0) {
                const float *xi = tree + in_off;
                bad_levels |= 1u << level;
                for (j = 0; j < half; j++)
                    r[j] = hypotf(xi[2 * j], xi[2 * j + 1]);
                x = (kvq_v16f)_mm512_mask_loadu_ps((__m512)ones,
                                                   (__mmask16)((1u << half) - 1u), r);
            } else {
                _mm512_mask_storeu_ps(r, (__mmask16)((1u << half) - 1u), _mm512_castps256_ps512(r8));
                x = kvq_sel16f(lane < (int32_t)half,
                               __builtin_shufflevector((kvq_v8f_)r8, (kvq_v8f_)r8, 0, 1, 2, 3, 4,
                                                       5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7),
                               ones);
            }
            in_off += rlen;
        }
    }
    /* the brackets of all n - 1 pairs: tree[0 .. 2 (n - 1)) */
    for (j = 0; j < n - 1; j += 16) {
        const int64_t m = n - 1 - j < 16 ? n - 1 - j : 16;
        float in[32], b_lo[16], b_hi[16];
        const float *src = tree + 2 * j;
        kvq_v16f out_lo, out_hi;
        int i;
        if (m < 16) {
            for (i = 0; i < 32; i++)
                in[i] = 1.0f;
            memcpy(in, src, (size_t)(2 * m) * sizeof(float));
            src = in;
        }
        {
            const kvq_v16f v0 = kvq_load16(src), v1 = kvq_load16(src + 16);
            const kvq_v16f af = __builtin_shufflevector(v0, v1, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18,
                                                        20, 22, 24, 26, 28, 30);
            const kvq_v16f cf = __builtin_shufflevector(v0, v1, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19,
                                                        21, 23, 25, 27, 29, 31);
            kvq_polar_brackets16(af, cf, &out_lo, &out_hi);
        }
        if (m == 16) {
            kvq_store16(lo + j, out_lo);
            kvq_store16(hi + j, out_hi);
        } else {
            kvq_store16(b_lo, out_lo);
            kvq_store16(b_hi, out_hi);
            memcpy(lo + j, b_lo, (size_t)m * sizeof(float));
            memcpy(hi + j, b_hi, (size_t)m * sizeof(float));
        }
    }
    return bad_levels;
}
#endif

/* The forward transform of a row: tree[0 .. n) holds the rotated row; level l's inputs are at
 * tree[2 (n - (n >> (l - 1))) ...), its radii (the next level's inputs) follow them, and the
 * brackets of its angles are at lo, hi [n - (n >> (l - 1)) ...) (tree holds 2 n floats, lo and hi
 * n - 1, r2 n / 2 doubles of scratch). A level holding a non-finite value takes libm's radii
 * (hypotf) and brackets open wide (-4, 4: every angle then goes to atan2f). */
static void kvq_polar_forward_row(float *tree, int64_t n, float *lo, float *hi, double *r2)
{
    int64_t rlen, in_off = 0, off = 0, j;
    uint32_t bad_levels = 0;
    int level;
#if KVQ_X86_PATHS
    if (!kvq_polar_portable && __builtin_cpu_supports("avx512f")) {
        bad_levels = kvq_polar_forward_row_avx512(tree, n, lo, hi);
    } else
#endif
    {
        for (rlen = n, level = 1; rlen > 1; rlen >>= 1, level++) {
            const int64_t half = rlen >> 1;
            if (kvq_polar_forward_level(tree + in_off, half, tree + in_off + rlen, lo + off,
                                        hi + off, r2)) {
                bad_levels |= 1u << level;
                for (j = 0; j < half; j++)
                    tree[in_off + rlen + j] = hypotf(tree[in_off + 2 * j],
                                                     tree[in_off + 2 * j + 1]);
            }
            off += half;
            in_off += rlen;
        }
    }
    if (bad_levels != 0)
        for (rlen = n, level = 1, off = 0; rlen > 1; rlen >>= 1, level++) {
            if (bad_levels & (1u << level))
                for (j = 0; j < rlen >> 1; j++) {
                    lo[off + j] = -KVQ_ANGLE_OPEN;
                    hi[off + j] = KVQ_ANGLE_OPEN;
                }
            off += rlen >> 1;
        }
}

/* The codec's column table of a level (polar.pyx's boundary_columns), KVQ_POLAR_COL_ROWS rows
 * of 16 lanes, lane w for width w (0..8; lanes past 8 as width 0): rows k < KVQ_POLAR_COLS hold
 * the k-th boundary of every width that the vector path compares (widths up to 5), +inf past a
 * width's boundaries (and for a width without a codebook: code 0); then the header of each
 * width's bucket table (rowops.h) for the gathers: lo, scale, n_buckets - 1, window, and where
 * its starts and its boundaries begin in the level's tables (integers, exact in float). */
#define KVQ_POLAR_COLS 31
#define KVQ_POLAR_COL_LO (KVQ_POLAR_COLS + 0)
#define KVQ_POLAR_COL_SCALE (KVQ_POLAR_COLS + 1)
#define KVQ_POLAR_COL_TOP (KVQ_POLAR_COLS + 2)
#define KVQ_POLAR_COL_WINDOW (KVQ_POLAR_COLS + 3)
#define KVQ_POLAR_COL_START (KVQ_POLAR_COLS + 4)
#define KVQ_POLAR_COL_BVAL (KVQ_POLAR_COLS + 5)
#define KVQ_POLAR_COL_ROWS (KVQ_POLAR_COLS + 6)

#if KVQ_CODE_PLAN
/* Blocks whose widest lane has more bits than this take the bucket tables by gathers; narrower
 * ones count their boundaries (2^w - 1 compares: cheaper up to 4 bits). */
#define KVQ_POLAR_GATHER_ABOVE 4

/* kvq_polar_lloyd_codes sixteen angles at a time. Narrow blocks: each lane's code is the count
 * of its width's boundaries below the bracket end (each boundary column permuted to the lanes'
 * widths; the same rule as the bucket tables, #{boundaries < v}). Wide blocks: kvq_code_lookup
 * lane by lane, its float operations in vectors, the bucket starts and boundaries gathered from
 * each lane's table. Under AVX-512 (rowops.h's KVQ_CODE_PLAN: GCC's permutations). */
__attribute__((target("avx512f"))) static int64_t
kvq_polar_lloyd_codes_avx512(const float *lo, const float *hi, int64_t cnt, const uint8_t *width,
                             const float *tables, int64_t stride, const float *cols,
                             uint8_t *code, int32_t *undecided)
{
    typedef uint8_t kvq_v16u8 __attribute__((vector_size(16)));
    int64_t j, n_undecided = 0;
    int k;
    const kvq_v16f t_lo = kvq_load16(cols + 16 * KVQ_POLAR_COL_LO);
    const kvq_v16f t_scale = kvq_load16(cols + 16 * KVQ_POLAR_COL_SCALE);
    const kvq_v16f t_top = kvq_load16(cols + 16 * KVQ_POLAR_COL_TOP);
    const kvq_v16i t_win = __builtin_convertvector(kvq_load16(cols + 16 * KVQ_POLAR_COL_WINDOW),
                                                   kvq_v16i);
    const kvq_v16i t_start = __builtin_convertvector(kvq_load16(cols + 16 * KVQ_POLAR_COL_START),
                                                     kvq_v16i);
    const kvq_v16i t_bval = __builtin_convertvector(kvq_load16(cols + 16 * KVQ_POLAR_COL_BVAL),
                                                    kvq_v16i);
    (void)stride;
    for (j = 0; j < cnt; j += 16) {
        const int m = cnt - j < 16 ? (int)(cnt - j) : 16;
        int w_max;
        kvq_v16u8 w8, c8;
        uint32_t mask;
        kvq_v16i wi, c_lo = {0}, c_hi = {0};
        kvq_v16f v_lo, v_hi;
        if (m == 16) {
            v_lo = kvq_load16(lo + j);
            v_hi = kvq_load16(hi + j);
            memcpy(&w8, width + j, 16);
        } else {
            /* the last block of a level: zero lanes past its end */
            float b_lo[16] = {0}, b_hi[16] = {0};
            uint8_t b_w[16] = {0};
            memcpy(b_lo, lo + j, (size_t)m * sizeof(float));
            memcpy(b_hi, hi + j, (size_t)m * sizeof(float));
            memcpy(b_w, width + j, (size_t)m);
            v_lo = kvq_load16(b_lo);
            v_hi = kvq_load16(b_hi);
            memcpy(&w8, b_w, 16);
        }
        wi = __builtin_convertvector(w8, kvq_v16i);
        w_max = _mm512_reduce_max_epi32((__m512i)wi);
        if (w_max <= KVQ_POLAR_GATHER_ABOVE) {
            const int n_cmp = (1 << w_max) - 1;
            for (k = 0; k < n_cmp; k++) {
                const kvq_v16f bk = __builtin_shuffle(kvq_load16(cols + 16 * k), wi);
                c_lo -= v_lo > bk;                                    /* true is -1 */
                c_hi -= v_hi > bk;
            }
        } else {
            /* kvq_code_bucket and kvq_code_lookup (rowops.h), the same float operations */
            const kvq_v16f l0 = __builtin_shuffle(t_lo, wi), sc = __builtin_shuffle(t_scale, wi);
            const kvq_v16f top = __builtin_shuffle(t_top, wi);
            const kvq_v16i win = __builtin_shuffle(t_win, wi);
            const kvq_v16i st = __builtin_shuffle(t_start, wi), bv = __builtin_shuffle(t_bval, wi);
            const int w_win = _mm512_reduce_max_epi32((__m512i)win);
            kvq_v16f f_lo = (v_lo - l0) * sc, f_hi = (v_hi - l0) * sc;
            kvq_v16i b_lo, b_hi;
            f_lo = kvq_sel16f(f_lo > 0.0f, f_lo, (kvq_v16f){0});
            f_hi = kvq_sel16f(f_hi > 0.0f, f_hi, (kvq_v16f){0});
            f_lo = kvq_sel16f(f_lo < top, f_lo, top);
            f_hi = kvq_sel16f(f_hi < top, f_hi, top);
            b_lo = __builtin_convertvector(f_lo, kvq_v16i);
            b_hi = __builtin_convertvector(f_hi, kvq_v16i);
            c_lo = (kvq_v16i)_mm512_cvttps_epi32(
                _mm512_i32gather_ps((__m512i)(st + b_lo), tables, 4));
            c_hi = (kvq_v16i)_mm512_cvttps_epi32(
                _mm512_i32gather_ps((__m512i)(st + b_hi), tables, 4));
            for (k = 0; k < w_win; k++) {
                const __mmask16 live = _mm512_cmpgt_epi32_mask((__m512i)win,
                                                               _mm512_set1_epi32(k));
                const kvq_v16f g_lo = (kvq_v16f)_mm512_mask_i32gather_ps(
                    _mm512_setzero_ps(), live, (__m512i)(bv + b_lo * win + k), tables, 4);
                const kvq_v16f g_hi = (kvq_v16f)_mm512_mask_i32gather_ps(
                    _mm512_setzero_ps(), live, (__m512i)(bv + b_hi * win + k), tables, 4);
                c_lo -= (g_lo < v_lo) & (win > k);
                c_hi -= (g_hi < v_hi) & (win > k);
            }
        }
        c8 = __builtin_convertvector(c_lo, kvq_v16u8);
        memcpy(code + j, &c8, (size_t)m);
        /* the lanes whose ends differ (rare), in increasing order */
        mask = _mm512_cmpneq_epi32_mask((__m512i)c_lo, (__m512i)c_hi) & ((1u << m) - 1u);
        while (mask != 0) {
            undecided[n_undecided++] = (int32_t)(j + __builtin_ctz(mask));
            mask &= mask - 1u;
        }
    }
    return n_undecided;
}
#endif

/* Lloyd codes of the cnt angles of one level from their brackets: code[j] = the code of lo[j]
 * through the table of width[j] (tables + width * stride: the level's row of the codec's bucket
 * tables, rowops.h); the indices j whose bracket ends get different codes are listed in
 * `undecided` in increasing order (their angles must come from atan2f). Returns how many.
 * `cols` (the level's column table, or NULL) lets AVX-512 count boundaries in vectors. */
KVQ_CLONES
static int64_t kvq_polar_lloyd_codes(const float *lo, const float *hi, int64_t cnt,
                                     const uint8_t *width, const float *tables, int64_t stride,
                                     const float *cols, uint8_t *code, int32_t *undecided)
{
    int64_t j, n_undecided = 0;
#if KVQ_CODE_PLAN
    if (cols != NULL && !kvq_polar_portable && __builtin_cpu_supports("avx512f"))
        return kvq_polar_lloyd_codes_avx512(lo, hi, cnt, width, tables, stride, cols, code,
                                            undecided);
#else
    (void)cols;
#endif
    for (j = 0; j < cnt; j++) {
        const float *t = tables + width[j] * stride;
        const int32_t b = kvq_code_bucket(t, lo[j]);
        int q;
        if (t[3] == 1.0f && kvq_code_bucket(t, hi[j]) == b) {
            /* one bucket (nearly always): one boundary decides both ends */
            const float bv = t[KVQ_CODE_TABLE_HEADER + (int32_t)t[2] + b];
            q = (int32_t)t[KVQ_CODE_TABLE_HEADER + b] + (bv < lo[j]);
            undecided[n_undecided] = (int32_t)j;
            n_undecided += (bv < lo[j]) != (bv < hi[j]);
        } else {
            q = kvq_code_lookup(t, lo[j]);
            undecided[n_undecided] = (int32_t)j;
            n_undecided += q != kvq_code_lookup(t, hi[j]);
        }
        code[j] = (uint8_t)q;
    }
    return n_undecided;
}

#if KVQ_X86_PATHS
/* kvq_polar_pack with BMI2 (on the AVX-512 path: CPUs whose pext is fast): eight codes at a
 * time, each width's mask (2^w - 1) by a byte shuffle, the codes' bits gathered by one pext. */
__attribute__((target("bmi2,popcnt,ssse3"))) static int64_t
kvq_polar_pack_bmi2(const uint8_t *code, const uint8_t *width, int64_t n, uint8_t *row,
                    uint64_t *acc_out, int *filled_out, int64_t *o_out)
{
    const __m128i masks = _mm_setr_epi8(0, 1, 3, 7, 15, 31, 63, 127, (char)255, 0, 0, 0, 0, 0, 0,
                                        0);
    unsigned __int128 acc = 0;
    int filled = 0;
    int64_t i = 0, o = 0;
    for (; i + 16 <= n; i += 16) {
        const __m128i mk = _mm_shuffle_epi8(masks, _mm_loadu_si128((const __m128i *)(width + i)));
        uint64_t m[2], c[2];
        int h;
        _mm_storeu_si128((__m128i *)m, mk);
        memcpy(c, code + i, 16);
        for (h = 0; h < 2; h++) {
            acc |= (unsigned __int128)_pext_u64(c[h], m[h]) << filled;
            filled += (int)_mm_popcnt_u64(m[h]);
            if (filled >= 64) {
                const uint64_t lo64 = (uint64_t)acc;
                int b;
                for (b = 0; b < 8; b++)
                    row[o + b] = (uint8_t)(lo64 >> (8 * b));
                o += 8;
                acc >>= 64;
                filled -= 64;
            }
        }
    }
    /* the rest: the caller's loop, from this state (filled < 64 bits) */
    while (filled >= 32) {
        const uint64_t lo64 = (uint64_t)acc;
        row[o] = (uint8_t)lo64;
        row[o + 1] = (uint8_t)(lo64 >> 8);
        row[o + 2] = (uint8_t)(lo64 >> 16);
        row[o + 3] = (uint8_t)(lo64 >> 24);
        o += 4;
        acc >>= 32;
        filled -= 32;
    }
    *acc_out = (uint64_t)acc;
    *filled_out = filled;
    *o_out = o;
    return i;
}
#endif

/* n codes of width[i] bits (0..8) into the zeroed row, LSB first from bit 0, in index order. */
static void kvq_polar_pack(const uint8_t *code, const uint8_t *width, int64_t n, uint8_t *row)
{
    uint64_t acc = 0;
    int filled = 0;
    int64_t i = 0, o = 0;
#if KVQ_X86_PATHS
    if (!kvq_polar_portable && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("bmi2"))
        i = kvq_polar_pack_bmi2(code, width, n, row, &acc, &filled, &o);
#endif
    for (; i < n; i++) {
        acc |= (uint64_t)code[i] << filled;
        filled += width[i];
        if (filled >= 32) {
            row[o] = (uint8_t)acc;
            row[o + 1] = (uint8_t)(acc >> 8);
            row[o + 2] = (uint8_t)(acc >> 16);
            row[o + 3] = (uint8_t)(acc >> 24);
            o += 4;
            acc >>= 32;
            filled -= 32;
        }
    }
    for (; filled > 0; filled -= 8) {
        row[o++] = (uint8_t)acc;
        acc >>= 8;
    }
}

#endif /* KVQ_POLAR_ENCODE_H */
