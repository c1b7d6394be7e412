"""``RowStream``: one slot of a :class:`~kvquant.streams.store.StreamStore` (a KV head of the
cache, or a stream of one's own), the per-sequence face of a store."""
import numpy as np

from kvquant.streams.options import StreamOptions
from kvquant.streams.store import StreamStore

class RowStream:
    """One slot of a :class:`StreamStore`: a growing sequence of rows under one codec.

    ``RowStream(codec, capacity, center=..., sinks=..., normalize=..., recent=...)`` is a
    stream of its own (a store of one slot); :meth:`of` views one slot of a store (as the
    cache hands out its KV heads). Writing (append, truncate, reserve) needs a stream of its
    own: a view's store is written through its owner.

    Parameters
    ----------
    codec : Codec
    capacity : int
        Rows to allocate up front.
    center, normalize, sinks, recent, calibrated
        The stream options (:func:`kvquant.streams.options.parse_stream_spec`).
    offset, channel_scale : ndarray of shape (dim,), optional
        Calibrated statistics, exactly when ``calibrated`` (and asked for).
    """

    def __init__(self, codec, capacity=0, center=False, sinks=0, normalize=False, recent=0,
                 calibrated=False, offset=None, channel_scale=None):
        one = (lambda v: None if v is None else np.asarray(v)[None])
        self.store = StreamStore(codec, StreamOptions(center, normalize, sinks, recent,
                                                      calibrated), 1, capacity,
                                 one(offset), one(channel_scale))
        self.slot = 0

    @classmethod
    def of(cls, store, slot):
        """A view of slot ``slot`` of ``store``."""
        store._check_slot(slot)
        self = object.__new__(cls)
        self.store, self.slot = store, int(slot)
        return self

    @classmethod
    def from_state(cls, codec, options, codes, side, offset=None, channel_scale=None,
                   exact=None, recent_rows=None):
        """A stream of its own holding rows stored elsewhere: :meth:`StreamStore.from_state`
        for one slot, each argument without its slot axis ((n_coded, code_bytes), (dim,),
        (n_sinks, dim), (m, dim))."""
        codes, side = codec.check_encoded(codec.encoded_rows(codes, side))
        if recent_rows is not None and np.ndim(recent_rows) != 2:
            raise ValueError(f"recent_rows must be given exactly with a recent window (options "
                             f"{options.as_dict()}), as copies of at most the {codes.shape[0]} "
                             f"coded rows of width {codec.dim}, got {np.shape(recent_rows)}")
        if exact is not None and np.ndim(exact) != 2:
            raise ValueError(f"sink rows must have shape (n_sinks, {codec.dim}), got "
                             f"{np.shape(exact)}")
        for name, vec in (("offset", offset), ("channel_scale", channel_scale)):
            if vec is not None and np.shape(vec) != (codec.dim,):
                raise ValueError(f"{name} must have shape ({codec.dim},), got {np.shape(vec)}")
        one = (lambda a: None if a is None else np.asarray(a)[:, None])
        store = StreamStore.from_state(
            codec, options, codes[:, None], side[:, None],
            None if offset is None else np.asarray(offset)[None],
            None if channel_scale is None else np.asarray(channel_scale)[None],
            one(exact), one(recent_rows))
        return cls.of(store, 0)

    # -- what it is --------------------------------------------------------------------------
    codec = property(lambda self: self.store.codec)
    options = property(lambda self: self.store.options)
    spec = property(lambda self: self.store.spec)
    center = property(lambda self: self.store.options.center)
    normalize = property(lambda self: self.store.options.normalize)
    sinks = property(lambda self: self.store.sinks)
    recent = property(lambda self: self.store.recent)
    n_rows = property(lambda self: self.store.n_rows)
    capacity = property(lambda self: self.store.capacity)

    @property
    def offset(self):
        """This slot's offset, (dim,) float32, or None."""
        o = self.store.offsets
        return None if o is None else o[self.slot]

    @property
    def channel_scale(self):
        """This slot's channel scales, (dim,) float32, or None."""
        s = self.store.channel_scales
        return None if s is None else s[self.slot]

    def __len__(self):
        return self.store.n_rows

    def __repr__(self):
        return f"<RowStream {self.spec!r} dim={self.codec.dim} rows={self.n_rows}>"

    # -- writing (a stream of its own) -------------------------------------------------------
    def _own(self, what):
        if self.store.slots != 1:
            raise ValueError(f"{what}: this RowStream is slot {self.slot} of a store of "
                             f"{self.store.slots} slots; write through the store (its cache)")
        return self.store

    def reserve(self, capacity):
        """Make room for ``capacity`` rows in all (never shrinks)."""
        self._own("reserve").reserve(capacity)

    def prepare(self, rows, n_threads=None):
        """Encode new rows (n_new, dim) without storing them: :class:`PreparedRows`."""
        return self._own("prepare").prepare(rows, n_threads)

    def store_prepared(self, prepared):
        """Store what :meth:`prepare` returned."""
        self._own("store").store(prepared)

    def append(self, rows, n_threads=None):
        """Quantize rows of shape (n_new, dim) and store them."""
        store = self._own("append")
        store.store(store.prepare(rows, n_threads))

    def append_encoded(self, enc):
        """Store rows already encoded by this stream's codec (e.g. read from a file)."""
        store = self._own("append_encoded")
        codes, side = store.codec.check_encoded(enc)
        store.store(store.prepare_encoded(codes[:, None], side[:, None]))

    def truncate(self, n_rows):
        """Keep the first ``n_rows`` rows (truncating to 0 also forgets offset and scales)."""
        self._own("truncate").truncate(n_rows)

    # -- reading -----------------------------------------------------------------------------
    def encoded(self, length=None):
        """The coded rows among the first ``length`` (all by default) as EncodedRows: a view.

        For a stream with sinks these are the rows after the sinks (the sinks are float32)."""
        return self.store.encoded(self.slot, length)

    def window_start(self, length=None):
        """:meth:`StreamStore.window_start`."""
        return self.store.window_start(length)

    def window_starts(self, lengths):
        """:meth:`StreamStore.window_starts`."""
        return self.store.window_starts(lengths)

    @property
    def recent_start(self):
        return self.store.recent_start

    def recent_rows(self, start, stop):
        """The float32 copies of rows [start, stop), (stop - start, dim)."""
        return self.store.recent_rows(start, stop, self.slot)

    def scores(self, q, n_threads=None, length=None, start=0):
        """``q . x^_t`` for the stored rows start <= t < length; q of shape (dim,) or (m, dim)."""
        return self.store.scores(q, self.slot, n_threads, length, start)

    def context(self, w, n_threads=None, start=0):
        """``sum_t w_t x^_t`` over rows start .. start + len(w) - 1; w of shape (T,) or (m, T)."""
        return self.store.context(w, self.slot, n_threads, start)

    def decode(self, start=0, stop=None, n_threads=None, window=True):
        """Rows [start, stop) as float32 (a block for the prefill path), as a read of all rows
        sees them; ``window=False``: every row after the sinks from its codes."""
        return self.store.decode(self.slot, start, stop, n_threads, window)

    # -- sizes (of one slot) -----------------------------------------------------------------
    def bytes_for(self, n_rows):
        """Bytes this slot holds once it has ``n_rows`` rows (:meth:`StreamStore.bytes_for`)."""
        return self.store.bytes_for(n_rows) // self.store.slots

    @property
    def nbytes(self):
        return self.bytes_for(self.n_rows)

    @property
    def fixed_bytes(self):
        """What the stream options add to ``n_rows * bytes_per_row`` once the sinks and the
        window are filled."""
        return self.store.fixed_bytes // self.store.slots

    @property
    def capacity_bytes(self):
        return self.store.capacity_bytes // self.store.slots
