/* Row kernels of the f32 codec (rows stored as they are): the baseline every codec is held to.
 * Reduction order: simd.h. */
#ifndef KVQ_CONSUMERS_F32_H
#define KVQ_CONSUMERS_F32_H

#include "simd.h"

static void kvq_f32_dot_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                 int64_t r0, int64_t r1, const float* q, float* out)
{
    const int64_t n = p->dim;
    float acc[16];
    int64_t t, i;
    int j;
    (void)side;
    for (t = r0; t < r1; t++) {
        const float* x = (const float*)(codes + t * p->code_bytes);
        kvq_zero16(acc);
        for (i = 0; i + 16 <= n; i += 16)
            for (j = 0; j < 16; j++) acc[j] = acc[j] + q[i + j] * x[i + j];
        for (j = 0; i + j < n; j++) acc[j] = acc[j] + q[i + j] * x[i + j];
        out[t] = kvq_tree16(acc);
    }
}

static void kvq_f32_axpy_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                  int64_t r0, int64_t r1, const float* w, float* acc)
{
    const int64_t n = p->dim;
    int64_t t, i;
    (void)side;
    for (t = r0; t < r1; t++) {
        const float* x = (const float*)(codes + t * p->code_bytes);
        const float c = w[t];
        for (i = 0; i < n; i++) acc[i] = acc[i] + c * x[i];
    }
}

#if KVQ_HAVE_X86_SIMD
KVQ_TARGET_AVX512 static void kvq_f32_dot_avx512(const kvq_params* p, const uint8_t* codes,
                                                 const float* side, int64_t r0, int64_t r1,
                                                 const float* q, float* out)
{
    const int64_t n = p->dim, n16 = n & ~(int64_t)15, stride = p->code_bytes / 4;
    const __mmask16 tail = kvq_mask16(n - n16);
    const float* X = (const float*)codes;
    int64_t t = r0, i;
    (void)side;
    /* four rows at a time: four independent dependency chains, each row's order unchanged */
    for (; t + 4 <= r1; t += 4) {
        const float *x0 = X + t * stride, *x1 = x0 + stride, *x2 = x1 + stride, *x3 = x2 + stride;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, qv;
        for (i = 0; i < n16; i += 16) {
            kvq_prefetch((const char*)(x0 + i) + KVQ_PREFETCH_BYTES);
            kvq_prefetch((const char*)(x1 + i) + KVQ_PREFETCH_BYTES);
            kvq_prefetch((const char*)(x2 + i) + KVQ_PREFETCH_BYTES);
            kvq_prefetch((const char*)(x3 + i) + KVQ_PREFETCH_BYTES);
            qv = _mm512_loadu_ps(q + i);
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(qv, _mm512_loadu_ps(x0 + i)));
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(qv, _mm512_loadu_ps(x1 + i)));
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(qv, _mm512_loadu_ps(x2 + i)));
            a3 = _mm512_add_ps(a3, _mm512_mul_ps(qv, _mm512_loadu_ps(x3 + i)));
        }
        if (tail) {
            qv = _mm512_maskz_loadu_ps(tail, q + i);
            a0 = _mm512_mask_add_ps(a0, tail, a0, _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(tail, x0 + i)));
            a1 = _mm512_mask_add_ps(a1, tail, a1, _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(tail, x1 + i)));
            a2 = _mm512_mask_add_ps(a2, tail, a2, _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(tail, x2 + i)));
            a3 = _mm512_mask_add_ps(a3, tail, a3, _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(tail, x3 + i)));
        }
        _mm_storeu_ps(out + t, kvq_tree16x4_avx512(a0, a1, a2, a3));
    }
    for (; t < r1; t++) {
        const float* x0 = X + t * stride;
        __m512 a0 = _mm512_setzero_ps(), qv;
        for (i = 0; i < n16; i += 16) {
            kvq_prefetch((const char*)(x0 + i) + KVQ_PREFETCH_BYTES);
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(x0 + i)));
        }
        if (tail) {
            qv = _mm512_maskz_loadu_ps(tail, q + i);
            a0 = _mm512_mask_add_ps(a0, tail, a0, _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(tail, x0 + i)));
        }
        out[t] = kvq_tree16_avx512(a0);
    }
}

KVQ_TARGET_AVX512 static void kvq_f32_axpy_avx512(const kvq_params* p, const uint8_t* codes,
                                                  const float* side, int64_t r0, int64_t r1,
                                                  const float* w, float* acc)
{
    const int64_t n = p->dim, n16 = n & ~(int64_t)15, stride = p->code_bytes / 4;
    const __mmask16 tail = kvq_mask16(n - n16);
    const float* X = (const float*)codes;
    int64_t t = r0, i;
    __m512 a;
    (void)side;
    /* four rows per load of the accumulator; each element still adds the rows in order */
    for (; t + 4 <= r1; t += 4) {
        const float *x0 = X + t * stride, *x1 = x0 + stride, *x2 = x1 + stride, *x3 = x2 + stride;
        const __m512 c0 = _mm512_set1_ps(w[t]), c1 = _mm512_set1_ps(w[t + 1]),
                     c2 = _mm512_set1_ps(w[t + 2]), c3 = _mm512_set1_ps(w[t + 3]);
        for (i = 0; i < n16; i += 16) {
            kvq_prefetch((const char*)(x0 + i) + KVQ_PREFETCH_BYTES);
            kvq_prefetch((const char*)(x1 + i) + KVQ_PREFETCH_BYTES);
            kvq_prefetch((const char*)(x2 + i) + KVQ_PREFETCH_BYTES);
            kvq_prefetch((const char*)(x3 + i) + KVQ_PREFETCH_BYTES);
            a = _mm512_loadu_ps(acc + i);
            a = _mm512_add_ps(a, _mm512_mul_ps(c0, _mm512_loadu_ps(x0 + i)));
            a = _mm512_add_ps(a, _mm512_mul_ps(c1, _mm512_loadu_ps(x1 + i)));
            a = _mm512_add_ps(a, _mm512_mul_ps(c2, _mm512_loadu_ps(x2 + i)));
            a = _mm512_add_ps(a, _mm512_mul_ps(c3, _mm512_loadu_ps(x3 + i)));
            _mm512_storeu_ps(acc + i, a);
        }
        if (tail) {
            a = _mm512_maskz_loadu_ps(tail, acc + i);
            a = _mm512_add_ps(a, _mm512_mul_ps(c0, _mm512_maskz_loadu_ps(tail, x0 + i)));
            a = _mm512_add_ps(a, _mm512_mul_ps(c1, _mm512_maskz_loadu_ps(tail, x1 + i)));
            a = _mm512_add_ps(a, _mm512_mul_ps(c2, _mm512_maskz_loadu_ps(tail, x2 + i)));
            a = _mm512_add_ps(a, _mm512_mul_ps(c3, _mm512_maskz_loadu_ps(tail, x3 + i)));
            _mm512_mask_storeu_ps(acc + i, tail, a);
        }
    }
    for (; t < r1; t++) {
        const float* x = X + t * stride;
        const __m512 c = _mm512_set1_ps(w[t]);
        for (i = 0; i < n16; i += 16) {
            kvq_prefetch((const char*)(x + i) + KVQ_PREFETCH_BYTES);
            _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i),
                                                    _mm512_mul_ps(c, _mm512_loadu_ps(x + i))));
        }
        if (tail)
            _mm512_mask_storeu_ps(acc + i, tail,
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(tail, acc + i),
                                                _mm512_mul_ps(c, _mm512_maskz_loadu_ps(tail, x + i))));
    }
}
#else  /* no vector path in this build: the dispatcher never picks these */
#define kvq_f32_dot_avx512 kvq_f32_dot_portable
#define kvq_f32_axpy_avx512 kvq_f32_axpy_portable
#endif

#endif /* KVQ_CONSUMERS_F32_H */
