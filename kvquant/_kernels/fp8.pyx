# fp8 e4m3fn (OCP) with one f32 scale per group of elements (per row when group == width).
# Encoding follows the engine (REFERENCE.md §1.1): round half to even, saturate to +-448, NaN -> 0,
# never emit 0x7F/0xFF; a group whose amax is not > 1e-35 or is not finite is inert (zero bytes,
# scale 1). Elements are multiplied by 448/amax and the stored scale is amax/448, both in float.
from cython.parallel cimport prange
from libc.float cimport FLT_MAX
from libc.math cimport fabsf, nearbyintf, isfinite
from libc.stdint cimport uint8_t, uint32_t
from libc.string cimport memcpy

cdef float FP8_MAX = 448.0
cdef float INERT_AMAX = 1e-35


cdef inline uint8_t e4m3_from_float(float f) noexcept nogil:
    """Round one float to e4m3fn: RNE, saturating, NaN -> 0x00, sign kept (also for -0)."""
    cdef uint32_t u
    memcpy(&u, &f, 4)
    cdef uint8_t sign = <uint8_t>((u >> 24) & 0x80)
    cdef float a = fabsf(f)
    cdef uint32_t ua, code
    if a != a:
        return 0
    if a >= 0.015625:  # 2**-6, the smallest normal: round the float's mantissa to 3 bits
        if a > FP8_MAX:
            return sign | 0x7E
        memcpy(&ua, &a, 4)
        ua = ua + 0x7FFFF + ((ua >> 20) & 1)   # round half to even at bit 20
        code = (ua >> 20) - ((127 - 7) << 3)   # rebias the exponent 127 -> 7
        if code > 0x7E:
            code = 0x7E
        return sign | <uint8_t>code
    # subnormal (or a carry into the smallest normal, code 8): multiples of 2**-9
    return sign | <uint8_t>nearbyintf(a * 512.0)


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
        out[i] = e4m3_from_float(x[i])


def e4m3_table():
    """The 256 decode values (NaN codes as 0) as a list of floats."""
    return [e4m3_to_float(<uint8_t>c) for c in range(256)]


def encode_rows(const float[:, ::1] X,      # IN  (n_rows, d)
                Py_ssize_t group,           # elements per scale; divides d
                uint8_t[:, ::1] codes,      # OUT (n_rows, d)
                float[:, ::1] scales,       # OUT (n_rows, d // group)
                uint8_t[::1] nonfinite,     # OUT (n_rows,) 1 where the row had NaN/inf
                int n_threads):
    cdef Py_ssize_t n_rows = X.shape[0], d = X.shape[1]
    cdef Py_ssize_t n_groups = d // group
    cdef Py_ssize_t r, g, i, start
    cdef float amax, a, scale, inv
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        nonfinite[r] = 0
        for g in range(n_groups):
            start = g * group
            # As the engine: a NaN never raises amax (the comparison is false) and later encodes
            # to 0x00; an inf raises it past FLT_MAX, which makes the group inert.
            amax = 0.0
            for i in range(start, start + group):
                a = fabsf(X[r, i])
                if not isfinite(a):
                    nonfinite[r] = 1
                if a > amax:
                    amax = a
            if not (amax > INERT_AMAX) or amax > FLT_MAX:
                for i in range(start, start + group):
                    codes[r, i] = 0
                scales[r, g] = 1.0
                continue
            inv = FP8_MAX / amax
            for i in range(start, start + group):
                codes[r, i] = e4m3_from_float(X[r, i] * inv)
            scales[r, g] = amax / FP8_MAX


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
