/* The vector kernels of rowops.h at one register width: included once per path with
 *   KVQ_LW       lanes of a float vector (16: AVX-512, 8: AVX2, 4: SSE2 or NEON),
 *   KVQ_LN(x)    the name of x in this instance (x_w16, x_w8, x_w4),
 *   KVQ_LTARGET  the target attribute of the instance's functions (empty for the baseline).
 * Vectors are exactly one register of the target: GCC lowers a vector wider than the target's
 * registers to scalar code for compares and lane permutations, so one 64-byte source compiled
 * for AVX2 or SSE ran 10-20x slower than it needs to. Every kernel works on groups of 16
 * elements held in 16 / KVQ_LW vectors and does the same float operations on the same operands
 * as the others, so all instances give the same bits. No include guard: included three times. */

#define KVQ_LK (16 / KVQ_LW)   /* vectors per group of 16 elements */

typedef float KVQ_LN(kvq_vf) __attribute__((vector_size(4 * KVQ_LW)));
typedef int32_t KVQ_LN(kvq_vi) __attribute__((vector_size(4 * KVQ_LW)));
typedef uint8_t KVQ_LN(kvq_vb) __attribute__((vector_size(KVQ_LW)));

/* Lane l paired with lane l ^ h (h < KVQ_LW), and the blend taking lane l from d when l & h
 * (the upper lane of a pair) and from s otherwise. */
#if KVQ_LW == 16
#define KVQ_LSWAP(v, h)                                                                         \
    __builtin_shufflevector(v, v, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h,      \
                            8 ^ h, 9 ^ h, 10 ^ h, 11 ^ h, 12 ^ h, 13 ^ h, 14 ^ h, 15 ^ h)
#define KVQ_LBLEND(s, d, h)                                                                     \
    __builtin_shufflevector(s, d, KVQ_LPICK(0, h), KVQ_LPICK(1, h), KVQ_LPICK(2, h),            \
                            KVQ_LPICK(3, h), KVQ_LPICK(4, h), KVQ_LPICK(5, h), KVQ_LPICK(6, h), \
                            KVQ_LPICK(7, h), KVQ_LPICK(8, h), KVQ_LPICK(9, h),                  \
                            KVQ_LPICK(10, h), KVQ_LPICK(11, h), KVQ_LPICK(12, h),               \
                            KVQ_LPICK(13, h), KVQ_LPICK(14, h), KVQ_LPICK(15, h))
#elif KVQ_LW == 8
#define KVQ_LSWAP(v, h)                                                                         \
    __builtin_shufflevector(v, v, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h)
#define KVQ_LBLEND(s, d, h)                                                                     \
    __builtin_shufflevector(s, d, KVQ_LPICK(0, h), KVQ_LPICK(1, h), KVQ_LPICK(2, h),            \
                            KVQ_LPICK(3, h), KVQ_LPICK(4, h), KVQ_LPICK(5, h), KVQ_LPICK(6, h), \
                            KVQ_LPICK(7, h))
#elif KVQ_LW == 4
#define KVQ_LSWAP(v, h) __builtin_shufflevector(v, v, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h)
#define KVQ_LBLEND(s, d, h)                                                                     \
    __builtin_shufflevector(s, d, KVQ_LPICK(0, h), KVQ_LPICK(1, h), KVQ_LPICK(2, h),            \
                            KVQ_LPICK(3, h))
#else
#error "rowops_lanes.h: KVQ_LW must be 4, 8 or 16"
#endif
#define KVQ_LPICK(l, h) ((l) & (h) ? KVQ_LW + (l) : (l))
/* one butterfly stage of stride h inside a vector: the lower lane of a pair gets a + b, the upper
 * one a - b (a the lower lane's value), exactly the scalar butterfly */
#define KVQ_LSTAGE(v, h)                                                                        \
    do {                                                                                        \
        const KVQ_LN(kvq_vf) p_ = KVQ_LSWAP(v, h);                                              \
        v = KVQ_LBLEND(v + p_, p_ - v, h);                                                      \
    } while (0)

/* The load and store carry the instance's target too: Clang rejects passing a vector wider than
 * the caller's or callee's registers between functions of different targets (an ABI change),
 * even always inlined. */
KVQ_LTARGET KVQ_INLINE KVQ_LN(kvq_vf) KVQ_LN(kvq_lload)(const float *p)
{
    KVQ_LN(kvq_vf) v;
    memcpy(&v, p, sizeof v);
    return v;
}

KVQ_LTARGET KVQ_INLINE void KVQ_LN(kvq_lstore)(float *p, KVQ_LN(kvq_vf) v)
{
    memcpy(p, &v, sizeof v);
}

/* kvq_fwht for n >= 16: stages h < KVQ_LW inside each vector, then two stages per pass over the
 * row where it can (radix 4: four vectors in registers), then the last one alone. */
KVQ_LTARGET static void KVQ_LN(kvq_fwht)(float *y, int64_t n)
{
    int64_t i, j, h;
    for (i = 0; i < n; i += KVQ_LW) {
        KVQ_LN(kvq_vf) v = KVQ_LN(kvq_lload)(y + i);
        KVQ_LSTAGE(v, 1);
        KVQ_LSTAGE(v, 2);
#if KVQ_LW >= 8
        KVQ_LSTAGE(v, 4);
#endif
#if KVQ_LW >= 16
        KVQ_LSTAGE(v, 8);
#endif
        KVQ_LN(kvq_lstore)(y + i, v);
    }
    h = KVQ_LW;
    for (; 4 * h <= n; h *= 4)
        for (i = 0; i < n; i += 4 * h)
            for (j = i; j < i + h; j += KVQ_LW) {
                const KVQ_LN(kvq_vf) v0 = KVQ_LN(kvq_lload)(y + j);
                const KVQ_LN(kvq_vf) v1 = KVQ_LN(kvq_lload)(y + j + h);
                const KVQ_LN(kvq_vf) v2 = KVQ_LN(kvq_lload)(y + j + 2 * h);
                const KVQ_LN(kvq_vf) v3 = KVQ_LN(kvq_lload)(y + j + 3 * h);
                const KVQ_LN(kvq_vf) s01 = v0 + v1, d01 = v0 - v1, s23 = v2 + v3, d23 = v2 - v3;
                KVQ_LN(kvq_lstore)(y + j, s01 + s23);
                KVQ_LN(kvq_lstore)(y + j + h, d01 + d23);
                KVQ_LN(kvq_lstore)(y + j + 2 * h, s01 - s23);
                KVQ_LN(kvq_lstore)(y + j + 3 * h, d01 - d23);
            }
    for (; h < n; h *= 2)
        for (i = 0; i < n; i += 2 * h)
            for (j = i; j < i + h; j += KVQ_LW) {
                const KVQ_LN(kvq_vf) a = KVQ_LN(kvq_lload)(y + j);
                const KVQ_LN(kvq_vf) b = KVQ_LN(kvq_lload)(y + j + h);
                KVQ_LN(kvq_lstore)(y + j, a + b);
                KVQ_LN(kvq_lstore)(y + j + h, a - b);
            }
}

/* code[i] = #{k : bnd[k] < y[i]} by counted compares, n a multiple of 16 (NaN: 0). */
KVQ_LTARGET static void KVQ_LN(kvq_codes_counted)(const float *y, int64_t n, const float *bnd,
                                                  int n_bnd, uint8_t *code)
{
    int64_t i;
    int j, k;
    for (i = 0; i < n; i += 16) {
        KVQ_LN(kvq_vf) v[KVQ_LK];
        KVQ_LN(kvq_vi) c[KVQ_LK];
        for (j = 0; j < KVQ_LK; j++) {
            v[j] = KVQ_LN(kvq_lload)(y + i + j * KVQ_LW);
            c[j] = (KVQ_LN(kvq_vi)){0};
        }
        for (k = 0; k < n_bnd; k++) {
            const float b = bnd[k];
            for (j = 0; j < KVQ_LK; j++)
                c[j] -= v[j] > b;                                  /* true is -1 */
        }
        for (j = 0; j < KVQ_LK; j++) {
            const KVQ_LN(kvq_vb) c8 = __builtin_convertvector(c[j], KVQ_LN(kvq_vb));
            memcpy(code + i + j * KVQ_LW, &c8, KVQ_LW);
        }
    }
}

/* The codes through a bucket table of window 1 (rowops.h: lo, scale, n_buckets - 1 as `top`,
 * the starts and the boundaries of its buckets), n a multiple of 16: the buckets in vectors
 * (kvq_code_bucket's float operations and clamps), then two table reads per element. */
KVQ_LTARGET static void KVQ_LN(kvq_codes_bucket1)(const float *y, int64_t n, float lo,
                                                  float scale, float top, const float *start,
                                                  const float *bval, uint8_t *code)
{
    int64_t i;
    int j, l;
    for (i = 0; i < n; i += 16) {
        int32_t b[16];
        for (j = 0; j < KVQ_LK; j++) {
            KVQ_LN(kvq_vf) t = (KVQ_LN(kvq_lload)(y + i + j * KVQ_LW) - lo) * scale;
            KVQ_LN(kvq_vi) bj;
            t = (KVQ_LN(kvq_vf))((KVQ_LN(kvq_vi))t & (t > 0.0f));              /* NaN, < 0 -> 0 */
            t = (KVQ_LN(kvq_vf))(((KVQ_LN(kvq_vi))t & (t < top))
                                 | ((KVQ_LN(kvq_vi))((KVQ_LN(kvq_vf)){0} + top) & ~(t < top)));
            bj = __builtin_convertvector(t, KVQ_LN(kvq_vi));
            memcpy(b + j * KVQ_LW, &bj, sizeof bj);
        }
        for (l = 0; l < 16; l++)
            code[i + l] = (uint8_t)((int32_t)start[b[l]] + (bval[b[l]] < y[i + l]));
    }
}

#undef KVQ_LK
#undef KVQ_LSWAP
#undef KVQ_LBLEND
#undef KVQ_LPICK
#undef KVQ_LSTAGE
