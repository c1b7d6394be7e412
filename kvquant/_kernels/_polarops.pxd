# Declarations of polarops.h (the polar radius allocation and the row rebuild), shared by the
# polar codec kernels (polar.pyx) and the attention consumers (consumers.pyx).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t

cdef extern from "polarops.h" nogil:
    ctypedef struct kvq_polar_layout:
        int64_t dim
        int n_levels
        int mode
        const int32_t* level_bits
        const int32_t* level_totals
        const int32_t* level_starts
        const float* cos_tab
        const float* sin_tab
        const int32_t* log2_cos2
        const int32_t* log2_sin2
        const int32_t* gains
        const void* plan
    ctypedef struct kvq_polar_scratch:
        pass
    int kvq_polar_scratch_alloc(kvq_polar_scratch* s, int64_t n)
    void kvq_polar_scratch_free(kvq_polar_scratch* s)
    void kvq_polar_allocate_bits(const int32_t* weight, int64_t cnt, const int32_t* gain,
                                 int64_t total, uint32_t* keys, uint8_t* width)
    int kvq_polar_allocate_near(const int32_t* weight, int64_t cnt, const int32_t* gain,
                                int64_t total, uint8_t* width)
    int kvq_polar_near_off
    void kvq_polar_child_weights(const int32_t* weight, int64_t cnt, const uint8_t* width,
                                 const uint8_t* code, const int32_t* log2_cos2,
                                 const int32_t* log2_sin2, int32_t* child)
    void kvq_polar_rebuild_row(const kvq_polar_layout* L, const uint8_t* row, float r,
                               kvq_polar_scratch* s, float* buf)
    int kvq_polar_live(float r)


cdef inline void polar_layout(kvq_polar_layout* L,                # OUT
                              int64_t dim, int mode,
                              const int32_t[::1] level_bits,     # IN  (n_levels + 1,)
                              const int32_t[::1] level_totals,   # IN  (n_levels + 1,)
                              const int32_t[::1] level_starts,   # IN  (n_levels + 1,)
                              const float[:, :, ::1] cos_tab,    # IN  (n_levels + 1, 9, 256)
                              const float[:, :, ::1] sin_tab,    # IN
                              const int32_t[:, :, ::1] log2_cos2,
                              const int32_t[:, :, ::1] log2_sin2,
                              const int32_t[:, ::1] gains) noexcept:
    """A row layout over the codec's tables (pointers into the caller's arrays; no plan)."""
    L.dim = dim
    L.n_levels = level_bits.shape[0] - 1
    L.mode = mode
    L.level_bits = &level_bits[0]
    L.level_totals = &level_totals[0]
    L.level_starts = &level_starts[0]
    L.cos_tab = &cos_tab[0, 0, 0]
    L.sin_tab = &sin_tab[0, 0, 0]
    L.log2_cos2 = &log2_cos2[0, 0, 0]
    L.log2_sin2 = &log2_sin2[0, 0, 0]
    L.gains = &gains[0, 0]
    L.plan = NULL
