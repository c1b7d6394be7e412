"""Lloyd-Max scalar codebooks: fitting with closed forms, stored package data, loading.

One module per job: :mod:`.lloyd_max` (the solver), :mod:`.densities` (what is fitted),
:mod:`.store` (codebook objects, files, package data, loading), :mod:`.cli`
(``kvquant codebooks fit``); this package re-exports their public names.

Units. The rotated codecs compute ``y = rotate(x) * sqrt(d) / |x|`` and snap each coordinate of
``y`` to the nearest level. Every codebook here lives in those "N(0, 1)" units:

* ``gaussian``: the Lloyd-Max quantizer of N(0, 1) (Max 1960), the engine's codebook family.
* ``beta`` at dimension ``d``: one coordinate ``t`` of a uniformly random unit vector of R^d has
  density proportional to ``(1 - t^2)^((d-3)/2)`` on [-1, 1] (docs/reference.md §2); the levels are
  fitted to ``y = t * sqrt(d)``, whose variance is exactly 1 and whose density tends to N(0, 1).

``Codebook.mse`` is the mean squared error per coordinate in the same units, that is ``d`` times
the MSE of ``t``, which is also the expected relative squared L2 error ``E|x - x^|^2 / |x|^2`` of a
whole row (before any float32 rounding).

Fitting: :func:`fit_lloyd_max` (:mod:`.lloyd_max`) on closed-form cell moments.

Storage. One JSON file per (dist, dim, bits) in ``kvquant/data/codebooks/``: Gaussian for bits
1..8 and Beta for d = 16, 32, ..., 4096 and bits 1..8, written by :func:`regenerate` (the
``kvquant codebooks fit`` command, which writes to ``--out``, by default ``./codebooks``; to
install fitted codebooks, write them into ``kvquant/data/codebooks`` of a source tree and
reinstall). :func:`load_codebook` reads them (checking a SHA-256 of the levels) and fits anything
else on the fly. :func:`use_codebooks` lends codebooks of one's own (a refit, levels fitted to
another density) to the codecs built inside a ``with`` block, without installing them.
"""

from .cli import add_cli
from .densities import ScalarDensity, beta_density, gaussian_density, polar_angle_density
from .lloyd_max import (DEFAULT_MAX_ITER, DEFAULT_TOL, ConvergenceError, LloydMaxResult,
                        fit_lloyd_max, quantizer_mse)
from .store import (BITS_RANGE, DEFAULT_DATA_DIR, DISTS, STORED_BETA_DIMS, Codebook,
                    CodebookFileError, fit_codebook, levels_checksum, load_codebook,
                    read_codebook, regenerate, use_codebooks, write_codebook)

__all__ = [
    "BITS_RANGE",
    "DEFAULT_DATA_DIR",
    "DEFAULT_MAX_ITER",
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
    "levels_checksum",
    "load_codebook",
    "polar_angle_density",
    "quantizer_mse",
    "read_codebook",
    "regenerate",
    "use_codebooks",
    "write_codebook",
]
