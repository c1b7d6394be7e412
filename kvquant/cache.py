"""QuantizedKVCache: quantized rows per layer, stream and KV head; attention reads the codes.

A cache holds, for every layer, a few named *streams* of rows (keys ``k`` and values ``v`` of a
GQA model, or the latent ``L`` and rope ``R`` rows of an MLA model), each under its own codec, and
each stream holds one sequence of rows per KV head: one :class:`~kvquant.streams.StreamStore` per
layer and stream, with the KV heads as its slots (one encode call per layer and stream). Rows
are quantized when they are appended (before attention reads them, as the engine does) and
attention reads them through the codecs' compressed-domain consumers: the cache is never decoded
for a decode step.

The cache knows nothing of models: a model appends its rows and calls :meth:`attend` (one query
per head, GQA layout) or :meth:`attend_prefill` (many causal queries, through a decoded block and
BLAS), or composes :meth:`scores` and :meth:`context` itself (MLA: scores over L and R, context
over L).

Storage grows geometrically (capacity doubles), so appending T rows one at a time copies O(T) rows
in all; :meth:`reserve` avoids any copy when the final length is known.
"""
import numpy as np

from kvquant._kernels import softmax as _softmax
from kvquant.codecs import Codec
from kvquant._threads import blas_threads, resolve_n_threads
from kvquant.streams.spec import StreamSpec
from kvquant.streams.row_stream import RowStream  # noqa: F401 (a KV head)
from kvquant.streams.store import StreamStore


def softmax(scores, out=None, scale=1.0, n_threads=1):
    """Softmax of ``scores * scale`` over the last axis, float32, compiled (softmax.h).

    The product and the division are numpy's float32 ones; exp is computed to within 1 ulp (not
    numpy's bits) and the sum in a fixed order: the same bits for any thread count and vector
    path. -inf entries get weight 0; a row with a NaN or +inf, or all -inf, becomes NaN (as
    numpy's). ``out`` (it may be ``scores`` itself) takes the weights without a new array: at
    long contexts a decode step's temporaries cost as much as its arithmetic.
    :func:`kvquant.reference.softmax` is the plain numpy one.

    Parameters
    ----------
    scores : ndarray of shape (..., n), float32 (other floats are converted)
    scale : float
        Multiplies the scores first (a float32 product, as ``scores * np.float32(scale)``).
    n_threads : int or None
        Threads at most (:func:`~kvquant._threads.resolve_n_threads`); small calls take one.
    """
    scores = np.asarray(scores)
    if scores.ndim == 0 or scores.shape[-1] == 0:
        raise ValueError(f"softmax needs at least one score a row, got shape {scores.shape}")
    in_place = (out is scores and scores.dtype == np.float32 and scores.flags.c_contiguous
                and scores.flags.writeable)
    work = scores if in_place else np.array(scores, dtype=np.float32, order="C")
    n_threads = resolve_n_threads(n_threads, work=work.size)
    _softmax.softmax_rows(work.reshape(-1, work.shape[-1]), np.float32(scale), n_threads)
    if out is None or out is work:
        return work
    out[...] = work
    return out


class QuantizedKVCache:
    """Quantized rows for every layer, named stream and KV head.

    Parameters
    ----------
    n_layers : int
    streams : dict
        ``name -> (spec, dim)``: the stream spec (or a list of one spec per layer) and the row
        width of each stream. E.g. ``{"k": ("tq4", 64), "v": ("kv8", 64)}`` (GQA),
        ``{"L": ("kv8-g32", 512), "R": ("kv8", 64)}`` (MLA), or with stream options
        ``{"k": ("polar5@center,sinks=1", 64), "v": ("polar4@sinks=1", 64)}``
        (:func:`~kvquant.streams.options.parse_stream_spec`), or a parsed
        :class:`~kvquant.streams.StreamSpec`. A Codec object may stand for a spec (no stream
        options). So may a stream factory, ``make_stream(capacity) -> RowStream`` (any callable
        that is not a Codec), called once per layer and KV head: streams of one's own, e.g. a
        codec under study that keeps per-stream state or carries stream options (research
        code).
        A layer's spec may also be a tuple of one spec per KV head (a bit allocation: each
        KV head of the layer under its own codec).
    n_kv_heads : int, default 1
        Row sequences per stream and layer.
    capacity : int, default 0
        Rows to reserve per sequence.
    statistics : StreamStatistics, optional
        Calibrated offsets and channel scales per layer, stream and KV head
        (:class:`~kvquant.streams.calibration.StreamStatistics`), for streams whose spec says
        ``center=calib`` / ``normalize=calib``.
    **codec_options
        Passed to :func:`kvquant.get_codec` (e.g. ``nonfinite="inert"``, ``seed=...``).

    Examples
    --------
    >>> cache = QuantizedKVCache(2, {"k": ("tq4", 64), "v": ("kv8", 64)}, n_kv_heads=3)
    >>> cache.append(0, k=K, v=V)                   # K, V: (n_new, 3, 64)
    >>> out = cache.attend(0, q, scale=0.125)       # q: (9, 64) -> (9, 64)
    """

    def __init__(self, n_layers, streams, n_kv_heads=1, capacity=0, statistics=None,
                 **codec_options):
        if isinstance(n_layers, bool) or not isinstance(n_layers, (int, np.integer)) or n_layers < 1:
            raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
        if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, (int, np.integer)) \
                or n_kv_heads < 1:
            raise ValueError(f"n_kv_heads must be a positive integer, got {n_kv_heads!r}")
        if not isinstance(streams, dict) or not streams:
            raise ValueError("streams must be a non-empty dict name -> (codec spec, dim)")
        self.n_layers = int(n_layers)
        self.n_kv_heads = int(n_kv_heads)
        self.stream_names = tuple(streams)
        self.dims = {}
        self._layers = []
        specs, parsed = {}, {}   # parsed: each spec string once, whatever layers repeat it
        for name, value in streams.items():
            try:
                spec, dim = value
            except (TypeError, ValueError):
                raise ValueError(f"stream {name!r}: expected (codec spec, dim), got {value!r}")
            per_layer = list(spec) if isinstance(spec, (list, tuple)) else [spec] * self.n_layers
            if len(per_layer) != self.n_layers:
                raise ValueError(f"stream {name!r}: {len(per_layer)} codec specs for "
                                 f"{self.n_layers} layers")
            for s in per_layer:
                for one in (s if isinstance(s, tuple) else (s,)):
                    if isinstance(one, str) and one not in parsed:
                        parsed[one] = StreamSpec.parse(one)
                if isinstance(s, tuple) and len(s) != self.n_kv_heads:
                    raise ValueError(f"stream {name!r}: {len(s)} specs for the "
                                     f"{self.n_kv_heads} KV heads of a layer")
            specs[name] = [tuple(parsed.get(x, x) for x in s) if isinstance(s, tuple)
                           else parsed[s] if isinstance(s, str) else s for s in per_layer]
            self.dims[name] = int(dim)
        codecs = {}   # codecs are immutable: one object per distinct (codec spec, dim)
        made = set()  # ids of the streams factories returned: each must be a new one
        self._stores = []   # per layer: name -> [(StreamStore, KV heads it holds as slots)]
        for layer in range(self.n_layers):
            entry, stores = {}, {}
            for name in self.stream_names:
                spec, dim = specs[name][layer], self.dims[name]
                if callable(spec) and not isinstance(spec, (Codec, StreamSpec)):
                    entry[name] = [self._own_stream(name, spec, capacity, made)
                                   for _ in range(self.n_kv_heads)]
                    stores[name] = [(s.store, [h]) for h, s in enumerate(entry[name])]
                    continue
                # one store per distinct spec among the layer's KV heads (its slots)
                head_specs = spec if isinstance(spec, tuple) else (spec,) * self.n_kv_heads
                entry[name], stores[name] = [None] * self.n_kv_heads, []
                for one in dict.fromkeys(head_specs):
                    heads = [h for h, x in enumerate(head_specs) if x == one]
                    if isinstance(one, Codec):
                        codec, options = one, None
                    else:
                        one = StreamSpec.of(one)   # parsed above; anything else is refused here
                        key = (one.codec_spec, dim)
                        if key not in codecs:
                            codecs[key] = one.codec(dim, **codec_options)
                        codec, options = codecs[key], one.options
                    if codec.dim != dim:
                        raise ValueError(f"stream {name!r}: codec width {codec.dim} != {dim}")
                    calibrated = options is not None and options.calibrated
                    store = StreamStore(codec, options, len(heads), capacity, **(
                        self._statistics(statistics, layer, name, heads, options)
                        if calibrated else {}))
                    for slot, h in enumerate(heads):
                        entry[name][h] = RowStream.of(store, slot)
                    stores[name].append((store, heads))
            self._layers.append(entry)
            self._stores.append(stores)
        # streams are fixed from here on: their widest recent window once
        self._recent = max(store.recent for store in self._all_stores())

    @staticmethod
    def _statistics(statistics, layer, name, heads, options):
        """The calibrated offsets / channel scales of some KV heads of a layer's stream, those
        its options ask for, as StreamStore keywords (none without ``statistics``)."""
        if statistics is None:
            return {}
        offsets, scales = statistics.vectors(layer, name)
        return {"offsets": None if offsets is None or not options.center else offsets[heads],
                "channel_scales": (None if scales is None or not options.normalize
                                   else scales[heads])}

    def _all_stores(self):
        return [store for stores in self._stores for per_name in stores.values()
                for store, _ in per_name]

    def _own_stream(self, name, make_stream, capacity, made):
        """A stream from a factory, checked: a new, empty RowStream of the stream's width."""
        stream = make_stream(capacity)
        if not isinstance(stream, RowStream) or stream.store.slots != 1:
            raise TypeError(f"stream {name!r}: a stream factory must return a RowStream of its "
                            f"own, got {type(stream).__name__}")
        if stream.codec.dim != self.dims[name]:
            raise ValueError(f"stream {name!r}: the factory's codec width {stream.codec.dim} != "
                             f"{self.dims[name]}")
        if len(stream):
            raise ValueError(f"stream {name!r}: the factory returned a stream holding "
                             f"{len(stream)} rows; a new cache starts empty")
        if id(stream.store) in made:
            raise ValueError(f"stream {name!r}: the factory returned the same RowStream twice; "
                             "each layer and KV head needs its own")
        made.add(id(stream.store))
        return stream

    def __repr__(self):
        streams = ", ".join(f"{n}: {self.stream(0, n).spec} x{self.dims[n]}"
                            for n in self.stream_names)
        return (f"<QuantizedKVCache layers={self.n_layers} kv_heads={self.n_kv_heads} "
                f"{{{streams}}} tokens={[self.length(i) for i in range(self.n_layers)]}>")

    # -- access ------------------------------------------------------------------------------
    def _check_layer(self, layer):
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is outside 0..{self.n_layers - 1}")

    def stream(self, layer, name, head=0):
        """One layer, stream and KV head as a :class:`~kvquant.streams.RowStream` (a building
        block: a view of the layer's store for that stream, the KV head its slot)."""
        self._check_layer(layer)
        if name not in self.dims:
            raise KeyError(f"no stream {name!r}; this cache has {list(self.stream_names)}")
        if not 0 <= head < self.n_kv_heads:
            raise IndexError(f"KV head {head} is outside 0..{self.n_kv_heads - 1}")
        return self._layers[layer][name][head]

    def codec(self, layer, name):
        return self.stream(layer, name).codec

    def length(self, layer):
        """Tokens stored in a layer."""
        self._check_layer(layer)
        return self._layers[layer][self.stream_names[0]][0].n_rows

    def __len__(self):
        """Tokens stored in the last layer (the whole cache after a complete forward step)."""
        return self.length(self.n_layers - 1)

    # -- writing -----------------------------------------------------------------------------
    def append(self, layer, n_threads=None, **rows):
        """Quantize and store the rows of new tokens in one layer, for every stream.

        Parameters
        ----------
        layer : int
        **rows : array-like of shape (n_new, n_kv_heads, dim), or (n_new, dim) with one KV head
            One array per stream, all with the same n_new.
        """
        self._check_layer(layer)
        if set(rows) != set(self.stream_names):
            raise ValueError(f"append needs rows for every stream {list(self.stream_names)}, "
                             f"got {sorted(rows)}")
        arrays = {}
        for name, X in rows.items():
            X = np.asarray(X)
            if X.ndim == 2 and self.n_kv_heads == 1:
                X = X[:, None, :]
            if X.ndim != 3 or X.shape[1:] != (self.n_kv_heads, self.dims[name]):
                raise ValueError(
                    f"rows for stream {name!r} must have shape (n_new, {self.n_kv_heads}, "
                    f"{self.dims[name]})" + (f" or (n_new, {self.dims[name]})"
                                             if self.n_kv_heads == 1 else "")
                    + f", got {X.shape}")
            arrays[name] = X
        counts = {X.shape[0] for X in arrays.values()}
        if len(counts) != 1:
            raise ValueError(f"every stream must get the same number of new rows, got "
                             f"{ {n: X.shape[0] for n, X in arrays.items()} }")
        # encode everything first (one call per store: its KV heads are its slots): a bad row
        # leaves the cache untouched
        prepared = [(store, store.prepare(X if len(heads) == X.shape[1] else X[:, heads],
                                          n_threads))
                    for name, X in arrays.items()
                    for store, heads in self._stores[layer][name]]
        for store, item in prepared:
            store.store(item)

    def reserve(self, capacity):
        """Allocate room for ``capacity`` tokens in every sequence."""
        for store in self._all_stores():
            store.reserve(capacity)

    def truncate(self, length):
        """Keep the first ``length`` tokens of every layer."""
        for store in self._all_stores():
            store.truncate(min(length, store.n_rows))

    # -- building blocks ---------------------------------------------------------------------
    def scores(self, layer, name, q, head=0, n_threads=None, length=None, start=0):
        """``q . x^_t`` over one stream's rows start <= t < length: (m, length - start) for q of
        shape (m, dim)."""
        return self.stream(layer, name, head).scores(q, n_threads, length, start)

    def context(self, layer, name, w, head=0, n_threads=None, start=0):
        """``sum_t w_t x^_t`` over one stream's rows start .. start + len(w) - 1."""
        return self.stream(layer, name, head).context(w, n_threads, start)

    # -- attention ---------------------------------------------------------------------------
    def _heads(self, layer, keys, values, n_heads):
        if n_heads % self.n_kv_heads:
            raise ValueError(f"{n_heads} query heads cannot share {self.n_kv_heads} KV heads "
                             "evenly")
        for name in (keys, values):
            self.stream(layer, name)
        return n_heads // self.n_kv_heads

    def attend(self, layer, q, scale=None, keys="k", values="v", n_threads=None, length=None,
               sliding_window=None):
        """Softmax attention of one query per head over the cached rows.

        Query head i reads KV head ``i // (n_heads // n_kv_heads)`` (the usual GQA layout).

        Parameters
        ----------
        layer : int
        q : array-like of shape (n_heads, d_keys)
        scale : float or None
            Score multiplier; None for 1/sqrt(d_keys).
        keys, values : str
            Stream names.
        length : int or None
            Attend to the first ``length`` rows only (default: all).
        sliding_window : int or None
            Attend to the last ``sliding_window`` of those rows only (the query's own included).

        Returns
        -------
        ndarray of shape (n_heads, d_values), dtype float32
        """
        q = np.asarray(q)
        if q.ndim != 2 or q.shape[1] != self.dims[keys]:
            raise ValueError(f"q must have shape (n_heads, {self.dims[keys]}), got {q.shape}")
        group = self._heads(layer, keys, values, q.shape[0])
        scale = np.float32(1.0 / np.sqrt(self.dims[keys]) if scale is None else scale)
        n_threads = resolve_n_threads(n_threads)
        out = np.empty((q.shape[0], self.dims[values]), np.float32)
        n = len(self.stream(layer, keys, 0)) if length is None else length
        # a window reads its rows only: a decode step costs O(sliding_window), not O(T)
        start = 0 if sliding_window is None else max(n - sliding_window, 0)
        for h in range(self.n_kv_heads):
            rows = slice(h * group, (h + 1) * group)
            s = self.stream(layer, keys, h).scores(q[rows], n_threads, length, start)
            w = softmax(s, out=s, scale=scale, n_threads=n_threads)
            out[rows] = self.stream(layer, values, h).context(w, n_threads, start)
        return out

    def attend_prefill(self, layer, Q, scale=None, keys="k", values="v", n_threads=None,
                       block=256, sliding_window=None):
        """Causal attention of the last ``n_q`` stored tokens' queries (prefill).

        The rows of each KV head are decoded once and the queries go through BLAS in blocks: much
        faster than one consumer call per query, and it agrees with :meth:`attend` at every
        position to rounding. Query j sits at position ``T - n_q + j`` and sees rows 0..that;
        with a recent window (``recent=W``) it reads rows p-W+1 .. p from their float32 copies,
        as :meth:`attend` with ``length=p + 1`` does (the queries must be those of the rows of
        the last append, whose copies the streams hold).

        Parameters
        ----------
        Q : array-like of shape (n_q, n_heads, d_keys)
        sliding_window : int or None
            Each query sees its last ``sliding_window`` rows only (its own included); a block
            of queries multiplies only the rows its windows cover, so a windowed prefill costs
            O(n_q * sliding_window), not O(n_q * T).

        Returns
        -------
        ndarray of shape (n_q, n_heads, d_values), dtype float32
        """
        Q, group, first, scale = self._prefill_queries(layer, Q, scale, keys, values)
        n_q, n_heads = Q.shape[:2]
        n_threads = resolve_n_threads(n_threads)
        out = np.empty((n_q, n_heads, self.dims[values]), np.float32)
        with blas_threads(n_threads):
            for h in range(self.n_kv_heads):
                sk, sv = self.stream(layer, keys, h), self.stream(layer, values, h)
                # with a window, rows come from their codes and each query's own window of
                # float32 copies is put in below
                K = sk.decode(n_threads=n_threads, window=False)
                V = sv.decode(n_threads=n_threads, window=False)
                Qh = Q[:, h * group:(h + 1) * group, :]            # (n_q, group, d)
                for b0 in range(0, n_q, block):
                    b1 = min(b0 + block, n_q)
                    visible = first + b1                           # rows the block's last query sees
                    # rows before the block's first window are invisible to all its queries
                    start = (0 if sliding_window is None
                             else min(max(first + b0 - sliding_window + 1, 0), visible))
                    Qb = Qh[b0:b1].reshape(-1, Q.shape[2])
                    S = np.matmul(Qb, K[start:visible].T)
                    S *= scale
                    S = S.reshape(b1 - b0, group, visible - start)
                    pos = first + np.arange(b0, b1)
                    if sk.recent:
                        lo, band = _window_band(sk, pos, visible, start)
                        Sx = np.matmul(Qb, sk.recent_rows(lo, visible).T)
                        Sx *= scale
                        Sx = Sx.reshape(b1 - b0, group, visible - lo)
                        np.copyto(S[:, :, lo - start:], Sx, where=band[:, None, :])
                    rows = np.arange(start, visible)[None, :]
                    future = rows > pos[:, None]
                    if sliding_window is not None:
                        future |= rows <= pos[:, None] - sliding_window
                    np.copyto(S, np.float32(-np.inf), where=future[:, None, :])
                    P = softmax(S, out=S, n_threads=n_threads)
                    ctx = P @ V[start:visible]
                    if sv.recent:
                        lo, band = _window_band(sv, pos, visible, start)
                        ctx += (P[:, :, lo - start:] * band[:, None, :]) @ (
                            sv.recent_rows(lo, visible) - V[lo:visible])
                    out[b0:b1, h * group:(h + 1) * group] = ctx
        return out

    def _prefill_queries(self, layer, Q, scale, keys, values):
        """Checked prefill queries: (Q as float32 (n_q, n_heads, d), heads per KV head, position
        of the first query, score scale)."""
        Q = np.asarray(Q, dtype=np.float32)
        if Q.ndim != 3 or Q.shape[2] != self.dims[keys]:
            raise ValueError(f"Q must have shape (n_q, n_heads, {self.dims[keys]}), got {Q.shape}")
        group = self._heads(layer, keys, values, Q.shape[1])
        T = self.length(layer)
        if Q.shape[0] > T:
            raise ValueError(f"{Q.shape[0]} queries but only {T} rows stored: append the rows "
                             "first")
        scale = np.float32(1.0 / np.sqrt(self.dims[keys]) if scale is None else scale)
        return Q, group, T - Q.shape[0], scale

    @property
    def recent(self):
        """The widest recent window of any stream of any layer (0: none)."""
        return self._recent

    # -- sizes -------------------------------------------------------------------------------
    @property
    def nbytes(self):
        """Bytes of the stored rows (codes and side values), every layer, stream and head."""
        return sum(store.nbytes for store in self._all_stores())

    @property
    def capacity_bytes(self):
        """Bytes allocated."""
        return sum(store.capacity_bytes for store in self._all_stores())

    @property
    def bytes_per_token(self):
        """Bytes one token adds to the cache (all layers, streams and heads); float32 sinks and
        offsets of streams with options are a fixed cost on top (see :attr:`nbytes`)."""
        return sum(head.codec.bytes_per_row
                   for entry in self._layers for heads in entry.values() for head in heads)

    @property
    def fixed_bytes(self):
        """Bytes of the stream options beyond ``bytes_per_token`` per token (sinks, window
        copies, offsets, scales; :attr:`StreamStore.fixed_bytes`), every layer, stream and head:
        a cache of T >= sinks + recent tokens holds ``T * bytes_per_token + fixed_bytes``."""
        return sum(store.fixed_bytes for store in self._all_stores())


def _window_band(stream, pos, visible, first_row=0):
    """For queries at positions ``pos`` reading rows ``first_row`` .. visible - 1: the first row
    any of them reads from a float32 copy, and the (n_q, visible - lo) mask of the rows each one
    does."""
    starts = stream.window_starts(pos + 1)
    # a query within the sinks has an empty band (its start is its length): not below the copies
    lo = min(visible, max(int(starts.min()), stream.recent_start, first_row))
    rows = np.arange(lo, visible)[None, :]
    return lo, (rows >= starts[:, None]) & (rows <= pos[:, None])
