/* Row kernels of the rotated Lloyd codecs (tq<b>, b = 1..8): codes packed LSB first (element i at
 * bits [i*b, (i+1)*b)), one side value r per row, x^ = unrotate(levels[c] * step) with
 * step = r / sqrtf(n) (0 for an inert row: r not in (0, 3.4e38f], the engine's inert threshold), as
 * the decoder computes it.
 *
 * The query arrives rotated (q~ = rotate(q)), so nothing here touches the rotation:
 *   score_t = tree16(lanes of q~_i * levels[c_ti]) * step_t      (simd.h order)
 *   acc~_i  = acc~_i + (w_t * step_t) * levels[c_ti], rows in order (unrotated once by the driver)
 * The AVX-512 path keeps up to 64 levels in registers and picks them with permutes; 7 and 8 bits
 * gather from a table in L1. With VBMI, 6 to 8 bits look levels up byte plane by byte plane
 * (below). A group of 16 codes is exactly 2b bytes, so every group starts on a byte boundary.
 */
#ifndef KVQ_CONSUMERS_TQ_H
#define KVQ_CONSUMERS_TQ_H

#include "simd.h"

static inline float kvq_tq_step(float r, float sqrtf_n)
{
    return (r > 0.0f && r <= 3.4e38f) ? r / sqrtf_n : 0.0f;
}

/* Codes of one row, LSB first, into c[0..n). */
static inline void kvq_tq_unpack(const uint8_t* src, int64_t n, int bits, uint8_t* c)
{
    uint64_t acc = 0;
    int filled = 0;
    const uint32_t mask = (1u << bits) - 1u;
    int64_t i;
    for (i = 0; i < n; i++) {
        while (filled < bits) {
            acc |= (uint64_t)(*src++) << filled;
            filled += 8;
        }
        c[i] = (uint8_t)(acc & mask);
        acc >>= bits;
        filled -= bits;
    }
}

#define KVQ_TQ_BLOCK 256   /* codes unpacked at a time by the portable path's narrow rows */

/* Lookup tables of a codebook, built once per consumer call: table[e] = levels[e mod 2**bits]
 * (so any byte whose low bits are the code indexes it), its four byte planes, and for 1, 2 and 4
 * bits the 8/b levels of the codes held by byte e (byte_levels[(8/b) e + k], code k of the byte). */
static void kvq_tq_prepare(const float* levels, int bits, float* table, uint8_t* planes,
                           float* byte_levels)
{
    const int per_byte = 8 / bits, mask = (1 << bits) - 1;
    int e, k;
    for (e = 0; e < 256; e++) {
        uint32_t u;
        table[e] = levels[e & mask];
        memcpy(&u, &table[e], 4);
        for (k = 0; k < 4; k++) planes[256 * k + e] = (uint8_t)(u >> (8 * k));
        if (bits == 1 || bits == 2 || bits == 4)
            for (k = 0; k < per_byte; k++)
                byte_levels[per_byte * e + k] = levels[(e >> (bits * k)) & mask];
    }
}

/* The levels of the 16 codes of one group (2b bytes at g) into v[16], in element order. Written
 * as fixed-size loops (b is a constant at every call) that compilers vectorize on any ISA. */
KVQ_INLINE void kvq_tq_values16(const kvq_params* p, const uint8_t* g, float* v, const int b)
{
    int j;
    if (b == 1 || b == 2 || b == 4) {   /* one table row per byte: 8/b levels */
        const int per = 8 / b;
        for (j = 0; j < 2 * b; j++) memcpy(v + per * j, p->byte_levels + per * g[j], 4 * per);
    } else if (b == 8) {
        for (j = 0; j < 16; j++) v[j] = p->levels[g[j]];
    } else {
        for (j = 0; j < 16; j++) {
            const int bit = b * j, o = bit >> 3;
            /* the code's bits lie in bytes o and o + 1 of the group (never past it) */
            const uint32_t w = (uint32_t)g[o] | (o + 1 < 2 * b ? (uint32_t)g[o + 1] << 8 : 0u);
            v[j] = p->levels[(w >> (bit & 7)) & ((1u << b) - 1u)];
        }
    }
}

KVQ_INLINE void kvq_tq_dot_portable_b(const kvq_params* p, const uint8_t* codes, const float* side,
                                      int64_t r0, int64_t r1, const float* q, float* out,
                                      const int b)
{
    const int64_t n = p->dim;
    float acc[16], v[16];
    int64_t t, i;
    int j;
    for (t = r0; t < r1; t++) {
        const uint8_t* g = codes + t * p->code_bytes;
        kvq_zero16(acc);
        for (i = 0; i < n; i += 16, g += 2 * b) {
            kvq_tq_values16(p, g, v, b);
            for (j = 0; j < 16; j++) acc[j] = acc[j] + q[i + j] * v[j];
        }
        out[t] = kvq_tree16(acc) * kvq_tq_step(side[t * p->n_side], p->sqrtf_n);
    }
}

KVQ_INLINE void kvq_tq_axpy_portable_b(const kvq_params* p, const uint8_t* codes,
                                       const float* side, int64_t r0, int64_t r1, const float* w,
                                       float* acc, const int b)
{
    const int64_t n = p->dim;
    float v[16];
    int64_t t, i;
    int j;
    for (t = r0; t < r1; t++) {
        const uint8_t* g = codes + t * p->code_bytes;
        const float ct = w[t] * kvq_tq_step(side[t * p->n_side], p->sqrtf_n);
        for (i = 0; i < n; i += 16, g += 2 * b) {
            kvq_tq_values16(p, g, v, b);
            for (j = 0; j < 16; j++) acc[i + j] = acc[i + j] + ct * v[j];
        }
    }
}

/* BODY(..., b) with b the constant bit width */
#define KVQ_TQ_PORTABLE_DISPATCH(BODY, ...)                  \
    switch (p->bits) {                                       \
    case 1: BODY(__VA_ARGS__, 1); break;                     \
    case 2: BODY(__VA_ARGS__, 2); break;                     \
    case 3: BODY(__VA_ARGS__, 3); break;                     \
    case 4: BODY(__VA_ARGS__, 4); break;                     \
    case 5: BODY(__VA_ARGS__, 5); break;                     \
    case 6: BODY(__VA_ARGS__, 6); break;                     \
    case 7: BODY(__VA_ARGS__, 7); break;                     \
    default: BODY(__VA_ARGS__, 8); break;                    \
    }

/* the same for the vector paths */
#define KVQ_TQ_DISPATCH KVQ_TQ_PORTABLE_DISPATCH

static void kvq_tq_dot_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                int64_t r0, int64_t r1, const float* q, float* out)
{
    const int64_t n = p->dim;
    const float* lev = p->levels;
    const int b = p->bits;
    uint8_t c[KVQ_TQ_BLOCK];
    float acc[16];
    int64_t t, i0, i, m;
    int j;
    if (n % 16 == 0) {
        KVQ_TQ_PORTABLE_DISPATCH(kvq_tq_dot_portable_b, p, codes, side, r0, r1, q, out)
        return;
    }
    for (t = r0; t < r1; t++) {   /* widths 2, 4, 8 */
        const uint8_t* row = codes + t * p->code_bytes;
        kvq_zero16(acc);
        for (i0 = 0; i0 < n; i0 += KVQ_TQ_BLOCK) {   /* KVQ_TQ_BLOCK * b bits: whole bytes */
            m = n - i0 < KVQ_TQ_BLOCK ? n - i0 : KVQ_TQ_BLOCK;
            kvq_tq_unpack(row + i0 * b / 8, m, b, c);
            for (i = 0; i + 16 <= m; i += 16)
                for (j = 0; j < 16; j++) acc[j] = acc[j] + q[i0 + i + j] * lev[c[i + j]];
            for (j = 0; i + j < m; j++) acc[j] = acc[j] + q[i0 + i + j] * lev[c[i + j]];
        }
        out[t] = kvq_tree16(acc) * kvq_tq_step(side[t * p->n_side], p->sqrtf_n);
    }
}

static void kvq_tq_axpy_portable(const kvq_params* p, const uint8_t* codes, const float* side,
                                 int64_t r0, int64_t r1, const float* w, float* acc)
{
    const int64_t n = p->dim;
    const float* lev = p->levels;
    const int b = p->bits;
    uint8_t c[KVQ_TQ_BLOCK];
    int64_t t, i0, i, m;
    if (n % 16 == 0) {
        KVQ_TQ_PORTABLE_DISPATCH(kvq_tq_axpy_portable_b, p, codes, side, r0, r1, w, acc)
        return;
    }
    for (t = r0; t < r1; t++) {
        const uint8_t* row = codes + t * p->code_bytes;
        const float ct = w[t] * kvq_tq_step(side[t * p->n_side], p->sqrtf_n);
        for (i0 = 0; i0 < n; i0 += KVQ_TQ_BLOCK) {
            m = n - i0 < KVQ_TQ_BLOCK ? n - i0 : KVQ_TQ_BLOCK;
            kvq_tq_unpack(row + i0 * b / 8, m, b, c);
            for (i = 0; i < m; i++) acc[i0 + i] = acc[i0 + i] + ct * lev[c[i]];
        }
    }
}

#if KVQ_PORTABLE_VECTORS
/* ---- the portable path's vector decoders (simd.h's vector extensions, any ISA) ----
 * 1, 2 and 4 bits: the 8/b levels of a code byte are one row of byte_levels (kvq_tq_prepare), so
 * a group is four 4-lane loads (1 and 2 bits) or eight 2-lane ones (4 bits on x86: measured
 * faster there than byte-plane lookups, which queue on the cores' one shuffle port). 3 bits, and
 * 4 bits elsewhere (ARM has tbl and shuffles to spare: fewer instructions): the 16 (periodic)
 * levels are split into four byte planes, each looked up for the 16 codes at once by simd.h's
 * kvq_pvb_lookup16, and the four bytes of each lane are interleaved back into floats (this
 * assumes little-endian). 5 to 7 bits: the codes are cut into bytes by vector shuffles and
 * multiplies, then a table load per code; 8 bits (and 3 to 7 on big-endian CPUs): a table load
 * per code. Only integer moves pick the levels, so every way gives the table's floats, and the
 * products and sums that follow are the scalar kernels'. Each way is written so that GCC and
 * Clang both keep it in vector registers (Clang 14 kept the former per-code loop a loop through a
 * stack array: 4-5x slower than GCC's build). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define KVQ_TQ_BYTE_PLANES 1
#else
#define KVQ_TQ_BYTE_PLANES 0
#endif

typedef struct {
    kvq_pvb plane[4];         /* byte k of levels 0 .. 15 (periodic below 16 levels) */
    const float* table;       /* 256 levels indexed by any byte whose low bits are the code */
    const float* byte_levels; /* 1, 2 and 4 bits: the 8/b levels of byte e at (8/b) e */
} kvq_tq_consts_portable;

KVQ_INLINE void kvq_tq_consts_init_portable(kvq_tq_consts_portable* K, const float* table256,
                                            const float* byte_levels, int b)
{
    uint8_t bytes[4][16];
    uint32_t u;
    int e, k;
    K->table = table256;
    K->byte_levels = byte_levels;
    if (b != 3 && b != 4) return;
    for (e = 0; e < 16; e++) {
        memcpy(&u, &table256[e], 4);
        for (k = 0; k < 4; k++) bytes[k][e] = (uint8_t)(u >> (8 * k));
    }
    for (k = 0; k < 4; k++) memcpy(&K->plane[k], bytes[k], 16);
}

/* dst[k] = kvq_tq_step(side[k ns], sqrtf_n) for k = 0..15 (the same compares and correctly
 * rounded division, lane-wise). */
KVQ_INLINE void kvq_tq_steps16_portable(const float* side, int64_t ns, float sqrtf_n, float* dst)
{
    const kvq_pv4 s = {sqrtf_n, sqrtf_n, sqrtf_n, sqrtf_n};
    kvq_pv4 r;
    int k;
    if (ns != 1) {
        for (k = 0; k < 16; k++) dst[k] = kvq_tq_step(side[k * ns], sqrtf_n);
        return;
    }
    for (k = 0; k < 16; k += 4) {
        memcpy(&r, side + k, 16);
        r = (kvq_pv4)((kvq_pv4i)(r / s) & ((r > 0.0f) & (r <= 3.4e38f)));
        memcpy(dst + k, &r, 16);
    }
}

/* Byte j = code j of the group's 2b bytes at g in its low b bits (the bits above it are the next
 * code's: the lookups ignore them), for b = 3 .. 7. Each 16-bit lane takes the two bytes holding
 * its code (a constant byte shuffle) and a multiply by 2^(8 - shift) moves the code to the lane's
 * high byte (a per-lane shift that every ISA has). `wide`: 16 bytes may be read at g. */
#define KVQ_TQ_O(B, j) ((B * (j)) >> 3)   /* the code's first byte */
#define KVQ_TQ_PICK2(B, j) KVQ_TQ_O(B, j), KVQ_TQ_O(B, j) + 1
/* bytes o, o + 1 of codes 8h .. 8h + 7 for the literal width B */
#define KVQ_TQ_PICK(x, B, h)                                                                     \
    KVQ_SHUFFLE(kvq_pvb, x, x, KVQ_TQ_PICK2(B, 8 * (h)), KVQ_TQ_PICK2(B, 8 * (h) + 1),             \
                KVQ_TQ_PICK2(B, 8 * (h) + 2), KVQ_TQ_PICK2(B, 8 * (h) + 3),                        \
                KVQ_TQ_PICK2(B, 8 * (h) + 4), KVQ_TQ_PICK2(B, 8 * (h) + 5),                        \
                KVQ_TQ_PICK2(B, 8 * (h) + 6), KVQ_TQ_PICK2(B, 8 * (h) + 7))
#define KVQ_TQ_PICKB(x, b, h)                                                                    \
    (b == 3 ? KVQ_TQ_PICK(x, 3, h) : b == 5 ? KVQ_TQ_PICK(x, 5, h)                                \
     : b == 6 ? KVQ_TQ_PICK(x, 6, h) : KVQ_TQ_PICK(x, 7, h))
#define KVQ_TQ_M(j) ((uint16_t)(256u >> ((b * (j)) & 7)))   /* 2^(8 - its bit offset) */
KVQ_INLINE kvq_pvb kvq_tq_codes16_portable(const uint8_t* g, const int b, const int wide)
{
    /* codes 8 .. 15 start 8b bits later: the same bit offsets */
    const kvq_pvh mul = {KVQ_TQ_M(0), KVQ_TQ_M(1), KVQ_TQ_M(2), KVQ_TQ_M(3),
                         KVQ_TQ_M(4), KVQ_TQ_M(5), KVQ_TQ_M(6), KVQ_TQ_M(7)};
    uint8_t buf[16];
    kvq_pvb x;
    kvq_pvh lo, hi;
    if (wide) {
        memcpy(&x, g, 16);
    } else {   /* the group only (a code's second byte may lie past it: zero) */
        memset(buf, 0, 16);
        memcpy(buf, g, 2 * b);
        memcpy(&x, buf, 16);
    }
    lo = (kvq_pvh)KVQ_TQ_PICKB(x, b, 0) * mul;
    hi = (kvq_pvh)KVQ_TQ_PICKB(x, b, 1) * mul;
    return KVQ_SHUFFLE(kvq_pvb, (kvq_pvb)lo, (kvq_pvb)hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21,
                       23, 25, 27, 29, 31);
}
#undef KVQ_TQ_M
#undef KVQ_TQ_PICKB
#undef KVQ_TQ_PICK
#undef KVQ_TQ_PICK2
#undef KVQ_TQ_O

/* The levels of the codes in the low 4 bits of idx (the bits above are ignored) from the byte
 * planes, as floats in element order. */
KVQ_INLINE kvq_pv kvq_tq_planes16_portable(kvq_pvb idx, const kvq_tq_consts_portable* K)
{
    const kvq_pvb p0 = kvq_pvb_lookup16(K->plane[0], idx), p1 = kvq_pvb_lookup16(K->plane[1], idx);
    const kvq_pvb p2 = kvq_pvb_lookup16(K->plane[2], idx), p3 = kvq_pvb_lookup16(K->plane[3], idx);
    kvq_pvh a0, a1, b0, b1;
    kvq_pv r;
    /* bytes 0,1 and 2,3 of lanes 0-7 (a0, b0) and 8-15 (a1, b1) as 16-bit pairs */
    a0 = (kvq_pvh)KVQ_SHUFFLE(kvq_pvb, p0, p1, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                              22, 7, 23);
    a1 = (kvq_pvh)KVQ_SHUFFLE(kvq_pvb, p0, p1, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
                              14, 30, 15, 31);
    b0 = (kvq_pvh)KVQ_SHUFFLE(kvq_pvb, p2, p3, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6,
                              22, 7, 23);
    b1 = (kvq_pvh)KVQ_SHUFFLE(kvq_pvb, p2, p3, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29,
                              14, 30, 15, 31);
    /* the two pairs of each lane side by side: lanes 0-3, 4-7, 8-11, 12-15 */
    r.q[0] = (kvq_pv4)KVQ_SHUFFLE(kvq_pvh, a0, b0, 0, 8, 1, 9, 2, 10, 3, 11);
    r.q[1] = (kvq_pv4)KVQ_SHUFFLE(kvq_pvh, a0, b0, 4, 12, 5, 13, 6, 14, 7, 15);
    r.q[2] = (kvq_pv4)KVQ_SHUFFLE(kvq_pvh, a1, b1, 0, 8, 1, 9, 2, 10, 3, 11);
    r.q[3] = (kvq_pv4)KVQ_SHUFFLE(kvq_pvh, a1, b1, 4, 12, 5, 13, 6, 14, 7, 15);
    return r;
}

/* Levels of the 16 codes of one group (2b bytes at g; `wide`: 16 bytes may be read at g). */
KVQ_INLINE kvq_pv kvq_tq_lev16_portable(const uint8_t* g, const kvq_tq_consts_portable* K,
                                        const int b, const int wide)
{
    float v[16];
    int j;
    if (b == 1 || b == 2) {   /* lanes 4j .. 4j + 3 from the row of byte jb / 2 */
        const int per = 8 / b;
        kvq_pv r;
        for (j = 0; j < 4; j++)
            memcpy(&r.q[j], K->byte_levels + per * g[j * b / 2] + 4 * (j % (per / 4)), 16);
        return r;
    }
#if KVQ_TQ_BYTE_PLANES && !(defined(__x86_64__) || defined(__i386__))
    if (b == 4) {   /* code 2k is the low nibble of byte k, code 2k + 1 its high nibble */
        kvq_pvb x;
        uint64_t g8;
        memcpy(&g8, g, 8);
        x = (kvq_pvb)(kvq_pvq){g8, 0};
        return kvq_tq_planes16_portable(KVQ_SHUFFLE(kvq_pvb, x & 15, x >> 4, 0, 16, 1, 17, 2, 18,
                                                    3, 19, 4, 20, 5, 21, 6, 22, 7, 23), K);
    }
#endif
    if (b == 4) {   /* lanes 4j .. 4j + 3 from the rows (two levels) of bytes 2j and 2j + 1 */
        kvq_pv r;
        for (j = 0; j < 4; j++) {   /* two 8-byte loads into one vector (movq + movhps, ld1) */
            memcpy(&r.q[j], K->byte_levels + 2 * g[2 * j], 8);
            memcpy((char*)&r.q[j] + 8, K->byte_levels + 2 * g[2 * j + 1], 8);
        }
        return r;
    }
#if KVQ_TQ_BYTE_PLANES
    if (b == 3) return kvq_tq_planes16_portable(kvq_tq_codes16_portable(g, 3, wide), K);
    if (b != 8) {   /* 5 to 7 bits: the table takes any byte whose low bits are the code */
        const kvq_pvb c = kvq_tq_codes16_portable(g, b, wide);
        for (j = 0; j < 16; j++) v[j] = K->table[c[j]];
        return kvq_pv_load(v);
    }
#endif
    if (b == 8) {
        for (j = 0; j < 16; j++) v[j] = K->table[g[j]];
    } else {
        for (j = 0; j < 16; j++) {
            const int bit = b * j, o = bit >> 3;
            /* the code's bits lie in bytes o and o + 1 of the group (never past it); the table
             * takes any byte whose low bits are the code */
            const uint32_t u = (uint32_t)g[o] | (o + 1 < 2 * b ? (uint32_t)g[o + 1] << 8 : 0u);
            v[j] = K->table[(u >> (bit & 7)) & 0xFFu];
        }
    }
    return kvq_pv_load(v);
}
#endif

#if KVQ_HAVE_X86_SIMD
typedef struct {
    __m512 t0, t1, t2, t3;   /* levels, 16 per register (periodic padding below 16 levels) */
    __m512i ctl, sh;         /* unpacking: byte shuffle and per-lane shift */
    const float* table;      /* 7 and 8 bits: the gather table (256 entries) */
} kvq_tq_consts;

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_tq_consts_init(kvq_tq_consts* K,
                                                                 const float* table256, int b)
{
    uint8_t ctl[64];
    int32_t sh[16];
    int i, k;
    K->t0 = _mm512_loadu_ps(table256);
    K->t1 = _mm512_loadu_ps(table256 + 16);
    K->t2 = _mm512_loadu_ps(table256 + 32);
    K->t3 = _mm512_loadu_ps(table256 + 48);
    K->table = table256;
    /* lane i takes the 4 bytes from byte (b*i)/8 of the group and shifts by (b*i)%8; 2 and 4
     * bits: lane i holds a dword of the group and shifts by (b*i)%32 (kvq_tq_lev16) */
    for (i = 0; i < 16; i++) {
        const int o = (b * i) >> 3;
        for (k = 0; k < 4; k++) ctl[4 * i + k] = (uint8_t)(o + k < 16 ? o + k : 0x80);
        sh[i] = b == 2 || b == 4 ? (b * i) & 31 : (b * i) & 7;
    }
    K->ctl = _mm512_loadu_si512((const void*)ctl);
    K->sh = _mm512_loadu_si512((const void*)sh);
}

/* dst[k] = kvq_tq_step(side[k ns], sqrtf_n) for k = 0..15: the same compares and (correctly
 * rounded) division, sixteen at a time. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_tq_steps16_avx512(const float* side, int64_t ns,
                                                                    float sqrtf_n, float* dst)
{
    __m512 r;
    __mmask16 ok;
    int k;
    if (ns != 1) {
        for (k = 0; k < 16; k++) dst[k] = kvq_tq_step(side[k * ns], sqrtf_n);
        return;
    }
    r = _mm512_loadu_ps(side);
    ok = _mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_GT_OQ)
         & _mm512_cmp_ps_mask(r, _mm512_set1_ps(3.4e38f), _CMP_LE_OQ);
    _mm512_storeu_ps(dst, _mm512_maskz_div_ps(ok, r, _mm512_set1_ps(sqrtf_n)));
}

/* The codes of one group (2b bytes at g, b = 2..7) in the low bits of their lanes, the higher
 * bits holding later codes (hence the levels' periodic padding): what kvq_tq_lev16 looks up.
 * `wide` says that 16 bytes may be read at g. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512i kvq_tq_codes16(const uint8_t* g,
                                                                const kvq_tq_consts* K,
                                                                const int b, const int wide)
{
    __m512i x;
    if (b == 2 || b == 4) {
        /* the codes of lanes 0-7 and 8-15 lie in dwords 0 and 1 (b = 4) or all in dword 0: a
         * broadcast and a shift per lane, no byte shuffle (nor a read past the group) */
        uint32_t w;
        memcpy(&w, g, 4);
        x = _mm512_set1_epi32((int)w);
        if (b == 4) {
            memcpy(&w, g + 4, 4);
            x = _mm512_mask_set1_epi32(x, (__mmask16)0xFF00, (int)w);
        }
        return _mm512_srlv_epi32(x, K->sh);
    }
    if (wide)
        x = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)g));
    else
        x = _mm512_broadcast_i32x4(_mm_maskz_loadu_epi8((__mmask16)((1u << (2 * b)) - 1u), g));
    return _mm512_srlv_epi32(_mm512_shuffle_epi8(x, K->ctl), K->sh);
}

/* Levels of the 16 codes of one group (2b bytes at g). `wide` says that 16 bytes may be read. */
KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE __m512 kvq_tq_lev16(const uint8_t* g,
                                                             const kvq_tq_consts* K,
                                                             const int b, const int wide)
{
    __m512i x;
    if (b == 1) {
        uint16_t m;
        memcpy(&m, g, 2);
        return _mm512_mask_blend_ps((__mmask16)m, _mm512_set1_ps(K->table[0]),
                                    _mm512_set1_ps(K->table[1]));
    }
    if (b == 8)
        return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)g)),
                                   K->table, 4);
    x = kvq_tq_codes16(g, K, b, wide);
    if (b <= 4)
        return _mm512_permutexvar_ps(x, K->t0);
    if (b == 5)
        return _mm512_permutex2var_ps(K->t0, x, K->t1);
    if (b == 6)
        return _mm512_mask_mov_ps(_mm512_permutex2var_ps(K->t0, x, K->t1),
                                  _mm512_test_epi32_mask(x, _mm512_set1_epi32(32)),
                                  _mm512_permutex2var_ps(K->t2, x, K->t3));
    return _mm512_i32gather_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xFF)), K->table, 4);
}

/* With VBMI, 2 to 4 bits: the group (2b <= 8 bytes) fits in one qword, so it is broadcast and a
 * single multishift moves code i to the low bits of lane i (the permute reads bits 0-3 only; the
 * levels table is periodic below 16 levels). One shuffle fewer per 16 codes than kvq_tq_lev16. */
typedef struct {
    kvq_tq_consts base;
    __m512i msh;          /* multishift control: lane i's low byte takes bits b*i.. of the qword */
} kvq_tq_consts_vbmi;

KVQ_TARGET_AVX512VBMI static KVQ_ALWAYS_INLINE void kvq_tq_consts_init_vbmi(kvq_tq_consts_vbmi* K,
                                                                          const float* table256,
                                                                          int b)
{
    uint8_t msh[64];
    int i, k;
    kvq_tq_consts_init(&K->base, table256, b);
    for (i = 0; i < 16; i++)
        for (k = 0; k < 4; k++) msh[4 * i + k] = (uint8_t)((b * i + 8 * k) & 63);
    K->msh = _mm512_loadu_si512((const void*)msh);
}

/* kvq_tq_codes16 for b = 2..4 by one multishift. */
KVQ_TARGET_AVX512VBMI static KVQ_ALWAYS_INLINE __m512i kvq_tq_codes16_vbmi(const uint8_t* g,
                                                                         const kvq_tq_consts_vbmi* K,
                                                                         const int b,
                                                                         const int wide)
{
    __m512i x;
    if (wide) {
        uint64_t u;
        memcpy(&u, g, 8);
        x = _mm512_set1_epi64((long long)u);
    } else {
        x = _mm512_broadcastq_epi64(_mm_maskz_loadu_epi8((__mmask16)((1u << (2 * b)) - 1u), g));
    }
    return _mm512_multishift_epi64_epi8(K->msh, x);
}

KVQ_TARGET_AVX512VBMI static KVQ_ALWAYS_INLINE __m512 kvq_tq_lev16_vbmi(const uint8_t* g,
                                                                      const kvq_tq_consts_vbmi* K,
                                                                      const int b, const int wide)
{
    if (b == 1 || b > 4)
        return kvq_tq_lev16(g, &K->base, b, wide);
    return _mm512_permutexvar_ps(kvq_tq_codes16_vbmi(g, K, b, wide), K->base.t0);
}

/* ---- AVX2: 16 levels as two 8-lane registers ---- */
typedef struct {
    __m256 t0, t1;                 /* levels 0-7 and 8-15 */
    __m256i ctl_lo, ctl_hi;        /* unpacking of lanes 0-7 and 8-15 (as kvq_tq_consts) */
    __m256i sh_lo, sh_hi;          /* 2 and 4 bits: shifts inside a broadcast dword instead */
    const float* table;            /* 5 to 8 bits: the gather table */
} kvq_tq_consts_avx2;

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE void kvq_tq_consts_init_avx2(kvq_tq_consts_avx2* K,
                                                                     const float* table256, int b)
{
    uint8_t ctl[64];
    int32_t sh[16];
    int i, k;
    K->t0 = _mm256_loadu_ps(table256);
    K->t1 = _mm256_loadu_ps(table256 + 8);
    K->table = table256;
    /* both 128-bit halves hold the group's 16 bytes: a byte index 0..15 reaches any of them */
    for (i = 0; i < 16; i++) {
        const int o = (b * i) >> 3;
        for (k = 0; k < 4; k++) ctl[4 * i + k] = (uint8_t)(o + k < 16 ? o + k : 0x80);
        sh[i] = (b * i) & 7;
    }
    K->ctl_lo = _mm256_loadu_si256((const __m256i*)ctl);
    K->ctl_hi = _mm256_loadu_si256((const __m256i*)(ctl + 32));
    if (b == 2 || b == 4)   /* code i of lanes 0-7 (8-15) at bit b*i of one dword of the group */
        for (i = 0; i < 16; i++) sh[i] = b == 4 ? 4 * (i & 7) : 2 * i;
    K->sh_lo = _mm256_loadu_si256((const __m256i*)sh);
    K->sh_hi = _mm256_loadu_si256((const __m256i*)(sh + 8));
}

KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE __m256 kvq_tq_lev8_avx2(__m256i x, const kvq_tq_consts_avx2* K,
                                                                const int b)
{
    if (b <= 3)   /* the low 3 bits pick one of 8 (periodic) levels */
        return _mm256_permutevar8x32_ps(K->t0, x);
    if (b == 4)   /* bit 3 (moved to the sign) chooses between the two halves */
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(K->t0, x), _mm256_permutevar8x32_ps(K->t1, x),
                                _mm256_castsi256_ps(_mm256_slli_epi32(x, 28)));
    return _mm256_i32gather_ps(K->table, _mm256_and_si256(x, _mm256_set1_epi32(0xFF)), 4);
}

/* kvq_tq_steps16_avx512 on AVX2. */
KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE void kvq_tq_steps16_avx2(const float* side, int64_t ns,
                                                                float sqrtf_n, float* dst)
{
    int k;
    if (ns != 1) {
        for (k = 0; k < 16; k++) dst[k] = kvq_tq_step(side[k * ns], sqrtf_n);
        return;
    }
    for (k = 0; k < 16; k += 8) {
        const __m256 r = _mm256_loadu_ps(side + k);
        const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(r, _mm256_setzero_ps(), _CMP_GT_OQ),
                                        _mm256_cmp_ps(r, _mm256_set1_ps(3.4e38f), _CMP_LE_OQ));
        _mm256_storeu_ps(dst + k, _mm256_and_ps(ok, _mm256_div_ps(r, _mm256_set1_ps(sqrtf_n))));
    }
}

/* Levels of the 16 codes of one group (2b bytes at g); `wide`: 16 bytes may be read. */
KVQ_TARGET_AVX2 static KVQ_ALWAYS_INLINE kvq_v16x2 kvq_tq_lev16_avx2(const uint8_t* g,
                                                                   const kvq_tq_consts_avx2* K,
                                                                   const int b, const int wide)
{
    kvq_v16x2 r;
    __m128i x128;
    __m256i x;
    if (b == 8) {
        r.lo = _mm256_i32gather_ps(K->table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)g)), 4);
        r.hi = _mm256_i32gather_ps(K->table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(g + 8))), 4);
        return r;
    }
    if (b == 2 || b == 4) {
        /* the 8 codes of a register lie in one dword (b = 4: dwords 0 and 1; b = 2: dword 0):
         * broadcast it and shift each lane's code down, no byte shuffle (nor a read past the
         * group) */
        const __m256i x0 = _mm256_broadcastd_epi32(_mm_loadu_si32(g));
        const __m256i x1 = b == 4 ? _mm256_broadcastd_epi32(_mm_loadu_si32(g + 4)) : x0;
        r.lo = kvq_tq_lev8_avx2(_mm256_srlv_epi32(x0, K->sh_lo), K, b);
        r.hi = kvq_tq_lev8_avx2(_mm256_srlv_epi32(x1, K->sh_hi), K, b);
        return r;
    }
    if (wide) {
        x128 = _mm_loadu_si128((const __m128i*)g);
    } else {
        uint8_t buf[16] = {0};
        memcpy(buf, g, (size_t)(2 * b));
        x128 = _mm_loadu_si128((const __m128i*)buf);
    }
    x = _mm256_broadcastsi128_si256(x128);
    r.lo = kvq_tq_lev8_avx2(_mm256_srlv_epi32(_mm256_shuffle_epi8(x, K->ctl_lo), K->sh_lo), K, b);
    r.hi = kvq_tq_lev8_avx2(_mm256_srlv_epi32(_mm256_shuffle_epi8(x, K->ctl_hi), K->sh_hi), K, b);
    return r;
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_tq_dot_body(const kvq_params* p,
                                                              const uint8_t* codes,
                                                              const float* side, int64_t r0,
                                                              int64_t r1, const float* q,
                                                              float* out, const int b)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, gb = 2 * b;
    /* rows before this one may read 16 bytes from any of their groups */
    const int64_t wide_end = p->n_rows - (16 + cb - 1) / cb;
    kvq_tq_consts K;
    int64_t t = r0, i;
    kvq_tq_consts_init(&K, p->table, b);
    for (; t + 4 <= r1; t += 4) {
        const uint8_t *c0 = codes + t * cb, *c1 = c0 + cb, *c2 = c1 + cb, *c3 = c2 + cb;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, qv;
        if (t + 4 <= wide_end) {
            const uint8_t* pf = c0 + KVQ_PREFETCH_BYTES;
            for (i = 0; i < n; i += 16, c0 += gb, c1 += gb, c2 += gb, c3 += gb, pf += 4 * gb) {
                kvq_prefetch(pf);
                qv = _mm512_loadu_ps(q + i);
                a0 = _mm512_add_ps(a0, _mm512_mul_ps(qv, kvq_tq_lev16(c0, &K, b, 1)));
                a1 = _mm512_add_ps(a1, _mm512_mul_ps(qv, kvq_tq_lev16(c1, &K, b, 1)));
                a2 = _mm512_add_ps(a2, _mm512_mul_ps(qv, kvq_tq_lev16(c2, &K, b, 1)));
                a3 = _mm512_add_ps(a3, _mm512_mul_ps(qv, kvq_tq_lev16(c3, &K, b, 1)));
            }
        } else {
            for (i = 0; i < n; i += 16, c0 += gb, c1 += gb, c2 += gb, c3 += gb) {
                qv = _mm512_loadu_ps(q + i);
                a0 = _mm512_add_ps(a0, _mm512_mul_ps(qv, kvq_tq_lev16(c0, &K, b, 0)));
                a1 = _mm512_add_ps(a1, _mm512_mul_ps(qv, kvq_tq_lev16(c1, &K, b, 0)));
                a2 = _mm512_add_ps(a2, _mm512_mul_ps(qv, kvq_tq_lev16(c2, &K, b, 0)));
                a3 = _mm512_add_ps(a3, _mm512_mul_ps(qv, kvq_tq_lev16(c3, &K, b, 0)));
            }
        }
        _mm_storeu_ps(out + t, _mm_mul_ps(kvq_tree16x4_avx512(a0, a1, a2, a3), _mm_setr_ps(
            kvq_tq_step(side[t * ns], p->sqrtf_n), kvq_tq_step(side[(t + 1) * ns], p->sqrtf_n),
            kvq_tq_step(side[(t + 2) * ns], p->sqrtf_n), kvq_tq_step(side[(t + 3) * ns], p->sqrtf_n))));
    }
    for (; t < r1; t++) {
        const uint8_t* c0 = codes + t * cb;
        __m512 a0 = _mm512_setzero_ps();
        for (i = 0; i < n; i += 16, c0 += gb)
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(_mm512_loadu_ps(q + i),
                                                 kvq_tq_lev16(c0, &K, b, 0)));
        out[t] = kvq_tree16_avx512(a0) * kvq_tq_step(side[t * ns], p->sqrtf_n);
    }
}

KVQ_TARGET_AVX512 static KVQ_ALWAYS_INLINE void kvq_tq_axpy_body(const kvq_params* p,
                                                               const uint8_t* codes,
                                                               const float* side, int64_t r0,
                                                               int64_t r1, const float* w,
                                                               float* acc, const int b)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, gb = 2 * b;
    const int64_t wide_end = p->n_rows - (16 + cb - 1) / cb;
    kvq_tq_consts K;
    int64_t t = r0, i;
    kvq_tq_consts_init(&K, p->table, b);
    /* four rows per load of the accumulator; each element still adds the rows in order */
    for (; t + 4 <= r1; t += 4) {
        const uint8_t *c0 = codes + t * cb, *c1 = c0 + cb, *c2 = c1 + cb, *c3 = c2 + cb;
        const uint8_t* pf = c0 + KVQ_PREFETCH_BYTES;
        const __m512 k0 = _mm512_set1_ps(w[t] * kvq_tq_step(side[t * ns], p->sqrtf_n));
        const __m512 k1 = _mm512_set1_ps(w[t + 1] * kvq_tq_step(side[(t + 1) * ns], p->sqrtf_n));
        const __m512 k2 = _mm512_set1_ps(w[t + 2] * kvq_tq_step(side[(t + 2) * ns], p->sqrtf_n));
        const __m512 k3 = _mm512_set1_ps(w[t + 3] * kvq_tq_step(side[(t + 3) * ns], p->sqrtf_n));
        const int wide = t + 4 <= wide_end;
        for (i = 0; i < n; i += 16, c0 += gb, c1 += gb, c2 += gb, c3 += gb, pf += 4 * gb) {
            __m512 a = _mm512_loadu_ps(acc + i);
            kvq_prefetch(pf);
            if (wide) {
                a = _mm512_add_ps(a, _mm512_mul_ps(k0, kvq_tq_lev16(c0, &K, b, 1)));
                a = _mm512_add_ps(a, _mm512_mul_ps(k1, kvq_tq_lev16(c1, &K, b, 1)));
                a = _mm512_add_ps(a, _mm512_mul_ps(k2, kvq_tq_lev16(c2, &K, b, 1)));
                a = _mm512_add_ps(a, _mm512_mul_ps(k3, kvq_tq_lev16(c3, &K, b, 1)));
            } else {
                a = _mm512_add_ps(a, _mm512_mul_ps(k0, kvq_tq_lev16(c0, &K, b, 0)));
                a = _mm512_add_ps(a, _mm512_mul_ps(k1, kvq_tq_lev16(c1, &K, b, 0)));
                a = _mm512_add_ps(a, _mm512_mul_ps(k2, kvq_tq_lev16(c2, &K, b, 0)));
                a = _mm512_add_ps(a, _mm512_mul_ps(k3, kvq_tq_lev16(c3, &K, b, 0)));
            }
            _mm512_storeu_ps(acc + i, a);
        }
    }
    for (; t < r1; t++) {
        const uint8_t* c = codes + t * cb;
        const __m512 ct = _mm512_set1_ps(w[t] * kvq_tq_step(side[t * ns], p->sqrtf_n));
        for (i = 0; i < n; i += 16, c += gb)
            _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i),
                             _mm512_mul_ps(ct, kvq_tq_lev16(c, &K, b, 0))));
    }
}

/* ---- 6, 7 and 8 bits with VBMI: byte-plane lookups instead of permutes and gathers ----------
 * Each level (a float) is split into its four bytes; the plane of byte k is a 64-, 128- or
 * 256-entry byte table held in 1, 2 or 4 registers and read with vpermb / vpermi2b, 64 codes at
 * a time; the four planes are interleaved back into floats. Codes narrower than a byte are first
 * spread into bytes (vpermb puts the b bytes of 8 codes in a qword, vpmultishiftqb cuts them). The codes are first moved so that the floats come out in
 * element order: vector m of a block of 64 holds elements 16m..16m+15, as everywhere else, so the
 * sums are those of the gather path, bit for bit. */
typedef struct {
    __m512i plane[16];   /* plane k, entries 64j..64j+63: plane[4k + j] */
    __m512i order;       /* byte moves putting element 16m + 4L + e at byte 16L + 4m + e */
    __m512i spread;      /* b < 8: bytes bL..bL+b-1 of the block into qword L */
    __m512i shift;       /* b < 8: bit offsets b*e of code e inside its qword */
} kvq_tq_vbmi_consts;

static uint8_t kvq_tq_vbmi_order[64], kvq_tq_vbmi_spread[9][64], kvq_tq_vbmi_shift[9][64];

static void kvq_tq_init(void)
{
    int b, e, L, m;
    for (L = 0; L < 4; L++)
        for (m = 0; m < 4; m++)
            for (e = 0; e < 4; e++)
                kvq_tq_vbmi_order[16 * L + 4 * m + e] = (uint8_t)(16 * m + 4 * L + e);
    for (b = 1; b <= 8; b++)
        for (L = 0; L < 8; L++)
            for (e = 0; e < 8; e++) {
                kvq_tq_vbmi_spread[b][8 * L + e] = (uint8_t)(b * L + e < 8 * b ? b * L + e : 63);
                kvq_tq_vbmi_shift[b][8 * L + e] = (uint8_t)(b * e);
            }
}

KVQ_TARGET_AVX512VBMI static KVQ_ALWAYS_INLINE void kvq_tq_vbmi_init(kvq_tq_vbmi_consts* K,
                                                                   const uint8_t* planes, int b)
{
    int k, m;
    for (k = 0; k < 4; k++)
        for (m = 0; m < 4; m++)
            K->plane[4 * k + m] = _mm512_loadu_si512((const void*)(planes + 256 * k + 64 * m));
    K->order = _mm512_loadu_si512((const void*)kvq_tq_vbmi_order);
    K->spread = _mm512_loadu_si512((const void*)kvq_tq_vbmi_spread[b]);
    K->shift = _mm512_loadu_si512((const void*)kvq_tq_vbmi_shift[b]);
}

/* The levels of 64 codes (b * 8 bytes at g) as four vectors in element order. */
KVQ_TARGET_AVX512VBMI static KVQ_ALWAYS_INLINE void kvq_tq_vbmi_lev64(const uint8_t* g,
                                                                    const kvq_tq_vbmi_consts* K,
                                                                    const int b, __m512 v[4])
{
    __m512i x, p[4], l01, h01, l23, h23;
    int k;
    if (b == 8) {
        x = _mm512_loadu_si512((const void*)g);
    } else {
        x = _mm512_maskz_loadu_epi8((__mmask64)((1ULL << (8 * b)) - 1), (const void*)g);
        x = _mm512_multishift_epi64_epi8(K->shift, _mm512_permutexvar_epi8(K->spread, x));
    }
    x = _mm512_permutexvar_epi8(K->order, x);
    if (b <= 6) {   /* 64 entries (periodic below 64 levels): one register per plane */
        for (k = 0; k < 4; k++) p[k] = _mm512_permutexvar_epi8(x, K->plane[4 * k]);
    } else if (b == 8) {
        const __mmask64 high = _mm512_movepi8_mask(x);
        for (k = 0; k < 4; k++)
            p[k] = _mm512_mask_mov_epi8(_mm512_permutex2var_epi8(K->plane[4 * k], x, K->plane[4 * k + 1]),
                                        high,
                                        _mm512_permutex2var_epi8(K->plane[4 * k + 2], x, K->plane[4 * k + 3]));
    } else {
        for (k = 0; k < 4; k++)
            p[k] = _mm512_permutex2var_epi8(K->plane[4 * k], x, K->plane[4 * k + 1]);
    }
    l01 = _mm512_unpacklo_epi8(p[0], p[1]);
    h01 = _mm512_unpackhi_epi8(p[0], p[1]);
    l23 = _mm512_unpacklo_epi8(p[2], p[3]);
    h23 = _mm512_unpackhi_epi8(p[2], p[3]);
    v[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(l01, l23));
    v[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(l01, l23));
    v[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(h01, h23));
    v[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(h01, h23));
}

KVQ_TARGET_AVX512VBMI static KVQ_ALWAYS_INLINE void kvq_tq_vbmi_dot_body(
    const kvq_params* p, const uint8_t* codes, const float* side, int64_t r0, int64_t r1,
    const float* q, float* out, const int b)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side;
    kvq_tq_vbmi_consts K;
    __m512 acc[4], v[4];
    int64_t t = r0, i;
    int k, m;
    kvq_tq_vbmi_init(&K, p->planes, b);
    for (; t < r1; t += 4) {
        const int nr = r1 - t < 4 ? (int)(r1 - t) : 4;
        for (k = 0; k < nr; k++) {
            const uint8_t* row = codes + (t + k) * cb;
            acc[k] = _mm512_setzero_ps();
            for (i = 0; i < n; i += 64) {
                kvq_prefetch(row + i * b / 8 + KVQ_PREFETCH_BYTES);
                kvq_tq_vbmi_lev64(row + i * b / 8, &K, b, v);
                for (m = 0; m < 4; m++)
                    acc[k] = _mm512_add_ps(acc[k], _mm512_mul_ps(_mm512_loadu_ps(q + i + 16 * m), v[m]));
            }
        }
        if (nr == 4) {
            _mm_storeu_ps(out + t, _mm_mul_ps(kvq_tree16x4_avx512(acc[0], acc[1], acc[2], acc[3]),
                _mm_setr_ps(kvq_tq_step(side[t * ns], p->sqrtf_n),
                            kvq_tq_step(side[(t + 1) * ns], p->sqrtf_n),
                            kvq_tq_step(side[(t + 2) * ns], p->sqrtf_n),
                            kvq_tq_step(side[(t + 3) * ns], p->sqrtf_n))));
        } else {
            for (k = 0; k < nr; k++)
                out[t + k] = kvq_tree16_avx512(acc[k]) * kvq_tq_step(side[(t + k) * ns], p->sqrtf_n);
        }
    }
}

KVQ_TARGET_AVX512VBMI static KVQ_ALWAYS_INLINE void kvq_tq_vbmi_axpy_body(
    const kvq_params* p, const uint8_t* codes, const float* side, int64_t r0, int64_t r1,
    const float* w, float* acc, const int b)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side;
    kvq_tq_vbmi_consts K;
    __m512 a[4], v[4], c[4];
    int64_t t = r0, i;
    int k, m, nr;
    kvq_tq_vbmi_init(&K, p->planes, b);
    for (; t < r1; t += nr) {
        nr = r1 - t < 4 ? (int)(r1 - t) : 4;
        for (k = 0; k < nr; k++)
            c[k] = _mm512_set1_ps(w[t + k] * kvq_tq_step(side[(t + k) * ns], p->sqrtf_n));
        for (i = 0; i < n; i += 64) {
            for (m = 0; m < 4; m++) a[m] = _mm512_loadu_ps(acc + i + 16 * m);
            for (k = 0; k < nr; k++) {   /* rows in order for every element */
                const uint8_t* g = codes + (t + k) * cb + i * b / 8;
                kvq_prefetch(g + KVQ_PREFETCH_BYTES);
                kvq_tq_vbmi_lev64(g, &K, b, v);
                for (m = 0; m < 4; m++) a[m] = _mm512_add_ps(a[m], _mm512_mul_ps(c[k], v[m]));
            }
            for (m = 0; m < 4; m++) _mm512_storeu_ps(acc + i + 16 * m, a[m]);
        }
    }
}

KVQ_TARGET_AVX512VBMI static void kvq_tq_vbmi_dot(const kvq_params* p, const uint8_t* codes,
                                                  const float* side, int64_t r0, int64_t r1,
                                                  const float* q, float* out)
{
    if (p->bits == 8) kvq_tq_vbmi_dot_body(p, codes, side, r0, r1, q, out, 8);
    else if (p->bits == 7) kvq_tq_vbmi_dot_body(p, codes, side, r0, r1, q, out, 7);
    else kvq_tq_vbmi_dot_body(p, codes, side, r0, r1, q, out, 6);
}

KVQ_TARGET_AVX512VBMI static void kvq_tq_vbmi_axpy(const kvq_params* p, const uint8_t* codes,
                                                   const float* side, int64_t r0, int64_t r1,
                                                   const float* w, float* acc)
{
    if (p->bits == 8) kvq_tq_vbmi_axpy_body(p, codes, side, r0, r1, w, acc, 8);
    else if (p->bits == 7) kvq_tq_vbmi_axpy_body(p, codes, side, r0, r1, w, acc, 7);
    else kvq_tq_vbmi_axpy_body(p, codes, side, r0, r1, w, acc, 6);
}


KVQ_TARGET_AVX512 static void kvq_tq_dot_avx512(const kvq_params* p, const uint8_t* codes,
                                                const float* side, int64_t r0, int64_t r1,
                                                const float* q, float* out)
{
    if (p->dim % 16) {   /* widths 2, 4, 8: not worth a vector path */
        kvq_tq_dot_portable(p, codes, side, r0, r1, q, out);
        return;
    }
    if (p->vbmi && p->bits >= 6 && p->dim % 64 == 0) {
        kvq_tq_vbmi_dot(p, codes, side, r0, r1, q, out);
        return;
    }
    KVQ_TQ_DISPATCH(kvq_tq_dot_body, p, codes, side, r0, r1, q, out)
}

KVQ_TARGET_AVX512 static void kvq_tq_axpy_avx512(const kvq_params* p, const uint8_t* codes,
                                                 const float* side, int64_t r0, int64_t r1,
                                                 const float* w, float* acc)
{
    if (p->dim % 16) {
        kvq_tq_axpy_portable(p, codes, side, r0, r1, w, acc);
        return;
    }
    if (p->vbmi && p->bits >= 6 && p->dim % 64 == 0) {
        kvq_tq_vbmi_axpy(p, codes, side, r0, r1, w, acc);
        return;
    }
    KVQ_TQ_DISPATCH(kvq_tq_axpy_body, p, codes, side, r0, r1, w, acc)
}
#else  /* no vector path in this build: the dispatcher never picks these */
static void kvq_tq_init(void) {}
#define kvq_tq_dot_avx512 kvq_tq_dot_portable
#define kvq_tq_axpy_avx512 kvq_tq_axpy_portable
#endif

#endif /* KVQ_CONSUMERS_TQ_H */
