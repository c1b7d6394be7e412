# The one place where kernels meet OpenMP. Without OpenMP (the compiler lacks it) the calls below
# fall back to single-thread answers and Cython's prange runs as a plain loop.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define KVQ_OPENMP_ENABLED 1
    #else
    #define KVQ_OPENMP_ENABLED 0
    static int omp_get_max_threads(void) { return 1; }
    static int omp_get_thread_num(void) { return 0; }
    #endif
    """
    bint KVQ_OPENMP_ENABLED
    int omp_get_max_threads() noexcept nogil
    int omp_get_thread_num() noexcept nogil
