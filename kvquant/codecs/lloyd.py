"""``tq<b>``: the rotated Lloyd-Max codec, b = 1..8 bits per element plus one side value.

A row x of width n (a power of two) is rotated (randomized Hadamard, docs/reference.md §1.2), scaled to
unit variance per coordinate, y = rotate(x) * sqrt(n) / |x|, and each coordinate is snapped to the
nearest level of a b-bit Lloyd-Max codebook (ties go to the lower level); codes are bit-packed LSB
first. The side value is the norm |x| (default) or the unbiased scale |x|^2 / <x, v> with v the
decoded unit-radius row (docs/reference.md §2: removes the inner-product shrink of MSE codebooks).

The side value is stored as float32 (4 bytes) by default; ``side_dtype="f16"`` stores it as
float16 (2 bytes: at d = 64, 0.25 instead of 0.5 bit per element). The codes do not depend on the
side value, so f16 only rounds that one scale (nearest even, relative error <= 2^-11): the row
decodes as the f32 codec's with its side value rounded to fp16. A side value above 65504 makes
the row bad (ValueError, or an inert row under ``nonfinite="inert"``); one below 6.1e-5 becomes
an fp16 subnormal and one below 3e-8 becomes 0 (a zero row), as an fp16 block scale does in
llama.cpp's q8_0.

``compat="colibri"`` (4 bits only) is the engine's codec bit for bit: its 16 Gaussian levels rounded
to three decimals, the norm as radius, nibble order element 2j low / 2j+1 high, f32 side values
(so not with ``side_dtype="f16"``).

Magnitudes (README "Codecs", docs/engine-arithmetic.md §8): a row is stored live when its norm is
above 1e-35 (else a zero row, as the engine) and at most 3.4e38 (the engine's float 3.4e38f;
above: ``ValueError`` naming the rows, or inert under ``nonfinite="inert"``). A row whose float32
rotation would overflow is rotated from a copy scaled by 2^-64 (the same codes as the row at an
ordinary scale); under ``compat`` it is refused instead, since the engine stores it as garbage. A
row whose decoded norm (side x rms of its levels) would pass 3.4e38 is refused too. So every
stored row decodes, scores and gives context finite; ``safe_norm`` is the norm up to which every
finite row encodes (None for ``side=unbiased``, whose side value has no simple bound).
"""
import math
import re

import numpy as np

from kvquant._kernels import consumers as _consumers
from kvquant._kernels import lloyd as _lloyd
from kvquant.codebooks import levels_checksum, load_codebook
from kvquant.codecs.base import (F16_MAX, FLT_MAX, ROW_LIMIT, SIDE_DTYPES, Codec,
                                 CodecWidthError, codecs_for_width)
from kvquant.rotation import ENGINE_SEED, HadamardRotation, is_power_of_two

# The engine's 4-bit levels (Gaussian Lloyd-Max, Max 1960, three decimals), positive half.
ENGINE_TQ4_LEVELS_POSITIVE = (0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733)
CODEBOOKS = ("beta", "gaussian")
SIDE_KINDS = ("norm", "unbiased")
MIN_BITS, MAX_BITS = 1, 8


def engine_tq4_levels():
    pos = np.array(ENGINE_TQ4_LEVELS_POSITIVE, dtype=np.float64)
    return np.concatenate([-pos[::-1], pos])


class LloydCodec(Codec):
    """Rotated Lloyd-Max codec.

    Parameters
    ----------
    dim : int
        Row width, a power of two >= 2.
    bits : int
        Bits per element, 1..8.
    seed : int
        Rotation seed (32 bits); default the engine's.
    codebook : {"beta", "gaussian"}
        ``beta`` is fitted for the exact coordinate density at ``dim``; ``gaussian`` is N(0,1).
    side : {"norm", "unbiased"}
    compat : None or "colibri"
    side_dtype : {"f32", "f16"}
        How the side value is stored (module docstring); ``f16`` is not the engine's format.
    nonfinite : {"raise", "inert"}
    """

    family = "tq"

    def __init__(self, dim, bits, seed=ENGINE_SEED, codebook="beta", side="norm", compat=None,
                 side_dtype="f32", nonfinite="raise"):
        super().__init__(dim, nonfinite)
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not (
                MIN_BITS <= bits <= MAX_BITS):
            raise ValueError(f"tq bits must be an integer in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
        if not is_power_of_two(self.dim) or self.dim < 2:
            raise CodecWidthError(
                f"tq{bits} needs a power-of-two row width (the Hadamard rotation), got {self.dim}; "
                f"use {codecs_for_width(self.dim)} for width {self.dim}"
            )
        if codebook not in CODEBOOKS:
            raise ValueError(f"codebook={codebook!r} is not one of {CODEBOOKS}")
        if side not in SIDE_KINDS:
            raise ValueError(f"side={side!r} is not one of {SIDE_KINDS}")
        if compat not in (None, "colibri"):
            raise ValueError(f"compat={compat!r} is not known; the only one is 'colibri'")
        if side_dtype not in SIDE_DTYPES:
            raise ValueError(f"side_dtype={side_dtype!r} is not one of {tuple(SIDE_DTYPES)}")
        if compat and side_dtype != "f32":
            raise ValueError(
                "compat='colibri' is the engine's format, which stores f32 side values: use "
                f"'tq{bits}:compat=colibri' without side_dtype, or drop compat to store f16 sides")
        self.bits = self.nominal_bits = int(bits)
        self.seed = int(seed)
        self.compat = compat
        self.codebook = codebook
        self.side_kind = side
        self.side_dtype = side_dtype
        if compat == "colibri":
            if self.bits != 4 or side != "norm" or codebook != "beta":
                raise ValueError(
                    "compat='colibri' is the engine's 4-bit codec with its own levels and the norm "
                    f"as side value: use 'tq4:compat=colibri' without codebook/side options "
                    f"(got bits={bits}, codebook={codebook!r}, side={side!r})"
                )
            levels = engine_tq4_levels()
            self.codebook_name = "colibri"
            self.codebook_identity = "colibri-tq4"
            self.engine_tag = 0x104 if self.seed == ENGINE_SEED else None
        else:
            cb = load_codebook(codebook, self.dim, self.bits)
            levels = np.asarray(cb.levels, dtype=np.float64)
            self.codebook_name = codebook
            self.codebook_identity = cb.identity
        self.levels64 = levels
        self.codebook_checksum = levels_checksum(levels)
        self.levels = levels.astype(np.float32)
        # Boundaries in float32: a coordinate strictly above boundary k gets a code > k.
        self.boundaries = ((levels[:-1] + levels[1:]) / 2).astype(np.float32)
        # the encoder's bucket table of these boundaries (read for b > 5; rowops.h)
        self.code_table = _lloyd.code_table(self.boundaries)
        for arr in (self.levels, self.boundaries, self.code_table):
            arr.flags.writeable = False
        self.rotation = HadamardRotation(self.dim, self.seed)
        self._set_range(float(np.abs(self.levels).max()))
        self.code_bytes = (self.dim * self.bits + 7) // 8
        self.n_side = 1
        self.spec = self._canonical_spec(codebook)

    def _set_range(self, max_level):
        """The magnitude contract (module docstring): ``range_rule`` and ``safe_norm``."""
        decoded = max(max_level, 1.0)
        if self.compat:
            self.range_rule = (
                "the engine's float32 rotation overflows (its partial sums reach sqrt(n) times "
                "the norm) or the decoded norm passes 3.4e38; the engine would store it as garbage")
            self.safe_norm = min(FLT_MAX / (math.sqrt(self.dim) * 1.001), ROW_LIMIT / decoded)
        else:
            self.range_rule = "its decoded norm (side x rms of its levels) passes 3.4e38"
            self.safe_norm = None if self.side_kind == "unbiased" else ROW_LIMIT / decoded
        if self.side_dtype == "f16":
            self.safe_norm = None if self.safe_norm is None else F16_MAX

    @property
    def series(self):
        if self.compat:
            return "tq colibri"
        if self.codebook == "gaussian":
            return "tq gaussian"
        return "tq unbiased" if self.side_kind == "unbiased" else "tq"

    def _canonical_spec(self, codebook):
        opts = []
        if self.compat:
            opts.append(f"compat={self.compat}")
        else:
            if codebook != "beta":
                opts.append(f"codebook={codebook}")
            if self.side_kind != "norm":
                opts.append(f"side={self.side_kind}")
            if self.side_dtype != "f32":
                opts.append(f"side_dtype={self.side_dtype}")
        if self.seed != ENGINE_SEED:
            opts.append(f"seed={self.seed:#x}")
        return f"tq{self.bits}" + (":" + ",".join(opts) if opts else "")

    def _encode(self, X, n_threads):
        n = X.shape[0]
        codes = np.empty((n, self.code_bytes), np.uint8)
        side = np.empty(n, np.float32)
        status = np.empty(n, np.uint8)
        _lloyd.encode_rows(X, self.rotation.signs, self.levels, self.boundaries, self.code_table,
                           self.bits, self.side_kind == "unbiased", self.compat == "colibri",
                           codes, side, status, n_threads)
        return codes, side.reshape(n, 1), status

    def _decode(self, codes, side, n_threads):
        out = np.empty((codes.shape[0], self.dim), np.float32)
        _lloyd.decode_rows(codes, np.ascontiguousarray(side[:, 0]), self.rotation.signs,
                           self.levels, self.bits, out, n_threads)
        return out

    # The query is rotated once and dotted with the levels, the radius applied once per row; the
    # context is accumulated in the rotated basis and unrotated once.
    def _scores(self, codes, side, Q, out, n_threads):
        _consumers.scores_tq(codes, side, self.rotation.signs, self.levels, self.bits, Q, out,
                             n_threads)

    def _context(self, codes, side, W, out, n_threads):
        _consumers.context_tq(codes, side, self.rotation.signs, self.levels, self.bits, W, out,
                              n_threads)


_BASE = re.compile(r"tq(\d+)")   # tq<b>: the bit width is the number after the name


def parse(base, dim, options):
    m = _BASE.fullmatch(base)
    if not m:
        return None
    return LloydCodec(dim, int(m.group(1)), **options)


def bit_ladder(base):
    """``("tq", b, widths)`` for a base ``tq<b>``: the name its bit width follows, the width
    and the widths the family takes (tq ``MIN_BITS..MAX_BITS``); None for any other base."""
    m = _BASE.fullmatch(base)
    return ("tq", int(m.group(1)), range(MIN_BITS, MAX_BITS + 1)) if m else None
