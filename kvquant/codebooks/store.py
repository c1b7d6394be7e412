"""Codebook objects, their files, the stored package data and loading.

One JSON file per (dist, dim, bits) in ``kvquant/data/codebooks/``: Gaussian for bits 1..8 and
Beta for d = 16, 32, ..., 4096 and bits 1..8, written by :func:`regenerate`. :func:`load_codebook`
reads them (checking a SHA-256 of the levels) and fits anything else on the fly.
:func:`use_codebooks` lends codebooks of one's own to the codecs built inside a ``with`` block.
"""
import contextlib
import functools
import hashlib
import json
import numbers
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType

import numpy as np
import scipy

from kvquant.outputs import atomic_write

from .densities import _check_dim, beta_density, gaussian_density
from .lloyd_max import DEFAULT_TOL

__all__ = ["BITS_RANGE", "DEFAULT_DATA_DIR", "DISTS", "STORED_BETA_DIMS", "Codebook",
           "CodebookFileError", "fit_codebook", "levels_checksum", "load_codebook",
           "read_codebook", "regenerate", "use_codebooks", "write_codebook"]

DISTS = ("gaussian", "beta")
BITS_RANGE = (1, 8)
STORED_BETA_DIMS = tuple(2**k for k in range(4, 13))  # 16 .. 4096

FILE_FORMAT = "kvquant-codebook"
FILE_FORMAT_VERSION = 1
_METHOD = ("Lloyd-Max fixed point (boundaries = midpoints, levels = centroids), closed-form "
           "cell moments, Newton-accelerated, converged when a plain Lloyd step moves < tol")
_UNITS = "levels and mse in N(0,1) units: y = coordinate * sqrt(dim) of a unit vector"

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "codebooks"


class CodebookFileError(ValueError):
    """A stored codebook file is unreadable, inconsistent or fails its checksum."""


def levels_checksum(levels):
    """SHA-256 hex digest of the little-endian float64 bytes of ``levels``."""
    return hashlib.sha256(np.ascontiguousarray(levels, dtype="<f8").tobytes()).hexdigest()


@dataclass(frozen=True, eq=False)
class Codebook:
    """A fitted scalar codebook in N(0, 1) units (see the module docstring).

    Parameters
    ----------
    dist : {"gaussian", "beta"}
    dim : int or None
        Dimension of the Beta density; None for gaussian.
    bits : int
        1..8; ``2**bits`` levels.
    levels : array_like of shape (2**bits,)
        Strictly ascending, finite; stored as a read-only float64 copy.
    mse : float
        Mean squared error per coordinate, in N(0, 1) units (= relative squared L2 error of a
        row for beta).
    tol : float
        Convergence tolerance of the fit (max level change of the last Lloyd step).
    iterations : int, optional
        Updates the fit took.
    versions : mapping, optional
        Library versions the fit ran with (``{"scipy": ..., "numpy": ...}``).

    Attributes
    ----------
    boundaries : ndarray of shape (2**bits - 1,), dtype float64
        Midpoints of neighbouring levels, read-only.
    checksum : str
        SHA-256 hex of the little-endian float64 bytes of ``levels``.
    levels_f32 : ndarray of shape (2**bits,), dtype float32
        ``levels`` rounded to float32, read-only (what the kernels use).
    identity : str
        ``"beta-d128-b4"`` or ``"gaussian-b4"``; also the stored file's stem.

    Notes
    -----
    Two codebooks compare equal when dist, dim, bits and the checksum of the levels agree.
    """

    dist: str
    dim: int | None
    bits: int
    levels: np.ndarray
    mse: float
    tol: float
    iterations: int | None = None
    versions: object = field(default_factory=dict)
    boundaries: np.ndarray = field(init=False, repr=False)
    checksum: str = field(init=False)
    levels_f32: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        dist, dim, bits = _check_args(self.dist, self.dim, self.bits)
        if dist == "gaussian":
            dim = None
        elif dim is None:
            raise ValueError("a beta codebook needs dim (an integer >= 2), got None")
        levels = np.array(self.levels, dtype=np.float64).reshape(-1)
        if levels.size != 2**bits:
            raise ValueError(f"{bits}-bit codebook needs {2**bits} levels, got {levels.size}")
        if not (np.all(np.isfinite(levels)) and np.all(np.diff(levels) > 0)):
            raise ValueError("codebook levels must be finite and strictly ascending")
        boundaries = 0.5 * (levels[:-1] + levels[1:])
        levels_f32 = levels.astype(np.float32)
        for arr in (levels, boundaries, levels_f32):
            arr.flags.writeable = False
        setattr_ = functools.partial(object.__setattr__, self)
        setattr_("dist", dist)
        setattr_("dim", dim)
        setattr_("bits", bits)
        setattr_("levels", levels)
        setattr_("mse", float(self.mse))
        setattr_("tol", float(self.tol))
        setattr_("iterations", None if self.iterations is None else int(self.iterations))
        setattr_("versions", MappingProxyType(dict(self.versions)))
        setattr_("boundaries", boundaries)
        setattr_("checksum", levels_checksum(levels))
        setattr_("levels_f32", levels_f32)

    @property
    def identity(self):
        return _identity(self.dist, self.dim, self.bits)

    @property
    def n_levels(self):
        return self.levels.size

    def __eq__(self, other):
        if not isinstance(other, Codebook):
            return NotImplemented
        return (self.dist, self.dim, self.bits, self.checksum) == (
            other.dist, other.dim, other.bits, other.checksum)

    def __hash__(self):
        return hash((self.dist, self.dim, self.bits, self.checksum))

    def __repr__(self):
        return (f"Codebook({self.identity}, mse={self.mse:.6g}, tol={self.tol:g}, "
                f"checksum={self.checksum[:12]}...)")


def _identity(dist, dim, bits):
    return f"gaussian-b{bits}" if dist == "gaussian" else f"beta-d{dim}-b{bits}"


def _check_bits(bits):
    lo, hi = BITS_RANGE
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not lo <= bits <= hi:
        raise ValueError(f"bits must be an integer in {lo}..{hi}, got {bits!r}")
    return int(bits)


def _check_args(dist, dim, bits):
    """Validate (dist, dim, bits); dim may be None (required later for beta)."""
    if dist not in DISTS:
        raise ValueError(f"dist must be one of {DISTS}, got {dist!r}")
    bits = _check_bits(bits)
    if dim is not None:
        dim = _check_dim(dim)
    return dist, dim, bits


def _versions():
    return {"scipy": scipy.__version__, "numpy": np.__version__}


# --------------------------------------------------------------------------------------------
# Fitting, files, loading
# --------------------------------------------------------------------------------------------


def fit_codebook(dist, dim, bits, tol=DEFAULT_TOL):
    """Fit the Lloyd-Max codebook of ``dist`` (at ``dim`` for beta) with ``2**bits`` levels.

    Parameters
    ----------
    dist : {"gaussian", "beta"}
    dim : int or None
        Required (>= 2) for beta; ignored for gaussian (may be None).
    bits : int
        1..8.
    tol : float
        Stop when a plain Lloyd step moves no level by ``tol`` or more (N(0, 1) units).

    Returns
    -------
    Codebook

    Raises
    ------
    ValueError
        Bad ``dist``, ``dim`` or ``bits``, naming the value and the accepted range.
    ConvergenceError
        The fit did not converge.
    """
    dist, dim, bits = _check_args(dist, dim, bits)
    if dist == "beta":
        if dim is None:
            raise ValueError("dist='beta' needs dim, an integer >= 2; got None")
        density = beta_density(dim)
    else:
        dim = None
        density = gaussian_density()
    result = density.fit(2**bits, tol=tol)
    return Codebook(dist=dist, dim=dim, bits=bits, levels=result.levels, mse=result.mse,
                    tol=tol, iterations=result.iterations, versions=_versions())


def _format_codebook(cb):
    meta = {
        "format": FILE_FORMAT,
        "format_version": FILE_FORMAT_VERSION,
        "identity": cb.identity,
        "dist": cb.dist,
        "dim": cb.dim,
        "bits": cb.bits,
        "units": _UNITS,
        "method": _METHOD,
        "mse": cb.mse,
        "tol": cb.tol,
        "iterations": cb.iterations,
        "scipy_version": cb.versions.get("scipy"),
        "numpy_version": cb.versions.get("numpy"),
        "checksum": cb.checksum,
    }
    lines = ["{"]
    lines += [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in meta.items()]
    # json.dumps writes floats with repr, the shortest string that round-trips.
    values = [json.dumps(float(v)) for v in cb.levels]
    rows = [", ".join(values[i:i + 4]) for i in range(0, len(values), 4)]
    lines.append('  "levels": [')
    lines += [f"    {row}," for row in rows[:-1]] + [f"    {rows[-1]}"]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def write_codebook(cb, directory):
    """Write ``cb`` as ``<directory>/<identity>.json`` (deterministic content).

    Parameters
    ----------
    cb : Codebook
    directory : str or path-like
        Created if missing.

    Returns
    -------
    pathlib.Path
        The file written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{cb.identity}.json"
    text = _format_codebook(cb)
    # write-then-rename, so that a reader never sees a half-written file, and a failed write
    # (a full disk) leaves neither a half-written file nor its temp file behind
    return atomic_write(path, lambda f: f.write(text))


def _parse_codebook(text, source):
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CodebookFileError(f"codebook file {source} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise CodebookFileError(f"codebook file {source} is not a {FILE_FORMAT} file")
    if data.get("format_version") != FILE_FORMAT_VERSION:
        raise CodebookFileError(
            f"codebook file {source} has format_version {data.get('format_version')!r}; "
            f"this kvquant reads version {FILE_FORMAT_VERSION}"
        )
    missing = [k for k in ("dist", "dim", "bits", "levels", "mse", "tol", "checksum")
               if k not in data]
    if missing:
        raise CodebookFileError(f"codebook file {source} lacks {', '.join(missing)}")
    try:
        cb = Codebook(dist=data["dist"], dim=data["dim"], bits=data["bits"],
                      levels=data["levels"], mse=data["mse"], tol=data["tol"],
                      iterations=data.get("iterations"),
                      versions={"scipy": data.get("scipy_version"),
                                "numpy": data.get("numpy_version")})
    except (TypeError, ValueError) as exc:
        raise CodebookFileError(f"codebook file {source} is inconsistent: {exc}") from None
    if cb.checksum != data["checksum"]:
        raise CodebookFileError(
            f"codebook file {source} fails its checksum: it records {data['checksum']}, its "
            f"levels hash to {cb.checksum}; the file is corrupted or was edited by hand "
            f"(regenerate it with `kvquant codebooks fit ... --out kvquant/data/codebooks` in a "
            "source tree, then reinstall)"
        )
    if data.get("identity", cb.identity) != cb.identity:
        raise CodebookFileError(
            f"codebook file {source} names itself {data['identity']!r} but holds {cb.identity!r}")
    return cb


def read_codebook(path):
    """Read one codebook file and verify its checksum.

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    Codebook

    Raises
    ------
    CodebookFileError
        Unreadable, inconsistent, or checksum mismatch; the message names the file.
    """
    path = Path(path)
    return _parse_codebook(path.read_text(encoding="utf-8"), path)


def _stored_identities():
    names = {_identity("gaussian", None, b) for b in range(BITS_RANGE[0], BITS_RANGE[1] + 1)}
    names |= {_identity("beta", d, b) for d in STORED_BETA_DIMS
              for b in range(BITS_RANGE[0], BITS_RANGE[1] + 1)}
    return frozenset(names)


def _package_resource(name):
    return resources.files("kvquant").joinpath("data").joinpath(
        "codebooks").joinpath(name)


@functools.lru_cache(maxsize=256)
def _load_cached(dist, dim, bits):
    identity = _identity(dist, dim, bits)
    if identity in _stored_identities():
        resource = _package_resource(f"{identity}.json")
        if not resource.is_file():
            raise CodebookFileError(
                f"stored codebook {identity}.json is missing from the kvquant package data "
                f"(broken install? regenerate with `kvquant codebooks fit --all --out "
                "kvquant/data/codebooks` in a source tree, then reinstall)"
            )
        cb = _parse_codebook(resource.read_text(encoding="utf-8"), resource)
        if (cb.dist, cb.dim, cb.bits) != (dist, dim, bits):
            raise CodebookFileError(f"codebook file {resource} holds {cb.identity}, not {identity}")
        return cb
    return fit_codebook(dist, dim, bits)


def load_codebook(dist, dim, bits):
    """Return the codebook for (dist, dim, bits), from package data when stored.

    Stored: gaussian for bits 1..8, beta for dim in 16, 32, ..., 4096 and bits 1..8; their
    checksum is verified on first load. Any other beta dimension (>= 2, power of two or not) is
    fitted on the fly, which takes milliseconds to a fraction of a second. Results are cached:
    repeated calls return the same (immutable) object.

    Parameters
    ----------
    dist : {"gaussian", "beta"}
    dim : int or None
        Beta: the dimension, >= 2. Gaussian: ignored (the N(0, 1) codebook does not depend on
        it), but validated when given; the result has ``dim = None``.
    bits : int
        1..8.

    Returns
    -------
    Codebook

    Raises
    ------
    ValueError
        Bad dist, dim or bits (the message names the value and the accepted range).
    CodebookFileError
        A stored file is missing, inconsistent or fails its checksum (the message names it).
    """
    dist, dim, bits = _check_args(dist, dim, bits)
    if dist == "gaussian":
        dim = None
    elif dim is None:
        raise ValueError("dist='beta' needs dim, an integer >= 2; got None")
    lent = _LENT.get(_identity(dist, dim, bits))
    return lent if lent is not None else _load_cached(dist, dim, bits)


_LENT = {}   # identity -> Codebook, while a use_codebooks block is open


@contextlib.contextmanager
def use_codebooks(*codebooks):
    """Inside the ``with`` block, :func:`load_codebook` returns these codebooks for their
    (dist, dim, bits) instead of the stored ones.

    A codec keeps the levels it was built with, so ``get_codec("tq4", 64)`` inside the block
    uses a lent ``beta-d64-b4`` for its whole life, and outside it the stored one. Its spec is
    the same string; what tells the two apart is ``codec.codebook_checksum`` (the SHA-256 of
    the levels), which the ``.kvq`` cache file records and checks: a file written with a lent
    codebook is refused under the stored one, and the other way round.

    Parameters
    ----------
    *codebooks : Codebook
        At most one per identity (``beta-d64-b4``, ``gaussian-b3``, ...). Levels fitted to any
        density go in as ``Codebook(dist="beta", dim=..., bits=..., levels=..., ...)`` (the
        slot of the codec that will use them), in N(0, 1) units.

    Yields
    ------
    None

    Raises
    ------
    TypeError
        Something that is not a Codebook.
    ValueError
        Two codebooks of the same identity, or one already lent by an enclosing block.
    """
    lent = {}
    for cb in codebooks:
        if not isinstance(cb, Codebook):
            raise TypeError(f"use_codebooks takes Codebook objects, got {type(cb).__name__}")
        if cb.identity in lent or cb.identity in _LENT:
            raise ValueError(f"two codebooks for {cb.identity} in use at once: lend one")
        lent[cb.identity] = cb
    _LENT.update(lent)
    try:
        yield
    finally:
        for identity in lent:
            del _LENT[identity]


def regenerate(dists=DISTS, dims=STORED_BETA_DIMS, bits_list=range(1, 9), directory=None,
               tol=DEFAULT_TOL, log=None):
    """Fit and write codebook files for every requested combination.

    Parameters
    ----------
    dists : iterable of {"gaussian", "beta"}
    dims : iterable of int
        Beta dimensions (ignored for gaussian, which gets one file per bits).
    bits_list : iterable of int
        Each in 1..8.
    directory : str or path-like, optional
        Default: the package data folder ``kvquant/data/codebooks``.
    tol : float
    log : callable, optional
        Called with one line of text per file written.

    Returns
    -------
    list of pathlib.Path
        Files written, in order.
    """
    directory = DEFAULT_DATA_DIR if directory is None else Path(directory)
    dists, dims, bits_list = list(dists), list(dims), list(bits_list)
    for dist in dists:
        _check_args(dist, None, BITS_RANGE[0])
    bits_list = [_check_bits(b) for b in bits_list]
    dims = [_check_dim(d) for d in dims]
    if "beta" in dists and not dims:
        raise ValueError("dist 'beta' needs at least one dim")
    jobs = []
    for dist in dists:
        for dim in (dims if dist == "beta" else [None]):
            jobs += [(dist, dim, bits) for bits in bits_list]
    written = []
    for dist, dim, bits in jobs:
        start = time.perf_counter()
        cb = fit_codebook(dist, dim, bits, tol=tol)
        path = write_codebook(cb, directory)
        written.append(path)
        if log is not None:
            log(f"{path}  mse={cb.mse:.6g}  iterations={cb.iterations}  "
                f"{time.perf_counter() - start:.3f} s")
    _load_cached.cache_clear()
    return written
