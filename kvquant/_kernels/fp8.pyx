# fp8 e4m3fn (OCP) with one f32 scale per group of elements (per row when group == width).
# Encoding follows the engine (docs/reference.md §1.1; the group encoder is in fp8ops.h): round half to
# even, saturate to +-448, NaN -> 0, never emit 0x7F/0xFF; a group whose amax is not > 1e-35 or
# exceeds 3.4e38f (the engine's literal) is inert (zero bytes, scale 1); elements are multiplied by
# 448/amax, scale = amax/448.
from cython.parallel cimport prange
from libc.stdint cimport uint8_t, uint32_t
from libc.string cimport memcpy

cdef extern from "fp8ops.h" nogil:
    uint8_t kvq_e4m3_encode(float f)
    int kvq_fp8_encode_group(const float* x, Py_ssize_t n, uint8_t* codes, float* scale)


cdef inline float e4m3_to_float(uint8_t c) noexcept nogil:
    cdef int e = (c >> 3) & 0xF
    cdef int m = c & 7
    cdef float v
    if e == 0xF and m == 7:
        return 0.0  # NaN codes decode to 0, as in the engine
    if e == 0:
        v = m * 0.001953125  # M * 2**-9
    else:
        v = (1.0 + m * 0.125) * _pow2(e - 7)
    return -v if (c & 0x80) else v


cdef inline float _pow2(int e) noexcept nogil:
    cdef uint32_t u = <uint32_t>(e + 127) << 23
    cdef float f
    memcpy(&f, &u, 4)
    return f


def float_to_e4m3(const float[::1] x, uint8_t[::1] out):
    """Element-wise e4m3fn encoding without scaling (for tests of the rounding rules)."""
    cdef Py_ssize_t i
    for i in range(x.shape[0]):
        out[i] = kvq_e4m3_encode(x[i])


def e4m3_table():
    """The 256 decode values (NaN codes as 0) as a list of floats."""
    return [e4m3_to_float(<uint8_t>c) for c in range(256)]


def encode_rows(const float[:, ::1] X,      # IN  (n_rows, d)
                Py_ssize_t group,           # elements per scale; divides d
                uint8_t[:, ::1] codes,      # OUT (n_rows, d)
                float[:, ::1] scales,       # OUT (n_rows, d // group)
                uint8_t[::1] status,        # OUT (n_rows,) 1: a NaN/inf, 2: a group amax > 3.4e38f
                int n_threads):
    cdef Py_ssize_t n_rows = X.shape[0], d = X.shape[1]
    cdef Py_ssize_t n_groups = d // group
    cdef Py_ssize_t r, g, start
    cdef int st
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        status[r] = 0
        for g in range(n_groups):
            start = g * group
            st = kvq_fp8_encode_group(&X[r, start], group, &codes[r, start], &scales[r, g])
            if st == 1 or (st == 2 and status[r] == 0):
                status[r] = <uint8_t>st


def decode_rows(const uint8_t[:, ::1] codes,  # IN  (n_rows, d)
                const float[:, ::1] scales,   # IN  (n_rows, d // group)
                Py_ssize_t group,
                float[:, ::1] out,            # OUT (n_rows, d)
                int n_threads):
    cdef float lut[256]
    cdef Py_ssize_t n_rows = codes.shape[0], d = codes.shape[1]
    cdef Py_ssize_t r, i, g, n_groups = d // group
    cdef float scale
    for i in range(256):
        lut[i] = e4m3_to_float(<uint8_t>i)
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        for g in range(n_groups):
            scale = scales[r, g]
            for i in range(g * group, (g + 1) * group):
                out[r, i] = lut[codes[r, i]] * scale
