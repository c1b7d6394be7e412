"""Lloyd-Max scalar codebooks: fitting with closed forms, stored package data, loading.

Units. The rotated codecs compute ``y = rotate(x) * sqrt(d) / |x|`` and snap each coordinate of
``y`` to the nearest level. Every codebook here lives in those "N(0, 1)" units:

* ``gaussian``: the Lloyd-Max quantizer of N(0, 1) (Max 1960), the engine's codebook family.
* ``beta`` at dimension ``d``: one coordinate ``t`` of a uniformly random unit vector of R^d has
  density proportional to ``(1 - t^2)^((d-3)/2)`` on [-1, 1] (docs/reference.md §2); the levels are
  fitted to ``y = t * sqrt(d)``, whose variance is exactly 1 and whose density tends to N(0, 1).

``Codebook.mse`` is the mean squared error per coordinate in the same units, that is ``d`` times
the MSE of ``t``, which is also the expected relative squared L2 error ``E|x - x^|^2 / |x|^2`` of a
whole row (before any float32 rounding).

Fitting. :func:`fit_lloyd_max` is a generic core: it takes the CDF and the partial moments of a
density as callables, so cell probabilities, centroids and the MSE are closed forms evaluated at the
cell boundaries (no quadrature). The result is the Lloyd fixed point: boundaries are the midpoints
of neighbouring levels and every level is the centroid of its cell. Newton steps on that fixed-point
equation only accelerate the search (plain Lloyd needs tens of thousands of iterations at 8 bits);
convergence is always declared by a plain Lloyd step that moves no level by ``tol`` or more.

Storage. One JSON file per (dist, dim, bits) in ``kvquant/data/codebooks/``: Gaussian for bits
1..8 and Beta for d = 16, 32, ..., 4096 and bits 1..8, written by :func:`regenerate` (the
``kvquant codebooks fit`` command, which writes to ``--out``, by default ``./codebooks``; to
install fitted codebooks, write them into ``kvquant/data/codebooks`` of a source tree and
reinstall). :func:`load_codebook` reads them (checking a SHA-256 of the levels) and fits anything
else on the fly. :func:`use_codebooks` lends codebooks of one's own (a refit, levels fitted to
another density) to the codecs built inside a ``with`` block, without installing them.
"""
import contextlib
import functools
import hashlib
import json
import math
import numbers
import os
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType

import numpy as np
import scipy
from scipy import linalg, special

from kvquant.outputs import check_out_dir

__all__ = [
    "BITS_RANGE",
    "DEFAULT_TOL",
    "DISTS",
    "STORED_BETA_DIMS",
    "Codebook",
    "CodebookFileError",
    "ConvergenceError",
    "LloydMaxResult",
    "ScalarDensity",
    "add_cli",
    "beta_density",
    "fit_codebook",
    "fit_lloyd_max",
    "gaussian_density",
    "load_codebook",
    "polar_angle_density",
    "quantizer_mse",
    "read_codebook",
    "regenerate",
    "use_codebooks",
    "write_codebook",
]

DISTS = ("gaussian", "beta")
BITS_RANGE = (1, 8)
STORED_BETA_DIMS = tuple(2**k for k in range(4, 13))  # 16 .. 4096
DEFAULT_TOL = 1e-12
# With Newton acceleration the stored codebooks need at most 5 updates; the budget is
# large so that callers without a pdf (plain Lloyd) still converge at 8 bits.
DEFAULT_MAX_ITER = 200_000

FILE_FORMAT = "kvquant-codebook"
FILE_FORMAT_VERSION = 1
_METHOD = ("Lloyd-Max fixed point (boundaries = midpoints, levels = centroids), closed-form "
           "cell moments, Newton-accelerated, converged when a plain Lloyd step moves < tol")
_UNITS = "levels and mse in N(0,1) units: y = coordinate * sqrt(dim) of a unit vector"

_PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_DATA_DIR = _PACKAGE_DIR / "data" / "codebooks"


class ConvergenceError(RuntimeError):
    """The Lloyd iteration did not reach its tolerance within the iteration budget."""


class CodebookFileError(ValueError):
    """A stored codebook file is unreadable, inconsistent or fails its checksum."""


# --------------------------------------------------------------------------------------------
# Generic Lloyd-Max core
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LloydMaxResult:
    """Outcome of :func:`fit_lloyd_max`.

    Attributes
    ----------
    levels : ndarray of shape (n_levels,), dtype float64
        Ascending reconstruction levels (the last plain Lloyd iterate).
    boundaries : ndarray of shape (n_levels - 1,), dtype float64
        Midpoints of neighbouring levels.
    mse : float
        Mean squared error of the quantizer ``levels`` with ``boundaries`` (NaN when no partial
        second moment was given).
    iterations : int
        Number of updates (Lloyd or Newton steps) before convergence.
    newton_steps : int
        How many of those updates were accepted Newton steps.
    max_change : float
        Largest level change of the final plain Lloyd step (< ``tol``).
    """

    levels: np.ndarray
    boundaries: np.ndarray
    mse: float
    iterations: int
    newton_steps: int
    max_change: float


def fit_lloyd_max(cdf, partial_moment, lo, hi, n_levels, *, pdf=None, partial_second_moment=None,
                  center=None, init=None, tol=DEFAULT_TOL, max_iter=DEFAULT_MAX_ITER):
    """Fit the Lloyd-Max quantizer of a one-dimensional density from closed-form moments.

    The density ``f`` lives on ``[lo, hi]`` (either end may be infinite). The quantizer is the
    fixed point of the Lloyd map: boundaries are the midpoints of neighbouring levels (the first
    and last cells extend to ``lo`` and ``hi``), and each level is the centroid of its cell,
    ``c_i = (M(b_i) - M(b_{i-1})) / (F(b_i) - F(b_{i-1}))``.

    Parameters
    ----------
    cdf : callable
        ``F(x) = integral of f from lo to x``, vectorized over a float64 ndarray; must return 0 at
        ``lo`` and 1 at ``hi`` (accept infinities when the domain is infinite).
    partial_moment : callable
        ``M(x) = integral of t f(t) dt from lo to x``, vectorized; 0 at ``lo``.
    lo, hi : float
        Support of the density, ``lo < hi``.
    n_levels : int
        Number of levels, >= 1.
    pdf : callable, optional
        ``f(x)``, vectorized; only evaluated strictly inside ``(lo, hi)``. When given, Newton
        steps on the fixed-point equation (tridiagonal Jacobian from ``f`` at the boundaries)
        accelerate convergence; without it the iteration is plain Lloyd.
    partial_second_moment : callable, optional
        ``S(x) = integral of t^2 f(t) dt from lo to x``, vectorized; 0 at ``lo``. Needed for
        ``mse``, computed per cell as ``integral of (t - c_i)^2 f``, which holds off the fixed
        point too.
    center : float, optional
        Declare ``f`` symmetric about ``center`` (``lo`` and ``hi`` must be symmetric about it).
        Then only the lower half is fitted and mirrored: the levels are exactly symmetric, and the
        callables are only evaluated at ``x <= center``, where tail probabilities are small numbers
        computed without cancellation (the upper tail of a CDF is ``1 - small``). For an odd
        ``n_levels`` the middle level is ``center``.
    init : array_like of shape (n_levels,), optional
        Ascending initial levels inside ``(lo, hi)`` (in symmetric mode only the lower half is
        used). Quantiles ``F^-1((i + 1/2) / n_levels)`` are a good choice. Default: the centres
        of ``n_levels`` equal cells of ``[lo, hi]``, which needs a finite domain.
    tol : float
        Convergence: stop when a plain Lloyd step moves no level by ``tol`` or more.
    max_iter : int
        Budget of updates; :class:`ConvergenceError` when exhausted.

    Returns
    -------
    LloydMaxResult

    Raises
    ------
    ValueError
        Bad arguments, or a cell of zero probability (the density vanishes there).
    ConvergenceError
        No convergence within ``max_iter`` updates.

    Notes
    -----
    Why Newton: the Lloyd map contracts more and more slowly as levels multiply (at 8 bits on
    N(0, 1) plain Lloyd takes ~120 000 steps, and when its step falls below 1e-12 it is still
    ~1e-8 from the fixed point). Newton reaches the fixed point to rounding in a handful of steps;
    a step is only accepted when it keeps the levels ordered and shrinks the Lloyd residual.

    Accuracy: centroids are ratios of differences of ``F`` and ``M``. In non-symmetric mode, cells
    in a long upper tail take differences of values close to 1, which limits the attainable
    ``tol`` (about 3e-12 for N(0, 1) at 8 bits); ``center`` avoids this for symmetric densities.
    The MSE sums ``dS - 2 c dM + c^2 dF`` per cell, accurate to about 1e-15 absolute per cell.

    Polar-angle densities, ``f(psi)`` proportional to ``sin^k(2 psi)`` on ``[0, pi/2]``, fit with
    ``center=pi/4``: ``F(psi) = I_s((k+1)/2, (k+1)/2)`` with ``s = sin^2(psi)`` (substitute
    ``ds = sin(2 psi) dpsi``); ``M(psi) = psi F(psi) - int_0^psi F`` has no elementary form for
    general ``k``, but any accurate vectorized evaluation (e.g. ``scipy.integrate.quad`` per
    boundary, or Gauss-Legendre on the smooth integrand) will do. A uniform density on
    ``[lo, hi]`` (``M(x) = (x^2 - lo^2) / (2 (hi - lo))``) gives the uniform quantizer.
    """
    n_levels = _as_int(n_levels, "n_levels")
    if n_levels < 1:
        raise ValueError(f"n_levels must be >= 1, got {n_levels}")
    lo, hi = float(lo), float(hi)
    if not lo < hi:
        raise ValueError(f"need lo < hi, got lo={lo!r}, hi={hi!r}")
    if not (isinstance(tol, numbers.Real) and tol > 0):
        raise ValueError(f"tol must be a positive number, got {tol!r}")
    max_iter = _as_int(max_iter, "max_iter")
    if max_iter < 0:
        raise ValueError(f"max_iter must be >= 0, got {max_iter}")

    symmetric = center is not None
    if symmetric:
        center = float(center)
        if not lo < center < hi:
            raise ValueError(f"center={center!r} is not inside ({lo!r}, {hi!r})")
        finite = math.isfinite(lo) and math.isfinite(hi)
        if finite and not math.isclose(center - lo, hi - center, rel_tol=1e-12):
            raise ValueError(f"[{lo!r}, {hi!r}] is not symmetric about center={center!r}")
        if math.isfinite(lo) != math.isfinite(hi):
            raise ValueError(f"[{lo!r}, {hi!r}] is not symmetric about center={center!r}")
        n_free, odd = n_levels // 2, n_levels % 2
    else:
        n_free, odd = n_levels, 0

    x = _initial_free_levels(init, lo, hi, n_levels, n_free, center)

    def last_boundary(levels):
        # Non-symmetric: the last cell ends at hi. Symmetric: the lower half ends at center for
        # an even count, or at the midpoint with the central level for an odd one.
        if not symmetric:
            return hi
        return 0.5 * (levels[-1] + center) if odd else center

    def lloyd_map(levels):
        b = np.empty(n_free + 1)
        b[0] = lo
        b[1:n_free] = 0.5 * (levels[:-1] + levels[1:])
        b[n_free] = last_boundary(levels)
        F = np.empty_like(b)
        M = np.empty_like(b)
        F[0] = M[0] = 0.0  # by definition; spares callables the (possibly infinite) lo
        F[1:] = cdf(b[1:])
        M[1:] = partial_moment(b[1:])
        p = np.diff(F)
        if not np.all(p > 0):
            bad = int(np.flatnonzero(~(p > 0))[0])
            raise ValueError(
                f"cell [{b[bad]!r}, {b[bad + 1]!r}] has probability {p[bad]!r}: the density "
                f"vanishes there or the CDF is not increasing"
            )
        return np.diff(M) / p, b, p

    def newton_step(levels, mapped, b, p):
        # Jacobian of the Lloyd map: c_i depends on b_{i-1} and b_i only, each boundary on two
        # neighbouring levels, so J is tridiagonal and (J - I) delta = -(T(x) - x) is cheap.
        m = n_free
        f = np.zeros(m + 1)
        moving = slice(1, m + 1 if (symmetric and odd) else m)
        f[moving] = pdf(b[moving])
        dc_dlower = f[:-1] * (mapped - b[:-1]) / p  # d c_i / d b_{i-1}
        dc_dupper = f[1:] * (b[1:] - mapped) / p  # d c_i / d b_i
        dc_dlower[0] = 0.0  # b_0 = lo is fixed
        if not (symmetric and odd):
            dc_dupper[-1] = 0.0  # the last boundary is fixed
        ab = np.zeros((3, m))
        ab[0, 1:] = 0.5 * dc_dupper[:-1]
        ab[1, :] = 0.5 * (dc_dlower + dc_dupper) - 1.0
        ab[2, :-1] = 0.5 * dc_dlower[1:]
        delta = linalg.solve_banded((1, 1), ab, levels - mapped)
        return levels + delta

    def is_valid(levels):
        upper = center if symmetric else hi
        return bool(np.all(np.isfinite(levels)) and levels[0] > lo and levels[-1] < upper
                    and np.all(np.diff(levels) > 0))

    iterations = newton_steps = 0
    if n_free == 0:
        free = x
        max_change = 0.0
    else:
        mapped, b, p = lloyd_map(x)
        while True:
            max_change = float(np.max(np.abs(mapped - x)))
            if max_change < tol:
                break
            if iterations >= max_iter:
                raise ConvergenceError(
                    f"Lloyd-Max did not converge in {max_iter} updates for {n_levels} levels: "
                    f"last max level change {max_change:.3e} >= tol {tol:.3e}"
                )
            iterations += 1
            accepted = False
            if pdf is not None:
                try:
                    with np.errstate(all="ignore"):
                        candidate = newton_step(x, mapped, b, p)
                    if is_valid(candidate):
                        c_mapped, c_b, c_p = lloyd_map(candidate)
                        if np.max(np.abs(c_mapped - candidate)) < max_change:
                            x, mapped, b, p = candidate, c_mapped, c_b, c_p
                            newton_steps += 1
                            accepted = True
                except (ValueError, linalg.LinAlgError, FloatingPointError):
                    accepted = False  # an unusable Newton step: fall back to a Lloyd step
            if not accepted:
                x = mapped
                mapped, b, p = lloyd_map(x)
        free = mapped

    levels = _mirror(free, center, odd) if symmetric else free.copy()
    boundaries = 0.5 * (levels[:-1] + levels[1:])
    mse = math.nan
    if partial_second_moment is not None:
        mse = _squared_error(levels, lo, hi, center, cdf, partial_moment,
                             partial_second_moment)
    return LloydMaxResult(levels=levels, boundaries=boundaries, mse=mse, iterations=iterations,
                          newton_steps=newton_steps, max_change=max_change)


def _initial_free_levels(init, lo, hi, n_levels, n_free, center):
    if init is None:
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError("init is required when the domain is infinite (e.g. quantiles)")
        init = lo + (np.arange(n_levels) + 0.5) * ((hi - lo) / n_levels)
    init = np.array(init, dtype=np.float64).reshape(-1)
    if init.shape != (n_levels,):
        raise ValueError(f"init must hold n_levels={n_levels} values, got {init.size}")
    x = init[:n_free].copy()
    upper = center if center is not None else hi
    if n_free and not (np.all(np.isfinite(x)) and x[0] > lo and x[-1] < upper
                       and np.all(np.diff(x) > 0)):
        raise ValueError(
            f"init levels must be finite, strictly ascending and inside ({lo!r}, {upper!r})"
            + (" (the lower half must lie below center)" if center is not None else "")
        )
    return x


def _mirror(free, center, odd):
    upper = (2.0 * center - free)[::-1]
    middle = np.array([center]) if odd else np.empty(0)
    return np.concatenate([free, middle, upper])


def _squared_error(levels, lo, hi, center, cdf, partial_moment, partial_second_moment):
    """Integral of (t - q(t))^2 f(t) with q the nearest of ``levels`` (midpoint boundaries).

    Per cell [a, b] with level c: ``dS - 2 c dM + c^2 dF``. Cells wholly above ``center`` are
    mirrored below it, where a symmetric density's tails are small numbers rather than 1 - small.
    Endpoints equal to ``lo`` are not evaluated (all three functions are 0 there).
    """
    bounds = np.concatenate([[lo], 0.5 * (levels[:-1] + levels[1:]), [hi]])
    a, b, c = bounds[:-1].copy(), bounds[1:].copy(), levels.astype(np.float64, copy=True)
    if center is not None:
        up = a >= center
        a[up], b[up], c[up] = 2.0 * center - b[up], 2.0 * center - a[up], 2.0 * center - c[up]

    def moments(x):
        F, M, S = np.zeros_like(x), np.zeros_like(x), np.zeros_like(x)
        inner = x != lo
        F[inner] = cdf(x[inner])
        M[inner] = partial_moment(x[inner])
        S[inner] = partial_second_moment(x[inner])
        return F, M, S

    (Fa, Ma, Sa), (Fb, Mb, Sb) = moments(a), moments(b)
    return float(np.sum((Sb - Sa) - 2.0 * c * (Mb - Ma) + c * c * (Fb - Fa)))


def quantizer_mse(levels, density):
    """Mean squared error of nearest-level quantization of ``density`` with any ``levels``.

    Closed form per cell (no quadrature), valid off the Lloyd fixed point too, e.g. for the
    engine's 3-decimal levels.

    Parameters
    ----------
    levels : array_like of shape (n_levels,)
        Strictly ascending; boundaries are the midpoints.
    density : ScalarDensity

    Returns
    -------
    float
    """
    levels = np.array(levels, dtype=np.float64).reshape(-1)
    if levels.size < 1 or not (np.all(np.isfinite(levels)) and np.all(np.diff(levels) > 0)):
        raise ValueError("levels must be a non-empty, finite, strictly ascending sequence")
    return _squared_error(levels, density.lo, density.hi, density.center, density.cdf,
                          density.partial_moment, density.partial_second_moment)


# --------------------------------------------------------------------------------------------
# The two densities, in N(0, 1) units
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalarDensity:
    """A one-dimensional density with the closed forms :func:`fit_lloyd_max` needs.

    Attributes
    ----------
    name : str
    lo, hi : float
        Support.
    center : float or None
        Centre of symmetry.
    pdf, cdf, partial_moment, partial_second_moment, ppf : callable
        Vectorized ``f``, ``F``, ``M(x) = int_lo^x t f``, ``S(x) = int_lo^x t^2 f`` and ``F^-1``.
    """

    name: str
    lo: float
    hi: float
    center: float | None
    pdf: object
    cdf: object
    partial_moment: object
    partial_second_moment: object
    ppf: object

    def fit(self, n_levels, tol=DEFAULT_TOL, max_iter=DEFAULT_MAX_ITER):
        """Lloyd-Max fit started from the quantiles ``F^-1((i + 1/2) / n_levels)``."""
        init = self.ppf((np.arange(n_levels) + 0.5) / n_levels)
        return fit_lloyd_max(self.cdf, self.partial_moment, self.lo, self.hi, n_levels,
                             pdf=self.pdf, partial_second_moment=self.partial_second_moment,
                             center=self.center, init=init, tol=tol, max_iter=max_iter)


_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gaussian_density():
    """N(0, 1) with ``F = ndtr``, ``M(x) = -phi(x)``, ``S(x) = F(x) - x phi(x)``.

    Returns
    -------
    ScalarDensity
    """

    def pdf(x):
        x = np.asarray(x, dtype=np.float64)
        return _INV_SQRT_2PI * np.exp(-0.5 * x * x)

    def partial_moment(x):
        return -pdf(x)

    def partial_second_moment(x):
        x = np.asarray(x, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            x_phi = np.where(np.isfinite(x), x * pdf(x), 0.0)  # x phi(x) -> 0 at +-inf
        return special.ndtr(x) - x_phi

    return ScalarDensity(name="gaussian", lo=-math.inf, hi=math.inf, center=0.0, pdf=pdf,
                         cdf=special.ndtr, partial_moment=partial_moment,
                         partial_second_moment=partial_second_moment, ppf=special.ndtri)


def beta_density(dim):
    """Density of ``y = t sqrt(dim)``, ``t`` one coordinate of a uniform unit vector of R^dim.

    ``f_t(t) = (1 - t^2)^a / B(1/2, a + 1)`` on [-1, 1] with ``a = (dim - 3) / 2``. Closed forms
    (with ``u = t^2`` and ``betaincc`` the complemented regularized incomplete beta function):

    * ``F_t(t) = betaincc(1/2, a + 1, u) / 2`` for ``t <= 0`` and ``1 - F_t(-t)`` above (the
      complement function keeps full relative precision in the lower tail);
    * ``M_t(t) = -(1 - t^2)^(a + 1) / (2 (a + 1) B(1/2, a + 1))``;
    * ``S_t(t) = t M_t(t) + F_t^(a + 1)(t) / dim`` (integration by parts; ``F^(a+1)`` is the CDF
      of the same family at dimension ``dim + 2``), so ``S_t(1) = 1 / dim``.

    Normalizers are taken in log space (``betaln``) so that dim = 4096 and beyond do not
    overflow. In ``y`` units: ``F(y) = F_t(t)``, ``M(y) = sqrt(dim) M_t(t)``,
    ``S(y) = y M(y) + F^(a+1)(t)``.

    Parameters
    ----------
    dim : int
        Dimension, >= 2 (dim = 2 is the arcsine density, unbounded at the ends).

    Returns
    -------
    ScalarDensity
        Supported on ``[-sqrt(dim), sqrt(dim)]``, symmetric about 0, variance 1.
    """
    dim = _check_dim(dim)
    a = 0.5 * (dim - 3)
    scale = math.sqrt(dim)
    log_norm = special.betaln(0.5, a + 1.0)

    def to_t(y):
        return np.clip(np.asarray(y, dtype=np.float64) / scale, -1.0, 1.0)

    def log_one_minus_t2(t):
        # log((1 - t)(1 + t)) keeps full precision near |t| = 1, unlike log1p(-t*t).
        with np.errstate(divide="ignore"):
            return np.log1p(-t) + np.log1p(t)

    def cdf_t(t, exponent):
        lower_tail = 0.5 * special.betaincc(0.5, exponent + 1.0, t * t)
        return np.where(t < 0, lower_tail, 1.0 - lower_tail)

    def pdf(y):
        t = to_t(y)
        log_kernel = a * log_one_minus_t2(t) if a != 0 else np.zeros_like(t)
        inside = np.abs(np.asarray(y, dtype=np.float64)) <= scale
        with np.errstate(over="ignore"):
            return np.where(inside, np.exp(log_kernel - log_norm) / scale, 0.0)

    def cdf(y):
        return cdf_t(to_t(y), a)

    def partial_moment(y):
        t = to_t(y)
        log_abs = (a + 1.0) * log_one_minus_t2(t) - math.log(2.0 * (a + 1.0)) - log_norm
        return -scale * np.exp(log_abs)

    def partial_second_moment(y):
        t = to_t(y)
        return scale * t * partial_moment(y) + cdf_t(t, a + 1.0)

    def ppf(q):
        q = np.asarray(q, dtype=np.float64)
        lower = q < 0.5
        # Invert each half with the incomplete beta function that is small there.
        u_lower = special.betainccinv(0.5, a + 1.0, np.where(lower, 2.0 * q, 1.0))
        u_upper = special.betaincinv(0.5, a + 1.0, np.where(lower, 0.0, 2.0 * q - 1.0))
        return scale * np.where(lower, -np.sqrt(u_lower), np.sqrt(u_upper))

    return ScalarDensity(name=f"beta-d{dim}", lo=-scale, hi=scale, center=0.0, pdf=pdf, cdf=cdf,
                         partial_moment=partial_moment,
                         partial_second_moment=partial_second_moment, ppf=ppf)


# --------------------------------------------------------------------------------------------
# Codebook objects
# --------------------------------------------------------------------------------------------


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


def _as_int(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _check_dim(dim):
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    return int(dim)


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
    # Write-then-rename so that a reader never sees a half-written file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


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
    return resources.files(__package__ or "kvquant").joinpath("data").joinpath(
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


# --------------------------------------------------------------------------------------------
# Command line: `kvquant codebooks fit ...`
# --------------------------------------------------------------------------------------------


def _parse_int_list(text, name, allow_ranges):
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            if allow_ranges and "-" in part:
                first, last = (int(s) for s in part.split("-", 1))
                if first > last:
                    raise ValueError
                values.extend(range(first, last + 1))
            else:
                values.append(int(part))
        except ValueError:
            form = "a comma-separated list of integers and ranges like 1-8" if allow_ranges \
                else "a comma-separated list of integers"
            raise ValueError(f"{name} takes {form}, got {text!r}") from None
    return list(dict.fromkeys(values))


def _run_fit(args, parser):
    try:
        dists = [s.strip() for s in args.dist.split(",")] if args.dist else None
        bits_list = _parse_int_list(args.bits, "--bits", allow_ranges=True)
        dims = _parse_int_list(args.dim, "--dim", allow_ranges=False) if args.dim else None
        # every value is checked before what is missing, so the message names the bad one
        lo, hi = BITS_RANGE
        for bits in bits_list:
            if not lo <= bits <= hi:
                raise ValueError(f"--bits {bits} is out of range: bit widths are {lo}..{hi}")
        for dist in dists or ():
            if dist not in DISTS:
                raise ValueError(f"--dist {dist!r} is not one of {', '.join(DISTS)}")
        for dim in dims or ():
            if dim < 2:
                raise ValueError(f"--dim {dim} is out of range: dimensions are integers >= 2")
        if args.all:
            if dims is not None:
                raise ValueError("--all fits the stored dims; do not combine it with --dim")
            dists = dists or list(DISTS)
            dims = list(STORED_BETA_DIMS)
        if not dists:
            raise ValueError("give --dist (gaussian, beta or both) or --all")
        if "beta" in dists and not dims:
            raise ValueError("--dist beta needs --dim (e.g. --dim 64,128) or --all")
        check_out_dir(args.out)     # before the fits, not after them
        start = time.perf_counter()
        written = regenerate(dists, dims or [], bits_list, args.out, log=print)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {len(written)} codebook file(s) in {time.perf_counter() - start:.1f} s")
    return 0


def add_cli(subparsers):
    """Register ``codebooks fit`` on an argparse subparsers object.

    ``kvquant codebooks fit [--dist gaussian,beta] [--dim 64,128] [--bits 1-8] [--all]
    [--out DIR]`` (default ``./codebooks``: never the installed package). The ``fit`` parser sets ``func``: call ``args.func(args)``, which returns an
    exit code (0) or exits through ``parser.error`` on bad arguments.

    Parameters
    ----------
    subparsers : argparse._SubParsersAction
        From ``ArgumentParser.add_subparsers()``.

    Returns
    -------
    argparse.ArgumentParser
        The ``codebooks`` parser.
    """
    from kvquant.cli import DefaultsHelpFormatter
    parser = subparsers.add_parser(
        "codebooks", help="Lloyd-Max codebooks (fit and store)",
        description="Lloyd-Max codebooks for the rotated codecs, in N(0,1) units.")
    actions = parser.add_subparsers(dest="codebooks_action", metavar="ACTION")
    actions.required = True
    fit = actions.add_parser(
        "fit", help="fit codebooks and write them as JSON",
        description="Fit Lloyd-Max codebooks and write one JSON file per (dist, dim, bits).",
        formatter_class=DefaultsHelpFormatter)
    fit.add_argument("--dist", default=None,
                     help="gaussian, beta or gaussian,beta (default with --all: both)")
    fit.add_argument("--dim", default=None, help="beta dimensions, comma-separated (e.g. 64,128)")
    fit.add_argument("--bits", default="1-8", help="bit widths, e.g. 4 or 1-8 or 2,4")
    fit.add_argument("--all", action="store_true",
                     help="every stored dimension: " + ",".join(map(str, STORED_BETA_DIMS)))
    fit.add_argument("--out", default="codebooks",
                     help="output folder (the stored codebooks the codecs load live in "
                          "kvquant/data/codebooks of the source tree: write there with --out "
                          "to replace them, then reinstall)")
    fit.set_defaults(func=lambda args: _run_fit(args, fit))
    return parser


# --------------------------------------------------------------------------------------------
# Polar angles (PolarQuant, docs/reference.md §1.4)
# --------------------------------------------------------------------------------------------

_POLAR_GL_NODES, _POLAR_GL_WEIGHTS = np.polynomial.legendre.leggauss(24)
_POLAR_GL_PANELS = 48


def polar_angle_density(level):
    """Density of a level-``level`` angle of the recursive polar transform of a Gaussian vector.

    Level 1 (``atan2`` of two i.i.d. normals) is uniform on [-pi, pi]. At level ``l >= 2`` the
    angle between two sub-radii, each the norm of ``m = 2^(l-2)`` i.i.d. normals, has density
    ``sin^k(2 psi) / Z`` on [0, pi/2] with ``k = 2^(l-1) - 1`` and
    ``Z = B((k+1)/2, 1/2) / 2`` (Han et al., arXiv 2502.02617), symmetric about pi/4.

    Closed forms: ``F(psi) = I_s(a, a)`` with ``s = sin^2(psi)`` and ``a = (k+1)/2`` (below pi/4;
    ``1 - I_{cos^2 psi}(a, a)`` above). The partial moments ``int t f`` and ``int t^2 f`` have
    no elementary form: composite Gauss-Legendre (48 panels x 24 nodes) over ``[s0, psi]``, with
    ``s0 = max(0, pi/4 - 14 / sqrt(k+1))`` below which the density is under ``e^-390``; it
    agrees with adaptive quadrature to ~1e-16.

    Parameters
    ----------
    level : int
        >= 1.

    Returns
    -------
    ScalarDensity
        ``center`` is 0 (level 1) or pi/4: fit with :meth:`ScalarDensity.fit`.
    """
    level = _as_int(level, "level")
    if level < 1:
        raise ValueError(f"polar levels start at 1, got {level}")
    pi = math.pi
    if level == 1:
        def uniform_pdf(x):
            return np.full(np.shape(x), 0.5 / pi)

        return ScalarDensity(
            name="polar-l1", lo=-pi, hi=pi, center=0.0, pdf=uniform_pdf,
            cdf=lambda x: (np.asarray(x, dtype=np.float64) + pi) / (2.0 * pi),
            partial_moment=lambda x: (np.asarray(x, dtype=np.float64) ** 2 - pi * pi) / (4.0 * pi),
            partial_second_moment=lambda x: (np.asarray(x, dtype=np.float64) ** 3 + pi**3)
            / (6.0 * pi),
            ppf=lambda q: -pi + 2.0 * pi * np.asarray(q, dtype=np.float64))

    k = 2 ** (level - 1) - 1
    a = 0.5 * (k + 1)
    log_z = math.log(0.5) + special.betaln(a, 0.5)
    center = 0.25 * pi
    start = max(0.0, center - 14.0 / math.sqrt(k + 1))

    def pdf(x):
        x = np.asarray(x, dtype=np.float64)
        with np.errstate(divide="ignore"):
            return np.exp(k * np.log(np.abs(np.sin(2.0 * x))) - log_z)

    def cdf(x):
        x = np.asarray(x, dtype=np.float64)
        lower = special.betainc(a, a, np.sin(np.minimum(x, center)) ** 2)
        upper = special.betainc(a, a, np.cos(np.maximum(x, center)) ** 2)
        return np.where(x <= center, lower, 1.0 - upper)

    def moment(x, power):
        x = np.asarray(x, dtype=np.float64)
        flat = x.reshape(-1)
        lo = np.minimum(start, flat)
        h = (flat - lo) / _POLAR_GL_PANELS
        left = lo[:, None] + h[:, None] * np.arange(_POLAR_GL_PANELS)
        t = left[:, :, None] + (0.5 * h)[:, None, None] * (_POLAR_GL_NODES + 1.0)
        total = ((t**power) * pdf(t) * _POLAR_GL_WEIGHTS).sum(axis=(1, 2))
        return (0.5 * h * total).reshape(x.shape)

    def ppf(q):
        q = np.asarray(q, dtype=np.float64)
        lower = q < 0.5
        s_lower = special.betaincinv(a, a, np.where(lower, q, 0.25))
        s_upper = special.betaincinv(a, a, np.where(lower, 0.25, 1.0 - q))
        return np.where(lower, np.arcsin(np.sqrt(s_lower)),
                        0.5 * pi - np.arcsin(np.sqrt(s_upper)))

    return ScalarDensity(name=f"polar-l{level}", lo=0.0, hi=0.5 * pi, center=center, pdf=pdf,
                         cdf=cdf, partial_moment=lambda x: moment(x, 1),
                         partial_second_moment=lambda x: moment(x, 2), ppf=ppf)
