# Randomized Hadamard rotation: rotate(x) = H(D x) / sqrt(n), unrotate(y) = D (H y) / sqrt(n).
# H is the unnormalized Walsh-Hadamard transform in natural order (REFERENCE.md §1.2).
from cython.parallel cimport prange
from libc.math cimport sqrt, sqrtf
from libc.stdint cimport uint8_t

from kvquant._kernels._common cimport fwht


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
    cdef Py_ssize_t r, i, n_rows = X.shape[0], n = X.shape[1]
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf(<float>n)
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        for i in range(n):
            out[r, i] = X[r, i] * signs[i]
        fwht(&out[r, 0], n)
        for i in range(n):
            out[r, i] = out[r, i] * inv_sqrt_n


def unrotate_rows(const float[:, ::1] Y,   # IN  (n_rows, n)
                  const float[::1] signs,  # IN  (n,)
                  float[:, ::1] out,       # OUT (n_rows, n)
                  int n_threads):
    cdef Py_ssize_t r, i, n_rows = Y.shape[0], n = Y.shape[1]
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf(<float>n)
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        for i in range(n):
            out[r, i] = Y[r, i]
        fwht(&out[r, 0], n)
        for i in range(n):
            out[r, i] = out[r, i] * inv_sqrt_n * signs[i]


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
