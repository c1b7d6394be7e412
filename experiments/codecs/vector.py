"""``vq<b>``: rotated rows quantized two coordinates at a time with a 2-D codebook.

After the randomized Hadamard rotation (docs/reference.md §1.2) and scaling by sqrt(dim)/|x|,
the coordinates are near N(0, 1) and nearly independent; a scalar Lloyd-Max quantizer snaps each
alone. A 2-D codebook of 2^(2b) centroids, fitted by k-means (``scipy.cluster.vq.kmeans2``,
started from the product of the scalar Gaussian Lloyd-Max levels, so never worse than it on the
fitting sample) on Gaussian pairs, spends the same b bits per value and packs cells better: the
space-filling gain that vector quantization has over scalar quantization even for independent
coordinates (Gersho & Gray, "Vector Quantization and Signal Compression", ch. 11). CQ (Zhang
et al., arXiv 2405.03917) couples channels of unrotated keys; after a rotation the channels
carry little dependence left to couple, so this codec takes only the packing gain.

Spec: ``vq3`` (b = 1, 1.5, ... 4 bits per value: a pair's code is 2b bits, so half bits are
whole codes, ``vq2.5`` = 32 centroids a pair; ``side=unbiased`` stores |x|^2 / <x, x^> instead of
|x|, as ``tq``'s; ``side=match`` the radius that gives the decoded row exactly the norm |x|, the
token scale whose errors KVarN (Muller et al., arXiv 2606.03458) finds drive error accumulation
in decoding; ``side_dtype=f16``; ``seed`` the rotation's). Consumers in the compressed
domain: scores rotate the query once and read a (pairs x centroids) table of dot products per
query; the context accumulates each centroid's weight per pair, multiplies by the codebook once
and unrotates once.
"""
import functools
import json
import math
from pathlib import Path

import numpy as np
from scipy.cluster.vq import kmeans2

from kvquant.codebooks import load_codebook
from kvquant.codecs import Codec
from kvquant.codecs.tables import table_scores, table_weights
from kvquant.codecs.base import ROW_LIMIT, ROW_NORM_OVERFLOW, SIDE_DTYPES
from kvquant.rotation import ENGINE_SEED, HadamardRotation

from ._layers import pack_codes, unpack_codes

FIT_SAMPLES = 2 ** 18   # Gaussian pairs the codebook is fitted on
FIT_SEED = 0x5EED
FIT_ITERATIONS = 40
# bits per value the codec takes: 2^(2 b) centroids a pair, so halves are whole code widths
BITS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
SIDE_KINDS = ("norm", "unbiased", "match")


# the fitted codebooks, stored: a fit takes ~2 s a bit width, and every process that builds
# a vq codec (each worker of a report, a task run or the frontier) would repeat it.
# Rewritten by write_stored_codebooks(); tests/test_field_codecs.py refits and compares.
STORED = Path(__file__).with_name("vq_pair_codebooks.json")
FIT = {"samples": FIT_SAMPLES, "seed": FIT_SEED, "iterations": FIT_ITERATIONS}


@functools.lru_cache(maxsize=None)
def pair_codebook(bits):
    """The 2-D codebook of ``bits`` per value (1..4 in steps of 1/2): float64 (2^(2 bits), 2),
    read-only, as :func:`fit_pair_codebook` fits it (stored in :data:`STORED`)."""
    stored = _stored_codebooks()
    key = f"{float(bits):g}"
    if key not in stored["codebooks"]:
        raise ValueError(f"no stored vq codebook for {bits!r} bits per value; they cover "
                         f"{', '.join(stored['codebooks'])}")
    centroids = np.array(stored["codebooks"][key], dtype=np.float64)
    centroids.flags.writeable = False
    return centroids


@functools.lru_cache(maxsize=1)
def _stored_codebooks():
    stored = json.loads(STORED.read_text())
    if stored.get("fit") != FIT:
        raise RuntimeError(f"{STORED} was fitted with {stored.get('fit')}, not {FIT}: rewrite "
                           "it with kvquant_experiments.codecs.vector.write_stored_codebooks()")
    return stored


def write_stored_codebooks(path=STORED):
    """Fit every bit width's codebook and write them to ``path`` (JSON: floats written in
    Python's shortest round-trip form, so they read back bit for bit)."""
    books = {f"{b:g}": fit_pair_codebook(b).tolist() for b in BITS}
    Path(path).write_text(json.dumps({"fit": FIT, "codebooks": books}) + "\n")


def fit_pair_codebook(bits):
    """Fit the 2-D codebook of ``bits`` per value. Deterministic: Gaussian pairs from a fixed
    seed, k-means started from the product of scalar Gaussian Lloyd-Max levels
    (ceil(bits) x floor(bits) bits at half steps)."""
    width = int(round(2 * bits))
    first, second = (load_codebook("gaussian", 64, b).levels for b in ((width + 1) // 2,
                                                                        width // 2))
    grid = np.stack(np.meshgrid(np.asarray(first, np.float64), np.asarray(second, np.float64),
                                indexing="ij"), axis=-1).reshape(-1, 2)
    n = FIT_SAMPLES
    sample = np.random.default_rng(FIT_SEED).standard_normal((n, 2))
    centroids, _ = kmeans2(sample, grid, iter=FIT_ITERATIONS, minit="matrix", missing="raise")
    return centroids


class PairCodebook(Codec):
    """Rotated 2-D vector codec, ``bits`` per value plus one side value per row."""

    family = "vq"

    def __init__(self, dim, bits, seed=ENGINE_SEED, side="norm", side_dtype="f32",
                 nonfinite="raise"):
        super().__init__(dim, nonfinite)
        if float(bits) not in BITS:
            raise ValueError(f"vq bits must be one of {', '.join(f'{b:g}' for b in BITS)} per "
                             f"value (2^(2b) centroids a pair), got {bits!r}")
        if side not in SIDE_KINDS:
            raise ValueError(f"side={side!r} is not one of {SIDE_KINDS}")
        if side_dtype not in SIDE_DTYPES:
            raise ValueError(f"side_dtype={side_dtype!r} is not one of {tuple(SIDE_DTYPES)}")
        self.rotation = HadamardRotation(self.dim, seed)   # refuses widths that are not 2^k
        self.bits = self.nominal_bits = float(bits)
        self.seed = int(seed)
        self.side_kind = side
        self.side_dtype = side_dtype
        self.centroids = pair_codebook(self.bits)
        self.centroids32 = self.centroids.astype(np.float32)
        self.n_pairs = self.dim // 2
        self.code_width = int(round(2 * self.bits))
        self.code_bytes = (self.n_pairs * self.code_width + 7) // 8
        self.n_side = 1
        opts = [] if side == "norm" else [f"side={side}"]
        opts += [] if side_dtype == "f32" else [f"side_dtype={side_dtype}"]
        opts += [] if self.seed == ENGINE_SEED else [f"seed={self.seed:#x}"]
        self.spec = f"vq{self.bits:g}" + (":" + ",".join(opts) if opts else "")

    @property
    def series(self):
        return "vq" if self.side_kind == "norm" else f"vq {self.side_kind}"

    def _nearest(self, pairs):
        """Index of the nearest centroid of each pair, float32 (N, 2) -> int64 (N,)."""
        out = np.empty(len(pairs), np.int64)
        c = self.centroids32
        for start in range(0, len(pairs), 65536):
            p = pairs[start:start + 65536]
            d2 = (p[:, None, 0] - c[None, :, 0]) ** 2 + (p[:, None, 1] - c[None, :, 1]) ** 2
            out[start:start + 65536] = d2.argmin(axis=1)
        return out

    def _encode(self, X, n_threads):
        n = X.shape[0]
        status = np.zeros(n, np.uint8)
        finite = np.isfinite(X).all(axis=1)
        status[~finite] = 1
        X = np.where(finite[:, None], X, 0.0).astype(np.float32)
        norm = np.sqrt((X.astype(np.float64) ** 2).sum(axis=1))
        status[(norm > ROW_LIMIT) & (status == 0)] = ROW_NORM_OVERFLOW
        live = (norm > 1e-35) & (status == 0)
        scale = np.where(live, math.sqrt(self.dim) / np.where(live, norm, 1.0), 0.0)
        y = (self.rotation.rotate(X, n_threads).astype(np.float64) * scale[:, None])
        codes = self._nearest(y.astype(np.float32).reshape(-1, 2)).reshape(n, self.n_pairs)
        radius = norm
        if self.side_kind == "unbiased":
            dot = (y * self.centroids[codes].reshape(n, self.dim)).sum(axis=1)
            radius = np.where(live & (dot > 0), norm * self.dim / np.where(dot > 0, dot, 1.0),
                              0.0)
        elif self.side_kind == "match":
            unit = np.sqrt((self.centroids[codes] ** 2).sum(axis=(1, 2)))
            radius = np.where(live & (unit > 0),
                              norm * math.sqrt(self.dim) / np.where(unit > 0, unit, 1.0), 0.0)
        radius = np.where(live, radius, 0.0)
        codes[~live] = 0
        packed = pack_codes(codes, self.code_width)
        return packed, radius.astype(np.float32).reshape(n, 1), status

    def _unit_rows(self, codes):
        """Decoded rows in the rotated basis before the radius: float32 (n, dim)."""
        idx = unpack_codes(codes, self.n_pairs, self.code_width)
        return self.centroids32[idx].reshape(len(codes), self.dim)

    def _decode(self, codes, side, n_threads):
        y = self._unit_rows(codes) * (side[:, :1] / np.float32(math.sqrt(self.dim)))
        return self.rotation.unrotate(y, n_threads)

    def _scores(self, codes, side, Q, out, n_threads):
        # the query rotated once; per query a (pairs x centroids) table of dot products that
        # every row's codes index (kvquant.codecs.tables)
        q = self.rotation.rotate(Q, n_threads).reshape(len(Q), self.n_pairs, 2)
        table = np.einsum("mpj,kj->mpk", q, self.centroids32)
        out[:] = table_scores(codes, self.code_width, table,
                              side[:, 0] / np.float32(math.sqrt(self.dim)), n_threads)

    def _context(self, codes, side, W, out, n_threads):
        # each centroid's weight per pair, then the codebook once and one unrotation
        weights = W.astype(np.float64) * (side[:, 0].astype(np.float64) / math.sqrt(self.dim))
        cells = table_weights(codes, self.code_width, weights, self.n_pairs, n_threads)
        rotated = (cells @ self.centroids).reshape(len(W), self.dim).astype(np.float32)
        out[:] = self.rotation.unrotate(rotated, n_threads)


def factory_for(bits):
    def factory(dim, **options):
        return PairCodebook(dim, bits, **options)
    factory.__name__ = f"vq{bits:g}".replace(".", "_")
    return factory


# the entry points of setup.cfg: vq1, vq1.5, ... vq4
vq1, vq1_5, vq2, vq2_5, vq3, vq3_5, vq4 = (factory_for(b) for b in BITS)
