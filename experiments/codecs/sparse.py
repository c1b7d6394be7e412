"""``ds``: dense-and-sparse rows (KVQuant, Hooper et al., arXiv 2401.18079, section 3.4).

Each row's ``k`` largest magnitudes are kept exactly as (channel index, fp16 value) pairs; the
row with those entries zeroed (the dense part) goes through the inner codec. KVQuant keeps
~1% of the values per vector this way; at head_dim 64 one pair costs 3 bytes, 0.375 bits per
value, so the count is what the spec says (``k``), and the bytes are counted in ``bytes_per_row``.

Spec: ``ds:inner=tq3,k=1`` (``side_dtype=f16`` stores the inner codec's side values as fp16).
Consumers: the inner codec's own (compressed-domain where it has them) plus k multiply-adds per
row for the pairs.
"""
import numpy as np
from scipy import sparse as _sparse

from kvquant.codecs.base import ROW_RANGE, F16_MAX

from ._layers import LayeredCodec


class DenseSparse(LayeredCodec):
    """Dense-and-sparse codec: ``k`` exact outliers per row + ``inner`` on the rest.

    Parameters
    ----------
    dim : int
    inner : str
        Bare spec of the dense part's codec (default ``tq3``).
    k : int
        Outliers kept per row (1 <= k < dim).
    side_dtype : {"f32", "f16"}
    nonfinite : {"raise", "inert"}
    """

    family = "ds"
    range_rule = "an outlier it keeps is above the float16 maximum 65504"

    def __init__(self, dim, inner="tq3", k=1, side_dtype="f32", nonfinite="raise"):
        super().__init__(dim, inner, side_dtype, nonfinite)
        k = int(k)
        if not 1 <= k < self.dim:
            raise ValueError(f"ds: k={k} outliers per row must be in 1..{self.dim - 1}")
        self.k = k
        self.index_dtype = np.dtype("<u1") if self.dim <= 256 else np.dtype("<u2")
        self.own_bytes = k * (self.index_dtype.itemsize + 2)
        self._finish_layout()
        self.spec = self._spec("ds", k=k)

    @property
    def series(self):
        return f"ds{self.k} {self.inner.series}"

    def _encode(self, X, n_threads):
        X, status = self.finite_rows(X)
        n = X.shape[0]
        # stable sort: ties go to the lower channel, whatever the other rows are
        idx = np.sort(np.argsort(-np.abs(X), axis=1, kind="stable")[:, :self.k], axis=1)
        values = np.take_along_axis(X, idx, axis=1)
        over = (np.abs(values) > F16_MAX).any(axis=1) & (status == 0)
        status[over] = ROW_RANGE
        dense = X.copy()
        np.put_along_axis(dense, idx, 0.0, axis=1)
        dense[status != 0] = 0.0
        inner_codes, inner_side = self.encode_inner(dense, n_threads)
        with np.errstate(over="ignore"):
            half = values.astype("<f2")
        own = np.concatenate([idx.astype(self.index_dtype).view(np.uint8).reshape(n, -1),
                              half.view(np.uint8).reshape(n, -1)], axis=1)
        return self.join(inner_codes, inner_side, own, np.zeros((n, 0), np.float32), status)

    def pairs(self, own_codes):
        """(channel indices int64 (n, k), values float32 (n, k)) of stored rows."""
        n, split = own_codes.shape[0], self.k * self.index_dtype.itemsize
        own = np.ascontiguousarray(own_codes)
        idx = own[:, :split].copy().view(self.index_dtype).astype(np.int64)
        values = own[:, split:].copy().view("<f2").astype(np.float32)
        return idx.reshape(n, self.k), values.reshape(n, self.k)

    def _decode(self, codes, side, n_threads):
        ic, isd, oc, _ = self.split(codes, side)
        out = self.decode_inner(ic, isd, n_threads)
        idx, values = self.pairs(oc)
        rows = np.arange(out.shape[0])[:, None]
        out[rows, idx] += values
        return out

    def _outlier_matrix(self, own_codes):
        idx, values = self.pairs(own_codes)
        n = idx.shape[0]
        indptr = np.arange(0, n * self.k + 1, self.k)
        return _sparse.csr_matrix((values.ravel().astype(np.float64), idx.ravel(), indptr),
                                  shape=(n, self.dim))

    def _scores(self, codes, side, Q, out, n_threads):
        ic, isd, oc, _ = self.split(codes, side)
        dense = self.inner.scores_checked(ic, isd, Q, n_threads)
        idx, values = self.pairs(oc)
        # (m, T): sum over the k pairs of value * q[index]
        extra = (Q[:, idx] * values[None]).sum(axis=2, dtype=np.float32)
        np.add(dense, extra, out=out)

    def _context(self, codes, side, W, out, n_threads):
        ic, isd, oc, _ = self.split(codes, side)
        dense = self.inner.context_checked(ic, isd, W, n_threads)
        extra = (self._outlier_matrix(oc).T @ W.T.astype(np.float64)).T
        np.add(dense, extra.astype(np.float32), out=out)


def factory(dim, **options):
    return DenseSparse(dim, **options)
