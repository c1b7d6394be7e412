/* fp8 e4m3fn group encoder in C: the element encoder is branch-free so that GCC vectorizes the
 * encode loop, cloned per instruction set (the loader picks AVX-512, AVX2 or the baseline). The same
 * bits on every clone: the encode is element-wise and the rounding is IEEE round-half-to-even.
 * (The NaN-aware max loop stays scalar: GCC does not vectorize it without -ffinite-math-only.) */
#ifndef KVQ_FP8OPS_H
#define KVQ_FP8OPS_H
#include <float.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KVQ_FP8_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVQ_FP8_CLONES
#endif

/* One float to e4m3fn (OCP): round half to even, |x| > 448 and inf saturate to +-448, NaN -> 0x00,
 * the sign of zero kept; 0x7F/0xFF are never produced. */
static inline uint8_t kvq_e4m3_encode(float f)
{
    uint32_t u, ua, r, sign, code, sub;
    int32_t normal;
    float a, small, t;
    memcpy(&u, &f, 4);
    sign = (u >> 24) & 0x80u;
    ua = u & 0x7FFFFFFFu;
    memcpy(&a, &ua, 4);
    /* normal binades: round the float's 23-bit mantissa to 3 bits (ties to even), rebias 127 -> 7;
     * a carry into the next binade falls out of the addition */
    r = (ua + 0x7FFFFu + ((ua >> 20) & 1u)) >> 20;
    normal = (int32_t)r - (int32_t)(120u << 3);
    normal = normal > 0x7E ? 0x7E : normal;
    /* below 2**-6: multiples of 2**-9; adding 2**23 rounds a*512 (< 8) to an integer, ties to even */
    small = a < 0.015625f ? a : 0.0f;
    t = (small * 512.0f + 8388608.0f) - 8388608.0f;
    sub = (uint32_t)t;
    code = a >= 0.015625f ? (uint32_t)normal : sub;
    code = a > 448.0f ? 0x7Eu : code;
    code |= sign;
    code = (a != a) ? 0u : code;
    return (uint8_t)code;
}

/* Encode n elements with one scale (the engine's row quantizer): amax ignores NaN (the comparison
 * is false) and an inf raises it past every float; a group whose amax is not > 1e-35 or exceeds
 * 3.4e38f (the engine's literal, 3.39999995e38, a little below FLT_MAX) is inert (zero bytes,
 * scale 1). Elements are multiplied by 448/amax; scale = amax/448.
 * Returns 1 when the group held a NaN or inf, 2 when it is finite but its amax exceeds 3.4e38f,
 * else 0. */
KVQ_FP8_CLONES
static int kvq_fp8_encode_group(const float *x, int64_t n, uint8_t *codes, float *scale)
{
    int64_t i;
    float amax = 0.0f, inv;
    int bad = 0;
    for (i = 0; i < n; i++) {
        float a = x[i] < 0.0f ? -x[i] : x[i];
        bad |= !(a <= FLT_MAX);
        amax = a > amax ? a : amax;
    }
    if (!(amax > 1e-35f) || amax > 3.4e38f) {
        for (i = 0; i < n; i++)
            codes[i] = 0;
        *scale = 1.0f;
        return bad ? 1 : (amax > 3.4e38f ? 2 : 0);
    }
    inv = 448.0f / amax;
    for (i = 0; i < n; i++)
        codes[i] = kvq_e4m3_encode(x[i] * inv);
    *scale = amax / 448.0f;
    return bad;
}
#endif
