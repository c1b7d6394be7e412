/* The portable kernels built outside the extension with the kernels' headers
 * (tests/test_portable_path.py compiles and runs it; tools/check_portability.py builds it with
 * other compilers and for other CPUs and compares what it prints).
 *
 * Consumers: with -DKVQ_NO_SIMD the build has no intrinsics at all: the vector-extension
 * multi-query kernels (kvq_*_dotm_portable) must give the bits of the families' scalar one-query
 * kernels applied query by query (kvq_*_dotm_portableq) for every family, width and query count.
 * With -DKVQ_NO_VECTOR_EXT too, the portable kernels are the scalar ones (the plain-C build) and
 * the check shows that build compiles and runs (x86 builds need SSSE3 for the vector kernels:
 * simd.h). Encoders: the row kernels of rowops.h, fp8ops.h and polar_encode.h on every path the
 * CPU runs (on x86-64 the 4-, 8- and 16-lane ones) must give the bits of the portable path.
 *
 * Prints whether the consumers' vector kernels were compiled (vectors=1), one line per mismatch,
 * then OK or FAIL (exit status 0 or 1). With --digest it also prints, before OK, one line
 * "digest <case> <hash>" per case: a 64-bit FNV-1a hash of the portable path's outputs (NaN
 * outputs hashed as one pattern: IEEE leaves a NaN's sign and payload to the CPU). The inputs
 * come from a fixed integer generator and exact float operations, so every build on every CPU
 * hashes the same outputs when it computes the same bits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "consumers_multi.h"
#include "consumers_ggml_more.h"
#include "consumers_polar.h"
#include "fp8ops.h"
#include "matvec.h"
#include "polar_encode.h"
#include "softmax.h"

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

/* Random ggml rows (T rows of cb bytes, nb blocks of bb bytes): random bytes, then each block's
 * leading fp16 values (its scale, and its min where it has one), `drawn` of them drawn and the
 * first `kept` stored. */
static void random_ggml_rows(uint8_t* codes, int64_t T, int64_t cb, int64_t nb, int64_t bb,
                             int drawn, int kept)
{
    int64_t i, k;
    int j;
    for (i = 0; i < T * cb; i++) codes[i] = (uint8_t)next_u32();
    for (i = 0; i < T; i++)
        for (k = 0; k < nb; k++) {
            uint16_t h[2];
            for (j = 0; j < drawn; j++)
                h[j] = (uint16_t)((0x2000u + next_u32() % 0x1800u) | (next_u32() & 0x8000u));
            memcpy(codes + i * cb + k * bb, h, 2 * (size_t)kept);
        }
}

static int digest_mode = 0;

#define FNV_START 0xcbf29ce484222325ull

static uint64_t fnv_bytes(uint64_t h, const void* data, size_t n)
{
    const uint8_t* b = data;
    size_t i;
    for (i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static uint64_t fnv_floats(uint64_t h, const float* x, int64_t n)
{
    const uint32_t nan_bits = 0x7FC00000u;
    int64_t i;
    for (i = 0; i < n; i++)
        h = x[i] != x[i] ? fnv_bytes(h, &nan_bits, 4) : fnv_bytes(h, x + i, 4);
    return h;
}

static void put_digest(const char* name, uint64_t h)
{
    if (digest_mode) printf("digest %s %016llx\n", name, (unsigned long long)h);
}

/* Both kernels over rows [0, T) for m = 1..KVQ_MQ_MAX + 1 queries; returns 1 on a mismatch. */
static int compare(const char* name, const kvq_params* p, const uint8_t* codes, const float* side,
                   int64_t T, float scale, dotm_fn dot, dotm_fn dot_ref, axpym_fn axpy,
                   axpym_fn axpy_ref)
{
    char label[96];
    uint64_t h = FNV_START;
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
        h = fnv_floats(fnv_floats(h, s1, m * T), c1, m * n);
    }
    snprintf(label, sizeof label, "%s/n=%lld/G=%lld/b=%d/scale=%g", name, (long long)n,
             (long long)p->group, p->bits, scale);
    put_digest(label, h);
    free(Q); free(W); free(s1); free(s2); free(c1); free(c2);
    return bad;
}

typedef void (*dot1_fn)(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                        const float*, float*);
typedef void (*axpy1_fn)(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                         const float*, float*);

/* Scores and a context of one query over rows [0, T) of a family with one path, hashed. */
static void hash_reads(const char* name, const kvq_params* p, const uint8_t* codes, int64_t T,
                       dot1_fn dot, axpy1_fn axpy)
{
    const int64_t n = p->dim;
    float* q = malloc(sizeof(float) * n);
    float* w = malloc(sizeof(float) * T);
    float* s = malloc(sizeof(float) * T);
    float* c = calloc((size_t)n, sizeof(float));
    char label[64];
    int64_t i;
    for (i = 0; i < n; i++) q[i] = next_unit();
    for (i = 0; i < T; i++) w[i] = next_unit();
    dot(p, codes, NULL, 0, T, q, s);
    axpy(p, codes, NULL, 0, T, w, c);
    snprintf(label, sizeof label, "%s/n=%lld/kind=%d", name, (long long)n, p->bits);
    put_digest(label, fnv_floats(fnv_floats(FNV_START, s, T), c, n));
    free(q); free(w); free(s); free(c);
}

/* ---- encoders ------------------------------------------------------------------------------ */

#define ENC_ROWS 24
#define ENC_OPS 8
static const char* const enc_ops[ENC_OPS] = {"rotate", "rotate_safe", "sum_squares", "codes",
                                             "pack", "decode", "fp8", "polar_level"};

/* Bucket tables (rowops.h) of the angle boundaries of widths 1..8 bits over [-pi, pi], width w
 * at angle_tables + w * angle_stride: polar level 1's layout. */
static float* angle_tables;
static int64_t angle_stride;

static void angle_tables_build(void)
{
    float bnd[8][255];
    int64_t len[9] = {0}, nb, win;
    float tlo, tsc;
    int w, e;
    for (w = 1; w <= 8; w++) {
        for (e = 0; e < (1 << w) - 1; e++)
            bnd[w - 1][e] = -3.14159265f + 6.2831853f * ((float)e + 1.0f + 0.2f * next_unit())
                                              / (float)(1 << w);
        len[w] = kvq_code_table_plan(bnd[w - 1], (1 << w) - 1, &nb, &win, &tlo, &tsc);
        angle_stride = len[w] > angle_stride ? len[w] : angle_stride;
    }
    angle_tables = calloc((size_t)(9 * angle_stride), sizeof(float));
    for (w = 1; w <= 8; w++)
        kvq_code_table_build(bnd[w - 1], (1 << w) - 1, angle_tables + w * angle_stride);
}

/* Every encoder kernel over the rows of width n, each op's outputs hashed into h[op]; returns 1
 * when a kernel breaks an invariant that needs no reference (unpack(pack(c)) == c). */
static int encode_rows(const float* X, int64_t n, const float* signs, uint64_t* h)
{
    const float inv_sqrt_n = 1.0f / sqrtf((float)n);
    float* y = malloc(sizeof(float) * n);
    float* r = malloc(sizeof(float) * n);
    float* copy = malloc(sizeof(float) * n);
    float* lo = malloc(sizeof(float) * n);
    float* hi = malloc(sizeof(float) * n);
    double* r2 = malloc(sizeof(double) * n);
    uint8_t* code = malloc((size_t)n);
    uint8_t* back = malloc((size_t)n);
    uint8_t* packed = malloc((size_t)n + 8);
    uint8_t* width = malloc((size_t)n);
    int32_t* undecided = malloc(sizeof(int32_t) * n);
    float levels[256], bnd[255], fscale[64];
    float* table = NULL;
    int64_t t, g;
    int b, e, k, bad = 0, status[3];
    for (k = 0; k < ENC_OPS; k++) h[k] = FNV_START;
    for (t = 0; t < ENC_ROWS; t++) {
        const float* x = X + t * n;
        const int finite = t < ENC_ROWS - 1;   /* the last row holds NaN and inf */
        /* the rotations (the encoders' FWHT) */
        if (finite) {
            kvq_rotate_scale_row(x, signs, n, inv_sqrt_n, 1.25f, y);
            h[0] = fnv_floats(h[0], y, n);
            kvq_rotate_row_safe(x, signs, n, inv_sqrt_n, r);
            h[1] = fnv_floats(h[1], r, n);
        }
        {
            const double s0 = kvq_sum_squares(x, n, 0), s1 = kvq_sum_squares(x, n, 1);
            h[2] = fnv_bytes(fnv_bytes(h[2], &s0, 8), &s1, 8);
        }
        /* nearest codes of b = 1..8 bits (counted compares, the bucket table), packed, decoded */
        for (b = 1; b <= 8; b++) {
            const int n_bnd = (1 << b) - 1;
            int64_t nbk, win;
            float tlo, tsc;
            kvq_code_plan plan;
            int have_plan;
            for (e = 0; e < (1 << b); e++)
                levels[e] = -3.0f + 6.0f * ((float)e + 0.5f) / (float)(1 << b)
                            + 0.003f * next_unit();
            for (e = 0; e < n_bnd; e++) bnd[e] = 0.5f * (levels[e] + levels[e + 1]);
            table = realloc(table, sizeof(float) * kvq_code_table_plan(bnd, n_bnd, &nbk, &win,
                                                                      &tlo, &tsc));
            kvq_code_table_build(bnd, n_bnd, table);
            have_plan = kvq_code_plan_build(bnd, n_bnd, &plan);
            kvq_nearest_codes(finite ? y : x, n, bnd, n_bnd, table, have_plan ? &plan : NULL, code);
            h[3] = fnv_bytes(h[3], code, (size_t)n);
            memset(packed, 0, (size_t)n + 8);
            kvq_pack_codes(code, n, b, packed);
            kvq_unpack_codes(packed, n, b, back);
            h[4] = fnv_bytes(h[4], packed, (size_t)(n * b + 7) / 8);
            if (memcmp(code, back, (size_t)n)) {
                printf("pack n=%lld b=%d: unpack(pack(codes)) differs\n", (long long)n, b);
                bad = 1;
            }
            kvq_decode_row(code, n, levels, 0.75f + 0.25f * next_unit(), signs, inv_sqrt_n, r,
                           copy);
            h[5] = fnv_floats(h[5], r, n);
        }
        /* fp8 e4m3: one scale per row and per group of 32 */
        status[0] = kvq_fp8_encode_group(x, n, code, fscale);
        h[6] = fnv_bytes(fnv_floats(h[6], fscale, 1), code, (size_t)n);
        for (g = 0; g + 32 <= n; g += 32) {
            status[1] = kvq_fp8_encode_group(x + g, 32, code + g, fscale + g / 32);
            h[6] = fnv_bytes(h[6], &status[1], sizeof status[1]);
        }
        h[6] = fnv_bytes(fnv_floats(h[6], fscale, n / 32), code, (size_t)n);
        h[6] = fnv_bytes(h[6], &status[0], sizeof status[0]);
        /* one level of the polar transform: the radii, and each angle's code from its bracket
         * (the brackets themselves differ between paths: AVX-512 bounds the angle in float),
         * libm's atan2f deciding where a bracket holds a boundary, as polar.pyx does */
        if (finite) {
            const int64_t half = n / 2;
            int64_t j, u, nu;
            status[2] = kvq_polar_forward_level(x, half, r, lo, hi, r2);
            for (j = 0; j < half; j++) width[j] = (uint8_t)(1 + j % 8);
            nu = kvq_polar_lloyd_codes(lo, hi, half, width, angle_tables, angle_stride, NULL,
                                       code, undecided);
            for (u = 0; u < nu; u++) {
                j = undecided[u];
                code[j] = (uint8_t)kvq_code_lookup(angle_tables + width[j] * angle_stride,
                                                   atan2f(x[2 * j + 1], x[2 * j]));
            }
            h[7] = fnv_bytes(fnv_floats(h[7], r, half), code, (size_t)half);
            h[7] = fnv_bytes(h[7], &status[2], sizeof status[2]);
        }
    }
    free(y); free(r); free(copy); free(lo); free(hi); free(r2); free(code); free(back);
    free(packed); free(width); free(undecided); free(table);
    return bad;
}

/* Rows of width n: scaled uniform values, a row of subnormals, one whose butterflies overflow
 * in float (rotate_safe's rescaled path), one of zeros of both signs, one with NaN and inf. */
static void encoder_rows(float* X, int64_t n, float* signs)
{
    int64_t t, i;
    for (i = 0; i < n; i++) signs[i] = next_u32() & 1u ? 1.0f : -1.0f;
    for (t = 0; t < ENC_ROWS; t++) {
        const float sc = t < ENC_ROWS - 4 ? (float)(1u << (t % 12)) * 0.01f : 1.0f;
        for (i = 0; i < n; i++) X[t * n + i] = sc * next_unit();
    }
    for (i = 0; i < n; i++) {
        X[(ENC_ROWS - 4) * n + i] *= 1e-39f;
        X[(ENC_ROWS - 3) * n + i] *= 3e38f;
        X[(ENC_ROWS - 2) * n + i] = i % 2 ? -0.0f : 0.0f;
    }
    X[(ENC_ROWS - 1) * n + 1] = NAN;
    X[(ENC_ROWS - 1) * n + 5] = INFINITY;
    X[(ENC_ROWS - 1) * n + n - 1] = -INFINITY;
}

/* The encoder kernels on every path this CPU runs (rowops.h's lane widths, polar's AVX-512
 * helpers), against the portable path's bits; the portable path's outputs hashed. */
static int encoders(void)
{
    const int64_t dims[] = {16, 64, 128, 512};
    const int top = kvq_rowops_cpu_path();
    int bad = 0, di, path, k;
    angle_tables_build();
    for (di = 0; di < (int)(sizeof dims / sizeof dims[0]); di++) {
        const int64_t n = dims[di];
        float* X = malloc(sizeof(float) * ENC_ROWS * n);
        float* signs = malloc(sizeof(float) * n);
        uint64_t want[ENC_OPS], got[ENC_OPS], state0;
        char label[64];
        encoder_rows(X, n, signs);
        state0 = state;   /* every path draws the same levels */
        for (path = 0; path <= top; path++) {
            state = state0;
            kvq_rowops_set_path(path);
            kvq_polar_portable = path < 2;
            bad |= encode_rows(X, n, signs, path ? got : want);
            for (k = 0; path && k < ENC_OPS; k++)
                if (got[k] != want[k]) {
                    printf("%s n=%lld: path %d differs from the portable path\n", enc_ops[k],
                           (long long)n, path);
                    bad = 1;
                }
        }
        kvq_rowops_set_path(-1);
        kvq_polar_portable = 0;
        for (k = 0; k < ENC_OPS; k++) {
            snprintf(label, sizeof label, "enc-%s/n=%lld", enc_ops[k], (long long)n);
            put_digest(label, want[k]);
        }
        free(X); free(signs);
    }
    free(angle_tables);
    return bad;
}

/* softmax.h on every path this CPU runs (its 4-, 8- and 16-lane kernels; the scalar ones in the
 * plain-C build) against the baseline path's bits; those hashed. Rows of several chunks and
 * short tails, -inf entries, a row with a NaN and one of -inf only (NaNs compared as one
 * pattern, as in the digests). */
static int softmax_paths(void)
{
    const int64_t lengths[] = {1, 15, 17, 4096, 4097, 9000};
    const int top = kvq_rowops_cpu_path();
    int bad = 0, li, path;
    for (li = 0; li < (int)(sizeof lengths / sizeof lengths[0]); li++) {
        const int64_t n = lengths[li], m = 4;
        float* S = malloc(sizeof(float) * m * n);
        float* want = malloc(sizeof(float) * m * n);
        float* got = malloc(sizeof(float) * m * n);
        char label[64];
        int64_t i;
        for (i = 0; i < m * n; i++) S[i] = 12.0f * next_unit();
        for (i = 0; i < n; i += 5) S[i] = -INFINITY;
        S[n + n / 2] = NAN;
        for (i = 0; i < n; i++) S[2 * n + i] = -INFINITY;
        for (path = 0; path <= top; path++) {
            float* out = path ? got : want;
            memcpy(out, S, sizeof(float) * m * n);
            bad |= kvq_softmax_rows(out, m, n, 0.3f, 1, path) != 0;
            if (path && fnv_floats(1, got, m * n) != fnv_floats(1, want, m * n)) {
                printf("softmax n=%lld: path %d differs from the baseline path\n", (long long)n,
                       path);
                bad = 1;
            }
        }
        snprintf(label, sizeof label, "softmax/n=%lld", (long long)n);
        put_digest(label, fnv_floats(0xcbf29ce484222325ull, want, m * n));
        free(S); free(want); free(got);
    }
    return bad;
}

/* matvec.h (one cloned function: the loader's pick) hashed, widths with and without a tail of
 * the 16-lane blocks and a row count that leaves a pass of fewer rows. */
static void matvec_digest(void)
{
    const int64_t widths[] = {16, 33, 576};
    const int64_t m = 70;
    int wi;
    for (wi = 0; wi < (int)(sizeof widths / sizeof widths[0]); wi++) {
        const int64_t n = widths[wi];
        float* W = malloc(sizeof(float) * m * n);
        float* x = malloc(sizeof(float) * n);
        float* y = malloc(sizeof(float) * m);
        char label[64];
        int64_t i;
        for (i = 0; i < m * n; i++) W[i] = next_unit();
        for (i = 0; i < n; i++) x[i] = 4.0f * next_unit();
        kvq_matvec_rows(W, n, x, y, 0, m);
        snprintf(label, sizeof label, "matvec/n=%lld", (long long)n);
        put_digest(label, fnv_floats(0xcbf29ce484222325ull, y, m));
        free(W); free(x); free(y);
    }
}

/* Every kernel consumers.pyx dispatches to, by name: a build without x86 SIMD (aarch64, or
 * -DKVQ_NO_SIMD here) must alias each to a portable kernel, or the extension fails to compile. */
static const void* const dispatched[] = {
    (const void*)kvq_f32_dotm_avx2, (const void*)kvq_f32_axpym_avx2,
    (const void*)kvq_f32_dotm_avx512, (const void*)kvq_f32_axpym_avx512,
    (const void*)kvq_kv8_dotm_avx2, (const void*)kvq_kv8_axpym_avx2,
    (const void*)kvq_kv8_dotm_avx512, (const void*)kvq_kv8_axpym_avx512,
    (const void*)kvq_tq_dotm_avx2, (const void*)kvq_tq_axpym_avx2,
    (const void*)kvq_tq_dotm_avx512, (const void*)kvq_tq_axpym_avx512,
    (const void*)kvq_tq_dotm_avx512vbmi, (const void*)kvq_tq_axpym_avx512vbmi,
    (const void*)kvq_ggml_dotm_avx2, (const void*)kvq_ggml_axpym_avx2,
    (const void*)kvq_ggml_dotm_avx512, (const void*)kvq_ggml_axpym_avx512,
    (const void*)kvq_polar_dot_avx512, (const void*)kvq_polar_axpy_avx512,
    (const void*)kvq_gm_dot_avx512, (const void*)kvq_gm_axpy_avx512,
};

int main(int argc, char** argv)
{
    const int64_t T = 300;   /* blocks of 16 rows and a tail */
    const int64_t dims[] = {16, 48, 64, 128, 512};
    int bad = 0, di, b;
    uint8_t* codes = malloc((size_t)T * 512 * 2 + 64);
    float* side = malloc(sizeof(float) * T * 128);   /* up to n / 4 scales per row */
    float* x = malloc(sizeof(float) * T * 512);
    digest_mode = argc > 1 && strcmp(argv[1], "--digest") == 0;
    for (di = 0; di < (int)(sizeof dispatched / sizeof dispatched[0]); di++)
        bad |= dispatched[di] == NULL;
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
            random_ggml_rows(codes, T, p.code_bytes, nb, bb, 1, 1);
            bad |= compare(b == 4 ? "q4_0" : "q8_0", &p, codes, side, T, 1.0f,
                           kvq_ggml_dotm_portable, kvq_ggml_dotm_portableq,
                           kvq_ggml_axpym_portable, kvq_ggml_axpym_portableq);
        }

        /* q4_1, q5_0, q5_1, iq4_nl: one path (scalar) here, so only hashed */
        for (b = KVQ_GM_Q4_1; b <= KVQ_GM_IQ4_NL; b++) {
            const int64_t nb = n / 32, bb = kvq_gm_block_bytes(b);
            if (n % 32) continue;
            memset(&p, 0, sizeof p);
            p.n_rows = T; p.dim = n; p.code_bytes = nb * bb; p.bits = b;
            random_ggml_rows(codes, T, p.code_bytes, nb, bb, 2, kvq_gm_has_min(b) ? 2 : 1);
            hash_reads("ggml", &p, codes, T, kvq_gm_dot_portable, kvq_gm_axpy_portable);
        }
    }
    bad |= encoders();
    bad |= softmax_paths();
    matvec_digest();
    free(codes); free(side); free(x);
    printf("%s\n", bad ? "FAIL" : "OK");
    return bad;
}
