/* y = W x for one float32 row x (a decode step's projections), on the consumers' OpenMP threads:
 * the projections and the attention of a decode step then share one thread pool, and neither
 * waits for the other's spinning workers (README, "Inside a forward").
 *
 * Each output is the dot product of one row of W with x in a fixed order: 16 lane sums, lane l
 * adding w[j] x[j] for j = l, l + 16, ... in order (the last block padded with zeros), then
 * kvq_tree16's pairwise tree. Every row is computed whole by one thread and the build forbids FMA
 * contraction, so the bits do not depend on the thread count or on the clone the loader picks.
 * The lane loops are plain C, which GCC vectorizes per clone. */
#ifndef KVQ_MATVEC_H
#define KVQ_MATVEC_H
#include <stdint.h>
#include <string.h>

#include "rowops.h"
#include "tree16.h"

#define KVQ_MV_ROWS 4   /* rows a pass: x's block is loaded once for all of them */

KVQ_CLONES
static void kvq_matvec_rows(const float *W, int64_t n, const float *x, float *y, int64_t r0,
                            int64_t r1)
{
    int64_t r, j, k;
    int l;
    for (r = r0; r < r1; r += KVQ_MV_ROWS) {
        const int rows = r1 - r < KVQ_MV_ROWS ? (int)(r1 - r) : KVQ_MV_ROWS;
        float acc[KVQ_MV_ROWS][16], xb[16], wb[16];
        memset(acc, 0, sizeof acc);
        for (j = 0; j + 16 <= n; j += 16)
            for (k = 0; k < rows; k++) {
                const float *w = W + (r + k) * n + j;
                for (l = 0; l < 16; l++) acc[k][l] = acc[k][l] + w[l] * x[j + l];
            }
        if (j < n) {   /* the last block, padded with zeros */
            memset(xb, 0, sizeof xb);
            memcpy(xb, x + j, (size_t)(n - j) * sizeof(float));
            for (k = 0; k < rows; k++) {
                memset(wb, 0, sizeof wb);
                memcpy(wb, W + (r + k) * n + j, (size_t)(n - j) * sizeof(float));
                for (l = 0; l < 16; l++) acc[k][l] = acc[k][l] + wb[l] * xb[l];
            }
        }
        for (k = 0; k < rows; k++) y[r + k] = kvq_tree16(acc[k]);
    }
}
#endif
