/* Row kernels of the polar codec (polar<b>): each row is rebuilt top-down IN THE ROTATED BASIS,
 * exactly as the decoder's buffer before its unrotation (polarops.h), and read right away; the
 * query arrives rotated and contexts are unrotated once by the driver:
 *   score_t = tree16(lanes of q~_i * x~_ti)                     (simd.h order)
 *   acc~_i  = acc~_i + x~'_ti, rows in order, where x~' is the row rebuilt from w_t * r_t
 *             (the weight folded into the radius: one multiply per row instead of one per element)
 * Inert rows (radius not in (0, 3.4e38f]) score 0 and add nothing.
 *
 * The portable path is polarops.h's rebuild. The AVX-512 path (fixed-width modes: compat and
 * alloc=level, n >= 32) computes the same products:
 *   - the four top levels (1 + 2 + 4 + 8 angles: the 16 values entering the level of 16 angles)
 *     in one register: output lane m is r * F1 * F2 * F4 * F8, each factor the cos or sin of
 *     its ancestor's angle, multiplied in the decoder's top-down order;
 *   - every level of >= 16 angles 16 angles at a time: codes cut from 2w bytes (byte aligned:
 *     every earlier level holds a multiple of 8 bits), cos/sin looked up with permutes from
 *     registers, the products v*cos and v*sin interleaved back into element order;
 *   - levels 2 and 1 fused with the dot (or the accumulation): their outputs never go to memory.
 * Its constants (the plan) are built once per call by the driver. alloc=radius has per-row
 * widths (allocate_bits) and n < 32 too few angles: both paths run polarops.h's rebuild there,
 * the AVX-512 one with a vector dot. VBMI is not used: the cut above (one byte shuffle, one
 * shift) already takes 16 codes per step.
 */
#ifndef KVQ_CONSUMERS_POLAR_H
#define KVQ_CONSUMERS_POLAR_H

#include "simd.h"
#include "polarops.h"

/* Scratch of one call: the row buffer and the rebuild's per-angle arrays. */
typedef struct {
    kvq_polar_scratch s;
    float* buf;
} kvq_polar_work;

static int kvq_polar_work_alloc(kvq_polar_work* W, int64_t n)
{
    W->buf = (float*)malloc((size_t)(n + 16) * sizeof(float));
    if (!W->buf)
        return -1;
    if (kvq_polar_scratch_alloc(&W->s, n)) {
        free(W->buf);
        return -1;
    }
    return 0;
}

static void kvq_polar_work_free(kvq_polar_work* W)
{
    kvq_polar_scratch_free(&W->s);
    free(W->buf);
}

static inline float kvq_polar_dot_row(const float* q, const float* x, int64_t n)
{
    float acc[16];
    int64_t i;
    int j;
    kvq_zero16(acc);
    for (i = 0; i + 16 <= n; i += 16)
        for (j = 0; j < 16; j++) acc[j] = acc[j] + q[i + j] * x[i + j];
    for (j = 0; i + j < n; j++) acc[j] = acc[j] + q[i + j] * x[i + j];
    return kvq_tree16(acc);
}

/* Kernels cannot raise: if scratch memory is short, the results are NaN (visible, not wrong). */
static void kvq_polar_dot_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                   int64_t r0, int64_t r1, const float* q, float* out)
{
    const kvq_polar_layout* L = (const kvq_polar_layout*)p->codec;
    const int64_t n = p->dim;
    kvq_polar_work W;
    int64_t t;
    if (kvq_polar_work_alloc(&W, n)) {
        for (t = r0; t < r1; t++) out[t] = NAN;
        return;
    }
    for (t = r0; t < r1; t++) {
        const float r = side[t * p->n_side];
        if (!kvq_polar_live(r)) {
            out[t] = 0.0f;
            continue;
        }
        kvq_polar_rebuild_row(L, codes + t * p->code_bytes, r, &W.s, W.buf);
        out[t] = kvq_polar_dot_row(q, W.buf, n);
    }
    kvq_polar_work_free(&W);
}

static void kvq_polar_axpy_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                    int64_t r0, int64_t r1, const float* w, float* acc)
{
    const kvq_polar_layout* L = (const kvq_polar_layout*)p->codec;
    const int64_t n = p->dim;
    kvq_polar_work W;
    int64_t t, i;
    if (kvq_polar_work_alloc(&W, n)) {
        for (i = 0; i < n; i++) acc[i] = NAN;
        return;
    }
    for (t = r0; t < r1; t++) {
        const float r = side[t * p->n_side];
        if (!kvq_polar_live(r))
            continue;
        kvq_polar_rebuild_row(L, codes + t * p->code_bytes, w[t] * r, &W.s, W.buf);
        for (i = 0; i < n; i++) acc[i] = acc[i] + W.buf[i];
    }
    kvq_polar_work_free(&W);
}

#if KVQ_HAVE_X86_SIMD
/* Cutting 16 codes out of at most 16 bytes: lane i takes 4 bytes from byte ctl_i and shifts right
 * by sh_i. The bits above the code are left in place: the angle tables repeat with period
 * 2^width (polar.angle_tables), and the lookups read only the low log2(entries) index bits. */
typedef struct {
    __m512i ctl, sh;
    int n_bytes;          /* bytes the 16 codes span (a masked load reads no more) */
} kvq_polar_cut;

KVQ_TARGET_AVX512 static void kvq_polar_cut_init(kvq_polar_cut* C, const int* bit_offset,
                                                 const int* width)
{
    uint8_t ctl[64];
    int32_t sh[16];
    int i, k, end = 0;
    for (i = 0; i < 16; i++) {
        const int o = bit_offset[i] >> 3;
        for (k = 0; k < 4; k++) ctl[4 * i + k] = (uint8_t)(o + k < 16 ? o + k : 0x80);
        sh[i] = bit_offset[i] & 7;
        if (width[i] && bit_offset[i] + width[i] > end) end = bit_offset[i] + width[i];
    }
    C->ctl = _mm512_loadu_si512((const void*)ctl);
    C->sh = _mm512_loadu_si512((const void*)sh);
    C->n_bytes = (end + 7) >> 3;
}

/* The 16 codes starting at g; `avail` bytes may be read from g (a masked load below 16). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512i kvq_polar_cut16(const uint8_t* g, int64_t avail,
                                                                 const kvq_polar_cut* C)
{
    const __m128i raw = avail >= 16 ? _mm_loadu_si128((const __m128i*)g)
                                    : _mm_maskz_loadu_epi8((__mmask16)((1u << C->n_bytes) - 1u), g);
    const __m512i x = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), C->ctl);
    return _mm512_srlv_epi32(x, C->sh);
}

/* A (level, width) table of up to 64 floats in registers. */
typedef struct {
    __m512 t0, t1, t2, t3;
} kvq_polar_tab;

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_polar_tab_load(kvq_polar_tab* T,
                                                                 const float* tab)
{
    T->t0 = _mm512_loadu_ps(tab);
    T->t1 = _mm512_loadu_ps(tab + 16);
    T->t2 = _mm512_loadu_ps(tab + 32);
    T->t3 = _mm512_loadu_ps(tab + 48);
}

/* `width` is a compile-time constant at every call (the drivers dispatch on the bits). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512 kvq_polar_look(__m512i x, const kvq_polar_tab* T,
                                                               const int width)
{
    if (width <= 4)
        return _mm512_permutexvar_ps(x, T->t0);
    if (width == 5)
        return _mm512_permutex2var_ps(T->t0, x, T->t1);
    return _mm512_mask_mov_ps(_mm512_permutex2var_ps(T->t0, x, T->t1),
                              _mm512_test_epi32_mask(x, _mm512_set1_epi32(32)),
                              _mm512_permutex2var_ps(T->t2, x, T->t3));
}

/* Everything of a fixed-width layout that does not change from row to row. */
typedef struct {
    int64_t n;
    int n_levels;
    int top_last;                 /* the lowest of the four top levels (the one with 8 angles) */
    int64_t top_byte;             /* first byte of the top levels' codes */
    kvq_polar_cut top_cut;        /* their 15 codes (lanes 0-7: 8 angles, 8-11: 4, 12-13: 2, 14: 1) */
    __m512i top_idx[4];           /* per top level (1, 2, 4, 8 angles): lane m -> its ancestor's lane */
    __mmask16 top_sin[4];         /* lanes that take the sine */
    __m512i top_sin16[4];         /* the same as 16 in those lanes (index bit 4: the sine half) */
    kvq_polar_tab top_cos[4], top_sin_tab[4];
    kvq_polar_cut cut[2];         /* groups of 16 codes: [0] level 1, [1] deeper levels */
    kvq_polar_tab c1, s1, c2, s2; /* levels 1 and 2 */
    __m512i ilo, ihi;             /* interleave v*cos, v*sin into element order */
    const kvq_polar_layout* L;
} kvq_polar_plan;

KVQ_TARGET_AVX512 static void kvq_polar_plan_init(kvq_polar_plan* P, const kvq_polar_layout* L)
{
    const int nl = L->n_levels;
    int off[16], wid[16], lane_base[4] = {14, 12, 8, 0}, i, k, m;
    int32_t idx[16], lo[16], hi[16];
    P->n = L->dim;
    P->n_levels = nl;
    P->L = L;
    P->top_last = nl - 3;
    P->top_byte = L->level_starts[nl - 3] >> 3;
    /* top levels k = 0..3 have 1, 2, 4, 8 angles: level nl - k */
    for (k = 0; k < 4; k++) {
        const int level = nl - k, w = L->level_bits[level], cnt = 1 << k;
        const int rel = L->level_starts[level] - L->level_starts[nl - 3];
        for (i = 0; i < cnt; i++) {
            off[lane_base[k] + i] = rel + i * w;
            wid[lane_base[k] + i] = w;
        }
        for (m = 0; m < 16; m++) idx[m] = lane_base[k] + (m >> (4 - k));
        P->top_idx[k] = _mm512_loadu_si512((const void*)idx);
        P->top_sin[k] = 0;
        for (m = 0; m < 16; m++) {
            idx[m] = ((m >> (3 - k)) & 1) << 4;
            if ((m >> (3 - k)) & 1) P->top_sin[k] |= (__mmask16)(1u << m);
        }
        P->top_sin16[k] = _mm512_loadu_si512((const void*)idx);
        kvq_polar_tab_load(&P->top_cos[k], L->cos_tab + kvq_polar_tab_index(level, w));
        kvq_polar_tab_load(&P->top_sin_tab[k], L->sin_tab + kvq_polar_tab_index(level, w));
    }
    off[15] = 0;
    wid[15] = 0;
    kvq_polar_cut_init(&P->top_cut, off, wid);
    for (k = 0; k < 2; k++) {
        const int w = L->level_bits[k == 0 ? 1 : (nl >= 2 ? 2 : 1)];
        for (i = 0; i < 16; i++) {
            off[i] = i * w;
            wid[i] = w;
        }
        kvq_polar_cut_init(&P->cut[k], off, wid);
    }
    kvq_polar_tab_load(&P->c1, L->cos_tab + kvq_polar_tab_index(1, L->level_bits[1]));
    kvq_polar_tab_load(&P->s1, L->sin_tab + kvq_polar_tab_index(1, L->level_bits[1]));
    if (nl >= 2) {
        kvq_polar_tab_load(&P->c2, L->cos_tab + kvq_polar_tab_index(2, L->level_bits[2]));
        kvq_polar_tab_load(&P->s2, L->sin_tab + kvq_polar_tab_index(2, L->level_bits[2]));
    }
    for (i = 0; i < 8; i++) {
        lo[2 * i] = i;
        lo[2 * i + 1] = 16 + i;
        hi[2 * i] = 8 + i;
        hi[2 * i + 1] = 24 + i;
    }
    P->ilo = _mm512_loadu_si512((const void*)lo);
    P->ihi = _mm512_loadu_si512((const void*)hi);
}

/* In what follows W1 (level 1) and WD (deeper levels) are compile-time constants: the drivers
 * dispatch on the bits, so lookups and code offsets are straight-line code. `avail` is how many
 * bytes may be read from the start of the row: up to the end of the codes array, so that only
 * the last rows need masked loads (bytes past a group's codes are cut away). */

/* The 16 values leaving the four top levels (buf[0..16) of the decoder after them). */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512 kvq_polar_top16(const kvq_polar_plan* P,
                                                                const uint8_t* row,
                                                                int64_t avail, float r,
                                                                const int WD)
{
    const __m512i codes = kvq_polar_cut16(row + P->top_byte, avail - P->top_byte, &P->top_cut);
    __m512 v = _mm512_set1_ps(r);
    int k;
    for (k = 0; k < 4; k++) {
        const __m512i c = _mm512_permutexvar_epi32(P->top_idx[k], codes);
        if (WD <= 4) {
            /* one lookup in 16 cosines then 16 sines: index = code | 16 * (takes the sine) */
            const __m512i ix = _mm512_or_si512(_mm512_and_si512(c, _mm512_set1_epi32(15)),
                                               P->top_sin16[k]);
            v = _mm512_mul_ps(v, _mm512_permutex2var_ps(P->top_cos[k].t0, ix, P->top_sin_tab[k].t0));
        } else {
            v = _mm512_mul_ps(v, _mm512_mask_mov_ps(kvq_polar_look(c, &P->top_cos[k], WD),
                                                    P->top_sin[k],
                                                    kvq_polar_look(c, &P->top_sin_tab[k], WD)));
        }
    }
    return v;
}

/* One level's step on 16 angles: v (their radii) and their codes give the 32 outputs, in element
 * order: lo = elements 0..15, hi = 16..31 of the block. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_polar_split(const kvq_polar_plan* P, __m512 v,
                                                              __m512i c, const kvq_polar_tab* ct,
                                                              const kvq_polar_tab* st,
                                                              const int width,
                                                              __m512* lo, __m512* hi)
{
    const __m512 pc = _mm512_mul_ps(v, kvq_polar_look(c, ct, width));
    const __m512 ps = _mm512_mul_ps(v, kvq_polar_look(c, st, width));
    *lo = _mm512_permutex2var_ps(pc, P->ilo, ps);
    *hi = _mm512_permutex2var_ps(pc, P->ihi, ps);
}

/* Levels top_last - 1 down to 3 in place in buf (each of >= 32 angles); buf[0..16) holds the
 * top levels' output. Afterwards buf[0 .. n/4) is the input of level 2. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_polar_middle(const kvq_polar_plan* P,
                                                               const uint8_t* row,
                                                               int64_t avail, float* buf,
                                                               const int WD)
{
    const kvq_polar_layout* L = P->L;
    int level;
    for (level = P->top_last - 1; level >= 3; level--) {
        const int64_t cnt = P->n >> level, start = L->level_starts[level] >> 3;
        kvq_polar_tab ct, st;
        int64_t j0;
        __m512 lo, hi;
        kvq_polar_tab_load(&ct, L->cos_tab + kvq_polar_tab_index(level, WD));
        kvq_polar_tab_load(&st, L->sin_tab + kvq_polar_tab_index(level, WD));
        /* from the top down: block j0 writes [2 j0, 2 j0 + 32), above every unread input */
        for (j0 = cnt - 16; j0 >= 0; j0 -= 16) {
            const int64_t g = start + (j0 >> 3) * WD;
            kvq_polar_split(P, _mm512_loadu_ps(buf + j0),
                            kvq_polar_cut16(row + g, avail - g, &P->cut[1]), &ct, &st, WD,
                            &lo, &hi);
            _mm512_storeu_ps(buf + 2 * j0, lo);
            _mm512_storeu_ps(buf + 2 * j0 + 16, hi);
        }
    }
}

/* Level 1 on its 16 angles j0 .. j0+15 (radii v): the 32 elements 2 j0 .. 2 j0 + 31 go
 * straight into the score lanes (DOT) or the accumulator (else). */
#define KVQ_POLAR_LEVEL1(DOT, v, j0)                                                          \
    do {                                                                                      \
        const int64_t g1_ = ((j0) >> 3) * W1;                                                 \
        __m512 lo_, hi_;                                                                      \
        kvq_polar_split(P, (v), kvq_polar_cut16(row + g1_, avail - g1_, &P->cut[0]),     \
                        &P->c1, &P->s1, W1, &lo_, &hi_);                                      \
        if (DOT) {                                                                            \
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + 2 * (j0)), lo_));      \
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + 2 * (j0) + 16), hi_)); \
        } else {                                                                              \
            _mm512_storeu_ps(out + 2 * (j0), _mm512_add_ps(_mm512_loadu_ps(out + 2 * (j0)), lo_)); \
            _mm512_storeu_ps(out + 2 * (j0) + 16,                                             \
                             _mm512_add_ps(_mm512_loadu_ps(out + 2 * (j0) + 16), hi_));       \
        }                                                                                     \
    } while (0)

/* One live row (n >= 32) rebuilt from radius r: DOT: returns the 16 score lanes against q;
 * else: adds the row to out (and returns zero). Levels 2 and 1 run fused, block by block of
 * level 2, so level 1 still visits its elements in increasing order. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512 kvq_polar_row(const kvq_polar_plan* P,
                                                              const uint8_t* row,
                                                              int64_t avail, float r,
                                                              const float* q, float* out,
                                                              float* buf, const int DOT,
                                                              const int W1, const int WD,
                                                              const int64_t NFIX)
{
    const int64_t n = NFIX ? NFIX : P->n;   /* NFIX: a width known at compile time, or 0 */
    __m512 acc = _mm512_setzero_ps();
    const __m512 top = kvq_polar_top16(P, row, avail, r, WD);
    if (n == 32) {   /* the top levels end at level 2 */
        KVQ_POLAR_LEVEL1(DOT, top, 0);
        return acc;
    }
    {
        const int64_t g2 = P->L->level_starts[2] >> 3;
        int64_t j2;
        if (n > 64) {
            _mm512_storeu_ps(buf, top);
            kvq_polar_middle(P, row, avail, buf, WD);
        }
        for (j2 = 0; j2 < n / 4; j2 += 16) {
            const int64_t g = g2 + (j2 >> 3) * WD;
            __m512 lo, hi;
            kvq_polar_split(P, n == 64 ? top : _mm512_loadu_ps(buf + j2),
                            kvq_polar_cut16(row + g, avail - g, &P->cut[1]), &P->c2, &P->s2,
                            WD, &lo, &hi);
            KVQ_POLAR_LEVEL1(DOT, lo, 2 * j2);
            KVQ_POLAR_LEVEL1(DOT, hi, 2 * j2 + 16);
        }
    }
    return acc;
}

static inline void kvq_polar_prefetch_row(const uint8_t* row, int64_t code_bytes)
{
    int64_t b;
    for (b = 0; b < code_bytes; b += 64) kvq_prefetch(row + b + KVQ_PREFETCH_BYTES);
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_polar_dot_body(const kvq_polar_plan* P,
                                                                 const kvq_params* p,
                                                                 const uint8_t* codes,
                                                                 const float* side, int64_t r0,
                                                                 int64_t r1, const float* q,
                                                                 float* out, float* buf,
                                                                 const int W1, const int WD,
                                                                 const int64_t NFIX)
{
    const int64_t cb = p->code_bytes, ns = p->n_side;
    __m512 acc[4];
    int64_t t;
    for (t = r0; t < r1; t += 4) {
        const int nr = r1 - t < 4 ? (int)(r1 - t) : 4;
        int k;
        if (NFIX && NFIX <= 64 && nr == 4) {
            /* no branch between the four rows, so that the compiler can interleave them: each
             * row is computed (an inert one from radius 0), then an inert row's lanes are
             * zeroed, giving the score +0 as below */
            for (k = 0; k < 4; k++) {
                const uint8_t* row = codes + (t + k) * cb;
                const float r = side[(t + k) * ns];
                const int live = kvq_polar_live(r);
                kvq_polar_prefetch_row(row, cb);
                acc[k] = _mm512_maskz_mov_ps((__mmask16)(live ? 0xFFFF : 0),
                                             kvq_polar_row(P, row, (p->n_rows - t - k) * cb,
                                                           live ? r : 0.0f, q, NULL, buf, 1, W1,
                                                           WD, NFIX));
            }
        } else {
            for (k = 0; k < nr; k++) {
                const uint8_t* row = codes + (t + k) * cb;
                const float r = side[(t + k) * ns];
                kvq_polar_prefetch_row(row, cb);
                /* an inert row: zero lanes, score +0 */
                acc[k] = kvq_polar_live(r) ? kvq_polar_row(P, row, (p->n_rows - t - k) * cb, r,
                                                           q, NULL, buf, 1, W1, WD, NFIX)
                                           : _mm512_setzero_ps();
            }
        }
        if (nr == 4) {
            _mm_storeu_ps(out + t, kvq_tree16x4_avx512(acc[0], acc[1], acc[2], acc[3]));
        } else {
            for (k = 0; k < nr; k++) out[t + k] = kvq_tree16_avx512(acc[k]);
        }
    }
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_polar_axpy_body(const kvq_polar_plan* P,
                                                                  const kvq_params* p,
                                                                  const uint8_t* codes,
                                                                  const float* side, int64_t r0,
                                                                  int64_t r1, const float* w,
                                                                  float* acc, float* buf,
                                                                  const int W1, const int WD,
                                                                  const int64_t NFIX)
{
    const int64_t cb = p->code_bytes, ns = p->n_side;
    int64_t t;
    for (t = r0; t < r1; t++) {
        const uint8_t* row = codes + t * cb;
        const float r = side[t * ns];
        kvq_polar_prefetch_row(row, cb);
        if (kvq_polar_live(r))
            kvq_polar_row(P, row, (p->n_rows - t) * cb, w[t] * r, NULL, acc, buf, 0, W1, WD, NFIX);
    }
}

/* The plan of a call, built once by the driver for every row kernel call (and thread) to read:
 * memory for it (kvq_polar_plan_bytes, any alignment) and its construction. Leaves L->plan NULL
 * when the layout has no vector path. */
static size_t kvq_polar_plan_bytes(void)
{
    return sizeof(kvq_polar_plan) + 64;
}

static int kvq_polar_vector_layout(const kvq_polar_layout* L);

/* The plan of a call: the one prepared with the codec's tables, or built now. */
KVQ_TARGET_AVX512 static inline void kvq_polar_plan_load(kvq_polar_plan* P,
                                                         const kvq_polar_layout* L)
{
    if (L->plan)
        memcpy(P, L->plan, sizeof(*P));
    else
        kvq_polar_plan_init(P, L);
}

KVQ_TARGET_AVX512 static void kvq_polar_plan_prepare(kvq_polar_layout* L, void* mem)
{
    kvq_polar_plan* P = (kvq_polar_plan*)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    L->plan = NULL;
    if (mem && kvq_polar_vector_layout(L)) {
        kvq_polar_plan_init(P, L);
        L->plan = P;
    }
}

/* Fixed-width modes: level 1 on b bits, deeper levels on max(b - 1, 1); width 64 (a common
 * head size, where the per-row branches weigh most) compiled apart with its width known. */
#define KVQ_POLAR_DISPATCH_N(BODY, b, NFIX, ...)              \
    switch (b) {                                              \
    case 2: BODY(__VA_ARGS__, 2, 1, NFIX); break;             \
    case 3: BODY(__VA_ARGS__, 3, 2, NFIX); break;             \
    case 4: BODY(__VA_ARGS__, 4, 3, NFIX); break;             \
    case 5: BODY(__VA_ARGS__, 5, 4, NFIX); break;             \
    default: BODY(__VA_ARGS__, 6, 5, NFIX); break;            \
    }
#define KVQ_POLAR_DISPATCH(BODY, b, ...)                      \
    do {                                                      \
        if (P.n == 64)                                        \
            KVQ_POLAR_DISPATCH_N(BODY, b, 64, __VA_ARGS__)    \
        else                                                  \
            KVQ_POLAR_DISPATCH_N(BODY, b, 0, __VA_ARGS__)     \
    } while (0)

/* The vector rebuild takes fixed widths that the dispatch knows, and at least 32 elements. */
static inline int kvq_polar_vector_layout(const kvq_polar_layout* L)
{
    const int b = L->level_bits[1];
    return L->mode != KVQ_POLAR_RADIUS && L->dim >= 32 && b >= 2 && b <= 6
           && L->level_bits[2] == (b - 1 > 1 ? b - 1 : 1);
}

/* The middle levels' buffer (the input of level 2: n/4 floats) is on the stack up to this width,
 * so that the vector path allocates nothing per call. */
#define KVQ_POLAR_STACK_DIM 8192

KVQ_TARGET_AVX512 static void kvq_polar_dot_avx512(const kvq_params* p, const uint8_t* codes,
                                                   const float* side, int64_t r0, int64_t r1,
                                                   const float* q, float* out)
{
    const kvq_polar_layout* L = (const kvq_polar_layout*)p->codec;
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side;
    kvq_polar_work W;
    int64_t t;
    if (kvq_polar_vector_layout(L) && n <= KVQ_POLAR_STACK_DIM) {
        /* a local copy: stores to the rows' floats cannot alias it, so its constants can stay
         * in registers */
        kvq_polar_plan P;
        float buf[KVQ_POLAR_STACK_DIM / 4 + 16];
        kvq_polar_plan_load(&P, L);
        KVQ_POLAR_DISPATCH(kvq_polar_dot_body, L->level_bits[1], &P, p, codes, side, r0, r1, q,
                           out, buf);
        return;
    }
    if (n % 16) {   /* widths 2, 4, 8 */
        kvq_polar_dot_portable(p, codes, side, r0, r1, q, out);
        return;
    }
    if (kvq_polar_work_alloc(&W, n)) {
        for (t = r0; t < r1; t++) out[t] = NAN;
        return;
    }
    if (kvq_polar_vector_layout(L)) {
        kvq_polar_plan P;
        kvq_polar_plan_load(&P, L);
        KVQ_POLAR_DISPATCH(kvq_polar_dot_body, L->level_bits[1], &P, p, codes, side, r0, r1, q,
                           out, W.buf);
    } else {
        /* radius mode (and n = 16): the shared rebuild, a vector dot in the same lane order */
        for (t = r0; t < r1; t++) {
            const float r = side[t * ns];
            __m512 acc = _mm512_setzero_ps();
            int64_t i;
            if (!kvq_polar_live(r)) {
                out[t] = 0.0f;
                continue;
            }
            kvq_polar_rebuild_row(L, codes + t * cb, r, &W.s, W.buf);
            for (i = 0; i < n; i += 16)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(W.buf + i)));
            out[t] = kvq_tree16_avx512(acc);
        }
    }
    kvq_polar_work_free(&W);
}

KVQ_TARGET_AVX512 static void kvq_polar_axpy_avx512(const kvq_params* p, const uint8_t* codes,
                                                    const float* side, int64_t r0, int64_t r1,
                                                    const float* w, float* acc)
{
    const kvq_polar_layout* L = (const kvq_polar_layout*)p->codec;
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side;
    kvq_polar_work W;
    int64_t t, i;
    if (kvq_polar_vector_layout(L) && n <= KVQ_POLAR_STACK_DIM) {
        kvq_polar_plan P;
        float buf[KVQ_POLAR_STACK_DIM / 4 + 16];
        kvq_polar_plan_load(&P, L);
        KVQ_POLAR_DISPATCH(kvq_polar_axpy_body, L->level_bits[1], &P, p, codes, side, r0, r1, w,
                           acc, buf);
        return;
    }
    if (n % 16) {
        kvq_polar_axpy_portable(p, codes, side, r0, r1, w, acc);
        return;
    }
    if (kvq_polar_work_alloc(&W, n)) {
        for (i = 0; i < n; i++) acc[i] = NAN;
        return;
    }
    if (kvq_polar_vector_layout(L)) {
        kvq_polar_plan P;
        kvq_polar_plan_load(&P, L);
        KVQ_POLAR_DISPATCH(kvq_polar_axpy_body, L->level_bits[1], &P, p, codes, side, r0, r1, w,
                           acc, W.buf);
    } else {
        for (t = r0; t < r1; t++) {
            const float r = side[t * ns];
            if (!kvq_polar_live(r))
                continue;
            kvq_polar_rebuild_row(L, codes + t * cb, w[t] * r, &W.s, W.buf);
            for (i = 0; i < n; i += 16)
                _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), _mm512_loadu_ps(W.buf + i)));
        }
    }
    kvq_polar_work_free(&W);
}
#else  /* no vector path in this build: the dispatcher never picks these */
static size_t kvq_polar_plan_bytes(void) { return 0; }
static void kvq_polar_plan_prepare(kvq_polar_layout* L, void* mem) { (void)mem; L->plan = NULL; }
#define kvq_polar_dot_avx512 kvq_polar_dot_portable
#define kvq_polar_axpy_avx512 kvq_polar_axpy_portable
#endif

#endif /* KVQ_CONSUMERS_POLAR_H */
