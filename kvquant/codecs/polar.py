"""``polar<b>``: PolarQuant, b = 2..6, one side value (the norm).

A row x of width n (a power of two) is rotated (randomized Hadamard, docs/reference.md §1.2), then
turned into n - 1 angles by a recursive pairwise polar transform: level 1 angles
``atan2(r[2j+1], r[2j])`` in (-pi, pi] with radii ``hypot(r[2j], r[2j+1])``; each deeper level
repeats on the radii (angles in [0, pi/2]) until one radius, the norm, is left. Each angle gets one
code; codes are written LSB first through a bit cursor, level 1 first, index order within a level.
The side value is the norm; decoding rebuilds top-down with cos/sin (so the decoded norm is the
radius) and unrotates. The codes do not depend on it (the angles are scale-free).

The side value is stored as float32 (4 bytes) by default; the Lloyd variant takes
``side_dtype="f16"`` (2 bytes: at d = 64, 0.25 instead of 0.5 bit per element), which only rounds
the norm to fp16 (nearest even, relative error <= 2^-11): the row decodes as the f32 codec's with
its norm rounded to fp16. A norm above 65504 makes the row bad (ValueError, or an inert row under
``nonfinite="inert"``); one below 6.1e-5 becomes an fp16 subnormal and one below 3e-8 becomes 0
(a zero row), as an fp16 block scale does in llama.cpp's q8_0.

Two variants share the transform and the byte budget
``ceil(((n/2) b + (n/2 - 1) max(b-1, 1)) / 8)`` bytes per row:

``compat="colibri"``
    The engine's codec 0 bit for bit (docs/reference.md §1.4, docs/engine-arithmetic.md §4): uniform
    floor-and-clamp grids, level 1 on b bits over [-pi, pi), deeper levels on b-1 bits centred at
    pi/4 with half-width min(1.5/sqrt(2^(l-1)), pi/4); float32 libm arithmetic as the engine;
    f32 side values (so not with ``side_dtype="f16"``).

default (Lloyd)
    Lloyd-Max angle codebooks fitted to the true angle densities (uniform at level 1,
    ``sin^(2^(l-1)-1)(2 psi)`` at level l >= 2; :func:`kvquant.codebooks.polar_angle_density`),
    nearest-centroid rounding, stored as package data (``polar-angles.json``). Bit allocation:

    * ``alloc="radius"`` (default): every level keeps the engine's bit total (b per angle at
      level 1, b-1 deeper, the bits left over by byte rounding go to level 1), but inside a level
      the bits go where the error is: an angle splitting a sub-radius rho costs about
      ``rho^2 (2 - 2 cos(error))``, and rho is known to the decoder before it reads that level
      (levels are decoded top-down). Each level's bits are handed out greedily by the largest
      ``log2(rho^2) + log2(D(k) - D(k+1))``, with D(k) the chordal distortion of the k-bit codebook.
      All of it runs on fixed-point integers taken from the codes (log2 cos^2 and log2 sin^2 of
      the centroids, 2^-16 units), so encoder, decoder and the numpy reference agree exactly.
    * ``alloc="level"``: b bits at level 1, b-1 deeper, for every angle (the engine's layout).

    Measured mean relative L2 on Gaussian rows (4000 rows, seed 0; d = 128 / 512):

    ====  ================  ================  ================
    bits  compat            alloc=level       alloc=radius
    ====  ================  ================  ================
    2     0.5707 / 0.5733   0.5157 / 0.5172   0.4669 / 0.4700
    3     0.2912 / 0.2926   0.2693 / 0.2704   0.2299 / 0.2325
    4     0.1471 / 0.1477   0.1377 / 0.1383   0.1153 / 0.1170
    5     0.0737 / 0.0740   0.0696 / 0.0698   0.0578 / 0.0589
    6     0.0369 / 0.0371   0.0349 / 0.0351   0.0288 / 0.0295
    ====  ================  ================  ================

    Codebooks alone (``alloc="level"``) gain 5-10%: level 1 is uniform, so its Lloyd codebook is the
    engine's grid, and level 1 dominates the error. The radius split gains another 9-18%.

    Other level totals at the same byte budget (level 1 on b+1 or b-1 bits, or level 2 on b bits),
    each with the radius split, measured worse at b = 3, 4, 5 in a float64 prototype (1500 rows;
    e.g. 4 bits, d = 512: 0.151, 0.180, 0.140 against 0.117), hence the engine's level totals with
    the radius-driven split inside each level.

Magnitudes (README "Codecs", docs/engine-arithmetic.md §8): a row is stored live when its norm is
above 1e-35 (else a zero row, as the engine) and at most 3.4e38 (the engine's float 3.4e38f;
above: ``ValueError`` naming the rows, or inert under ``nonfinite="inert"``). The Lloyd variant
rotates a row whose float32 butterflies would overflow from a copy scaled by 2^-64 (the angles do
not depend on the scale), so it takes every finite row of norm up to 3.4e38; ``compat`` refuses
such a row instead (the engine stores it as garbage). The decoded norm is the radius, and the
decoder unrotates overflow-safe, so every stored row decodes, scores and gives context finite.
"""
import functools
import hashlib
import json
import math
import os
import re
from importlib import resources
from pathlib import Path

import numpy as np

from kvquant._kernels import consumers as _consumers
from kvquant._kernels import lloyd as _lloyd
from kvquant._kernels import polar as _polar
from kvquant.codecs.base import (F16_MAX, FLT_MAX, ROW_LIMIT, SIDE_DTYPES, Codec,
                                 CodecWidthError, codecs_for_width)
from kvquant.rotation import ENGINE_SEED, HadamardRotation, is_power_of_two

MIN_BITS, MAX_BITS = 2, 6
MAX_ANGLE_BITS = 8           # widest code a single angle may get (radius allocation)
MAX_LEVELS = 12              # stored codebooks cover widths up to 2**12 = 4096
LOG2_UNIT = 1 << 16          # fixed-point scale of the integer allocation tables
ALLOCS = ("radius", "level")
COMPATS = ("colibri",)

MODE_ENGINE_GRID, MODE_LLOYD_LEVEL, MODE_LLOYD_RADIUS = 0, 1, 2

FILE_FORMAT = "kvquant-polar-codebooks"
FILE_FORMAT_VERSION = 1
FILE_NAME = "polar-angles.json"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_PATH = _PACKAGE_DIR / "data" / "codebooks" / FILE_NAME


class PolarCodebookError(ValueError):
    """The stored polar codebooks are unreadable, inconsistent or fail their checksum."""


# --------------------------------------------------------------------------------------------
# Codebooks: fitting, file, loading
# --------------------------------------------------------------------------------------------


def _chordal_distortion(level, centroids, density):
    """E[2 - 2 cos(psi - q(psi))]: the squared error of a unit pair whose angle is rounded to the
    nearest centroid. Level 1 (uniform, equal cells) in closed form; deeper levels by composite
    Gauss-Legendre over each cell."""
    if level == 1:
        half = math.pi / centroids.size
        return 2.0 - 2.0 * math.sin(half) / half
    nodes, weights = np.polynomial.legendre.leggauss(32)
    edges = np.concatenate([[0.0], 0.5 * (centroids[1:] + centroids[:-1]), [0.5 * math.pi]])
    total = 0.0
    for i, c in enumerate(centroids):
        panels = 64
        h = (edges[i + 1] - edges[i]) / panels
        left = edges[i] + h * np.arange(panels)
        t = left[:, None] + 0.5 * h * (nodes + 1.0)
        total += 0.5 * h * float(((2.0 - 2.0 * np.cos(t - c)) * density.pdf(t) * weights).sum())
    return total


def _fixed_log2(values):
    return np.round(LOG2_UNIT * np.log2(values)).astype(np.int64)


def fit_polar_codebooks(n_levels=MAX_LEVELS, tol=1e-10):
    """Fit the Lloyd-Max angle codebooks of levels 1..n_levels, bits 0..MAX_ANGLE_BITS.

    A 0-bit codebook is the density's mean (pi/4; 0 at level 1, where any angle will do).

    Returns
    -------
    dict
        The content of the stored file (see :func:`write_polar_codebooks`).
    """
    import scipy

    from kvquant.codebooks import polar_angle_density

    levels = []
    for level in range(1, n_levels + 1):
        density = polar_angle_density(level)
        books = []
        for bits in range(MAX_ANGLE_BITS + 1):
            if bits == 0:
                centroids, mse = np.array([density.center]), float("nan")
            else:
                fit = density.fit(2**bits, tol=tol)
                centroids, mse = fit.levels, fit.mse
            books.append({"bits": bits, "centroids": [float(c) for c in centroids],
                          "angle_mse": mse,
                          "chordal": _chordal_distortion(level, centroids, density)})
        chordal = np.array([b["chordal"] for b in books])
        entry = {"level": level, "codebooks": books,
                 "gains": _fixed_log2(chordal[:-1] - chordal[1:]).tolist()}
        if level >= 2:
            entry["log2_cos2"] = [_fixed_log2(np.cos(b["centroids"]) ** 2).tolist() for b in books]
            entry["log2_sin2"] = [_fixed_log2(np.sin(b["centroids"]) ** 2).tolist() for b in books]
        levels.append(entry)
    data = {
        "format": FILE_FORMAT,
        "format_version": FILE_FORMAT_VERSION,
        "identity": f"polar-lloyd-l{n_levels}-b{MAX_ANGLE_BITS}",
        "units": "angles in radians; integer tables in 2^-16 log2 units",
        "method": ("Lloyd-Max fixed point per level (kvquant.codebooks.fit_lloyd_max) on the "
                   "polar angle densities, tol=%g; chordal distortion E[2-2cos(err)] by "
                   "Gauss-Legendre; gains = round(2^16 log2(D(k) - D(k+1)))" % tol),
        "n_levels": n_levels,
        "max_bits": MAX_ANGLE_BITS,
        "scipy_version": scipy.__version__,
        "numpy_version": np.__version__,
        "levels": levels,
    }
    data["checksum"] = _checksum(data)
    return data


def _checksum(data):
    """SHA-256 over the centroids (<f8) and integer tables (<i8), level by level."""
    h = hashlib.sha256()
    for entry in data["levels"]:
        h.update(np.int64(entry["level"]).tobytes())
        for book in entry["codebooks"]:
            h.update(np.asarray(book["centroids"], dtype="<f8").tobytes())
        h.update(np.asarray(entry["gains"], dtype="<i8").tobytes())
        for key in ("log2_cos2", "log2_sin2"):
            for row in entry.get(key, []):
                h.update(np.asarray(row, dtype="<i8").tobytes())
    return h.hexdigest()


def write_polar_codebooks(data, path=DEFAULT_PATH):
    """Write the codebooks as JSON (write-then-rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


class PolarCodebooks:
    """The stored angle codebooks as the kernels use them.

    Attributes
    ----------
    identity, checksum : str
    n_levels : int
    centroids64 : list of list of ndarray
        ``centroids64[level][bits]``, float64 (index 0 unused).
    centroids, boundaries : ndarray of shape (n_levels + 1, 9, 256), float32
        Padded tables; boundaries are midpoints of neighbouring centroids.
    code_tables : ndarray of shape (n_levels + 1, 9, L), float32
        The encoder's bucket table of each (level, width)'s boundaries (rowops.h).
    log2_cos2, log2_sin2 : ndarray of shape (n_levels + 1, 9, 256), int32
    gains : ndarray of shape (n_levels + 1, 8), int32
    chordal : ndarray of shape (n_levels + 1, 9), float64
    """

    def __init__(self, data, source="<data>"):
        if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
            raise PolarCodebookError(f"{source} is not a {FILE_FORMAT} file")
        if data.get("format_version") != FILE_FORMAT_VERSION:
            raise PolarCodebookError(f"{source} has format_version "
                                     f"{data.get('format_version')!r}, expected "
                                     f"{FILE_FORMAT_VERSION}")
        checksum = _checksum(data)
        if checksum != data.get("checksum"):
            raise PolarCodebookError(
                f"{source} fails its checksum (records {data.get('checksum')}, holds {checksum}); "
                "regenerate it with `python -m kvquant.codecs.polar`")
        self.identity = data["identity"]
        self.checksum = checksum
        n_levels = self.n_levels = int(data["n_levels"])
        shape = (n_levels + 1, MAX_ANGLE_BITS + 1, 256)
        self.centroids = np.zeros(shape, np.float32)
        self.boundaries = np.full(shape, np.inf, np.float32)
        self.log2_cos2 = np.zeros(shape, np.int32)
        self.log2_sin2 = np.zeros(shape, np.int32)
        self.gains = np.zeros((n_levels + 1, MAX_ANGLE_BITS), np.int32)
        self.chordal = np.zeros((n_levels + 1, MAX_ANGLE_BITS + 1))
        self.centroids64 = [None]
        for entry in data["levels"]:
            level = entry["level"]
            books = []
            for book in entry["codebooks"]:
                bits = book["bits"]
                c = np.asarray(book["centroids"], dtype=np.float64)
                if c.size != 2**bits or not np.all(np.diff(c) > 0):
                    raise PolarCodebookError(f"{source}: level {level} bits {bits} is malformed")
                books.append(c)
                self.centroids[level, bits, :c.size] = c
                self.boundaries[level, bits, :c.size - 1] = 0.5 * (c[1:] + c[:-1])
                self.chordal[level, bits] = book["chordal"]
                if level >= 2:
                    self.log2_cos2[level, bits, :c.size] = entry["log2_cos2"][bits]
                    self.log2_sin2[level, bits, :c.size] = entry["log2_sin2"][bits]
            gains = np.asarray(entry["gains"], dtype=np.int64)
            if not np.all(np.diff(gains) < 0):
                raise PolarCodebookError(f"{source}: gains of level {level} do not decrease")
            self.gains[level] = gains
            self.centroids64.append(books)
        self.code_tables = _code_tables(self.boundaries)
        for arr in (self.centroids, self.boundaries, self.log2_cos2, self.log2_sin2, self.gains,
                    self.chordal, self.code_tables):
            arr.flags.writeable = False


# the bucket table of no boundaries (every angle gets code 0; rowops.h layout)
_EMPTY_CODE_TABLE = np.array([0.0, 0.0, 1.0, 0.0, 0.0], np.float32)


def _code_tables(boundaries):
    """The encoder's bucket tables (rowops.h) of every (level, width) of ``boundaries`` (shape
    (n_levels + 1, 9, 256), +inf past a codebook's last boundary), padded to one length: float32
    of shape (n_levels + 1, 9, L). Widths without a codebook get the table of code 0."""
    tables = {}
    for level in range(boundaries.shape[0]):
        for bits in range(1, boundaries.shape[1]):
            bnd = np.ascontiguousarray(boundaries[level, bits, :2**bits - 1])
            if np.all(np.isfinite(bnd)):
                tables[level, bits] = _lloyd.code_table(bnd)
    length = max([t.size for t in tables.values()] + [_EMPTY_CODE_TABLE.size])
    out = np.zeros(boundaries.shape[:2] + (length,), np.float32)
    out[:, :, :_EMPTY_CODE_TABLE.size] = _EMPTY_CODE_TABLE
    for (level, bits), t in tables.items():
        out[level, bits, :t.size] = t
    return out


@functools.lru_cache(maxsize=4)
def load_polar_codebooks(path=None):
    """The stored polar codebooks (package data unless ``path``), checksum verified, cached."""
    if path is None:
        resource = resources.files("kvquant").joinpath("data", "codebooks", FILE_NAME)
        if not resource.is_file():
            raise PolarCodebookError(
                f"stored polar codebooks {FILE_NAME} are missing from the kvquant package data "
                "(broken install? regenerate with `python -m kvquant.codecs.polar`)")
        text, source = resource.read_text(encoding="utf-8"), resource
    else:
        text, source = Path(path).read_text(encoding="utf-8"), path
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolarCodebookError(f"{source} is not valid JSON: {exc}") from None
    return PolarCodebooks(data, source)


# --------------------------------------------------------------------------------------------
# Layout and the engine's grids
# --------------------------------------------------------------------------------------------


def engine_row_bytes(dim, bits):
    """The engine's row bytes: ceil(((n/2) b + (n/2 - 1) max(b-1, 1)) / 8)."""
    return ((dim // 2) * bits + (dim // 2 - 1) * max(bits - 1, 1) + 7) // 8


def engine_grid_centres(level, bits):
    """Decode values of the engine's grid at ``level`` with ``bits`` bits, float32 as it computes
    them (docs/engine-arithmetic.md §4)."""
    f32 = np.float32
    pi = f32(np.pi)
    q = np.arange(2**bits, dtype=np.float32)
    scale = f32(2**bits)
    if level == 1:
        return (-pi + ((q + f32(0.5)) * (f32(2) * pi)) / scale).astype(np.float32)
    s = f32(2 ** (level - 1))
    w = min(f32(1.5) / np.sqrt(s), f32(0.25) * pi)
    lo = f32(0.25) * pi - w
    return (lo + ((q + f32(0.5)) * (f32(2) * w)) / scale).astype(np.float32)


class PolarCodec(Codec):
    """PolarQuant codec.

    Parameters
    ----------
    dim : int
        Row width, a power of two >= 2 (<= 4096 for the Lloyd variant).
    bits : int
        2..6: bits per level-1 angle; deeper levels get max(bits - 1, 1).
    seed : int
        Rotation seed (32 bits); default the engine's.
    compat : None or "colibri"
        The engine's codec 0, bit for bit.
    alloc : {"radius", "level"} or None
        Lloyd variant only: how each level's bits are split among its angles (module docstring).
    side_dtype : {"f32", "f16"}
        Lloyd variant only: how the norm is stored (module docstring).
    nonfinite : {"raise", "inert"}

    Attributes
    ----------
    level_bits : tuple of int
        Per level (index 0 unused): the fixed width of its angles (compat and ``alloc="level"``)
        or the mean width (``alloc="radius"``).
    level_total_bits : tuple of int
        Bits each level occupies in a row (index 0 unused); level 1 starts at bit 0.
    """

    family = "polar"

    def __init__(self, dim, bits, seed=ENGINE_SEED, compat=None, alloc=None, side_dtype="f32",
                 nonfinite="raise"):
        super().__init__(dim, nonfinite)
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not (
                MIN_BITS <= bits <= MAX_BITS):
            raise ValueError(
                f"polar bits must be an integer in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
        if not is_power_of_two(self.dim) or self.dim < 2:
            raise CodecWidthError(
                f"polar{bits} needs a power-of-two row width (the Hadamard rotation and the "
                f"pairwise polar transform), got {self.dim}; use {codecs_for_width(self.dim)} "
                f"for width {self.dim}")
        if compat not in (None,) + COMPATS:
            raise ValueError(f"compat={compat!r} is not known; the only one is 'colibri'")
        if alloc is not None and alloc not in ALLOCS:
            raise ValueError(f"alloc={alloc!r} is not one of {ALLOCS}")
        if compat is not None and alloc is not None:
            raise ValueError(
                "compat='colibri' is the engine's codec with its own grids and fixed widths: "
                f"use 'polar{bits}:compat=colibri' without alloc (got alloc={alloc!r})")
        if side_dtype not in SIDE_DTYPES:
            raise ValueError(f"side_dtype={side_dtype!r} is not one of {tuple(SIDE_DTYPES)}")
        if compat is not None and side_dtype != "f32":
            raise ValueError(
                "compat='colibri' is the engine's format, which stores f32 side values: use "
                f"'polar{bits}:compat=colibri' without side_dtype, or drop compat to store f16 "
                "sides")
        self.bits = self.nominal_bits = int(bits)
        self.side_dtype = side_dtype
        self.seed = int(seed)
        self.compat = compat
        self.alloc = None if compat else (alloc or "radius")
        self.rotation = HadamardRotation(self.dim, self.seed)
        if compat:
            self.range_rule = ("the engine's float32 rotation overflows (its partial sums reach "
                               "sqrt(n) times the norm); the engine would store it as garbage")
            self.safe_norm = min(FLT_MAX / (math.sqrt(self.dim) * 1.001), ROW_LIMIT)
        else:
            # rotated on a scaled copy: every norm up to the limit (f16 sides: up to 65504)
            self.safe_norm = F16_MAX if side_dtype == "f16" else ROW_LIMIT
        self.n_levels = n_levels = self.dim.bit_length() - 1
        counts = [0] + [self.dim >> level for level in range(1, n_levels + 1)]
        level_bits = [0, self.bits] + [max(self.bits - 1, 1)] * (n_levels - 1)
        totals = [c * b for c, b in zip(counts, level_bits)]
        self.code_bytes = engine_row_bytes(self.dim, self.bits)
        assert (sum(totals) + 7) // 8 == self.code_bytes
        self.n_side = 1

        if compat:
            self.mode = MODE_ENGINE_GRID
            self.codebook_identity = "colibri-polar"
            centres = [engine_grid_centres(level, level_bits[level])
                       for level in range(1, n_levels + 1)]
            self.codebook_checksum = hashlib.sha256(
                np.concatenate(centres).astype("<f8").tobytes()).hexdigest()
            self.engine_tag = self.bits if self.seed == ENGINE_SEED else None
            shape = (n_levels + 1, MAX_ANGLE_BITS + 1, 256)
            self._tables = (np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                            np.zeros(shape, np.int32), np.zeros(shape, np.int32),
                            np.zeros((n_levels + 1, MAX_ANGLE_BITS), np.int32))
            self._code_tables = np.zeros((n_levels + 1, MAX_ANGLE_BITS + 1, 1), np.float32)
        else:
            if n_levels > MAX_LEVELS:
                raise ValueError(
                    f"polar{bits} (Lloyd) has stored codebooks up to width {2**MAX_LEVELS}, got "
                    f"{self.dim}; use 'polar{bits}:compat=colibri' for wider rows")
            cb = load_polar_codebooks()
            self.codebooks = cb
            self.codebook_identity = cb.identity
            self.codebook_checksum = cb.checksum
            if self.alloc == "radius":
                self.mode = MODE_LLOYD_RADIUS
                # the bits that byte rounding leaves over go to level 1, then level 2, ...
                spare = 8 * self.code_bytes - sum(totals)
                for level in range(1, n_levels + 1):
                    add = min(spare, MAX_ANGLE_BITS * counts[level] - totals[level])
                    totals[level] += add
                    spare -= add
            else:
                self.mode = MODE_LLOYD_LEVEL
            self._tables = (cb.centroids[:n_levels + 1], cb.boundaries[:n_levels + 1],
                            cb.log2_cos2[:n_levels + 1], cb.log2_sin2[:n_levels + 1],
                            cb.gains[:n_levels + 1])
            self._code_tables = cb.code_tables[:n_levels + 1]
        # the encoder's boundary columns, derived once from the tables (none on the engine grid)
        self._boundary_cols = (None if self.mode == MODE_ENGINE_GRID else
                               _polar.boundary_columns(self._tables[1], self._code_tables))
        self.level_bits = tuple(level_bits)
        self.level_total_bits = tuple(totals)
        self._level_bits = np.asarray(level_bits, np.int32)
        self._level_totals = np.asarray(totals, np.int32)
        self._level_starts = np.concatenate([[0, 0], np.cumsum(totals[1:])[:-1]]).astype(np.int32)
        # cos/sin of every (level, width, code), computed once as the decoder computes them
        cos_tab = np.empty((n_levels + 1, MAX_ANGLE_BITS + 1, 256), np.float32)
        sin_tab = np.empty_like(cos_tab)
        _polar.angle_tables(self.mode, self._tables[0], cos_tab, sin_tab)
        cos_tab.flags.writeable = sin_tab.flags.writeable = False
        self._angle_tables = (cos_tab, sin_tab)
        self.spec = self._canonical_spec()

    @property
    def series(self):
        return "polar colibri" if self.compat else "polar"

    def _canonical_spec(self):
        opts = []
        if self.compat:
            opts.append(f"compat={self.compat}")
        elif self.alloc != "radius":
            opts.append(f"alloc={self.alloc}")
        if self.side_dtype != "f32":
            opts.append(f"side_dtype={self.side_dtype}")
        if self.seed != ENGINE_SEED:
            opts.append(f"seed={self.seed:#x}")
        return f"polar{self.bits}" + (":" + ",".join(opts) if opts else "")

    def _encode(self, X, n_threads):
        n = X.shape[0]
        codes = np.empty((n, self.code_bytes), np.uint8)
        side = np.empty(n, np.float32)
        status = np.empty(n, np.uint8)
        _, _, log_cos2, log_sin2, gains = self._tables
        _polar.encode_rows(X, self.rotation.signs, self.mode, self._level_bits,
                           self._level_totals, self._code_tables, self._boundary_cols, log_cos2,
                           log_sin2, gains, codes, side, status, n_threads)
        return codes, side.reshape(n, 1), status

    def _decode(self, codes, side, n_threads):
        out = np.empty((codes.shape[0], self.dim), np.float32)
        _, _, log_cos2, log_sin2, gains = self._tables
        cos_tab, sin_tab = self._angle_tables
        _polar.decode_rows(codes, np.ascontiguousarray(side[:, 0]), self.rotation.signs,
                           self.mode, self._level_bits, self._level_totals, self._level_starts,
                           cos_tab, sin_tab, log_cos2, log_sin2, gains, out, n_threads)
        return out

    # Consumers: each row is rebuilt in the rotated basis (the decoder's rebuild, polarops.h) and
    # read at once; the query is rotated once and contexts are unrotated once
    # (kvquant/_kernels/consumers_polar.h). Nothing is decoded to memory.
    def _kernel_tables(self):
        _, _, log_cos2, log_sin2, gains = self._tables
        cos_tab, sin_tab = self._angle_tables
        return (self.rotation.signs, self.mode, self._level_bits, self._level_totals,
                self._level_starts, cos_tab, sin_tab, log_cos2, log_sin2, gains)

    def _scores(self, codes, side, Q, out, n_threads):
        _consumers.scores_polar(codes, side, *self._kernel_tables(), Q, out, n_threads)

    def _context(self, codes, side, W, out, n_threads):
        _consumers.context_polar(codes, side, *self._kernel_tables(), W, out, n_threads)


_BASE = re.compile(r"polar(\d+)")   # polar<b>: the bit width is the number after the name


def parse(base, dim, options):
    m = _BASE.fullmatch(base)
    if not m:
        return None
    return PolarCodec(dim, int(m.group(1)), **options)


def bit_ladder(base):
    """``("polar", b, widths)`` for a base ``polar<b>``: the name its bit width follows, the width
    and the widths the family takes (polar ``MIN_BITS..MAX_BITS``); None for any other base."""
    m = _BASE.fullmatch(base)
    return ("polar", int(m.group(1)), range(MIN_BITS, MAX_BITS + 1)) if m else None


def _main(argv=None):
    import argparse
    import time

    parser = argparse.ArgumentParser(
        prog="python -m kvquant.codecs.polar",
        description="Fit the Lloyd-Max polar angle codebooks and write them as package data.")
    parser.add_argument("--levels", type=int, default=MAX_LEVELS)
    parser.add_argument("--out", default=str(DEFAULT_PATH))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    data = fit_polar_codebooks(args.levels)
    path = write_polar_codebooks(data, args.out)
    print(f"{path}  {data['identity']}  checksum {data['checksum'][:16]}...  "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
