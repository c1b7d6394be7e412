"""The one thread-count policy of kvquant (as scikit-learn's).

``None`` means what OpenMP would use by default (it honours ``OMP_NUM_THREADS``), ``-1`` all
cores, a positive number exactly that many; ``0`` and other negatives are errors.
"""
import os

from kvquant._kernels import _build_info


# Below this many elements per thread, waking another thread costs more than it saves. Results do
# not depend on the thread count, so capping it changes speed only.
MIN_ELEMENTS_PER_THREAD = 32768


def resolve_n_threads(n_threads=None, work=None):
    """Return the number of threads a kernel call should use.

    ``work`` (elements to process), when given, caps the count so that small calls stay on one
    thread.
    """
    n = _resolve(n_threads)
    if work is not None:
        n = max(1, min(n, int(work) // MIN_ELEMENTS_PER_THREAD))
    return n


def _resolve(n_threads):
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


class blas_threads:
    """Hold BLAS to n threads for a block (threadpoolctl, one controller per process); None
    leaves it as it is."""

    _controller = None

    def __init__(self, n_threads):
        self.n_threads = n_threads
        self._limit = None

    def __enter__(self):
        if self.n_threads is None:
            return self
        try:
            if blas_threads._controller is None:
                from threadpoolctl import ThreadpoolController
                blas_threads._controller = ThreadpoolController()
            self._limit = blas_threads._controller.limit(limits=self.n_threads, user_api="blas")
        except ImportError:   # pragma: no cover - threadpoolctl is a dependency
            self._limit = None
        return self

    def __exit__(self, *exc):
        if self._limit is not None:
            self._limit.restore_original_limits()
        return False
