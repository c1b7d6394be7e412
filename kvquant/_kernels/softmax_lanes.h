/* The softmax row kernels of softmax.h at one register width: included once per path with
 *   KVQ_SW       lanes of a float vector (16: AVX-512, 8: AVX2, 4: SSE2 or NEON),
 *   KVQ_SN(x)    the name of x in this instance (x_w16, x_w8, x_w4),
 *   KVQ_STARGET  the target attribute of the instance's functions (empty for the baseline).
 * Each vector is one register of its target (GCC compiles compares of wider vectors to scalar
 * code). Elements are taken in groups of 16 held in 16 / KVQ_SW vectors, and every instance does
 * the same float operations on the same operands: the same bits on every path. No include
 * guard: included three times. */

#define KVQ_SK (16 / KVQ_SW)   /* vectors per group of 16 elements */

typedef float KVQ_SN(kvq_smf) __attribute__((vector_size(4 * KVQ_SW)));
typedef int32_t KVQ_SN(kvq_smi) __attribute__((vector_size(4 * KVQ_SW)));
typedef uint32_t KVQ_SN(kvq_smu) __attribute__((vector_size(4 * KVQ_SW)));

KVQ_STARGET KVQ_SM_INLINE KVQ_SN(kvq_smf) KVQ_SN(kvq_sm_load)(const float *p)
{
    KVQ_SN(kvq_smf) v;
    memcpy(&v, p, sizeof v);
    return v;
}

KVQ_STARGET KVQ_SM_INLINE void KVQ_SN(kvq_sm_store)(float *p, KVQ_SN(kvq_smf) v)
{
    memcpy(p, &v, sizeof v);
}

/* exp(x) for x <= 0 (softmax's s - max), -inf or NaN: softmax.h's kvq_sm_exp1, lane by lane. */
KVQ_STARGET KVQ_SM_INLINE KVQ_SN(kvq_smf) KVQ_SN(kvq_sm_exp)(KVQ_SN(kvq_smf) x)
{
    typedef KVQ_SN(kvq_smf) vf;
    typedef KVQ_SN(kvq_smi) vi;
    typedef KVQ_SN(kvq_smu) vu;
    const vi under = x < KVQ_SM_LOWEST;                     /* -1 where the result is 0 */
    const vf xc = (vf)((under & (vi)((vf){} + KVQ_SM_LOWEST)) | (~under & (vi)x));
    const vf v = xc * KVQ_SM_LOG2E + KVQ_SM_ROUNDER;
    const vf nf = v - KVQ_SM_ROUNDER;                       /* round(x log2 e), in [-150, 0] */
    const vu ni = (vu)v - (vu)((vf){} + KVQ_SM_ROUNDER);    /* the same integer, two's complement */
    const vf r = (xc - nf * KVQ_SM_LN2_HI) - nf * KVQ_SM_LN2_LO;
    vf p = (vf){} + KVQ_SM_P0;
    p = p * r + KVQ_SM_P1;
    p = p * r + KVQ_SM_P2;
    p = p * r + KVQ_SM_P3;
    p = p * r + KVQ_SM_P4;
    p = p * r + KVQ_SM_P5;
    p = (p * (r * r) + r) + 1.0f;
    const vf up = (vf)((ni + (vu){} + (127u + KVQ_SM_SHIFT)) << 23);  /* 2^(n + SHIFT) */
    const vf e = (p * up) * KVQ_SM_UNSHIFT;
    return (vf)(~under & (vi)e);
}

/* s[i] = s[i] * scale for i < n; *max_out = the largest of them (-inf for none), *nan_out = 1
 * when one is NaN. n is a multiple of 16. Four running maxima (a max is exact in any order):
 * one would make the loop wait on its compare and select. */
KVQ_STARGET static void KVQ_SN(kvq_sm_scale_max)(float *s, int64_t n, float scale,
                                                  float *max_out, int *nan_out)
{
    typedef KVQ_SN(kvq_smf) vf;
    typedef KVQ_SN(kvq_smi) vi;
    vf mx[4];
    vi nan = (vi){};
    int64_t i = 0;
    int k;
    for (k = 0; k < 4; k++)
        mx[k] = (vf){} - INFINITY;
    for (; i + 4 * KVQ_SW <= n; i += 4 * KVQ_SW)
        for (k = 0; k < 4; k++) {
            const vf t = KVQ_SN(kvq_sm_load)(s + i + k * KVQ_SW) * scale;
            const vi gt = t > mx[k];
            KVQ_SN(kvq_sm_store)(s + i + k * KVQ_SW, t);
            mx[k] = (vf)((gt & (vi)t) | (~gt & (vi)mx[k]));
            nan |= t != t;
        }
    for (; i < n; i += KVQ_SW) {
        const vf t = KVQ_SN(kvq_sm_load)(s + i) * scale;
        const vi gt = t > mx[0];
        KVQ_SN(kvq_sm_store)(s + i, t);
        mx[0] = (vf)((gt & (vi)t) | (~gt & (vi)mx[0]));
        nan |= t != t;
    }
    float best = -INFINITY;
    int any_nan = 0;
    for (int l = 0; l < KVQ_SW; l++) {
        for (k = 0; k < 4; k++)
            if (mx[k][l] > best)
                best = mx[k][l];
        any_nan |= nan[l] != 0;
    }
    *max_out = best;
    *nan_out = any_nan;
}

/* s[i] = exp(s[i] - mx) for i < n (a multiple of 16); lane j of `lanes` gets the sum of the
 * elements i = j, j + 16, ... in that order, from +0. The exponentials of four vectors are
 * computed before they are summed (in order): their long chains then overlap. */
KVQ_STARGET static void KVQ_SN(kvq_sm_exp_sum)(float *s, int64_t n, float mx, float lanes[16])
{
    typedef KVQ_SN(kvq_smf) vf;
    vf acc[KVQ_SK];
    int64_t i = 0;
    int k;
    for (k = 0; k < KVQ_SK; k++)
        acc[k] = (vf){};
    for (; i + 4 * KVQ_SW <= n; i += 4 * KVQ_SW) {
        vf e[4];
        for (k = 0; k < 4; k++)
            e[k] = KVQ_SN(kvq_sm_exp)(KVQ_SN(kvq_sm_load)(s + i + k * KVQ_SW) - mx);
        for (k = 0; k < 4; k++) {
            KVQ_SN(kvq_sm_store)(s + i + k * KVQ_SW, e[k]);
            acc[k % KVQ_SK] = acc[k % KVQ_SK] + e[k];
        }
    }
    /* what is left is less than 4 vectors, a whole number of groups of 16 */
    for (; i < n; i += 16)
        for (k = 0; k < KVQ_SK; k++) {
            const vf e = KVQ_SN(kvq_sm_exp)(KVQ_SN(kvq_sm_load)(s + i + k * KVQ_SW) - mx);
            KVQ_SN(kvq_sm_store)(s + i + k * KVQ_SW, e);
            acc[k] = acc[k] + e;
        }
    for (k = 0; k < KVQ_SK; k++)
        KVQ_SN(kvq_sm_store)(lanes + k * KVQ_SW, acc[k]);
}

/* s[i] = s[i] / total for i < n (a multiple of 16). */
KVQ_STARGET static void KVQ_SN(kvq_sm_divide)(float *s, int64_t n, float total)
{
    for (int64_t i = 0; i < n; i += KVQ_SW)
        KVQ_SN(kvq_sm_store)(s + i, KVQ_SN(kvq_sm_load)(s + i) / total);
}

#undef KVQ_SK
