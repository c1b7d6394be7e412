# Facts about how the kernels were compiled, for the build-sanity test and `kvquant info`.
from kvquant._kernels._openmp cimport KVQ_OPENMP_ENABLED, omp_get_max_threads


def openmp_enabled():
    """True when the kernels were compiled with OpenMP."""
    return bool(KVQ_OPENMP_ENABLED)


def openmp_max_threads():
    """Threads an OpenMP region would use by default (1 without OpenMP)."""
    return omp_get_max_threads()
