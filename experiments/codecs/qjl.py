"""``qjl``: an inner codec plus a 1-bit sign sketch of its residual (QJL, Zandieh et al.,
arXiv 2406.03482; the two-stage TurboQuant_prod of arXiv 2504.19874, section 3.2).

The residual r = x - inner(x) is projected by a seeded Gaussian matrix S (m x dim, m = dim) and
only the signs of S r are kept, with |r| as one more side value. The estimate
``q . x ~ q . inner(x) + sqrt(pi/2) / m * |r| * (S q) . sign(S r)`` is unbiased over S, and it is
what decoding gives: ``decode(x) = inner(x) + sqrt(pi/2) / m * |r| * S^T sign(S r)``, so the
consumers (inner consumer + m sign-weighted terms of the projected query) equal decode then
multiply. It costs m bits (1 bit per value) plus one side value; TurboQuant reports that the
variance it adds hurts softmax attention more than its bias removal helps, which the
ablation measures rather than assumes.

Spec: ``qjl:inner=tq2,seed=0`` (``side_dtype=f16``: side values fp16).
"""
import math

import numpy as np

from ._layers import LayeredCodec, pack_codes, unpack_codes


class ResidualSigns(LayeredCodec):
    """``inner`` + the signs of a Gaussian projection of the residual."""

    family = "qjl"
    own_side = 1

    def __init__(self, dim, inner="tq2", seed=0, side_dtype="f32", nonfinite="raise"):
        super().__init__(dim, inner, side_dtype, nonfinite)
        self.seed = int(seed)
        self.m = self.dim
        self.projection = np.random.default_rng(self.seed).standard_normal((self.m, self.dim))
        self.projection.flags.writeable = False
        self.own_bytes = (self.m + 7) // 8
        self._finish_layout()
        self.spec = self._spec("qjl", seed=self.seed)

    @property
    def series(self):
        return f"qjl {self.inner.series}"

    def _encode(self, X, n_threads):
        X, status = self.finite_rows(X)
        inner_codes, inner_side = self.encode_inner(X, n_threads)
        residual = X.astype(np.float64) - self.decode_inner(inner_codes, inner_side, n_threads)
        norm = self.round_side(np.sqrt((residual * residual).sum(axis=1)))
        signs = (residual @ self.projection.T) >= 0
        return self.join(inner_codes, inner_side, pack_codes(signs.astype(np.uint8), 1),
                         norm, status)

    def _signs(self, own_codes):
        return 2.0 * unpack_codes(np.ascontiguousarray(own_codes), self.m, 1) - 1.0

    def _weights(self, own_codes, own_side):
        """(T, m) float64: sqrt(pi/2)/m * |r_t| * sign(S r_t)."""
        return self._signs(own_codes) * (math.sqrt(math.pi / 2) / self.m * own_side[:, :1])

    def _decode(self, codes, side, n_threads):
        ic, isd, oc, own = self.split(codes, side)
        out = self.decode_inner(ic, isd, n_threads)
        out += (self._weights(oc, own) @ self.projection).astype(np.float32)
        return out

    def _scores(self, codes, side, Q, out, n_threads):
        ic, isd, oc, own = self.split(codes, side)
        dense = self.inner.scores_checked(ic, isd, Q, n_threads)
        projected = Q.astype(np.float64) @ self.projection.T          # (m_q, m), once
        np.add(dense, (projected @ self._weights(oc, own).T).astype(np.float32), out=out)

    def _context(self, codes, side, W, out, n_threads):
        ic, isd, oc, own = self.split(codes, side)
        dense = self.inner.context_checked(ic, isd, W, n_threads)
        sketch = W.astype(np.float64) @ self._weights(oc, own)          # (m_q, m)
        np.add(dense, (sketch @ self.projection).astype(np.float32), out=out)


def factory(dim, **options):
    return ResidualSigns(dim, **options)
