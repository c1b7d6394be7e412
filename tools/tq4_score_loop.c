/* The tq4 score loop at d = 64 alone, in five ways, to see what bounds it: one thread, sixteen
 * 64-wide rows at a time (their sums in registers, reduced by kvq_tree16x16_avx512 as the
 * consumers do), ns per row, best of many passes.
 *
 *   multishift   a broadcast of the group's 8 bytes, vpmultishiftqb, vpermps (the consumers' way)
 *   shift        the same broadcast, a per-lane shift (vpsrlvd), vpermps; lanes hold elements
 *                k + 8 (L & 1) for lane L = 2k + (L & 1), so the query is permuted to match and
 *                each row's sums are permuted back before the tree
 *   preloaded    codes stored already broadcast (64 bytes a group), so the loop loads them with
 *                plain loads: what the broadcast itself costs
 *   from-first   multishift with each row's lanes begun at their first product instead of 0 + it,
 *                and +0 added to each row's sum (simd.h's kvq_sums16_from_first_avx512; the
 *                consumers' narrow score kernels do this)
 *   row-lanes    lanes hold sixteen rows instead of sixteen elements: the query's products with
 *                the 16 levels are tabulated once (64 tables of 16, the very products the loop
 *                would compute), the block's codes are transposed to 8 dwords x 16 rows (24
 *                vpermt2d), and each element costs a shift, a vpermps from its table and an add
 *                into the lane sum it belongs to; the tree is then 15 vertical adds. No
 *                multiplies and no reduction shuffles, but a shuffle-class op per element
 *
 * All five give the same bits (checked). Needs AVX-512 VBMI. Build and run from the repo root:
 *   gcc -O3 -ffp-contract=off -Ikvquant/_kernels tools/tq4_score_loop.c -o /tmp/tq4_score_loop
 *   /tmp/tq4_score_loop 16384 400       # rows, passes
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "simd.h"

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")))

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* The multishift loop. preloaded: `c` holds each group's 8 bytes already broadcast to 64 (the
 * codes are loaded, not broadcast); from_first: each row's lanes begin at their first product,
 * and +0 goes to the row's sum. */
TGT static KVQ_ALWAYS_INLINE void scores_multishift_body(const uint8_t* c, int64_t T,
                                                         const float* q, const float* lev,
                                                         float* out, const int preloaded,
                                                         const int from_first)
{
    uint8_t msh[64];
    __m512 qv[4], acc[16];
    int i, k, s, r;
    for (i = 0; i < 16; i++)
        for (k = 0; k < 4; k++) msh[4 * i + k] = (uint8_t)((4 * i + 8 * k) & 63);
    const __m512i M = _mm512_loadu_si512(msh);
    const __m512 t0 = _mm512_loadu_ps(lev);
    for (s = 0; s < 4; s++) qv[s] = _mm512_loadu_ps(q + 16 * s);
    for (int64_t t = 0; t + 16 <= T; t += 16) {
        for (r = 0; r < 16; r++) {
            __m512 a = _mm512_setzero_ps();
            for (s = 0; s < 4; s++) {
                __m512i x;
                if (preloaded) {
                    x = _mm512_loadu_si512(c + ((t + r) * 4 + s) * 64);
                } else {
                    uint64_t u;
                    memcpy(&u, c + (t + r) * 32 + 8 * s, 8);
                    x = _mm512_set1_epi64((long long)u);
                }
                const __m512 p = _mm512_mul_ps(qv[s], _mm512_permutexvar_ps(
                    _mm512_multishift_epi64_epi8(M, x), t0));
                a = from_first && s == 0 ? p : _mm512_add_ps(a, p);
            }
            acc[r] = a;
        }
        if (from_first) kvq_sums16_from_first_avx512(acc, out + t, NULL);
        else _mm512_storeu_ps(out + t, kvq_tree16x16_avx512(acc));
    }
}

TGT static void scores_multishift(const uint8_t* c, int64_t T, const float* q, const float* lev,
                                  float* out)
{
    scores_multishift_body(c, T, q, lev, out, 0, 0);
}

TGT static void scores_from_first(const uint8_t* c, int64_t T, const float* q, const float* lev,
                                  float* out)
{
    scores_multishift_body(c, T, q, lev, out, 0, 1);
}

TGT static void scores_preloaded(const uint8_t* wide, int64_t T, const float* q,
                                 const float* lev, float* out)
{
    scores_multishift_body(wide, T, q, lev, out, 1, 0);
}

TGT static void scores_shift(const uint8_t* c, int64_t T, const float* q, const float* lev,
                             float* out)
{
    int32_t sh[16], perm[16], back[16];
    __m512 qv[4], acc[16];
    int L, e, s, r;
    for (L = 0; L < 16; L++) {
        sh[L] = 4 * (L >> 1);
        perm[L] = (L >> 1) + 8 * (L & 1);
    }
    for (e = 0; e < 16; e++) back[e] = 2 * (e & 7) + (e >> 3);
    const __m512i S = _mm512_loadu_si512(sh), P = _mm512_loadu_si512(perm);
    const __m512i B = _mm512_loadu_si512(back);
    const __m512 t0 = _mm512_loadu_ps(lev);
    for (s = 0; s < 4; s++) qv[s] = _mm512_permutexvar_ps(P, _mm512_loadu_ps(q + 16 * s));
    for (int64_t t = 0; t + 16 <= T; t += 16) {
        for (r = 0; r < 16; r++) {
            __m512 a = _mm512_setzero_ps();
            for (s = 0; s < 4; s++) {
                uint64_t u;
                memcpy(&u, c + (t + r) * 32 + 8 * s, 8);
                const __m512 v = _mm512_permutexvar_ps(
                    _mm512_srlv_epi32(_mm512_set1_epi64((long long)u), S), t0);
                a = _mm512_add_ps(a, _mm512_mul_ps(qv[s], v));
            }
            acc[r] = _mm512_permutexvar_ps(B, a);
        }
        _mm512_storeu_ps(out + t, kvq_tree16x16_avx512(acc));
    }
}

TGT static void scores_row_lanes(const uint8_t* c, int64_t T, const float* q, const float* lev,
                                 float* out)
{
    /* the transposes: two rows a register -> four -> eight -> sixteen, one dword each */
    const __m512i s1a = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i s1b = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i s2a = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i s2b = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const __m512i s3a = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i s3b = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    float* tab = aligned_alloc(64, 64 * 16 * sizeof(float));
    int i, m, e, h, half, j;
    for (i = 0; i < 64; i++)   /* q_i times each level: the loop's products, computed once */
        _mm512_store_ps(tab + 16 * i, _mm512_mul_ps(_mm512_set1_ps(q[i]), _mm512_loadu_ps(lev)));
    for (int64_t t = 0; t + 16 <= T; t += 16) {
        __m512i L[8], A[8], B[8], X[8];
        __m512 acc[16];
        for (i = 0; i < 8; i++) L[i] = _mm512_loadu_si512(c + (t + 2 * i) * 32);
        for (i = 0; i < 4; i++) {   /* A[2i], A[2i+1]: dwords 0-3 and 4-7 of rows 4i..4i+3 */
            A[2 * i] = _mm512_permutex2var_epi32(L[2 * i], s1a, L[2 * i + 1]);
            A[2 * i + 1] = _mm512_permutex2var_epi32(L[2 * i], s1b, L[2 * i + 1]);
        }
        for (h = 0; h < 2; h++)     /* B: dword pairs of rows 8h..8h+7 */
            for (half = 0; half < 2; half++) {
                B[4 * h + 2 * half] = _mm512_permutex2var_epi32(A[4 * h + half], s2a, A[4 * h + 2 + half]);
                B[4 * h + 2 * half + 1] = _mm512_permutex2var_epi32(A[4 * h + half], s2b, A[4 * h + 2 + half]);
            }
        for (j = 0; j < 4; j++) {   /* X[m]: dword m (elements 8m..8m+7) of the sixteen rows */
            X[2 * j] = _mm512_permutex2var_epi32(B[j], s3a, B[4 + j]);
            X[2 * j + 1] = _mm512_permutex2var_epi32(B[j], s3b, B[4 + j]);
        }
        for (i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (m = 0; m < 8; m++) {
            __m512i x = X[m];
            _Pragma("GCC unroll 8") for (e = 0; e < 8; e++) {   /* vpermps reads bits 0-3 */
                i = 8 * m + e;
                acc[i & 15] = _mm512_add_ps(acc[i & 15],
                                            _mm512_permutexvar_ps(x, _mm512_load_ps(tab + 16 * i)));
                x = _mm512_srli_epi32(x, 4);
            }
        }
        for (i = 0; i < 8; i++) acc[i] = _mm512_add_ps(acc[i], acc[i + 8]);   /* kvq_tree16 */
        for (i = 0; i < 4; i++) acc[i] = _mm512_add_ps(acc[i], acc[i + 4]);
        for (i = 0; i < 2; i++) acc[i] = _mm512_add_ps(acc[i], acc[i + 2]);
        _mm512_storeu_ps(out + t, _mm512_add_ps(acc[0], acc[1]));
    }
    free(tab);
}

int main(int argc, char** argv)
{
    const int64_t T = argc > 1 ? atoll(argv[1]) & ~(int64_t)15 : 16384;
    const int passes = argc > 2 ? atoi(argv[2]) : 400;
    uint8_t* c = malloc(T * 32);
    uint8_t* wide = malloc(T * 4 * 64);
    float q[64], lev[16], *out[5];
    const char* names[5] = {"multishift", "shift", "preloaded", "from-first", "row-lanes"};
    int64_t i;
    int k, p, round;
    if (!__builtin_cpu_supports("avx512vbmi")) {
        fprintf(stderr, "this CPU has no AVX-512 VBMI\n");
        return 2;
    }
    srand(1);
    for (i = 0; i < T * 32; i++) c[i] = (uint8_t)rand();
    for (i = 0; i < T * 4; i++)
        for (k = 0; k < 8; k++) memcpy(wide + i * 64 + 8 * k, c + i * 8, 8);
    for (k = 0; k < 64; k++) q[k] = rand() / (float)RAND_MAX - 0.5f;
    for (k = 0; k < 16; k++) lev[k] = (k - 7.5f) / 4.0f;
    for (k = 0; k < 5; k++) out[k] = malloc(T * 4);
    for (round = 0; round < 3; round++)
        for (k = 0; k < 5; k++) {
            double best = 1e9;
            for (p = 0; p < passes; p++) {
                const double t0 = now_s();
                if (k == 0) scores_multishift(c, T, q, lev, out[0]);
                else if (k == 1) scores_shift(c, T, q, lev, out[1]);
                else if (k == 2) scores_preloaded(wide, T, q, lev, out[2]);
                else if (k == 3) scores_from_first(c, T, q, lev, out[3]);
                else scores_row_lanes(c, T, q, lev, out[4]);
                const double dt = now_s() - t0;
                if (dt < best) best = dt;
            }
            printf("round %d  %-10s %.3f ns/row\n", round, names[k], 1e9 * best / T);
        }
    for (k = 1; k < 5; k++)
        if (memcmp(out[0], out[k], T * 4)) {
            printf("%s: different bits\n", names[k]);
            return 1;
        }
    printf("same bits\n");
    return 0;
}
