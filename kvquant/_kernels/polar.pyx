# PolarQuant ("polar<b>"): randomized Hadamard rotation, recursive pairwise polar transform, one
# code per angle written LSB first through a bit cursor, level 1 first. docs/reference.md §1.4 and
# docs/engine-arithmetic.md §4.
#
# Three modes share the transform and the layout (level l starts at bit level_starts[l]):
#   MODE_ENGINE_GRID   the engine's uniform floor-and-clamp grids, fixed widths per level; every
#                      float operation in the engine's order (atan2f, hypotf, floorf, cosf, sinf,
#                      the float PI constant) so that its codec 0 is reproduced bit for bit;
#   MODE_LLOYD_LEVEL   Lloyd-Max centroids per level, fixed widths per level;
#   MODE_LLOYD_RADIUS  Lloyd-Max centroids, each level's bits split among its angles by the
#                      decoded sub-radii, all in fixed-point integers derived from the codes
#                      (allocate_bits, polarops.h), so encoder and decoder agree exactly.
# The decoder rebuilds rows with polarops.h from cos/sin tables (angle_tables), as the attention
# consumers do (consumers_polar.h).
# The forward transform computes no angle with libm unless it must (polar_encode.h): every
# quantizer above is monotone in the float angle, so a bracket around atan2f decides the code; an
# angle within a hair of a code boundary is computed with atan2f. The Lloyd codes come from bucket
# tables (rowops.h, built once per codebook). The codes are those of the libm angles, bit for bit.
# The norm is accumulated in double and is the stored radius; the inert rule is the engine's.
# Magnitudes (docs/engine-arithmetic.md §8): a row whose butterflies overflow is refused in grid
# (compat) mode (ROW_RANGE: the engine would store garbage) and otherwise rotated from a copy
# scaled by 2^-64 (the angles do not depend on the scale); the decoder unrotates overflow-safe.
from cython.parallel cimport parallel, prange
from libc.math cimport atan2f, floorf, cosf, sinf, sqrt, sqrtf, isfinite, NAN
from libc.float cimport FLT_MAX
from libc.stdint cimport uint8_t, int32_t, int64_t, uint32_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset

import numpy as np

from kvquant._kernels import consumers
from kvquant._kernels.lloyd import ROWOPS_PATHS
from kvquant._kernels._common cimport (
    PRESCALE, ROW_RANGE, kvq_all_finite, kvq_rotate_scale_row_prescaled, kvq_unrotate_row_safe,
    live_radius)

cdef extern from "rowops.h" nogil:
    double kvq_sum_squares(const float* x, Py_ssize_t n, int in_index_order)
    void kvq_sum_squares_rows(const float* x, Py_ssize_t m, Py_ssize_t n, double* out)
    void kvq_rotate_scale_row(const float* x, const float* signs, Py_ssize_t n, float inv_sqrt_n,
                              float to_unit, float* y)
    int kvq_code_lookup(const float* table, float v)
    int CODE_TABLE_HEADER "KVQ_CODE_TABLE_HEADER"
    int kvq_rowops_set_path(int path)

cdef extern from "polar_encode.h" nogil:
    int kvq_polar_portable
    int kvq_polar_forward_level(const float* x, Py_ssize_t half, float* r, float* lo, float* hi,
                                double* r2)
    void kvq_polar_forward_row(float* tree, Py_ssize_t n, float* lo, float* hi, double* r2)
    int POLAR_COLS "KVQ_POLAR_COLS"
    int POLAR_COL_ROWS "KVQ_POLAR_COL_ROWS"
    int POLAR_COL_LO "KVQ_POLAR_COL_LO"
    int POLAR_COL_SCALE "KVQ_POLAR_COL_SCALE"
    int POLAR_COL_TOP "KVQ_POLAR_COL_TOP"
    int POLAR_COL_WINDOW "KVQ_POLAR_COL_WINDOW"
    int POLAR_COL_START "KVQ_POLAR_COL_START"
    int POLAR_COL_BVAL "KVQ_POLAR_COL_BVAL"
    Py_ssize_t kvq_polar_lloyd_codes(const float* lo, const float* hi, Py_ssize_t cnt,
                                     const uint8_t* width, const float* tables, Py_ssize_t stride,
                                     const float* cols, uint8_t* code, int32_t* undecided)
    void kvq_polar_pack(const uint8_t* code, const uint8_t* width, Py_ssize_t n, uint8_t* row)

# The radius allocation and the row rebuild are shared with the attention consumers
# (consumers_polar.h): one implementation, the same bits.
from kvquant._kernels._polarops cimport (
    kvq_polar_allocate_bits, kvq_polar_allocate_near, kvq_polar_child_weights, kvq_polar_layout,
    kvq_polar_live, kvq_polar_near_off,
    kvq_polar_rebuild_row, kvq_polar_scratch, kvq_polar_scratch_alloc, kvq_polar_scratch_free,
    polar_layout)

cdef enum:
    MODE_ENGINE_GRID = 0
    MODE_LLOYD_LEVEL = 1
    MODE_LLOYD_RADIUS = 2

cdef enum:
    MAX_ANGLE_BITS = 8
    MAX_LEVELS = 31
    NORM_ROWS = 4     # rows whose norms the encoder sums side by side (kvq_sum_squares_rows)

# Float constants as typed floats: an untyped literal such as 0.5 is a C double and would pull
# the engine's float expressions into double precision.
cdef float PI_F = 3.14159265358979
cdef float F_HALF = 0.5
cdef float F_QUARTER = 0.25
cdef float F_ONE_AND_HALF = 1.5
cdef float F_TWO = 2.0


# -- the engine's grids ----------------------------------------------------------------------

cdef inline int engine_code_level1(float ang, float inv_two_pi, float scale,
                                   int max_code) noexcept nogil:
    cdef float u = (ang + PI_F) * inv_two_pi
    cdef int q = <int>floorf(u * scale)
    if q < 0:
        q = 0
    if q > max_code:
        q = max_code
    return q


cdef inline float engine_centre_level1(int q, float scale) noexcept nogil:
    return -PI_F + (((<float>q + F_HALF) * (F_TWO * PI_F)) / scale)


cdef inline int engine_code_deep(float ang, float lo, float two_w, float scale,
                                 int max_code) noexcept nogil:
    cdef float u = (ang - lo) / two_w
    cdef int q = <int>floorf(u * scale)
    if q < 0:
        q = 0
    if q > max_code:
        q = max_code
    return q


cdef inline float engine_centre_deep(int q, float lo, float two_w, float scale) noexcept nogil:
    return lo + (((<float>q + F_HALF) * two_w) / scale)


cdef void engine_grid(int n_levels, float* lo, float* two_w) noexcept nogil:
    """Per deeper level: s = 2^(l-1); w = min(1.5/sqrtf(s), pi/4); lo = pi/4 - w (floats)."""
    cdef int level
    cdef float s, w, quarter_pi = F_QUARTER * PI_F
    for level in range(2, n_levels + 1):
        s = <float>(1 << (level - 1))
        w = F_ONE_AND_HALF / sqrtf(s)
        if not (w < quarter_pi):
            w = quarter_pi
        lo[level] = quarter_pi - w
        two_w[level] = F_TWO * w


# -- the code of one angle ----------------------------------------------------------------------

cdef inline int angle_code(float ang, int mode, int level, int b, const float* table,
                           float inv_two_pi, float lo, float two_w) noexcept nogil:
    """The code of a float angle at `level` with width b: the engine's grid or the Lloyd
    centroid (number of boundaries strictly below it, ties to the lower one; `table` is the
    bucket table of the (level, b) boundaries). Monotone in `ang`."""
    if mode == MODE_ENGINE_GRID:
        if level == 1:
            return engine_code_level1(ang, inv_two_pi, <float>(1 << b), (1 << b) - 1)
        return engine_code_deep(ang, lo, two_w, <float>(1 << b), (1 << b) - 1)
    if b == 0:
        return 0
    return kvq_code_lookup(table, ang)


# -- encode ----------------------------------------------------------------------------------

_portable_forced = False


def set_portable(bint portable):
    """True: this module's encoder skips its AVX-512 helpers (the vector Lloyd codes, the
    allocation's candidate scan) and runs the portable code, as on a CPU without AVX-512; False:
    the automatic choice. For tests: both must give the same bits."""
    global _portable_forced
    _portable_forced = bool(portable)
    _follow_simd()


cdef int _follow_simd() except -1:
    """Set the row kernels' path to the consumers' current one (consumers.set_simd,
    KVQUANT_SIMD); the AVX-512 helpers run only on the AVX-512 path and without set_portable.
    Returns the path that runs."""
    global kvq_polar_portable
    cdef int path = kvq_rowops_set_path(ROWOPS_PATHS[consumers.get_simd()])
    kvq_polar_portable = 1 if _portable_forced or path < 2 else 0
    return path


def boundary_columns(const float[:, :, ::1] boundaries,     # IN (n_levels + 1, 9, 256)
                     const float[:, :, ::1] code_tables):   # IN (n_levels + 1, 9, L)
    """The column tables of polar_encode.h, float32 (n_levels + 1, KVQ_POLAR_COL_ROWS, 16). Entry
    [level, k, w] for k < KVQ_POLAR_COLS is boundary k of width w at that level, +inf past the
    width's 2**w - 1 boundaries, for lanes w > 8, and for a width whose bucket table is the empty
    one (every angle code 0: a width without a complete codebook). The rows after them hold the
    header of each width's bucket table (lanes w > 8: width 0's): lo, scale, n_buckets - 1,
    window, and the offsets of its starts and of its boundaries in the level's tables."""
    cdef Py_ssize_t n_lev = boundaries.shape[0], stride = code_tables.shape[2], level, w, k, ww
    out = np.full((n_lev, POLAR_COL_ROWS, 16), np.inf, np.float32)
    cdef float[:, :, ::1] o = out
    for level in range(n_lev):
        for w in range(1, MAX_ANGLE_BITS + 1):
            # the empty table (rowops.h layout, window 0) gives code 0 whatever the value
            if code_tables[level, w, 3] == 0.0:
                continue
            for k in range(min(POLAR_COLS, (1 << w) - 1)):
                o[level, k, w] = boundaries[level, w, k]
        for w in range(16):
            ww = w if w <= MAX_ANGLE_BITS else 0
            o[level, POLAR_COL_LO, w] = code_tables[level, ww, 0]
            o[level, POLAR_COL_SCALE, w] = code_tables[level, ww, 1]
            o[level, POLAR_COL_TOP, w] = code_tables[level, ww, 2] - <float>1.0
            o[level, POLAR_COL_WINDOW, w] = code_tables[level, ww, 3]
            o[level, POLAR_COL_START, w] = <float>(ww * stride + CODE_TABLE_HEADER)
            o[level, POLAR_COL_BVAL, w] = <float>(ww * stride + CODE_TABLE_HEADER
                                                  + <Py_ssize_t>code_tables[level, ww, 2])
    return out


def encode_rows(const float[:, ::1] X,                 # IN  (n_rows, n), n a power of two
                const float[::1] signs,                # IN  (n,) +-1
                int mode,                              # MODE_*
                const int32_t[::1] level_bits,         # IN  (n_levels + 1,) fixed widths
                const int32_t[::1] level_totals,       # IN  (n_levels + 1,) bits per level
                const float[:, :, ::1] code_tables,    # IN  (n_levels + 1, 9, L) Lloyd
                boundary_cols,                         # IN  boundary_columns(); None: engine grid
                const int32_t[:, :, ::1] log2_cos2,    # IN  (n_levels + 1, 9, 256)
                const int32_t[:, :, ::1] log2_sin2,    # IN  (n_levels + 1, 9, 256)
                const int32_t[:, ::1] gains,           # IN  (n_levels + 1, 8)
                uint8_t[:, ::1] codes,                 # OUT (n_rows, code_bytes)
                float[::1] side,                       # OUT (n_rows,) radius = norm
                uint8_t[::1] status,                   # OUT (n_rows,) ROW_* codes
                int n_threads):
    cdef Py_ssize_t n_rows = X.shape[0], n = X.shape[1], code_bytes = codes.shape[1]
    cdef Py_ssize_t r, i, j, k, off, cnt, n_undecided
    cdef int n_levels = level_bits.shape[0] - 1, level, b, q
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf(<float>n)
    cdef float inv_two_pi = F_HALF / PI_F
    cdef float grid_lo[MAX_LEVELS + 1]
    cdef float grid_two_w[MAX_LEVELS + 1]
    cdef double norm2
    cdef float radius
    cdef float* y
    cdef float* tree
    cdef float* ang_lo
    cdef float* ang_hi
    cdef double* r2
    cdef int32_t* undecided
    cdef uint8_t* code
    cdef uint8_t* width
    cdef int32_t* weight
    cdef int32_t* child
    cdef int32_t* swap
    cdef int32_t* cur_w
    cdef uint32_t* keys
    cdef int32_t* next_w
    cdef uint8_t* row
    cdef double* norms
    cdef Py_ssize_t* norms_first
    if n_rows == 0:
        return
    _follow_simd()
    engine_grid(n_levels, grid_lo, grid_two_w)
    # the boundary columns of the vector code path (polar_encode.h), built once by the codec
    cdef const float[:, :, ::1] cols
    cdef const float* cols_p = NULL
    if mode != MODE_ENGINE_GRID:
        cols = boundary_cols
        cols_p = &cols[0, 0, 0]
    # below `safe` the rotation's partial sums (at most sqrt(n) x the norm) cannot overflow
    cdef float safe = (FLT_MAX / <float>4.0) / sqrtf(<float>n)
    with nogil, parallel(num_threads=n_threads):
        # tree: the inputs of every level, level 1 (the rotated row) first; level l's pairs
        # start at 2 * (n - (n >> (l - 1))), its angles' brackets at n - (n >> (l - 1))
        tree = <float*>malloc(2 * n * sizeof(float))
        y = tree
        ang_lo = <float*>malloc(n * sizeof(float))
        ang_hi = <float*>malloc(n * sizeof(float))
        r2 = <double*>malloc(n * sizeof(double))
        undecided = <int32_t*>malloc(n * sizeof(int32_t))
        code = <uint8_t*>malloc(n * sizeof(uint8_t))
        width = <uint8_t*>malloc(n * sizeof(uint8_t))
        weight = <int32_t*>malloc(n * sizeof(int32_t))
        child = <int32_t*>malloc(n * sizeof(int32_t))
        keys = <uint32_t*>malloc(MAX_ANGLE_BITS * n * sizeof(uint32_t))
        # the norms of this thread's next NORM_ROWS rows, from row norms_first[0]
        norms = <double*>malloc(NORM_ROWS * sizeof(double))
        norms_first = <Py_ssize_t*>malloc(sizeof(Py_ssize_t))
        norms_first[0] = -NORM_ROWS
        for r in prange(n_rows, schedule="static"):
            row = &codes[r, 0]
            memset(row, 0, code_bytes)
            # the engine's norm (double sum in index order; NORM_ROWS rows side by side) and
            # rotation (signs, butterflies, x 1/sqrtf(n); the extra x 1.0f changes no bit)
            if r < norms_first[0] or r >= norms_first[0] + NORM_ROWS:
                norms_first[0] = r
                kvq_sum_squares_rows(&X[r, 0], min(<Py_ssize_t>NORM_ROWS, n_rows - r), n, norms)
            norm2 = norms[r - norms_first[0]]
            radius = live_radius(norm2, &status[r])   # assigned here: private per thread
            if radius == 0.0:
                # zero, tiny or non-finite norm: an inert row (zero codes, radius 0)
                side[r] = 0.0
                continue
            kvq_rotate_scale_row(&X[r, 0], &signs[0], n, inv_sqrt_n, <float>1.0, y)
            if radius > safe and not kvq_all_finite(y, n):
                if mode == MODE_ENGINE_GRID:
                    # the engine's float32 rotation overflows: it would store garbage codes
                    status[r] = ROW_RANGE
                    side[r] = 0.0
                    continue
                kvq_rotate_scale_row_prescaled(&X[r, 0], &signs[0], n, inv_sqrt_n, <float>1.0,
                                               PRESCALE, y)
            # forward transform: level 1's brackets at [0 .. n/2), then each level after the
            # previous; a level holding a non-finite value takes libm's radii and its brackets
            # open wide (every angle then goes to atan2f)
            kvq_polar_forward_row(tree, n, ang_lo, ang_hi, r2)
            # quantize, top level first (the radius allocation needs the levels above)
            # per-row pointers: the thread's buffers stay put, only these swap
            cur_w = weight
            next_w = child
            cur_w[0] = 0
            for level in range(n_levels, 0, -1):
                cnt = n >> level
                off = n - (n >> (level - 1))
                if mode == MODE_LLOYD_RADIUS:
                    kvq_polar_allocate_bits(cur_w, cnt, &gains[level, 0], level_totals[level],
                                            keys, &width[off])
                else:
                    for j in range(cnt):
                        width[off + j] = <uint8_t>level_bits[level]
                if mode == MODE_ENGINE_GRID:
                    n_undecided = 0
                    for j in range(cnt):
                        q = angle_code(ang_lo[off + j], mode, level, width[off + j], NULL,
                                       inv_two_pi, grid_lo[level], grid_two_w[level])
                        code[off + j] = <uint8_t>q
                        undecided[n_undecided] = <int32_t>j
                        if q != angle_code(ang_hi[off + j], mode, level, width[off + j], NULL,
                                           inv_two_pi, grid_lo[level], grid_two_w[level]):
                            n_undecided = n_undecided + 1
                else:
                    n_undecided = kvq_polar_lloyd_codes(
                        &ang_lo[off], &ang_hi[off], cnt, &width[off], &code_tables[level, 0, 0],
                        code_tables.shape[2], cols_p + level * POLAR_COL_ROWS * 16, &code[off],
                        undecided)
                for k in range(n_undecided):
                    # a code boundary inside the bracket: libm's angle decides
                    j = undecided[k]
                    b = width[off + j]
                    code[off + j] = <uint8_t>angle_code(
                        atan2f(tree[2 * off + 2 * j + 1], tree[2 * off + 2 * j]), mode, level, b,
                        &code_tables[level, b, 0], inv_two_pi, grid_lo[level], grid_two_w[level])
                if mode == MODE_LLOYD_RADIUS and level > 1:
                    kvq_polar_child_weights(cur_w, cnt, &width[off], &code[off],
                                            &log2_cos2[level, 0, 0], &log2_sin2[level, 0, 0],
                                            next_w)
                    swap = cur_w
                    cur_w = next_w
                    next_w = swap
            kvq_polar_pack(code, width, n - 1, row)
            side[r] = radius
        free(tree)
        free(ang_lo)
        free(ang_hi)
        free(r2)
        free(undecided)
        free(code)
        free(width)
        free(weight)
        free(child)
        free(keys)
        free(norms)
        free(norms_first)


# -- decode ----------------------------------------------------------------------------------

def angle_tables(int mode,
                 const float[:, :, ::1] centroids,      # IN  (n_levels + 1, 9, 256) Lloyd
                 float[:, :, ::1] cos_out,              # OUT (n_levels + 1, 9, 256)
                 float[:, :, ::1] sin_out):             # OUT (n_levels + 1, 9, 256)
    """cosf and sinf of the decode angle of every (level, width, code): the engine's bin centre
    (grid mode) or the stored centroid, with the decoder's float expressions. Built once per
    codec: the decoder and the consumers multiply by these entries instead of evaluating angles
    per row. The 256 entries of a (level, width) repeat with period 2**width, so that a vector
    lookup may ignore the index bits above the code. Level 0 is unused (zeros)."""
    cdef int n_levels = cos_out.shape[0] - 1, level, b, q
    cdef float grid_lo[MAX_LEVELS + 1]
    cdef float grid_two_w[MAX_LEVELS + 1]
    cdef float theta
    cos_out[:, :, :] = 0
    sin_out[:, :, :] = 0
    engine_grid(n_levels, grid_lo, grid_two_w)
    for level in range(1, n_levels + 1):
        for b in range(MAX_ANGLE_BITS + 1):
            for q in range(1 << b):
                if mode == MODE_ENGINE_GRID:
                    if level == 1:
                        theta = engine_centre_level1(q, <float>(1 << b))
                    else:
                        theta = engine_centre_deep(q, grid_lo[level], grid_two_w[level],
                                                   <float>(1 << b))
                else:
                    theta = centroids[level, b, q]
                cos_out[level, b, q] = cosf(theta)
                sin_out[level, b, q] = sinf(theta)
            for q in range(1 << b, 256):
                cos_out[level, b, q] = cos_out[level, b, q & ((1 << b) - 1)]
                sin_out[level, b, q] = sin_out[level, b, q & ((1 << b) - 1)]


def decode_rows(const uint8_t[:, ::1] codes,           # IN  (n_rows, code_bytes)
                const float[::1] side,                 # IN  (n_rows,) radius
                const float[::1] signs,                # IN  (n,)
                int mode,
                const int32_t[::1] level_bits,         # IN  (n_levels + 1,)
                const int32_t[::1] level_totals,       # IN  (n_levels + 1,)
                const int32_t[::1] level_starts,       # IN  (n_levels + 1,) first bit of a level
                const float[:, :, ::1] cos_tab,        # IN  (n_levels + 1, 9, 256) angle_tables
                const float[:, :, ::1] sin_tab,        # IN
                const int32_t[:, :, ::1] log2_cos2,    # IN  (n_levels + 1, 9, 256)
                const int32_t[:, :, ::1] log2_sin2,    # IN
                const int32_t[:, ::1] gains,           # IN  (n_levels + 1, 8)
                float[:, ::1] out,                     # OUT (n_rows, n)
                int n_threads):
    """Top-down rebuild (polarops.h, the consumers' too), then unrotate."""
    cdef Py_ssize_t n_rows = out.shape[0], n = out.shape[1]
    cdef Py_ssize_t r, i
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf(<float>n)
    cdef kvq_polar_layout L
    cdef kvq_polar_scratch* scratch
    cdef float* buf
    cdef float* copy
    if n_rows == 0:
        return
    _follow_simd()
    polar_layout(&L, n, mode, level_bits, level_totals, level_starts, cos_tab, sin_tab, log2_cos2,
                 log2_sin2, gains)
    with nogil, parallel(num_threads=n_threads):
        # assigned in the parallel block: one scratch per thread
        scratch = <kvq_polar_scratch*>malloc(sizeof(kvq_polar_scratch))
        if scratch != NULL and kvq_polar_scratch_alloc(scratch, n) != 0:
            free(scratch)
            scratch = NULL
        copy = <float*>malloc(n * sizeof(float))
        if copy == NULL and scratch != NULL:
            kvq_polar_scratch_free(scratch)
            free(scratch)
            scratch = NULL
        for r in prange(n_rows, schedule="static"):
            buf = &out[r, 0]
            if scratch == NULL or not kvq_polar_live(side[r]):
                # inert row (also a damaged side value: never decoded as data); NaN if memory
                # for the scratch was short (kernels do not raise)
                for i in range(n):
                    buf[i] = 0.0 if scratch != NULL else NAN
                continue
            kvq_polar_rebuild_row(&L, &codes[r, 0], side[r], scratch, buf)
            kvq_unrotate_row_safe(buf, &signs[0], n, inv_sqrt_n, copy)
        if scratch != NULL:
            kvq_polar_scratch_free(scratch)
            free(scratch)
        free(copy)


# -- the forward transform, exposed for tests -------------------------------------------------

def forward_level(const float[::1] x,     # IN  (2 * half,) pairs (a, c)
                  float[::1] radius,      # OUT (half,) hypotf(a, c)
                  float[::1] lo,          # OUT (half,) brackets around atan2f(c, a)
                  float[::1] hi):         # OUT (half,)
    """One level of the encoder's forward transform (polar_encode.h); True when a value was
    not finite (the encoder then redoes the level with libm)."""
    cdef Py_ssize_t half = radius.shape[0]
    cdef double* r2
    cdef int bad
    if half == 0:
        return False
    r2 = <double*>malloc(half * sizeof(double))
    if r2 == NULL:
        raise MemoryError()
    bad = kvq_polar_forward_level(&x[0], half, &radius[0], &lo[0], &hi[0], r2)
    free(r2)
    return bool(bad)


def forward_row(float[::1] tree,          # IN/OUT (2 * n,) the row in [0, n); the levels' radii after
                float[::1] lo,            # OUT (n - 1,) brackets of every level's angles
                float[::1] hi):           # OUT (n - 1,)
    """The encoder's whole forward transform of one row (polar_encode.h): level l's inputs at
    tree[2 (n - (n >> (l - 1))) ...), its radii right after them, its brackets at
    lo, hi [n - (n >> (l - 1)) ...); a level holding a non-finite value takes hypotf's radii and
    brackets [-4, 4]."""
    cdef Py_ssize_t n = tree.shape[0] // 2
    cdef double* r2
    if n < 2:
        return
    r2 = <double*>malloc(n * sizeof(double))
    if r2 == NULL:
        raise MemoryError()
    kvq_polar_forward_row(&tree[0], n, &lo[0], &hi[0], r2)
    free(r2)


def allocate_bits(const int32_t[::1] weight,   # IN  (cnt,) a level's weights (2^16 log2 r^2)
                  const int32_t[::1] gain,     # IN  (8,) strictly decreasing
                  Py_ssize_t total,            # bits of the level
                  uint8_t[::1] width):         # OUT (cnt,)
    """The radius allocation of one level (polarops.h), exposed for tests: giving angle j its
    (k+1)-th bit is worth weight[j] + gain[k]; the `total` largest keys win, ties to the lower
    index; width[j] is how many of angle j's keys won."""
    cdef Py_ssize_t cnt = weight.shape[0]
    cdef uint32_t* keys
    if cnt == 0:
        return
    keys = <uint32_t*>malloc((MAX_ANGLE_BITS * cnt + 16) * sizeof(uint32_t))
    if keys == NULL:
        raise MemoryError()
    kvq_polar_allocate_bits(&weight[0], cnt, &gain[0], total, keys, &width[0])
    free(keys)


def allocate_near(const int32_t[::1] weight,   # IN  (cnt,) a level's weights
                  const int32_t[::1] gain,     # IN  (8,) strictly decreasing
                  Py_ssize_t total,            # bits of the level
                  uint8_t[::1] width):         # OUT (cnt,) set only when it returns 1
    """The AVX-512 allocation from the guess at the mean weight alone (polarops.h), for tests:
    1 when it gave the widths, 0 when it leaves the level to the search, -1 when it cannot run
    here (no AVX-512 build or CPU, cnt not a power of two in [2, 256], total outside
    (0, 8 cnt))."""
    if weight.shape[0] != width.shape[0] or gain.shape[0] != MAX_ANGLE_BITS:
        raise ValueError("allocate_near: width must match weight, and gain hold 8 values")
    if weight.shape[0] == 0:
        return -1
    return kvq_polar_allocate_near(&weight[0], weight.shape[0], &gain[0], total, &width[0])


def set_near_guess(bint on):
    """False: this module's AVX-512 allocation (encoder and decoder) always runs its bracket
    search instead of first trying the guess at the mean weight; True: the default. For tests:
    both must give the same bits."""
    global kvq_polar_near_off
    kvq_polar_near_off = 0 if on else 1


# -- the engine's grids, exposed for tests ---------------------------------------------------

def engine_grid_centres(int level,
                        int bits,
                        float[::1] out):          # OUT (2**bits,) decode value of each code
    cdef float lo[MAX_LEVELS + 1]
    cdef float two_w[MAX_LEVELS + 1]
    cdef int q
    engine_grid(level, lo, two_w)
    for q in range(1 << bits):
        if level == 1:
            out[q] = engine_centre_level1(q, <float>(1 << bits))
        else:
            out[q] = engine_centre_deep(q, lo[level], two_w[level], <float>(1 << bits))


def engine_grid_codes(int level,
                      int bits,
                      const float[::1] angles,    # IN  (m,)
                      int32_t[::1] out):          # OUT (m,) floor-then-clamp code of each angle
    cdef float lo[MAX_LEVELS + 1]
    cdef float two_w[MAX_LEVELS + 1]
    cdef Py_ssize_t i
    engine_grid(level, lo, two_w)
    for i in range(angles.shape[0]):
        if level == 1:
            out[i] = engine_code_level1(angles[i], F_HALF / PI_F, <float>(1 << bits),
                                        (1 << bits) - 1)
        else:
            out[i] = engine_code_deep(angles[i], lo[level], two_w[level], <float>(1 << bits),
                                      (1 << bits) - 1)
