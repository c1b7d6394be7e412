/* Row operations of the polar codec shared by its encoder, its decoder and its attention
 * consumers (kvquant/_kernels/polar.pyx, consumers_polar.h): the radius bit allocation and the
 * top-down rebuild of a row in the rotated basis. One implementation, so that the decoder's rows
 * and the rows the consumers read are the same bits.
 *
 * Angles are never evaluated here: cos/sin of every (level, width, code) are tabulated once per
 * codec by polar.pyx (angle_tables) with the decoder's float expressions, so a rebuilt element is
 * exactly parent * cos_tab[...] or parent * sin_tab[...], whatever path computes it.
 */
#ifndef KVQ_POLAROPS_H
#define KVQ_POLAROPS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVQ_POLAR_MAX_BITS 8      /* widest code of one angle (radius allocation) */

/* Nonzero: the encoder's AVX-512 helpers (here and in polar_encode.h) stand aside and the
 * portable code runs, as on a CPU without AVX-512 (polar.pyx sets it on the paths below AVX-512
 * and under its set_portable, for the tests that check both give the same bits; each module
 * holds its own copy). */
static int kvq_polar_portable = 0;
/* Nonzero: the AVX-512 allocation skips its guess from the mean (kvq_polar_allocate_near_avx512)
 * and always runs its search (polar.pyx's set_near_guess, for the tests of both). */
static int kvq_polar_near_off = 0;
#define KVQ_POLAR_TAB 256         /* entries per (level, width) row of the angle tables */

/* the codec's modes (kvquant.codecs.polar MODE_*) */
#define KVQ_POLAR_GRID 0
#define KVQ_POLAR_LEVEL 1
#define KVQ_POLAR_RADIUS 2

typedef struct {
    int64_t dim;                  /* n, a power of two >= 2 */
    int n_levels;                 /* log2(n) */
    int mode;                     /* KVQ_POLAR_* */
    const int32_t* level_bits;    /* (n_levels + 1,) width of every angle of a level (fixed modes) */
    const int32_t* level_totals;  /* (n_levels + 1,) bits a level occupies */
    const int32_t* level_starts;  /* (n_levels + 1,) first bit of a level; level 1 at bit 0 */
    const float* cos_tab;         /* (n_levels + 1, 9, 256): cos of the angle of (level, width, code) */
    const float* sin_tab;
    const int32_t* log2_cos2;     /* (n_levels + 1, 9, 256) radius mode: 2^16 log2 cos^2 */
    const int32_t* log2_sin2;
    const int32_t* gains;         /* (n_levels + 1, 8) radius mode */
    const void* plan;             /* consumers: their vector constants, built once per call (or NULL) */
} kvq_polar_layout;

static inline int64_t kvq_polar_tab_index(int level, int width)
{
    return ((int64_t)level * (KVQ_POLAR_MAX_BITS + 1) + width) * KVQ_POLAR_TAB;
}

/* Scratch of one thread for rows of width n: per-angle codes, widths, integer weights, keys. */
typedef struct {
    uint8_t* code;     /* (n,) */
    uint8_t* width;    /* (n,) */
    int32_t* weight;   /* (n,) */
    int32_t* child;    /* (n,) */
    uint32_t* keys;    /* (MAX_BITS * n / 2,) */
    uint8_t* row;      /* (n + 8,) a copy of the codes of a row, zero padded: 8-byte reads */
    void* block;       /* the allocation holding all of them */
} kvq_polar_scratch;

/* 0 on success, -1 when memory is short (then nothing is held). */
static int kvq_polar_scratch_alloc(kvq_polar_scratch* s, int64_t n)
{
    const size_t m = (size_t)n;
    char* p = (char*)malloc(3 * m + 8 * m + 4 * (KVQ_POLAR_MAX_BITS * m / 2 + 1) + 64);
    s->block = p;
    if (!p)
        return -1;
    s->keys = (uint32_t*)p;
    p += 4 * (KVQ_POLAR_MAX_BITS * m / 2 + 1);
    s->weight = (int32_t*)p;
    p += 4 * m;
    s->child = (int32_t*)p;
    p += 4 * m;
    s->code = (uint8_t*)p;
    s->width = (uint8_t*)p + m;
    s->row = (uint8_t*)p + 2 * m;   /* a row holds at most 8 (n - 1) bits: n - 1 bytes */
    return 0;
}

static void kvq_polar_scratch_free(kvq_polar_scratch* s)
{
    free(s->block);
    s->block = NULL;
}

/* ---- codes --------------------------------------------------------------------------------- */

/* cnt codes of one width (>= 1) from bit `pos`, through a bit accumulator. */
static inline void kvq_polar_unpack(const uint8_t* row, int64_t pos, int64_t cnt, int width,
                                    uint8_t* code)
{
    const uint8_t* src = row + (pos >> 3);
    const uint32_t mask = (1u << width) - 1u;
    const int drop = (int)(pos & 7);
    uint64_t acc = 0;
    int filled = 0;
    int64_t i;
    if (drop) {
        acc = (uint64_t)(*src++ >> drop);
        filled = 8 - drop;
    }
    for (i = 0; i < cnt; i++) {
        while (filled < width) {
            acc |= (uint64_t)(*src++) << filled;
            filled += 8;
        }
        code[i] = (uint8_t)(acc & mask);
        acc >>= width;
        filled -= width;
    }
}

/* ---- the radius allocation ----------------------------------------------------------------- */

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* the counting loops vectorize; GCC builds one clone per instruction set, picked at load time */
#define KVQ_POLAR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVQ_POLAR_CLONES
#endif

/* How many keys are >= t. */
KVQ_POLAR_CLONES
static int64_t kvq_polar_count_ge(const uint32_t* key, int64_t m, uint32_t t)
{
    uint32_t c = 0;
    int64_t i;
    for (i = 0; i < m; i++) c += key[i] >= t;
    return (int64_t)c;
}

KVQ_POLAR_CLONES
static void kvq_polar_make_keys(const int32_t* weight, int64_t cnt, const int32_t* gain,
                                int64_t base, uint32_t* keys)
{
    int64_t j;
    int k;
    for (j = 0; j < cnt; j++) {
        const uint32_t wj = (uint32_t)(weight[j] - base);
        for (k = 0; k < KVQ_POLAR_MAX_BITS; k++)
            keys[j * KVQ_POLAR_MAX_BITS + k] = wj + (uint32_t)gain[k];
    }
}

/* The search below stops once its bracket holds this few keys, and picks among them directly. */
#define KVQ_POLAR_FEW 16

/* The allocation's AVX-512 kernels (below) are built by GCC on x86-64 Linux. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#define KVQ_POLAR_AVX512 1
#else
#define KVQ_POLAR_AVX512 0
#endif

/* The keys in [lo, lo + width) (the first KVQ_POLAR_FEW of them, in index order) into cand,
 * which holds KVQ_POLAR_FEW + 1 slots; returns how many. Each block of 16 keys gives a bit mask
 * of the keys in range (a vectorized test); only its set bits are visited. */
KVQ_POLAR_CLONES
static int kvq_polar_collect(const uint32_t* key, int64_t m, uint32_t lo, uint32_t width,
                             uint32_t* cand)
{
    int64_t i0, i;
    int found = 0;
    for (i0 = 0; i0 < m && found < KVQ_POLAR_FEW; i0 += 16) {
        const int64_t e = i0 + 16 < m ? i0 + 16 : m;
        uint32_t mask = 0;
        for (i = i0; i < e; i++) mask |= (uint32_t)(key[i] - lo < width) << (i - i0);
        while (mask != 0 && found < KVQ_POLAR_FEW) {
            cand[found++] = key[i0 + __builtin_ctz(mask)];
            mask &= mask - 1u;
        }
    }
    return found;
}

/* The threshold search of kvq_polar_allocate_bits (both paths): its bracket [lo, hi) with
 * count(>= lo) = c_lo >= total > c_hi = count(>= hi), the last probe t and its count c. */
typedef struct {
    int64_t lo, hi, c_lo, c_hi, t, c, step;
    int halve;
} kvq_polar_search;

/* The next probe, strictly inside the bracket: first between the a-th and (a+1)-th bit of a
 * mean angle (a the mean width), then a step by the expected slope, then interpolation, or
 * halving as kvq_polar_search_take set it. The threshold found is exact whatever the probes. */
static inline int64_t kvq_polar_search_probe(kvq_polar_search* s, int64_t total, int64_t cnt,
                                             int64_t w_sum, int64_t base, const int32_t* gain)
{
    const int a = total / cnt < 1 ? 1 : (total / cnt > 7 ? 7 : (int)(total / cnt));
    int64_t t = s->t;
    if (s->step == 0)
        t = w_sum / cnt - base + ((int64_t)gain[a - 1] + gain[a]) / 2;
    else if (s->step == 1)
        t += (int64_t)((double)(s->c - total) * (double)((int64_t)gain[a - 1] - gain[a])
                       / (double)cnt);
    else if (s->halve)
        t = s->lo + (s->hi - s->lo) / 2;
    else   /* where the count would cross `total` if it fell linearly over the bracket */
        t = s->lo + (int64_t)((double)(s->hi - s->lo) * (double)(s->c_lo - total + 1)
                              / (double)(s->c_lo - s->c_hi + 1));
    s->t = t <= s->lo ? s->lo + 1 : (t >= s->hi ? s->hi - 1 : t);
    return s->t;
}

/* The probe's count c narrows the bracket. */
static inline void kvq_polar_search_take(kvq_polar_search* s, int64_t c, int64_t total)
{
    int shrank_little;
    s->c = c;
    if (c >= total) {
        shrank_little = 2 * (s->t - s->lo) < s->hi - s->lo;
        s->lo = s->t;
        s->c_lo = c;
    } else {
        shrank_little = 2 * (s->hi - s->t) < s->hi - s->lo;
        s->hi = s->t;
        s->c_hi = c;
    }
    /* from the third probe on, a probe that cut the bracket by at least half is followed by one
     * halving (a safeguard against slow interpolation; on the encoder's levels of Gaussian rows
     * it rarely fires: 2.82 counting passes a search at d = 128, polar4, as many as without
     * it, and 2.89 when halving follows the probes that cut less than half instead) */
    s->halve = s->step >= 2 && !shrank_little;
    s->step++;
}

#if KVQ_POLAR_AVX512
/* kvq_polar_widths under AVX-512: 16 angles a vector, each angle's next key (weight plus the
 * gain of its width) by a permute, so that the ties are found in the same pass. `weight` is
 * read in whole vectors (room for cnt rounded up to 16 values; the lanes past cnt are unused). */
__attribute__((target("avx512f"))) static void
kvq_polar_widths_avx512(const int32_t* weight, int64_t cnt, const int32_t* gain, int64_t base,
                        uint32_t thr, int64_t need, uint8_t* width)
{
    const __m512i v_base = _mm512_set1_epi32((int)(uint32_t)base);
    const __m512i v_thr = _mm512_set1_epi32((int)thr), one = _mm512_set1_epi32(1);
    const __m512i v_gain = _mm512_maskz_loadu_epi32(0xFF, gain);   /* lanes 0..7 */
    __m512i g[KVQ_POLAR_MAX_BITS];
    int64_t j0;
    int k;
    for (k = 0; k < KVQ_POLAR_MAX_BITS; k++)
        g[k] = _mm512_set1_epi32(gain[k]);
    for (j0 = 0; j0 < cnt; j0 += 16) {
        const __mmask16 live = cnt - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (cnt - j0)) - 1u);
        const __m512i wj = _mm512_sub_epi32(_mm512_loadu_si512((const void*)(weight + j0)), v_base);
        __m512i above = _mm512_setzero_si512();
        for (k = 0; k < KVQ_POLAR_MAX_BITS; k++)
            above = _mm512_mask_add_epi32(above,
                                          _mm512_cmpgt_epu32_mask(_mm512_add_epi32(wj, g[k]), v_thr),
                                          above, one);
        {
            /* narrowed in a register and copied (a narrowing store to memory is slow on some
             * CPUs) */
            const __m128i w8 = _mm512_cvtepi32_epi8(above);
            if (live == 0xFFFF)
                _mm_storeu_si128((__m128i*)(width + j0), w8);
            else {
                uint8_t b8[16];
                _mm_storeu_si128((__m128i*)b8, w8);
                memcpy(width + j0, b8, (size_t)(cnt - j0));
            }
        }
        if (need > 0) {
            /* the angles whose next key is thr, in index order: the first `need` of them win */
            const __m512i next = _mm512_add_epi32(wj, _mm512_permutexvar_epi32(above, v_gain));
            uint32_t tie = _mm512_mask_cmpeq_epi32_mask(
                live & _mm512_cmplt_epu32_mask(above, _mm512_set1_epi32(KVQ_POLAR_MAX_BITS)),
                next, v_thr);
            while (tie != 0 && need > 0) {
                width[j0 + __builtin_ctz(tie)]++;
                need--;
                tie &= tie - 1u;
            }
        }
    }
}
#endif

#if KVQ_POLAR_AVX512
/* The r-th largest (1 <= r <= m) of cand[0 .. m), m <= 16 (cand holds 16), without sorting (a sort of 16 random
 * keys mispredicts most of its steps): the smallest value with fewer than r values above it.
 * Adds to *n_above how many are above it. */
__attribute__((target("avx512f"))) static uint32_t
kvq_polar_select_avx512(const uint32_t* cand, int m, int64_t r, int64_t* n_above)
{
    const __mmask16 live = (__mmask16)((1u << m) - 1u);
    const __m512i v = _mm512_maskz_mov_epi32(live, _mm512_loadu_si512((const void*)cand));
    const __m512i one = _mm512_set1_epi32(1);
    __m512i gt = _mm512_setzero_si512();
    uint32_t thr;
    int j;
    for (j = 0; j < m; j++)
        gt = _mm512_mask_add_epi32(gt, _mm512_cmplt_epu32_mask(v, _mm512_set1_epi32((int)cand[j])),
                                   gt, one);
    thr = (uint32_t)_mm512_mask_reduce_min_epu32(
        live & _mm512_cmplt_epu32_mask(gt, _mm512_set1_epi32((int)r)), v);
    *n_above += __builtin_popcount(live & _mm512_cmpgt_epu32_mask(v, _mm512_set1_epi32((int)thr)));
    return thr;
}
#endif

#if KVQ_POLAR_AVX512
/* kvq_polar_allocate_bits under AVX-512 (0 < total < MAX_BITS * cnt, cnt >= 2): the same exact
 * threshold, found without writing the keys. Key (j, k) is rel[j] + lift[k] with rel[j] = weight[j]
 * - min weight and lift[k] = gain[k] - gain[MAX_BITS - 1], both >= 0 (`rel`: scratch for cnt
 * values rounded up to 16). The keys >= t are counted 16 angles a vector as rel >= t - lift[k] (a
 * bound at or below 0 counts every angle, one above 2^32 - 1 none). The bracket steps are those
 * of the portable search; its last few keys are gathered by compresses. */
__attribute__((target("avx512f"))) static int64_t
kvq_polar_count_ge_avx512(const uint32_t* rel, int64_t cnt, const int64_t* lift, int64_t t)
{
    __m512i acc = _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi32(1);
    int64_t j0, c = 0;
    int k;
    for (k = 0; k < KVQ_POLAR_MAX_BITS; k++) {
        const int64_t b = t - lift[k];
        __m512i vb;
        if (b <= 0) {
            c += cnt;
            continue;
        }
        if (b > (int64_t)UINT32_MAX)
            continue;
        vb = _mm512_set1_epi32((int)(uint32_t)b);
        for (j0 = 0; j0 + 16 <= cnt; j0 += 16)
            acc = _mm512_mask_add_epi32(acc,
                                        _mm512_cmpge_epu32_mask(_mm512_loadu_si512(rel + j0), vb),
                                        acc, one);
        if (j0 < cnt) {
            const __mmask16 live = (__mmask16)((1u << (cnt - j0)) - 1u);
            acc = _mm512_mask_add_epi32(
                acc, _mm512_mask_cmpge_epu32_mask(live, _mm512_loadu_si512((const void*)(rel + j0)), vb),
                acc, one);
        }
    }
    return c + (int64_t)(uint32_t)_mm512_reduce_add_epi32(acc);
}

/* The allocation of a level of 2 angles under AVX-512 (0 < total < MAX_BITS * cnt), by ranks:
 * with key' = 64 key + 63 - (8 j + k) the keys are distinct and ordered as the greedy takes them
 * (larger first, ties to the lower index), so key' wins when fewer than `total` keys' are above
 * it; each key' is compared with all (at 2 angles cheaper than kvq_polar_allocate_near_avx512,
 * at 4 dearer: 18 and 26 ns against 69 and 30 ns a level on the encoder's levels). Needs span <
 * 2^26 (key' < 2^32): returns 0 (and does nothing) otherwise. */
#define KVQ_POLAR_RANK_MAX_CNT 2
__attribute__((target("avx512f"))) static int
kvq_polar_allocate_ranked_avx512(const int32_t* weight, int64_t cnt, const int32_t* gain,
                                 int64_t total, uint8_t* width)
{
    const int n_vec = (int)(cnt >> 1);   /* 16 keys (two angles) a vector */
    uint32_t key[KVQ_POLAR_RANK_MAX_CNT * KVQ_POLAR_MAX_BITS];
    __m512i kv[KVQ_POLAR_RANK_MAX_CNT / 2], rank[KVQ_POLAR_RANK_MAX_CNT / 2];
    const __m512i gain2 = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)gain)),
        _mm256_loadu_si256((const __m256i*)gain), 1);
    const __m512i lane_down = _mm512_set_epi32(48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59,
                                               60, 61, 62, 63);
    const __m512i one = _mm512_set1_epi32(1), v_total = _mm512_set1_epi32((int)total);
    int64_t w_min = weight[0], w_max = weight[0], base, span, j;
    int v, i;
    for (j = 1; j < cnt; j++) {
        w_min = weight[j] < w_min ? weight[j] : w_min;
        w_max = weight[j] > w_max ? weight[j] : w_max;
    }
    base = w_min + gain[KVQ_POLAR_MAX_BITS - 1];
    span = w_max + gain[0] - base;
    if (span >= ((int64_t)1 << 26))
        return 0;
    for (v = 0; v < n_vec; v++) {
        const __m512i w = _mm512_mask_blend_epi32(
            0xFF00, _mm512_set1_epi32((int)(uint32_t)(weight[2 * v] - base)),
            _mm512_set1_epi32((int)(uint32_t)(weight[2 * v + 1] - base)));
        /* 64 key + 63 - flat index: lane l of vector v is index 16 v + l */
        kv[v] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(w, gain2), 6),
                                 _mm512_sub_epi32(lane_down, _mm512_set1_epi32(16 * v - 48)));
        _mm512_storeu_si512((void*)(key + 16 * v), kv[v]);
        rank[v] = _mm512_setzero_si512();
    }
    for (i = 0; i < 16 * n_vec; i++) {
        const __m512i b = _mm512_set1_epi32((int)key[i]);
        for (v = 0; v < n_vec; v++)
            rank[v] = _mm512_mask_add_epi32(rank[v], _mm512_cmpgt_epu32_mask(b, kv[v]), rank[v],
                                            one);
    }
    for (v = 0; v < n_vec; v++) {
        const uint32_t win = _mm512_cmplt_epu32_mask(rank[v], v_total);
        width[2 * v] = (uint8_t)__builtin_popcount(win & 0xFFu);
        width[2 * v + 1] = (uint8_t)__builtin_popcount(win >> 8);
    }
    return 1;
}

__attribute__((target("avx512f"))) static void
kvq_polar_allocate_bits_avx512(const int32_t* weight, int64_t cnt, const int32_t* gain,
                               int64_t total, uint32_t* rel, uint8_t* width)
{
    const int64_t n_keys = KVQ_POLAR_MAX_BITS * cnt;
    uint32_t cand[2 * KVQ_POLAR_FEW];
    int64_t lo, hi, c_hi, w_sum = 0, j0;
    int64_t w_min, w_max, base, span, lift[KVQ_POLAR_MAX_BITS];
    int m = 0, k;
    __m512i v_min = _mm512_set1_epi32(INT32_MAX), v_max = _mm512_set1_epi32(INT32_MIN);
    __m512i v_sum = _mm512_setzero_si512();
    uint32_t thr;
    /* the weights into rel first, in whole vectors (a masked load of data just stored is slow on
     * some CPUs); the lanes past cnt repeat weight[0] */
    for (j0 = 0; j0 + 16 <= cnt; j0 += 16)
        _mm512_storeu_si512((void*)(rel + j0), _mm512_loadu_si512((const void*)(weight + j0)));
    for (k = (int)j0; k < j0 + 16; k++)
        rel[k] = (uint32_t)weight[k < cnt ? k : 0];
    for (j0 = 0; j0 < cnt; j0 += 16) {
        const __mmask16 live = cnt - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (cnt - j0)) - 1u);
        const __m512i w = _mm512_loadu_si512((const void*)(rel + j0));
        v_min = _mm512_mask_min_epi32(v_min, live, v_min, w);
        v_max = _mm512_mask_max_epi32(v_max, live, v_max, w);
        v_sum = _mm512_add_epi64(v_sum, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(w)));
        v_sum = _mm512_add_epi64(v_sum, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(w, 1)));
    }
    w_min = _mm512_reduce_min_epi32(v_min);
    w_max = _mm512_reduce_max_epi32(v_max);
    w_sum = _mm512_reduce_add_epi64(v_sum);
    base = w_min + gain[KVQ_POLAR_MAX_BITS - 1];
    span = w_max + gain[0] - base;
    for (k = 0; k < KVQ_POLAR_MAX_BITS; k++)
        lift[k] = (int64_t)gain[k] - gain[KVQ_POLAR_MAX_BITS - 1];
    {
        const __m512i v_base = _mm512_set1_epi32((int)(uint32_t)w_min);
        for (j0 = 0; j0 < cnt; j0 += 16)
            _mm512_storeu_si512((void*)(rel + j0),
                                _mm512_sub_epi32(_mm512_loadu_si512((const void*)(rel + j0)),
                                                 v_base));
    }
    {
        kvq_polar_search srch = {0, span + 1, n_keys, 0, 0, 0, 0, 0};
        while (srch.hi - srch.lo > 1 && srch.c_lo - srch.c_hi > KVQ_POLAR_FEW)
            kvq_polar_search_take(&srch, kvq_polar_count_ge_avx512(
                rel, cnt, lift, kvq_polar_search_probe(&srch, total, cnt, w_sum, base, gain)),
                total);
        lo = srch.lo;
        hi = srch.hi;
        c_hi = srch.c_hi;
    }
    if (hi - lo == 1) {
        thr = (uint32_t)lo;
    } else {
        /* the c_lo - c_hi (<= 16) keys in [lo, hi): keys - lo below hi - lo, unsigned */
        const __m512i v_width = _mm512_set1_epi32((int)(uint32_t)(hi - lo));
        for (k = 0; k < KVQ_POLAR_MAX_BITS; k++) {
            const __m512i off = _mm512_set1_epi32((int)(uint32_t)(lift[k] - lo));
            for (j0 = 0; j0 < cnt; j0 += 16) {
                const __mmask16 live =
                    cnt - j0 >= 16 ? 0xFFFF : (__mmask16)((1u << (cnt - j0)) - 1u);
                const __m512i key_lo = _mm512_add_epi32(_mm512_loadu_si512((const void*)(rel + j0)),
                                                        off);
                const __mmask16 in = _mm512_mask_cmplt_epu32_mask(live, key_lo, v_width);
                /* compressed in a register, stored whole (a compress to memory is slow on
                 * some CPUs); cand has room for 16 past the last kept */
                _mm512_storeu_si512((void*)(cand + m),
                                    _mm512_maskz_compress_epi32(
                                        in, _mm512_add_epi32(key_lo, _mm512_set1_epi32((int)(uint32_t)lo))));
                m += __builtin_popcount(in);
            }
        }
        thr = kvq_polar_select_avx512(cand, m, total - c_hi, &c_hi);
    }
    kvq_polar_widths_avx512((const int32_t*)rel, cnt, gain, base - w_min, thr, total - c_hi,
                            width);
}
#endif

#if KVQ_POLAR_AVX512
/* kvq_polar_allocate_near_avx512 handles levels up to this many angles (16 vectors of them). */
#define KVQ_POLAR_NEAR_MAX_CNT 256
/* |weights| and |gains| below this: every key, bound and threshold below is an exact int32. */
#define KVQ_POLAR_NEAR_LIMIT ((int32_t)1 << 29)

/* The s-th smallest (1 <= s <= m) of the m values in lanes [0, m) of v, m <= 16: the largest
 * value with fewer than s values below it (each lane counts the others by 15 rotations). */
__attribute__((target("avx512f"))) static int32_t
kvq_polar_rank_select_avx512(__m512i v, int m, int64_t s)
{
    const __mmask16 live = (__mmask16)((1u << m) - 1u);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i below = _mm512_setzero_si512();
    v = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), live, v);   /* never below a live one */
#define KVQ_POLAR_ROT(SH)                                                                        \
    below = _mm512_mask_add_epi32(below, _mm512_cmplt_epi32_mask(_mm512_alignr_epi32(v, v, SH), v), \
                                  below, one)
    KVQ_POLAR_ROT(1); KVQ_POLAR_ROT(2); KVQ_POLAR_ROT(3); KVQ_POLAR_ROT(4); KVQ_POLAR_ROT(5);
    KVQ_POLAR_ROT(6); KVQ_POLAR_ROT(7); KVQ_POLAR_ROT(8); KVQ_POLAR_ROT(9); KVQ_POLAR_ROT(10);
    KVQ_POLAR_ROT(11); KVQ_POLAR_ROT(12); KVQ_POLAR_ROT(13); KVQ_POLAR_ROT(14); KVQ_POLAR_ROT(15);
#undef KVQ_POLAR_ROT
    return _mm512_mask_reduce_max_epi32(
        live & _mm512_cmplt_epi32_mask(below, _mm512_set1_epi32((int)s)), v);
}

/* The s-th smallest (1 <= s) of the live lanes of nv vectors of values; 0 when it cannot tell
 * (s above the live count, a bracket it cannot narrow in 16 probes): then *ok is 0. `lo` is at or
 * below every live value, `spread` the expected distance from the smallest to the largest. The
 * values in a bracket [lo, hi) are counted by compares at probes aimed by that spread (then
 * twice, four times as far while no probe is above s values), by interpolation, and after 8
 * probes by halving; once it holds at most 16 values they are gathered into one vector
 * (compresses) and ranked there. */
__attribute__((target("avx512f"))) static int32_t
kvq_polar_select_small_avx512(const __m512i* val, const __mmask16* live, int nv, int64_t s,
                              int64_t lo, int64_t spread, int* ok)
{
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    int64_t m_live = 0, hi = (int64_t)INT32_MAX + 1, c_lo = 0, c_hi, x, c;
    __m512i pack = _mm512_setzero_si512();
    int v, pos = 0, iter;
    *ok = 0;
    for (v = 0; v < nv; v++)
        m_live += __builtin_popcount(live[v]);
    if (s > m_live || m_live == 0)
        return 0;
    c_hi = m_live;
    for (iter = 0; c_hi - c_lo > 16; iter++) {
        /* aim the probe at rank s + 7 while the bracket's floor is near s, else at s - 8 */
        const int64_t want = s - c_lo <= 8 ? s + 7 : s - 8;
        if (iter >= 16)
            return 0;
        if (hi > (int64_t)INT32_MAX)   /* no ceiling yet: as if evenly spread, reaching further */
            x = lo + 1 + ((spread * (want - c_lo) / m_live) << (iter < 20 ? iter : 20));
        else if (iter < 8)
            x = lo + 1 + (hi - lo) * (want - c_lo) / (c_hi - c_lo);
        else
            x = lo + (hi - lo) / 2;   /* safeguard: plain halving */
        x = x <= lo ? lo + 1 : (x >= hi ? hi - 1 : x);
        if (x > (int64_t)INT32_MAX)
            return 0;
        {
            const __m512i vx = _mm512_set1_epi32((int)x);
            c = 0;
            for (v = 0; v < nv; v++)
                c += __builtin_popcount(_mm512_mask_cmplt_epi32_mask(live[v], val[v], vx));
        }
        if (c < s) {
            lo = x;
            c_lo = c;
        } else {
            hi = x;
            c_hi = c;
        }
    }
    /* the c_hi - c_lo (<= 16) live values in [lo, hi) into the first lanes of pack */
    {
        const __m512i vlo = _mm512_set1_epi32((int)lo);
        const __m512i vhi = _mm512_set1_epi32((int)(hi > (int64_t)INT32_MAX ? INT32_MAX : hi));
        for (v = 0; v < nv; v++) {
            __mmask16 in = _mm512_mask_cmpge_epi32_mask(live[v], val[v], vlo);
            int p;
            if (hi <= (int64_t)INT32_MAX)
                in &= _mm512_cmplt_epi32_mask(val[v], vhi);
            p = __builtin_popcount(in);
            if (p != 0) {
                const __m512i comp = _mm512_maskz_compress_epi32(in, val[v]);
                pack = _mm512_mask_permutexvar_epi32(
                    pack, (__mmask16)(((1u << p) - 1u) << pos),
                    _mm512_sub_epi32(iota, _mm512_set1_epi32(pos)), comp);
                pos += p;
            }
        }
    }
    *ok = 1;
    return kvq_polar_rank_select_avx512(pack, pos, s - c_lo);
}

/* The widths of nv vectors (cnt angles) narrowed to bytes, in whole 16-byte stores. */
__attribute__((target("avx512f"))) static inline void
kvq_polar_store_widths(const __m512i* wd, int nv, int64_t cnt, uint8_t* width)
{
    int v;
    for (v = 0; v < nv; v++) {
        /* narrowed in a register and copied (a narrowing store to memory is slow on some CPUs) */
        const __m128i w8 = _mm512_cvtepi32_epi8(wd[v]);
        if (cnt >= 16)
            _mm_storeu_si128((__m128i*)(width + 16 * v), w8);
        else {
            uint8_t b8[16];
            _mm_storeu_si128((__m128i*)b8, w8);
            memcpy(width, b8, (size_t)cnt);
        }
    }
}

/* The allocation of a level (2 <= cnt <= KVQ_POLAR_NEAR_MAX_CNT, a power of two; 0 < total <
 * MAX_BITS * cnt) from its first guess, under AVX-512; the widths of kvq_polar_allocate_bits.
 * Keys are weight + gain as int32 (returns 0, doing nothing useful, when a weight or gain is too
 * large for that, or when it cannot decide: the search then runs).
 * The guess t0 (the mean weight plus a mean angle's gain between its a-th and (a+1)-th bit, a the
 * level's mean width) gives every angle its width w at t0 in one pass, and c0 = the count of keys
 * >= t0 (their sum). Near t0 the keys are those of each angle next to it: its last key taken,
 * M = weight + gain[w - 1] >= t0, and its first key left, N = weight + gain[w] < t0. With c0 =
 * total the keys >= t0 are the winners; with c0 > total the threshold (the total-th largest key)
 * is the (c0 - total + 1)-th smallest M, with c0 < total the (total - c0)-th largest N, unless
 * an angle's second key from t0 comes first. So that value is only a candidate T: the last pass
 * counts the keys above it and equal to it, and T is the threshold exactly when count(> T) <
 * total <= count(>= T); then every key above T wins and `need` of those equal to it, in index
 * order. */
__attribute__((target("avx512f"))) static int
kvq_polar_allocate_near_avx512(const int32_t* weight, int64_t cnt, const int32_t* gain,
                               int64_t total, uint8_t* width)
{
    const int nv = (int)((cnt + 15) >> 4), log2_cnt = __builtin_ctzll((unsigned long long)cnt);
    const __mmask16 last = cnt >= 16 ? 0xFFFF : (__mmask16)((1u << cnt) - 1u);
    const __m512i v_gain = _mm512_maskz_loadu_epi32(0xFF, gain);   /* lanes 0..7 */
    const __m512i one = _mm512_set1_epi32(1), eight = _mm512_set1_epi32(KVQ_POLAR_MAX_BITS);
    __m512i w[KVQ_POLAR_NEAR_MAX_CNT / 16], wd[KVQ_POLAR_NEAR_MAX_CNT / 16];
    __m512i val[KVQ_POLAR_NEAR_MAX_CNT / 16];
    __mmask16 live[KVQ_POLAR_NEAR_MAX_CNT / 16], tie[KVQ_POLAR_NEAR_MAX_CNT / 16];
    __m512i v_sum = _mm512_setzero_si512(), v_min, v_max, v_c = _mm512_setzero_si512();
    int64_t w_sum, t0, c0, s, need;
    int32_t thr;
    int a, k, v, ok, take;
    for (k = 0; k < KVQ_POLAR_MAX_BITS; k++)
        if (gain[k] >= KVQ_POLAR_NEAR_LIMIT || gain[k] <= -KVQ_POLAR_NEAR_LIMIT)
            return 0;
    v_min = v_max = _mm512_setzero_si512();
    for (v = 0; v < nv; v++) {
        w[v] = _mm512_maskz_loadu_epi32(v == nv - 1 ? last : 0xFFFF, weight + 16 * v);
        v_min = _mm512_min_epi32(v_min, w[v]);
        v_max = _mm512_max_epi32(v_max, w[v]);
        v_sum = _mm512_add_epi64(v_sum, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(w[v])));
        v_sum = _mm512_add_epi64(v_sum, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(w[v], 1)));
    }
    if (_mm512_reduce_min_epi32(v_min) <= -KVQ_POLAR_NEAR_LIMIT
        || _mm512_reduce_max_epi32(v_max) >= KVQ_POLAR_NEAR_LIMIT)
        return 0;
    w_sum = _mm512_reduce_add_epi64(v_sum);
    a = (int)(total >> log2_cnt);
    a = a < 1 ? 1 : (a > KVQ_POLAR_MAX_BITS - 1 ? KVQ_POLAR_MAX_BITS - 1 : a);
    t0 = (w_sum >> log2_cnt) + (((int64_t)gain[a - 1] + gain[a]) >> 1);
    /* pass 1: the widths at t0 (key >= t0 as weight >= t0 - gain) and their sum */
    {
        __m512i b[KVQ_POLAR_MAX_BITS];
        for (k = 0; k < KVQ_POLAR_MAX_BITS; k++)
            b[k] = _mm512_set1_epi32((int)(t0 - gain[k]));
        for (v = 0; v < nv; v++) {
            __m512i c = _mm512_setzero_si512();
            for (k = 0; k < KVQ_POLAR_MAX_BITS; k++)
                c = _mm512_mask_add_epi32(c, _mm512_cmpge_epi32_mask(w[v], b[k]), c, one);
            wd[v] = c;
            v_c = _mm512_mask_add_epi32(v_c, v == nv - 1 ? last : 0xFFFF, v_c, c);
        }
        c0 = _mm512_reduce_add_epi32(v_c);
    }
    if (c0 == total) {   /* the keys >= t0 are the winners */
        kvq_polar_store_widths(wd, nv, cnt, width);
        return 1;
    }
    /* the candidate: an M (c0 > total) or -N (c0 < total, so that both are smallest-first) */
    take = c0 > total;
    {
        const __m512i shift = take ? _mm512_set1_epi32(-1) : _mm512_setzero_si512();
        for (v = 0; v < nv; v++) {
            const __mmask16 lane = v == nv - 1 ? last : 0xFFFF;
            const __m512i g = _mm512_permutexvar_epi32(_mm512_add_epi32(wd[v], shift), v_gain);
            const __m512i key = _mm512_add_epi32(w[v], g);
            if (take) {
                live[v] = lane & _mm512_cmpge_epi32_mask(wd[v], one);
                val[v] = key;
            } else {
                live[v] = lane & _mm512_cmplt_epi32_mask(wd[v], eight);
                val[v] = _mm512_sub_epi32(_mm512_setzero_si512(), key);
            }
        }
        s = take ? c0 - total + 1 : total - c0;
        /* M >= t0 and -N >= 1 - t0; the M (N) lie within about one gain step of t0 */
        thr = kvq_polar_select_small_avx512(val, live, nv, s, take ? t0 : 1 - t0,
                                            (int64_t)gain[a - 1] - gain[a], &ok);
        if (!ok)
            return 0;
    }
    /* Every other key of an angle is at least the smallest gain step from its M (N): with the
     * candidate that close to t0, the keys at or past it are the M (N) alone, and the widths
     * follow from theirs at t0: an angle loses (take) or gains its bit when its value is below
     * the candidate; of those equal to it, the first `need` keep (win) theirs. */
    {
        int64_t min_step = (int64_t)gain[0] - gain[1], n_below = 0, n_eq = 0;
        const __m512i v_thr = _mm512_set1_epi32(thr);
        __mmask16 below[KVQ_POLAR_NEAR_MAX_CNT / 16];
        for (k = 2; k < KVQ_POLAR_MAX_BITS; k++)
            min_step = (int64_t)gain[k - 1] - gain[k] < min_step ? (int64_t)gain[k - 1] - gain[k]
                                                                 : min_step;
        if (take ? (int64_t)thr >= t0 + min_step : -(int64_t)thr < t0 - min_step)
            return 0;
        for (v = 0; v < nv; v++) {
            below[v] = _mm512_mask_cmplt_epi32_mask(live[v], val[v], v_thr);
            tie[v] = _mm512_mask_cmpeq_epi32_mask(live[v], val[v], v_thr);
            n_below += __builtin_popcount(below[v]);
            n_eq += __builtin_popcount(tie[v]);
        }
        need = take ? n_below + n_eq - s + 1 : s - n_below;
        if (need < 1 || need > n_eq)
            return 0;
        for (v = 0; v < nv; v++) {
            __mmask16 drop = below[v];
            if (take && need == n_eq)          /* every tie keeps its bit */
                ;
            else if (take)
                drop |= tie[v];                /* the ties drop, then the first `need` get it back */
            else if (need == n_eq)
                drop |= tie[v];                /* (take == 0: drop means gain) */
            wd[v] = take ? _mm512_mask_sub_epi32(wd[v], drop, wd[v], one)
                         : _mm512_mask_add_epi32(wd[v], drop, wd[v], one);
        }
        kvq_polar_store_widths(wd, nv, cnt, width);
        if (need != n_eq)
            for (v = 0; v < nv && need > 0; v++) {
                uint32_t t = tie[v];
                while (t != 0 && need > 0) {
                    width[16 * v + __builtin_ctz(t)]++;
                    need--;
                    t &= t - 1u;
                }
            }
        return 1;
    }
}
#endif

/* kvq_polar_allocate_near_avx512 alone, for tests: 1 when it gave the widths, 0 when it left the
 * level to the search, -1 when it cannot run here (no AVX-512, or cnt not a power of two in
 * [2, KVQ_POLAR_NEAR_MAX_CNT], or total outside (0, MAX_BITS * cnt)). */
static int kvq_polar_allocate_near(const int32_t* weight, int64_t cnt, const int32_t* gain,
                                   int64_t total, uint8_t* width)
{
#if KVQ_POLAR_AVX512
    if (__builtin_cpu_supports("avx512f") && cnt >= 2 && cnt <= KVQ_POLAR_NEAR_MAX_CNT
        && (cnt & (cnt - 1)) == 0 && total > 0 && total < KVQ_POLAR_MAX_BITS * cnt)
        return kvq_polar_allocate_near_avx512(weight, cnt, gain, total, width);
#else
    (void)weight; (void)cnt; (void)gain; (void)total; (void)width;
#endif
    return -1;
}

/* Every key above thr wins; `need` of the keys equal to it win, in index order (an angle has at
 * most one key equal to thr: its keys strictly decrease). */
KVQ_POLAR_CLONES
static void kvq_polar_widths(const int32_t* weight, int64_t cnt, const int32_t* gain,
                             int64_t base, uint32_t thr, int64_t need, uint8_t* width)
{
    int64_t j;
    int k;
    for (j = 0; j < cnt; j++) {
        const uint32_t wj = (uint32_t)(weight[j] - base);
        uint8_t above = 0;
        for (k = 0; k < KVQ_POLAR_MAX_BITS; k++) above += wj + (uint32_t)gain[k] > thr;
        width[j] = above;
    }
    for (j = 0; j < cnt && need > 0; j++) {
        const uint32_t wj = (uint32_t)(weight[j] - base);
        if (width[j] < KVQ_POLAR_MAX_BITS && wj + (uint32_t)gain[width[j]] == thr) {
            width[j]++;
            need--;
        }
    }
}

/* min, max and sum of the weights */
KVQ_POLAR_CLONES
static void kvq_polar_weight_stats(const int32_t* weight, int64_t cnt, int64_t* w_min,
                                   int64_t* w_max, int64_t* w_sum)
{
    int32_t lo = weight[0], hi = weight[0];
    int64_t j, sum = 0;
    for (j = 0; j < cnt; j++) {
        lo = weight[j] < lo ? weight[j] : lo;
        hi = weight[j] > hi ? weight[j] : hi;
        sum += weight[j];
    }
    *w_min = lo;
    *w_max = hi;
    *w_sum = sum;
}

/* Greedy bit allocation of one level: giving angle j its (k+1)-th bit is worth
 * weight[j] + gain[k]; the `total` largest keys win, ties to the lower index. Keys of one angle
 * decrease with k (gains strictly decrease), so angle j wins its first width[j] keys.
 * The threshold t (the total-th largest key) is the largest t with at least `total` keys >= t.
 * It is bracketed by exact counts: a first guess from the mean weight and the level's mean
 * width, a step by the expected slope (about one key per angle per gain step), then
 * interpolation, with one halving after each probe (from the third) that cut the bracket by at
 * least half (kvq_polar_search_take); once the bracket holds at most KVQ_POLAR_FEW keys they
 * are sorted. Under AVX-512 a level of up to KVQ_POLAR_NEAR_MAX_CNT angles first tries
 * kvq_polar_allocate_near_avx512 (the keys next to the first guess), which nearly always
 * decides; the search runs when it does not. Whatever the path, t is exact.
 * Integer arithmetic only: encoder, decoder and consumers agree. `keys` is scratch for
 * MAX_BITS * cnt values. */
static void kvq_polar_allocate_bits(const int32_t* weight, int64_t cnt, const int32_t* gain,
                                    int64_t total, uint32_t* keys, uint8_t* width)
{
    const int64_t n_keys = KVQ_POLAR_MAX_BITS * cnt;
    uint32_t cand[KVQ_POLAR_FEW + 1];   /* kvq_polar_collect writes one slot past the last kept */
    int64_t lo, hi, c_hi, w_sum = 0;
    int m;
    int64_t w_min, w_max, base, span;
    uint32_t thr;
    if (total >= n_keys || total <= 0) {
        memset(width, total > 0 ? KVQ_POLAR_MAX_BITS : 0, (size_t)cnt);
        return;
    }
    if (cnt == 1) {
        /* one angle holds every key, strictly decreasing: it wins its first `total` */
        width[0] = (uint8_t)total;
        return;
    }
#if KVQ_POLAR_AVX512
    if (!kvq_polar_portable && __builtin_cpu_supports("avx512f")) {
        if (cnt <= KVQ_POLAR_RANK_MAX_CNT && (cnt & (cnt - 1)) == 0
            && kvq_polar_allocate_ranked_avx512(weight, cnt, gain, total, width))
            return;
        if (!kvq_polar_near_off && cnt <= KVQ_POLAR_NEAR_MAX_CNT && (cnt & (cnt - 1)) == 0
            && kvq_polar_allocate_near_avx512(weight, cnt, gain, total, width))
            return;
        kvq_polar_allocate_bits_avx512(weight, cnt, gain, total, keys, width);
        return;
    }
#endif
    kvq_polar_weight_stats(weight, cnt, &w_min, &w_max, &w_sum);
    base = w_min + gain[KVQ_POLAR_MAX_BITS - 1];
    span = w_max + gain[0] - base;          /* < 2^32: the tables are bounded far below */
    kvq_polar_make_keys(weight, cnt, gain, base, keys);
    {
        kvq_polar_search srch = {0, span + 1, n_keys, 0, 0, 0, 0, 0};
        while (srch.hi - srch.lo > 1 && srch.c_lo - srch.c_hi > KVQ_POLAR_FEW)
            kvq_polar_search_take(&srch, kvq_polar_count_ge(
                keys, n_keys, (uint32_t)kvq_polar_search_probe(&srch, total, cnt, w_sum, base,
                                                               gain)), total);
        lo = srch.lo;
        hi = srch.hi;
        c_hi = srch.c_hi;
    }
    if (hi - lo == 1) {
        thr = (uint32_t)lo;
    } else {
        /* the c_lo - c_hi keys in [lo, hi); the threshold is the (total - c_hi)-th largest */
        int i;
        m = kvq_polar_collect(keys, n_keys, (uint32_t)lo, (uint32_t)(hi - lo), cand);
        for (i = 1; i < m; i++) {   /* insertion sort, largest first */
            const uint32_t v = cand[i];
            int p = i;
            while (p > 0 && cand[p - 1] < v) {
                cand[p] = cand[p - 1];
                p--;
            }
            cand[p] = v;
        }
        thr = cand[total - c_hi - 1];
        for (i = 0; i < m && cand[i] > thr; i++) c_hi++;   /* now: the keys above thr */
    }
    kvq_polar_widths(weight, cnt, gain, base, thr, total - c_hi, width);
}

/* log2 radius^2 of the two halves split by each angle: + log2 cos^2 / + log2 sin^2. */
static inline void kvq_polar_child_weights(const int32_t* weight, int64_t cnt,
                                           const uint8_t* width, const uint8_t* code,
                                           const int32_t* log2_cos2, const int32_t* log2_sin2,
                                           int32_t* child)
{
    int64_t j;
    for (j = 0; j < cnt; j++) {
        const int64_t k = ((int64_t)width[j] << 8) + code[j];
        child[2 * j] = weight[j] + log2_cos2[k];
        child[2 * j + 1] = weight[j] + log2_sin2[k];
    }
}

/* ---- the rebuild --------------------------------------------------------------------------- */

/* Levels n_levels down to `last` of the top-down rebuild, in place in buf, from buf[0] = r:
 * buf[2j] = buf[j] * cos(theta_j), buf[2j+1] = buf[j] * sin(theta_j), j from the top down.
 * After level `last`, buf[0 .. n >> (last - 1)) holds that level's output. The radius mode
 * allocates each level's widths from the levels above, so it always starts at the top. */
static void kvq_polar_rebuild_levels(const kvq_polar_layout* L, const uint8_t* row, float r,
                                     int last, kvq_polar_scratch* s, float* buf)
{
    const int64_t n = L->dim;
    int32_t *cur_w = s->weight, *next_w = s->child, *swap;
    uint8_t* code = s->code;
    const uint8_t* padded = s->row;
    int level;
    int64_t j, cnt;
    buf[0] = r;
    cur_w[0] = 0;
    if (L->mode == KVQ_POLAR_RADIUS) {
        const int64_t end = L->level_starts[L->n_levels] + L->level_totals[L->n_levels];
        const int64_t n_bytes = (end + 7) >> 3;
        memcpy(s->row, row, (size_t)n_bytes);
        memset(s->row + n_bytes, 0, 8);
    }
    for (level = L->n_levels; level >= last; level--) {
        cnt = n >> level;
        if (L->mode == KVQ_POLAR_RADIUS) {
            const int64_t lt = kvq_polar_tab_index(level, 0);
            uint8_t* width = s->width;
            int64_t pos = L->level_starts[level];
            kvq_polar_allocate_bits(cur_w, cnt, L->gains + KVQ_POLAR_MAX_BITS * level,
                                    L->level_totals[level], s->keys, width);
            /* variable widths: 8-byte reads from the padded copy, no branch per code */
            for (j = 0; j < cnt; j++) {
                uint64_t v;
                memcpy(&v, padded + (pos >> 3), 8);
                code[j] = (uint8_t)((v >> (pos & 7)) & ((1u << width[j]) - 1u));
                pos += width[j];
            }
            if (level > 1) {
                kvq_polar_child_weights(cur_w, cnt, width, code, L->log2_cos2 + lt,
                                        L->log2_sin2 + lt, next_w);
                swap = cur_w;
                cur_w = next_w;
                next_w = swap;
            }
            for (j = cnt - 1; j >= 0; j--) {
                const int64_t k = lt + ((int64_t)width[j] << 8) + code[j];
                const float v = buf[j];
                buf[2 * j] = v * L->cos_tab[k];
                buf[2 * j + 1] = v * L->sin_tab[k];
            }
        } else {
            const int w = L->level_bits[level];
            const float* ct = L->cos_tab + kvq_polar_tab_index(level, w);
            const float* st = L->sin_tab + kvq_polar_tab_index(level, w);
            kvq_polar_unpack(row, L->level_starts[level], cnt, w, code);
            for (j = cnt - 1; j >= 0; j--) {
                const float v = buf[j];
                buf[2 * j] = v * ct[code[j]];
                buf[2 * j + 1] = v * st[code[j]];
            }
        }
    }
}

/* The whole row in the rotated basis (the decoder's buffer before its unrotation). */
static inline void kvq_polar_rebuild_row(const kvq_polar_layout* L, const uint8_t* row, float r,
                                         kvq_polar_scratch* s, float* buf)
{
    kvq_polar_rebuild_levels(L, row, r, 1, s, buf);
}

/* The decoder's rule for a stored radius: anything not in (0, 3.4e38f] (the engine's inert
 * threshold, KVQ_ROW_LIMIT of rowops.h) is an inert row. */
static inline int kvq_polar_live(float r)
{
    return r > 0.0f && r <= 3.4e38f;
}

#endif /* KVQ_POLAROPS_H */
