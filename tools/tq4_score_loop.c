/* The tq4 score loop at d = 64 alone, in three ways of putting the codes into lanes, to see what
 * bounds it: one thread, sixteen 64-wide rows at a time (their sums in registers, reduced by
 * kvq_tree16x16_avx512 as the consumers do), ns per row, best of many passes.
 *
 *   multishift   a broadcast of the group's 8 bytes, vpmultishiftqb, vpermps (the consumers' way)
 *   shift        the same broadcast, a per-lane shift (vpsrlvd), vpermps; lanes hold elements
 *                k + 8 (L & 1) for lane L = 2k + (L & 1), so the query is permuted to match and
 *                each row's sums are permuted back before the tree
 *   preloaded    codes stored already broadcast (64 bytes a group), so the loop loads them with
 *                plain loads: what the broadcast itself costs
 *
 * All three give the same bits (checked). Needs AVX-512 VBMI. Build and run from the repo root:
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

TGT static void scores_multishift(const uint8_t* c, int64_t T, const float* q, const float* lev,
                                  float* out)
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
                uint64_t u;
                memcpy(&u, c + (t + r) * 32 + 8 * s, 8);
                const __m512 v = _mm512_permutexvar_ps(
                    _mm512_multishift_epi64_epi8(M, _mm512_set1_epi64((long long)u)), t0);
                a = _mm512_add_ps(a, _mm512_mul_ps(qv[s], v));
            }
            acc[r] = a;
        }
        _mm512_storeu_ps(out + t, kvq_tree16x16_avx512(acc));
    }
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

TGT static void scores_preloaded(const uint8_t* wide, int64_t T, const float* q,
                                 const float* lev, float* out)
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
                const __m512i x = _mm512_loadu_si512(wide + ((t + r) * 4 + s) * 64);
                const __m512 v = _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(M, x), t0);
                a = _mm512_add_ps(a, _mm512_mul_ps(qv[s], v));
            }
            acc[r] = a;
        }
        _mm512_storeu_ps(out + t, kvq_tree16x16_avx512(acc));
    }
}

int main(int argc, char** argv)
{
    const int64_t T = argc > 1 ? atoll(argv[1]) & ~(int64_t)15 : 16384;
    const int passes = argc > 2 ? atoi(argv[2]) : 400;
    uint8_t* c = malloc(T * 32);
    uint8_t* wide = malloc(T * 4 * 64);
    float q[64], lev[16], *out[3];
    const char* names[3] = {"multishift", "shift", "preloaded"};
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
    for (k = 0; k < 3; k++) out[k] = malloc(T * 4);
    for (round = 0; round < 3; round++)
        for (k = 0; k < 3; k++) {
            double best = 1e9;
            for (p = 0; p < passes; p++) {
                const double t0 = now_s();
                if (k == 0) scores_multishift(c, T, q, lev, out[0]);
                else if (k == 1) scores_shift(c, T, q, lev, out[1]);
                else scores_preloaded(wide, T, q, lev, out[2]);
                const double dt = now_s() - t0;
                if (dt < best) best = dt;
            }
            printf("round %d  %-10s %.3f ns/row\n", round, names[k], 1e9 * best / T);
        }
    for (k = 1; k < 3; k++)
        if (memcmp(out[0], out[k], T * 4)) {
            printf("%s: different bits\n", names[k]);
            return 1;
        }
    printf("same bits\n");
    return 0;
}
