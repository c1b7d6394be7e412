# Randomized Hadamard rotation: rotate(x) = H(D x) / sqrt(n), unrotate(y) = D (H y) / sqrt(n).
# H is the unnormalized Walsh-Hadamard transform in natural order (docs/reference.md §1.2).
# rotate/unrotate are safe from the butterflies' float32 overflow (rowops.h): a row whose partial
# sums would overflow is computed on a copy scaled by 2^-64, the same bits as before otherwise.
from cython.parallel cimport parallel, prange
from libc.math cimport sqrt, sqrtf
from libc.stdint cimport uint8_t
from libc.stdlib cimport free, malloc

from kvquant._kernels._common cimport fwht, kvq_rotate_row_safe, kvq_unrotate_row_safe


def fwht_rows(float[:, ::1] X,   # IN/OUT (n_rows, n), n a power of two
              int n_threads):
    """Unnormalized Walsh-Hadamard transform of every row, in place."""
    cdef Py_ssize_t r, n_rows = X.shape[0], n = X.shape[1]
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        fwht(&X[r, 0], n)


def rotate_rows(const float[:, ::1] X,     # IN  (n_rows, n)
                const float[::1] signs,    # IN  (n,) entries +-1
                float[:, ::1] out,         # OUT (n_rows, n)
                int n_threads):
    cdef Py_ssize_t r, n_rows = X.shape[0], n = X.shape[1]
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf(<float>n)
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        kvq_rotate_row_safe(&X[r, 0], &signs[0], n, inv_sqrt_n, &out[r, 0])


def unrotate_rows(const float[:, ::1] Y,   # IN  (n_rows, n)
                  const float[::1] signs,  # IN  (n,)
                  float[:, ::1] out,       # OUT (n_rows, n)
                  int n_threads):
    cdef Py_ssize_t r, i, n_rows = Y.shape[0], n = Y.shape[1]
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf(<float>n)
    cdef float* copy
    if n_rows == 0:
        return
    with nogil, parallel(num_threads=n_threads):
        copy = <float*>malloc(n * sizeof(float))
        for r in prange(n_rows, schedule="static"):
            for i in range(n):
                out[r, i] = Y[r, i]
            kvq_unrotate_row_safe(&out[r, 0], &signs[0], n, inv_sqrt_n, copy)
        free(copy)


def row_norms(const float[:, ::1] X,   # IN  (n_rows, d)
              double[::1] out,         # OUT (n_rows,) sqrt(sum x^2) accumulated in double
              int n_threads):
    cdef Py_ssize_t r, i, n_rows = X.shape[0], d = X.shape[1]
    cdef double acc
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        acc = 0.0
        for i in range(d):
            acc = acc + <double>X[r, i] * <double>X[r, i]
        out[r] = sqrt(acc)
