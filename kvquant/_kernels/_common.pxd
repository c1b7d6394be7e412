# Helpers shared by the codec kernels: the Walsh-Hadamard transform (from rowops.h) and bit
# packing. They are compiled into each kernel module (no cross-module calls).
from libc.stdint cimport uint8_t, uint32_t, uint64_t


cdef extern from "rowops.h" nogil:
    void kvq_fwht(float* y, Py_ssize_t n)


cdef inline void fwht(float* x, Py_ssize_t n) noexcept nogil:
    """Unnormalized fast Walsh-Hadamard transform in natural (Sylvester) order, in place."""
    kvq_fwht(x, n)


cdef inline void pack_bits(const uint8_t* codes, Py_ssize_t n, int bits,
                           uint8_t* out) noexcept nogil:
    """Write n codes of `bits` bits each, LSB first through a bit cursor.

    Element i occupies bits [i*bits, (i+1)*bits) of the byte string; for 4 bits this puts even
    elements in the low nibble. Trailing bits of the last byte are zero.
    """
    cdef uint64_t acc = 0
    cdef int filled = 0
    cdef Py_ssize_t i, o = 0
    for i in range(n):
        acc |= (<uint64_t>codes[i]) << filled
        filled += bits
        while filled >= 8:
            out[o] = <uint8_t>(acc & 0xFF)
            o += 1
            acc >>= 8
            filled -= 8
    if filled > 0:
        out[o] = <uint8_t>(acc & 0xFF)


cdef inline void unpack_bits(const uint8_t* packed, Py_ssize_t n, int bits,
                             uint8_t* codes) noexcept nogil:
    """Inverse of pack_bits."""
    cdef uint64_t acc = 0
    cdef int filled = 0
    cdef uint32_t mask = (1u << bits) - 1u
    cdef Py_ssize_t i, o = 0
    for i in range(n):
        while filled < bits:
            acc |= (<uint64_t>packed[o]) << filled
            o += 1
            filled += 8
        codes[i] = <uint8_t>(acc & mask)
        acc >>= bits
        filled -= bits
