/* Multi-query row kernels (kvq_dotm_fn / kvq_axpym_fn of simd.h) for f32, kv8, tq and q8_0/q4_0:
 * the m query heads that share a KV head (GQA) read each row once. A row's codes are decoded once
 * per 16 elements and the values serve every query; each query keeps its own lane sums in the
 * order simd.h defines, so its result has the bits of a one-query call.
 *
 * The kernels are written once, in consumers_multi_body.h, over a 16-lane vector type and the
 * families' decoders, and compiled here for AVX-512, for AVX2 and, with simd.h's compiler vector
 * extensions instead of intrinsics, for the portable path (any ISA). Layouts without a vector
 * path (widths that are not a multiple of 16, kv8 groups that do not split into steps of 16, 6- to
 * 8-bit tq with VBMI), and the portable path of a compiler without vector extensions, run the
 * one-query kernels query by query.
 */
#ifndef KVQ_CONSUMERS_MULTI_H
#define KVQ_CONSUMERS_MULTI_H

#include "simd.h"
#include "consumers_f32.h"
#include "consumers_kv8.h"
#include "consumers_tq.h"
#include "consumers_ggml.h"

/* One-query kernels applied query by query: the fallback of the vector multi-query kernels (and
 * the portable path's multi-query kernels in a build without vector extensions). */
#if defined(__GNUC__) || defined(__clang__)
#define KVQ_MAYBE_UNUSED __attribute__((unused))   /* a fallback some builds never take */
#else
#define KVQ_MAYBE_UNUSED
#endif
#define KVQ_MQ_BY_QUERY(FAM, PATH, DOT, AXPY)                                                   \
KVQ_MAYBE_UNUSED                                                                                \
static void kvq_##FAM##_dotm_##PATH(const kvq_params* p, const uint8_t* codes, const float* side,          \
                        int64_t r0, int64_t r1, const float* Q, int m, float* out, int64_t ldo) \
{                                                                                               \
    int j;                                                                                      \
    for (j = 0; j < m; j++) DOT(p, codes, side, r0, r1, Q + j * p->dim, out + j * ldo);         \
}                                                                                               \
KVQ_MAYBE_UNUSED                                                                                \
static void kvq_##FAM##_axpym_##PATH(const kvq_params* p, const uint8_t* codes, const float* side,         \
                         int64_t r0, int64_t r1, const float* W, int64_t ldw, int m, float* acc) \
{                                                                                               \
    int j;                                                                                      \
    for (j = 0; j < m; j++) AXPY(p, codes, side, r0, r1, W + j * ldw, acc + j * p->dim);        \
}

KVQ_MQ_BY_QUERY(f32, portableq, kvq_f32_dot_portable, kvq_f32_axpy_portable)
KVQ_MQ_BY_QUERY(kv8, portableq, kvq_kv8_dot_portable, kvq_kv8_axpy_portable)
KVQ_MQ_BY_QUERY(tq, portableq, kvq_tq_dot_portable, kvq_tq_axpy_portable)
KVQ_MQ_BY_QUERY(ggml, portableq, kvq_ggml_dot_portable, kvq_ggml_axpy_portable)

/* Queries whose scaled copy (q 2^120, kv8's raw decode) fits the kernels' stack buffer. */
#define KVQ_MQ_FOLD_FLOATS 8192

/* max |x_i| < 2^7 over n floats (NaN fails): the 2^120 of kv8's raw decode may go into x. */
static inline int kvq_mq_foldable(const float* x, int64_t n)
{
    int64_t i;
    int ok = 1;
    for (i = 0; i < n; i++) ok &= fabsf(x[i]) < 128.0f;   /* no early exit: it vectorizes */
    return ok;
}

/* Layouts the vector multi-query kernels take (the others go query by query). */
static inline int kvq_mq_kv8_layout_ok(const kvq_params* p)
{
    return p->dim % 16 == 0 && (p->group == p->dim || p->group % 16 == 0);
}

static inline int kvq_mq_tq_own_kernels(const kvq_params* p, int vbmi_kernels)
{
    return p->dim % 16 != 0 || (vbmi_kernels && p->vbmi && p->bits >= 6 && p->dim % 64 == 0);
}

/* kv8 context coefficients w_jt * s_tg of R rows x m queries for group g: cf[r m + j], and
 * cfr = cf 2^120 (exact). Returns whether every |cf| < 2^7 (the raw decode applies). */
static inline int kvq_mq_kv8_coefs(const float* W, int64_t ldw, int64_t t, int m, const float* s,
                                   int64_t ns, int64_t g, int R, float* cf, float* cfr)
{
    int r, j, fold = 1;
    for (r = 0; r < R; r++)
        for (j = 0; j < m; j++) {
            const float c = W[j * ldw + t + r] * s[r * ns + g];
            cf[r * m + j] = c;
            cfr[r * m + j] = c * 0x1p120f;
            fold &= fabsf(c) < 128.0f;
        }
    return fold;
}

#if KVQ_PORTABLE_VECTORS
/* ---- portable: simd.h's 16-lane vector type, no intrinsics (any ISA the compiler targets) ---- */
#define KVQ_MQ(name) kvq_##name##_portable
#define KVQ_MQ_TARGET
#define KVQ_MQ_FALLBACK(name) kvq_##name##_portableq
#define MV kvq_pv
#define MV_ZERO() kvq_pv_zero()
#define MV_LOAD(x) kvq_pv_load(x)
#define MV_STORE(x, v) kvq_pv_store(x, v)
#define MV_ADD(a, b) kvq_pv_add(a, b)
#define MV_MUL(a, b) kvq_pv_mul(a, b)
#define MV_SET1(c) kvq_pv_set1(c)
#define MV_TREE1(a) kvq_pv_tree16(a)
#define MV_TREE4(a, b, c, d, out) kvq_pv_tree16x4(a, b, c, d, out)
#define MV_SUMS16(a, dst, scale) kvq_pv_sums16(a, dst, scale)
#define MV_TQ_STEPS16(side, ns, sq, dst) kvq_tq_steps16_portable(side, ns, sq, dst)
#define MV_E4M3(c, how) kvq_e4m3_16_portable(c, how)
#define MV_E4M3_SPECIAL(c, len) kvq_e4m3_special_portable(c, len)
#define MV_TQ_CONSTS kvq_tq_consts_portable
/* the body calls it where its kvq_params `p` is in scope: 1- and 2-bit codes take byte_levels */
#define MV_TQ_INIT(K, table, b) kvq_tq_consts_init_portable(K, table, p->byte_levels, b)
#define MV_TQ_LEV16(g, K, b, wide) kvq_tq_lev16_portable(g, K, b, wide)
#define MV_GGML_VALUES(blk, q4, lo, hi) kvq_ggml_values_portable(blk, q4, lo, hi)
#define MV_FP16(b) kvq_fp16_value(b)
/* sized for 16 128-bit registers (x86-64 SSE; NEON has 32): a 16-lane vector is four of them */
#define KVQ_MQ_PASS 4
#define KVQ_MQ_ROWS(M) ((M) <= 2 ? 2 : 1)
#define KVQ_MQ_CTX_ROWS 2
#define KVQ_MQ_EACH_M(C) C(1) C(2) C(3) C(4)
#define KVQ_MQ_VBMI_TQ 0
#define KVQ_MQ_NARROW 0   /* the narrow kernels (32 vector registers) would spill here */
#define KVQ_MQ_AXPY_ROWS 2
#include "consumers_multi_body.h"
#else
#define kvq_f32_dotm_portable kvq_f32_dotm_portableq
#define kvq_f32_axpym_portable kvq_f32_axpym_portableq
#define kvq_kv8_dotm_portable kvq_kv8_dotm_portableq
#define kvq_kv8_axpym_portable kvq_kv8_axpym_portableq
#define kvq_tq_dotm_portable kvq_tq_dotm_portableq
#define kvq_tq_axpym_portable kvq_tq_axpym_portableq
#define kvq_ggml_dotm_portable kvq_ggml_dotm_portableq
#define kvq_ggml_axpym_portable kvq_ggml_axpym_portableq
#endif

#if KVQ_HAVE_X86_SIMD
KVQ_MQ_BY_QUERY(f32, avx512q, kvq_f32_dot_avx512, kvq_f32_axpy_avx512)
KVQ_MQ_BY_QUERY(kv8, avx512q, kvq_kv8_dot_avx512, kvq_kv8_axpy_avx512)
KVQ_MQ_BY_QUERY(tq, avx512q, kvq_tq_dot_avx512, kvq_tq_axpy_avx512)

/* ---- AVX-512 ---- */
#define KVQ_MQ(name) kvq_##name##_avx512
#define KVQ_MQ_TARGET KVQ_TARGET_AVX512
#define KVQ_MQ_FALLBACK(name) kvq_##name##_avx512q
#define MV __m512
#define MV_ZERO() _mm512_setzero_ps()
#define MV_LOAD(x) _mm512_loadu_ps(x)
#define MV_STORE(x, v) _mm512_storeu_ps(x, v)
#define MV_ADD(a, b) _mm512_add_ps(a, b)
#define MV_MUL(a, b) _mm512_mul_ps(a, b)
#define MV_SET1(c) _mm512_set1_ps(c)
#define MV_TREE1(a) kvq_tree16_avx512(a)
#define MV_TREE4(a, b, c, d, out) _mm_storeu_ps(out, kvq_tree16x4_avx512(a, b, c, d))
#define MV_SUMS16(a, dst, scale) kvq_sums16_avx512(a, dst, scale)
#define MV_SUMS16_FROM_FIRST(a, dst, scale) kvq_sums16_from_first_avx512(a, dst, scale)
#define MV_TQ_STEPS16(side, ns, sq, dst) kvq_tq_steps16_avx512(side, ns, sq, dst)
#define MV_E4M3(c, how) kvq_e4m3_16(c, how)
#define MV_E4M3_SPECIAL(c, len) kvq_e4m3_special_avx512(c, len)
#define MV_TQ_CONSTS kvq_tq_consts
#define MV_TQ_INIT(K, table, b) kvq_tq_consts_init(K, table, b)
#define MV_TQ_LEV16(g, K, b, wide) kvq_tq_lev16(g, K, b, wide)
#define MV_TQ_CODES16(g, K, b, wide) kvq_tq_codes16(g, K, b, wide)   /* b = 2..4 (narrow) */
#define MV_TQ_LEVELS(K) ((K)->t0)
#define MV_LOOKUP16(codes, table) _mm512_permutexvar_ps(codes, table)
#define MV_GGML_VALUES(blk, q4, lo, hi) kvq_ggml_values(blk, q4, lo, hi)
#define MV_FP16(b) kvq_fp16_value_f16c(b)
/* queries per pass and rows per pass for M queries: R * M <= 8 accumulators (of 32 registers) */
#define KVQ_MQ_PASS 8
#define KVQ_MQ_ROWS(M) ((M) == 1 ? 4 : (M) <= 4 ? 2 : 1)
#define KVQ_MQ_CTX_ROWS 4   /* rows per load and store of the context accumulators */
#define KVQ_MQ_EACH_M(C) C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8)
#define KVQ_MQ_VBMI_TQ 1   /* 6- to 8-bit tq with VBMI keeps its own kernels */
#define KVQ_MQ_NARROW 1
#include "consumers_multi_body.h"

/* ---- AVX-512 with VBMI: tq only (its 2- to 4-bit unpacking) ---- */
#define KVQ_MQ(name) kvq_##name##_avx512vbmi
#define KVQ_MQ_TARGET KVQ_TARGET_AVX512VBMI
#define KVQ_MQ_FALLBACK(name) kvq_##name##_avx512q
#define MV __m512
#define MV_ZERO() _mm512_setzero_ps()
#define MV_LOAD(x) _mm512_loadu_ps(x)
#define MV_STORE(x, v) _mm512_storeu_ps(x, v)
#define MV_ADD(a, b) _mm512_add_ps(a, b)
#define MV_MUL(a, b) _mm512_mul_ps(a, b)
#define MV_SET1(c) _mm512_set1_ps(c)
#define MV_TREE1(a) kvq_tree16_avx512(a)
#define MV_TREE4(a, b, c, d, out) _mm_storeu_ps(out, kvq_tree16x4_avx512(a, b, c, d))
#define MV_SUMS16(a, dst, scale) kvq_sums16_avx512(a, dst, scale)
#define MV_SUMS16_FROM_FIRST(a, dst, scale) kvq_sums16_from_first_avx512(a, dst, scale)
#define MV_TQ_STEPS16(side, ns, sq, dst) kvq_tq_steps16_avx512(side, ns, sq, dst)
#define MV_TQ_CONSTS kvq_tq_consts_vbmi
#define MV_TQ_INIT(K, table, b) kvq_tq_consts_init_vbmi(K, table, b)
#define MV_TQ_LEV16(g, K, b, wide) kvq_tq_lev16_vbmi(g, K, b, wide)
#define MV_TQ_CODES16(g, K, b, wide) kvq_tq_codes16_vbmi(g, K, b, wide)
#define MV_TQ_LEVELS(K) ((K)->base.t0)
#define MV_LOOKUP16(codes, table) _mm512_permutexvar_ps(codes, table)
#define KVQ_MQ_PASS 8
#define KVQ_MQ_ROWS(M) ((M) == 1 ? 4 : (M) <= 4 ? 2 : 1)
#define KVQ_MQ_CTX_ROWS 4   /* rows per load and store of the context accumulators */
#define KVQ_MQ_EACH_M(C) C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8)
#define KVQ_MQ_VBMI_TQ 1
#define KVQ_MQ_NARROW 1
#define KVQ_MQ_TQ_ONLY 1
#include "consumers_multi_body.h"
#undef KVQ_MQ_TQ_ONLY

/* ---- AVX2 (no FMA) ---- */
#define KVQ_MQ(name) kvq_##name##_avx2
#define KVQ_MQ_TARGET KVQ_TARGET_AVX2
#define KVQ_MQ_FALLBACK(name) kvq_##name##_portableq
#define MV kvq_v16x2
#define MV_ZERO() kvq_v2_zero()
#define MV_LOAD(x) kvq_v2_load(x)
#define MV_STORE(x, v) kvq_v2_store(x, v)
#define MV_ADD(a, b) kvq_v2_add(a, b)
#define MV_MUL(a, b) kvq_v2_mul(a, b)
#define MV_SET1(c) kvq_v2_set1(c)
#define MV_TREE1(a) kvq_tree16_avx2(a)
#define MV_TREE4(a, b, c, d, out) _mm_storeu_ps(out, kvq_tree16x4_avx2(a, b, c, d))
#define MV_SUMS16(a, dst, scale) kvq_sums16_avx2(a, dst, scale)
#define MV_TQ_STEPS16(side, ns, sq, dst) kvq_tq_steps16_avx2(side, ns, sq, dst)
#define MV_E4M3(c, how) kvq_e4m3_16_avx2(c, how)
#define MV_E4M3_SPECIAL(c, len) kvq_e4m3_special_avx2(c, len)
#define MV_TQ_CONSTS kvq_tq_consts_avx2
#define MV_TQ_INIT(K, table, b) kvq_tq_consts_init_avx2(K, table, b)
#define MV_TQ_LEV16(g, K, b, wide) kvq_tq_lev16_avx2(g, K, b, wide)
#define MV_GGML_VALUES(blk, q4, lo, hi) kvq_ggml_values_avx2(blk, q4, lo, hi)
#define MV_FP16(b) kvq_fp16_value_avx2(b)
/* 16 registers of 8 lanes: R * M <= 4 accumulators (8 registers), and two rows per pass even for
 * one query (four rows' accumulators and values spill: measured slower) */
#define KVQ_MQ_PASS 4
#define KVQ_MQ_ROWS(M) ((M) <= 2 ? 2 : 1)
#define KVQ_MQ_CTX_ROWS 2
#define KVQ_MQ_EACH_M(C) C(1) C(2) C(3) C(4)
#define KVQ_MQ_VBMI_TQ 0
#define KVQ_MQ_NARROW 0   /* 16 registers: the narrow kernels would spill */
#include "consumers_multi_body.h"

#else  /* no vector path in this build: the dispatcher never picks these */
#define kvq_f32_dotm_avx512 kvq_f32_dotm_portable
#define kvq_f32_axpym_avx512 kvq_f32_axpym_portable
#define kvq_kv8_dotm_avx512 kvq_kv8_dotm_portable
#define kvq_kv8_axpym_avx512 kvq_kv8_axpym_portable
#define kvq_tq_dotm_avx512 kvq_tq_dotm_portable
#define kvq_tq_axpym_avx512 kvq_tq_axpym_portable
#define kvq_tq_dotm_avx512vbmi kvq_tq_dotm_portable
#define kvq_tq_axpym_avx512vbmi kvq_tq_axpym_portable
#define kvq_ggml_dotm_avx512 kvq_ggml_dotm_portable
#define kvq_ggml_axpym_avx512 kvq_ggml_axpym_portable
#define kvq_f32_dotm_avx2 kvq_f32_dotm_portable
#define kvq_f32_axpym_avx2 kvq_f32_axpym_portable
#define kvq_kv8_dotm_avx2 kvq_kv8_dotm_portable
#define kvq_kv8_axpym_avx2 kvq_kv8_axpym_portable
#define kvq_tq_dotm_avx2 kvq_tq_dotm_portable
#define kvq_tq_axpym_avx2 kvq_tq_axpym_portable
#define kvq_ggml_dotm_avx2 kvq_ggml_dotm_portable
#define kvq_ggml_axpym_avx2 kvq_ggml_axpym_portable
#endif

#endif /* KVQ_CONSUMERS_MULTI_H */
