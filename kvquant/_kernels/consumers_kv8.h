/* Row kernels of the kv8 codecs (fp8 e4m3fn codes, one f32 scale per row or per group of G
 * elements). The codes are decoded inline to their exact e4m3 values v (no scale) and the scale is
 * factored out of each sum. Reduction order: simd.h, plus, by layout:
 *   per row (G == n):   score = tree16(lanes of q_i * v_i) * s
 *   G a multiple of 16: per group g, lane partials P_g (q_i * v_i over the group, per lane, from
 *                       +0); acc = acc + P_g * s_g per lane in group order; score = tree16(acc)
 *   any other G:        acc = acc + (q_i * v_i) * s_{g(i)} per lane; score = tree16(acc)
 *   context:            acc_i = acc_i + (w_t * s_{t,g(i)}) * v_ti, rows in order.
 * The values v are exact, so the way they are obtained (a table here, integer bit moves in the
 * AVX-512 path) cannot change a result.
 */
#ifndef KVQ_CONSUMERS_KV8_H
#define KVQ_CONSUMERS_KV8_H

#include "simd.h"

/* e4m3fn value of a code, NaN codes (0x7F, 0xFF) as +0 as in the engine. */
static float kvq_e4m3_value(uint8_t c)
{
    uint32_t e = (c >> 3) & 15u, m = c & 7u, u;
    float f;
    if ((c & 0x7F) == 0x7F)
        return 0.0f;
    if (e == 0) {
        f = (float)m * 0x1p-9f;          /* subnormal: M * 2**-9 */
        memcpy(&u, &f, 4);
        u |= (uint32_t)(c & 0x80) << 24;
    } else {                             /* rebias the exponent 7 -> 127 */
        u = ((uint32_t)(c & 0x80) << 24) | (((uint32_t)(c & 0x7F) << 20) + (120u << 23));
    }
    memcpy(&f, &u, 4);
    return f;
}

static float kvq_e4m3_lut[256];

static void kvq_e4m3_init(void)
{
    int c;
    for (c = 0; c < 256; c++) kvq_e4m3_lut[c] = kvq_e4m3_value((uint8_t)c);
}

/* The portable path reads the values from a table: on the CPUs it is for, a table load per code
 * is faster than the integer decode (which compilers do not vectorize well here). */
static void kvq_kv8_dot_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                 int64_t r0, int64_t r1, const float* q, float* out)
{
    const int64_t n = p->dim, G = p->group, ns = p->n_side;
    float acc[16], part[16];
    int64_t t, i, g;
    int j;
    for (t = r0; t < r1; t++) {
        const uint8_t* c = codes + t * p->code_bytes;
        const float* s = side + t * ns;
        kvq_zero16(acc);
        if (G == n) {
            for (i = 0; i + 16 <= n; i += 16)
                for (j = 0; j < 16; j++) acc[j] = acc[j] + q[i + j] * kvq_e4m3_lut[c[i + j]];
            for (j = 0; i + j < n; j++) acc[j] = acc[j] + q[i + j] * kvq_e4m3_lut[c[i + j]];
            out[t] = kvq_tree16(acc) * s[0];
        } else if (G % 16 == 0) {
            for (g = 0; g < ns; g++) {
                kvq_zero16(part);
                for (i = g * G; i < (g + 1) * G; i += 16)
                    for (j = 0; j < 16; j++)
                        part[j] = part[j] + q[i + j] * kvq_e4m3_lut[c[i + j]];
                for (j = 0; j < 16; j++) acc[j] = acc[j] + part[j] * s[g];
            }
            out[t] = kvq_tree16(acc);
        } else {
            for (i = 0; i < n; i++)
                acc[i & 15] = acc[i & 15] + (q[i] * kvq_e4m3_lut[c[i]]) * s[i / G];
            out[t] = kvq_tree16(acc);
        }
    }
}

static void kvq_kv8_axpy_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                  int64_t r0, int64_t r1, const float* w, float* acc)
{
    const int64_t G = p->group, ns = p->n_side;
    int64_t t, i, g;
    for (t = r0; t < r1; t++) {
        const uint8_t* c = codes + t * p->code_bytes;
        const float* s = side + t * ns;
        for (g = 0; g < ns; g++) {
            const float cg = w[t] * s[g];
            for (i = g * G; i < (g + 1) * G; i++) acc[i] = acc[i] + cg * kvq_e4m3_lut[c[i]];
        }
    }
}

/* How the vector decoders take a run of codes (a block of 64 checked for special codes first). */
#define KVQ_E4M3_ANY 0
#define KVQ_E4M3_PLAIN 1
#define KVQ_E4M3_RAW 2   /* plain, the 2^120 folded into the other factor */

#if KVQ_PORTABLE_VECTORS
/* ---- the portable path's vector decoders (simd.h's vector extensions, any ISA) ----
 * The same integer moves as the AVX-512 decoders below, lane-wise on 16 lanes. */

/* Any special code (subnormal, zero, NaN: (c + 1) & 0x7F <= 8) among the first len codes at c
 * (len a multiple of 16). */
KVQ_INLINE int kvq_e4m3_special_portable(const uint8_t* c, int64_t len)
{
    kvq_pvb b, hit = {0};
    uint64_t h[2];
    int64_t i;
    for (i = 0; i < len; i += 16) {
        memcpy(&b, c + i, 16);
        hit |= (kvq_pvb)(((b + 1) & 0x7F) <= 8);
    }
    memcpy(h, &hit, 16);
    return (h[0] | h[1]) != 0;
}

/* 16 codes decoded as `how` says (KVQ_E4M3_*): each code moved to the top byte of its lane
 * (u = c << 24 plus bits below that the masks drop), so the arithmetic shift u >> 4 puts the sign in bit 31 and the low 7 bits at
 * bits 20-26 (the rebias-free float bits of the AVX-512 decoder). */
KVQ_INLINE kvq_pv kvq_e4m3_16_portable(const uint8_t* c, const int how)
{
    kvq_pvb b;
    kvq_pv out;
    int k;
    memcpy(&b, c, 16);
    for (k = 0; k < 4; k++) {
        const kvq_pv4u u = kvq_pvb_top4(b, k);   /* only bits 24-31 are used */
        kvq_pv4u v = (kvq_pv4u)((kvq_pv4i)u >> 4) & 0x87F00000u;
        if (how != KVQ_E4M3_RAW)
            v += 120u << 23;   /* rebias the exponent 7 -> 127 */
        if (how == KVQ_E4M3_ANY) {
            /* subnormals (and zero): M * 2**-9 with the sign; NaN codes: +0 */
            const kvq_pv4u sub = (kvq_pv4u)((u & 0x78000000u) == 0u);
            const kvq_pv4u nan = (kvq_pv4u)((u & 0x7F000000u) == 0x7F000000u);
            const kvq_pv4 vs = __builtin_convertvector((kvq_pv4i)((u >> 24) & 7u), kvq_pv4)
                               * 0x1p-9f;
            v = (((kvq_pv4u)vs | (u & 0x80000000u)) & sub) | (v & ~sub);
            v &= ~nan;
        }
        out.q[k] = (kvq_pv4)v;
    }
    return out;
}
#endif

#if KVQ_HAVE_X86_SIMD
/* 64 codes at c hold one whose value needs more than the exponent rebias: a subnormal (exponent 0,
 * zero included) or a NaN code. (c + 1) & 0x7F <= 8 exactly for magnitudes 0..7 and 0x7F. Rare in
 * real rows (a few per 10^4 codes), so a block that has one takes the general decoder. */
KVQ_TARGET_AVX512 static inline __mmask64 kvq_e4m3_special64(const uint8_t* c)
{
    const __m512i b = _mm512_loadu_si512((const void*)c);
    const __m512i t = _mm512_and_si512(_mm512_add_epi8(b, _mm512_set1_epi8(1)),
                                       _mm512_set1_epi8(0x7F));
    return _mm512_cmple_epu8_mask(t, _mm512_set1_epi8(8));
}

/* Any special code in the first n codes of NR rows (row stride cb)? */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE int kvq_e4m3_rows_special(const uint8_t* c, int64_t cb,
                                                                   int64_t n, const int NR)
{
    const int64_t n64 = n & ~(int64_t)63;
    __mmask64 m = 0;
    int64_t i;
    int k;
    for (k = 0; k < NR; k++) {
        for (i = 0; i < n64; i += 64) m |= kvq_e4m3_special64(c + k * cb + i);
        if (n64 < n) {
            const __mmask64 live = (__mmask64)(~0ULL >> (64 - (n - n64)));
            const __m512i b = _mm512_maskz_loadu_epi8(live, (const void*)(c + k * cb + n64));
            const __m512i t = _mm512_and_si512(_mm512_add_epi8(b, _mm512_set1_epi8(1)),
                                               _mm512_set1_epi8(0x7F));
            m |= live & _mm512_cmple_epu8_mask(t, _mm512_set1_epi8(8));
        }
    }
    return m != 0;
}

/* 16 codes (sign-extended to 32 bits) without special codes: rebias only. */
KVQ_TARGET_AVX512 static inline __m512 kvq_e4m3_plain16(__m512i x)
{
    x = _mm512_and_si512(_mm512_slli_epi32(x, 20), _mm512_set1_epi32((int)0x87F00000u));
    return _mm512_castsi512_ps(_mm512_add_epi32(x, _mm512_set1_epi32(120 << 23)));
}

/* Any 16 codes: rebias, then patch subnormals (M * 2**-9 with the sign) and NaN codes (+0). */
KVQ_TARGET_AVX512 static inline __m512 kvq_e4m3_any16(__m512i x)
{
    const __m512i sign = _mm512_and_si512(x, _mm512_set1_epi32((int)0x80000000u));
    const __mmask16 sub = _mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x78));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)),
                                                  _mm512_set1_epi32(0x7F));
    __m512 v = kvq_e4m3_plain16(x);
    __m512 vs = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(7))),
                              _mm512_set1_ps(0x1p-9f));
    vs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(vs), sign));
    v = _mm512_mask_mov_ps(v, sub, vs);
    return _mm512_maskz_mov_ps((__mmask16)~nan, v);
}

/* Plain codes moved into float bits without the rebias: value * 2^-120, exact and normal (no
 * subnormal codes in a plain block). The 2^120 then goes into the other factor of the product
 * (q * 2^120, or w * s * 2^120), exact while that factor stays below 2^7 in magnitude: the product
 * is the same real number, hence the same float. One integer add fewer per 16 codes. */
KVQ_TARGET_AVX512 static inline __m512 kvq_e4m3_raw16(__m512i x)
{
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(x, 20),
                                                _mm512_set1_epi32((int)0x87F00000u)));
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512 kvq_e4m3_16(const uint8_t* c, const int how)
{
    const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)c));
    return how == KVQ_E4M3_RAW ? kvq_e4m3_raw16(x)
         : how == KVQ_E4M3_PLAIN ? kvq_e4m3_plain16(x) : kvq_e4m3_any16(x);
}

/* max |x_i| < 2^7 (NaN fails): the 2^120 of the raw decode may be folded into x. */
KVQ_TARGET_AVX512 static inline int kvq_foldable(const float* x, int64_t n)
{
    const int64_t n16 = n & ~(int64_t)15;
    const __m512 lim = _mm512_set1_ps(128.0f);
    __mmask16 ok = 0xFFFF;
    int64_t i;
    for (i = 0; i < n16; i += 16)
        ok &= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + i)), lim, _CMP_LT_OQ);
    if (i < n) {
        const __mmask16 m = kvq_mask16(n - i);
        ok &= (__mmask16)(_mm512_mask_cmp_ps_mask(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + i)),
                                                  lim, _CMP_LT_OQ) | (__mmask16)~m);
    }
    return ok == 0xFFFF;
}

KVQ_TARGET_AVX512 static inline __m512 kvq_e4m3_16_masked(const uint8_t* c, __mmask16 m)
{
    return kvq_e4m3_any16(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const void*)c)));
}

/* Any special code among the first len codes at c (len a multiple of 16, at most 64). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE int kvq_e4m3_special_avx512(const uint8_t* c, int64_t len)
{
    const __mmask64 live = len >= 64 ? ~(__mmask64)0 : (__mmask64)(~0ULL >> (64 - len));
    const __m512i b = _mm512_maskz_loadu_epi8(live, (const void*)c);
    const __m512i t = _mm512_and_si512(_mm512_add_epi8(b, _mm512_set1_epi8(1)),
                                       _mm512_set1_epi8(0x7F));
    return (live & _mm512_cmple_epu8_mask(t, _mm512_set1_epi8(8))) != 0;
}

/* ---- AVX2: the same decoders, 8 lanes at a time ---- */
KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE int kvq_e4m3_special_avx2(const uint8_t* c, int64_t len)
{
    /* t = (c + 1) & 0x7F is 0..127, so t <= 8 is the signed compare 9 > t */
    __m256i hit = _mm256_setzero_si256();
    __m128i hit16 = _mm_setzero_si128();
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        const __m256i t = _mm256_and_si256(_mm256_add_epi8(
            _mm256_loadu_si256((const __m256i*)(c + i)), _mm256_set1_epi8(1)), _mm256_set1_epi8(0x7F));
        hit = _mm256_or_si256(hit, _mm256_cmpgt_epi8(_mm256_set1_epi8(9), t));
    }
    if (i < len) {   /* 16 codes left (len is a multiple of 16) */
        const __m128i t = _mm_and_si128(_mm_add_epi8(_mm_loadu_si128((const __m128i*)(c + i)),
                                                     _mm_set1_epi8(1)), _mm_set1_epi8(0x7F));
        hit16 = _mm_cmpgt_epi8(_mm_set1_epi8(9), t);
    }
    return !_mm256_testz_si256(hit, hit) || !_mm_testz_si128(hit16, hit16);
}

/* 8 codes sign-extended to 32 bits, decoded as `how` says (KVQ_E4M3_*, as kvq_e4m3_16). */
KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE __m256 kvq_e4m3_8_avx2(__m256i x, const int how)
{
    const __m256i raw = _mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32((int)0x87F00000u));
    __m256 v, vs;
    __m256i sub, nan;
    if (how == KVQ_E4M3_RAW)
        return _mm256_castsi256_ps(raw);
    v = _mm256_castsi256_ps(_mm256_add_epi32(raw, _mm256_set1_epi32(120 << 23)));
    if (how == KVQ_E4M3_PLAIN)
        return v;
    sub = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
    nan = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), _mm256_set1_epi32(0x7F));
    vs = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(7))),
                       _mm256_set1_ps(0x1p-9f));
    vs = _mm256_or_ps(vs, _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0x80000000u))));
    v = _mm256_blendv_ps(v, vs, _mm256_castsi256_ps(sub));
    return _mm256_andnot_ps(_mm256_castsi256_ps(nan), v);
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE kvq_v16x2 kvq_e4m3_16_avx2(const uint8_t* c, const int how)
{
    /* two 8-byte loads that the sign extensions take as memory operands (no byte shuffle) */
    kvq_v16x2 r;
    r.lo = kvq_e4m3_8_avx2(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)c)), how);
    r.hi = kvq_e4m3_8_avx2(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8))), how);
    return r;
}

/* Scale layouts with a vector path (others run the portable code, which defines the same bits). */
enum { KVQ_KV8_ROW = 0, KVQ_KV8_G16 = 1, KVQ_KV8_SMALL = 2, KVQ_KV8_OTHER = 3 };

static inline int kvq_kv8_layout(int64_t n, int64_t G)
{
    if (G == n) return KVQ_KV8_ROW;
    if (G % 16 == 0) return KVQ_KV8_G16;
    if (16 % G == 0 && n % 16 == 0) return KVQ_KV8_SMALL;
    return KVQ_KV8_OTHER;
}

/* G divides 16: the 16/G scales of a step spread over its lanes (lane j gets scale j / G). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512 kvq_kv8_lane_scales(const float* s, int64_t i,
                                                                    const int G, __m512i spread)
{
    /* G is a compile-time constant at every call: the divisions are shifts */
    return _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(kvq_mask16(16 / G), s + i / G));
}

KVQ_TARGET_AVX512 static inline __m512i kvq_kv8_spread(int64_t G)
{
    int32_t idx[16];
    int j;
    for (j = 0; j < 16; j++) idx[j] = (int32_t)(j / G);
    return _mm512_loadu_si512((const void*)idx);
}

/* Scores of NR (1 or 4) consecutive rows at c (scales at s), layout L. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_kv8_dot_rows(const kvq_params* p,
                                                               const uint8_t* c, const float* s,
                                                               const float* q, float* out,
                                                               const int NR, const int L,
                                                               const int Gs, __m512i spread,
                                                               const int fold)
{
    /* Gs: the group size of the small layout, a compile-time constant (no divisions here);
     * fold: max |q| < 2^7, so plain blocks may use the raw decode */
    const int64_t n = p->dim, n16 = n & ~(int64_t)15, cb = p->code_bytes, ns = p->n_side;
    const int64_t steps_per_group = L == KVQ_KV8_G16 ? p->group / 16 : 1;
    const __mmask16 tail = kvq_mask16(n - n16);
    __m512 acc[4], part[4], qv, pr;
    int64_t i = 0, i1, j, g = 0, left = steps_per_group;
    int k, plain;
    for (k = 0; k < NR; k++) acc[k] = part[k] = _mm512_setzero_ps();
#define KVQ_KV8_DOT_STEP(PLAIN)                                                              \
    qv = _mm512_loadu_ps(q + j);                                                             \
    if (PLAIN == KVQ_E4M3_RAW) qv = _mm512_mul_ps(qv, _mm512_set1_ps(0x1p120f));             \
    for (k = 0; k < NR; k++) {                                                               \
        pr = _mm512_mul_ps(qv, kvq_e4m3_16(c + k * cb + j, PLAIN));                          \
        if (L == KVQ_KV8_ROW) acc[k] = _mm512_add_ps(acc[k], pr);                            \
        else if (L == KVQ_KV8_G16) part[k] = _mm512_add_ps(part[k], pr);                     \
        else acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(pr,                                \
                          kvq_kv8_lane_scales(s + k * ns, j, Gs, spread)));                  \
    }                                                                                        \
    if (L == KVQ_KV8_G16 && --left == 0) {                                                   \
        for (k = 0; k < NR; k++) {                                                           \
            acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(part[k], _mm512_set1_ps(s[k * ns + g]))); \
            part[k] = _mm512_setzero_ps();                                                   \
        }                                                                                    \
        g++;                                                                                 \
        left = steps_per_group;                                                              \
    }
    if (!kvq_e4m3_rows_special(c, cb, n, NR)) {
        /* the common case: every code decodes by the rebias alone */
        if (fold)
            for (j = 0; j < n16; j += 16) {
                if (NR == 4 || (j & 63) == 0) kvq_prefetch(c + KVQ_PREFETCH_BYTES + NR * j);
                KVQ_KV8_DOT_STEP(KVQ_E4M3_RAW)
            }
        else
            for (j = 0; j < n16; j += 16) {
                if (NR == 4 || (j & 63) == 0) kvq_prefetch(c + KVQ_PREFETCH_BYTES + NR * j);
                KVQ_KV8_DOT_STEP(KVQ_E4M3_PLAIN)
            }
        i = n16;
    } else {
        /* a few blocks of 64 codes hold subnormal or NaN codes: only those decode in full */
        for (; i + 64 <= n16; i += 64) {
            __mmask64 m = 0;
            for (k = 0; k < NR; k++) {
                kvq_prefetch(c + KVQ_PREFETCH_BYTES + NR * i + 64 * k);
                m |= kvq_e4m3_special64(c + k * cb + i);
            }
            plain = m == 0;
            i1 = i + 64;
            if (plain)
                for (j = i; j < i1; j += 16) { KVQ_KV8_DOT_STEP(1) }
            else
                for (j = i; j < i1; j += 16) { KVQ_KV8_DOT_STEP(0) }
        }
    }
    for (j = i; j < n16; j += 16) { KVQ_KV8_DOT_STEP(0) }
#undef KVQ_KV8_DOT_STEP
    if (L == KVQ_KV8_ROW && tail) {
        qv = _mm512_maskz_loadu_ps(tail, q + n16);
        for (k = 0; k < NR; k++)
            acc[k] = _mm512_mask_add_ps(acc[k], tail, acc[k], _mm512_mul_ps(qv,
                                        kvq_e4m3_16_masked(c + k * cb + n16, tail)));
    }
    if (NR == 4) {
        __m128 r = kvq_tree16x4_avx512(acc[0], acc[1], acc[2], acc[3]);
        if (L == KVQ_KV8_ROW)
            r = _mm_mul_ps(r, _mm_setr_ps(s[0], s[ns], s[2 * ns], s[3 * ns]));
        _mm_storeu_ps(out, r);
    } else {
        for (k = 0; k < NR; k++)
            out[k] = L == KVQ_KV8_ROW ? kvq_tree16_avx512(acc[k]) * s[k * ns]
                                      : kvq_tree16_avx512(acc[k]);
    }
}

/* Context contribution of NR consecutive rows: acc += (w_t s_tg) v_t, rows in order. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_kv8_axpy_rows(const kvq_params* p,
                                                                const uint8_t* c, const float* s,
                                                                const float* w, float* acc,
                                                                const int NR, const int L,
                                                                const int Gs, __m512i spread)
{
    const int64_t n = p->dim, n16 = n & ~(int64_t)15, cb = p->code_bytes, ns = p->n_side;
    const int64_t steps_per_group = L == KVQ_KV8_G16 ? p->group / 16 : 1;
    const __mmask16 tail = kvq_mask16(n - n16);
    __m512 coef[4], coef_raw[4], wt[4], a;
    int64_t i = 0, i1, j, g = 0, left = 0;
    int k, plain, fold = L != KVQ_KV8_SMALL;
    for (k = 0; k < NR; k++) {
        wt[k] = _mm512_set1_ps(w[k]);
        coef[k] = _mm512_set1_ps(w[k] * s[k * ns]);
        coef_raw[k] = _mm512_mul_ps(coef[k], _mm512_set1_ps(0x1p120f));
        for (g = 0; fold && g < (L == KVQ_KV8_G16 ? ns : 1); g++)
            fold = fabsf(w[k] * s[k * ns + g]) < 128.0f;
    }
    g = 0;
#define KVQ_KV8_AXPY_STEP(PLAIN)                                                             \
    if (L == KVQ_KV8_G16 && left-- == 0) {                                                   \
        for (k = 0; k < NR; k++) {                                                           \
            coef[k] = _mm512_set1_ps(w[k] * s[k * ns + g]);                                  \
            coef_raw[k] = _mm512_mul_ps(coef[k], _mm512_set1_ps(0x1p120f));                  \
        }                                                                                    \
        g++;                                                                                 \
        left = steps_per_group - 1;                                                          \
    }                                                                                        \
    a = _mm512_loadu_ps(acc + j);                                                            \
    for (k = 0; k < NR; k++) {                                                               \
        if (L == KVQ_KV8_SMALL)                                                              \
            coef[k] = _mm512_mul_ps(wt[k], kvq_kv8_lane_scales(s + k * ns, j, Gs, spread));  \
        a = _mm512_add_ps(a, _mm512_mul_ps(PLAIN == KVQ_E4M3_RAW ? coef_raw[k] : coef[k],    \
                                           kvq_e4m3_16(c + k * cb + j, PLAIN)));             \
    }                                                                                        \
    _mm512_storeu_ps(acc + j, a);
    if (!kvq_e4m3_rows_special(c, cb, n, NR)) {
        /* the common case: every code decodes by the rebias alone */
        if (fold)
            for (j = 0; j < n16; j += 16) {
                if (NR == 4 || (j & 63) == 0) kvq_prefetch(c + KVQ_PREFETCH_BYTES + NR * j);
                KVQ_KV8_AXPY_STEP(KVQ_E4M3_RAW)
            }
        else
            for (j = 0; j < n16; j += 16) {
                if (NR == 4 || (j & 63) == 0) kvq_prefetch(c + KVQ_PREFETCH_BYTES + NR * j);
                KVQ_KV8_AXPY_STEP(KVQ_E4M3_PLAIN)
            }
        i = n16;
    } else {
        /* a few blocks of 64 codes hold subnormal or NaN codes: only those decode in full */
        for (; i + 64 <= n16; i += 64) {
            __mmask64 m = 0;
            for (k = 0; k < NR; k++) {
                kvq_prefetch(c + KVQ_PREFETCH_BYTES + NR * i + 64 * k);
                m |= kvq_e4m3_special64(c + k * cb + i);
            }
            plain = m == 0;
            i1 = i + 64;
            if (plain)
                for (j = i; j < i1; j += 16) { KVQ_KV8_AXPY_STEP(1) }
            else
                for (j = i; j < i1; j += 16) { KVQ_KV8_AXPY_STEP(0) }
        }
    }
    for (j = i; j < n16; j += 16) { KVQ_KV8_AXPY_STEP(0) }
#undef KVQ_KV8_AXPY_STEP
    if (L == KVQ_KV8_ROW && tail) {
        a = _mm512_maskz_loadu_ps(tail, acc + n16);
        for (k = 0; k < NR; k++)
            a = _mm512_add_ps(a, _mm512_mul_ps(coef[k], kvq_e4m3_16_masked(c + k * cb + n16, tail)));
        _mm512_mask_storeu_ps(acc + n16, tail, a);
    }
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_kv8_dot_layout(const kvq_params* p,
                                                                 const uint8_t* codes,
                                                                 const float* side, int64_t r0,
                                                                 int64_t r1, const float* q,
                                                                 float* out, const int L,
                                                                 const int Gs)
{
    const __m512i spread = L == KVQ_KV8_SMALL ? kvq_kv8_spread(Gs) : _mm512_setzero_si512();
    const int fold = kvq_foldable(q, p->dim);
    int64_t t = r0;
    for (; t + 4 <= r1; t += 4)
        kvq_kv8_dot_rows(p, codes + t * p->code_bytes, side + t * p->n_side, q, out + t, 4, L,
                         Gs, spread, fold);
    for (; t < r1; t++)
        kvq_kv8_dot_rows(p, codes + t * p->code_bytes, side + t * p->n_side, q, out + t, 1, L,
                         Gs, spread, fold);
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_kv8_axpy_layout(const kvq_params* p,
                                                                  const uint8_t* codes,
                                                                  const float* side, int64_t r0,
                                                                  int64_t r1, const float* w,
                                                                  float* acc, const int L,
                                                                  const int Gs)
{
    const __m512i spread = L == KVQ_KV8_SMALL ? kvq_kv8_spread(Gs) : _mm512_setzero_si512();
    int64_t t = r0;
    for (; t + 4 <= r1; t += 4)
        kvq_kv8_axpy_rows(p, codes + t * p->code_bytes, side + t * p->n_side, w + t, acc, 4, L,
                          Gs, spread);
    for (; t < r1; t++)
        kvq_kv8_axpy_rows(p, codes + t * p->code_bytes, side + t * p->n_side, w + t, acc, 1, L,
                          Gs, spread);
}

KVQ_TARGET_AVX512 static void kvq_kv8_dot_avx512(const kvq_params* p, const uint8_t* codes,
                                                 const float* side, int64_t r0, int64_t r1,
                                                 const float* q, float* out)
{
    switch (kvq_kv8_layout(p->dim, p->group)) {
    case KVQ_KV8_ROW: kvq_kv8_dot_layout(p, codes, side, r0, r1, q, out, KVQ_KV8_ROW, 0); break;
    case KVQ_KV8_G16: kvq_kv8_dot_layout(p, codes, side, r0, r1, q, out, KVQ_KV8_G16, 0); break;
    case KVQ_KV8_SMALL:
        switch (p->group) {
        case 1: kvq_kv8_dot_layout(p, codes, side, r0, r1, q, out, KVQ_KV8_SMALL, 1); break;
        case 2: kvq_kv8_dot_layout(p, codes, side, r0, r1, q, out, KVQ_KV8_SMALL, 2); break;
        case 4: kvq_kv8_dot_layout(p, codes, side, r0, r1, q, out, KVQ_KV8_SMALL, 4); break;
        default: kvq_kv8_dot_layout(p, codes, side, r0, r1, q, out, KVQ_KV8_SMALL, 8); break;
        }
        break;
    default: kvq_kv8_dot_portable(p, codes, side, r0, r1, q, out);
    }
}

KVQ_TARGET_AVX512 static void kvq_kv8_axpy_avx512(const kvq_params* p, const uint8_t* codes,
                                                  const float* side, int64_t r0, int64_t r1,
                                                  const float* w, float* acc)
{
    switch (kvq_kv8_layout(p->dim, p->group)) {
    case KVQ_KV8_ROW: kvq_kv8_axpy_layout(p, codes, side, r0, r1, w, acc, KVQ_KV8_ROW, 0); break;
    case KVQ_KV8_G16: kvq_kv8_axpy_layout(p, codes, side, r0, r1, w, acc, KVQ_KV8_G16, 0); break;
    case KVQ_KV8_SMALL:
        switch (p->group) {
        case 1: kvq_kv8_axpy_layout(p, codes, side, r0, r1, w, acc, KVQ_KV8_SMALL, 1); break;
        case 2: kvq_kv8_axpy_layout(p, codes, side, r0, r1, w, acc, KVQ_KV8_SMALL, 2); break;
        case 4: kvq_kv8_axpy_layout(p, codes, side, r0, r1, w, acc, KVQ_KV8_SMALL, 4); break;
        default: kvq_kv8_axpy_layout(p, codes, side, r0, r1, w, acc, KVQ_KV8_SMALL, 8); break;
        }
        break;
    default: kvq_kv8_axpy_portable(p, codes, side, r0, r1, w, acc);
    }
}
#else  /* no vector path in this build: the dispatcher never picks these */
#define kvq_kv8_dot_avx512 kvq_kv8_dot_portable
#define kvq_kv8_axpy_avx512 kvq_kv8_axpy_portable
#endif

#endif /* KVQ_CONSUMERS_KV8_H */
