# Bit packing of small integer codes, row by row (exposed for tests and for other codecs).
from cython.parallel cimport prange
from libc.stdint cimport uint8_t

from kvquant._kernels._common cimport pack_bits, unpack_bits


def pack_rows(const uint8_t[:, ::1] codes,   # IN  (n_rows, n) codes < 2**bits
              int bits,
              uint8_t[:, ::1] packed,        # OUT (n_rows, ceil(n*bits/8))
              int n_threads):
    cdef Py_ssize_t r, n_rows = codes.shape[0], n = codes.shape[1]
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        pack_bits(&codes[r, 0], n, bits, &packed[r, 0])


def unpack_rows(const uint8_t[:, ::1] packed,  # IN  (n_rows, ceil(n*bits/8))
                int bits,
                uint8_t[:, ::1] codes,         # OUT (n_rows, n)
                int n_threads):
    cdef Py_ssize_t r, n_rows = codes.shape[0], n = codes.shape[1]
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        unpack_bits(&packed[r, 0], n, bits, &codes[r, 0])
