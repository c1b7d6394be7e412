"""``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``iq4_nl`` and their ``+rot`` variants:
llama.cpp's quantized KV-cache types (its ``--cache-type-k`` / ``--cache-type-v`` values).

Baselines that users already run (docs/reference.md §3). A row is cut into blocks of 32 values; each
block stores an fp16 scale d (2 bytes, little endian) and its quants, exactly as a ggml tensor
row, so ``EncodedRows.codes`` holds the row byte for byte as llama.cpp would and there are no side
values:

``q8_0``
    34 bytes per block (8.5 bits per value): d = max|x| / 127, q = round(x / d) as int8.
``q4_0``
    18 bytes per block (4.5 bits per value): d = m / -8 with m the element of largest magnitude,
    q = min(15, trunc(x / d + 8.5)); byte j holds q[j] in its low nibble and q[j + 16] in its high
    one; decoded as d (q - 8).
``q4_1``
    20 bytes per block (5.0 bits per value): d = (max - min) / 15 and m = min, both fp16,
    q = min(15, trunc((x - min) / d + 0.5)) packed as q4_0; decoded as d q + m.
``q5_0``
    22 bytes per block (5.5 bits per value): d = m / -16, q = min(31, trunc(x / d + 16.5)); an
    fp16 d, then a little-endian uint32 whose bit j is bit 4 of q[j], then the low nibbles as
    q4_0; decoded as d (q - 16).
``q5_1``
    24 bytes per block (6.0 bits per value): d = (max - min) / 31, m = min, the high bits as
    q5_0, q = min(31, trunc((x - min) / d + 0.5)); decoded as d q + m.
``iq4_nl``
    18 bytes per block (4.5 bits per value): an fp16 d and 16 nibbles indexing the fixed
    non-uniform levels K = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
    113}; decoded as d K[q]. The encoder is ggml's reference one (quantize_row_iq4_nl_ref): each
    x takes the level nearest x / d0 with d0 = m / -127, then d is the least-squares scale of
    those levels with weights x^2.

Encoding is bit-identical to ``gguf.quants.quantize`` and decoding to ``gguf.quants.dequantize``
for ``GGMLQuantizationType.Q8_0`` / ``Q4_0`` / ``Q4_1`` / ``Q5_0`` / ``Q5_1``. The gguf package
has no IQ4_NL quantizer: ``iq4_nl`` decodes as its ``dequantize`` does and encodes as
kvquant.reference.iq4_nl_encode_rows, a numpy transcription of ggml's algorithm.

``+rot`` applies the orthonormal randomized Hadamard rotation of docs/reference.md §1.2 to the row
first (and its inverse after decoding), as llama.cpp does for quantized caches since PR #21038
(the engine's sign vector by default; ``seed=`` picks another). It needs a power-of-two width.

Rows that no block format can hold are refused (or stored inert with ``nonfinite="inert"``): rows
with NaN/inf, and rows whose block scale overflows fp16 (|d| >= 65520, e.g. |x| >= 524160 for
q4_0), which ggml would store as an infinite scale; for q4_1 / q5_1 also rows with a block minimum
beyond fp16 (|min| >= 65520). Blocks so small that their scale is an fp16
subnormal lose precision, and a block whose scale rounds to 0 (|d| < 2^-25) decodes as zeros, as
in llama.cpp.
"""
import re

import numpy as np

from kvquant._kernels import consumers as _consumers
from kvquant._kernels import ggml as _ggml
from kvquant.codecs.base import Codec, CodecWidthError
from kvquant.rotation import ENGINE_SEED, HadamardRotation, is_power_of_two

BLOCK = 32
# kernel kind (kvquant._kernels.ggml KIND_*), bytes per block
KINDS = {"q8_0": (0, 34), "q4_0": (1, 18), "q4_1": (2, 20), "q5_0": (3, 22), "q5_1": (4, 24),
         "iq4_nl": (5, 18)}
# the formats whose row kernels live in consumers_ggml_more.h
_MORE_KINDS = ("q4_1", "q5_0", "q5_1", "iq4_nl")


class GGMLCodec(Codec):
    """llama.cpp block format, optionally rotated.

    Parameters
    ----------
    dim : int
        Row width, a multiple of 32 (and a power of two with ``rotate``).
    kind : {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"}
    rotate : bool
        Hadamard-rotate rows before quantizing.
    seed : int, optional
        Rotation seed (32 bits), only with ``rotate``; default the engine's.
    nonfinite : {"raise", "inert"}
        "inert" stores a refused row as the format's encoding of a zero row.
    """

    family = "ggml"

    def __init__(self, dim, kind, rotate=False, seed=None, nonfinite="raise"):
        super().__init__(dim, nonfinite)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {tuple(KINDS)}, got {kind!r}")
        name = kind + ("+rot" if rotate else "")
        if self.dim % BLOCK:
            raise CodecWidthError(
                f"{name} stores blocks of {BLOCK} values: the row width must be a multiple of "
                f"{BLOCK}, got {self.dim}; use kv8 for width {self.dim}")
        if rotate and not is_power_of_two(self.dim):
            raise CodecWidthError(
                f"{name} needs a power-of-two row width (the Hadamard rotation), got {self.dim}; "
                f"use the unrotated {kind} for width {self.dim}")
        if seed is not None and not rotate:
            raise ValueError(f"seed={seed!r} only applies to rotated codecs: use '{kind}+rot'")
        self.kind = kind
        self._kind_code, block_bytes = KINDS[kind]
        self._bits = 8 if kind == "q8_0" else 4    # the q8_0 / q4_0 row kernels' selector
        self.rotate = bool(rotate)
        self.seed = (ENGINE_SEED if seed is None else int(seed)) if rotate else None
        self.rotation = HadamardRotation(self.dim, self.seed) if rotate else None
        self._signs = self.rotation.signs if rotate else np.ones(1, np.float32)
        self.block_bytes = block_bytes
        self.code_bytes = (self.dim // BLOCK) * block_bytes
        self.n_side = 0
        self.spec = name + (f":seed={self.seed:#x}" if rotate and self.seed != ENGINE_SEED
                            else "")
        self.nominal_bits = int(kind[kind.index("q") + 1])   # q8_0 -> 8, iq4_nl -> 4

    @property
    def series(self):
        return self.kind + ("+rot" if self.rotate else "")

    def _raise_on_bad_rows(self, status):
        bad = np.flatnonzero(status)
        if bad.size == 0 or self.nonfinite == "inert":
            return
        shown = ", ".join(str(i) for i in bad[:10]) + (" ..." if bad.size > 10 else "")
        kinds = []
        if np.any(status[bad] == 1):
            kinds.append("contain NaN or inf")
        if np.any(status[bad] == 2):
            what = "scale or minimum" if self.kind in ("q4_1", "q5_1") else "scale"
            kinds.append(f"have a block {what} beyond float16 (ggml would store an infinite "
                         f"{what})")
        raise ValueError(
            f"{bad.size} row(s) {' or '.join(kinds)} (rows {shown}); nothing was stored. Clean "
            f"them, or build the codec with nonfinite='inert' to store them as zero rows")

    def _encode(self, X, n_threads):
        n = X.shape[0]
        codes = np.empty((n, self.code_bytes), np.uint8)
        status = np.empty(n, np.uint8)
        _ggml.encode_rows(X, self._kind_code, self.rotate, self._signs, codes, status, n_threads)
        return codes, np.zeros((n, 0), np.float32), status

    def _decode(self, codes, side, n_threads):
        out = np.empty((codes.shape[0], self.dim), np.float32)
        _ggml.decode_rows(codes, self._kind_code, self.rotate, self._signs, out, n_threads)
        return out

    # Compressed-domain consumers (kvquant._kernels.consumers): the block scale is factored out of
    # each block's partial sum; +rot rotates the queries once and unrotates the context once.
    # q4_1 / q5_1 add m_b times the block's query sum (scores) or w_t m_tb (context).
    def _scores(self, codes, side, Q, out, n_threads):
        if self.kind in _MORE_KINDS:
            _consumers.scores_ggml_more(codes, self._kind_code, self.rotate, self._signs, Q, out,
                                        n_threads)
        else:
            _consumers.scores_ggml(codes, self._bits, self.rotate, self._signs, Q, out, n_threads)

    def _context(self, codes, side, W, out, n_threads):
        if self.kind in _MORE_KINDS:
            _consumers.context_ggml_more(codes, self._kind_code, self.rotate, self._signs, W, out,
                                         n_threads)
        else:
            _consumers.context_ggml(codes, self._bits, self.rotate, self._signs, W, out,
                                    n_threads)


def parse(base, dim, options):
    m = re.fullmatch(r"(q8_0|q4_0|q4_1|q5_0|q5_1|iq4_nl)(\+rot)?", base)
    if not m:
        return None
    return GGMLCodec(dim, m.group(1), rotate=bool(m.group(2)), **options)
