"""A codec written as a user would write one (for the registry's tests): one sign bit per value
and the row's mean absolute value as its scale."""
import numpy as np

from kvquant.codecs import Codec


class SignCodec(Codec):
    family = "toy-sign"

    def __init__(self, dim, nonfinite="raise", scale="mean"):
        super().__init__(dim, nonfinite)
        if scale not in ("mean", "rms"):
            raise ValueError(f"scale={scale!r}: mean or rms")
        self.scale = scale
        self.spec = "toysign" if scale == "mean" else "toysign:scale=rms"
        self.code_bytes = (dim + 7) // 8
        self.n_side = 1

    def _encode(self, X, n_threads):
        status = (~np.isfinite(X).all(axis=1)).astype(np.uint8)
        Xf = np.where(np.isfinite(X), X, 0)
        s = (np.abs(Xf).mean(axis=1) if self.scale == "mean"
             else np.sqrt((Xf * Xf).mean(axis=1)))
        codes = np.packbits(Xf >= 0, axis=1, bitorder="little")
        return codes, s.astype(np.float32)[:, None], status

    def _decode(self, codes, side, n_threads):
        signs = np.unpackbits(codes, axis=1, count=self.dim, bitorder="little")
        return ((2.0 * signs - 1.0) * side[:, :1]).astype(np.float32)


def factory(dim, **options):
    return SignCodec(dim, **options)
