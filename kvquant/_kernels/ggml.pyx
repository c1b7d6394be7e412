# llama.cpp's cache block formats Q8_0 and Q4_0: blocks of 32 values, an fp16 scale d (little
# endian) then the quants, optionally after the randomized Hadamard rotation of the row.
# docs/reference.md §3. The arithmetic is that of ggml's reference quantizers as the `gguf` package
# writes them in numpy (its quants.quantize is the oracle of the tests):
#   Q8_0  d = amax / 127; id = 1/d (0 when d == 0); q = roundf(x * id), half away from zero.
#   Q4_0  m = the first element of largest |x|; d = m / -8; id = 1/d (0 when d == 0);
#         q = min(15, trunc(x * id + 8.5)); byte j = q[j] | q[j + 16] << 4.
# A non-finite x * id (only when d is a float32 subnormal, so that 1/d overflows) gives q = 0, as
# numpy's float->int cast does on x86. All float32; the scale is rounded to fp16 half to even.
from cython.parallel cimport parallel, prange
from libc.math cimport fabsf, sqrtf, isfinite
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int8_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

from kvquant._kernels._common cimport fwht

cdef enum:
    QK = 32
    KIND_Q8_0 = 0
    KIND_Q4_0 = 1

# Row status codes written by encode_rows (the Python layer turns them into errors).
cdef enum:
    ROW_OK = 0
    ROW_NONFINITE = 1
    ROW_SCALE_OVERFLOW = 2   # a block scale beyond fp16 (|d| >= 65520): ggml would store inf

cdef float F_127 = 127.0
cdef float F_MINUS_8 = -8.0
cdef float F_8_5 = 8.5
cdef float F_ONE = 1.0
cdef float F_HALF = 0.5


cdef inline uint16_t fp32_to_fp16(float f) noexcept nogil:
    """IEEE binary16 nearest, ties to even; overflow -> inf, NaN -> 0x7E00 (as ggml)."""
    cdef uint32_t u, a, mant, q, rem, halfway
    cdef uint16_t sign
    cdef int shift
    memcpy(&u, &f, 4)
    sign = <uint16_t>((u >> 16) & 0x8000)
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x477FF000:            # >= 65520 rounds to infinity
        return sign | 0x7C00
    if a >= 0x38800000:            # normal half: round the mantissa at bit 13, ties to even
        a = a + 0xFFF + ((a >> 13) & 1)
        return sign | <uint16_t>((a >> 13) - ((127 - 15) << 10))
    # subnormal half: value = q * 2^-24
    shift = 126 - <int>(a >> 23)   # >= 14
    if shift > 24:
        return sign
    mant = (a & 0x7FFFFF) | 0x800000
    q = mant >> shift
    rem = mant & ((1u << shift) - 1u)
    halfway = 1u << (shift - 1)
    if rem > halfway or (rem == halfway and (q & 1u)):
        q += 1
    return sign | <uint16_t>q


cdef inline float fp16_to_fp32(uint16_t h) noexcept nogil:
    """Exact widening of an IEEE binary16."""
    cdef uint32_t sign = (<uint32_t>h & 0x8000) << 16
    cdef uint32_t e = (h >> 10) & 0x1F
    cdef uint32_t m = h & 0x3FF
    cdef uint32_t u
    cdef float f
    if e == 0x1F:
        u = sign | 0x7F800000 | (m << 13)
    elif e != 0:
        u = sign | ((e + 112) << 23) | (m << 13)
    elif m == 0:
        u = sign
    else:
        # subnormal: m * 2^-24, renormalised
        e = 113
        while (m & 0x400) == 0:
            m <<= 1
            e -= 1
        u = sign | (e << 23) | ((m & 0x3FF) << 13)
    memcpy(&f, &u, 4)
    return f


cdef inline int8_t round_half_away(float v) noexcept nogil:
    """roundf(v) for |v| <= 127.5 without a libm call (SSE2 has no roundss); non-finite -> 0."""
    cdef int t
    cdef float frac
    if not isfinite(v):
        return 0
    t = <int>v                       # truncation toward zero, exact
    frac = v - <float>t              # exact: |v| < 2^23
    if frac >= F_HALF:
        t += 1
    elif frac <= -F_HALF:
        t -= 1
    return <int8_t>t


cdef inline int quantize_block_q8_0(const float* x, uint8_t* out) noexcept nogil:
    cdef int j
    cdef float amax = 0.0, a, d, inv
    cdef uint16_t h
    for j in range(QK):
        a = fabsf(x[j])
        if a > amax:
            amax = a
    d = amax / F_127
    inv = F_ONE / d if d != 0.0 else <float>0.0
    h = fp32_to_fp16(d)
    if (h & 0x7FFF) >= 0x7C00:
        return ROW_SCALE_OVERFLOW
    out[0] = <uint8_t>(h & 0xFF)
    out[1] = <uint8_t>(h >> 8)
    for j in range(QK):
        out[2 + j] = <uint8_t>round_half_away(x[j] * inv)
    return ROW_OK


cdef inline uint8_t nibble_q4_0(float v) noexcept nogil:
    """min(15, trunc(v)) for v = x * id + 8.5, which is >= 0.5 - eps when finite; non-finite -> 0."""
    if not isfinite(v) or v < 0.0:
        return 0
    if v >= 15.0:
        return 15
    return <uint8_t>(<int>v)          # the cast truncates toward zero


cdef inline int quantize_block_q4_0(const float* x, uint8_t* out) noexcept nogil:
    cdef int j
    cdef float amax = fabsf(x[0]), peak = x[0], a, d, inv, v0, v1
    cdef uint16_t h
    for j in range(1, QK):
        a = fabsf(x[j])
        if a > amax:           # strictly: the first of equal magnitudes wins, as argmax
            amax = a
            peak = x[j]
    d = peak / F_MINUS_8
    inv = F_ONE / d if d != 0.0 else <float>0.0
    h = fp32_to_fp16(d)
    if (h & 0x7FFF) >= 0x7C00:
        return ROW_SCALE_OVERFLOW
    out[0] = <uint8_t>(h & 0xFF)
    out[1] = <uint8_t>(h >> 8)
    for j in range(QK // 2):
        v0 = x[j] * inv + F_8_5
        v1 = x[j + QK // 2] * inv + F_8_5
        out[2 + j] = nibble_q4_0(v0) | <uint8_t>(nibble_q4_0(v1) << 4)
    return ROW_OK


def encode_rows(const float[:, ::1] X,     # IN  (n_rows, d), d a multiple of 32
                int kind,                  # KIND_Q8_0 or KIND_Q4_0
                bint rotate,               # apply the Hadamard rotation first (d a power of 2)
                const float[::1] signs,    # IN  (d,) +-1 (read only when rotate)
                uint8_t[:, ::1] codes,     # OUT (n_rows, n_blocks * block_bytes)
                uint8_t[::1] status,       # OUT (n_rows,) ROW_* codes
                int n_threads):
    cdef Py_ssize_t n_rows = X.shape[0], d = X.shape[1]
    cdef Py_ssize_t n_blocks = d // QK
    cdef Py_ssize_t block_bytes = 2 + (QK if kind == KIND_Q8_0 else QK // 2)
    cdef Py_ssize_t r, i, blk
    cdef float inv_sqrt_n = F_ONE / sqrtf(<float>d)
    cdef int st, s
    cdef float* y
    cdef const float* src
    if n_rows == 0:
        return
    with nogil, parallel(num_threads=n_threads):
        y = <float*>malloc(d * sizeof(float))
        for r in prange(n_rows, schedule="static"):
            st = ROW_OK
            for i in range(d):
                if not isfinite(X[r, i]):
                    st = ROW_NONFINITE
                    break
            src = &X[r, 0]
            if st == ROW_OK and rotate:
                for i in range(d):
                    y[i] = X[r, i] * signs[i]
                fwht(y, d)
                for i in range(d):
                    y[i] = y[i] * inv_sqrt_n
                    if not isfinite(y[i]):
                        st = ROW_SCALE_OVERFLOW   # the butterflies overflowed float32
                src = y
            if st == ROW_OK:
                for blk in range(n_blocks):
                    if kind == KIND_Q8_0:
                        s = quantize_block_q8_0(src + blk * QK, &codes[r, blk * block_bytes])
                    else:
                        s = quantize_block_q4_0(src + blk * QK, &codes[r, blk * block_bytes])
                    if s != ROW_OK:
                        st = s
                        break
            if st != ROW_OK:
                # inert row: what the format stores for a row of zeros
                for i in range(d):
                    y[i] = 0.0
                for blk in range(n_blocks):
                    if kind == KIND_Q8_0:
                        quantize_block_q8_0(y + blk * QK, &codes[r, blk * block_bytes])
                    else:
                        quantize_block_q4_0(y + blk * QK, &codes[r, blk * block_bytes])
            status[r] = <uint8_t>st
        free(y)


def decode_rows(const uint8_t[:, ::1] codes,   # IN  (n_rows, n_blocks * block_bytes)
                int kind,
                bint rotate,                   # unrotate after dequantizing
                const float[::1] signs,        # IN  (d,)
                float[:, ::1] out,             # OUT (n_rows, d)
                int n_threads):
    cdef Py_ssize_t n_rows = out.shape[0], d = out.shape[1]
    cdef Py_ssize_t n_blocks = d // QK
    cdef Py_ssize_t block_bytes = 2 + (QK if kind == KIND_Q8_0 else QK // 2)
    cdef Py_ssize_t r, i, j, blk
    cdef float inv_sqrt_n = F_ONE / sqrtf(<float>d)
    cdef float scale
    cdef const uint8_t* b
    cdef float* o
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        for blk in range(n_blocks):
            b = &codes[r, blk * block_bytes]
            o = &out[r, blk * QK]
            scale = fp16_to_fp32(<uint16_t>(b[0] | (b[1] << 8)))
            if kind == KIND_Q8_0:
                for j in range(QK):
                    o[j] = (<float>(<int8_t>b[2 + j])) * scale
            else:
                for j in range(QK // 2):
                    o[j] = scale * <float>(<int>(b[2 + j] & 0x0F) - 8)
                    o[j + QK // 2] = scale * <float>(<int>(b[2 + j] >> 4) - 8)
        if rotate:
            fwht(&out[r, 0], d)
            for i in range(d):
                out[r, i] = out[r, i] * inv_sqrt_n * signs[i]


def fp16_bits(const float[::1] x, uint16_t[::1] out):
    """float32 -> binary16 bit patterns (for tests of the rounding)."""
    cdef Py_ssize_t i
    for i in range(x.shape[0]):
        out[i] = fp32_to_fp16(x[i])


def fp16_values(const uint16_t[::1] h, float[::1] out):
    """binary16 bit patterns -> float32 (for tests)."""
    cdef Py_ssize_t i
    for i in range(h.shape[0]):
        out[i] = fp16_to_fp32(h[i])
