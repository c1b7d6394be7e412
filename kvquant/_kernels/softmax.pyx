# Softmax over the rows of a float32 matrix, in place (softmax.h): the step between the
# consumers' scores and their context, compiled so that it costs a few passes over the scores
# on every thread instead of numpy's six on one.
from libc.stdint cimport int64_t

from kvquant._kernels import consumers

cdef extern from "softmax.h" nogil:
    int KVQ_SM_CHUNK
    int kvq_softmax_rows(float* S, int64_t m, int64_t n, float scale, int n_threads, int path)
    float kvq_sm_exp1(float x)

# the consumers' path names -> softmax.h's paths (VBMI adds nothing here)
_PATHS = {"portable": 0, "avx2": 1, "avx512": 2, "avx512vbmi": 2}
CHUNK = KVQ_SM_CHUNK


def softmax_rows(float[:, ::1] S,      # IN/OUT (m, n): scores in, weights out
                 float scale,
                 int n_threads):
    """Each row of S becomes softmax(S[r] * scale), in place, on the consumers' current path
    (``consumers.set_simd``). The same bits for any thread count and path."""
    cdef int path = _PATHS[consumers.get_simd()]
    cdef int status
    with nogil:
        status = kvq_softmax_rows(&S[0, 0] if S.shape[0] and S.shape[1] else NULL,
                                  S.shape[0], S.shape[1], scale, n_threads, path)
    if status != 0:
        raise MemoryError("softmax: no memory for the chunks' partial sums")


def exp_nonpositive(const float[::1] x,   # IN  (n,) values <= 0, -inf or NaN
                    float[::1] out):      # OUT (n,)
    """softmax.h's exp, element by element (for tests of its accuracy)."""
    cdef Py_ssize_t i
    for i in range(x.shape[0]):
        out[i] = kvq_sm_exp1(x[i])
