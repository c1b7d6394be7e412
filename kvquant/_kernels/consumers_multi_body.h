/* The multi-query kernels over a 16-lane vector type MV, included once per instruction set by
 * consumers_multi.h (which defines KVQ_MQ, MV and the MV_* operations and decoders). No include
 * guard on purpose.
 *
 * Scores: R rows and M queries per pass (R M accumulators in registers, R and M compile-time
 * constants); each 16 codes of a row are decoded once and multiplied by the M queries' 16
 * elements, each (row, query) sum keeping simd.h's lane order. Contexts: R rows at a time; per 16
 * elements each query's accumulator is loaded once and adds the R rows in row order.
 *
 * Narrow rows (n <= KVQ_MQ_NARROW_MAX, in the builds that set KVQ_MQ_NARROW: those with 32
 * vector registers), where the few vector operations per 16 codes make every other one count:
 * - the scores of up to KVQ_MQ_NARROW_QUERIES queries a pass (tq and kv8): the queries stay in
 *   registers, each row is decoded once for all of them, each query's sums of sixteen rows are
 *   reduced together, and each row's lanes begin at their first product, +0 being added to the
 *   sums instead (kvq_sums16_from_first_avx512: the same bits, one add per 16 rows, not per row);
 * - tq's context of up to KVQ_MQ_NARROW_QUERIES queries stays in registers for the call; for one
 *   query (2 to 4 bits) each row multiplies its coefficient into the 16 levels once and the codes
 *   look their products up (the same products: one multiply a row instead of n / 16).
 * The bits of the wide kernels. Single-thread C timings at d = 64 on a Zen 4 (Zen 4 runs
 * AVX-512 on 256-bit units): one query, tq4 scores 3.57 -> 3.35 ns a row, tq4 context
 * 3.31 -> 2.63, kv8 scores 4.49 -> 4.37; three queries, tq4 context 7.17 -> 6.35 (and the wide
 * tq scores, whose lanes also begin at their first product under AVX-512: 7.46 -> 7.01). A
 * narrow kv8 context measured no faster (its per-row check for special codes stays). Several
 * queries' scores, one thread on a Zen 5 (full-width AVX-512), against the wide kernels (builds
 * alternated): tq4 at m = 3 5.1-6.8 -> 3.7-3.9 ns a row, m = 8 17-22 -> 9.7-10.1; kv8 at m = 3
 * 6.3-6.7 -> 5.0-5.2, m = 8 15-19 -> 12-14.
 */
#define KVQ_MQ_NARROW_MAX 64

#define KVQ_MQ_NARROW_QUERIES 4   /* M x NS <= 16 registers of queries or context sums */

/* CALL(NS) for the narrow row widths NS = n / 16 of 1..4 (n <= KVQ_MQ_NARROW_MAX). */
#define KVQ_MQ_NARROW_SWITCH(n, CALL)                                                         \
    switch ((n) / 16) {                                                                       \
    case 1: CALL(1); break;                                                                   \
    case 2: CALL(2); break;                                                                   \
    case 3: CALL(3); break;                                                                   \
    default: CALL(4); break;                                                                  \
    }

/* KVQ_MQ_NARROW_SWITCH(n, CALL) with the compile-time query count M_ = m of 1..4. */
#define KVQ_MQ_NARROW_EACH_M(m, n, CALL)                                                      \
    switch (m) {                                                                              \
    case 1: { enum { M_ = 1 }; KVQ_MQ_NARROW_SWITCH(n, CALL) } break;                         \
    case 2: { enum { M_ = 2 }; KVQ_MQ_NARROW_SWITCH(n, CALL) } break;                         \
    case 3: { enum { M_ = 3 }; KVQ_MQ_NARROW_SWITCH(n, CALL) } break;                         \
    default: { enum { M_ = 4 }; KVQ_MQ_NARROW_SWITCH(n, CALL) } break;                        \
    }

/* Lane sums begun at their first product instead of 0 + it, made whole by adding +0 to each
 * row's sum (kvq_sums16_from_first_avx512 says why that gives the same bits): the AVX-512 tq
 * score kernels, where it saves an add per row and query. */
#ifdef MV_SUMS16_FROM_FIRST
#define KVQ_MQ_FROM_FIRST 1
#else
#define KVQ_MQ_FROM_FIRST 0
#define MV_SUMS16_FROM_FIRST(a, dst, scale) MV_SUMS16(a, dst, scale)   /* never taken here */
#endif

/* Sums of R rows x M queries to out[j ldo + r] (times scale[r] when scale is not NULL; plus0:
 * lanes begun at their first product). */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(mq_store)(const MV* acc, float* out, int64_t ldo,
                                                           const float* scale, const int R,
                                                           const int M, const int plus0)
{
    float s4[4];
    int r, j;
    for (j = 0; j < M; j++) {
        if (R == 4)
            MV_TREE4(acc[j], acc[M + j], acc[2 * M + j], acc[3 * M + j], s4);
        else
            for (r = 0; r < R; r++) s4[r] = MV_TREE1(acc[r * M + j]);
        if (plus0)
            for (r = 0; r < R; r++) s4[r] = s4[r] + 0.0f;
        for (r = 0; r < R; r++) out[j * ldo + r] = scale ? s4[r] * scale[r] : s4[r];
    }
}

/* The score kernels take rows in blocks of KVQ_MQ_BLOCK: each pass of R rows parks its lane sums
 * in blk (query j, row k of the block at blk[KVQ_MQ_BLOCK j + k]) and the block's sums are reduced
 * sixteen rows at a time (MV_SUMS16: the same adds as one row's tree, fewer shuffles), then scaled
 * by a vector multiply. Rows after the last whole block go through mq_store. */
#define KVQ_MQ_BLOCK 16

/* acc of R rows x M queries (a pass at row k of the block) into blk, or straight to out. */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(mq_put)(const MV* acc, MV* blk, int k,
                                                         float* out, int64_t ldo,
                                                         const float* scale, const int R,
                                                         const int M, const int plus0)
{
    int r, j;
    if (!blk) {
        KVQ_MQ(mq_store)(acc, out, ldo, scale, R, M, plus0);
        return;
    }
    for (j = 0; j < M; j++)
        for (r = 0; r < R; r++) blk[KVQ_MQ_BLOCK * j + k + r] = acc[r * M + j];
}

/* A block's sums of M queries to out[j ldo + k], times scale[k] when scale is not NULL. */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(mq_sums)(const MV* blk, float* out,
                                                          int64_t ldo, const float* scale,
                                                          const int M, const int plus0)
{
    int j;
    for (j = 0; j < M; j++) {
        if (plus0) MV_SUMS16_FROM_FIRST(blk + KVQ_MQ_BLOCK * j, out + j * ldo, scale);
        else MV_SUMS16(blk + KVQ_MQ_BLOCK * j, out + j * ldo, scale);
    }
}

/* Rows per pass of the f32 and ggml context kernels (whose rows' values stay in registers). */
#ifndef KVQ_MQ_AXPY_ROWS
#define KVQ_MQ_AXPY_ROWS 4
#endif

/* Runs ROWS(R, t) over rows [r0, r1): R at a time, then one at a time. */
#define KVQ_MQ_ROW_LOOP(R, CALL)                                                              \
    do {                                                                                      \
        int64_t t = r0;                                                                       \
        for (; t + (R) <= r1; t += (R)) CALL(R, t);                                           \
        for (; t < r1; t++) CALL(1, t);                                                       \
    } while (0)

/* The context kernels' row loop: when `blocks`, whole blocks of KVQ_MQ_BLOCK rows with their
 * coefficients computed sixteen at a time by PREP(t0), passes CALL(R, t, k) at row k of the
 * block; the rest (every row when not `blocks`) CALL(R, t, -1), coefficients computed per pass. */
#define KVQ_MQ_CTX_LOOP(R, CALL, PREP, blocks)                                                \
    do {                                                                                      \
        int64_t t = r0, t0;                                                                   \
        int k_;                                                                               \
        for (; (blocks) && t + KVQ_MQ_BLOCK <= r1; t += KVQ_MQ_BLOCK) {                       \
            t0 = t;                                                                           \
            PREP(t0);                                                                         \
            for (k_ = 0; k_ < KVQ_MQ_BLOCK; k_ += (R)) CALL(R, t0 + k_, k_);                 \
        }                                                                                     \
        for (; t + (R) <= r1; t += (R)) CALL(R, t, -1);                                      \
        for (; t < r1; t++) CALL(1, t, -1);                                                   \
    } while (0)

/* The score kernels' row loop: whole blocks through blk (CALL(R, t, blk, k) for the passes,
 * then FINISH(t0) with the block's first row), then the rest as KVQ_MQ_ROW_LOOP (blk NULL). */
#define KVQ_MQ_BLOCK_LOOP(R, CALL, FINISH)                                                    \
    do {                                                                                      \
        int64_t t = r0, t0;                                                                   \
        int k_;                                                                               \
        for (; t + KVQ_MQ_BLOCK <= r1; t += KVQ_MQ_BLOCK) {                                   \
            t0 = t;                                                                           \
            for (k_ = 0; k_ < KVQ_MQ_BLOCK; k_ += (R)) CALL(R, t0 + k_, blk_, k_);           \
            FINISH(t0);                                                                       \
        }                                                                                     \
        for (; t + (R) <= r1; t += (R)) CALL(R, t, (MV*)NULL, 0);                            \
        for (; t < r1; t++) CALL(1, t, (MV*)NULL, 0);                                         \
    } while (0)

#ifndef KVQ_MQ_TQ_ONLY
/* ---- f32 --------------------------------------------------------------------------------- */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(f32_dot_rows)(const kvq_params* p,
                                                               const uint8_t* codes, int64_t t,
                                                               const float* Q, float* out,
                                                               int64_t ldo, MV* blk, int k,
                                                               const int R, const int M)
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
    KVQ_MQ(mq_put)(acc, blk, k, out + t, ldo, NULL, R, M, 0);
}

KVQ_MQ_TARGET static void KVQ_MQ(f32_dotm)(const kvq_params* p, const uint8_t* codes,
                                          const float* side, int64_t r0, int64_t r1,
                                          const float* Q, int m, float* out, int64_t ldo)
{
    MV blk_[KVQ_MQ_PASS * KVQ_MQ_BLOCK];
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
#define KVQ_MQ_CALL(R, t, blk, k) KVQ_MQ(f32_dot_rows)(p, codes, t, Qj, oj, ldo, blk, k, R, M_)
#define KVQ_MQ_FINISH(t) KVQ_MQ(mq_sums)(blk_, oj + (t), ldo, NULL, M_, 0)
#define KVQ_MQ_CASE(M) case M: { enum { M_ = M };                                             \
            KVQ_MQ_BLOCK_LOOP(KVQ_MQ_ROWS(M), KVQ_MQ_CALL, KVQ_MQ_FINISH); } break;
        KVQ_MQ_EACH_M(KVQ_MQ_CASE)
#undef KVQ_MQ_CASE
#undef KVQ_MQ_FINISH
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
        KVQ_MQ_ROW_LOOP(KVQ_MQ_AXPY_ROWS, KVQ_MQ_CALL);
    } else {
        const int M_ = 0;
        KVQ_MQ_ROW_LOOP(KVQ_MQ_AXPY_ROWS, KVQ_MQ_CALL);
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
                                                               float* out, int64_t ldo, MV* blk,
                                                               int k, const int R, const int M,
                                                               const int grouped)
{
    /* grouped: a constant, G != n (scales per group of G, a multiple of 16, inside the sums) */
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, G = p->group;
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
    KVQ_MQ(mq_put)(acc, blk, k, out + t, ldo, grouped ? NULL : scale, R, M, 0);
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(kv8_dot_layout)(const kvq_params* p,
                                                                  const uint8_t* codes,
                                                                  const float* side, int64_t r0,
                                                                  int64_t r1, const float* Q,
                                                                  int m, float* out, int64_t ldo,
                                                                  const int grouped)
{
    /* per-row scales (n_side is then 1) multiply a block's sums; group scales are inside them */
    const int64_t n = p->dim;
    float qraw[KVQ_MQ_FOLD_FLOATS];
    MV blk_[KVQ_MQ_PASS * KVQ_MQ_BLOCK];
    int j0, mm;
    int64_t i;
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
#define KVQ_MQ_CALL(R, t, blk, k)                                                            \
            KVQ_MQ(kv8_dot_rows)(p, codes, side, t, Qj, Qr, oj, ldo, blk, k, R, M_, grouped)
#define KVQ_MQ_FINISH(t) KVQ_MQ(mq_sums)(blk_, oj + (t), ldo, grouped ? NULL : side + (t), M_, 0)
#define KVQ_MQ_CASE(M) case M: { enum { M_ = M };                                             \
            KVQ_MQ_BLOCK_LOOP(KVQ_MQ_ROWS(M), KVQ_MQ_CALL, KVQ_MQ_FINISH); } break;
        KVQ_MQ_EACH_M(KVQ_MQ_CASE)
#undef KVQ_MQ_CASE
#undef KVQ_MQ_FINISH
#undef KVQ_MQ_CALL
        }
    }
}

#if KVQ_MQ_NARROW
/* Scores of one query over narrow kv8 rows of NS = n / 16 vectors with one scale per row: the
 * query (and its 2^120 fold when RAW) stays in registers, sixteen rows are checked for special
 * codes before any is summed (one branch: a branch per row cost ~15%) and their sums are reduced
 * together. A block holding special codes is summed row by row. The sums of kv8_dot_rows. */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(kv8_dot_narrow)(const kvq_params* p,
                                                                 const uint8_t* codes,
                                                                 const float* side, int64_t r0,
                                                                 int64_t r1, const float* q,
                                                                 const float* qraw, float* out,
                                                                 const int NS, const int RAW)
{
    const int64_t cb = p->code_bytes, ns = p->n_side;
    MV qv[KVQ_MQ_NARROW_MAX / 16], qf[KVQ_MQ_NARROW_MAX / 16], acc[KVQ_MQ_BLOCK], a;
    const uint8_t* c;
    int64_t t;
    int s, k, special;
    for (s = 0; s < NS; s++) {
        qv[s] = MV_LOAD(q + 16 * s);
        qf[s] = RAW ? MV_LOAD(qraw + 16 * s) : qv[s];
    }
#define KVQ_MQ_KV8_NARROW_PLAIN(T)                                                            \
    c = codes + (T) * cb;                                                                     \
    if (RAW) {                                                                                \
        a = MV_MUL(qf[0], MV_E4M3(c, KVQ_E4M3_RAW));   /* lanes from their first product */   \
        for (s = 1; s < NS; s++) a = MV_ADD(a, MV_MUL(qf[s], MV_E4M3(c + 16 * s, KVQ_E4M3_RAW))); \
    } else {                                                                                  \
        a = MV_MUL(qv[0], MV_E4M3(c, KVQ_E4M3_PLAIN));                                        \
        for (s = 1; s < NS; s++) a = MV_ADD(a, MV_MUL(qv[s], MV_E4M3(c + 16 * s, KVQ_E4M3_PLAIN))); \
    }
#define KVQ_MQ_KV8_NARROW_SUM(T)                                                              \
    if (MV_E4M3_SPECIAL(codes + (T) * cb, 16 * NS)) {                                         \
        c = codes + (T) * cb;                                                                 \
        a = MV_MUL(qv[0], MV_E4M3(c, KVQ_E4M3_ANY));                                          \
        for (s = 1; s < NS; s++) a = MV_ADD(a, MV_MUL(qv[s], MV_E4M3(c + 16 * s, KVQ_E4M3_ANY))); \
    } else {                                                                                  \
        KVQ_MQ_KV8_NARROW_PLAIN(T)                                                            \
    }
    for (t = r0; t + KVQ_MQ_BLOCK <= r1; t += KVQ_MQ_BLOCK) {
        for (k = 0; k < KVQ_MQ_BLOCK; k++) kvq_prefetch(codes + (t + k) * cb + KVQ_PREFETCH_BYTES);
        special = 0;
        for (k = 0; k < KVQ_MQ_BLOCK; k++)
            special |= MV_E4M3_SPECIAL(codes + (t + k) * cb, 16 * NS);
        if (special)
            for (k = 0; k < KVQ_MQ_BLOCK; k++) { KVQ_MQ_KV8_NARROW_SUM(t + k) acc[k] = a; }
        else
            for (k = 0; k < KVQ_MQ_BLOCK; k++) { KVQ_MQ_KV8_NARROW_PLAIN(t + k) acc[k] = a; }
        MV_SUMS16_FROM_FIRST(acc, out + t, side + t);   /* one scale per row: n_side is 1 */
    }
    for (; t < r1; t++) {
        KVQ_MQ_KV8_NARROW_SUM(t)
        out[t] = (MV_TREE1(a) + 0.0f) * side[t * ns];
    }
#undef KVQ_MQ_KV8_NARROW_SUM
#undef KVQ_MQ_KV8_NARROW_PLAIN
}
#endif

#if KVQ_MQ_NARROW
/* Scores of M = 2..4 queries over narrow kv8 rows of NS = n / 16 vectors with one scale per
 * row (M NS <= 16): the queries (their 2^120 folds when RAW) stay in registers, each row is decoded
 * once for the M queries, sixteen rows are checked for special codes before any is summed (one
 * branch: a branch per row cost ~15%) and each query's sums of the sixteen are reduced together.
 * A block holding special codes is summed row by row, the queries then read from memory. The
 * sums of kv8_dot_rows. Apart from the one-query kernel on purpose: one body for both measured
 * ~7% slower for one query (Zen 5). */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(kv8_dot_narrow_m)(const kvq_params* p,
                                                                   const uint8_t* codes,
                                                                   const float* side, int64_t r0,
                                                                   int64_t r1, const float* Q,
                                                                   const float* Qraw, float* out,
                                                                   int64_t ldo, const int NS,
                                                                   const int M, const int RAW)
{
    const int64_t cb = p->code_bytes, ns = p->n_side, n = p->dim;
    const float* Qf = RAW ? Qraw : Q;
    MV qf[KVQ_MQ_NARROW_QUERIES * KVQ_MQ_NARROW_MAX / 16], v[KVQ_MQ_NARROW_MAX / 16], a;
    MV acc[KVQ_MQ_NARROW_QUERIES * KVQ_MQ_BLOCK];
    const uint8_t* c;
    int64_t t;
    int s, k, j, special;
    for (j = 0; j < M; j++)
        for (s = 0; s < NS; s++) qf[j * NS + s] = MV_LOAD(Qf + j * n + 16 * s);
    /* each query's sum from its first product: PUT stores it */
#define KVQ_MQ_KV8_NARROW_DOTS(QV, PUT)                                                       \
    for (j = 0; j < M; j++) {                                                                 \
        a = MV_MUL(QV(0), v[0]);                                                              \
        for (s = 1; s < NS; s++) a = MV_ADD(a, MV_MUL(QV(s), v[s]));                          \
        PUT;                                                                                  \
    }
#define KVQ_MQ_QF(s_) qf[j * NS + (s_)]
#define KVQ_MQ_QMEM(s_) MV_LOAD(Q + j * n + 16 * (s_))
#define KVQ_MQ_KV8_NARROW_PLAIN(T, PUT)                                                       \
    c = codes + (T) * cb;                                                                     \
    if (RAW) { for (s = 0; s < NS; s++) v[s] = MV_E4M3(c + 16 * s, KVQ_E4M3_RAW); }           \
    else { for (s = 0; s < NS; s++) v[s] = MV_E4M3(c + 16 * s, KVQ_E4M3_PLAIN); }             \
    KVQ_MQ_KV8_NARROW_DOTS(KVQ_MQ_QF, PUT)
#define KVQ_MQ_KV8_NARROW_SUM(T, PUT)                                                         \
    if (MV_E4M3_SPECIAL(codes + (T) * cb, 16 * NS)) {                                         \
        c = codes + (T) * cb;                                                                 \
        for (s = 0; s < NS; s++) v[s] = MV_E4M3(c + 16 * s, KVQ_E4M3_ANY);                    \
        KVQ_MQ_KV8_NARROW_DOTS(KVQ_MQ_QMEM, PUT)                                              \
    } else {                                                                                  \
        KVQ_MQ_KV8_NARROW_PLAIN(T, PUT)                                                       \
    }
    for (t = r0; t + KVQ_MQ_BLOCK <= r1; t += KVQ_MQ_BLOCK) {
        for (k = 0; k < KVQ_MQ_BLOCK; k++) kvq_prefetch(codes + (t + k) * cb + KVQ_PREFETCH_BYTES);
        special = 0;
        for (k = 0; k < KVQ_MQ_BLOCK; k++)
            special |= MV_E4M3_SPECIAL(codes + (t + k) * cb, 16 * NS);
        if (special)
            for (k = 0; k < KVQ_MQ_BLOCK; k++) {
                KVQ_MQ_KV8_NARROW_SUM(t + k, acc[j * KVQ_MQ_BLOCK + k] = a)
            }
        else
            for (k = 0; k < KVQ_MQ_BLOCK; k++) {
                KVQ_MQ_KV8_NARROW_PLAIN(t + k, acc[j * KVQ_MQ_BLOCK + k] = a)
            }
        for (j = 0; j < M; j++)   /* one scale per row: n_side is 1 */
            MV_SUMS16_FROM_FIRST(acc + j * KVQ_MQ_BLOCK, out + j * ldo + t, side + t);
    }
    for (; t < r1; t++) {
        KVQ_MQ_KV8_NARROW_SUM(t, out[j * ldo + t] = (MV_TREE1(a) + 0.0f) * side[t * ns])
    }
#undef KVQ_MQ_KV8_NARROW_SUM
#undef KVQ_MQ_KV8_NARROW_PLAIN
#undef KVQ_MQ_QMEM
#undef KVQ_MQ_QF
#undef KVQ_MQ_KV8_NARROW_DOTS
}
#endif

#if KVQ_MQ_NARROW
/* Scores of m > 1 queries over narrow kv8 rows with one scale per row, KVQ_MQ_NARROW_QUERIES a
 * pass at most (a last pass of one query takes the one-query kernel); a function of its own, as
 * tq_dotm_narrow. */
KVQ_MQ_TARGET static void KVQ_MQ(kv8_dotm_narrow)(const kvq_params* p, const uint8_t* codes,
                                                const float* side, int64_t r0, int64_t r1,
                                                const float* Q, int m, float* out, int64_t ldo)
{
    float qraw[KVQ_MQ_NARROW_QUERIES * KVQ_MQ_NARROW_MAX];
    const float* Qj;
    int64_t i;
    int j0, mm, raw;
    for (j0 = 0; j0 < m; j0 += mm) {
        mm = m - j0 < KVQ_MQ_NARROW_QUERIES ? m - j0 : KVQ_MQ_NARROW_QUERIES;
        Qj = Q + j0 * p->dim;
        raw = kvq_mq_foldable(Qj, mm * p->dim);
        if (raw)
            for (i = 0; i < mm * p->dim; i++) qraw[i] = Qj[i] * 0x1p120f;   /* exact */
#define KVQ_MQ_CALL(NS)                                                                       \
        if (M_ == 1 && raw)                                                                   \
            KVQ_MQ(kv8_dot_narrow)(p, codes, side, r0, r1, Qj, qraw, out + j0 * ldo, NS, 1);  \
        else if (M_ == 1)                                                                     \
            KVQ_MQ(kv8_dot_narrow)(p, codes, side, r0, r1, Qj, NULL, out + j0 * ldo, NS, 0);  \
        else if (raw)                                                                         \
            KVQ_MQ(kv8_dot_narrow_m)(p, codes, side, r0, r1, Qj, qraw, out + j0 * ldo, ldo,   \
                                     NS, M_, 1);                                              \
        else                                                                                  \
            KVQ_MQ(kv8_dot_narrow_m)(p, codes, side, r0, r1, Qj, NULL, out + j0 * ldo, ldo,   \
                                     NS, M_, 0)
        KVQ_MQ_NARROW_EACH_M(mm, p->dim, KVQ_MQ_CALL)
#undef KVQ_MQ_CALL
    }
}
#endif

KVQ_MQ_TARGET static void KVQ_MQ(kv8_dotm)(const kvq_params* p, const uint8_t* codes,
                                          const float* side, int64_t r0, int64_t r1,
                                          const float* Q, int m, float* out, int64_t ldo)
{
    if (!kvq_mq_kv8_layout_ok(p)) {
        KVQ_MQ_FALLBACK(kv8_dotm)(p, codes, side, r0, r1, Q, m, out, ldo);
        return;
    }
#if KVQ_MQ_NARROW
    if (m > 1 && p->dim <= KVQ_MQ_NARROW_MAX && p->group == p->dim) {
        KVQ_MQ(kv8_dotm_narrow)(p, codes, side, r0, r1, Q, m, out, ldo);
        return;
    }
    if (m == 1 && p->dim <= KVQ_MQ_NARROW_MAX && p->group == p->dim) {
        float qraw[KVQ_MQ_NARROW_MAX];
        int64_t i;
        const int raw = kvq_mq_foldable(Q, p->dim);
        if (raw)
            for (i = 0; i < p->dim; i++) qraw[i] = Q[i] * 0x1p120f;   /* exact */
#define KVQ_MQ_CALL(NS)                                                                       \
        if (raw) KVQ_MQ(kv8_dot_narrow)(p, codes, side, r0, r1, Q, qraw, out, NS, 1);        \
        else KVQ_MQ(kv8_dot_narrow)(p, codes, side, r0, r1, Q, NULL, out, NS, 0)
        KVQ_MQ_NARROW_SWITCH(p->dim, KVQ_MQ_CALL)
#undef KVQ_MQ_CALL
        return;
    }
#endif
    if (p->group == p->dim)
        KVQ_MQ(kv8_dot_layout)(p, codes, side, r0, r1, Q, m, out, ldo, 0);
    else
        KVQ_MQ(kv8_dot_layout)(p, codes, side, r0, r1, Q, m, out, ldo, 1);
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(kv8_axpy_rows)(const kvq_params* p,
                                                                const uint8_t* codes,
                                                                const float* side, int64_t t,
                                                                const float* W, int64_t ldw,
                                                                int m_, float* acc,
                                                                const float* cfb,
                                                                const float* cfrb, int foldb,
                                                                const int R, const int M)
{
    /* cfb, cfrb: the coefficients of a block of per-row scales (kv8_ctx_block) for query j and
     * row r at [KVQ_MQ_BLOCK j + r], and foldb whether they all allow the raw decode; NULL: the
     * coefficients are computed here */
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, G = p->group;
    const int64_t steps_per_group = G / 16;
    const int m = M ? M : m_;   /* M: a compile-time query count (0: m_ at run time) */
    const uint8_t* c = codes + t * cb;
    const float* s = side + t * ns;
    float cf[4 * KVQ_MQ_MAX], cfr[4 * KVQ_MQ_MAX];
    MV a, v[4];
    int64_t i0, i, g, left;
    int r, j, special, fold = 1;
    if (cfb) {
        fold = foldb;
    } else {
        /* the raw decode when every coefficient of these rows is below 2^7 */
        for (g = 0; g < ns && fold; g++)
            fold = kvq_mq_kv8_coefs(W, ldw, t, m, s, ns, g, R, cf, cfr);
        kvq_mq_kv8_coefs(W, ldw, t, m, s, ns, 0, R, cf, cfr);
    }
    g = 0;
    left = steps_per_group;
#define KVQ_MQ_KV8_STEP(HOW, CF, CFB)                                                        \
    for (r = 0; r < R; r++) v[r] = MV_E4M3(c + r * cb + i, HOW);                             \
    for (j = 0; j < m; j++) {                                                                \
        a = MV_LOAD(acc + j * n + i);                                                        \
        for (r = 0; r < R; r++)                                                              \
            a = MV_ADD(a, MV_MUL(MV_SET1(cfb ? CFB[KVQ_MQ_BLOCK * j + r] : CF[r * m + j]),   \
                                 v[r]));                                                     \
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
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_ANY, cf, cfb) }
        else if (fold)
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_RAW, cfr, cfrb) }
        else
            for (i = i0; i < i1; i += 16) { KVQ_MQ_KV8_STEP(KVQ_E4M3_PLAIN, cf, cfb) }
    }
#undef KVQ_MQ_KV8_STEP
}

/* The coefficients w_jt s_t of rows [t, t + KVQ_MQ_BLOCK) and m queries (per-row scales, one
 * per row) into cf[KVQ_MQ_BLOCK j + r], cfr = cf 2^120 (exact); returns whether every |cf| < 2^7
 * (the raw decode applies). The products of kvq_mq_kv8_coefs, sixteen at a time. */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE int KVQ_MQ(kv8_ctx_block)(const float* W, int64_t ldw,
                                                               int64_t t, int m,
                                                               const float* side, float* cf,
                                                               float* cfr)
{
    const MV s = MV_LOAD(side + t);
    int j, r, fold = 1;
    for (j = 0; j < m; j++) {
        const MV c = MV_MUL(MV_LOAD(W + j * ldw + t), s);
        MV_STORE(cf + KVQ_MQ_BLOCK * j, c);
        MV_STORE(cfr + KVQ_MQ_BLOCK * j, MV_MUL(c, MV_SET1(0x1p120f)));
    }
    for (r = 0; r < KVQ_MQ_BLOCK * m; r++) fold &= fabsf(cf[r]) < 128.0f;
    return fold;
}

KVQ_MQ_TARGET static void KVQ_MQ(kv8_axpym)(const kvq_params* p, const uint8_t* codes,
                                           const float* side, int64_t r0, int64_t r1,
                                           const float* W, int64_t ldw, int m, float* acc)
{
    float cfb_[KVQ_MQ_MAX * KVQ_MQ_BLOCK], cfrb_[KVQ_MQ_MAX * KVQ_MQ_BLOCK];
    int j0, mm, fold_ = 0;
    if (!kvq_mq_kv8_layout_ok(p)) {
        KVQ_MQ_FALLBACK(kv8_axpym)(p, codes, side, r0, r1, W, ldw, m, acc);
        return;
    }
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Wj = W + j0 * ldw;
        float* aj = acc + j0 * p->dim;
        mm = m - j0 < KVQ_MQ_MAX ? m - j0 : KVQ_MQ_MAX;
#define KVQ_MQ_CALL(R, t, k)                                                                 \
        KVQ_MQ(kv8_axpy_rows)(p, codes, side, t, Wj, ldw, mm, aj, (k) < 0 ? NULL : cfb_ + (k), \
                              cfrb_ + ((k) < 0 ? 0 : (k)), fold_, R, M_)
#define KVQ_MQ_PREP(t) fold_ = KVQ_MQ(kv8_ctx_block)(Wj, ldw, t, mm, side, cfb_, cfrb_)
        if (p->group != p->dim) {   /* group scales: the coefficients change along the row */
            const int M_ = 0;
            KVQ_MQ_CTX_LOOP(KVQ_MQ_CTX_ROWS, KVQ_MQ_CALL, KVQ_MQ_PREP, 0);
        } else if (mm == 1) {
            const int M_ = 1;
            KVQ_MQ_CTX_LOOP(KVQ_MQ_CTX_ROWS, KVQ_MQ_CALL, KVQ_MQ_PREP, 1);
        } else {
            const int M_ = 0;
            KVQ_MQ_CTX_LOOP(KVQ_MQ_CTX_ROWS, KVQ_MQ_CALL, KVQ_MQ_PREP, 1);
        }
#undef KVQ_MQ_PREP
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
                                                              int64_t ldo, MV* blk, int k,
                                                              const int R, const int M,
                                                              const int b, const int wide)
{
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, gb = 2 * b;
    const uint8_t* c = codes + t * cb;
    MV acc[8], v[4], qv;
    float step[4];
    int64_t i, off;
    int r, j;
    if (KVQ_MQ_FROM_FIRST) {   /* the lanes begin at their first product */
        for (r = 0; r < R; r++) v[r] = MV_TQ_LEV16(c + r * cb, K, b, wide);
        for (j = 0; j < M; j++) {
            qv = MV_LOAD(Q + j * n);
            for (r = 0; r < R; r++) acc[r * M + j] = MV_MUL(qv, v[r]);
        }
    } else {
        for (r = 0; r < R * M; r++) acc[r] = MV_ZERO();
    }
    for (i = KVQ_MQ_FROM_FIRST ? 16 : 0, off = i / 16 * gb; i < n; i += 16, off += gb) {
        kvq_prefetch(c + KVQ_PREFETCH_BYTES + R * off);
        for (r = 0; r < R; r++) v[r] = MV_TQ_LEV16(c + r * cb + off, K, b, wide);
        for (j = 0; j < M; j++) {
            qv = MV_LOAD(Q + j * n + i);
            for (r = 0; r < R; r++) acc[r * M + j] = MV_ADD(acc[r * M + j], MV_MUL(qv, v[r]));
        }
    }
    if (!blk)
        for (r = 0; r < R; r++) step[r] = kvq_tq_step(side[(t + r) * ns], p->sqrtf_n);
    KVQ_MQ(mq_put)(acc, blk, k, out + t, ldo, step, R, M, KVQ_MQ_FROM_FIRST);
}

#if KVQ_MQ_NARROW
/* Scores of one query over rows of NS = n / 16 vectors (narrow rows). */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_dot_narrow)(const kvq_params* p,
                                                                const uint8_t* codes,
                                                                const float* side, int64_t r0,
                                                                int64_t r1, const float* q,
                                                                float* out,
                                                                const MV_TQ_CONSTS* K,
                                                                const int b, const int NS)
{
    const int64_t cb = p->code_bytes, gb = 2 * b;
    const int64_t wide_end = p->n_rows - (16 + p->code_bytes - 1) / p->code_bytes;
    float step[KVQ_MQ_BLOCK];
    MV qv[KVQ_MQ_NARROW_MAX / 16], acc[KVQ_MQ_BLOCK], a;
    int64_t t;
    int s, k;
    for (s = 0; s < NS; s++) qv[s] = MV_LOAD(q + 16 * s);
#define KVQ_MQ_NARROW_SUM(T, WIDE)                                                            \
    a = MV_MUL(qv[0], MV_TQ_LEV16(codes + (T) * cb, K, b, WIDE));   /* lanes from their first */ \
    for (s = 1; s < NS; s++)                                                                  \
        a = MV_ADD(a, MV_MUL(qv[s], MV_TQ_LEV16(codes + (T) * cb + s * gb, K, b, WIDE)));
    for (t = r0; t + KVQ_MQ_BLOCK <= r1 && t + KVQ_MQ_BLOCK <= wide_end; t += KVQ_MQ_BLOCK) {
        kvq_prefetch(codes + t * cb + KVQ_PREFETCH_BYTES);
        for (k = 0; k < KVQ_MQ_BLOCK; k++) {
            KVQ_MQ_NARROW_SUM(t + k, 1)
            acc[k] = a;
        }
        MV_TQ_STEPS16(side + t * p->n_side, p->n_side, p->sqrtf_n, step);
        MV_SUMS16_FROM_FIRST(acc, out + t, step);
    }
    for (; t < r1; t++) {
        if (t < wide_end) { KVQ_MQ_NARROW_SUM(t, 1) }
        else { KVQ_MQ_NARROW_SUM(t, 0) }
        out[t] = (MV_TREE1(a) + 0.0f) * kvq_tq_step(side[t * p->n_side], p->sqrtf_n);
    }
#undef KVQ_MQ_NARROW_SUM
}

/* Scores of M = 2..4 queries over rows of NS = n / 16 vectors (narrow rows; M NS <= 16): the
 * queries stay in registers, each row's codes are looked up once for the M queries, and each
 * query's sums of a block of sixteen rows, parked in acc, are reduced together. Apart from the
 * one-query kernel on purpose, as kv8_dot_narrow_m. */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_dot_narrow_m)(const kvq_params* p,
                                                                    const uint8_t* codes,
                                                                    const float* side, int64_t r0,
                                                                    int64_t r1, const float* Q,
                                                                    float* out, int64_t ldo,
                                                                    const MV_TQ_CONSTS* K,
                                                                    const int b, const int NS,
                                                                    const int M)
{
    const int64_t cb = p->code_bytes, gb = 2 * b, n = p->dim;
    const int64_t wide_end = p->n_rows - (16 + p->code_bytes - 1) / p->code_bytes;
    float step[KVQ_MQ_BLOCK];
    MV qv[KVQ_MQ_NARROW_QUERIES * KVQ_MQ_NARROW_MAX / 16], v[KVQ_MQ_NARROW_MAX / 16], a;
    MV acc[KVQ_MQ_NARROW_QUERIES * KVQ_MQ_BLOCK];
    int64_t t;
    int s, k, j;
    for (j = 0; j < M; j++)
        for (s = 0; s < NS; s++) qv[j * NS + s] = MV_LOAD(Q + j * n + 16 * s);
#define KVQ_MQ_NARROW_SUM(T, WIDE, PUT)                                                       \
    for (s = 0; s < NS; s++) v[s] = MV_TQ_LEV16(codes + (T) * cb + s * gb, K, b, WIDE);      \
    for (j = 0; j < M; j++) {                                                                 \
        a = MV_MUL(qv[j * NS], v[0]);   /* lanes from their first product */                 \
        for (s = 1; s < NS; s++) a = MV_ADD(a, MV_MUL(qv[j * NS + s], v[s]));                 \
        PUT;                                                                                  \
    }
    for (t = r0; t + KVQ_MQ_BLOCK <= r1 && t + KVQ_MQ_BLOCK <= wide_end; t += KVQ_MQ_BLOCK) {
        kvq_prefetch(codes + t * cb + KVQ_PREFETCH_BYTES);
        for (k = 0; k < KVQ_MQ_BLOCK; k++) {
            KVQ_MQ_NARROW_SUM(t + k, 1, acc[j * KVQ_MQ_BLOCK + k] = a)
        }
        MV_TQ_STEPS16(side + t * p->n_side, p->n_side, p->sqrtf_n, step);
        for (j = 0; j < M; j++)
            MV_SUMS16_FROM_FIRST(acc + j * KVQ_MQ_BLOCK, out + j * ldo + t, step);
    }
    for (; t < r1; t++) {
        const float st = kvq_tq_step(side[t * p->n_side], p->sqrtf_n);
        if (t < wide_end) { KVQ_MQ_NARROW_SUM(t, 1, out[j * ldo + t] = (MV_TREE1(a) + 0.0f) * st) }
        else { KVQ_MQ_NARROW_SUM(t, 0, out[j * ldo + t] = (MV_TREE1(a) + 0.0f) * st) }
    }
#undef KVQ_MQ_NARROW_SUM
}

/* Context of M queries over rows of NS = n / 16 vectors (narrow rows; M NS <= 16). */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_axpy_narrow)(const kvq_params* p,
                                                                 const uint8_t* codes,
                                                                 const float* side, int64_t r0,
                                                                 int64_t r1, const float* W,
                                                                 int64_t ldw, float* acc,
                                                                 const MV_TQ_CONSTS* K,
                                                                 const int b, const int NS,
                                                                 const int M)
{
    const int64_t cb = p->code_bytes, gb = 2 * b, n = p->dim;
    const int64_t wide_end = p->n_rows - (16 + p->code_bytes - 1) / p->code_bytes;
    float cf[4][KVQ_MQ_BLOCK], step[KVQ_MQ_BLOCK];
    MV a[16], v[KVQ_MQ_NARROW_MAX / 16], cv;
    int64_t t;
    int s, k, j;
    for (j = 0; j < M; j++)
        for (s = 0; s < NS; s++) a[j * NS + s] = MV_LOAD(acc + j * n + 16 * s);
#define KVQ_MQ_NARROW_ADD(T, CFJ, WIDE)                                                       \
    if (M == 1 && b >= 2 && b <= 4) {                                                         \
        /* one query: the row's coefficient times the levels once, then each element looks its \
         * product up (the product it would compute; one multiply a row instead of NS) */     \
        j = 0;                                                                                \
        cv = MV_MUL(MV_SET1(CFJ), MV_TQ_LEVELS(K));                                           \
        for (s = 0; s < NS; s++)                                                              \
            a[s] = MV_ADD(a[s], MV_LOOKUP16(MV_TQ_CODES16(codes + (T) * cb + s * gb, K, b, WIDE), cv)); \
    } else {                                                                                  \
        for (s = 0; s < NS; s++) v[s] = MV_TQ_LEV16(codes + (T) * cb + s * gb, K, b, WIDE);  \
        for (j = 0; j < M; j++) {                                                             \
            cv = MV_SET1(CFJ);                                                                \
            for (s = 0; s < NS; s++) a[j * NS + s] = MV_ADD(a[j * NS + s], MV_MUL(cv, v[s])); \
        }                                                                                     \
    }
    for (t = r0; t + KVQ_MQ_BLOCK <= r1 && t + KVQ_MQ_BLOCK <= wide_end; t += KVQ_MQ_BLOCK) {
        /* the coefficients w_jt step_t, sixteen at a time */
        MV_TQ_STEPS16(side + t * p->n_side, p->n_side, p->sqrtf_n, step);
        for (j = 0; j < M; j++) MV_STORE(cf[j], MV_MUL(MV_LOAD(W + j * ldw + t), MV_LOAD(step)));
        kvq_prefetch(codes + t * cb + KVQ_PREFETCH_BYTES);
        for (k = 0; k < KVQ_MQ_BLOCK; k++) { KVQ_MQ_NARROW_ADD(t + k, cf[j][k], 1) }
    }
    for (; t < r1; t++) {
        const float st = kvq_tq_step(side[t * p->n_side], p->sqrtf_n);
        if (t < wide_end) { KVQ_MQ_NARROW_ADD(t, W[j * ldw + t] * st, 1) }
        else { KVQ_MQ_NARROW_ADD(t, W[j * ldw + t] * st, 0) }
    }
#undef KVQ_MQ_NARROW_ADD
    for (j = 0; j < M; j++)
        for (s = 0; s < NS; s++) MV_STORE(acc + j * n + 16 * s, a[j * NS + s]);
}
#endif

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_dot_bits)(const kvq_params* p,
                                                              const uint8_t* codes,
                                                              const float* side, int64_t r0,
                                                              int64_t r1, const float* Q, int m,
                                                              float* out, int64_t ldo, const int b)
{
    /* rows before wide_end may read 16 bytes from any of their groups */
    const int64_t wide_end = p->n_rows - (16 + p->code_bytes - 1) / p->code_bytes;
    MV_TQ_CONSTS K;
    MV blk_[KVQ_MQ_PASS * KVQ_MQ_BLOCK];
    float step_[KVQ_MQ_BLOCK];
    int j0, mm;
    MV_TQ_INIT(&K, p->table, b);
#if KVQ_MQ_NARROW
    if (m == 1 && p->dim <= KVQ_MQ_NARROW_MAX) {
#define KVQ_MQ_CALL(NS) KVQ_MQ(tq_dot_narrow)(p, codes, side, r0, r1, Q, out, &K, b, NS)
        KVQ_MQ_NARROW_SWITCH(p->dim, KVQ_MQ_CALL)
#undef KVQ_MQ_CALL
        return;
    }
#endif
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Qj = Q + j0 * p->dim;
        float* oj = out + j0 * ldo;
        mm = m - j0 < KVQ_MQ_PASS ? m - j0 : KVQ_MQ_PASS;
        switch (mm) {
#define KVQ_MQ_CALL(R, t, blk, k)                                                            \
            if ((t) + (R) <= wide_end)                                                       \
                KVQ_MQ(tq_dot_rows)(p, codes, side, t, &K, Qj, oj, ldo, blk, k, R, M_, b, 1); \
            else                                                                             \
                KVQ_MQ(tq_dot_rows)(p, codes, side, t, &K, Qj, oj, ldo, blk, k, R, M_, b, 0)
#define KVQ_MQ_FINISH(t)                                                                     \
            MV_TQ_STEPS16(side + (t) * p->n_side, p->n_side, p->sqrtf_n, step_);             \
            KVQ_MQ(mq_sums)(blk_, oj + (t), ldo, step_, M_, KVQ_MQ_FROM_FIRST)
#define KVQ_MQ_CASE(M) case M: { enum { M_ = M };                                             \
            KVQ_MQ_BLOCK_LOOP(KVQ_MQ_ROWS(M), KVQ_MQ_CALL, KVQ_MQ_FINISH); } break;
        KVQ_MQ_EACH_M(KVQ_MQ_CASE)
#undef KVQ_MQ_CASE
#undef KVQ_MQ_FINISH
#undef KVQ_MQ_CALL
        }
    }
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_axpy_rows)(const kvq_params* p,
                                                               const uint8_t* codes,
                                                               const float* side, int64_t t,
                                                               const MV_TQ_CONSTS* K,
                                                               const float* W, int64_t ldw,
                                                               int m_, float* acc,
                                                               const float* cfb, const int R,
                                                               const int M, const int b,
                                                               const int wide)
{
    /* cfb: the coefficients w_jt step_t of a block (query j, row r at [KVQ_MQ_BLOCK j + r]);
     * NULL: computed here */
    const int64_t n = p->dim, cb = p->code_bytes, ns = p->n_side, gb = 2 * b;
    const int m = M ? M : m_;   /* M: a compile-time query count (0: m_ at run time) */
    const uint8_t* c = codes + t * cb;
    float cf[4 * KVQ_MQ_MAX];
    MV a, v[4];
    int64_t i, off;
    int r, j;
    for (r = 0; !cfb && r < R; r++) {
        const float st = kvq_tq_step(side[(t + r) * ns], p->sqrtf_n);
        for (j = 0; j < m; j++) cf[r * m + j] = W[j * ldw + t + r] * st;
    }
    for (i = 0, off = 0; i < n; i += 16, off += gb) {
        kvq_prefetch(c + KVQ_PREFETCH_BYTES + R * off);
        for (r = 0; r < R; r++) v[r] = MV_TQ_LEV16(c + r * cb + off, K, b, wide);
        for (j = 0; j < m; j++) {
            a = MV_LOAD(acc + j * n + i);
            for (r = 0; r < R; r++)
                a = MV_ADD(a, MV_MUL(MV_SET1(cfb ? cfb[KVQ_MQ_BLOCK * j + r] : cf[r * m + j]),
                                     v[r]));
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
    float cfb_[KVQ_MQ_MAX * KVQ_MQ_BLOCK], step_[KVQ_MQ_BLOCK];
    int j0, mm, j;
    MV_TQ_INIT(&K, p->table, b);
#if KVQ_MQ_NARROW
    if (m <= KVQ_MQ_NARROW_QUERIES && p->dim <= KVQ_MQ_NARROW_MAX) {
#define KVQ_MQ_CALL(NS) KVQ_MQ(tq_axpy_narrow)(p, codes, side, r0, r1, W, ldw, acc, &K, b, NS, M_)
        KVQ_MQ_NARROW_EACH_M(m, p->dim, KVQ_MQ_CALL)
#undef KVQ_MQ_CALL
        return;
    }
#endif
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Wj = W + j0 * ldw;
        float* aj = acc + j0 * p->dim;
        mm = m - j0 < KVQ_MQ_MAX ? m - j0 : KVQ_MQ_MAX;
#define KVQ_MQ_CALL(R, t, k)                                                                 \
        if ((t) + (R) <= wide_end)                                                           \
            KVQ_MQ(tq_axpy_rows)(p, codes, side, t, &K, Wj, ldw, mm, aj,                     \
                                 (k) < 0 ? NULL : cfb_ + (k), R, M_, b, 1);                  \
        else                                                                                 \
            KVQ_MQ(tq_axpy_rows)(p, codes, side, t, &K, Wj, ldw, mm, aj,                     \
                                 (k) < 0 ? NULL : cfb_ + (k), R, M_, b, 0)
        /* the products w_jt * step_t of the per-row code, sixteen at a time */
#define KVQ_MQ_PREP(t)                                                                       \
        MV_TQ_STEPS16(side + (t) * p->n_side, p->n_side, p->sqrtf_n, step_);                 \
        for (j = 0; j < mm; j++)                                                             \
            MV_STORE(cfb_ + KVQ_MQ_BLOCK * j, MV_MUL(MV_LOAD(Wj + j * ldw + (t)),            \
                                                     MV_LOAD(step_)))
        if (mm == 1) {
            const int M_ = 1;
            KVQ_MQ_CTX_LOOP(KVQ_MQ_CTX_ROWS, KVQ_MQ_CALL, KVQ_MQ_PREP, 1);
        } else {
            const int M_ = 0;
            KVQ_MQ_CTX_LOOP(KVQ_MQ_CTX_ROWS, KVQ_MQ_CALL, KVQ_MQ_PREP, 1);
        }
#undef KVQ_MQ_PREP
#undef KVQ_MQ_CALL
    }
}

#if KVQ_MQ_NARROW
/* Scores of m > 1 queries over narrow rows, KVQ_MQ_NARROW_QUERIES a pass at most (a last pass
 * of one query takes the one-query kernel). */
KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(tq_dot_narrow_bits)(const kvq_params* p,
                                                                     const uint8_t* codes,
                                                                     const float* side,
                                                                     int64_t r0, int64_t r1,
                                                                     const float* Q, int m,
                                                                     float* out, int64_t ldo,
                                                                     const int b)
{
    MV_TQ_CONSTS K;
    int j0, mm;
    MV_TQ_INIT(&K, p->table, b);
    for (j0 = 0; j0 < m; j0 += mm) {
        mm = m - j0 < KVQ_MQ_NARROW_QUERIES ? m - j0 : KVQ_MQ_NARROW_QUERIES;
#define KVQ_MQ_CALL(NS)                                                                       \
        if (M_ == 1)                                                                          \
            KVQ_MQ(tq_dot_narrow)(p, codes, side, r0, r1, Q + j0 * p->dim, out + j0 * ldo,    \
                                  &K, b, NS);                                                 \
        else                                                                                  \
            KVQ_MQ(tq_dot_narrow_m)(p, codes, side, r0, r1, Q + j0 * p->dim, out + j0 * ldo, \
                                    ldo, &K, b, NS, M_)
        KVQ_MQ_NARROW_EACH_M(mm, p->dim, KVQ_MQ_CALL)
#undef KVQ_MQ_CALL
    }
}

/* A function of its own, not inlined into tq_dotm's one-query path: sharing its frame made the
 * one-query narrow kernel ~7% slower (Zen 5). */
KVQ_MQ_TARGET static void KVQ_MQ(tq_dotm_narrow)(const kvq_params* p, const uint8_t* codes,
                                               const float* side, int64_t r0, int64_t r1,
                                               const float* Q, int m, float* out, int64_t ldo)
{
    KVQ_TQ_DISPATCH(KVQ_MQ(tq_dot_narrow_bits), p, codes, side, r0, r1, Q, m, out, ldo)
}
#endif

KVQ_MQ_TARGET static void KVQ_MQ(tq_dotm)(const kvq_params* p, const uint8_t* codes,
                                         const float* side, int64_t r0, int64_t r1,
                                         const float* Q, int m, float* out, int64_t ldo)
{
    if (kvq_mq_tq_own_kernels(p, KVQ_MQ_VBMI_TQ)) {
        KVQ_MQ_FALLBACK(tq_dotm)(p, codes, side, r0, r1, Q, m, out, ldo);
        return;
    }
#if KVQ_MQ_NARROW
    if (m > 1 && p->dim <= KVQ_MQ_NARROW_MAX) {
        KVQ_MQ(tq_dotm_narrow)(p, codes, side, r0, r1, Q, m, out, ldo);
        return;
    }
#endif
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
                                                                int64_t ldo, MV* blk, int k,
                                                                const int R, const int M,
                                                                const int q4)
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
    KVQ_MQ(mq_put)(acc, blk, k, out + t, ldo, NULL, R, M, 0);
}

KVQ_MQ_TARGET static KVQ_ALWAYS_INLINE void KVQ_MQ(ggml_dot_q)(const kvq_params* p,
                                                             const uint8_t* codes, int64_t r0,
                                                             int64_t r1, const float* Q, int m,
                                                             float* out, int64_t ldo,
                                                             const int q4)
{
    MV blk_[KVQ_MQ_PASS * KVQ_MQ_BLOCK];
    int j0, mm;
    for (j0 = 0; j0 < m; j0 += mm) {
        const float* Qj = Q + j0 * p->dim;
        float* oj = out + j0 * ldo;
        mm = m - j0 < KVQ_MQ_PASS ? m - j0 : KVQ_MQ_PASS;
        switch (mm) {
#define KVQ_MQ_CALL(R, t, blk, k) KVQ_MQ(ggml_dot_rows)(p, codes, t, Qj, oj, ldo, blk, k, R, M_, q4)
#define KVQ_MQ_FINISH(t) KVQ_MQ(mq_sums)(blk_, oj + (t), ldo, NULL, M_, 0)
#define KVQ_MQ_CASE(M) case M: { enum { M_ = M };                                             \
            KVQ_MQ_BLOCK_LOOP(KVQ_MQ_ROWS(M), KVQ_MQ_CALL, KVQ_MQ_FINISH); } break;
        KVQ_MQ_EACH_M(KVQ_MQ_CASE)
#undef KVQ_MQ_CASE
#undef KVQ_MQ_FINISH
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
        KVQ_MQ_ROW_LOOP(KVQ_MQ_AXPY_ROWS, KVQ_MQ_CALL);
    } else {
        const int q4_ = 0;
        KVQ_MQ_ROW_LOOP(KVQ_MQ_AXPY_ROWS, KVQ_MQ_CALL);
    }
#undef KVQ_MQ_CALL
}

#endif /* KVQ_MQ_TQ_ONLY */

#undef KVQ_MQ_ROW_LOOP
#undef KVQ_MQ_BLOCK_LOOP
#undef KVQ_MQ_CTX_LOOP
#undef KVQ_MQ_BLOCK
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
#undef MV_SUMS16
#undef MV_SUMS16_FROM_FIRST
#undef KVQ_MQ_FROM_FIRST
#undef MV_TQ_STEPS16
#undef MV_E4M3
#undef MV_E4M3_SPECIAL
#undef MV_TQ_CONSTS
#undef MV_TQ_INIT
#undef MV_TQ_LEV16
#undef MV_TQ_CODES16
#undef MV_TQ_LEVELS
#undef MV_LOOKUP16
#undef MV_GGML_VALUES
#undef MV_FP16
#undef KVQ_MQ_PASS
#undef KVQ_MQ_ROWS
#undef KVQ_MQ_CTX_ROWS
#undef KVQ_MQ_EACH_M
#undef KVQ_MQ_VBMI_TQ
#undef KVQ_MQ_AXPY_ROWS
#undef KVQ_MQ_NARROW
#undef KVQ_MQ_NARROW_MAX
#undef KVQ_MQ_NARROW_SWITCH
#undef KVQ_MQ_NARROW_EACH_M
#undef KVQ_MQ_NARROW_QUERIES
