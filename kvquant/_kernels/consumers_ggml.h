/* Row kernels of llama.cpp's block formats q8_0 and q4_0 (p->bits = 8 or 4). A row is blocks of
 * 32 values, each an fp16 scale d (little endian) followed by 32 int8 (q8_0, 34 bytes) or 16 bytes
 * of nibbles (q4_0, 18 bytes: byte j holds element j low and j + 16 high, value nibble - 8). The
 * values are small integers, exact in float; the block scale is factored out of each block's sum:
 *   score = tree16(acc), acc = acc + P_b * d_b per lane, in block order, where P_b is the block's
 *           lane partial sum of q_i * v_i over its two 16-element steps (from +0)
 *   context acc_i = acc_i + (w_t * d_tb) * v_ti, rows in order.
 * For the +rot variants the driver rotates the query and unrotates the context (as tq).
 */
#ifndef KVQ_CONSUMERS_GGML_H
#define KVQ_CONSUMERS_GGML_H

#include "simd.h"

#define KVQ_GGML_BLOCK 32

static inline float kvq_fp16_value(const uint8_t* b)
{
    const uint32_t h = (uint32_t)b[0] | ((uint32_t)b[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, u;
    float f;
    if (e == 0x1F) {
        u = sign | 0x7F800000u | (m << 13);
    } else if (e != 0) {
        u = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        u = sign;
    } else {   /* subnormal: m * 2^-24, exact in float */
        f = (float)m * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    memcpy(&f, &u, 4);
    return f;
}

/* The 32 values of a block into v (fixed-size loops that compilers vectorize). */
KVQ_INLINE void kvq_ggml_values32(const uint8_t* blk, float* v, const int q4)
{
    int j;
    if (q4)
        for (j = 0; j < 16; j++) {
            v[j] = (float)((int)(blk[2 + j] & 0x0F) - 8);
            v[16 + j] = (float)((int)(blk[2 + j] >> 4) - 8);
        }
    else
        for (j = 0; j < 32; j++) v[j] = (float)(int8_t)blk[2 + j];
}

KVQ_INLINE void kvq_ggml_dot_portable_q(const kvq_params* p, const uint8_t* codes,
                                        int64_t r0, int64_t r1, const float* q, float* out,
                                        const int q4)
{
    const int64_t nb = p->dim / KVQ_GGML_BLOCK, bb = q4 ? 18 : 34;
    float acc[16], part[16], v[32];
    int64_t t, b;
    int j;
    for (t = r0; t < r1; t++) {
        const uint8_t* row = codes + t * p->code_bytes;
        kvq_zero16(acc);
        for (b = 0; b < nb; b++) {
            const uint8_t* blk = row + b * bb;
            const float d = kvq_fp16_value(blk);
            const float* qb = q + 32 * b;
            kvq_ggml_values32(blk, v, q4);
            for (j = 0; j < 16; j++) part[j] = 0.0f + qb[j] * v[j];   /* from +0 */
            for (j = 0; j < 16; j++) part[j] = part[j] + qb[16 + j] * v[16 + j];
            for (j = 0; j < 16; j++) acc[j] = acc[j] + part[j] * d;
        }
        out[t] = kvq_tree16(acc);
    }
}

KVQ_INLINE void kvq_ggml_axpy_portable_q(const kvq_params* p, const uint8_t* codes,
                                         int64_t r0, int64_t r1, const float* w, float* acc,
                                         const int q4)
{
    const int64_t nb = p->dim / KVQ_GGML_BLOCK, bb = q4 ? 18 : 34;
    float v[32];
    int64_t t, b;
    int j;
    for (t = r0; t < r1; t++) {
        const uint8_t* row = codes + t * p->code_bytes;
        for (b = 0; b < nb; b++) {
            const uint8_t* blk = row + b * bb;
            const float c = w[t] * kvq_fp16_value(blk);
            float* a = acc + 32 * b;
            kvq_ggml_values32(blk, v, q4);
            for (j = 0; j < 32; j++) a[j] = a[j] + c * v[j];
        }
    }
}

static void kvq_ggml_dot_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                  int64_t r0, int64_t r1, const float* q, float* out)
{
    (void)side;
    if (p->bits == 4)
        kvq_ggml_dot_portable_q(p, codes, r0, r1, q, out, 1);
    else
        kvq_ggml_dot_portable_q(p, codes, r0, r1, q, out, 0);
}

static void kvq_ggml_axpy_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                   int64_t r0, int64_t r1, const float* w, float* acc)
{
    (void)side;
    if (p->bits == 4)
        kvq_ggml_axpy_portable_q(p, codes, r0, r1, w, acc, 1);
    else
        kvq_ggml_axpy_portable_q(p, codes, r0, r1, w, acc, 0);
}

#if KVQ_PORTABLE_VECTORS
/* The 32 values of a block as two 16-lane vectors (elements 0..15, 16..31): the portable path's
 * decoder (simd.h's vector extensions, any ISA). Each byte goes to the top of a 32-bit lane and
 * an arithmetic shift brings the value down with its sign: q8_0's int8 directly, q4_0's nibble n
 * as n ^ 8 read as a signed nibble, which is n - 8. The values are small integers, exact in float. */
KVQ_INLINE void kvq_ggml_values_portable(const uint8_t* blk, const int q4, kvq_pv* lo, kvq_pv* hi)
{
    kvq_pvb x, y;
    int k;
    memcpy(&x, blk + 2, 16);
    if (q4) {
        x ^= 0x88;
        for (k = 0; k < 4; k++) {
            const kvq_pv4u u = kvq_pvb_top4(x, k);
            lo->q[k] = __builtin_convertvector((kvq_pv4i)(u << 4) >> 28, kvq_pv4);
            hi->q[k] = __builtin_convertvector((kvq_pv4i)u >> 28, kvq_pv4);
        }
    } else {
        memcpy(&y, blk + 18, 16);
        for (k = 0; k < 4; k++) {
            lo->q[k] = __builtin_convertvector((kvq_pv4i)kvq_pvb_top4(x, k) >> 24, kvq_pv4);
            hi->q[k] = __builtin_convertvector((kvq_pv4i)kvq_pvb_top4(y, k) >> 24, kvq_pv4);
        }
    }
}
#endif

#if KVQ_HAVE_X86_SIMD
/* The 32 values of a block as two vectors (elements 0..15, 16..31). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_ggml_values(const uint8_t* blk, const int q4,
                                                              __m512* lo, __m512* hi)
{
    if (q4) {
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)));
        const __m512i eight = _mm512_set1_epi32(8);
        *lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(x, _mm512_set1_epi32(15)), eight));
        *hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(x, 4), eight));
    } else {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2))));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18))));
    }
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE float kvq_fp16_value_f16c(const uint8_t* b)
{
    uint16_t h;
    memcpy(&h, b, 2);
    return _cvtsh_ss(h);   /* exact widening, as kvq_fp16_value */
}

/* ---- AVX2: the block's values as two 16-lane pairs of registers ---- */
KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE void kvq_ggml_values_avx2(const uint8_t* blk, const int q4,
                                                                  kvq_v16x2* lo, kvq_v16x2* hi)
{
    if (q4) {
        const __m128i x = _mm_loadu_si128((const __m128i*)(blk + 2));
        const __m256i a = _mm256_cvtepu8_epi32(x), b = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(x, x));
        const __m256i f = _mm256_set1_epi32(15), e = _mm256_set1_epi32(8);
        lo->lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(a, f), e));
        lo->hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, f), e));
        hi->lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(a, 4), e));
        hi->hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), e));
    } else {
        lo->lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2))));
        lo->hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 10))));
        hi->lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 18))));
        hi->hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 26))));
    }
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE float kvq_fp16_value_avx2(const uint8_t* b)
{
    uint16_t h;
    memcpy(&h, b, 2);
    return _cvtsh_ss(h);
}

/* Scores of NR (1 or 4) consecutive rows. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_ggml_dot_rows(const kvq_params* p,
                                                                const uint8_t* c, const float* q,
                                                                float* out, const int NR,
                                                                const int q4)
{
    const int64_t nb = p->dim / KVQ_GGML_BLOCK, cb = p->code_bytes;
    const int64_t bb = q4 ? 18 : 34;
    __m512 acc[4], part, lo, hi, q0, q1;
    int64_t b;
    int k;
    for (k = 0; k < NR; k++) acc[k] = _mm512_setzero_ps();
    for (b = 0; b < nb; b++) {
        q0 = _mm512_loadu_ps(q + 32 * b);
        q1 = _mm512_loadu_ps(q + 32 * b + 16);
        for (k = 0; k < NR; k++) {
            const uint8_t* blk = c + k * cb + b * bb;
            kvq_prefetch(blk + KVQ_PREFETCH_BYTES);
            kvq_ggml_values(blk, q4, &lo, &hi);
            part = _mm512_add_ps(_mm512_setzero_ps(), _mm512_mul_ps(q0, lo));
            part = _mm512_add_ps(part, _mm512_mul_ps(q1, hi));
            acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(part, _mm512_set1_ps(kvq_fp16_value_f16c(blk))));
        }
    }
    if (NR == 4)
        _mm_storeu_ps(out, kvq_tree16x4_avx512(acc[0], acc[1], acc[2], acc[3]));
    else
        for (k = 0; k < NR; k++) out[k] = kvq_tree16_avx512(acc[k]);
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_ggml_axpy_rows(const kvq_params* p,
                                                                 const uint8_t* c, const float* w,
                                                                 float* acc, const int NR,
                                                                 const int q4)
{
    const int64_t nb = p->dim / KVQ_GGML_BLOCK, cb = p->code_bytes;
    const int64_t bb = q4 ? 18 : 34;
    __m512 a0, a1, lo, hi, coef;
    int64_t b;
    int k;
    for (b = 0; b < nb; b++) {
        a0 = _mm512_loadu_ps(acc + 32 * b);
        a1 = _mm512_loadu_ps(acc + 32 * b + 16);
        for (k = 0; k < NR; k++) {
            const uint8_t* blk = c + k * cb + b * bb;
            kvq_prefetch(blk + KVQ_PREFETCH_BYTES);
            kvq_ggml_values(blk, q4, &lo, &hi);
            coef = _mm512_set1_ps(w[k] * kvq_fp16_value_f16c(blk));
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(coef, lo));
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(coef, hi));
        }
        _mm512_storeu_ps(acc + 32 * b, a0);
        _mm512_storeu_ps(acc + 32 * b + 16, a1);
    }
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_ggml_dot_all(const kvq_params* p,
                                                               const uint8_t* codes, int64_t r0,
                                                               int64_t r1, const float* q,
                                                               float* out, const int q4)
{
    int64_t t = r0;
    for (; t + 4 <= r1; t += 4) kvq_ggml_dot_rows(p, codes + t * p->code_bytes, q, out + t, 4, q4);
    for (; t < r1; t++) kvq_ggml_dot_rows(p, codes + t * p->code_bytes, q, out + t, 1, q4);
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_ggml_axpy_all(const kvq_params* p,
                                                                const uint8_t* codes, int64_t r0,
                                                                int64_t r1, const float* w,
                                                                float* acc, const int q4)
{
    int64_t t = r0;
    for (; t + 4 <= r1; t += 4) kvq_ggml_axpy_rows(p, codes + t * p->code_bytes, w + t, acc, 4, q4);
    for (; t < r1; t++) kvq_ggml_axpy_rows(p, codes + t * p->code_bytes, w + t, acc, 1, q4);
}

KVQ_TARGET_AVX512 static void kvq_ggml_dot_avx512(const kvq_params* p, const uint8_t* codes,
                                                  const float* side, int64_t r0, int64_t r1,
                                                  const float* q, float* out)
{
    (void)side;
    if (p->bits == 4)
        kvq_ggml_dot_all(p, codes, r0, r1, q, out, 1);
    else
        kvq_ggml_dot_all(p, codes, r0, r1, q, out, 0);
}

KVQ_TARGET_AVX512 static void kvq_ggml_axpy_avx512(const kvq_params* p, const uint8_t* codes,
                                                   const float* side, int64_t r0, int64_t r1,
                                                   const float* w, float* acc)
{
    (void)side;
    if (p->bits == 4)
        kvq_ggml_axpy_all(p, codes, r0, r1, w, acc, 1);
    else
        kvq_ggml_axpy_all(p, codes, r0, r1, w, acc, 0);
}
#else  /* no vector path in this build: the dispatcher never picks these */
#define kvq_ggml_dot_avx512 kvq_ggml_dot_portable
#define kvq_ggml_axpy_avx512 kvq_ggml_axpy_portable
#endif

#endif /* KVQ_CONSUMERS_GGML_H */
