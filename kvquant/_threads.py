"""The one thread-count policy of kvquant (as scikit-learn's).

``None`` means what OpenMP would use by default (it honours ``OMP_NUM_THREADS``), ``-1`` all
cores, a positive number exactly that many; ``0`` and other negatives are errors.
"""
import os

from kvquant._kernels import _build_info


def resolve_n_threads(n_threads=None):
    """Return the number of threads a kernel call should use."""
    if n_threads is None:
        return max(1, _build_info.openmp_max_threads())
    if isinstance(n_threads, bool) or not isinstance(n_threads, int):
        raise TypeError(f"n_threads must be an int or None, got {n_threads!r}")
    if n_threads == -1:
        return os.cpu_count() or 1
    if n_threads <= 0:
        raise ValueError(
            f"n_threads={n_threads} is not valid: use a positive count, -1 for all cores, "
            "or None for the OpenMP default"
        )
    return n_threads
