"""Compiled kernels. Importing this package checks that they were built.

The kernels never validate their inputs; the Python layer in ``kvquant.codecs`` does.
"""
try:
    from kvquant._kernels import _build_info  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on a broken build
    raise ImportError(
        "kvquant's compiled kernels are missing or broken "
        f"({exc}). Build them with `pip install -e .` (or `python setup.py build_ext --inplace`) "
        "from the source tree; kvquant has no pure-Python fallback."
    ) from exc
