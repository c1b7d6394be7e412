"""A reference of the recent window (``recent=W``) for the tests: the last W rows read from a
second, float32 cache kept beside the quantized one, and the rest through the codecs. Written
differently from the stream store's window (two whole caches, a mask over every position), so
that the two agreeing is a check of the store's window rule."""
import numpy as np

from kvquant.cache import QuantizedKVCache, softmax


class RecentWindowCache(QuantizedKVCache):
    """A cache whose last ``window`` rows are read exactly (float32) and older rows through the
    codecs: the query at position t reads rows t-W+1..t exact, rows before quantized.

    Every row is kept twice (an f32 copy beside the codec's).

    Parameters
    ----------
    n_layers, streams, n_kv_heads, capacity
        As :class:`~kvquant.cache.QuantizedKVCache`.
    window : int
        Rows W read exactly (0: the codec alone; >= the context: f32 attention).
    """

    def __init__(self, n_layers, streams, n_kv_heads=1, capacity=0, window=0):
        super().__init__(n_layers, streams, n_kv_heads, capacity)
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
            raise ValueError(f"window must be an integer >= 0, got {window!r}")
        self.window = int(window)
        self.exact = QuantizedKVCache(n_layers, {n: ("f32", d) for n, d in self.dims.items()},
                                      n_kv_heads, capacity)

    def append(self, layer, n_threads=None, **rows):
        before = self.length(layer)
        super().append(layer, n_threads, **rows)
        try:
            self.exact.append(layer, n_threads, **rows)
        except Exception:
            self._truncate_layer(layer, before)
            raise

    def _truncate_layer(self, layer, length):
        for name in self.stream_names:
            for h in range(self.n_kv_heads):
                self.stream(layer, name, h).truncate(length)

    def reserve(self, capacity):
        super().reserve(capacity)
        self.exact.reserve(capacity)

    def truncate(self, length):
        super().truncate(length)
        self.exact.truncate(length)

    def attend(self, layer, q, scale=None, keys="k", values="v", n_threads=None, length=None):
        """One query per head at position ``length - 1`` (default: the last row); see
        :meth:`QuantizedKVCache.attend`. Returns (n_heads, d_values) float32."""
        q = np.asarray(q)
        if q.ndim != 2 or q.shape[1] != self.dims[keys]:
            raise ValueError(f"q must have shape (n_heads, {self.dims[keys]}), got {q.shape}")
        group = self._heads(layer, keys, values, q.shape[0])
        n = self.length(layer) if length is None else int(length)
        recent = max(n - self.window, 0)              # rows recent.. are read exactly
        scale = np.float32(1.0 / np.sqrt(self.dims[keys]) if scale is None else scale)
        out = np.empty((q.shape[0], self.dims[values]), np.float32)
        for h in range(self.n_kv_heads):
            rows = slice(h * group, (h + 1) * group)
            s = self.stream(layer, keys, h).scores(q[rows], n_threads, n)
            s[:, recent:] = self.exact.stream(layer, keys, h).scores(q[rows], n_threads, n)[
                :, recent:]
            s *= scale
            w = softmax(s)
            w_old, w_new = w.copy(), w
            w_old[:, recent:] = 0.0
            w_new[:, :recent] = 0.0
            out[rows] = (self.stream(layer, values, h).context(w_old, n_threads)
                         + self.exact.stream(layer, values, h).context(w_new, n_threads))
        return out

    def attend_prefill(self, layer, Q, scale=None, keys="k", values="v", n_threads=None,
                       block=256):
        """Causal attention of the last ``n_q`` stored tokens' queries, the window exact; see
        :meth:`QuantizedKVCache.attend_prefill`.

        Parameters
        ----------
        Q : array-like of shape (n_q, n_heads, d_keys)

        Returns
        -------
        ndarray of shape (n_q, n_heads, d_values), dtype float32
        """
        Q, group, first, scale = self._prefill_queries(layer, Q, scale, keys, values)
        n_q, n_heads = Q.shape[:2]
        out = np.empty((n_q, n_heads, self.dims[values]), np.float32)
        for h in range(self.n_kv_heads):
            Kq = self.stream(layer, keys, h).decode(n_threads=n_threads)
            Vq = self.stream(layer, values, h).decode(n_threads=n_threads)
            Kf = self.exact.stream(layer, keys, h).decode(n_threads=n_threads)
            Vf = self.exact.stream(layer, values, h).decode(n_threads=n_threads)
            Qh = Q[:, h * group:(h + 1) * group, :]
            for b0 in range(0, n_q, block):
                b1 = min(b0 + block, n_q)
                visible = first + b1
                Qb = Qh[b0:b1].reshape(-1, Q.shape[2])
                shape = (b1 - b0, group, visible)
                Sq = np.matmul(Qb, Kq[:visible].T).reshape(shape)
                Sf = np.matmul(Qb, Kf[:visible].T).reshape(shape)
                age = (first + np.arange(b0, b1))[:, None] - np.arange(visible)[None, :]
                exact = ((age >= 0) & (age < self.window))[:, None, :]
                S = np.where(exact, Sf, Sq)
                S *= scale
                np.copyto(S, np.float32(-np.inf), where=(age < 0)[:, None, :])
                P = softmax(S)
                out[b0:b1, h * group:(h + 1) * group] = (
                    np.where(exact, P, np.float32(0)) @ Vf[:visible]
                    + np.where(exact, np.float32(0), P) @ Vq[:visible])
        return out
