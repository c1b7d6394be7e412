"""``CacheRecords``: a cache file's records in memory: token ids and one stream store per
stream (:class:`~kvquant.streams.StreamStore`, its row slots as the store's slots).

The records never encode rows: the file's writer prepares them through the stores
(:meth:`CacheRecords.prepare`) and extends the records with what they returned. What the records
add to the stores is the file's record layout: the records of a stream's sink tokens hold a
zero row's codes (placeholders, never read; kept as loaded).
"""
import numpy as np

from kvquant.streams.options import StreamOptions
from kvquant.streams.row_stream import RowStream
from kvquant.streams.store import StreamStore


class CacheRecords:
    """The records of a cache, in memory: token ids and, per stream, codes and side values.

    A stream with stream options (``"polar5@center,sinks=1"``) also holds its state: the offset
    and channel scales of every row slot (set by the first append) and the float32 rows of the
    first ``sinks`` tokens (their records hold a zero row's codes as placeholders). Read such a
    stream with :meth:`decode` or :meth:`row_stream`; its codes alone are not its rows.

    Arrays returned are read-only views valid until the next append or truncate.

    Attributes
    ----------
    tokens : ndarray of shape (n,), dtype int32
    """

    def __init__(self, streams, codecs, options=None, statistics=None):
        """``statistics``: by stream name, the calibrated ``(offsets, channel_scales)`` (each
        (rows, dim) or None) of a stream whose options say calibrated."""
        self._streams = list(streams)
        options, statistics = options or {}, statistics or {}
        self._stores = {s.name: StreamStore(codecs[s.name],
                                            options.get(s.name, StreamOptions()), s.rows, 0,
                                            *statistics.get(s.name, (None, None)))
                        for s in self._streams}
        # codes and side values of the sink tokens' records: (m, rows, code_bytes / n_side)
        self._placeholders = {s.name: (np.zeros((0, s.rows, codecs[s.name].code_bytes), np.uint8),
                                       np.zeros((0, s.rows, codecs[s.name].n_side), np.float32))
                              for s in self._streams}
        self._n = 0
        self._tokens = np.zeros(0, np.int32)

    def __len__(self):
        return self._n

    def __repr__(self):
        return f"<CacheRecords {self._n} tokens, streams {[s.name for s in self._streams]}>"

    @property
    def stream_names(self):
        return [s.name for s in self._streams]

    @staticmethod
    def _ro(a):
        if a is None:
            return None
        v = a.view()
        v.flags.writeable = False
        return v

    @property
    def tokens(self):
        return self._ro(self._tokens[:self._n])

    def store(self, name):
        """The :class:`~kvquant.streams.StreamStore` of stream ``name`` (read it, do not write
        it: the file writes through :meth:`extend`)."""
        return self._stores[name]

    def _record_codes(self, name, start, stop):
        """(codes, side) of records [start, stop) of stream ``name``, (k, rows, ...): the sink
        tokens' placeholders, then the store's coded rows."""
        store = self._stores[name]
        e = store.n_sinks
        if start >= e:
            return store.coded_rows(start - e, stop - e)
        pc, ps = self._placeholders[name]
        if stop <= e:
            return pc[start:stop], ps[start:stop]
        cc, cs = store.coded_rows(0, stop - e)
        return np.concatenate([pc[start:e], cc]), np.concatenate([ps[start:e], cs])

    def codes(self, name):
        """Codes of stream ``name``, shape (n, rows, code_bytes), uint8, as stored: for a stream
        with stream options, codes of the centered and scaled rows, and a zero row's codes for
        the sink tokens (see :meth:`decode`)."""
        return self._ro(self._record_codes(name, 0, self._n)[0])

    def side(self, name):
        """Side values of stream ``name``, shape (n, rows, n_side), float32, as stored."""
        return self._ro(self._record_codes(name, 0, self._n)[1])

    def options(self, name):
        """The :class:`~kvquant.streams.StreamOptions` of stream ``name``."""
        return self._stores[name].options

    def offset(self, name):
        """Offset of every row slot, (rows, dim) float32, or None (not centered, or no rows)."""
        return self._ro(self._stores[name].offsets)

    def channel_scale(self, name):
        """Channel scales of every row slot, (rows, dim) float32, or None."""
        return self._ro(self._stores[name].channel_scales)

    def sink_rows(self, name):
        """The float32 rows of the first min(n, sinks) tokens, (n_exact, rows, dim)."""
        return self._ro(self._stores[name].sink_rows())

    def window_start(self, name, length=None):
        """First row that a query reading the first ``length`` rows (default all) reads from a
        float32 copy (``recent=W`` streams; ``length`` for others)."""
        n = self._n if length is None else length
        return n - len(self._stores[name].window_copies(n))

    def window_rows(self, name, length=None):
        """The float32 copies a query reading the first ``length`` rows takes from its window,
        (length - window_start, rows, dim)."""
        return self._ro(self._stores[name].window_copies(length))

    def _check_plain(self, name, what):
        store = self._stores[name]
        if not store.plain:
            raise ValueError(
                f"stream {name!r} is {store.spec!r}: its codes hold rows after an offset, scales "
                f"or float32 sinks, so {what} would not be its rows; read it with "
                f"records.decode({name!r}) or records.row_stream({name!r}, row)")

    def rows(self, name, row):
        """EncodedRows of row slot ``row`` (e.g. a layer) of stream ``name``, one per token
        (streams without stream options)."""
        self._check_plain(name, "EncodedRows of its codes")
        store = self._stores[name]
        return store.codec.encoded_rows(np.array(store.encoded(row).codes),
                                        np.array(store.encoded(row).side))

    def stream(self, name):
        """A list with one EncodedRows per row slot of stream ``name``."""
        return [self.rows(name, j) for j in range(self._stores[name].slots)]

    def row_stream(self, name, row):
        """Row slot ``row`` of stream ``name`` as a :class:`~kvquant.streams.RowStream` (a
        copy), with its offset, scales and sinks: attention reads it through the consumers."""
        return RowStream.of(self._stores[name].slot_store(row), 0)

    def floats(self, name):
        """Rows of an f32 stream as float32 of shape (n, rows, dim)."""
        store = self._stores[name]
        if store.codec.spec != "f32":
            raise ValueError(f"stream {name!r} is {store.codec.spec!r}, not f32: decode it with "
                             "its codec")
        self._check_plain(name, "its f32 codes")
        return self._ro(np.ascontiguousarray(store.coded_rows()[0]).view("<f4"))

    @property
    def L(self):
        """MLA latent rows: one EncodedRows per layer."""
        return self.stream("L")

    @property
    def R(self):
        """MLA rope rows: one EncodedRows per layer."""
        return self.stream("R")

    @property
    def index(self):
        """Indexer rows, float32 of shape (n, n_index_layers, index_hd), or None."""
        return self.floats("index") if "index" in self._stores else None

    def decode(self, name, n_threads=None):
        """Rows of stream ``name`` as the model sees them, float32 of shape (n, rows, dim):
        decoded (then scaled and offset, for a stream with those options), sinks exact."""
        store = self._stores[name]
        if self._n == 0:
            return np.zeros((0, store.slots, store.codec.dim), np.float32)
        return np.stack([store.decode(j, n_threads=n_threads) for j in range(store.slots)],
                        axis=1)

    # -- writing (the CacheFile's business) ---------------------------------------------------
    def prepare(self, name, X, n_threads=None, codec=None):
        """:class:`~kvquant.streams.PreparedRows` of float rows ``X`` (n, rows, dim) for stream
        ``name`` (nothing changes; a bad row raises)."""
        return self._stores[name].prepare(X, n_threads, where=f"stream {name!r} row slot "
                                          "{slot}: ", codec=codec)

    def prepare_encoded(self, name, codes, side):
        """:class:`~kvquant.streams.PreparedRows` of rows encoded elsewhere (n, rows, ...)."""
        return self._stores[name].prepare_encoded(codes, side)

    def encode_slot(self, name, X, n_threads=None):
        """EncodedRows of float rows (n, dim) given for one row slot of a plain stream (rows
        given slot by slot), encoded through a store of the stream's codec."""
        store = self._stores[name]
        prepared = StreamStore(store.codec).prepare(X, n_threads)
        return store.codec.encoded_rows(prepared.codes[:, 0], prepared.side[:, 0])

    def placeholder(self, name, n, codec=None):
        """(codes, side) of the records of ``n`` sink tokens of stream ``name``: a zero row's
        codes (valid for every codec, never read)."""
        return self._stores[name].zero_codes(n, codec)

    def extend(self, tokens, prepared, placeholders=None):
        """Append records: ``tokens`` and, per stream, the PreparedRows of their rows (every
        stream). ``placeholders`` (per stream with sinks) are the records' codes of the new
        sink tokens; a zero row's codes by default."""
        k = len(tokens)
        if k == 0:
            return
        for name, item in prepared.items():
            held = item.sinks.shape[0]
            if held:
                pc, ps = (placeholders or {}).get(name) or self.placeholder(name, held)
                old_c, old_s = self._placeholders[name]
                e = self._stores[name].n_sinks
                self._placeholders[name] = (np.concatenate([old_c[:e], pc]),
                                            np.concatenate([old_s[:e], ps]))
            self._stores[name].store(item)
        need = self._n + k
        if need > len(self._tokens):
            grown = np.zeros(max(need, 2 * len(self._tokens), 16), np.int32)
            grown[:self._n] = self._tokens[:self._n]
            self._tokens = grown
        self._tokens[self._n:need] = tokens
        self._n = need

    def load(self, tokens, codes, side, states=None, windows=None):
        """Records read from a file (replacing any held): ``codes``/``side`` per stream of every
        token (placeholders included), ``states`` per stream with options as (offsets, channel
        scales, sink rows), ``windows`` per stream with a window as the float32 copies of its
        last rows."""
        k = len(tokens)
        for s in self._streams:
            name, store = s.name, self._stores[s.name]
            offsets, scales, sinks = (states or {}).get(name, (None, None, None))
            if store.options.calibrated:   # the running ones (the header's digest matched)
                offsets, scales = store.offsets, store.channel_scales
            e = min(k, store.sinks)
            window = None
            if store.recent:
                window = (windows or {}).get(name)
                if window is None:
                    window = np.zeros((0, s.rows, s.dim), np.float32)
            self._stores[name] = StreamStore.from_state(
                store.codec, store.options, codes[name][e:k], side[name][e:k], offsets, scales,
                None if sinks is None else sinks[:e], window)
            self._placeholders[name] = (np.array(codes[name][:e]), np.array(side[name][:e]))
        self._tokens = np.array(tokens, np.int32)
        self._n = k

    def truncate(self, n):
        """Keep the first ``n`` records (stores as :meth:`StreamStore.truncate`)."""
        self._n = min(self._n, n)
        for store in self._stores.values():
            store.truncate(self._n)

    def slice(self, start, stop):
        """(tokens, codes, side) of records start..stop-1, the file's record layout."""
        codes, side = {}, {}
        for name in self._stores:
            codes[name], side[name] = self._record_codes(name, start, stop)
        return self._tokens[start:stop], codes, side
