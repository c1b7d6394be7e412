# Rotated scalar codec ("tq<b>"): randomized Hadamard rotation, per-row radius, nearest level of a
# b-bit Lloyd-Max codebook (rowops.h: a search tree in vector registers from 5 to 8 bits where
# AVX-512 is there, else counted compares up to 31 boundaries and a bucket table above), codes
# bit-packed LSB first. docs/reference.md §1.2-1.3 and §2.
# The vector path (AVX-512, AVX2 or the baseline's 4 lanes) follows the consumers' choice
# (consumers.set_simd, KVQUANT_SIMD); every path gives the same bytes.
# The float operations follow the engine's order so that its 4-bit codec is reproduced bit for bit:
# the rotation's 1/sqrtf(n) and the scaling sqrtf(n)/norm are separate float multiplies, and the
# decoder divides the radius by sqrtf(n).
# Magnitudes (docs/engine-arithmetic.md §8): a row whose butterflies overflow is refused under
# compat (ROW_RANGE: the engine would store garbage) and otherwise rotated from a copy scaled by
# 2^-64 (the same codes as exact arithmetic); a row whose decoded norm would pass 3.4e38f is
# refused (ROW_RANGE), so that every stored row decodes and reads finite.
from cython.parallel cimport parallel, prange
from libc.math cimport sqrt, sqrtf
from libc.float cimport FLT_MAX
from libc.stdint cimport uint8_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset

import numpy as np

from kvquant._kernels import consumers
from kvquant._kernels._common cimport (
    PRESCALE, ROW_LIMIT, ROW_RANGE, kvq_all_finite, kvq_rotate_scale_row_prescaled, live_radius)


cdef extern from "rowops.h" nogil:
    double kvq_sum_squares(const float* x, Py_ssize_t n, int in_index_order)
    void kvq_rotate_scale_row(const float* x, const float* signs, Py_ssize_t n, float inv_sqrt_n,
                              float to_unit, float* y)
    void kvq_pack_codes(const uint8_t* code, Py_ssize_t n, int bits, uint8_t* out)
    void kvq_unpack_codes(const uint8_t* packed, Py_ssize_t n, int bits, uint8_t* code)
    void kvq_decode_row(const uint8_t* code, Py_ssize_t n, const float* levels, float step,
                        const float* signs, float inv_sqrt_n, float* out, float* copy)
    ctypedef struct kvq_code_plan:
        pass
    int kvq_code_plan_build(const float* bnd, Py_ssize_t n_bnd, kvq_code_plan* plan)
    void kvq_nearest_codes(const float* y, Py_ssize_t n, const float* bnd, int n_bnd,
                           const float* table, const kvq_code_plan* plan, uint8_t* code)
    Py_ssize_t kvq_code_table_plan(const float* bnd, Py_ssize_t n_bnd, Py_ssize_t* n_buckets,
                                   Py_ssize_t* window, float* lo, float* scale)
    void kvq_code_table_build(const float* bnd, Py_ssize_t n_bnd, float* table)
    void kvq_nearest_by_distance(const float* y, Py_ssize_t n, const float* levels, int n_levels,
                                 float* best_d, uint8_t* code)
    int kvq_rowops_set_path(int path)
    void kvq_fwht(float* y, Py_ssize_t n)

# the row kernels' path (rowops.h: 0 baseline, 1 AVX2, 2 AVX-512) for each of the consumers'
# (also read by polar.pyx)
ROWOPS_PATHS = {"portable": 0, "avx2": 1, "avx512": 2, "avx512vbmi": 2}
_ROWOPS_NAMES = ("portable", "avx2", "avx512")


cdef int _follow_simd() except -1:
    """Set the row kernels' path to the consumers' current one; returns the path that runs."""
    return kvq_rowops_set_path(ROWOPS_PATHS[consumers.get_simd()])


def encoder_simd():
    """The vector path the encoders of this module run now: ``"avx512"``, ``"avx2"`` or
    ``"portable"`` (the consumers' choice, ``consumers.set_simd``, as far as rows need it)."""
    return _ROWOPS_NAMES[_follow_simd()]


def code_table(const float[::1] boundaries):   # IN (n_bnd,) ascending, finite
    """The bucket table of kvq_nearest_codes (rowops.h) for these boundaries, float32 (length,).

    Built once per codebook; an encoder with more than 31 boundaries reads it instead of
    searching."""
    cdef Py_ssize_t n_bnd = boundaries.shape[0], n_buckets, window
    cdef float lo, scale
    if n_bnd == 0:
        raise ValueError("a code table needs at least one boundary")
    table = np.empty(kvq_code_table_plan(&boundaries[0], n_bnd, &n_buckets, &window, &lo, &scale),
                     np.float32)
    cdef float[::1] t = table
    kvq_code_table_build(&boundaries[0], n_bnd, &t[0])
    return table


def nearest_codes(const float[::1] y,            # IN  (n,)
                  const float[::1] boundaries,   # IN  (n_bnd,) ascending
                  const float[::1] table,        # IN  code_table(boundaries)
                  uint8_t[::1] out,              # OUT (n,) #{boundaries < y}, NaN -> 0
                  bint search_tree=True):
    """The encoder's nearest-level rule on a vector (exposed for tests of every path).

    With ``search_tree`` the vector search tree of rowops.h runs where it can (AVX-512, 16 to 255
    boundaries), as in the encoder; without it only the counted compares and the bucket table.
    Returns whether the search tree ran."""
    cdef kvq_code_plan* plan = NULL
    cdef bint use_plan = False
    if y.shape[0] == 0:
        return False
    _follow_simd()
    if search_tree:
        plan = <kvq_code_plan*>malloc(sizeof(kvq_code_plan))
        if plan == NULL:
            raise MemoryError()
        use_plan = kvq_code_plan_build(&boundaries[0], boundaries.shape[0], plan)
    kvq_nearest_codes(&y[0], y.shape[0], &boundaries[0], boundaries.shape[0], &table[0],
                      plan if use_plan else NULL, &out[0])
    free(plan)
    return use_plan and y.shape[0] >= 16


def fwht(float[::1] y):                         # IN/OUT (n,) n a power of two
    """The unnormalized Walsh-Hadamard transform of the encoders, in place, on the path that
    runs (exposed for tests of every path)."""
    _follow_simd()
    if y.shape[0] > 0:
        kvq_fwht(&y[0], y.shape[0])


def pack_codes(const uint8_t[::1] code,         # IN  (n,) codes < 2**bits
               int bits,
               uint8_t[::1] out):               # OUT (>= ceil(n*bits/8),) only those written
    """The encoder's packer on one row (exposed for tests: bits and the bytes it touches)."""
    if out.shape[0] < (code.shape[0] * bits + 7) // 8:
        raise ValueError("out holds fewer than ceil(n * bits / 8) bytes")
    if code.shape[0] > 0:
        kvq_pack_codes(&code[0], code.shape[0], bits, &out[0])


def unpack_codes(const uint8_t[::1] packed,     # IN  (ceil(n*bits/8),) exactly the row
                 int bits,
                 uint8_t[::1] code):            # OUT (n,)
    """The decoder's unpacker on one row (exposed for tests)."""
    if packed.shape[0] != (code.shape[0] * bits + 7) // 8:
        raise ValueError("packed must hold exactly ceil(n * bits / 8) bytes")
    if code.shape[0] > 0:
        kvq_unpack_codes(&packed[0], code.shape[0], bits, &code[0])


def encode_rows(const float[:, ::1] X,          # IN  (n_rows, n), n a power of two
                const float[::1] signs,         # IN  (n,) +-1
                const float[::1] levels,        # IN  (2**bits,) ascending, N(0,1) units
                const float[::1] boundaries,    # IN  (2**bits - 1,) ascending
                const float[::1] table,         # IN  code_table(boundaries)
                int bits,
                bint unbiased,                  # side = |x|^2/<x, x^_unit> instead of |x|
                bint by_distance,               # engine's distance scan instead of boundaries
                uint8_t[:, ::1] codes,          # OUT (n_rows, ceil(n*bits/8))
                float[::1] side,                # OUT (n_rows,)
                uint8_t[::1] status,            # OUT (n_rows,) ROW_* codes
                int n_threads):
    cdef Py_ssize_t n_rows = X.shape[0], n = X.shape[1], code_bytes = codes.shape[1]
    cdef Py_ssize_t r, i
    cdef int n_bnd = boundaries.shape[0], n_levels = levels.shape[0]
    cdef float sqrtf_n = sqrtf(<float>n)
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf_n
    cdef double norm2, dot, lev2
    cdef float radius, to_unit, max_level = 0.0
    cdef float* y
    cdef float* scratch
    cdef uint8_t* c
    if n_rows == 0:
        return
    _follow_simd()
    for i in range(n_levels):
        max_level = max(max_level, abs(levels[i]))
    # Below `safe` the rotation's partial sums (at most sqrt(n) x the norm) cannot overflow; below
    # `safe_side` the decoded norm (at most side x the largest level) cannot pass ROW_LIMIT.
    cdef float safe = (FLT_MAX / <float>4.0) / sqrtf_n
    cdef float safe_side = ROW_LIMIT / max(max_level, <float>1.0)
    # the vector search tree of the nearest level, built once per call (NULL: the other paths)
    cdef kvq_code_plan* plan = NULL
    if not by_distance:
        plan = <kvq_code_plan*>malloc(sizeof(kvq_code_plan))
        if plan == NULL:
            raise MemoryError()
        if not kvq_code_plan_build(&boundaries[0], n_bnd, plan):
            free(plan)
            plan = NULL
    with nogil, parallel(num_threads=n_threads):
        y = <float*>malloc(n * sizeof(float))
        scratch = <float*>malloc(n * sizeof(float))
        c = <uint8_t*>malloc(n * sizeof(uint8_t))
        for r in prange(n_rows, schedule="static"):
            norm2 = kvq_sum_squares(&X[r, 0], n, by_distance)
            radius = live_radius(norm2, &status[r])   # assigned here: private per thread
            if radius == 0.0:
                # zero, tiny or non-finite norm: an inert row (zero codes, radius 0)
                memset(&codes[r, 0], 0, code_bytes)
                side[r] = 0.0
                continue
            to_unit = sqrtf_n / radius
            kvq_rotate_scale_row(&X[r, 0], &signs[0], n, inv_sqrt_n, to_unit, y)
            if radius > safe and not kvq_all_finite(y, n):
                if by_distance:
                    # the engine's float32 rotation overflows: it would store garbage codes
                    status[r] = ROW_RANGE
                    memset(&codes[r, 0], 0, code_bytes)
                    side[r] = 0.0
                    continue
                kvq_rotate_scale_row_prescaled(&X[r, 0], &signs[0], n, inv_sqrt_n,
                                               sqrtf_n / (radius * PRESCALE), PRESCALE, y)
            if by_distance:
                kvq_nearest_by_distance(y, n, &levels[0], n_levels, scratch, c)
            else:
                kvq_nearest_codes(y, n, &boundaries[0], n_bnd, &table[0], plan, c)
            kvq_pack_codes(c, n, bits, &codes[r, 0])
            if unbiased:
                # <x, unrotate(level[c])/sqrt(n)> = (norm/n) <y, level[c]>; side = |x|^2 / that
                dot = 0.0
                for i in range(n):
                    dot = dot + <double>y[i] * <double>levels[c[i]]
                side[r] = <float>(n * <double>radius / dot) if dot > 0.0 else radius
            else:
                side[r] = radius
            if not (side[r] <= safe_side):
                # decoded norm = side * rms(level[c]); refuse the row if it or the side value
                # itself (an unbiased side may exceed the norm) passes ROW_LIMIT
                lev2 = 0.0
                for i in range(n):
                    lev2 = lev2 + <double>levels[c[i]] * <double>levels[c[i]]
                if not (side[r] <= ROW_LIMIT
                        and <double>side[r] * sqrt(lev2 / n) <= <double>ROW_LIMIT):
                    status[r] = ROW_RANGE
                    memset(&codes[r, 0], 0, code_bytes)
                    side[r] = 0.0
        free(y)
        free(scratch)
        free(c)
    free(plan)


def decode_rows(const uint8_t[:, ::1] codes,    # IN  (n_rows, ceil(n*bits/8))
                const float[::1] side,          # IN  (n_rows,)
                const float[::1] signs,         # IN  (n,)
                const float[::1] levels,        # IN  (2**bits,)
                int bits,
                float[:, ::1] out,              # OUT (n_rows, n)
                int n_threads):
    cdef Py_ssize_t n_rows = out.shape[0], n = out.shape[1]
    cdef Py_ssize_t r, i
    cdef float sqrtf_n = sqrtf(<float>n)
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf_n
    cdef float step
    cdef uint8_t* c
    cdef float* copy
    if n_rows == 0:
        return
    _follow_simd()
    with nogil, parallel(num_threads=n_threads):
        c = <uint8_t*>malloc(n * sizeof(uint8_t))
        copy = <float*>malloc(n * sizeof(float))
        for r in prange(n_rows, schedule="static"):
            kvq_unpack_codes(&codes[r, 0], n, bits, c)
            if not (side[r] > 0.0) or side[r] > ROW_LIMIT:
                step = 0.0   # inert row (also a damaged side value: never decoded as data)
            else:
                step = side[r] / sqrtf_n
            kvq_decode_row(c, n, &levels[0], step, &signs[0], inv_sqrt_n, &out[r, 0], copy)
        free(c)
        free(copy)
