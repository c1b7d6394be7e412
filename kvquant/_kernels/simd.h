/* Shared machinery of the compressed-domain consumers (included from consumers.pyx).
 *
 * Every codec family supplies row kernels with the signatures below, a portable C version and,
 * on x86-64 with GCC/Clang, AVX2 and AVX-512 versions compiled for their targets only through a
 * per-function attribute (the rest of the build keeps baseline flags); the driver picks one at
 * run time from the CPU's features. The multi-query kernels (consumers_multi.h) read each row
 * once for the m queries of a KV head; their portable version is written over GCC/Clang vector
 * extensions (below: no intrinsics, any ISA), the scalar kernels remaining for other compilers.
 *
 * All paths produce the same bits. What makes that possible is a reduction order fixed by
 * definition, not by the compiler:
 *   - a dot product over a row of width n uses 16 lanes: lane j accumulates elements
 *     i = j, j+16, j+32, ... in that order (acc = acc + product, starting from +0), a short last
 *     step touching only the lanes it covers;
 *   - the 16 lane sums are combined by the fixed tree of kvq_tree16 (j + j+8, then j + j+4,
 *     then j + j+2, then j + j+1), which is also what the AVX-512 register halving computes
 *     (and the AVX2 one: its 16 lanes are two 8-lane registers, lanes 0-7 and 8-15);
 *   - products and sums are separate roundings: a multiply, then an add. No FMA in either path
 *     (the portable path must run on CPUs without FMA, where fmaf is a slow library call) and the
 *     build has -ffp-contract=off, so the compiler does not fuse them either;
 *   - a context sum runs over the rows of a chunk in row order (per element: acc = acc + c*v);
 *     chunks have a fixed size and their partial sums are added in chunk order by the driver, so
 *     the result does not depend on the thread count.
 */
#ifndef KVQ_SIMD_H
#define KVQ_SIMD_H

#include <stdint.h>
#include <string.h>
#include <float.h>
#include <math.h>

/* -DKVQ_NO_SIMD builds the portable path only (a compiler without target attributes, or a test). */
#if !defined(KVQ_NO_SIMD) && (defined(__x86_64__) || defined(_M_X64)) \
    && (defined(__GNUC__) || defined(__clang__))
#define KVQ_HAVE_X86_SIMD 1
#include <immintrin.h>
/* The AVX-512 subset the kernels need: F (512-bit float/int), BW + VL (byte masks and masked
 * 128-bit byte loads), DQ (256-bit float extraction), and F16C (fp16 block scales). Skylake-X and
 * later have all of them. */
#define KVQ_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
/* The same plus VBMI (byte permutes across a whole register: Ice Lake, Sapphire Rapids, Zen 4). */
#define KVQ_TARGET_AVX512VBMI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,avx512vbmi")))
/* AVX2 and F16C, no FMA (every AVX2 CPU has F16C: Haswell, Zen 1 and later). */
#define KVQ_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#else
#define KVQ_HAVE_X86_SIMD 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVQ_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define KVQ_ALWAYS_INLINE inline
#endif

/* Inlined into its caller whatever the compiler's judgement: constant arguments (a bit width,
 * a row count) then make the loops fixed-size ones that the compiler vectorizes. */
#if defined(__GNUC__) || defined(__clang__)
#define KVQ_INLINE static inline __attribute__((always_inline))
#else
#define KVQ_INLINE static inline
#endif

/* Instruction-set levels (a Python-visible enum). 3 differs from 2 only where a kernel has a
 * VBMI variant (6-, 7- and 8-bit tq). */
#define KVQ_SIMD_PORTABLE 0
#define KVQ_SIMD_AVX2 1
#define KVQ_SIMD_AVX512 2
#define KVQ_SIMD_AVX512VBMI 3

#if KVQ_HAVE_X86_SIMD
#include <cpuid.h>
/* F16C from CPUID leaf 1 (ECX bit 29): Clang before 16 rejects "f16c" in __builtin_cpu_supports
 * (a build error), and GCC and Clang both ship <cpuid.h>. Its instructions use the AVX register
 * state, which the avx2 / avx512f checks below have already found enabled by the OS. */
static int kvq_cpu_has_f16c(void)
{
    unsigned int a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
#endif

static int kvq_cpu_simd_level(void)
{
#if KVQ_HAVE_X86_SIMD
    __builtin_cpu_init();
    /* libgcc's checks include the OS's support for the AVX-512 register state (XCR0). */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
            && kvq_cpu_has_f16c())
        return __builtin_cpu_supports("avx512vbmi") ? KVQ_SIMD_AVX512VBMI : KVQ_SIMD_AVX512;
    if (__builtin_cpu_supports("avx2") && kvq_cpu_has_f16c())
        return KVQ_SIMD_AVX2;
#endif
    return KVQ_SIMD_PORTABLE;
}

static int kvq_compiled_simd_level(void)
{
#if KVQ_HAVE_X86_SIMD
    return KVQ_SIMD_AVX512VBMI;
#else
    return KVQ_SIMD_PORTABLE;
#endif
}

/* What a row kernel needs to know about the codec. Fields a family does not use are ignored. */
typedef struct {
    int64_t n_rows;       /* rows in the codes array: kernels may read past a row, never past this */
    int64_t dim;          /* row width n */
    int64_t code_bytes;   /* stored code bytes per row (row stride of `codes`) */
    int64_t n_side;       /* side floats per row (row stride of `side`) */
    int64_t group;        /* kv8: elements per scale */
    int bits;             /* tq: bits per code */
    float sqrtf_n;        /* tq: sqrtf(n), the decoder's divisor of the radius */
    const float* levels;  /* tq: 2**bits levels in N(0,1) units */
    const float* table;   /* tq: 256 levels indexed by any byte whose low bits are the code */
    const uint8_t* planes;/* tq: byte k of table[e] at planes[256 k + e] */
    const float* byte_levels; /* tq, 1, 2 or 4 bits: the 8/b levels of byte e at (8/b) e .. */
    int vbmi;             /* the CPU has AVX-512 VBMI and the caller allows it */
    const void* codec;    /* polar: its kvq_polar_layout (polarops.h) */
} kvq_params;

/* Queries handled per pass of the multi-query kernels (more are taken in passes of this many). */
#define KVQ_MQ_MAX 8

/* out[t] = q . x^_t for rows t in [r0, r1) (q already in the codec's basis: rotated for tq).
 * `codes` and `side` point at row 0; `out` is indexed by the absolute row t. */
typedef void (*kvq_dot_fn)(const kvq_params* p, const uint8_t* codes, const float* side,
                           int64_t r0, int64_t r1, const float* q, float* out);
/* acc[i] = acc[i] + c_t * v_ti for rows t in [r0, r1) in order, where x^_t = (per-row or
 * per-group factor) * v_t and c_t = w_t * that factor; w is indexed by the absolute row t. */
typedef void (*kvq_axpy_fn)(const kvq_params* p, const uint8_t* codes, const float* side,
                            int64_t r0, int64_t r1, const float* w, float* acc);
/* The same for m queries at once: query j is Q[j n .. j n + n), its scores go to out[j ldo + t]
 * (weights W[j ldw + t], context acc[j n .. j n + n)). Each query's result has the bits of the
 * one-query kernel: the rows are read once, the sums are those defined above. */
typedef void (*kvq_dotm_fn)(const kvq_params* p, const uint8_t* codes, const float* side,
                            int64_t r0, int64_t r1, const float* Q, int m, float* out,
                            int64_t ldo);
typedef void (*kvq_axpym_fn)(const kvq_params* p, const uint8_t* codes, const float* side,
                             int64_t r0, int64_t r1, const float* W, int64_t ldw, int m,
                             float* acc);

/* ---- the lane reduction, shared by both paths ------------------------------------------------ */

#include "tree16.h"

static inline void kvq_zero16(float a[16])
{
    int j;
    for (j = 0; j < 16; j++) a[j] = 0.0f;
}

#if KVQ_HAVE_X86_SIMD
KVQ_TARGET_AVX512 static inline float kvq_tree16_avx512(__m512 v)
{
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

/* kvq_tree16 of four vectors at once: the same pairwise adds, lanes of four rows side by side.
 * Returns the four sums (row k in element k). */
KVQ_TARGET_AVX512 static inline __m128 kvq_tree16x4_avx512(__m512 a, __m512 b, __m512 c, __m512 d)
{
    /* j + j+8: [a lo8 | b lo8] + [a hi8 | b hi8] */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* j + j+4: 128-bit lane k now holds row k */
    const __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    /* j + j+2, then j + j+1, inside each 128-bit lane */
    const __m512 s2 = _mm512_add_ps(s4, _mm512_shuffle_ps(s4, s4, 0xEE));
    const __m512 s1 = _mm512_add_ps(s2, _mm512_shuffle_ps(s2, s2, 0x55));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0,
                                                                         0, 0, 0, 0, 0, 0, 0, 0), s1));
}

/* kvq_tree16 of sixteen vectors a[0..15] at once: the sums in row order (row k in element k).
 * Every row goes through the same pairwise adds as kvq_tree16, in a transposed layout: after the
 * first two levels a vector holds four rows (one per 128-bit lane), after the last it holds
 * sixteen, so a row costs two shuffles instead of four (the cost that dominates narrow rows). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512 kvq_tree16x16_avx512(const __m512* a)
{
    __m512 w[4], z0, z1, s;
    int k;
    for (k = 0; k < 4; k++) {
        /* j + j+8, then j + j+4: 128-bit lane i of w[k] holds row 4k + i */
        const __m512 a0 = a[4 * k], a1 = a[4 * k + 1], a2 = a[4 * k + 2], a3 = a[4 * k + 3];
        const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44),
                                        _mm512_shuffle_f32x4(a0, a1, 0xEE));
        const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44),
                                        _mm512_shuffle_f32x4(a2, a3, 0xEE));
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    }
    /* j + j+2 inside each 128-bit lane: lane i holds rows i and 4 + i (z0), 8 + i and 12 + i (z1) */
    z0 = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x44), _mm512_shuffle_ps(w[0], w[1], 0xEE));
    z1 = _mm512_add_ps(_mm512_shuffle_ps(w[2], w[3], 0x44), _mm512_shuffle_ps(w[2], w[3], 0xEE));
    /* j + j+1: element 4i + k holds row 4k + i; the permute puts the rows in order */
    s = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7,
                                                   11, 15), s);
}

/* dst[k] = kvq_tree16(a[k]) (times scale[k] when scale is not NULL), k = 0..15. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_sums16_avx512(const __m512* a, float* dst,
                                                                const float* scale)
{
    __m512 s = kvq_tree16x16_avx512(a);
    if (scale) s = _mm512_mul_ps(s, _mm512_loadu_ps(scale));
    _mm512_storeu_ps(dst, s);
}

/* kvq_sums16_avx512 of sums whose lanes began at their first product instead of 0 + it: adding
 * +0 to each row's sum gives the bits of lanes begun at 0. (0 + p is p except that -0 becomes +0,
 * so the two sums differ at most by the sign of a zero; sums begun at +0 are never -0, and
 * s + 0 is s except that -0 becomes +0.) One add per sixteen rows instead of one per row. As on
 * every path, a NaN's payload and sign are not part of the bits: which operand's NaN an add
 * passes on is the compiler's choice (it may swap the operands of a commutative add). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_sums16_from_first_avx512(const __m512* a,
                                                                           float* dst,
                                                                           const float* scale)
{
    __m512 s = _mm512_add_ps(kvq_tree16x16_avx512(a), _mm512_setzero_ps());
    if (scale) s = _mm512_mul_ps(s, _mm512_loadu_ps(scale));
    _mm512_storeu_ps(dst, s);
}

/* ---- AVX2: 16 lanes as two 8-lane registers (lanes 0-7, 8-15) ---------------------------- */
typedef struct { __m256 lo, hi; } kvq_v16x2;

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE kvq_v16x2 kvq_v2_zero(void)
{
    kvq_v16x2 r;
    r.lo = r.hi = _mm256_setzero_ps();
    return r;
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE kvq_v16x2 kvq_v2_load(const float* x)
{
    kvq_v16x2 r;
    r.lo = _mm256_loadu_ps(x);
    r.hi = _mm256_loadu_ps(x + 8);
    return r;
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE void kvq_v2_store(float* x, kvq_v16x2 a)
{
    _mm256_storeu_ps(x, a.lo);
    _mm256_storeu_ps(x + 8, a.hi);
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE kvq_v16x2 kvq_v2_add(kvq_v16x2 a, kvq_v16x2 b)
{
    a.lo = _mm256_add_ps(a.lo, b.lo);
    a.hi = _mm256_add_ps(a.hi, b.hi);
    return a;
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE kvq_v16x2 kvq_v2_mul(kvq_v16x2 a, kvq_v16x2 b)
{
    a.lo = _mm256_mul_ps(a.lo, b.lo);
    a.hi = _mm256_mul_ps(a.hi, b.hi);
    return a;
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE kvq_v16x2 kvq_v2_set1(float c)
{
    kvq_v16x2 r;
    r.lo = r.hi = _mm256_set1_ps(c);
    return r;
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE float kvq_tree16_avx2(kvq_v16x2 v)
{
    const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* kvq_tree16 of four vectors at once (row k in element k), the same pairwise adds. */
KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE __m128 kvq_tree16x4_avx2(kvq_v16x2 a, kvq_v16x2 b,
                                                                 kvq_v16x2 c, kvq_v16x2 d)
{
    const __m256 a8 = _mm256_add_ps(a.lo, a.hi), b8 = _mm256_add_ps(b.lo, b.hi);
    const __m256 c8 = _mm256_add_ps(c.lo, c.hi), d8 = _mm256_add_ps(d.lo, d.hi);
    /* j + j+4: [a | b] and [c | d], one row per 128-bit half */
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a8, b8, 0x20),
                                    _mm256_permute2f128_ps(a8, b8, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c8, d8, 0x20),
                                    _mm256_permute2f128_ps(c8, d8, 0x31));
    /* j + j+2: [a0 a1 c0 c1 | b0 b1 d0 d1] */
    const __m256 s2 = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    /* j + j+1: [a c a c | b d b d] */
    const __m256 s1 = _mm256_add_ps(_mm256_shuffle_ps(s2, s2, 0x88), _mm256_shuffle_ps(s2, s2, 0xDD));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(s1), _mm256_extractf128_ps(s1, 1));
}

/* kvq_tree16 of eight vectors a[0..7] at once (row k in element k), the same pairwise adds in a
 * transposed layout (as kvq_tree16x16_avx512). */
KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE __m256 kvq_tree16x8_avx2(const kvq_v16x2* a)
{
    __m256 v[4], z0, z1, s;
    int k;
    for (k = 0; k < 4; k++) {
        /* j + j+8 (the two registers), then j + j+4: 128-bit half h of v[k] holds row 2k + h */
        const __m256 x = _mm256_add_ps(a[2 * k].lo, a[2 * k].hi);
        const __m256 y = _mm256_add_ps(a[2 * k + 1].lo, a[2 * k + 1].hi);
        v[k] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    }
    /* j + j+2: half h holds rows h, 2 + h (z0) and 4 + h, 6 + h (z1), two elements each */
    z0 = _mm256_add_ps(_mm256_shuffle_ps(v[0], v[1], 0x44), _mm256_shuffle_ps(v[0], v[1], 0xEE));
    z1 = _mm256_add_ps(_mm256_shuffle_ps(v[2], v[3], 0x44), _mm256_shuffle_ps(v[2], v[3], 0xEE));
    /* j + j+1: element 4h + k holds row 2k + h; the permute puts the rows in order */
    s = _mm256_add_ps(_mm256_shuffle_ps(z0, z1, 0x88), _mm256_shuffle_ps(z0, z1, 0xDD));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* dst[k] = kvq_tree16(a[k]) (times scale[k] when scale is not NULL), k = 0..15. */
KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE void kvq_sums16_avx2(const kvq_v16x2* a, float* dst,
                                                            const float* scale)
{
    __m256 s0 = kvq_tree16x8_avx2(a), s1 = kvq_tree16x8_avx2(a + 8);
    if (scale) {
        s0 = _mm256_mul_ps(s0, _mm256_loadu_ps(scale));
        s1 = _mm256_mul_ps(s1, _mm256_loadu_ps(scale + 8));
    }
    _mm256_storeu_ps(dst, s0);
    _mm256_storeu_ps(dst + 8, s1);
}

/* A macro: as an inline function GCC may judge it free of side effects and drop the calls. */
#define kvq_prefetch(p) _mm_prefetch((const char*)(p), _MM_HINT_T2)

/* Lanes [0, rem) set. */
static inline __mmask16 kvq_mask16(int64_t rem)
{
    return (__mmask16)((1u << rem) - 1u);
}
#elif defined(__GNUC__) || defined(__clang__)
/* the same hint on any ISA (read, low temporal locality: as _MM_HINT_T2) */
#define kvq_prefetch(p) __builtin_prefetch((const void*)(p), 0, 1)
#else
#define kvq_prefetch(p) ((void)(p))
#endif

/* Rows stream from memory faster than the hardware prefetchers fetch them on this kind of
 * machine (measured: 2x on a busy 2-core VM), so the kernels ask for the line this many bytes
 * ahead of where they read, into L2. Prefetches never fault, past the end of the rows too. */
#define KVQ_PREFETCH_BYTES 16384

/* ---- the portable path's 16 lanes --------------------------------------------------------------
 * GCC and Clang vector extensions: 128-bit vectors (the width every SIMD ISA has: SSE2, NEON,
 * AltiVec, WASM) whose operations are lane-wise IEEE single precision (a multiply and an add stay
 * two roundings under -ffp-contract=off), lowered by the compiler to the target's instructions.
 * No intrinsics: the same source on every ISA. The 16 lanes of simd.h's order are four of them,
 * a struct the compiler keeps in registers (a single 64-byte vector type is not: without AVX-512
 * GCC keeps such variables in memory). A compiler without the extensions, or -DKVQ_NO_VECTOR_EXT,
 * keeps the scalar kernels of each family (which define the bits) query by query; so does an x86
 * build for the baseline ISA (SSE2), where the byte shuffles have no instruction and the
 * compiler's emulation is slower than the scalar kernels (measured: 0.07-0.28x numpy against
 * 0.4-0.8x): the vector kernels need SSSE3 there (-march=x86-64-v2 or later, KVQUANT_MARCH).
 * tools/check_portability.py builds these headers with GCC and Clang for x86-64 and aarch64
 * (NEON) and compares the bits of every output (docs/portability.md). */
#if !defined(KVQ_NO_VECTOR_EXT) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)) \
    && (!(defined(__x86_64__) || defined(__i386__)) || defined(__SSSE3__))
#define KVQ_PORTABLE_VECTORS 1
typedef float kvq_pv4 __attribute__((vector_size(16)));    /* 4 float lanes */
typedef int32_t kvq_pv4i __attribute__((vector_size(16))); /* 4 int32 lanes (compare results) */
typedef uint32_t kvq_pv4u __attribute__((vector_size(16)));/* 4 uint32 lanes (bit moves) */
typedef uint8_t kvq_pvb __attribute__((vector_size(16)));  /* 16 bytes */
typedef uint16_t kvq_pvh __attribute__((vector_size(16))); /* 8 uint16 */
typedef uint64_t kvq_pvq __attribute__((vector_size(16))); /* 2 uint64 */
typedef struct { kvq_pv4 q[4]; } kvq_pv;                   /* 16 lanes: q[k] holds 4k .. 4k+3 */

/* A shuffle of two vectors of type T by constant indices (0.. from a, then b). GCC before 12 has
 * only __builtin_shuffle, which takes the indices as a vector of T. */
#if defined(__clang__) || __GNUC__ >= 12
#define KVQ_SHUFFLE(T, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KVQ_SHUFFLE(T, a, b, ...) __builtin_shuffle(a, b, (T){__VA_ARGS__})
#endif

/* Bytes 4q .. 4q + 3 of x as four 32-bit lanes, each byte in bits 24-31 (the bits below are
 * copies of it: the decoders shift or mask them away). The widening as a constant byte shuffle,
 * one pshufb with SSSE3 or a tbl on ARM. */
#define KVQ_PVB_TOP4(x, q)                                                                   \
    ((kvq_pv4u)KVQ_SHUFFLE(kvq_pvb, x, x, 4 * (q), 4 * (q), 4 * (q), 4 * (q), 4 * (q) + 1,     \
                           4 * (q) + 1, 4 * (q) + 1, 4 * (q) + 1, 4 * (q) + 2, 4 * (q) + 2,      \
                           4 * (q) + 2, 4 * (q) + 2, 4 * (q) + 3, 4 * (q) + 3, 4 * (q) + 3,      \
                           4 * (q) + 3))

/* r[i] = tab[idx[i] mod 16], i = 0..15: a byte table lookup with variable indices (one pshufb
 * with SSSE3, one tbl on ARM). GCC's __builtin_shuffle takes the indices modulo 16 itself. Clang
 * has no variable shuffle builtin: for x86 the lanes written out one by one are what its code
 * generator turns into pshufb (a loop over them is not: that stays sixteen byte loads); for
 * aarch64 Clang 14 does not, so there the lookup is NEON's tbl, the one intrinsic of the path. */
#if defined(__clang__) && defined(__aarch64__)
#include <arm_neon.h>
#endif
KVQ_INLINE kvq_pvb kvq_pvb_lookup16(kvq_pvb tab, kvq_pvb idx)
{
#if !defined(__clang__)
    return __builtin_shuffle(tab, idx);
#elif defined(__aarch64__)
    return (kvq_pvb)vqtbl1q_u8((uint8x16_t)tab, (uint8x16_t)(idx & 15));
#else
    kvq_pvb r;
    idx &= 15;
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(idx));   /* and the indices one vector (see below) */
#endif
    r[0] = tab[idx[0]];   r[1] = tab[idx[1]];   r[2] = tab[idx[2]];   r[3] = tab[idx[3]];
    r[4] = tab[idx[4]];   r[5] = tab[idx[5]];   r[6] = tab[idx[6]];   r[7] = tab[idx[7]];
    r[8] = tab[idx[8]];   r[9] = tab[idx[9]];   r[10] = tab[idx[10]]; r[11] = tab[idx[11]];
    r[12] = tab[idx[12]]; r[13] = tab[idx[13]]; r[14] = tab[idx[14]]; r[15] = tab[idx[15]];
#if defined(__x86_64__) || defined(__i386__)
    /* empty asms keep the indices and the lanes one vector each: merged into the shuffles
     * around them they would no longer be a lookup, and become sixteen byte loads again */
    __asm__("" : "+x"(r));
#endif
    return r;
#endif
}

/* KVQ_PVB_TOP4 for a quarter k that is a constant after inlining (the shuffle takes literals). */
KVQ_INLINE kvq_pv4u kvq_pvb_top4(kvq_pvb x, const int k)
{
    return k == 0 ? KVQ_PVB_TOP4(x, 0) : k == 1 ? KVQ_PVB_TOP4(x, 1)
         : k == 2 ? KVQ_PVB_TOP4(x, 2) : KVQ_PVB_TOP4(x, 3);
}

KVQ_INLINE kvq_pv kvq_pv_zero(void)
{
    kvq_pv r;
    int k;
    for (k = 0; k < 4; k++) r.q[k] = (kvq_pv4){0.0f, 0.0f, 0.0f, 0.0f};
    return r;
}

KVQ_INLINE kvq_pv kvq_pv_load(const float* x)
{
    kvq_pv r;
    int k;
    for (k = 0; k < 4; k++) memcpy(&r.q[k], x + 4 * k, 16);
    return r;
}

KVQ_INLINE void kvq_pv_store(float* x, kvq_pv v)
{
    int k;
    for (k = 0; k < 4; k++) memcpy(x + 4 * k, &v.q[k], 16);
}

KVQ_INLINE kvq_pv kvq_pv_add(kvq_pv a, kvq_pv b)
{
    int k;
    for (k = 0; k < 4; k++) a.q[k] = a.q[k] + b.q[k];
    return a;
}

KVQ_INLINE kvq_pv kvq_pv_mul(kvq_pv a, kvq_pv b)
{
    int k;
    for (k = 0; k < 4; k++) a.q[k] = a.q[k] * b.q[k];
    return a;
}

/* every lane c (a -0 stays -0: no `zero + c`) */
KVQ_INLINE kvq_pv kvq_pv_set1(float c)
{
    kvq_pv r;
    int k;
    for (k = 0; k < 4; k++) r.q[k] = (kvq_pv4){c, c, c, c};
    return r;
}

/* The first two levels of kvq_tree16 (j + j+8, then j + j+4): the four partial sums s4. */
KVQ_INLINE kvq_pv4 kvq_pv_tree16_s4(kvq_pv v)
{
    return (v.q[0] + v.q[2]) + (v.q[1] + v.q[3]);
}

KVQ_INLINE float kvq_pv_tree16(kvq_pv v)
{
    const kvq_pv4 s4 = kvq_pv_tree16_s4(v);
    const kvq_pv4 s2 = s4 + KVQ_SHUFFLE(kvq_pv4i, s4, s4, 2, 3, 2, 3);   /* j + j+2 */
    return s2[0] + s2[1];                                               /* j + j+1 */
}

/* kvq_tree16 of four vectors at once (row k in element k): the same pairwise adds, the last two
 * levels on the transposed partial sums (four rows per add). */
KVQ_INLINE kvq_pv4 kvq_pv_tree16x4v(kvq_pv a, kvq_pv b, kvq_pv c, kvq_pv d)
{
    const kvq_pv4 sa = kvq_pv_tree16_s4(a), sb = kvq_pv_tree16_s4(b);
    const kvq_pv4 sc = kvq_pv_tree16_s4(c), sd = kvq_pv_tree16_s4(d);
    const kvq_pv4 ab01 = KVQ_SHUFFLE(kvq_pv4i, sa, sb, 0, 4, 1, 5);   /* a0 b0 a1 b1 */
    const kvq_pv4 ab23 = KVQ_SHUFFLE(kvq_pv4i, sa, sb, 2, 6, 3, 7);
    const kvq_pv4 cd01 = KVQ_SHUFFLE(kvq_pv4i, sc, sd, 0, 4, 1, 5);
    const kvq_pv4 cd23 = KVQ_SHUFFLE(kvq_pv4i, sc, sd, 2, 6, 3, 7);
    /* element k of lane j's column: s4[j] of row k */
    const kvq_pv4 l0 = KVQ_SHUFFLE(kvq_pv4i, ab01, cd01, 0, 1, 4, 5);
    const kvq_pv4 l1 = KVQ_SHUFFLE(kvq_pv4i, ab01, cd01, 2, 3, 6, 7);
    const kvq_pv4 l2 = KVQ_SHUFFLE(kvq_pv4i, ab23, cd23, 0, 1, 4, 5);
    const kvq_pv4 l3 = KVQ_SHUFFLE(kvq_pv4i, ab23, cd23, 2, 3, 6, 7);
    return (l0 + l2) + (l1 + l3);   /* j + j+2, then j + j+1 */
}

/* out[k] = kvq_tree16(a[k]), k = 0..3 */
KVQ_INLINE void kvq_pv_tree16x4(kvq_pv a, kvq_pv b, kvq_pv c, kvq_pv d, float* out)
{
    const kvq_pv4 s = kvq_pv_tree16x4v(a, b, c, d);
    memcpy(out, &s, 16);
}

/* dst[k] = kvq_tree16(a[k]) (times scale[k] when scale is not NULL), k = 0..15. */
KVQ_INLINE void kvq_pv_sums16(const kvq_pv* a, float* dst, const float* scale)
{
    kvq_pv4 s, f;
    int k;
    for (k = 0; k < 16; k += 4) {
        s = kvq_pv_tree16x4v(a[k], a[k + 1], a[k + 2], a[k + 3]);
        if (scale) {
            memcpy(&f, scale + k, 16);
            s = s * f;
        }
        memcpy(dst + k, &s, 16);
    }
}
#else
#define KVQ_PORTABLE_VECTORS 0
#endif

#endif /* KVQ_SIMD_H */
