"""Compiled kernels. Importing this package checks that they were built.

The kernels never validate their inputs; the Python layer in ``kvquant.codecs`` does.
"""
from kvquant import _openmp_env

# Before the first OpenMP-linked extension loads: libgomp reads its wait policy only then.
_openmp_env.apply()

try:
    from kvquant._kernels import _build_info  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on a broken build
    raise ImportError(
        "kvquant's compiled kernels are missing or broken "
        f"({exc}). Build them with `pip install -e .` (or `python setup.py build_ext --inplace`) "
        "from the source tree; kvquant has no pure-Python fallback."
    ) from exc
