# llama.cpp's cache block formats: blocks of 32 values, an fp16 scale d (little endian), for the
# offset formats an fp16 minimum m, for the 5-bit formats 4 bytes of high bits, then the quants,
# optionally after the randomized Hadamard rotation of the row. docs/reference.md §3. The
# arithmetic is that of ggml's reference quantizers (ggml-quants.c, quantize_row_<type>_ref) as the
# `gguf` package writes them in numpy (its quants.quantize is the oracle of the tests):
#   Q8_0  d = amax / 127; id = 1/d (0 when d == 0); q = roundf(x * id), half away from zero.
#   Q4_0  m = the first element of largest |x|; d = m / -8; id = 1/d (0 when d == 0);
#         q = min(15, trunc(x * id + 8.5)); byte j = q[j] | q[j + 16] << 4.
#   Q5_0  as Q4_0 with d = m / -16, q = min(31, trunc(x * id + 16.5)); low nibbles as Q4_0, bit 4
#         of q[j] in bit j of a little-endian uint32 qh.
#   Q4_1  d = (max - min) / 15, q = min(15, trunc((x - min) * id + 0.5)); stores d then m = min.
#   Q5_1  d = (max - min) / 31, q = min(31, trunc((x - min) * id + 0.5)); qh as Q5_0.
# The float -> integer step is numpy's on x86 (which the gguf oracle runs): truncate to int32 (a
# non-finite or out-of-range value gives INT32_MIN), keep the low byte, then clip; it only
# differs from a plain truncation when d is a float32 subnormal, so that 1/d overflows. Q4_0's
# older kernel gives 0 for a non-finite value, which is the same byte.
#   IQ4_NL (no quantizer in gguf: ggml's quantize_row_iq4_nl_ref, i.e. quantize_row_iq4_nl_impl
#         with one block per super-block, no importance weights and ntry = -1): the first element
#         of largest |x| gives d0 = m / -127 and each x its nearest of the 16 levels
#         K = {-127, -104, ..., 113} at x / d0 (ggml's best_index_int8, ties to the upper level
#         only when strictly nearer); then d = sum(w k x) / sum(w k k) with w = x^2, summed in
#         element order in float32. A block with max|x| < 1e-15 stores d = 0 and zero nibbles
#         (ggml leaves its nibbles to whatever its scratch holds; they decode to zero either way).
# All float32; the scales are rounded to fp16 half to even.
from cython.parallel cimport parallel, prange
from libc.math cimport fabsf, sqrtf, isfinite
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int8_t, int32_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

from kvquant._kernels._common cimport fwht

cdef enum:
    QK = 32
    KIND_Q8_0 = 0
    KIND_Q4_0 = 1
    KIND_Q4_1 = 2
    KIND_Q5_0 = 3
    KIND_Q5_1 = 4
    KIND_IQ4_NL = 5

# Bytes per block of each kind (kvquant.codecs.ggml.KINDS restates them; a test pins the two).
BLOCK_BYTES = {KIND_Q8_0: 34, KIND_Q4_0: 18, KIND_Q4_1: 20, KIND_Q5_0: 22, KIND_Q5_1: 24,
               KIND_IQ4_NL: 18}
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
cdef int8_t K_IQ4_NL[16]
for _i, _v in enumerate(IQ4_NL_LEVELS):
    K_IQ4_NL[_i] = _v

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
cdef float F_MINUS_16 = -16.0
cdef float F_16_5 = 16.5
cdef float F_15 = 15.0
cdef float F_31 = 31.0
cdef float F_MINUS_127 = -127.0
cdef float F_IQ4_EPS = 1e-15      # ggml's GROUP_MAX_EPS


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



cdef inline int block_bytes_of(int kind) noexcept nogil:
    if kind == KIND_Q8_0:
        return 34
    if kind == KIND_Q4_1:
        return 20
    if kind == KIND_Q5_0:
        return 22
    if kind == KIND_Q5_1:
        return 24
    return 18                         # q4_0, iq4_nl


cdef inline uint8_t numpy_u8(float v) noexcept nogil:
    """numpy's float32 -> uint8 cast on x86: truncate to int32 (INT32_MIN when non-finite or out
    of range), keep the low byte."""
    cdef int32_t t = -2147483647 - 1
    if v >= -2147483648.0 and v < 2147483648.0:
        t = <int32_t>v
    return <uint8_t>(t & 0xFF)


cdef inline uint8_t clip_u8(uint8_t q, uint8_t top) noexcept nogil:
    return top if q > top else q


cdef inline int store_fp16(float v, uint8_t* out) noexcept nogil:
    """Writes fp16(v) little endian; ROW_SCALE_OVERFLOW when it is not finite."""
    cdef uint16_t h = fp32_to_fp16(v)
    if (h & 0x7FFF) >= 0x7C00:
        return ROW_SCALE_OVERFLOW
    out[0] = <uint8_t>(h & 0xFF)
    out[1] = <uint8_t>(h >> 8)
    return ROW_OK


cdef inline void store_qh(uint32_t qh, uint8_t* out) noexcept nogil:
    out[0] = <uint8_t>(qh & 0xFF)
    out[1] = <uint8_t>((qh >> 8) & 0xFF)
    out[2] = <uint8_t>((qh >> 16) & 0xFF)
    out[3] = <uint8_t>(qh >> 24)


cdef inline int quantize_block_q5_0(const float* x, uint8_t* out) noexcept nogil:
    cdef int j
    cdef float amax = fabsf(x[0]), peak = x[0], a, d, inv
    cdef uint8_t q0, q1
    cdef uint32_t qh = 0
    for j in range(1, QK):
        a = fabsf(x[j])
        if a > amax:           # the first of equal magnitudes wins, as argmax
            amax = a
            peak = x[j]
    d = peak / F_MINUS_16
    inv = F_ONE / d if d != 0.0 else <float>0.0
    if store_fp16(d, out) != ROW_OK:
        return ROW_SCALE_OVERFLOW
    for j in range(QK // 2):
        q0 = clip_u8(numpy_u8(x[j] * inv + F_16_5), 31)
        q1 = clip_u8(numpy_u8(x[j + QK // 2] * inv + F_16_5), 31)
        out[6 + j] = (q0 & 0x0F) | <uint8_t>((q1 & 0x0F) << 4)
        qh |= (<uint32_t>(q0 >> 4) & 1u) << j
        qh |= (<uint32_t>(q1 >> 4) & 1u) << (j + QK // 2)
    store_qh(qh, out + 2)
    return ROW_OK


cdef inline int quantize_block_offset(const float* x, uint8_t* out, int five) noexcept nogil:
    """Q4_1 (five = 0) and Q5_1 (five = 1): d = (max - min) / (2^b - 1), m = min."""
    cdef int j
    cdef float lo = x[0], hi = x[0], d, inv
    cdef uint8_t q0, q1, top = 31 if five else 15
    cdef uint32_t qh = 0
    cdef uint8_t* qs = out + (8 if five else 4)
    for j in range(1, QK):
        if x[j] < lo:
            lo = x[j]
        if x[j] > hi:
            hi = x[j]
    d = (hi - lo) / (F_31 if five else F_15)
    inv = F_ONE / d if d != 0.0 else <float>0.0
    if store_fp16(d, out) != ROW_OK or store_fp16(lo, out + 2) != ROW_OK:
        return ROW_SCALE_OVERFLOW
    for j in range(QK // 2):
        q0 = clip_u8(numpy_u8((x[j] - lo) * inv + F_HALF), top)
        q1 = clip_u8(numpy_u8((x[j + QK // 2] - lo) * inv + F_HALF), top)
        qs[j] = (q0 & 0x0F) | <uint8_t>((q1 & 0x0F) << 4)
        qh |= (<uint32_t>(q0 >> 4) & 1u) << j
        qh |= (<uint32_t>(q1 >> 4) & 1u) << (j + QK // 2)
    if five:
        store_qh(qh, out + 4)
    return ROW_OK


cdef inline int iq4_nl_index(float v) noexcept nogil:
    """ggml's best_index_int8 over the 16 IQ4_NL levels."""
    cdef int lo = 0, hi = 15, mid
    if v <= <float>K_IQ4_NL[0]:
        return 0
    if v >= <float>K_IQ4_NL[15]:
        return 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if v < <float>K_IQ4_NL[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if v - <float>K_IQ4_NL[hi - 1] < <float>K_IQ4_NL[hi] - v else hi


cdef inline int quantize_block_iq4_nl(const float* x, uint8_t* out) noexcept nogil:
    cdef int j
    cdef float amax = 0.0, peak = 0.0, a, d0, inv, w, k, sumqx = 0.0, sumq2 = 0.0
    cdef uint8_t L[QK]
    for j in range(QK):
        a = fabsf(x[j])
        if a > amax:
            amax = a
            peak = x[j]
    if amax < F_IQ4_EPS:
        for j in range(18):
            out[j] = 0
        return ROW_OK
    d0 = peak / F_MINUS_127
    inv = F_ONE / d0
    for j in range(QK):
        L[j] = <uint8_t>iq4_nl_index(inv * x[j])
        k = <float>K_IQ4_NL[L[j]]
        w = x[j] * x[j]
        sumqx = sumqx + w * k * x[j]
        sumq2 = sumq2 + w * k * k
    if store_fp16(sumqx / sumq2, out) != ROW_OK:
        return ROW_SCALE_OVERFLOW
    for j in range(QK // 2):
        out[2 + j] = L[j] | <uint8_t>(L[j + QK // 2] << 4)
    return ROW_OK


cdef inline int quantize_block(int kind, const float* x, uint8_t* out) noexcept nogil:
    if kind == KIND_Q8_0:
        return quantize_block_q8_0(x, out)
    if kind == KIND_Q4_0:
        return quantize_block_q4_0(x, out)
    if kind == KIND_Q5_0:
        return quantize_block_q5_0(x, out)
    if kind == KIND_Q4_1:
        return quantize_block_offset(x, out, 0)
    if kind == KIND_Q5_1:
        return quantize_block_offset(x, out, 1)
    return quantize_block_iq4_nl(x, out)


cdef inline uint32_t load_qh(const uint8_t* b) noexcept nogil:
    return (<uint32_t>b[0] | (<uint32_t>b[1] << 8) | (<uint32_t>b[2] << 16)
            | (<uint32_t>b[3] << 24))


cdef inline void dequantize_block(int kind, const uint8_t* b, float* o) noexcept nogil:
    cdef int j
    cdef float scale = fp16_to_fp32(<uint16_t>(b[0] | (b[1] << 8))), m
    cdef uint32_t qh
    cdef const uint8_t* qs
    if kind == KIND_Q8_0:
        for j in range(QK):
            o[j] = (<float>(<int8_t>b[2 + j])) * scale
    elif kind == KIND_Q4_0:
        for j in range(QK // 2):
            o[j] = scale * <float>(<int>(b[2 + j] & 0x0F) - 8)
            o[j + QK // 2] = scale * <float>(<int>(b[2 + j] >> 4) - 8)
    elif kind == KIND_IQ4_NL:
        for j in range(QK // 2):
            o[j] = scale * <float>K_IQ4_NL[b[2 + j] & 0x0F]
            o[j + QK // 2] = scale * <float>K_IQ4_NL[b[2 + j] >> 4]
    elif kind == KIND_Q5_0:
        qh = load_qh(b + 2)
        for j in range(QK // 2):
            o[j] = scale * <float>(<int>((b[6 + j] & 0x0F) | (((qh >> j) & 1u) << 4)) - 16)
            o[j + QK // 2] = scale * <float>(
                <int>((b[6 + j] >> 4) | (((qh >> (j + QK // 2)) & 1u) << 4)) - 16)
    else:                              # q4_1, q5_1: d q + m
        m = fp16_to_fp32(<uint16_t>(b[2] | (b[3] << 8)))
        qh = load_qh(b + 4) if kind == KIND_Q5_1 else 0
        qs = b + (8 if kind == KIND_Q5_1 else 4)
        for j in range(QK // 2):
            o[j] = scale * <float>((qs[j] & 0x0F) | (((qh >> j) & 1u) << 4)) + m
            o[j + QK // 2] = scale * <float>(
                (qs[j] >> 4) | (((qh >> (j + QK // 2)) & 1u) << 4)) + m


def encode_rows(const float[:, ::1] X,     # IN  (n_rows, d), d a multiple of 32
                int kind,                  # KIND_*
                bint rotate,               # apply the Hadamard rotation first (d a power of 2)
                const float[::1] signs,    # IN  (d,) +-1 (read only when rotate)
                uint8_t[:, ::1] codes,     # OUT (n_rows, n_blocks * block_bytes)
                uint8_t[::1] status,       # OUT (n_rows,) ROW_* codes
                int n_threads):
    cdef Py_ssize_t n_rows = X.shape[0], d = X.shape[1]
    cdef Py_ssize_t n_blocks = d // QK
    cdef Py_ssize_t block_bytes = block_bytes_of(kind)
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
                    s = quantize_block(kind, src + blk * QK, &codes[r, blk * block_bytes])
                    if s != ROW_OK:
                        st = s
                        break
            if st != ROW_OK:
                # inert row: what the format stores for a row of zeros
                for i in range(d):
                    y[i] = 0.0
                for blk in range(n_blocks):
                    quantize_block(kind, y + blk * QK, &codes[r, blk * block_bytes])
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
    cdef Py_ssize_t block_bytes = block_bytes_of(kind)
    cdef Py_ssize_t r, i, blk
    cdef float inv_sqrt_n = F_ONE / sqrtf(<float>d)
    if n_rows == 0:
        return
    for r in prange(n_rows, nogil=True, schedule="static", num_threads=n_threads):
        for blk in range(n_blocks):
            dequantize_block(kind, &codes[r, blk * block_bytes], &out[r, blk * QK])
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
