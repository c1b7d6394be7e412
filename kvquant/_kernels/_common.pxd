# Helpers shared by the codec kernels: the Walsh-Hadamard transform (from rowops.h) and bit
# packing. They are compiled into each kernel module (no cross-module calls).
from libc.float cimport FLT_MAX
from libc.math cimport isfinite, sqrt
from libc.stdint cimport uint8_t, uint32_t, uint64_t

# Row status codes written by the encoders (the Python layer turns them into errors;
# kvquant/codecs/base.py has the same numbers).
cdef enum:
    ROW_OK = 0
    ROW_NONFINITE = 1
    ROW_NORM_OVERFLOW = 2    # norm (fp8: an element) above ROW_LIMIT
    ROW_RANGE = 4            # finite norm, but the float32 arithmetic cannot carry the row


cdef extern from "rowops.h" nogil:
    float ROW_LIMIT "KVQ_ROW_LIMIT"      # the engine's inert threshold 3.4e38f
    float PRESCALE "KVQ_PRESCALE"        # 2^-64
    int kvq_all_finite(const float* y, Py_ssize_t n)
    int kvq_unrotate_row_safe(float* y, const float* signs, Py_ssize_t n, float inv_sqrt_n,
                              float* copy)
    void kvq_rotate_row_safe(const float* x, const float* signs, Py_ssize_t n, float inv_sqrt_n,
                             float* out)
    void kvq_rotate_scale_row_prescaled(const float* x, const float* signs, Py_ssize_t n,
                                        float inv_sqrt_n, float to_unit, float pre, float* y)


cdef inline float live_radius(double norm2, uint8_t* status) noexcept nogil:
    """The engine's radius rule: radius = (float)sqrt(sum of squares); a row whose radius is not
    > 1e-35 or exceeds 3.4e38f (ROW_LIMIT) is inert (the caller stores zero codes and radius 0).
    Writes the row status; returns the radius, or 0 for an inert row."""
    cdef float radius = <float>sqrt(norm2)
    if radius > <float>1e-35 and radius <= ROW_LIMIT:
        status[0] = ROW_OK
        return radius
    if not isfinite(norm2):
        status[0] = ROW_NONFINITE
    elif radius > ROW_LIMIT:
        status[0] = ROW_NORM_OVERFLOW
    else:
        status[0] = ROW_OK   # a zero or tiny row: inert, not an error
    return 0.0


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
