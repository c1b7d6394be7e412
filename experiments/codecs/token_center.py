"""``tokmean``: per-token centring before an inner codec.

Each row's own mean over its channels is removed and stored as one more side value; the
centred row goes through the inner codec. This is the per-token half of a per-token variance
normalization (KVarN normalizes each token's variance before rotating); the other half, the
row's scale, is already what the rotated codecs store as their radius. The stream option
``center`` removes a per-channel mean instead (one vector per stream): the two are different
offsets and compose.

Spec: ``tokmean:inner=tq3`` (``side_dtype=f16``: every side value fp16). Consumers: the inner
codec's plus ``mean * sum(q)`` per row for scores and ``sum_t w_t mean_t`` on every channel for
the context.
"""
import numpy as np

from kvquant.codecs.base import ROW_SIDE_OVERFLOW

from ._layers import LayeredCodec


class TokenCentered(LayeredCodec):
    """The row's mean stored as a side value, the centred row through ``inner``."""

    family = "tokmean"
    own_side = 1

    def __init__(self, dim, inner="tq3", side_dtype="f32", nonfinite="raise"):
        super().__init__(dim, inner, side_dtype, nonfinite)
        self._finish_layout()
        self.spec = self._spec("tokmean")

    @property
    def series(self):
        return f"tokmean {self.inner.series}"

    def _encode(self, X, n_threads):
        X, status = self.finite_rows(X)
        mean = self.round_side(X.mean(axis=1, dtype=np.float64))
        over = ~np.isfinite(mean) & (status == 0)
        status[over] = ROW_SIDE_OVERFLOW
        mean[status != 0] = 0.0
        centred = X - mean[:, None]
        centred[status != 0] = 0.0
        inner_codes, inner_side = self.encode_inner(centred, n_threads)
        return self.join(inner_codes, inner_side, np.zeros((len(X), 0), np.uint8), mean, status)

    def _decode(self, codes, side, n_threads):
        ic, isd, _, own = self.split(codes, side)
        out = self.decode_inner(ic, isd, n_threads)
        out += own[:, :1]
        return out

    def _scores(self, codes, side, Q, out, n_threads):
        ic, isd, _, own = self.split(codes, side)
        dense = self.inner.scores_checked(ic, isd, Q, n_threads)
        np.add(dense, Q.sum(axis=1)[:, None] * own[:, 0][None, :], out=out)

    def _context(self, codes, side, W, out, n_threads):
        ic, isd, _, own = self.split(codes, side)
        dense = self.inner.context_checked(ic, isd, W, n_threads)
        np.add(dense, (W @ own[:, 0])[:, None], out=out)


def factory(dim, **options):
    return TokenCentered(dim, **options)
