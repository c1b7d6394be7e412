/* The portable path's multi-query kernels against the families' scalar one-query kernels, built
 * outside the extension with the kernels' headers (tests/test_portable_path.py compiles and runs
 * it). With -DKVQ_NO_SIMD the build has no intrinsics at all: the vector-extension kernels
 * (kvq_*_dotm_portable) must give the bits of the scalar kernels applied query by query
 * (kvq_*_dotm_portableq) for every family, width and query count. With -DKVQ_NO_VECTOR_EXT too,
 * the portable kernels are the scalar ones (the plain-C build) and the check shows that build
 * compiles and runs (x86 builds need SSSE3 for the vector kernels: simd.h). Prints whether the
 * vector kernels were compiled (vectors=1) and one line per mismatch, then OK or FAIL (exit
 * status 0 or 1). */
#include <stdio.h>
#include <stdlib.h>
#include "consumers_multi.h"

typedef void (*dotm_fn)(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                        const float*, int, float*, int64_t);
typedef void (*axpym_fn)(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                         const float*, int64_t, int, float*);

static uint64_t state = 0x9E3779B97F4A7C15ull;

static uint32_t next_u32(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 16);
}

static float next_unit(void)   /* uniform in [-1, 1) */
{
    return (float)(next_u32() >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

/* Both kernels over rows [0, T) for m = 1..KVQ_MQ_MAX + 1 queries; returns 1 on a mismatch. */
static int compare(const char* name, const kvq_params* p, const uint8_t* codes, const float* side,
                   int64_t T, float scale, dotm_fn dot, dotm_fn dot_ref, axpym_fn axpy,
                   axpym_fn axpy_ref)
{
    const int64_t n = p->dim, mmax = KVQ_MQ_MAX + 1;
    float* Q = malloc(sizeof(float) * mmax * n);
    float* W = malloc(sizeof(float) * mmax * T);
    float* s1 = malloc(sizeof(float) * mmax * T);
    float* s2 = malloc(sizeof(float) * mmax * T);
    float* c1 = malloc(sizeof(float) * mmax * n);
    float* c2 = malloc(sizeof(float) * mmax * n);
    int64_t i;
    int m, bad = 0;
    for (i = 0; i < mmax * n; i++) Q[i] = next_unit() * scale;
    for (i = 0; i < mmax * T; i++) W[i] = next_unit() * scale;
    for (m = 1; m <= mmax; m++) {
        memset(c1, 0, sizeof(float) * mmax * n);
        memset(c2, 0, sizeof(float) * mmax * n);
        dot(p, codes, side, 0, T, Q, m, s1, T);
        dot_ref(p, codes, side, 0, T, Q, m, s2, T);
        axpy(p, codes, side, 0, T, W, T, m, c1);
        axpy_ref(p, codes, side, 0, T, W, T, m, c2);
        if (memcmp(s1, s2, sizeof(float) * m * T)) {
            printf("%s n=%lld m=%d scale=%g: scores differ\n", name, (long long)n, m, scale);
            bad = 1;
        }
        if (memcmp(c1, c2, sizeof(float) * m * n)) {
            printf("%s n=%lld m=%d scale=%g: contexts differ\n", name, (long long)n, m, scale);
            bad = 1;
        }
    }
    free(Q); free(W); free(s1); free(s2); free(c1); free(c2);
    return bad;
}

int main(void)
{
    const int64_t T = 300;   /* blocks of 16 rows and a tail */
    const int64_t dims[] = {16, 48, 64, 128, 512};
    int bad = 0, di, b;
    uint8_t* codes = malloc((size_t)T * 512 * 2 + 64);
    float* side = malloc(sizeof(float) * T * 128);   /* up to n / 4 scales per row */
    float* x = malloc(sizeof(float) * T * 512);
    kvq_e4m3_init();
    printf("vectors=%d\n", KVQ_PORTABLE_VECTORS);
    for (di = 0; di < (int)(sizeof dims / sizeof dims[0]); di++) {
        const int64_t n = dims[di];
        kvq_params p;
        int64_t i, k;
        float sc;

        /* f32 rows */
        memset(&p, 0, sizeof p);
        p.n_rows = T; p.dim = n; p.code_bytes = 4 * n;
        for (i = 0; i < T * n; i++) x[i] = next_unit();
        bad |= compare("f32", &p, (const uint8_t*)x, side, T, 1.0f, kvq_f32_dotm_portable,
                       kvq_f32_dotm_portableq, kvq_f32_axpym_portable, kvq_f32_axpym_portableq);

        /* kv8: normal codes, with rows of subnormals, zeros, -0 and NaN codes (0x7F, 0xFF) */
        for (i = 0; i < T * n; i++)
            codes[i] = (uint8_t)((next_u32() & 0x87u) | ((1u + next_u32() % 14u) << 3));
        for (i = 0; i < T; i += 7) codes[i * n + next_u32() % n] = (uint8_t)(next_u32() & 0x87u);
        for (i = 3; i < T; i += 11) codes[i * n + next_u32() % n] = 0x7F;
        for (i = 5; i < T; i += 13) codes[i * n + next_u32() % n] = 0xFF;
        for (k = 0; k < 3; k++) {   /* a row per scale, groups of 32, groups of 4 */
            const int64_t G = k == 0 ? n : k == 1 ? 32 : 4;
            if (n % G) continue;
            memset(&p, 0, sizeof p);
            p.n_rows = T; p.dim = n; p.code_bytes = n; p.n_side = n / G; p.group = G;
            for (i = 0; i < T * p.n_side; i++) side[i] = 0.01f * (2.0f + next_unit());
            /* factors below 2^7 (the raw decode) and above */
            for (sc = 1.0f; sc < 1000.0f; sc *= 300.0f)
                bad |= compare("kv8", &p, codes, side, T, sc, kvq_kv8_dotm_portable,
                               kvq_kv8_dotm_portableq, kvq_kv8_axpym_portable,
                               kvq_kv8_axpym_portableq);
        }

        /* tq1 .. tq8: random codes, a zero radius (an inert row) now and then */
        for (b = 1; b <= 8; b++) {
            float levels[256], table[256], byte_levels[256 * 8];
            uint8_t planes[1024];
            int e;
            if (n % 16) continue;
            for (e = 0; e < (1 << b); e++)
                levels[e] = -2.5f + 5.0f * (float)e / (float)(1 << b) + 0.01f * next_unit();
            kvq_tq_prepare(levels, b, table, planes, byte_levels);
            memset(&p, 0, sizeof p);
            p.n_rows = T; p.dim = n; p.code_bytes = n * b / 8; p.n_side = 1; p.bits = b;
            p.sqrtf_n = sqrtf((float)n); p.levels = levels; p.table = table; p.planes = planes;
            p.byte_levels = byte_levels;
            for (i = 0; i < T * p.code_bytes; i++) codes[i] = (uint8_t)next_u32();
            for (i = 0; i < T; i++) side[i] = i % 50 == 3 ? 0.0f : 3.0f * (2.0f + next_unit());
            bad |= compare("tq", &p, codes, side, T, 1.0f, kvq_tq_dotm_portable,
                           kvq_tq_dotm_portableq, kvq_tq_axpym_portable, kvq_tq_axpym_portableq);
        }

        /* q4_0 and q8_0 blocks: random values, fp16 scales of either sign */
        for (b = 4; b <= 8; b += 4) {
            const int64_t nb = n / 32, bb = b == 4 ? 18 : 34;
            if (n % 32) continue;
            memset(&p, 0, sizeof p);
            p.n_rows = T; p.dim = n; p.code_bytes = nb * bb; p.bits = b;
            for (i = 0; i < T * p.code_bytes; i++) codes[i] = (uint8_t)next_u32();
            for (i = 0; i < T; i++)
                for (k = 0; k < nb; k++) {
                    const uint16_t h = (uint16_t)((0x2000u + next_u32() % 0x1800u)
                                                  | (next_u32() & 0x8000u));
                    memcpy(codes + i * p.code_bytes + k * bb, &h, 2);
                }
            bad |= compare(b == 4 ? "q4_0" : "q8_0", &p, codes, side, T, 1.0f,
                           kvq_ggml_dotm_portable, kvq_ggml_dotm_portableq,
                           kvq_ggml_axpym_portable, kvq_ggml_axpym_portableq);
        }
    }
    free(codes); free(side); free(x);
    printf("%s\n", bad ? "FAIL" : "OK");
    return bad;
}
