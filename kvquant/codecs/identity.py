"""``f32``: rows stored as they are, the reference every other codec is measured against."""
import numpy as np

from kvquant._kernels import consumers as _consumers
from kvquant.codecs.base import Codec


class F32Codec(Codec):
    family = "f32"
    nominal_bits = 32
    engine_tag = 0

    def __init__(self, dim, nonfinite="raise"):
        super().__init__(dim, nonfinite)
        self.spec = "f32"
        self.code_bytes = 4 * self.dim
        self.n_side = 0

    def _encode(self, X, n_threads):
        status = (~np.isfinite(X).all(axis=1)).astype(np.uint8)
        codes = X.view(np.uint8).copy()
        # with nonfinite="inert" such rows are stored as zeros, as every other codec does
        codes[status.astype(bool)] = 0
        return codes, np.zeros((X.shape[0], 0), np.float32), status

    def _decode(self, codes, side, n_threads):
        return codes.view(np.float32).copy()

    def _scores(self, codes, side, Q, out, n_threads):
        _consumers.scores_f32(codes, Q, out, n_threads)

    def _context(self, codes, side, W, out, n_threads):
        _consumers.context_f32(codes, W, out, n_threads)


def parse(base, dim, options):
    if base != "f32":
        return None
    return F32Codec(dim, **options)
