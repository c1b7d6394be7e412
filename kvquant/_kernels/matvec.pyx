# One float32 row through a matrix (matvec.h): a decode step's projections on kvquant's OpenMP
# threads, so that they and the consumers share one pool.
from cython.parallel cimport prange
from libc.stdint cimport int64_t

cdef extern from "matvec.h" nogil:
    void kvq_matvec_rows(const float* W, int64_t n, const float* x, float* y, int64_t r0,
                         int64_t r1)

# rows a task: a 64-row block of a 576-wide matrix is 147 KB, a fair share of a core's L2
cdef int64_t BLOCK_ROWS = 64


def matvec(const float[:, ::1] W,    # IN  (m, n)
           const float[::1] x,       # IN  (n,)
           float[::1] y,             # OUT (m,)
           int n_threads):
    """y = W x, each output in matvec.h's fixed order: the same bits for any thread count.
    y must not overlap W or x."""
    cdef int64_t m = W.shape[0], n = W.shape[1], b, n_blocks = (m + BLOCK_ROWS - 1) // BLOCK_ROWS
    if x.shape[0] != n or y.shape[0] != m:
        raise ValueError(f"matvec: W is ({m}, {n}), so x needs {n} entries and y {m}; got "
                         f"{x.shape[0]} and {y.shape[0]}")
    if n_threads < 1:
        raise ValueError(f"matvec: n_threads must be at least 1, got {n_threads}")
    if m == 0:
        return
    if n == 0:
        y[:] = 0.0
        return
    if n_threads == 1 or n_blocks == 1:
        with nogil:
            kvq_matvec_rows(&W[0, 0], n, &x[0], &y[0], 0, m)
        return
    for b in prange(n_blocks, nogil=True, schedule="static", num_threads=n_threads):
        kvq_matvec_rows(&W[0, 0], n, &x[0], &y[0], b * BLOCK_ROWS,
                        min(m, (b + 1) * BLOCK_ROWS))
