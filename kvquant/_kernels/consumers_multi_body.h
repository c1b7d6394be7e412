/* The multi-query kernels over a 16-lane vector type MV, included once per instruction set by
 * consumers_multi.h (which defines KVQ_MQ, MV and the MV_* operations and decoders). No include
 * guard on purpose.
 *
 * Scores: R rows and M queries per pass (R M accumulators in registers, R and M compile-time
 * constants); each 16 codes of a row are decoded once and multiplied by the M queries' 16
 * elements, each (row, query) sum keeping simd.h's lane order. Contexts: R rows at a time; per 16
 * elements each query's accumulator is loaded once and adds the R rows in row order.
 */

/* Sums of R rows x M queries to out[j ldo + r] (times scale[r] when scale is not NULL). */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(mq_store)(const MV* acc, float* out, int64_t ldo,
                                                           const float* scale, const int R,
                                                           const int M)
{
    float s4[4];
    int r, j;
    for (j = 0; j < M; j++) {
        if (R == 4)
            MV_TREE4(acc[j], acc[M + j], acc[2 * M + j], acc[3 * M + j], s4);
        else
            for (r = 0; r < R; r++) s4[r] = MV_TREE1(acc[r * M + j]);
        for (r = 0; r < R; r++) out[j * ldo + r] = scale ? s4[r] * scale[r] : s4[r];
    }
}

/* Runs ROWS(R, t) over rows [r0, r1): R at a time, then one at a time. */
#define KVQ_MQ_ROW_LOOP(R, CALL)                                                              \
    do {                                                                                      \
        int64_t t = r0;                                                                       \
        for (; t + (R) <= r1; t += (R)) CALL(R, t);                                           \
        for (; t < r1; t++) CALL(1, t);                                                       \
    } while (0)

#ifndef KVQ_MQ_TQ_ONLY
/* ---- f32 --------------------------------------------------------------------------------- */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(f32_dot_rows)(const kvq_params* p,
                                                               const uint8_t* codes, int64_t t,
                                                               const float* Q, float* out,
                                                               int64_t ldo, const int R,
                                                               const int M)
{
    const int64_t n = p->dim, stride = p->code_bytes / 4;
    const float* x = (const float*)codes + t * stride;
    MV acc[8], qv;
    int64_t i;
    int r, j;
    for (r = 0; r < R * M; r++) acc[r] = MV_ZERO();
    for (i = 0; i < n; i += 16) {
        for (r = 0; r < R; r++) kvq_prefetch((const char*)(x + r * stride + i) + KVQ_PREFETCH_BYTES);
        for (j = 0; j < M; j++) {
            qv = MV_LOAD(Q + j * n + i);
            for (r = 0; r < R; r++)
                acc[r * M + j] = MV_ADD(acc[r * M + j], MV_MUL(qv, MV_LOAD(x + r * stride + i)));
        }
    }
    KVQ_MQ(mq_store)(acc, out + t, ldo, NULL, R, M);
}

KVQ_MQ_TARGET static void KVQ_MQ(f32_dotm)(const kvq_params* p, const uint8_t* codes,
                                          const float* side, int64_t r0, int64_t r1,
                                          const float* Q, int m, float* out, int64_t ldo)
{
    int j0, mm;
    if (p->dim % 16) {
        KVQ_MQ_FALLBACK(f32_dotm)(p, codes, side, r0, r1, Q, m, out, ldo);
        return;
    }
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Qj = Q + j0 * p->dim;
        float* oj = out + j0 * ldo;
        mm = m - j0 < KVQ_MQ_PASS ? m - j0 : KVQ_MQ_PASS;
        switch (mm) {
#define KVQ_MQ_CALL(R, t) KVQ_MQ(f32_dot_rows)(p, codes, t, Qj, oj, ldo, R, M_)
#define KVQ_MQ_CASE(M) case M: { enum { M_ = M }; KVQ_MQ_ROW_LOOP(KVQ_MQ_ROWS(M), KVQ_MQ_CALL); } break;
        KVQ_MQ_EACH_M(KVQ_MQ_CASE)
#undef KVQ_MQ_CASE
#undef KVQ_MQ_CALL
        }
    }
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(f32_axpy_rows)(const kvq_params* p,
                                                                const uint8_t* codes, int64_t t,
                                                                const float* W, int64_t ldw,
                                                                int m_, float* acc, const int R,
                                                                const int M)
{
    const int64_t n = p->dim, stride = p->code_bytes / 4;
    const int m = M ? M : m_;   /* M: a compile-time query count (0: m_ at run time) */
    const float* x = (const float*)codes + t * stride;
    MV a, v[4];
    int64_t i;
    int r, j;
    for (i = 0; i < n; i += 16) {
        for (r = 0; r < R; r++) {
            kvq_prefetch((const char*)(x + r * stride + i) + KVQ_PREFETCH_BYTES);
            v[r] = MV_LOAD(x + r * stride + i);
        }
        for (j = 0; j < m; j++) {
            a = MV_LOAD(acc + j * n + i);
            for (r = 0; r < R; r++) a = MV_ADD(a, MV_MUL(MV_SET1(W[j * ldw + t + r]), v[r]));
            MV_STORE(acc + j * n + i, a);
        }
    }
}

KVQ_MQ_TARGET static void KVQ_MQ(f32_axpym)(const kvq_params* p, const uint8_t* codes,
                                           const float* side, int64_t r0, int64_t r1,
                                           const float* W, int64_t ldw, int m, float* acc)
{
    if (p->dim % 16) {
        KVQ_MQ_FALLBACK(f32_axpym)(p, codes, side, r0, r1, W, ldw, m, acc);
        return;
    }
#define KVQ_MQ_CALL(R, t) KVQ_MQ(f32_axpy_rows)(p, codes, t, W, ldw, m, acc, R, M_)
    if (m == 1) {
        const int M_ = 1;
        KVQ_MQ_ROW_LOOP(4, KVQ_MQ_CALL);
    } else {
        const int M_ = 0;
        KVQ_MQ_ROW_LOOP(4, KVQ_MQ_CALL);
    }
#undef KVQ_MQ_CALL
}

/* ---- kv8 (per-row scale, or groups of a multiple of 16) -------------------------------------
 * Blocks of 64 codes holding no special code (subnormal, NaN: kvq_e4m3_special64) decode by the
 * exponent rebias alone, or raw with the 2^120 in the other factor when that factor is below
 * 2^7 (the same products, hence the same bits: consumers_kv8.h). */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(kv8_dot_rows)(const kvq_params* p,
                                                               const uint8_t* codes,
                                                               const float* side, int64_t t,
                                                               const float* Q, const float* Qraw,
                                                               float* out, int64_t ldo,
                                                               const int R, const int M)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, G = p->group;
    const int grouped = G != n;
    const int64_t steps_per_group = G / 16;
    const uint8_t* c = codes + t * cb;
    const float* s = side + t * ns;
    MV acc[8], part[8], v[4], qv, pr;
    float scale[4];
    int64_t i0, i, g = 0, left = steps_per_group;
    int r, j, special;
    for (r = 0; r < R * M; r++) acc[r] = part[r] = MV_ZERO();
#define KVQ_MQ_KV8_STEP(HOW, QQ)                                                             \
    for (r = 0; r < R; r++) v[r] = MV_E4M3(c + r * cb + i, HOW);                             \
    for (j = 0; j < M; j++) {                                                                \
        qv = MV_LOAD(QQ + j * n + i);                                                        \
        for (r = 0; r < R; r++) {                                                            \
            pr = MV_MUL(qv, v[r]);                                                           \
            if (grouped) part[r * M + j] = MV_ADD(part[r * M + j], pr);                      \
            else acc[r * M + j] = MV_ADD(acc[r * M + j], pr);                                \
        }                                                                                    \
    }                                                                                        \
    if (grouped && --left == 0) {                                                            \
        for (r = 0; r < R; r++) {                                                            \
            const MV sg = MV_SET1(s[r * ns + g]);                                            \
            for (j = 0; j < M; j++) {                                                        \
                acc[r * M + j] = MV_ADD(acc[r * M + j], MV_MUL(part[r * M + j], sg));        \
                part[r * M + j] = MV_ZERO();                                                 \
            }                                                                                \
        }                                                                                    \
        g++;                                                                                 \
        left = steps_per_group;                                                              \
    }
    for (i0 = 0; i0 < n; i0 += 64) {
        const int64_t i1 = i0 + 64 < n ? i0 + 64 : n;
        special = 0;
        for (r = 0; r < R; r++) {
            kvq_prefetch(c + r * cb + i0 + KVQ_PREFETCH_BYTES);
            special |= MV_E4M3_SPECIAL(c + r * cb + i0, i1 - i0);
        }
        if (special)
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_ANY, Q) }
        else if (Qraw)
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_RAW, Qraw) }
        else
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_PLAIN, Q) }
    }
#undef KVQ_MQ_KV8_STEP
    for (r = 0; r < R; r++) scale[r] = s[r * ns];
    KVQ_MQ(mq_store)(acc, out + t, ldo, grouped ? NULL : scale, R, M);
}

KVQ_MQ_TARGET static void KVQ_MQ(kv8_dotm)(const kvq_params* p, const uint8_t* codes,
                                          const float* side, int64_t r0, int64_t r1,
                                          const float* Q, int m, float* out, int64_t ldo)
{
    const int64_t n = p->dim;
    float qraw[KVQ_MQ_FOLD_FLOATS];
    int j0, mm;
    int64_t i;
    if (!kvq_mq_kv8_layout_ok(p)) {
        KVQ_MQ_FALLBACK(kv8_dotm)(p, codes, side, r0, r1, Q, m, out, ldo);
        return;
    }
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Qj = Q + j0 * n;
        const float* Qr = NULL;
        float* oj = out + j0 * ldo;
        mm = m - j0 < KVQ_MQ_PASS ? m - j0 : KVQ_MQ_PASS;
        if (mm * n <= KVQ_MQ_FOLD_FLOATS && kvq_mq_foldable(Qj, mm * n)) {
            for (i = 0; i < mm * n; i++) qraw[i] = Qj[i] * 0x1p120f;   /* exact */
            Qr = qraw;
        }
        switch (mm) {
#define KVQ_MQ_CALL(R, t) KVQ_MQ(kv8_dot_rows)(p, codes, side, t, Qj, Qr, oj, ldo, R, M_)
#define KVQ_MQ_CASE(M) case M: { enum { M_ = M }; KVQ_MQ_ROW_LOOP(KVQ_MQ_ROWS(M), KVQ_MQ_CALL); } break;
        KVQ_MQ_EACH_M(KVQ_MQ_CASE)
#undef KVQ_MQ_CASE
#undef KVQ_MQ_CALL
        }
    }
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(kv8_axpy_rows)(const kvq_params* p,
                                                                const uint8_t* codes,
                                                                const float* side, int64_t t,
                                                                const float* W, int64_t ldw,
                                                                int m_, float* acc, const int R,
                                                                const int M)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, G = p->group;
    const int64_t steps_per_group = G / 16;
    const int m = M ? M : m_;   /* M: a compile-time query count (0: m_ at run time) */
    const uint8_t* c = codes + t * cb;
    const float* s = side + t * ns;
    float cf[4 * KVQ_MQ_MAX], cfr[4 * KVQ_MQ_MAX];
    MV a, v[4];
    int64_t i0, i, g, left;
    int r, j, special, fold = 1;
    /* the raw decode when every coefficient of these rows is below 2^7 */
    for (g = 0; g < ns && fold; g++) fold = kvq_mq_kv8_coefs(W, ldw, t, m, s, ns, g, R, cf, cfr);
    kvq_mq_kv8_coefs(W, ldw, t, m, s, ns, 0, R, cf, cfr);
    g = 0;
    left = steps_per_group;
#define KVQ_MQ_KV8_STEP(HOW, CF)                                                             \
    for (r = 0; r < R; r++) v[r] = MV_E4M3(c + r * cb + i, HOW);                             \
    for (j = 0; j < m; j++) {                                                                \
        a = MV_LOAD(acc + j * n + i);                                                        \
        for (r = 0; r < R; r++) a = MV_ADD(a, MV_MUL(MV_SET1(CF[r * m + j]), v[r]));         \
        MV_STORE(acc + j * n + i, a);                                                        \
    }                                                                                        \
    if (--left == 0 && ++g < ns) {                                                           \
        kvq_mq_kv8_coefs(W, ldw, t, m, s, ns, g, R, cf, cfr);                                \
        left = steps_per_group;                                                              \
    }
    for (i0 = 0; i0 < n; i0 += 64) {
        const int64_t i1 = i0 + 64 < n ? i0 + 64 : n;
        special = 0;
        for (r = 0; r < R; r++) {
            kvq_prefetch(c + r * cb + i0 + KVQ_PREFETCH_BYTES);
            special |= MV_E4M3_SPECIAL(c + r * cb + i0, i1 - i0);
        }
        if (special)
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_ANY, cf) }
        else if (fold)
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_RAW, cfr) }
        else
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_PLAIN, cf) }
    }
#undef KVQ_MQ_KV8_STEP
}

KVQ_MQ_TARGET static void KVQ_MQ(kv8_axpym)(const kvq_params* p, const uint8_t* codes,
                                           const float* side, int64_t r0, int64_t r1,
                                           const float* W, int64_t ldw, int m, float* acc)
{
    int j0, mm;
    if (!kvq_mq_kv8_layout_ok(p)) {
        KVQ_MQ_FALLBACK(kv8_axpym)(p, codes, side, r0, r1, W, ldw, m, acc);
        return;
    }
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Wj = W + j0 * ldw;
        float* aj = acc + j0 * p->dim;
        mm = m - j0 < KVQ_MQ_MAX ? m - j0 : KVQ_MQ_MAX;
#define KVQ_MQ_CALL(R, t) KVQ_MQ(kv8_axpy_rows)(p, codes, side, t, Wj, ldw, mm, aj, R, M_)
        if (mm == 1) {
            const int M_ = 1;
            KVQ_MQ_ROW_LOOP(4, KVQ_MQ_CALL);
        } else {
            const int M_ = 0;
            KVQ_MQ_ROW_LOOP(4, KVQ_MQ_CALL);
        }
#undef KVQ_MQ_CALL
    }
}

#endif /* KVQ_MQ_TQ_ONLY */

/* ---- tq<b> ------------------------------------------------------------------------------- */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_dot_rows)(const kvq_params* p,
                                                              const uint8_t* codes,
                                                              const float* side, int64_t t,
                                                              const MV_TQ_CONSTS* K,
                                                              const float* Q, float* out,
                                                              int64_t ldo, const int R,
                                                              const int M, const int b,
                                                              const int wide)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, gb = 2 * b;
    const uint8_t* c = codes + t * cb;
    MV acc[8], v[4], qv;
    float step[4];
    int64_t i, off;
    int r, j;
    for (r = 0; r < R * M; r++) acc[r] = MV_ZERO();
    for (i = 0, off = 0; i < n; i += 16, off += gb) {
        kvq_prefetch(c + KVQ_PREFETCH_BYTES + R * off);
        for (r = 0; r < R; r++) v[r] = MV_TQ_LEV16(c + r * cb + off, K, b, wide);
        for (j = 0; j < M; j++) {
            qv = MV_LOAD(Q + j * n + i);
            for (r = 0; r < R; r++) acc[r * M + j] = MV_ADD(acc[r * M + j], MV_MUL(qv, v[r]));
        }
    }
    for (r = 0; r < R; r++) step[r] = kvq_tq_step(side[(t + r) * ns], p->sqrtf_n);
    KVQ_MQ(mq_store)(acc, out + t, ldo, step, R, M);
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_dot_bits)(const kvq_params* p,
                                                              const uint8_t* codes,
                                                              const float* side, int64_t r0,
                                                              int64_t r1, const float* Q, int m,
                                                              float* out, int64_t ldo, const int b)
{
    /* rows before wide_end may read 16 bytes from any of their groups */
    const int64_t wide_end = p->n_rows - (16 + p->code_bytes - 1) / p->code_bytes;
    MV_TQ_CONSTS K;
    int j0, mm;
    MV_TQ_INIT(&K, p->table, b);
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Qj = Q + j0 * p->dim;
        float* oj = out + j0 * ldo;
        mm = m - j0 < KVQ_MQ_PASS ? m - j0 : KVQ_MQ_PASS;
        switch (mm) {
#define KVQ_MQ_CALL(R, t)                                                                    \
            if ((t) + (R) <= wide_end)                                                       \
                KVQ_MQ(tq_dot_rows)(p, codes, side, t, &K, Qj, oj, ldo, R, M_, b, 1);        \
            else                                                                             \
                KVQ_MQ(tq_dot_rows)(p, codes, side, t, &K, Qj, oj, ldo, R, M_, b, 0)
#define KVQ_MQ_CASE(M) case M: { enum { M_ = M }; KVQ_MQ_ROW_LOOP(KVQ_MQ_ROWS(M), KVQ_MQ_CALL); } break;
        KVQ_MQ_EACH_M(KVQ_MQ_CASE)
#undef KVQ_MQ_CASE
#undef KVQ_MQ_CALL
        }
    }
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_axpy_rows)(const kvq_params* p,
                                                               const uint8_t* codes,
                                                               const float* side, int64_t t,
                                                               const MV_TQ_CONSTS* K,
                                                               const float* W, int64_t ldw,
                                                               int m_, float* acc, const int R,
                                                               const int M, const int b,
                                                               const int wide)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, gb = 2 * b;
    const int m = M ? M : m_;   /* M: a compile-time query count (0: m_ at run time) */
    const uint8_t* c = codes + t * cb;
    float cf[4 * KVQ_MQ_MAX];
    MV a, v[4];
    int64_t i, off;
    int r, j;
    for (r = 0; r < R; r++) {
        const float st = kvq_tq_step(side[(t + r) * ns], p->sqrtf_n);
        for (j = 0; j < m; j++) cf[r * m + j] = W[j * ldw + t + r] * st;
    }
    for (i = 0, off = 0; i < n; i += 16, off += gb) {
        kvq_prefetch(c + KVQ_PREFETCH_BYTES + R * off);
        for (r = 0; r < R; r++) v[r] = MV_TQ_LEV16(c + r * cb + off, K, b, wide);
        for (j = 0; j < m; j++) {
            a = MV_LOAD(acc + j * n + i);
            for (r = 0; r < R; r++) a = MV_ADD(a, MV_MUL(MV_SET1(cf[r * m + j]), v[r]));
            MV_STORE(acc + j * n + i, a);
        }
    }
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_axpy_bits)(const kvq_params* p,
                                                               const uint8_t* codes,
                                                               const float* side, int64_t r0,
                                                               int64_t r1, const float* W,
                                                               int64_t ldw, int m, float* acc,
                                                               const int b)
{
    const int64_t wide_end = p->n_rows - (16 + p->code_bytes - 1) / p->code_bytes;
    MV_TQ_CONSTS K;
    int j0, mm;
    MV_TQ_INIT(&K, p->table, b);
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Wj = W + j0 * ldw;
        float* aj = acc + j0 * p->dim;
        mm = m - j0 < KVQ_MQ_MAX ? m - j0 : KVQ_MQ_MAX;
#define KVQ_MQ_CALL(R, t)                                                                    \
        if ((t) + (R) <= wide_end)                                                           \
            KVQ_MQ(tq_axpy_rows)(p, codes, side, t, &K, Wj, ldw, mm, aj, R, M_, b, 1);       \
        else                                                                                 \
            KVQ_MQ(tq_axpy_rows)(p, codes, side, t, &K, Wj, ldw, mm, aj, R, M_, b, 0)
        if (mm == 1) {
            const int M_ = 1;
            KVQ_MQ_ROW_LOOP(4, KVQ_MQ_CALL);
        } else {
            const int M_ = 0;
            KVQ_MQ_ROW_LOOP(4, KVQ_MQ_CALL);
        }
#undef KVQ_MQ_CALL
    }
}

KVQ_MQ_TARGET static void KVQ_MQ(tq_dotm)(const kvq_params* p, const uint8_t* codes,
                                         const float* side, int64_t r0, int64_t r1,
                                         const float* Q, int m, float* out, int64_t ldo)
{
    if (kvq_mq_tq_own_kernels(p, KVQ_MQ_VBMI_TQ)) {
        KVQ_MQ_FALLBACK(tq_dotm)(p, codes, side, r0, r1, Q, m, out, ldo);
        return;
    }
    KVQ_TQ_DISPATCH(KVQ_MQ(tq_dot_bits), p, codes, side, r0, r1, Q, m, out, ldo)
}

KVQ_MQ_TARGET static void KVQ_MQ(tq_axpym)(const kvq_params* p, const uint8_t* codes,
                                          const float* side, int64_t r0, int64_t r1,
                                          const float* W, int64_t ldw, int m, float* acc)
{
    if (kvq_mq_tq_own_kernels(p, KVQ_MQ_VBMI_TQ)) {
        KVQ_MQ_FALLBACK(tq_axpym)(p, codes, side, r0, r1, W, ldw, m, acc);
        return;
    }
    KVQ_TQ_DISPATCH(KVQ_MQ(tq_axpy_bits), p, codes, side, r0, r1, W, ldw, m, acc)
}

#ifndef KVQ_MQ_TQ_ONLY
/* ---- q8_0 / q4_0 ------------------------------------------------------------------------- */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(ggml_dot_rows)(const kvq_params* p,
                                                                const uint8_t* codes, int64_t t,
                                                                const float* Q, float* out,
                                                                int64_t ldo, const int R,
                                                                const int M, const int q4)
{
    const int64_t nb = p->dim / KVQ_GGML_BLOCK, cb = p->code_bytes, n = p->dim;
    const int64_t bb = q4 ? 18 : 34;
    const uint8_t* c = codes + t * cb;
    MV acc[8], lo[4], hi[4], part, q0, q1;
    float d[4];
    int64_t b;
    int r, j;
    for (r = 0; r < R * M; r++) acc[r] = MV_ZERO();
    for (b = 0; b < nb; b++) {
        for (r = 0; r < R; r++) {
            const uint8_t* blk = c + r * cb + b * bb;
            kvq_prefetch(blk + KVQ_PREFETCH_BYTES);
            MV_GGML_VALUES(blk, q4, &lo[r], &hi[r]);
            d[r] = MV_FP16(blk);
        }
        for (j = 0; j < M; j++) {
            q0 = MV_LOAD(Q + j * n + 32 * b);
            q1 = MV_LOAD(Q + j * n + 32 * b + 16);
            for (r = 0; r < R; r++) {
                part = MV_ADD(MV_ZERO(), MV_MUL(q0, lo[r]));   /* from +0, as the portable path */
                part = MV_ADD(part, MV_MUL(q1, hi[r]));
                acc[r * M + j] = MV_ADD(acc[r * M + j], MV_MUL(part, MV_SET1(d[r])));
            }
        }
    }
    KVQ_MQ(mq_store)(acc, out + t, ldo, NULL, R, M);
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(ggml_dot_q)(const kvq_params* p,
                                                             const uint8_t* codes, int64_t r0,
                                                             int64_t r1, const float* Q, int m,
                                                             float* out, int64_t ldo,
                                                             const int q4)
{
    int j0, mm;
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Qj = Q + j0 * p->dim;
        float* oj = out + j0 * ldo;
        mm = m - j0 < KVQ_MQ_PASS ? m - j0 : KVQ_MQ_PASS;
        switch (mm) {
#define KVQ_MQ_CALL(R, t) KVQ_MQ(ggml_dot_rows)(p, codes, t, Qj, oj, ldo, R, M_, q4)
#define KVQ_MQ_CASE(M) case M: { enum { M_ = M }; KVQ_MQ_ROW_LOOP(KVQ_MQ_ROWS(M), KVQ_MQ_CALL); } break;
        KVQ_MQ_EACH_M(KVQ_MQ_CASE)
#undef KVQ_MQ_CASE
#undef KVQ_MQ_CALL
        }
    }
}

KVQ_MQ_TARGET static void KVQ_MQ(ggml_dotm)(const kvq_params* p, const uint8_t* codes,
                                           const float* side, int64_t r0, int64_t r1,
                                           const float* Q, int m, float* out, int64_t ldo)
{
    (void)side;
    if (p->bits == 4)
        KVQ_MQ(ggml_dot_q)(p, codes, r0, r1, Q, m, out, ldo, 1);
    else
        KVQ_MQ(ggml_dot_q)(p, codes, r0, r1, Q, m, out, ldo, 0);
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(ggml_axpy_rows)(const kvq_params* p,
                                                                 const uint8_t* codes, int64_t t,
                                                                 const float* W, int64_t ldw,
                                                                 int m, float* acc, const int R,
                                                                 const int q4)
{
    const int64_t nb = p->dim / KVQ_GGML_BLOCK, cb = p->code_bytes, n = p->dim;
    const int64_t bb = q4 ? 18 : 34;
    const uint8_t* c = codes + t * cb;
    MV lo[4], hi[4], a0, a1, cf;
    float d[4];
    int64_t b;
    int r, j;
    for (b = 0; b < nb; b++) {
        for (r = 0; r < R; r++) {
            const uint8_t* blk = c + r * cb + b * bb;
            kvq_prefetch(blk + KVQ_PREFETCH_BYTES);
            MV_GGML_VALUES(blk, q4, &lo[r], &hi[r]);
            d[r] = MV_FP16(blk);
        }
        for (j = 0; j < m; j++) {
            a0 = MV_LOAD(acc + j * n + 32 * b);
            a1 = MV_LOAD(acc + j * n + 32 * b + 16);
            for (r = 0; r < R; r++) {
                cf = MV_SET1(W[j * ldw + t + r] * d[r]);
                a0 = MV_ADD(a0, MV_MUL(cf, lo[r]));
                a1 = MV_ADD(a1, MV_MUL(cf, hi[r]));
            }
            MV_STORE(acc + j * n + 32 * b, a0);
            MV_STORE(acc + j * n + 32 * b + 16, a1);
        }
    }
}

KVQ_MQ_TARGET static void KVQ_MQ(ggml_axpym)(const kvq_params* p, const uint8_t* codes,
                                            const float* side, int64_t r0, int64_t r1,
                                            const float* W, int64_t ldw, int m, float* acc)
{
    (void)side;
#define KVQ_MQ_CALL(R, t) KVQ_MQ(ggml_axpy_rows)(p, codes, t, W, ldw, m, acc, R, q4_)
    if (p->bits == 4) {
        const int q4_ = 1;
        KVQ_MQ_ROW_LOOP(4, KVQ_MQ_CALL);
    } else {
        const int q4_ = 0;
        KVQ_MQ_ROW_LOOP(4, KVQ_MQ_CALL);
    }
#undef KVQ_MQ_CALL
}

#endif /* KVQ_MQ_TQ_ONLY */

#undef KVQ_MQ_ROW_LOOP
#undef KVQ_MQ
#undef KVQ_MQ_TARGET
#undef KVQ_MQ_FALLBACK
#undef MV
#undef MV_ZERO
#undef MV_LOAD
#undef MV_STORE
#undef MV_ADD
#undef MV_MUL
#undef MV_SET1
#undef MV_TREE1
#undef MV_TREE4
#undef MV_E4M3
#undef MV_E4M3_SPECIAL
#undef MV_TQ_CONSTS
#undef MV_TQ_INIT
#undef MV_TQ_LEV16
#undef MV_GGML_VALUES
#undef MV_FP16
#undef KVQ_MQ_PASS
#undef KVQ_MQ_ROWS
#undef KVQ_MQ_EACH_M
#undef KVQ_MQ_VBMI_TQ
