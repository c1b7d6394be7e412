"""QuantizedKVCache: quantized rows per layer, stream and KV head; attention reads the codes.

A cache holds, for every layer, a few named *streams* of rows (keys ``k`` and values ``v`` of a
GQA model, or the latent ``L`` and rope ``R`` rows of an MLA model), each under its own codec, and
each stream holds one sequence of rows per KV head. Rows are quantized when they are appended
(before attention reads them, as the engine does) and attention reads them through the codecs'
compressed-domain consumers: the cache is never decoded for a decode step.

The cache knows nothing of models: a model appends its rows and calls :meth:`attend` (one query
per head, GQA layout) or :meth:`attend_prefill` (many causal queries, through a decoded block and
BLAS), or composes :meth:`scores` and :meth:`context` itself (MLA: scores over L and R, context
over L).

Storage grows geometrically (capacity doubles), so appending T rows one at a time copies O(T) rows
in all; :meth:`reserve` avoids any copy when the final length is known.
"""
import math

import numpy as np

from kvquant.codecs import Codec, EncodedRows, get_codec
from kvquant._threads import resolve_n_threads
from kvquant.stream_options import (  # noqa: F401 (parse/format: the cache's spec language)
    StreamOptions, format_stream_spec, parse_stream_spec, split_rows, window_start)

_MIN_CAPACITY = 16


class RowStream:
    """One growing sequence of rows under one codec.

    Parameters
    ----------
    codec : Codec
    capacity : int
        Rows to allocate up front.
    center : bool
        Subtract the mean of the first append's rows before encoding (:func:`parse_stream_spec`).
    normalize : bool
        Divide each channel by a scale taken from the first append's rows (same place).
    sinks : int
        Keep the first ``sinks`` rows in float32, unquantized.
    recent : int
        Read the ``recent`` rows before a query's position in float32 (a moving window).

    Notes
    -----
    Rows 0 .. min(n_rows, sinks) are held as float32; the codes hold the rows after them, as
    ``(x - offset) / channel_scale`` (offset 0 and scale 1 where not asked for). Reading
    (``scores``, ``context``, ``decode``) gives the stored rows as the model sees them: the sinks
    exactly, the other rows decoded, scaled back and offset; with ``recent=W``, a read of the
    first ``length`` rows (a query at position length - 1) reads rows length - W .. length - 1
    from their float32 copies, which the stream holds for its last W rows and, until the next
    append, for the rows of the last append (:meth:`window_start`).
    """

    def __init__(self, codec, capacity=0, center=False, sinks=0, normalize=False, recent=0):
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a Codec (use kvquant.get_codec), got {codec!r}")
        StreamOptions(center, normalize, sinks, recent)   # validates the counts
        self.codec = codec
        self.center = bool(center)
        self.normalize = bool(normalize)
        self.sinks = int(sinks)
        self.recent = int(recent)
        self._recent_rows = np.empty((0, codec.dim), np.float32)   # rows [_recent_start, n_rows)
        self._recent_start = 0
        self._last_append = 0   # rows before the last append (reads of fewer rows: refused)
        self.n_rows = 0
        self.offset = None            # (dim,) float32 once a centered stream got its first rows
        self.channel_scale = None     # (dim,) float32 once a normalized stream got its first rows
        self._n_exact = 0             # rows held in float32 (the first min(n_rows, sinks))
        self._exact = np.empty((0, codec.dim), np.float32)   # grows up to `sinks` rows
        self._codes = np.empty((0, codec.code_bytes), np.uint8)
        self._side = np.empty((0, codec.n_side), np.float32)
        self.reserve(capacity)

    @classmethod
    def from_state(cls, codec, options, codes, side, offset=None, channel_scale=None,
                   exact=None, recent_rows=None):
        """A stream holding rows stored elsewhere (a cache file's records), ready for attention.

        Parameters
        ----------
        codec : Codec
        options : StreamOptions
        codes, side : ndarray of shape (n_coded, code_bytes) uint8 / (n_coded, n_side)
            The coded rows (after the sinks), as this codec encoded them.
        offset, channel_scale : ndarray of shape (dim,), float32, or None
            The stream's offset and scales: given exactly when the options ask for them and the
            stream holds rows.
        exact : ndarray of shape (n_exact, dim), float32, or None
            The float32 sink rows; ``n_exact == options.sinks`` when there are coded rows.
        recent_rows : ndarray of shape (m, dim), float32, or None
            With ``options.recent``: the float32 copies of the last m coded rows.
        """
        codes, side = codec.check_encoded(EncodedRows(codes, side, codec.spec, codec.dim))
        if (recent_rows is not None) != bool(options.recent) or (
                recent_rows is not None and (np.ndim(recent_rows) != 2
                                             or np.shape(recent_rows)[1] != codec.dim
                                             or len(recent_rows) > codes.shape[0])):
            raise ValueError(f"recent_rows must be given exactly with a recent window (options "
                             f"{options.as_dict()}), as copies of at most the {codes.shape[0]} "
                             f"coded rows of width {codec.dim}, got {np.shape(recent_rows)}")
        exact = np.zeros((0, codec.dim), np.float32) if exact is None else np.asarray(exact)
        n_coded, n_exact = codes.shape[0], exact.shape[0]
        dim = codec.dim
        if exact.shape[1:] != (dim,) or n_exact > options.sinks or (
                n_coded and n_exact != options.sinks):
            raise ValueError(f"{options.sinks} sink row(s) of width {dim} come before any coded "
                             f"row: got {exact.shape} sink rows and {n_coded} coded rows")
        has_rows = n_coded + n_exact > 0
        for name, vec, asked in (("offset", offset, options.center),
                                 ("channel_scale", channel_scale, options.normalize)):
            if (vec is not None) != (asked and has_rows):
                raise ValueError(f"{name} must be given exactly when the stream "
                                 f"{'asks for it' if asked else 'does not ask for it'} and holds "
                                 f"rows (options {options.as_dict()}, {n_coded + n_exact} rows)")
            if vec is not None and np.shape(vec) != (dim,):
                raise ValueError(f"{name} must have shape ({dim},), got {np.shape(vec)}")
        self = cls(codec, n_coded, **options.as_dict())
        self.offset = None if offset is None else np.array(offset, np.float32)
        self.channel_scale = None if channel_scale is None else np.array(channel_scale,
                                                                         np.float32)
        self._hold_exact(n_exact)
        self._exact[:n_exact] = exact
        self._n_exact = n_exact
        self.n_rows = n_exact
        self._append_codes(EncodedRows(codes, side, codec.spec, codec.dim))
        if recent_rows is not None:
            self._recent_rows = np.array(recent_rows, np.float32)
        self._recent_start = self.n_rows - len(self._recent_rows)
        self._last_append = self.n_rows
        return self

    @property
    def options(self):
        return StreamOptions(self.center, self.normalize, self.sinks, self.recent)

    @property
    def spec(self):
        """The stream spec: the codec's spec and the stream options."""
        return self.options.stream_spec(self.codec.spec)

    @property
    def _plain(self):
        return self.options.plain

    def __len__(self):
        return self.n_rows

    def __repr__(self):
        return f"<RowStream {self.spec!r} dim={self.codec.dim} rows={self.n_rows}>"

    @property
    def capacity(self):
        return self._codes.shape[0]

    def reserve(self, capacity):
        """Make room for ``capacity`` rows in all (never shrinks)."""
        capacity = int(capacity)
        if capacity <= self.capacity:
            return
        codes = np.empty((capacity, self.codec.code_bytes), np.uint8)
        side = np.empty((capacity, self.codec.n_side), np.float32)
        n_coded = self.n_rows - self._n_exact
        codes[:n_coded] = self._codes[:n_coded]
        side[:n_coded] = self._side[:n_coded]
        self._codes, self._side = codes, side

    def prepare(self, rows, n_threads=None):
        """Encode new rows without storing them (a bad row raises and changes nothing).

        Returns an object for :meth:`store`; the cache encodes every stream first and then stores,
        so that a bad row in one stream leaves all of them untouched.
        """
        if self._plain:
            return (None, None, None, self.codec.encode(rows, n_threads), None)
        X = self.codec.as_rows(rows)
        offset, scale, exact, rest = split_rows(
            X, self.options, self.offset, self.channel_scale, self.n_rows, self.codec.nonfinite)
        enc = self.codec.encode(rest, n_threads)
        window = None
        if self.recent:   # float32 copies of the coded rows, as given (NaN/inf rows: inert zero)
            window = X[exact.shape[0]:]
            bad = ~np.isfinite(window).all(axis=1)
            if bad.any():
                window = np.where(bad[:, None], np.float32(0), window)
        return (offset, scale, exact, enc, window)

    def store(self, prepared):
        """Store what :meth:`prepare` returned."""
        offset, scale, exact, enc, window = prepared
        self.offset, self.channel_scale = offset, scale
        self._last_append = self.n_rows
        if exact is not None and exact.shape[0]:
            self._hold_exact(self._n_exact + exact.shape[0])
            self._exact[self._n_exact:self._n_exact + exact.shape[0]] = exact
            self._n_exact += exact.shape[0]
            self.n_rows += exact.shape[0]
        before = self.n_rows
        self._append_codes(enc)
        if self.recent:
            self._keep_recent(before, window)

    def _keep_recent(self, before, window):
        """After appending ``window`` (float32 copies of rows [before, n_rows)): hold the copies
        of the last ``recent`` rows before this append and of all rows of this append."""
        start = int(window_start(before, self.recent, self._recent_start, self.sinks))
        held = self._recent_rows[start - self._recent_start:before - self._recent_start]
        self._recent_rows = np.concatenate([held, np.asarray(window, np.float32)])
        self._recent_start = self.n_rows - len(self._recent_rows)

    def _hold_exact(self, n):
        """Room for n float32 sink rows (grown geometrically, never past ``sinks``)."""
        if n > self._exact.shape[0]:
            grown = np.empty((min(self.sinks, max(n, 2 * self._exact.shape[0])), self.codec.dim),
                             np.float32)
            grown[:self._n_exact] = self._exact[:self._n_exact]
            self._exact = grown

    def append(self, rows, n_threads=None):
        """Quantize rows of shape (n_new, dim) and store them."""
        self.store(self.prepare(rows, n_threads))

    def append_encoded(self, enc):
        """Store rows already encoded by this stream's codec (e.g. read from a file)."""
        if not self._plain:
            raise ValueError(
                f"stream {self.spec!r} centers or normalizes its rows or keeps sinks in float32: "
                "rows encoded elsewhere carry no offset, scales or exact sinks; append the float "
                "rows instead")
        self._append_codes(enc)

    def _append_codes(self, enc):
        codes, side = self.codec.check_encoded(enc)
        k = codes.shape[0]
        n_coded = self.n_rows - self._n_exact
        if n_coded + k > self.capacity:
            self.reserve(max(n_coded + k, 2 * self.capacity, _MIN_CAPACITY))
        self._codes[n_coded: n_coded + k] = codes
        self._side[n_coded: n_coded + k] = side
        self.n_rows += k

    def truncate(self, n_rows):
        """Keep the first ``n_rows`` rows (truncating to 0 also forgets offset and scales)."""
        if not 0 <= n_rows <= self.n_rows:
            raise ValueError(f"cannot truncate {self.n_rows} rows to {n_rows}")
        self.n_rows = int(n_rows)
        self._n_exact = min(self._n_exact, self.n_rows)
        # the copies kept: those the window of the new length needs, where still held (so that
        # dropping the rows of an append gives back the stream before it); a row whose copy is
        # gone reads from its codes
        keep = int(window_start(self.n_rows, self.recent, self._recent_start, self.sinks))
        self._recent_rows = np.array(self._recent_rows[keep - self._recent_start:
                                                       self.n_rows - self._recent_start])
        self._recent_start = keep
        self._last_append = min(self._last_append, self.n_rows)
        if self.n_rows == 0:
            self.offset = self.channel_scale = None
            self._recent_start = 0

    def encoded(self, length=None):
        """The coded rows among the first ``length`` (all by default) as EncodedRows: a view.

        For a stream with sinks these are the rows after the sinks (the sinks are float32)."""
        return EncodedRows(*self._coded(self._length(length)), self.codec.spec, self.codec.dim)

    def _coded(self, n):
        """(codes, side) views of the coded rows among the first n, checked when stored."""
        k = n - min(self._n_exact, n)
        return self._codes[:k], self._side[:k]

    def _length(self, length):
        if length is None:
            return self.n_rows
        if not 0 <= length <= self.n_rows:
            raise ValueError(f"length {length} is outside 0..{self.n_rows} (rows stored)")
        return int(length)

    def window_start(self, length=None):
        """First row that a read of the first ``length`` rows (a query at position
        length - 1) takes from its float32 copy: ``length`` when the stream has no window.

        Reads of fewer rows than the stream held before its last append are refused: the
        copies of their windows are gone (rows whose copies a truncation dropped read from
        their codes)."""
        n = self._length(length)
        if self.recent:
            self._check_window_length(n)
        return int(window_start(n, self.recent, self._recent_start, self.sinks))

    def window_starts(self, lengths):
        """:meth:`window_start` of every length in ``lengths`` (an int array), vectorized."""
        lengths = np.asarray(lengths, np.int64)
        if self.recent and lengths.size:
            self._check_window_length(int(lengths.min()))
        return window_start(lengths, self.recent, self._recent_start, self.sinks)

    def _check_window_length(self, n):
        if n < self._last_append:
            raise ValueError(
                f"a read of the first {n} rows needs the float32 copies of its window of "
                f"{self.recent} rows; this stream keeps them for its last {self.recent} rows "
                f"and the rows of its last append: read at least {self._last_append} rows")

    def recent_rows(self, start, stop):
        """The float32 copies of rows [start, stop), which must lie in the rows held
        (``window_start(length)`` .. ``length`` for any length from the last append on)."""
        if not self._recent_start <= start <= stop <= self.n_rows:
            raise ValueError(f"rows [{start}, {stop}) are not all held in float32 (held: "
                             f"[{self._recent_start}, {self.n_rows}))")
        return self._recent_rows[start - self._recent_start:stop - self._recent_start]

    def scores(self, q, n_threads=None, length=None):
        """``q . x^_t`` for the stored rows t < length; q of shape (dim,) or (m, dim)."""
        n = self._length(length)
        if self._plain:
            return self.codec.scores_checked(*self._coded(n), q, n_threads)
        e, ws = min(n, self._n_exact), self.window_start(n)
        q32 = np.asarray(q, dtype=np.float32)
        q_coded = q32 if self.channel_scale is None else q32 * self.channel_scale
        coded = self.codec.scores_checked(*self._coded(ws), q_coded, n_threads)
        if self.offset is not None and coded.shape[-1]:
            coded += (q32 @ self.offset)[..., None]
        parts = ([q32 @ self._exact[:e].T] if e else []) + [coded]
        if ws < n:
            parts.append(q32 @ self.recent_rows(ws, n).T)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

    def context(self, w, n_threads=None):
        """``sum_t w_t x^_t`` over the first ``len(w)`` rows; w of shape (T,) or (m, T)."""
        n = self._length(np.shape(w)[-1])
        if self._plain:
            return self.codec.context_checked(*self._coded(n), w, n_threads)
        e, ws = min(n, self._n_exact), self.window_start(n)
        w32 = np.asarray(w, dtype=np.float32)
        out = self.codec.context_checked(*self._coded(ws), w32[..., e:ws], n_threads)
        if self.channel_scale is not None:
            out *= self.channel_scale
        if self.offset is not None and ws > e:
            out += w32[..., e:ws].sum(axis=-1, dtype=np.float32)[..., None] * self.offset
        if e:
            out += w32[..., :e] @ self._exact[:e]
        if ws < n:
            out += w32[..., ws:n] @ self.recent_rows(ws, n)
        return out

    def decode(self, start=0, stop=None, n_threads=None, window=True):
        """Rows [start, stop) as float32 (a block for the prefill path), as a read of all rows
        sees them; ``window=False``: every row after the sinks from its codes."""
        stop = self.n_rows if stop is None else stop
        if self._plain:
            return self.codec.decode(self.encoded()[start:stop], n_threads)
        if not 0 <= start <= stop <= self.n_rows:
            raise ValueError(f"rows [{start}, {stop}) are outside 0..{self.n_rows}")
        e = self._n_exact
        ws = self.window_start() if window else self.n_rows
        coded_stop = max(min(stop, ws), start)
        coded = self.codec.decode(self.encoded()[max(start - e, 0):max(coded_stop - e, 0)],
                                  n_threads)
        if self.channel_scale is not None:
            coded *= self.channel_scale
        if self.offset is not None:
            coded += self.offset
        parts = ([self._exact[start:min(stop, e)]] if start < e else []) + [coded]
        if stop > ws:
            parts.append(self.recent_rows(max(start, ws), stop))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def bytes_for(self, n_rows):
        """Bytes this stream holds once it has ``n_rows`` rows: codes and side values of the
        coded rows, float32 sinks, the float32 copies of the last ``recent`` rows (besides their
        codes), and the offset and scales from the first append on. (The copies of a long
        append's older rows, held until the next append for its own queries, are not counted.)"""
        exact = min(n_rows, self.sinks)
        window = min(n_rows - exact, self.recent)
        vectors = (self.center + self.normalize) if n_rows else 0
        return ((n_rows - exact) * self.codec.bytes_per_row
                + 4 * self.codec.dim * (exact + window + vectors))

    @property
    def nbytes(self):
        """Bytes of the stored rows (codes and side values; float32 sinks, offset, scales)."""
        return self.bytes_for(self.n_rows)

    @property
    def fixed_bytes(self):
        """What the stream options add to ``n_rows * bytes_per_row`` once the sinks and the
        window are filled: float32 sink rows in place of their codes, the window's float32
        copies, the offset and the channel scales."""
        n = max(self.sinks + self.recent, 1)
        return self.bytes_for(n) - n * self.codec.bytes_per_row

    @property
    def capacity_bytes(self):
        """Bytes allocated."""
        return (self._codes.nbytes + self._side.nbytes + self._exact.nbytes
                + self._recent_rows.nbytes)


def softmax(scores):
    """Softmax over the last axis in float32 (max subtracted; rows of -inf give weight 0)."""
    m = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - m)
    e /= e.sum(axis=-1, keepdims=True)
    return e


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
        (:func:`parse_stream_spec`). A Codec object may stand for a spec (no stream options).
        So may a stream factory, ``make_stream(capacity) -> RowStream`` (any callable that is
        not a Codec), called once per layer and KV head: streams of one's own, e.g. a codec
        under study that keeps per-stream state or carries stream options (research code).
    n_kv_heads : int, default 1
        Row sequences per stream and layer.
    capacity : int, default 0
        Rows to reserve per sequence.
    **codec_options
        Passed to :func:`kvquant.get_codec` (e.g. ``nonfinite="inert"``, ``seed=...``).

    Examples
    --------
    >>> cache = QuantizedKVCache(2, {"k": ("tq4", 64), "v": ("kv8", 64)}, n_kv_heads=3)
    >>> cache.append(0, k=K, v=V)                   # K, V: (n_new, 3, 64)
    >>> out = cache.attend(0, q, scale=0.125)       # q: (9, 64) -> (9, 64)
    """

    def __init__(self, n_layers, streams, n_kv_heads=1, capacity=0, **codec_options):
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
        specs = {}
        for name, value in streams.items():
            try:
                spec, dim = value
            except (TypeError, ValueError):
                raise ValueError(f"stream {name!r}: expected (codec spec, dim), got {value!r}")
            per_layer = list(spec) if isinstance(spec, (list, tuple)) else [spec] * self.n_layers
            if len(per_layer) != self.n_layers:
                raise ValueError(f"stream {name!r}: {len(per_layer)} codec specs for "
                                 f"{self.n_layers} layers")
            specs[name] = per_layer
            self.dims[name] = int(dim)
        codecs = {}   # codecs are immutable: one object per distinct (spec, dim)
        made = set()  # ids of the streams factories returned: each must be a new one
        for layer in range(self.n_layers):
            entry = {}
            for name in self.stream_names:
                spec, stream_options = specs[name][layer], {}
                if callable(spec) and not isinstance(spec, Codec):
                    entry[name] = [self._own_stream(name, spec, capacity, made)
                                   for _ in range(self.n_kv_heads)]
                    continue
                if isinstance(spec, Codec):
                    codec = spec
                else:
                    spec, stream_options = parse_stream_spec(spec)
                    key = (spec, self.dims[name])
                    if key not in codecs:
                        codecs[key] = get_codec(spec, self.dims[name], **codec_options)
                    codec = codecs[key]
                if codec.dim != self.dims[name]:
                    raise ValueError(f"stream {name!r}: codec width {codec.dim} != {self.dims[name]}")
                entry[name] = [RowStream(codec, capacity, **stream_options)
                               for _ in range(self.n_kv_heads)]
            self._layers.append(entry)
        # streams are fixed from here on: their widest recent window once
        self._recent = max(s.recent for entry in self._layers for heads in entry.values()
                           for s in heads)

    def _own_stream(self, name, make_stream, capacity, made):
        """A stream from a factory, checked: a new, empty RowStream of the stream's width."""
        stream = make_stream(capacity)
        if not isinstance(stream, RowStream):
            raise TypeError(f"stream {name!r}: a stream factory must return a RowStream, got "
                            f"{type(stream).__name__}")
        if stream.codec.dim != self.dims[name]:
            raise ValueError(f"stream {name!r}: the factory's codec width {stream.codec.dim} != "
                             f"{self.dims[name]}")
        if len(stream):
            raise ValueError(f"stream {name!r}: the factory returned a stream holding "
                             f"{len(stream)} rows; a new cache starts empty")
        if id(stream) in made:
            raise ValueError(f"stream {name!r}: the factory returned the same RowStream twice; "
                             "each layer and KV head needs its own")
        made.add(id(stream))
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
        """The RowStream of one layer, stream and KV head (a building block)."""
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
        # encode everything first: a bad row leaves the cache untouched
        prepared = {name: [self.stream(layer, name, h).prepare(X[:, h, :], n_threads)
                           for h in range(self.n_kv_heads)] for name, X in arrays.items()}
        for name, per_head in prepared.items():
            for h, item in enumerate(per_head):
                self._layers[layer][name][h].store(item)

    def reserve(self, capacity):
        """Allocate room for ``capacity`` tokens in every sequence."""
        for entry in self._layers:
            for heads in entry.values():
                for s in heads:
                    s.reserve(capacity)

    def truncate(self, length):
        """Keep the first ``length`` tokens of every layer."""
        for entry in self._layers:
            for heads in entry.values():
                for s in heads:
                    s.truncate(min(length, s.n_rows))

    # -- building blocks ---------------------------------------------------------------------
    def scores(self, layer, name, q, head=0, n_threads=None, length=None):
        """``q . x^_t`` over one stream's rows: (m, T) for q of shape (m, dim)."""
        return self.stream(layer, name, head).scores(q, n_threads, length)

    def context(self, layer, name, w, head=0, n_threads=None):
        """``sum_t w_t x^_t`` over one stream's first len(w) rows."""
        return self.stream(layer, name, head).context(w, n_threads)

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
        for h in range(self.n_kv_heads):
            rows = slice(h * group, (h + 1) * group)
            s = self.stream(layer, keys, h).scores(q[rows], n_threads, length)
            s *= scale
            if sliding_window is not None:
                s[:, :max(s.shape[1] - sliding_window, 0)] = -np.inf
            w = softmax(s)
            out[rows] = self.stream(layer, values, h).context(w, n_threads)
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
            Each query sees its last ``sliding_window`` rows only (its own included).

        Returns
        -------
        ndarray of shape (n_q, n_heads, d_values), dtype float32
        """
        Q, group, first, scale = self._prefill_queries(layer, Q, scale, keys, values)
        n_q, n_heads = Q.shape[:2]
        n_threads = resolve_n_threads(n_threads)
        out = np.empty((n_q, n_heads, self.dims[values]), np.float32)
        with _blas_threads(n_threads):
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
                    Qb = Qh[b0:b1].reshape(-1, Q.shape[2])
                    S = np.matmul(Qb, K[:visible].T)
                    S *= scale
                    S = S.reshape(b1 - b0, group, visible)
                    pos = first + np.arange(b0, b1)
                    if sk.recent:
                        lo, band = _window_band(sk, pos, visible)
                        Sx = np.matmul(Qb, sk.recent_rows(lo, visible).T)
                        Sx *= scale
                        Sx = Sx.reshape(b1 - b0, group, visible - lo)
                        np.copyto(S[:, :, lo:], Sx, where=band[:, None, :])
                    future = np.arange(visible)[None, :] > pos[:, None]
                    if sliding_window is not None:
                        future |= np.arange(visible)[None, :] <= pos[:, None] - sliding_window
                    np.copyto(S, np.float32(-np.inf), where=future[:, None, :])
                    P = softmax(S)
                    ctx = P @ V[:visible]
                    if sv.recent:
                        lo, band = _window_band(sv, pos, visible)
                        ctx += (P[:, :, lo:] * band[:, None, :]) @ (
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
        return sum(s.nbytes for entry in self._layers for heads in entry.values() for s in heads)

    @property
    def capacity_bytes(self):
        """Bytes allocated."""
        return sum(s.capacity_bytes for entry in self._layers for heads in entry.values()
                   for s in heads)

    @property
    def bytes_per_token(self):
        """Bytes one token adds to the cache (all layers, streams and heads); float32 sinks and
        offsets of streams with options are a fixed cost on top (see :attr:`nbytes`)."""
        return sum(heads[0].codec.bytes_per_row * self.n_kv_heads
                   for entry in self._layers for heads in entry.values())

    @property
    def fixed_bytes(self):
        """Bytes of the stream options beyond ``bytes_per_token`` per token (sinks, window
        copies, offsets, scales; :attr:`RowStream.fixed_bytes`), every layer, stream and head: a
        cache of T >= sinks + recent tokens holds ``T * bytes_per_token + fixed_bytes``."""
        return sum(s.fixed_bytes for entry in self._layers for heads in entry.values()
                   for s in heads)


def _window_band(stream, pos, visible):
    """For queries at positions ``pos`` reading rows < visible: the first row any of them reads
    from a float32 copy, and the (n_q, visible - lo) mask of the rows each one does."""
    starts = stream.window_starts(pos + 1)
    # a query within the sinks has an empty band (its start is its length): not below the copies
    lo = min(visible, max(int(starts.min()), stream._recent_start))
    rows = np.arange(lo, visible)[None, :]
    return lo, (rows >= starts[:, None]) & (rows <= pos[:, None])


class _blas_threads:
    """Hold BLAS to n threads for a block (threadpoolctl, one controller per process)."""

    _controller = None

    def __init__(self, n_threads):
        self.n_threads = n_threads
        self._limit = None

    def __enter__(self):
        try:
            if _blas_threads._controller is None:
                from threadpoolctl import ThreadpoolController
                _blas_threads._controller = ThreadpoolController()
            self._limit = _blas_threads._controller.limit(limits=self.n_threads, user_api="blas")
        except ImportError:   # pragma: no cover - threadpoolctl is a dependency
            self._limit = None
        return self

    def __exit__(self, *exc):
        if self._limit is not None:
            self._limit.restore_original_limits()
        return False
