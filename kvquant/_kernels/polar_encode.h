/* The polar encoder's row operations (kvquant/_kernels/polar.pyx): the forward transform without
 * per-angle libm calls, the Lloyd codes of a level from bucket tables, the variable-width packing.
 *
 * One level maps the pairs (a, c) = (x[2j], x[2j+1]) to radii r[j] = hypotf(a, c) and angles
 * atan2f(c, a). The codes only need each angle's code, and every quantizer of the codec (the
 * engine's floor-and-clamp grids, the Lloyd boundaries) is a monotone function of the float
 * angle. So the angle is computed approximately in double precision, vectorized, with a proven
 * error bound, and the float interval [lo, hi] around it certainly holds libm's atan2f(c, a):
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
 * zeros decide between 0 and pi, and between pi and -pi) always go to libm.
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
typedef int64_t kvq_v8l __attribute__((vector_size(64)));
typedef float kvq_v8f __attribute__((vector_size(32)));
typedef int32_t kvq_v8i __attribute__((vector_size(32)));

/* m ? a : b lane by lane (m from a vector compare: all ones or zeros) */
KVQ_INLINE kvq_v8d kvq_sel8d(kvq_v8l m, kvq_v8d a, kvq_v8d b)
{
    return (kvq_v8d)((m & (kvq_v8l)a) | (~m & (kvq_v8l)b));
}

/* kvq_atan2_approx on 8 lanes: the same formulas, selects instead of branches. */
KVQ_INLINE kvq_v8d kvq_atan2_approx8(kvq_v8d a, kvq_v8d c)
{
    const kvq_v8l abs_mask = (kvq_v8l){0} + INT64_MAX;
    const kvq_v8d ax = (kvq_v8d)((kvq_v8l)a & abs_mask), ac = (kvq_v8d)((kvq_v8l)c & abs_mask);
    const kvq_v8l swap = ac > ax;
    const kvq_v8d num = kvq_sel8d(swap, ax, ac), den = kvq_sel8d(swap, ac, ax);
    const kvq_v8l reduce = num > 0.41421356237309503 * den;
    const kvq_v8d u = kvq_sel8d(reduce, num - den, num) / kvq_sel8d(reduce, num + den, den);
    const kvq_v8d u2 = u * u;
    kvq_v8d p = (kvq_v8d){0} + 1.0 / 13.0, th;
    p = p * u2 - 1.0 / 11.0;
    p = p * u2 + 1.0 / 9.0;
    p = p * u2 - 1.0 / 7.0;
    p = p * u2 + 1.0 / 5.0;
    p = p * u2 - 1.0 / 3.0;
    th = u + u * (u2 * p);
    th = kvq_sel8d(reduce, 0.78539816339744828 + th, th);
    th = kvq_sel8d(swap, 1.5707963267948966 - th, th);
    th = kvq_sel8d(a < 0.0, 3.1415926535897931 - th, th);
    return kvq_sel8d(c < 0.0, -th, th);
}
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
 * The same steps as kvq_atan2_approx in float arithmetic (twice the lanes of the double path).
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

__attribute__((target("avx512f"))) KVQ_INLINE kvq_v16f
kvq_atan2_approx16f(kvq_v16f a, kvq_v16f c)
{
    const kvq_v16i abs_mask = (kvq_v16i){0} + 0x7fffffff;
    const kvq_v16f ax = (kvq_v16f)((kvq_v16i)a & abs_mask), ac = (kvq_v16f)((kvq_v16i)c & abs_mask);
    const kvq_v16i swap = ac > ax;
    const kvq_v16f num = kvq_sel16f(swap, ax, ac), den = kvq_sel16f(swap, ac, ax);
    /* scaled by a power of two (exact): big pairs halved, tiny ones made normal */
    const kvq_v16f scale = kvq_sel16f(den > 1e38f, (kvq_v16f){0} + 0.5f,
                                      kvq_sel16f(den < 1e-30f, (kvq_v16f){0} + 18446744073709551616.0f,
                                                 (kvq_v16f){0} + 1.0f));
    const kvq_v16f ns = num * scale, ds = den * scale;
    const kvq_v16i reduce = ns > 0.41421356237309503f * ds;
    const kvq_v16f u = kvq_sel16f(reduce, ns - ds, ns) / kvq_sel16f(reduce, ns + ds, ds);
    const kvq_v16f u2 = u * u;
    kvq_v16f p = (kvq_v16f){0} + (float)(1.0 / 13.0), th;
    p = p * u2 - (float)(1.0 / 11.0);
    p = p * u2 + (float)(1.0 / 9.0);
    p = p * u2 - (float)(1.0 / 7.0);
    p = p * u2 + (float)(1.0 / 5.0);
    p = p * u2 - (float)(1.0 / 3.0);
    th = u + u * (u2 * p);
    th = kvq_sel16f(reduce, 0.78539816339744828f + th, th);
    th = kvq_sel16f(swap, 1.5707963267948966f - th, th);
    th = kvq_sel16f(a < 0.0f, 3.1415926535897931f - th, th);
    return kvq_sel16f(c < 0.0f, -th, th);
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
        const kvq_v16f th = kvq_atan2_approx16f(af, cf);
        const kvq_v16f pad = (kvq_v16f)((kvq_v16i)th & ((kvq_v16i){0} + 0x7fffffff))
                             * (float)KVQ_ANGLE_PAD_REL + (float)KVQ_ANGLE_PAD_ABS;
        const kvq_v16i exact = (af != 0.0f) & (cf != 0.0f);
        const kvq_v16f open = (kvq_v16f){0} + KVQ_ANGLE_OPEN;
        const kvq_v16f out_lo = kvq_sel16f(exact, th - pad, -open);
        const kvq_v16f out_hi = kvq_sel16f(exact, th + pad, open);
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
    for (; j + 8 <= half; j += 8) {
        const kvq_v16f v = kvq_load16(x + 2 * j);
        const kvq_v8f af = __builtin_shufflevector(v, v, 0, 2, 4, 6, 8, 10, 12, 14);
        const kvq_v8f cf = __builtin_shufflevector(v, v, 1, 3, 5, 7, 9, 11, 13, 15);
        const kvq_v8d ad = __builtin_convertvector(af, kvq_v8d);
        const kvq_v8d cd = __builtin_convertvector(cf, kvq_v8d);
        const kvq_v8d th = kvq_atan2_approx8(ad, cd);
        const kvq_v8l abs_mask = (kvq_v8l){0} + INT64_MAX;
        const kvq_v8d pad = (kvq_v8d)((kvq_v8l)th & abs_mask) * KVQ_ANGLE_PAD_REL
                            + KVQ_ANGLE_PAD_ABS;
        const kvq_v8i exact = (af != 0.0f) & (cf != 0.0f);
        const kvq_v8i finite = (af <= FLT_MAX) & (af >= -FLT_MAX) & (cf <= FLT_MAX)
                               & (cf >= -FLT_MAX);
        const kvq_v8f th_lo = __builtin_convertvector(th - pad, kvq_v8f);
        const kvq_v8f th_hi = __builtin_convertvector(th + pad, kvq_v8f);
        const kvq_v8f open = (kvq_v8f){0} + KVQ_ANGLE_OPEN;
        const kvq_v8d sq = ad * ad + cd * cd;
        kvq_v8f out_lo, out_hi;
        out_lo = (kvq_v8f)((exact & (kvq_v8i)th_lo) | (~exact & (kvq_v8i)(-open)));
        out_hi = (kvq_v8f)((exact & (kvq_v8i)th_hi) | (~exact & (kvq_v8i)open));
        memcpy(lo + j, &out_lo, sizeof out_lo);
        memcpy(hi + j, &out_hi, sizeof out_hi);
        memcpy(r2 + j, &sq, sizeof sq);
        all_finite &= finite;
    }
    {
        int32_t f[8];
        int k;
        memcpy(f, &all_finite, sizeof f);
        for (k = 0; k < 8; k++)
            bad |= !f[k];
    }
#endif
    for (; j < half; j++)
        bad |= kvq_polar_forward_pair(x, j, r2, lo, hi);
    kvq_sqrt_to_float(r2, half, r);
    return bad;
}

/* Boundaries per width that the vector path compares (widths up to 5); the codec's column table
 * of a level holds, for k < KVQ_POLAR_COLS, the k-th boundary of every width w (0..8) in lane w:
 * cols[16 k + w], +inf past a width's boundaries (and for a width without a codebook: code 0). */
#define KVQ_POLAR_COLS 31

#if KVQ_CODE_PLAN
/* kvq_polar_lloyd_codes sixteen angles at a time: each lane's code is the count of its width's
 * boundaries below the bracket end (each boundary column permuted to the lanes' widths; the
 * same rule as the bucket tables, #{boundaries < v}); lanes wider than 5 bits take the table.
 * Under AVX-512 (rowops.h's KVQ_CODE_PLAN: GCC's permutations). */
__attribute__((target("avx512f"))) static int64_t
kvq_polar_lloyd_codes_avx512(const float *lo, const float *hi, int64_t cnt, const uint8_t *width,
                             const float *tables, int64_t stride, const float *cols,
                             uint8_t *code, int32_t *undecided)
{
    typedef uint8_t kvq_v16u8 __attribute__((vector_size(16)));
    int64_t j, n_undecided = 0;
    int k, l;
    for (j = 0; j < cnt; j += 16) {
        const int m = cnt - j < 16 ? (int)(cnt - j) : 16;
        int32_t q_lo[16], q_hi[16];
        int w_max, w_cmp, n_cmp;
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
        /* the widest lane, and the widest the compares decide (up to 5 bits) */
        w_max = _mm512_reduce_max_epi32((__m512i)wi);
        w_cmp = _mm512_reduce_max_epi32((__m512i)(wi & (wi <= 5)));
        n_cmp = (1 << w_cmp) - 1;
        for (k = 0; k < n_cmp; k++) {
            const kvq_v16f bk = __builtin_shuffle(kvq_load16(cols + 16 * k), wi);
            c_lo -= v_lo > bk;                                    /* true is -1 */
            c_hi -= v_hi > bk;
        }
        if (w_max > 5) {
            memcpy(q_lo, &c_lo, sizeof q_lo);
            memcpy(q_hi, &c_hi, sizeof q_hi);
            for (l = 0; l < m; l++)
                if (width[j + l] > 5) {
                    const float *t = tables + width[j + l] * stride;
                    q_lo[l] = kvq_code_lookup(t, lo[j + l]);
                    q_hi[l] = kvq_code_lookup(t, hi[j + l]);
                }
            memcpy(&c_lo, q_lo, sizeof q_lo);
            memcpy(&c_hi, q_hi, sizeof q_hi);
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

/* n codes of width[i] bits (0..8) into the zeroed row, LSB first from bit 0, in index order. */
static void kvq_polar_pack(const uint8_t *code, const uint8_t *width, int64_t n, uint8_t *row)
{
    uint64_t acc = 0;
    int filled = 0;
    int64_t i, o = 0;
    for (i = 0; i < n; i++) {
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
