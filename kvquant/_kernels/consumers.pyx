# Compressed-domain attention consumers: scores s_t = q . x^_t and contexts sum_t w_t x^_t, read
# straight from the stored codes and side values; the cache is never decoded (DESIGN.md, Kernels).
#
# Each codec family brings row kernels (C, in consumers_<family>.h: a portable version, an AVX2
# and an AVX-512 one, chosen at run time; f32, kv8, tq and the ggml blocks also have multi-query
# kernels, consumers_multi.h, that read each row once for all the queries of a call); this module
# runs them over the rows in parallel:
#   scores:  rows in blocks, one prange iteration per block; each score is one row's own sum.
#   context: rows in chunks of CONTEXT_CHUNK (a constant, not a function of the thread count); each
#            chunk sums its rows in order into its own partial vector, and the partials are added
#            in chunk order. So results are the same bits for any thread count, and the portable
#            and AVX-512 paths agree bit for bit (the reduction order is defined in simd.h).
# Kernels never validate; kvquant.codecs does.
import os
import sys

import numpy as np

from cython.parallel cimport parallel, prange
from libc.math cimport sqrtf
from libc.stdint cimport uint8_t, int32_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset

from kvquant._kernels._common cimport kvq_rotate_row_safe, kvq_unrotate_row_safe

cdef extern from "simd.h":
    ctypedef struct kvq_params:
        int64_t n_rows
        int64_t dim
        int64_t code_bytes
        int64_t n_side
        int64_t group
        int bits
        float sqrtf_n
        const float* levels
        const float* table
        const uint8_t* planes
        const float* byte_levels
        int vbmi
        const void* codec
    ctypedef void (*kvq_dot_fn)(const kvq_params* p, const uint8_t* codes, const float* side,
                                int64_t r0, int64_t r1, const float* q,
                                float* out) noexcept nogil
    ctypedef void (*kvq_axpy_fn)(const kvq_params* p, const uint8_t* codes, const float* side,
                                 int64_t r0, int64_t r1, const float* w,
                                 float* acc) noexcept nogil
    ctypedef void (*kvq_dotm_fn)(const kvq_params* p, const uint8_t* codes, const float* side,
                                 int64_t r0, int64_t r1, const float* Q, int m, float* out,
                                 int64_t ldo) noexcept nogil
    ctypedef void (*kvq_axpym_fn)(const kvq_params* p, const uint8_t* codes, const float* side,
                                  int64_t r0, int64_t r1, const float* W, int64_t ldw, int m,
                                  float* acc) noexcept nogil
    int kvq_cpu_simd_level() noexcept nogil
    int kvq_compiled_simd_level() noexcept nogil
    int KVQ_SIMD_PORTABLE
    int KVQ_SIMD_AVX2
    int KVQ_SIMD_AVX512
    int KVQ_SIMD_AVX512VBMI

cdef extern from "consumers_kv8.h":
    void kvq_e4m3_init() noexcept nogil
    float kvq_e4m3_value(uint8_t c) noexcept nogil

cdef extern from "consumers_tq.h":
    void kvq_tq_init() noexcept nogil
    void kvq_tq_prepare(const float* levels, int bits, float* table, uint8_t* planes,
                        float* byte_levels) noexcept nogil

from kvquant._kernels._polarops cimport kvq_polar_layout, polar_layout

cdef extern from "consumers_polar.h":
    size_t kvq_polar_plan_bytes() noexcept nogil
    void kvq_polar_plan_prepare(kvq_polar_layout* L, void* mem) noexcept nogil
    void kvq_polar_dot_portable(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                                const float*, float*) noexcept nogil
    void kvq_polar_axpy_portable(const kvq_params*, const uint8_t*, const float*, int64_t,
                                 int64_t, const float*, float*) noexcept nogil
    void kvq_polar_dot_avx512(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                              const float*, float*) noexcept nogil
    void kvq_polar_axpy_avx512(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                               const float*, float*) noexcept nogil

cdef extern from "consumers_multi.h":
    # the multi-query kernels, per family and path (C functions used as pointers)
    kvq_dotm_fn _f32_dotm_portable "kvq_f32_dotm_portable"
    kvq_axpym_fn _f32_axpym_portable "kvq_f32_axpym_portable"
    kvq_dotm_fn _f32_dotm_avx2 "kvq_f32_dotm_avx2"
    kvq_axpym_fn _f32_axpym_avx2 "kvq_f32_axpym_avx2"
    kvq_dotm_fn _f32_dotm_avx512 "kvq_f32_dotm_avx512"
    kvq_axpym_fn _f32_axpym_avx512 "kvq_f32_axpym_avx512"
    kvq_dotm_fn _kv8_dotm_portable "kvq_kv8_dotm_portable"
    kvq_axpym_fn _kv8_axpym_portable "kvq_kv8_axpym_portable"
    kvq_dotm_fn _kv8_dotm_avx2 "kvq_kv8_dotm_avx2"
    kvq_axpym_fn _kv8_axpym_avx2 "kvq_kv8_axpym_avx2"
    kvq_dotm_fn _kv8_dotm_avx512 "kvq_kv8_dotm_avx512"
    kvq_axpym_fn _kv8_axpym_avx512 "kvq_kv8_axpym_avx512"
    kvq_dotm_fn _tq_dotm_portable "kvq_tq_dotm_portable"
    kvq_axpym_fn _tq_axpym_portable "kvq_tq_axpym_portable"
    kvq_dotm_fn _tq_dotm_avx2 "kvq_tq_dotm_avx2"
    kvq_axpym_fn _tq_axpym_avx2 "kvq_tq_axpym_avx2"
    kvq_dotm_fn _tq_dotm_avx512 "kvq_tq_dotm_avx512"
    kvq_axpym_fn _tq_axpym_avx512 "kvq_tq_axpym_avx512"
    kvq_dotm_fn _tq_dotm_avx512vbmi "kvq_tq_dotm_avx512vbmi"
    kvq_axpym_fn _tq_axpym_avx512vbmi "kvq_tq_axpym_avx512vbmi"
    kvq_dotm_fn _ggml_dotm_portable "kvq_ggml_dotm_portable"
    kvq_axpym_fn _ggml_axpym_portable "kvq_ggml_axpym_portable"
    kvq_dotm_fn _ggml_dotm_avx2 "kvq_ggml_dotm_avx2"
    kvq_axpym_fn _ggml_axpym_avx2 "kvq_ggml_axpym_avx2"
    kvq_dotm_fn _ggml_dotm_avx512 "kvq_ggml_dotm_avx512"
    kvq_axpym_fn _ggml_axpym_avx512 "kvq_ggml_axpym_avx512"

kvq_e4m3_init()
kvq_tq_init()

# Rows per context chunk. Part of the definition of a context's rounding: never derive it from
# the thread count.
CONTEXT_CHUNK = 1024
cdef int64_t _CONTEXT_CHUNK = CONTEXT_CHUNK
cdef int64_t _SUB_BLOCK = 64      # rows handed to a row kernel at a time (all queries in turn)
cdef int64_t _SCORE_BLOCK = 128   # rows per parallel iteration of scores
cdef int64_t _MERGE_BLOCK = 256   # context elements per parallel iteration of the merge
# Element operations below which another thread costs more than it saves (waking a thread takes
# microseconds, much more on a busy machine). Results do not depend on the thread count, so this
# only changes speed.
cdef int64_t _MIN_WORK_PER_THREAD = 1 << 16


cdef inline int _threads_for(int64_t work, int n_threads) noexcept nogil:
    cdef int64_t useful = work // _MIN_WORK_PER_THREAD
    if useful < 1:
        return 1
    return <int>useful if useful < n_threads else n_threads

# -- which instruction set runs ----------------------------------------------------------------
SIMD_NAMES = {0: "portable", 1: "avx2", 2: "avx512", 3: "avx512vbmi"}
cdef int _cpu_level = kvq_cpu_simd_level() if kvq_compiled_simd_level() else 0
cdef int _level = _cpu_level


def cpu_simd():
    """The best path this CPU and build can run: ``"avx512vbmi"``, ``"avx512"``, ``"avx2"`` or
    ``"portable"``."""
    return SIMD_NAMES[_cpu_level]


def get_simd():
    """The path the consumers use now."""
    return SIMD_NAMES[_level]


def set_simd(mode):
    """Choose the path: ``"auto"`` (the best available), ``"portable"``, ``"avx2"`` (AVX2 and
    F16C, no FMA; polar runs its portable kernels there), ``"avx512"`` or ``"avx512vbmi"``
    (AVX-512 plus byte permutes, used by 6- to 8-bit tq).

    Every path gives the same bits; forcing one is for tests and benchmarks. Returns the previous
    path's name. The environment variable ``KVQUANT_SIMD`` sets the initial mode.
    """
    global _level
    previous = SIMD_NAMES[_level]
    levels = {"portable": KVQ_SIMD_PORTABLE, "avx2": KVQ_SIMD_AVX2, "avx512": KVQ_SIMD_AVX512,
              "avx512vbmi": KVQ_SIMD_AVX512VBMI}
    if mode == "auto":
        _level = _cpu_level
    elif mode in levels:
        if _cpu_level < levels[mode]:
            raise ValueError(f"this CPU or build cannot run the {mode!r} path (it has "
                             f"{SIMD_NAMES[_cpu_level]!r})")
        _level = levels[mode]
    else:
        raise ValueError(f"simd mode must be 'auto' or one of {sorted(levels)}, got {mode!r}")
    return previous


def _simd_from_environment():
    """Apply ``KVQUANT_SIMD`` (unset or empty: auto). A value that is not a path this CPU runs
    stops the import with a message naming the variable and the values it takes; under the
    ``kvquant`` command (which cannot catch an error raised while its own package is imported)
    the message is one line on stderr and the exit status 2, as for any bad input."""
    mode = os.environ.get("KVQUANT_SIMD", "") or "auto"
    try:
        set_simd(mode.strip().lower())
    except ValueError as exc:
        message = (
            f"environment variable KVQUANT_SIMD={mode!r} is not valid: it takes auto, portable, "
            f"avx2, avx512 or avx512vbmi, and this CPU runs up to {SIMD_NAMES[_cpu_level]!r} "
            f"({exc}); unset it for the automatic choice")
        if os.path.basename(sys.argv[0] if sys.argv else "") == "kvquant":
            print(f"kvquant: {message}", file=sys.stderr)
            raise SystemExit(2)
        raise ImportError(message) from None


_simd_from_environment()


# -- drivers -----------------------------------------------------------------------------------
cdef void _run_scores(kvq_dot_fn fn, const kvq_params* p, const uint8_t* codes,
                      const float* side,
                      const float[:, ::1] Q,      # IN  (m, d) in the codec's basis
                      float[:, ::1] out,          # OUT (m, T)
                      int n_threads) noexcept nogil:
    cdef int64_t T = p.n_rows, m = Q.shape[0]
    cdef int64_t n_blocks = (T + _SCORE_BLOCK - 1) // _SCORE_BLOCK
    cdef int64_t b, j, r0, r1
    if T == 0 or m == 0:
        return
    n_threads = _threads_for(T * m * p.dim, n_threads)
    for b in prange(n_blocks, schedule="static", num_threads=n_threads):
        r0 = b * _SCORE_BLOCK
        r1 = min(r0 + _SCORE_BLOCK, T)
        for j in range(m):
            fn(p, codes, side, r0, r1, &Q[j, 0], &out[j, 0])


cdef void _run_context(kvq_axpy_fn fn, const kvq_params* p, const uint8_t* codes,
                       const float* side,
                       const float[:, ::1] W,         # IN  (m, T)
                       float[:, :, ::1] partial,      # scratch (n_chunks, m, d)
                       float[:, ::1] out,             # OUT (m, d) in the codec's basis
                       int n_threads) noexcept nogil:
    cdef int64_t T = p.n_rows, m = W.shape[0], d = p.dim
    cdef int64_t n_chunks = (T + _CONTEXT_CHUNK - 1) // _CONTEXT_CHUNK
    cdef int64_t c, j, r0, r1, s, e
    if m == 0:
        return
    if T == 0:
        memset(&out[0, 0], 0, m * d * sizeof(float))
        return
    for c in prange(n_chunks, schedule="static",
                    num_threads=_threads_for(T * m * d, n_threads)):
        memset(&partial[c, 0, 0], 0, m * d * sizeof(float))
        r0 = c * _CONTEXT_CHUNK
        r1 = min(r0 + _CONTEXT_CHUNK, T)
        s = r0
        while s < r1:
            e = min(s + _SUB_BLOCK, r1)
            for j in range(m):
                fn(p, codes, side, s, e, &W[j, 0], &partial[c, j, 0])
            s = e
    _merge_partials(partial, out, n_chunks, n_threads)


cdef inline kvq_dotm_fn _pick_dotm(kvq_dotm_fn portable, kvq_dotm_fn avx2,
                                   kvq_dotm_fn avx512) noexcept nogil:
    return avx512 if _level >= KVQ_SIMD_AVX512 else avx2 if _level == KVQ_SIMD_AVX2 else portable


cdef inline kvq_axpym_fn _pick_axpym(kvq_axpym_fn portable, kvq_axpym_fn avx2,
                                     kvq_axpym_fn avx512) noexcept nogil:
    return avx512 if _level >= KVQ_SIMD_AVX512 else avx2 if _level == KVQ_SIMD_AVX2 else portable


cdef void _run_scores_m(kvq_dotm_fn fn, const kvq_params* p, const uint8_t* codes,
                        const float* side,
                        const float[:, ::1] Q,      # IN  (m, d) in the codec's basis
                        float[:, ::1] out,          # OUT (m, T)
                        int n_threads) noexcept nogil:
    """_run_scores with a multi-query kernel: each block of rows is read once for all m."""
    cdef int64_t T = p.n_rows, m = Q.shape[0]
    cdef int64_t n_blocks = (T + _SCORE_BLOCK - 1) // _SCORE_BLOCK
    cdef int64_t b, r0, r1
    if T == 0 or m == 0:
        return
    n_threads = _threads_for(T * m * p.dim, n_threads)
    for b in prange(n_blocks, schedule="static", num_threads=n_threads):
        r0 = b * _SCORE_BLOCK
        r1 = min(r0 + _SCORE_BLOCK, T)
        fn(p, codes, side, r0, r1, &Q[0, 0], <int>m, &out[0, 0], T)


cdef void _run_context_m(kvq_axpym_fn fn, const kvq_params* p, const uint8_t* codes,
                         const float* side,
                         const float[:, ::1] W,         # IN  (m, T)
                         float[:, :, ::1] partial,      # scratch (n_chunks, m, d)
                         float[:, ::1] out,             # OUT (m, d) in the codec's basis
                         int n_threads) noexcept nogil:
    """_run_context with a multi-query kernel: the same chunks, partials and merge."""
    cdef int64_t T = p.n_rows, m = W.shape[0], d = p.dim
    cdef int64_t n_chunks = (T + _CONTEXT_CHUNK - 1) // _CONTEXT_CHUNK
    cdef int64_t c, r0, r1, s, e
    if m == 0:
        return
    if T == 0:
        memset(&out[0, 0], 0, m * d * sizeof(float))
        return
    for c in prange(n_chunks, schedule="static",
                    num_threads=_threads_for(T * m * d, n_threads)):
        memset(&partial[c, 0, 0], 0, m * d * sizeof(float))
        r0 = c * _CONTEXT_CHUNK
        r1 = min(r0 + _CONTEXT_CHUNK, T)
        s = r0
        while s < r1:
            e = min(s + _SUB_BLOCK, r1)
            fn(p, codes, side, s, e, &W[0, 0], T, <int>m, &partial[c, 0, 0])
            s = e
    _merge_partials(partial, out, n_chunks, n_threads)


cdef void _merge_partials(float[:, :, ::1] partial, float[:, ::1] out, int64_t n_chunks,
                          int n_threads) noexcept nogil:
    """out = the chunk partials added in chunk order, element by element."""
    cdef int64_t m = out.shape[0], d = out.shape[1]
    cdef int64_t n_eblocks = (d + _MERGE_BLOCK - 1) // _MERGE_BLOCK
    cdef int64_t c, j, k, i, i0, i1
    for k in prange(m * n_eblocks, schedule="static",
                    num_threads=_threads_for(n_chunks * m * d, n_threads)):
        j = k // n_eblocks
        i0 = (k % n_eblocks) * _MERGE_BLOCK
        i1 = min(i0 + _MERGE_BLOCK, d)
        memcpy(&out[j, i0], &partial[0, j, i0], (i1 - i0) * sizeof(float))
        for c in range(1, n_chunks):
            for i in range(i0, i1):
                out[j, i] = out[j, i] + partial[c, j, i]


cdef inline object _partials(int64_t T, int64_t m, int64_t d):
    return np.empty((max(1, (T + _CONTEXT_CHUNK - 1) // _CONTEXT_CHUNK), m, d), np.float32)


cdef void _rotate_rows(const float[:, ::1] X, const float[::1] signs, float[:, ::1] out,
                       int n_threads) noexcept nogil:
    """H (D x) / sqrt(n) per row, the same float operations as kvquant._kernels.rotation (safe
    from the butterflies' overflow the same way)."""
    cdef int64_t r, m = X.shape[0], n = X.shape[1]
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf(<float>n)
    for r in prange(m, schedule="static", num_threads=_threads_for(m * n * 8, n_threads)):
        kvq_rotate_row_safe(&X[r, 0], &signs[0], n, inv_sqrt_n, &out[r, 0])


cdef const float[:, ::1] _queries_in_code_basis(const float[:, ::1] Q, bint rotate,
                                                const float[::1] signs, int n_threads):
    """The queries in the basis the codes were stored in: rotated once (+rot), else as given."""
    if not rotate:
        return Q
    cdef float[:, ::1] Qrot = np.empty((Q.shape[0], Q.shape[1]), np.float32)
    with nogil:
        _rotate_rows(Q, signs, Qrot, n_threads)
    return Qrot


cdef void _unrotate_rows_inplace(float[:, ::1] Y, const float[::1] signs,
                                 int n_threads) noexcept nogil:
    """D (H y) / sqrt(n) per row, the same float operations as kvquant._kernels.rotation, safe
    from the butterflies' overflow (kvq_unrotate_row_safe: the same bits when they do not)."""
    cdef int64_t r, m = Y.shape[0], n = Y.shape[1]
    cdef float inv_sqrt_n = (<float>1.0) / sqrtf(<float>n)
    cdef float* copy
    with parallel(num_threads=_threads_for(m * n * 8, n_threads)):
        copy = <float*>malloc(n * sizeof(float))
        for r in prange(m, schedule="static"):
            kvq_unrotate_row_safe(&Y[r, 0], &signs[0], n, inv_sqrt_n, copy)
        free(copy)


# -- f32 -----------------------------------------------------------------------------------------
cdef void _f32_params(kvq_params* p, const uint8_t[:, ::1] codes):
    memset(p, 0, sizeof(kvq_params))
    p.n_rows = codes.shape[0]
    p.code_bytes = codes.shape[1]
    p.dim = codes.shape[1] // 4


def scores_f32(const uint8_t[:, ::1] codes,   # IN  (T, 4 d) float32 rows as bytes
               const float[:, ::1] Q,         # IN  (m, d)
               float[:, ::1] out,             # OUT (m, T)
               int n_threads):
    cdef kvq_params p
    cdef kvq_dotm_fn fn = _pick_dotm(_f32_dotm_portable, _f32_dotm_avx2, _f32_dotm_avx512)
    _f32_params(&p, codes)
    if p.n_rows == 0 or Q.shape[0] == 0:
        return
    with nogil:
        _run_scores_m(fn, &p, &codes[0, 0], NULL, Q, out, n_threads)


def context_f32(const uint8_t[:, ::1] codes,  # IN  (T, 4 d)
                const float[:, ::1] W,        # IN  (m, T)
                float[:, ::1] out,            # OUT (m, d)
                int n_threads):
    cdef kvq_params p
    cdef kvq_axpym_fn fn = _pick_axpym(_f32_axpym_portable, _f32_axpym_avx2,
                                       _f32_axpym_avx512)
    _f32_params(&p, codes)
    if W.shape[0] == 0:
        return
    cdef float[:, :, ::1] partial = _partials(p.n_rows, W.shape[0], p.dim)
    cdef const uint8_t* c0 = &codes[0, 0] if p.n_rows else NULL
    with nogil:
        _run_context_m(fn, &p, c0, NULL, W, partial, out, n_threads)


# -- kv8 -----------------------------------------------------------------------------------------
cdef void _kv8_params(kvq_params* p, const uint8_t[:, ::1] codes, const float[:, ::1] scales,
                      int64_t group):
    memset(p, 0, sizeof(kvq_params))
    p.n_rows = codes.shape[0]
    p.dim = codes.shape[1]
    p.code_bytes = codes.shape[1]
    p.n_side = scales.shape[1]
    p.group = group


def e4m3_values():
    """The decode values the consumers use (NaN codes as 0), for tests."""
    return [kvq_e4m3_value(<uint8_t>c) for c in range(256)]


def scores_kv8(const uint8_t[:, ::1] codes,   # IN  (T, d) e4m3fn codes
               const float[:, ::1] scales,    # IN  (T, d // group)
               int64_t group,
               const float[:, ::1] Q,         # IN  (m, d)
               float[:, ::1] out,             # OUT (m, T)
               int n_threads):
    cdef kvq_params p
    cdef kvq_dotm_fn fn = _pick_dotm(_kv8_dotm_portable, _kv8_dotm_avx2, _kv8_dotm_avx512)
    _kv8_params(&p, codes, scales, group)
    if p.n_rows == 0 or Q.shape[0] == 0:
        return
    with nogil:
        _run_scores_m(fn, &p, &codes[0, 0], &scales[0, 0], Q, out, n_threads)


def context_kv8(const uint8_t[:, ::1] codes,  # IN  (T, d)
                const float[:, ::1] scales,   # IN  (T, d // group)
                int64_t group,
                const float[:, ::1] W,        # IN  (m, T)
                float[:, ::1] out,            # OUT (m, d)
                int n_threads):
    cdef kvq_params p
    cdef kvq_axpym_fn fn = _pick_axpym(_kv8_axpym_portable, _kv8_axpym_avx2,
                                       _kv8_axpym_avx512)
    _kv8_params(&p, codes, scales, group)
    if W.shape[0] == 0:
        return
    cdef float[:, :, ::1] partial = _partials(p.n_rows, W.shape[0], p.dim)
    cdef const uint8_t* c0 = &codes[0, 0] if p.n_rows else NULL
    cdef const float* s0 = &scales[0, 0] if p.n_rows else NULL
    with nogil:
        _run_context_m(fn, &p, c0, s0, W, partial, out, n_threads)


# -- tq (rotated Lloyd) --------------------------------------------------------------------------
cdef void _tq_params(kvq_params* p, const uint8_t[:, ::1] codes, const float[:, ::1] side,
                     const float[::1] levels, int bits, int64_t dim, float* table,
                     uint8_t* planes, float* byte_levels):
    memset(p, 0, sizeof(kvq_params))
    p.n_rows = codes.shape[0]
    p.dim = dim
    p.code_bytes = codes.shape[1]
    p.n_side = side.shape[1]
    p.bits = bits
    p.sqrtf_n = sqrtf(<float>dim)
    p.levels = &levels[0]
    p.vbmi = _level >= KVQ_SIMD_AVX512VBMI
    kvq_tq_prepare(&levels[0], bits, table, planes, byte_levels)
    p.table = table
    p.planes = planes
    p.byte_levels = byte_levels


def scores_tq(const uint8_t[:, ::1] codes,    # IN  (T, ceil(n*bits/8))
              const float[:, ::1] side,       # IN  (T, 1) radius
              const float[::1] signs,         # IN  (n,) rotation signs
              const float[::1] levels,        # IN  (2**bits,)
              int bits,
              const float[:, ::1] Q,          # IN  (m, n) queries, original basis
              float[:, ::1] out,              # OUT (m, T)
              int n_threads):
    """Rotates the queries once, then dots them with the levels; the radius is applied per row."""
    cdef kvq_params p
    cdef float table[256]
    cdef uint8_t planes[1024]
    cdef float byte_levels[2048]
    cdef kvq_dotm_fn fn = _pick_dotm(_tq_dotm_portable, _tq_dotm_avx2,
                                     _tq_dotm_avx512vbmi if _level >= KVQ_SIMD_AVX512VBMI
                                     else _tq_dotm_avx512)
    _tq_params(&p, codes, side, levels, bits, Q.shape[1], table, planes, byte_levels)
    if p.n_rows == 0 or Q.shape[0] == 0:
        return
    cdef float[:, ::1] Qrot = np.empty((Q.shape[0], Q.shape[1]), np.float32)
    with nogil:
        _rotate_rows(Q, signs, Qrot, n_threads)
        _run_scores_m(fn, &p, &codes[0, 0], &side[0, 0], Qrot, out, n_threads)


def context_tq(const uint8_t[:, ::1] codes,   # IN  (T, ceil(n*bits/8))
               const float[:, ::1] side,      # IN  (T, 1)
               const float[::1] signs,        # IN  (n,)
               const float[::1] levels,       # IN  (2**bits,)
               int bits,
               const float[:, ::1] W,         # IN  (m, T)
               float[:, ::1] out,             # OUT (m, n) original basis
               int n_threads):
    """Accumulates in the rotated basis, then unrotates each context once."""
    cdef kvq_params p
    cdef float table[256]
    cdef uint8_t planes[1024]
    cdef float byte_levels[2048]
    cdef kvq_axpym_fn fn = _pick_axpym(_tq_axpym_portable, _tq_axpym_avx2,
                                       _tq_axpym_avx512vbmi if _level >= KVQ_SIMD_AVX512VBMI
                                       else _tq_axpym_avx512)
    _tq_params(&p, codes, side, levels, bits, out.shape[1], table, planes,
               byte_levels)
    if W.shape[0] == 0:
        return
    cdef float[:, :, ::1] partial = _partials(p.n_rows, W.shape[0], p.dim)
    cdef const uint8_t* c0 = &codes[0, 0] if p.n_rows else NULL
    cdef const float* s0 = &side[0, 0] if p.n_rows else NULL
    with nogil:
        _run_context_m(fn, &p, c0, s0, W, partial, out, n_threads)
        _unrotate_rows_inplace(out, signs, n_threads)


# -- q8_0 / q4_0 (llama.cpp blocks), optionally rotated ------------------------------------------
cdef void _ggml_params(kvq_params* p, const uint8_t[:, ::1] codes, int bits, int64_t dim):
    memset(p, 0, sizeof(kvq_params))
    p.n_rows = codes.shape[0]
    p.dim = dim
    p.code_bytes = codes.shape[1]
    p.bits = bits


def scores_ggml(const uint8_t[:, ::1] codes,   # IN  (T, (n/32) * block bytes)
                int bits,                      # 8: q8_0, 4: q4_0
                bint rotate,                   # +rot: rotate the queries once
                const float[::1] signs,        # IN  (n,) rotation signs (any when not rotate)
                const float[:, ::1] Q,         # IN  (m, n) queries, original basis
                float[:, ::1] out,             # OUT (m, T)
                int n_threads):
    """The block scale is factored out of each block's partial sum."""
    cdef kvq_params p
    cdef kvq_dotm_fn fn = _pick_dotm(_ggml_dotm_portable, _ggml_dotm_avx2, _ggml_dotm_avx512)
    _ggml_params(&p, codes, bits, Q.shape[1])
    if p.n_rows == 0 or Q.shape[0] == 0:
        return
    cdef const float[:, ::1] Qb = _queries_in_code_basis(Q, rotate, signs, n_threads)
    with nogil:
        _run_scores_m(fn, &p, &codes[0, 0], NULL, Qb, out, n_threads)


def context_ggml(const uint8_t[:, ::1] codes,  # IN  (T, (n/32) * block bytes)
                 int bits,
                 bint rotate,                  # +rot: accumulate rotated, unrotate once
                 const float[::1] signs,       # IN  (n,)
                 const float[:, ::1] W,        # IN  (m, T)
                 float[:, ::1] out,            # OUT (m, n) original basis
                 int n_threads):
    """The block scale is folded into the weight."""
    cdef kvq_params p
    cdef kvq_axpym_fn fn = _pick_axpym(_ggml_axpym_portable, _ggml_axpym_avx2,
                                       _ggml_axpym_avx512)
    _ggml_params(&p, codes, bits, out.shape[1])
    if W.shape[0] == 0:
        return
    cdef float[:, :, ::1] partial = _partials(p.n_rows, W.shape[0], p.dim)
    cdef const uint8_t* c0 = &codes[0, 0] if p.n_rows else NULL
    with nogil:
        _run_context_m(fn, &p, c0, NULL, W, partial, out, n_threads)
        if rotate:
            _unrotate_rows_inplace(out, signs, n_threads)


# -- polar ---------------------------------------------------------------------------------------
cdef void _polar_params(kvq_params* p, kvq_polar_layout* L, const uint8_t[:, ::1] codes,
                        const float[:, ::1] side, int64_t dim, int mode,
                        const int32_t[::1] level_bits, const int32_t[::1] level_totals,
                        const int32_t[::1] level_starts, const float[:, :, ::1] cos_tab,
                        const float[:, :, ::1] sin_tab, const int32_t[:, :, ::1] log2_cos2,
                        const int32_t[:, :, ::1] log2_sin2, const int32_t[:, ::1] gains):
    memset(p, 0, sizeof(kvq_params))
    p.n_rows = codes.shape[0]
    p.dim = dim
    p.code_bytes = codes.shape[1]
    p.n_side = side.shape[1]
    polar_layout(L, dim, mode, level_bits, level_totals, level_starts, cos_tab, sin_tab,
                 log2_cos2, log2_sin2, gains)
    p.codec = L


cdef void* _polar_plan(kvq_polar_layout* L) noexcept nogil:
    """The AVX-512 path's constants, built once per call (NULL: the kernels build their own)."""
    cdef void* mem = NULL
    if _level >= KVQ_SIMD_AVX512 and kvq_polar_plan_bytes() > 0:
        mem = malloc(kvq_polar_plan_bytes())
        kvq_polar_plan_prepare(L, mem)
    return mem


def scores_polar(const uint8_t[:, ::1] codes,       # IN  (T, code_bytes)
                 const float[:, ::1] side,          # IN  (T, 1) radius
                 const float[::1] signs,            # IN  (n,) rotation signs
                 int mode,                          # kvquant.codecs.polar MODE_*
                 const int32_t[::1] level_bits,     # IN  (n_levels + 1,)
                 const int32_t[::1] level_totals,   # IN  (n_levels + 1,)
                 const int32_t[::1] level_starts,   # IN  (n_levels + 1,)
                 const float[:, :, ::1] cos_tab,    # IN  (n_levels + 1, 9, 256) polar.angle_tables
                 const float[:, :, ::1] sin_tab,    # IN
                 const int32_t[:, :, ::1] log2_cos2,  # IN (n_levels + 1, 9, 256)
                 const int32_t[:, :, ::1] log2_sin2,  # IN
                 const int32_t[:, ::1] gains,       # IN  (n_levels + 1, 8)
                 const float[:, ::1] Q,             # IN  (m, n) queries, original basis
                 float[:, ::1] out,                 # OUT (m, T)
                 int n_threads):
    """Rotates the queries once, then dots them with each row rebuilt in the rotated basis."""
    cdef kvq_params p
    cdef kvq_polar_layout L
    cdef kvq_dot_fn fn = (kvq_polar_dot_avx512 if _level >= KVQ_SIMD_AVX512
                          else kvq_polar_dot_portable)
    _polar_params(&p, &L, codes, side, Q.shape[1], mode, level_bits, level_totals, level_starts,
                  cos_tab, sin_tab, log2_cos2, log2_sin2, gains)
    if p.n_rows == 0 or Q.shape[0] == 0:
        return
    cdef float[:, ::1] Qrot = np.empty((Q.shape[0], Q.shape[1]), np.float32)
    cdef void* plan
    with nogil:
        plan = _polar_plan(&L)
        _rotate_rows(Q, signs, Qrot, n_threads)
        _run_scores(fn, &p, &codes[0, 0], &side[0, 0], Qrot, out, n_threads)
        free(plan)


def context_polar(const uint8_t[:, ::1] codes,      # IN  (T, code_bytes)
                  const float[:, ::1] side,         # IN  (T, 1)
                  const float[::1] signs,           # IN  (n,)
                  int mode,
                  const int32_t[::1] level_bits,
                  const int32_t[::1] level_totals,
                  const int32_t[::1] level_starts,
                  const float[:, :, ::1] cos_tab,
                  const float[:, :, ::1] sin_tab,
                  const int32_t[:, :, ::1] log2_cos2,
                  const int32_t[:, :, ::1] log2_sin2,
                  const int32_t[:, ::1] gains,
                  const float[:, ::1] W,            # IN  (m, T)
                  float[:, ::1] out,                # OUT (m, n) original basis
                  int n_threads):
    """Accumulates rows rebuilt in the rotated basis, then unrotates each context once."""
    cdef kvq_params p
    cdef kvq_polar_layout L
    cdef kvq_axpy_fn fn = (kvq_polar_axpy_avx512 if _level >= KVQ_SIMD_AVX512
                           else kvq_polar_axpy_portable)
    _polar_params(&p, &L, codes, side, out.shape[1], mode, level_bits, level_totals,
                  level_starts, cos_tab, sin_tab, log2_cos2, log2_sin2, gains)
    if W.shape[0] == 0:
        return
    cdef float[:, :, ::1] partial = _partials(p.n_rows, W.shape[0], p.dim)
    cdef const uint8_t* c0 = &codes[0, 0] if p.n_rows else NULL
    cdef const float* s0 = &side[0, 0] if p.n_rows else NULL
    cdef void* plan
    with nogil:
        plan = _polar_plan(&L)
        _run_context(fn, &p, c0, s0, W, partial, out, n_threads)
        _unrotate_rows_inplace(out, signs, n_threads)
        free(plan)


# == q4_1 / q5_0 / q5_1 / iq4_nl (llama.cpp blocks, consumers_ggml_more.h), optionally rotated ==
cdef extern from "consumers_ggml_more.h":
    void kvq_gm_dot_portable(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                             const float*, float*) noexcept nogil
    void kvq_gm_axpy_portable(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                              const float*, float*) noexcept nogil
    void kvq_gm_dot_avx512(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                           const float*, float*) noexcept nogil
    void kvq_gm_axpy_avx512(const kvq_params*, const uint8_t*, const float*, int64_t, int64_t,
                            const float*, float*) noexcept nogil


cdef void _ggml_more_params(kvq_params* p, const uint8_t[:, ::1] codes, int kind, int64_t dim):
    memset(p, 0, sizeof(kvq_params))
    p.n_rows = codes.shape[0]
    p.dim = dim
    p.code_bytes = codes.shape[1]
    p.bits = kind                      # the block kind: kvquant._kernels.ggml KIND_*


def scores_ggml_more(const uint8_t[:, ::1] codes,   # IN  (T, (n/32) * block bytes)
                     int kind,                      # ggml KIND_Q4_1, _Q5_0, _Q5_1, _IQ4_NL
                     bint rotate,                   # +rot: rotate the queries once
                     const float[::1] signs,        # IN  (n,) rotation signs (any when not rotate)
                     const float[:, ::1] Q,         # IN  (m, n) queries, original basis
                     float[:, ::1] out,             # OUT (m, T)
                     int n_threads):
    """The block scale is factored out of each block's partial sum (and the minimum out of the
    block's query sum)."""
    cdef kvq_params p
    cdef kvq_dot_fn fn = kvq_gm_dot_avx512 if _level >= KVQ_SIMD_AVX512 else kvq_gm_dot_portable
    _ggml_more_params(&p, codes, kind, Q.shape[1])
    if p.n_rows == 0 or Q.shape[0] == 0:
        return
    cdef const float[:, ::1] Qb = _queries_in_code_basis(Q, rotate, signs, n_threads)
    with nogil:
        _run_scores(fn, &p, &codes[0, 0], NULL, Qb, out, n_threads)


def context_ggml_more(const uint8_t[:, ::1] codes,  # IN  (T, (n/32) * block bytes)
                      int kind,
                      bint rotate,                  # +rot: accumulate rotated, unrotate once
                      const float[::1] signs,       # IN  (n,)
                      const float[:, ::1] W,        # IN  (m, T)
                      float[:, ::1] out,            # OUT (m, n) original basis
                      int n_threads):
    """The block scale is folded into the weight; the minimum adds w_t m_tb to every element."""
    cdef kvq_params p
    cdef kvq_axpy_fn fn = (kvq_gm_axpy_avx512 if _level >= KVQ_SIMD_AVX512
                           else kvq_gm_axpy_portable)
    _ggml_more_params(&p, codes, kind, out.shape[1])
    if W.shape[0] == 0:
        return
    cdef float[:, :, ::1] partial = _partials(p.n_rows, W.shape[0], p.dim)
    cdef const uint8_t* c0 = &codes[0, 0] if p.n_rows else NULL
    with nogil:
        _run_context(fn, &p, c0, NULL, W, partial, out, n_threads)
        if rotate:
            _unrotate_rows_inplace(out, signs, n_threads)
