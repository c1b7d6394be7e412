"""The densities codebooks are fitted to, in N(0, 1) units, with the closed forms the solver needs:
the Gaussian, one coordinate of a random unit vector (Beta), and PolarQuant's angles.
"""
import math
import numbers
from dataclasses import dataclass

import numpy as np
from scipy import special

from .lloyd_max import DEFAULT_MAX_ITER, DEFAULT_TOL, _as_int, fit_lloyd_max

__all__ = ["ScalarDensity", "beta_density", "gaussian_density", "polar_angle_density"]


def _check_dim(dim):
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    return int(dim)


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


# Polar angles (PolarQuant, docs/reference.md §1.4)
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
