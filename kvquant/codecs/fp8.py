"""``kv8`` and ``kv8-g<N>``: fp8 e4m3fn with f32 scales (docs/reference.md §1.1).

``kv8`` keeps one scale per row (scale = max|x| / 448), as the engine's KV8 tier; ``kv8-g<N>`` one
scale per N consecutive elements (the engine's KV8_GS=N, applied here to any row).

Magnitudes: a group (the whole row for ``kv8``) whose largest element is above 1e-35 and at most
3.4e38 (the engine's float 3.4e38f) is stored live, its elements within |x|/16 + scale 2^-10; one
whose largest element is not above 1e-35 is zero bytes with scale 1, as the engine. A row holding
NaN/inf or an element above 3.4e38 raises ``ValueError`` naming the rows; under
``nonfinite="inert"`` it is stored as the engine stores it: a NaN element becomes 0 and the rest
of its row stays live, a group holding an inf or an element above 3.4e38 is zeros with scale 1.
"""
import re

import numpy as np

from kvquant._kernels import consumers as _consumers
from kvquant._kernels import fp8 as _fp8
from kvquant.codecs.base import Codec, CodecWidthError


class FP8Codec(Codec):
    """fp8 e4m3fn codec.

    Parameters
    ----------
    dim : int
        Row width.
    group : int or None
        Elements per scale; None for one scale per row. Must divide ``dim``.
    nonfinite : {"raise", "inert"}
    """

    family = "kv8"
    nominal_bits = 8
    inert_rule = ("stores them as the engine does: a NaN element becomes 0 and the rest of its "
                  "row stays live; a row (kv8-g<N>: a group) holding an inf or an element above "
                  "3.4e38 is stored as zero bytes with scale 1")
    limit_rule = "have an element above 3.4e38 (the engine's limit, the float 3.4e38f)"

    def __init__(self, dim, group=None, nonfinite="raise"):
        super().__init__(dim, nonfinite)
        if group is None:
            self.group = self.dim
            self.spec = "kv8"
            self.engine_tag = 1
        else:
            if group < 1 or self.dim % group:
                raise CodecWidthError(
                    f"kv8 group size {group} must be a positive divisor of the width {self.dim}"
                )
            self.group = int(group)
            self.spec = f"kv8-g{self.group}"
        self.code_bytes = self.dim
        self.n_side = self.dim // self.group

    def _encode(self, X, n_threads):
        n = X.shape[0]
        codes = np.empty((n, self.dim), np.uint8)
        scales = np.empty((n, self.n_side), np.float32)
        status = np.empty(n, np.uint8)
        _fp8.encode_rows(X, self.group, codes, scales, status, n_threads)
        return codes, scales, status

    def _decode(self, codes, side, n_threads):
        out = np.empty((codes.shape[0], self.dim), np.float32)
        _fp8.decode_rows(codes, side, self.group, out, n_threads)
        return out

    # Decoded inline; the scale is factored out of each (per-group) sum, and folded into the
    # weight of the context.
    def _scores(self, codes, side, Q, out, n_threads):
        _consumers.scores_kv8(codes, side, self.group, Q, out, n_threads)

    def _context(self, codes, side, W, out, n_threads):
        _consumers.context_kv8(codes, side, self.group, W, out, n_threads)


# kv8-g<N>: one scale per N elements
_GROUPED = re.compile(r"kv8-g(\d+)")


def parse(base, dim, options):
    if base == "kv8":
        return FP8Codec(dim, **options)
    m = _GROUPED.fullmatch(base)
    if m:
        return FP8Codec(dim, group=int(m.group(1)), **options)
    return None


def row_scaled(base, options):
    """``("kv8", options kept)`` for a codec that groups its scales, ``kv8-g<N>`` or ``kv8`` with
    ``group=N`` (one scale per row in place of one per N elements; every option but ``group``
    kept), None for any other codec."""
    if _GROUPED.fullmatch(base) or (base == "kv8" and options.get("group") is not None):
        return "kv8", {k: v for k, v in options.items() if k != "group"}
    return None
