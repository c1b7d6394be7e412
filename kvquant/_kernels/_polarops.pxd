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
    void kvq_polar_child_weights(const int32_t* weight, int64_t cnt, const uint8_t* width,
                                 const uint8_t* code, const int32_t* log2_cos2,
                                 const int32_t* log2_sin2, int32_t* child)
    void kvq_polar_rebuild_row(const kvq_polar_layout* L, const uint8_t* row, float r,
                               kvq_polar_scratch* s, float* buf)
    int kvq_polar_live(float r)
