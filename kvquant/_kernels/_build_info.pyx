# Facts about how the kernels were compiled, for the build-sanity test and `kvquant info`.
from kvquant._kernels._openmp cimport KVQ_OPENMP_ENABLED, omp_get_max_threads


def openmp_enabled():
    """True when the kernels were compiled with OpenMP."""
    return bool(KVQ_OPENMP_ENABLED)


def openmp_max_threads():
    """Threads an OpenMP region would use by default (1 without OpenMP)."""
    return omp_get_max_threads()


cdef extern from *:
    """
    #if defined(__clang__)
    #define KVQ_COMPILER "clang " __clang_version__
    #elif defined(__GNUC__)
    #define KVQ_COMPILER "gcc " __VERSION__
    #else
    #define KVQ_COMPILER "an unknown compiler"
    #endif
    """
    const char* KVQ_COMPILER


cdef extern from "rowops.h":
    int KVQ_CODE_PLAN


def compiler():
    """The compiler that built the kernels and its version, e.g. ``'gcc 12.2.0'``."""
    return KVQ_COMPILER.decode().strip()   # Clang's version string ends in a blank


def encoder_search_tree():
    """True when the build has the encoders' AVX-512 search tree for the nearest level
    (rowops.h: written with GCC's variable shuffles, so GCC on x86-64 only; other builds use
    the counted compares and bucket tables, which give the same codes)."""
    return bool(KVQ_CODE_PLAN)
