/* Row kernels of llama.cpp's block formats q4_1, q5_0, q5_1 and iq4_nl (docs/reference.md §3).
 * p->bits holds the block kind (kvquant._kernels.ggml KIND_*: 2 q4_1, 3 q5_0, 4 q5_1, 5 iq4_nl).
 * A block is 32 values: an fp16 scale d (little endian), for q4_1 / q5_1 an fp16 minimum m, for
 * q5_0 / q5_1 a little-endian uint32 qh (bit j = bit 4 of code j), then 16 bytes of nibbles (byte
 * j: code j low, code j + 16 high). The value v of a code is code - 16 (q5_0), code (q4_1, q5_1)
 * or the iq4_nl level K[code]; x = d v (+ m). Every v is a small integer, exact in float.
 *
 * Reduction order (the same in both paths, as simd.h defines it for the other families):
 *   score   per lane j: P_b = (+0 + q_(32b+j) v_(32b+j)) + q_(32b+16+j) v_(32b+16+j), and for the
 *           offset kinds S_b = (+0 + q_(32b+j)) + q_(32b+16+j);
 *           acc = acc + P_b d_b, then acc = acc + S_b m_b, in block order; score = tree16(acc).
 *   context acc_i = acc_i + (w_t d_tb) v_ti, then acc_i = acc_i + w_t m_tb, rows in order.
 * For the +rot variants the driver rotates the query and unrotates the context (as q4_0+rot).
 */
#ifndef KVQ_CONSUMERS_GGML_MORE_H
#define KVQ_CONSUMERS_GGML_MORE_H

#include "simd.h"
#include "consumers_ggml.h"   /* kvq_fp16_value: the blocks' fp16 fields */

#define KVQ_GM_Q4_1 2
#define KVQ_GM_Q5_0 3
#define KVQ_GM_Q5_1 4
#define KVQ_GM_IQ4_NL 5

/* ggml's kvalues_iq4nl */
static const float kvq_gm_iq4nl_levels[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f,
                                              -10.f, 1.f, 13.f, 25.f, 38.f, 53.f, 69.f, 89.f,
                                              113.f};

static inline int kvq_gm_block_bytes(const int kind)
{
    return kind == KVQ_GM_Q4_1 ? 20 : kind == KVQ_GM_Q5_0 ? 22 : kind == KVQ_GM_Q5_1 ? 24 : 18;
}

static inline int kvq_gm_has_min(const int kind)
{
    return kind == KVQ_GM_Q4_1 || kind == KVQ_GM_Q5_1;
}

static inline int kvq_gm_has_qh(const int kind)
{
    return kind == KVQ_GM_Q5_0 || kind == KVQ_GM_Q5_1;
}

/* offset of the nibbles and of qh in a block */
static inline int kvq_gm_qs_offset(const int kind)
{
    return kind == KVQ_GM_Q4_1 ? 4 : kind == KVQ_GM_Q5_0 ? 6 : kind == KVQ_GM_Q5_1 ? 8 : 2;
}

static inline int kvq_gm_qh_offset(const int kind)
{
    return kind == KVQ_GM_Q5_0 ? 2 : 4;
}

static inline uint32_t kvq_gm_qh(const uint8_t* blk, const int kind)
{
    const uint8_t* b = blk + kvq_gm_qh_offset(kind);
    return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}

/* v of code j of a block (qh: the block's high bits, 0 for the 4-bit kinds) */
static inline float kvq_gm_value(const uint8_t* blk, const int j, const int kind, const uint32_t qh)
{
    const uint8_t* qs = blk + kvq_gm_qs_offset(kind);
    int code = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
    code |= (int)((qh >> j) & 1u) << 4;
    if (kind == KVQ_GM_IQ4_NL)
        return kvq_gm_iq4nl_levels[code];
    return (float)(kind == KVQ_GM_Q5_0 ? code - 16 : code);
}

static void kvq_gm_dot_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                int64_t r0, int64_t r1, const float* q, float* out)
{
    const int kind = p->bits, bb = kvq_gm_block_bytes(kind);
    const int offset = kvq_gm_has_min(kind), five = kvq_gm_has_qh(kind);
    const int64_t nb = p->dim / 32;
    float acc[16], part[16], qsum[16];
    int64_t t, b;
    int j, s;
    (void)side;
    for (t = r0; t < r1; t++) {
        const uint8_t* row = codes + t * p->code_bytes;
        kvq_zero16(acc);
        for (b = 0; b < nb; b++) {
            const uint8_t* blk = row + b * bb;
            const float d = kvq_fp16_value(blk);
            const uint32_t qh = five ? kvq_gm_qh(blk, kind) : 0u;
            const float* qb = q + 32 * b;
            kvq_zero16(part);
            for (s = 0; s < 2; s++)
                for (j = 0; j < 16; j++)
                    part[j] = part[j] + qb[16 * s + j] * kvq_gm_value(blk, 16 * s + j, kind, qh);
            for (j = 0; j < 16; j++) acc[j] = acc[j] + part[j] * d;
            if (offset) {
                const float m = kvq_fp16_value(blk + 2);
                kvq_zero16(qsum);
                for (s = 0; s < 2; s++)
                    for (j = 0; j < 16; j++) qsum[j] = qsum[j] + qb[16 * s + j];
                for (j = 0; j < 16; j++) acc[j] = acc[j] + qsum[j] * m;
            }
        }
        out[t] = kvq_tree16(acc);
    }
}

static void kvq_gm_axpy_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                 int64_t r0, int64_t r1, const float* w, float* acc)
{
    const int kind = p->bits, bb = kvq_gm_block_bytes(kind);
    const int offset = kvq_gm_has_min(kind), five = kvq_gm_has_qh(kind);
    const int64_t nb = p->dim / 32;
    int64_t t, b;
    int j;
    (void)side;
    for (t = r0; t < r1; t++) {
        const uint8_t* row = codes + t * p->code_bytes;
        for (b = 0; b < nb; b++) {
            const uint8_t* blk = row + b * bb;
            const float c = w[t] * kvq_fp16_value(blk);
            const uint32_t qh = five ? kvq_gm_qh(blk, kind) : 0u;
            float* a = acc + 32 * b;
            for (j = 0; j < 32; j++) a[j] = a[j] + c * kvq_gm_value(blk, j, kind, qh);
            if (offset) {
                const float wm = w[t] * kvq_fp16_value(blk + 2);
                for (j = 0; j < 32; j++) a[j] = a[j] + wm;
            }
        }
    }
}

#if KVQ_HAVE_X86_SIMD
/* The 32 values of a block as two vectors (elements 0..15, 16..31). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_gm_values(const uint8_t* blk, const int kind,
                                                            const __m512 levels, __m512* lo,
                                                            __m512* hi)
{
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + kvq_gm_qs_offset(kind))));
    __m512i l = _mm512_and_si512(x, _mm512_set1_epi32(15)), h = _mm512_srli_epi32(x, 4);
    if (kvq_gm_has_qh(kind)) {
        const uint32_t qh = kvq_gm_qh(blk, kind);
        const __m512i sixteen = _mm512_set1_epi32(16);
        l = _mm512_mask_or_epi32(l, (__mmask16)(qh & 0xFFFFu), l, sixteen);
        h = _mm512_mask_or_epi32(h, (__mmask16)(qh >> 16), h, sixteen);
    }
    if (kind == KVQ_GM_IQ4_NL) {
        *lo = _mm512_permutexvar_ps(l, levels);
        *hi = _mm512_permutexvar_ps(h, levels);
    } else if (kind == KVQ_GM_Q5_0) {
        const __m512i sixteen = _mm512_set1_epi32(16);
        *lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(l, sixteen));
        *hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(h, sixteen));
    } else {
        *lo = _mm512_cvtepi32_ps(l);
        *hi = _mm512_cvtepi32_ps(h);
    }
}

/* Scores of NR (1 or 4) consecutive rows. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_gm_dot_rows(const kvq_params* p,
                                                              const uint8_t* c, const float* q,
                                                              float* out, const int NR,
                                                              const int kind)
{
    const int64_t nb = p->dim / 32, cb = p->code_bytes, bb = kvq_gm_block_bytes(kind);
    const __m512 levels = _mm512_loadu_ps(kvq_gm_iq4nl_levels);
    __m512 acc[4], part, lo, hi, q0, q1, qsum = _mm512_setzero_ps();
    int64_t b;
    int k;
    for (k = 0; k < NR; k++) acc[k] = _mm512_setzero_ps();
    for (b = 0; b < nb; b++) {
        q0 = _mm512_loadu_ps(q + 32 * b);
        q1 = _mm512_loadu_ps(q + 32 * b + 16);
        if (kvq_gm_has_min(kind))
            qsum = _mm512_add_ps(_mm512_add_ps(_mm512_setzero_ps(), q0), q1);
        for (k = 0; k < NR; k++) {
            const uint8_t* blk = c + k * cb + b * bb;
            kvq_prefetch(blk + KVQ_PREFETCH_BYTES);
            kvq_gm_values(blk, kind, levels, &lo, &hi);
            part = _mm512_add_ps(_mm512_setzero_ps(), _mm512_mul_ps(q0, lo));
            part = _mm512_add_ps(part, _mm512_mul_ps(q1, hi));
            acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(part, _mm512_set1_ps(kvq_fp16_value(blk))));
            if (kvq_gm_has_min(kind))
                acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(qsum, _mm512_set1_ps(kvq_fp16_value(blk + 2))));
        }
    }
    if (NR == 4)
        _mm_storeu_ps(out, kvq_tree16x4_avx512(acc[0], acc[1], acc[2], acc[3]));
    else
        for (k = 0; k < NR; k++) out[k] = kvq_tree16_avx512(acc[k]);
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_gm_axpy_rows(const kvq_params* p,
                                                               const uint8_t* c, const float* w,
                                                               float* acc, const int NR,
                                                               const int kind)
{
    const int64_t nb = p->dim / 32, cb = p->code_bytes, bb = kvq_gm_block_bytes(kind);
    const __m512 levels = _mm512_loadu_ps(kvq_gm_iq4nl_levels);
    __m512 a0, a1, lo, hi, coef, wm;
    int64_t b;
    int k;
    for (b = 0; b < nb; b++) {
        a0 = _mm512_loadu_ps(acc + 32 * b);
        a1 = _mm512_loadu_ps(acc + 32 * b + 16);
        for (k = 0; k < NR; k++) {
            const uint8_t* blk = c + k * cb + b * bb;
            kvq_prefetch(blk + KVQ_PREFETCH_BYTES);
            kvq_gm_values(blk, kind, levels, &lo, &hi);
            coef = _mm512_set1_ps(w[k] * kvq_fp16_value(blk));
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(coef, lo));
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(coef, hi));
            if (kvq_gm_has_min(kind)) {
                wm = _mm512_set1_ps(w[k] * kvq_fp16_value(blk + 2));
                a0 = _mm512_add_ps(a0, wm);
                a1 = _mm512_add_ps(a1, wm);
            }
        }
        _mm512_storeu_ps(acc + 32 * b, a0);
        _mm512_storeu_ps(acc + 32 * b + 16, a1);
    }
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_gm_dot_all(const kvq_params* p,
                                                             const uint8_t* codes, int64_t r0,
                                                             int64_t r1, const float* q,
                                                             float* out, const int kind)
{
    int64_t t = r0;
    for (; t + 4 <= r1; t += 4) kvq_gm_dot_rows(p, codes + t * p->code_bytes, q, out + t, 4, kind);
    for (; t < r1; t++) kvq_gm_dot_rows(p, codes + t * p->code_bytes, q, out + t, 1, kind);
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_gm_axpy_all(const kvq_params* p,
                                                              const uint8_t* codes, int64_t r0,
                                                              int64_t r1, const float* w,
                                                              float* acc, const int kind)
{
    int64_t t = r0;
    for (; t + 4 <= r1; t += 4) kvq_gm_axpy_rows(p, codes + t * p->code_bytes, w + t, acc, 4, kind);
    for (; t < r1; t++) kvq_gm_axpy_rows(p, codes + t * p->code_bytes, w + t, acc, 1, kind);
}

/* one specialised copy per kind (the kind is a constant inside each) */
KVQ_TARGET_AVX512 static void kvq_gm_dot_avx512(const kvq_params* p, const uint8_t* codes,
                                                const float* side, int64_t r0, int64_t r1,
                                                const float* q, float* out)
{
    (void)side;
    switch (p->bits) {
    case KVQ_GM_Q4_1: kvq_gm_dot_all(p, codes, r0, r1, q, out, KVQ_GM_Q4_1); break;
    case KVQ_GM_Q5_0: kvq_gm_dot_all(p, codes, r0, r1, q, out, KVQ_GM_Q5_0); break;
    case KVQ_GM_Q5_1: kvq_gm_dot_all(p, codes, r0, r1, q, out, KVQ_GM_Q5_1); break;
    default: kvq_gm_dot_all(p, codes, r0, r1, q, out, KVQ_GM_IQ4_NL); break;
    }
}

KVQ_TARGET_AVX512 static void kvq_gm_axpy_avx512(const kvq_params* p, const uint8_t* codes,
                                                 const float* side, int64_t r0, int64_t r1,
                                                 const float* w, float* acc)
{
    (void)side;
    switch (p->bits) {
    case KVQ_GM_Q4_1: kvq_gm_axpy_all(p, codes, r0, r1, w, acc, KVQ_GM_Q4_1); break;
    case KVQ_GM_Q5_0: kvq_gm_axpy_all(p, codes, r0, r1, w, acc, KVQ_GM_Q5_0); break;
    case KVQ_GM_Q5_1: kvq_gm_axpy_all(p, codes, r0, r1, w, acc, KVQ_GM_Q5_1); break;
    default: kvq_gm_axpy_all(p, codes, r0, r1, w, acc, KVQ_GM_IQ4_NL); break;
    }
}
#else  /* no vector path in this build: the dispatcher never picks these */
#define kvq_gm_dot_avx512 kvq_gm_dot_portable
#define kvq_gm_axpy_avx512 kvq_gm_axpy_portable
#endif

#endif /* KVQ_CONSUMERS_GGML_MORE_H */
