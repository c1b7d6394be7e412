"""``StreamStore``: the rows of one stream, written once, for the cache and the cache file alike.

A store holds a sequence of tokens and, per token, one row in each of its *slots* (the KV heads
of one layer in the cache, the row slots of a file's stream), under one codec and one set of
:class:`~kvquant.streams.options.StreamOptions`:

* the first ``min(n_rows, sinks)`` rows of every slot in float32 (sinks);
* the codes and side values of the rows after them, as ``(x - offset) / channel_scale`` (the
  offset and the scales of each slot taken from the first append, where asked for);
* with ``recent=W``, float32 copies of the last W rows and, until the next append, of the rows
  of the last append (:meth:`StreamStore.window_start`).

Writing is two steps: :meth:`StreamStore.prepare` encodes rows and returns
:class:`PreparedRows` without changing the store (a bad row raises and leaves everything as it
was), :meth:`StreamStore.store` keeps them. Reads take a slot: :meth:`StreamStore.scores`,
:meth:`StreamStore.context` and :meth:`StreamStore.decode` give the rows as the model sees them.
:class:`~kvquant.streams.row_stream.RowStream` is one slot of a store (a store of one slot of its
own, or a view).
"""
from dataclasses import dataclass

import numpy as np

from kvquant.codecs import Codec
from kvquant.streams.options import StreamOptions, split_rows, window_start

_MIN_CAPACITY = 16


@dataclass(frozen=True)
class PreparedRows:
    """Rows encoded for one append, not stored yet (:meth:`StreamStore.prepare`).

    Attributes
    ----------
    codes : ndarray of shape (n_coded, slots, code_bytes), uint8
    side : ndarray of shape (n_coded, slots, n_side), float32
        The coded rows of the append (after the sinks it fills).
    sinks : ndarray of shape (n_sinks, slots, dim), float32
        The rows of the append kept in float32 (the first tokens of a stream with sinks).
    offsets, channel_scales : ndarray of shape (slots, dim), float32, or None
        The store's offsets and scales after this append (the first append sets them).
    window : ndarray of shape (n_coded, slots, dim), float32, or None
        With a recent window: float32 copies of the coded rows, as given (NaN/inf: zero rows).
    """

    codes: np.ndarray
    side: np.ndarray
    sinks: np.ndarray
    offsets: np.ndarray = None
    channel_scales: np.ndarray = None
    window: np.ndarray = None

    @property
    def n_rows(self):
        """Tokens in this append."""
        return self.sinks.shape[0] + self.codes.shape[0]


class StreamStore:
    """The rows of one stream: one codec, stream options, ``slots`` rows per token.

    Parameters
    ----------
    codec : Codec
    options : StreamOptions, default none
    slots : int, default 1
        Rows per token (KV heads of a layer, row slots of a file's stream).
    capacity : int, default 0
        Coded rows to allocate per slot up front.
    offsets, channel_scales : ndarray of shape (slots, dim), float32, optional
        Calibrated statistics: given exactly when the options say ``calibrated`` (and ask for
        them); the store then uses them from its first row on and keeps them through
        truncation.

    Notes
    -----
    Codes are held slot-major, (slots, capacity, code_bytes): a slot's coded rows are one
    C-contiguous block that the consumers read without a copy.
    """

    def __init__(self, codec, options=None, slots=1, capacity=0, offsets=None,
                 channel_scales=None):
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a Codec (use kvquant.get_codec), got {codec!r}")
        options = StreamOptions() if options is None else options
        if not isinstance(options, StreamOptions):
            raise TypeError(f"options must be StreamOptions, got {options!r}")
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        self.codec = codec
        self.options = options
        self.slots = int(slots)
        dim = codec.dim
        self.n_rows = 0
        self._n_exact = 0        # rows held in float32 (the first min(n_rows, sinks))
        self._last_append = 0    # rows before the last append (reads of fewer rows: refused)
        # (slots, dim) float32 once a centered / normalized stream got rows (from the start
        # when calibrated)
        self.offsets, self.channel_scales = _calibrated_vectors(
            options, self.slots, dim, offsets, channel_scales)
        self._exact = np.empty((self.slots, 0, dim), np.float32)   # grows up to `sinks` rows
        self._recent_rows = np.empty((self.slots, 0, dim), np.float32)  # [_recent_start, n_rows)
        self._recent_start = 0
        self._codes = np.empty((self.slots, 0, codec.code_bytes), np.uint8)
        self._side = np.empty((self.slots, 0, codec.n_side), np.float32)
        self.reserve(capacity)

    # -- what it is --------------------------------------------------------------------------
    @property
    def sinks(self):
        return self.options.sinks

    @property
    def recent(self):
        return self.options.recent

    @property
    def plain(self):
        """True when the store only encodes its rows (no offset, scales, sinks or window)."""
        return self.options.plain

    @property
    def spec(self):
        """The stream spec: the codec's spec and the stream options."""
        return self.options.stream_spec(self.codec.spec)

    def __len__(self):
        return self.n_rows

    def __repr__(self):
        return (f"<StreamStore {self.spec!r} dim={self.codec.dim} slots={self.slots} "
                f"rows={self.n_rows}>")

    @property
    def n_sinks(self):
        """Rows held in float32 as sinks: min(n_rows, sinks)."""
        return self._n_exact

    @property
    def n_coded(self):
        """Rows held as codes (after the sinks)."""
        return self.n_rows - self._n_exact

    @property
    def capacity(self):
        """Coded rows allocated per slot."""
        return self._codes.shape[1]

    @property
    def recent_start(self):
        """First row whose float32 copy is held (``recent=W``)."""
        return self._recent_start

    def reserve(self, capacity):
        """Make room for ``capacity`` coded rows per slot (never shrinks)."""
        capacity = int(capacity)
        if capacity <= self.capacity:
            return
        codes = np.empty((self.slots, capacity, self.codec.code_bytes), np.uint8)
        side = np.empty((self.slots, capacity, self.codec.n_side), np.float32)
        k = self.n_coded
        codes[:, :k] = self._codes[:, :k]
        side[:, :k] = self._side[:, :k]
        self._codes, self._side = codes, side

    # -- state -------------------------------------------------------------------------------
    def state(self):
        """Everything the store holds, as views (:class:`StreamState`)."""
        return StreamState(
            self.codec, self.options, *self.coded_rows(), self.offsets, self.channel_scales,
            self.sink_rows(), self._recent_rows.transpose(1, 0, 2) if self.recent else None)

    @classmethod
    def from_state(cls, codec, options, codes, side, offsets=None, channel_scales=None,
                   sinks=None, recent_rows=None):
        """A store holding rows stored elsewhere (a cache file's records), ready for reads.

        Parameters
        ----------
        codec : Codec
        options : StreamOptions
        codes, side : ndarray of shape (n_coded, slots, code_bytes) uint8 / (n_coded, slots,
            n_side) float32
            The coded rows (after the sinks), as this codec encoded them.
        offsets, channel_scales : ndarray of shape (slots, dim), float32, or None
            Given exactly when the options ask for them and the store holds rows.
        sinks : ndarray of shape (n_sinks, slots, dim), float32, or None
            The float32 sink rows; ``n_sinks == options.sinks`` when there are coded rows.
        recent_rows : ndarray of shape (m, slots, dim), float32, or None
            With ``options.recent``: the float32 copies of the last m coded rows.
        """
        codes, side = np.asarray(codes), np.asarray(side)
        if codes.ndim != 3 or side.ndim != 3 or codes.shape[:2] != side.shape[:2]:
            raise ValueError(f"codes and side values must be (n_coded, slots, ...) arrays of "
                             f"the same rows, got {codes.shape} and {side.shape}")
        n_coded, slots = codes.shape[:2]
        dim = codec.dim
        checked = codec.check_encoded(codec.encoded_rows(
            codes.reshape(n_coded * slots, codes.shape[2]),
            side.reshape(n_coded * slots, side.shape[2])))
        if (recent_rows is not None) != bool(options.recent) or (
                recent_rows is not None and (np.ndim(recent_rows) != 3
                                             or np.shape(recent_rows)[1:] != (slots, dim)
                                             or len(recent_rows) > n_coded)):
            raise ValueError(f"recent_rows must be given exactly with a recent window (options "
                             f"{options.as_dict()}), as copies of at most the {n_coded} "
                             f"coded rows of {slots} slot(s) of width {dim}, got "
                             f"{np.shape(recent_rows)}")
        sinks = (np.zeros((0, slots, dim), np.float32) if sinks is None
                 else np.asarray(sinks, np.float32))
        n_exact = sinks.shape[0]
        if sinks.shape[1:] != (slots, dim) or n_exact > options.sinks or (
                n_coded and n_exact != options.sinks):
            raise ValueError(f"{options.sinks} sink row(s) of width {dim} come before any coded "
                             f"row: got {sinks.shape} sink rows and {n_coded} coded rows")
        has_rows = n_coded + n_exact > 0 or options.calibrated
        for name, vec, asked in (("offset", offsets, options.center),
                                 ("channel_scale", channel_scales, options.normalize)):
            if (vec is not None) != (asked and has_rows):
                raise ValueError(f"{name} must be given exactly when the stream "
                                 f"{'asks for it' if asked else 'does not ask for it'} and holds "
                                 f"rows (options {options.as_dict()}, {n_coded + n_exact} rows)")
            if vec is not None and np.shape(vec) != (slots, dim):
                raise ValueError(f"{name} must have shape ({slots}, {dim}), got "
                                 f"{np.shape(vec)}")
        if options.calibrated:
            self = cls(codec, options, slots, n_coded, offsets, channel_scales)
        else:
            self = cls(codec, options, slots, n_coded)
            self.offsets = None if offsets is None else np.array(offsets, np.float32)
            self.channel_scales = (None if channel_scales is None
                                   else np.array(channel_scales, np.float32))
        self._hold_exact(n_exact)
        self._exact[:, :n_exact] = sinks.transpose(1, 0, 2)
        self._n_exact = self.n_rows = n_exact
        self._put_codes(checked[0].reshape(n_coded, slots, codec.code_bytes),
                        checked[1].reshape(n_coded, slots, codec.n_side))
        if recent_rows is not None:
            self._recent_rows = np.array(np.asarray(recent_rows).transpose(1, 0, 2), np.float32)
        self._recent_start = self.n_rows - self._recent_rows.shape[1]
        self._last_append = self.n_rows
        return self

    def slot_store(self, slot):
        """A copy of slot ``slot`` as a store of one slot (its own arrays, its state)."""
        self._check_slot(slot)
        s = slice(slot, slot + 1)
        return StreamStore.from_state(
            self.codec, self.options, *(a[:, s] for a in self.coded_rows()),
            offsets=None if self.offsets is None else self.offsets[s],
            channel_scales=None if self.channel_scales is None else self.channel_scales[s],
            sinks=self.sink_rows()[:, s],
            recent_rows=self._recent_rows[s].transpose(1, 0, 2) if self.recent else None)

    # -- writing -----------------------------------------------------------------------------
    def _as_slot_rows(self, rows):
        X = np.asarray(rows)
        if X.ndim == 2 and self.slots == 1:
            X = X[:, None, :]
        if X.ndim != 3 or X.shape[1:] != (self.slots, self.codec.dim):
            raise ValueError(f"rows must have shape (n_new, {self.slots}, {self.codec.dim})"
                             + (f" or (n_new, {self.codec.dim})" if self.slots == 1 else "")
                             + f", got {X.shape}")
        return X

    def prepare(self, rows, n_threads=None, where="", codec=None):
        """Encode new rows without storing them (a bad row raises and changes nothing).

        Parameters
        ----------
        rows : array-like of shape (n_new, slots, dim), or (n_new, dim) with one slot
        n_threads : int or None
        where : str
            Prefix of a sink row's error; ``{slot}`` stands for the slot.
        codec : Codec, optional
            Another object of this store's codec (e.g. one with ``nonfinite="inert"``).

        Returns
        -------
        PreparedRows
            For :meth:`store`. One encode call for every slot's rows.
        """
        codec = self.codec if codec is None else codec
        if codec.spec != self.codec.spec or codec.dim != self.codec.dim:
            raise ValueError(f"codec {codec.spec!r} (dim {codec.dim}) is not this store's "
                             f"{self.codec.spec!r} (dim {self.codec.dim})")
        X = self._as_slot_rows(rows)
        n, slots, dim = X.shape
        if self.plain:
            enc = codec.encode(X.reshape(n * slots, dim), n_threads)
            return PreparedRows(enc.codes.reshape(n, slots, codec.code_bytes),
                                enc.side.reshape(n, slots, codec.n_side),
                                np.zeros((0, slots, dim), np.float32))
        parts = []
        for j in range(slots):
            Xj = codec.as_rows(X[:, j])
            parts.append((Xj,) + split_rows(
                Xj, self.options, None if self.offsets is None else self.offsets[j],
                None if self.channel_scales is None else self.channel_scales[j], self.n_rows,
                codec.nonfinite, where=where.format(slot=j)))
        take = parts[0][3].shape[0]
        rest = np.stack([p[4] for p in parts], axis=1)
        enc = codec.encode(rest.reshape((n - take) * slots, dim), n_threads)
        window = None
        if self.recent:   # float32 copies of the coded rows, as given (NaN/inf rows: inert zero)
            window = np.stack([p[0][take:] for p in parts], axis=1)
            bad = ~np.isfinite(window).all(axis=2)
            if bad.any():
                window = np.where(bad[..., None], np.float32(0), window)
        return PreparedRows(
            enc.codes.reshape(n - take, slots, codec.code_bytes),
            enc.side.reshape(n - take, slots, codec.n_side),
            np.stack([p[3] for p in parts], axis=1),
            None if not self.options.center else np.stack([p[1] for p in parts]),
            None if not self.options.normalize else np.stack([p[2] for p in parts]),
            window)

    def prepare_encoded(self, codes, side):
        """:class:`PreparedRows` of rows already encoded by this store's codec, (n, slots,
        code_bytes) / (n, slots, n_side) (a plain store only: encoded rows carry no offset,
        scales or float32 sinks)."""
        if not self.plain:
            raise ValueError(
                f"stream {self.spec!r} centers or normalizes its rows or keeps sinks or a "
                "window in float32: rows encoded elsewhere carry no offset, scales or exact "
                "rows; append the float rows instead")
        codes, side = np.asarray(codes), np.asarray(side)
        n = codes.shape[0]
        checked = self.codec.check_encoded(self.codec.encoded_rows(
            codes.reshape(n * self.slots, codes.shape[-1]),
            side.reshape(n * self.slots, side.shape[-1])))
        return PreparedRows(checked[0].reshape(n, self.slots, self.codec.code_bytes),
                            checked[1].reshape(n, self.slots, self.codec.n_side),
                            np.zeros((0, self.slots, self.codec.dim), np.float32))

    def zero_codes(self, n, codec=None):
        """(codes, side) of a zero row for ``n`` tokens, (n, slots, ...) read-only broadcasts:
        valid rows of every codec (a file's records of sink tokens hold them)."""
        codec = self.codec if codec is None else codec
        zero = codec.encode(np.zeros((1, codec.dim), np.float32))
        return (np.broadcast_to(zero.codes, (n, self.slots, codec.code_bytes)),
                np.broadcast_to(zero.side, (n, self.slots, codec.n_side)))

    def store(self, prepared):
        """Keep what :meth:`prepare` (or :meth:`prepare_encoded`) returned."""
        if not self.plain and not self.options.calibrated:
            self.offsets, self.channel_scales = prepared.offsets, prepared.channel_scales
        self._last_append = self.n_rows
        k = prepared.sinks.shape[0]
        if k:
            self._hold_exact(self._n_exact + k)
            self._exact[:, self._n_exact:self._n_exact + k] = prepared.sinks.transpose(1, 0, 2)
            self._n_exact += k
            self.n_rows += k
        before = self.n_rows
        self._put_codes(prepared.codes, prepared.side)
        if self.recent:
            self._keep_recent(before, prepared.window)

    def append(self, rows, n_threads=None):
        """Encode rows of shape (n_new, slots, dim) and store them."""
        self.store(self.prepare(rows, n_threads))

    def _put_codes(self, codes, side):
        """Append coded rows (k, slots, ...), already checked."""
        k = codes.shape[0]
        n_coded = self.n_coded
        if n_coded + k > self.capacity:
            self.reserve(max(n_coded + k, 2 * self.capacity, _MIN_CAPACITY))
        self._codes[:, n_coded:n_coded + k] = codes.transpose(1, 0, 2)
        self._side[:, n_coded:n_coded + k] = side.transpose(1, 0, 2)
        self.n_rows += k

    def _keep_recent(self, before, window):
        """After appending ``window`` (float32 copies of rows [before, n_rows)): hold the copies
        of the last ``recent`` rows before this append and of all rows of this append."""
        start = int(window_start(before, self.recent, self._recent_start, self.sinks))
        held = self._recent_rows[:, start - self._recent_start:before - self._recent_start]
        self._recent_rows = np.concatenate(
            [held, np.asarray(window, np.float32).transpose(1, 0, 2)], axis=1)
        self._recent_start = self.n_rows - self._recent_rows.shape[1]

    def _hold_exact(self, n):
        """Room for n float32 sink rows (grown geometrically, never past ``sinks``)."""
        if n > self._exact.shape[1]:
            grown = np.empty((self.slots, min(self.sinks, max(n, 2 * self._exact.shape[1])),
                              self.codec.dim), np.float32)
            grown[:, :self._n_exact] = self._exact[:, :self._n_exact]
            self._exact = grown

    def truncate(self, n_rows):
        """Keep the first ``n_rows`` rows (truncating to 0 also forgets offsets and scales)."""
        if not 0 <= n_rows <= self.n_rows:
            raise ValueError(f"cannot truncate {self.n_rows} rows to {n_rows}")
        self.n_rows = int(n_rows)
        self._n_exact = min(self._n_exact, self.n_rows)
        # the copies kept: those the window of the new length needs, where still held (so that
        # dropping the rows of an append gives back the stream before it); a row whose copy is
        # gone reads from its codes
        keep = int(window_start(self.n_rows, self.recent, self._recent_start, self.sinks))
        self._recent_rows = np.array(self._recent_rows[:, keep - self._recent_start:
                                                       self.n_rows - self._recent_start])
        self._recent_start = keep
        self._last_append = min(self._last_append, self.n_rows)
        if self.n_rows == 0:
            if not self.options.calibrated:
                self.offsets = self.channel_scales = None
            self._recent_start = 0

    # -- what is held ------------------------------------------------------------------------
    def coded_rows(self, start=0, stop=None):
        """(codes, side) of coded rows [start, stop) (indices among the coded rows, after the
        sinks), token-major views (k, slots, code_bytes) / (k, slots, n_side)."""
        stop = self.n_coded if stop is None else stop
        return (self._codes[:, start:stop].transpose(1, 0, 2),
                self._side[:, start:stop].transpose(1, 0, 2))

    def sink_rows(self):
        """The float32 sink rows, (n_sinks, slots, dim) view."""
        return self._exact[:, :self._n_exact].transpose(1, 0, 2)

    def window_copies(self, length=None):
        """The float32 copies that a read of the first ``length`` rows (default all) takes from
        its window, (length - window_start, slots, dim) view; empty where none are held."""
        n = self.n_rows if length is None else length
        start = self._recent_start
        ws = int(window_start(n, self.recent, start, self.sinks))
        if ws >= n:
            return self._recent_rows[:, :0].transpose(1, 0, 2)
        return self._recent_rows[:, ws - start:n - start].transpose(1, 0, 2)

    # -- reading one slot --------------------------------------------------------------------
    def _check_slot(self, slot):
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} is outside 0..{self.slots - 1}")

    def _length(self, length):
        if length is None:
            return self.n_rows
        if not 0 <= length <= self.n_rows:
            raise ValueError(f"length {length} is outside 0..{self.n_rows} (rows stored)")
        return int(length)

    def _coded(self, slot, n):
        """(codes, side) C-contiguous views of one slot's coded rows among the first n."""
        k = n - min(self._n_exact, n)
        return self._codes[slot, :k], self._side[slot, :k]

    def encoded(self, slot=0, length=None):
        """The coded rows of one slot among the first ``length`` (all by default) as
        EncodedRows: a view (for a store with sinks, the rows after them)."""
        return self.codec.encoded_rows(*self._coded(slot, self._length(length)))

    def window_start(self, length=None):
        """First row that a read of the first ``length`` rows (a query at position
        length - 1) takes from its float32 copy: ``length`` when the store has no window.

        Reads of fewer rows than the store held before its last append are refused: the
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

    def recent_rows(self, start, stop, slot=0):
        """The float32 copies of rows [start, stop) of one slot, (stop - start, dim); the rows
        must lie in those held (``window_start(length)`` .. ``length`` for any length from the
        last append on)."""
        if not self._recent_start <= start <= stop <= self.n_rows:
            raise ValueError(f"rows [{start}, {stop}) are not all held in float32 (held: "
                             f"[{self._recent_start}, {self.n_rows}))")
        return self._recent_rows[slot, start - self._recent_start:stop - self._recent_start]

    def scores(self, q, slot=0, n_threads=None, length=None, start=0):
        """``q . x^_t`` over one slot's rows start <= t < length.

        Parameters
        ----------
        q : array-like of shape (dim,) or (m, dim)
        slot : int
        length : int or None
            Rows read (default all).
        start : int
            First row read (a sliding window reads its last rows only); each row's score is
            the same as in a read from row 0.

        Returns
        -------
        ndarray of shape (length - start,) or (m, length - start), dtype float32
        """
        n = self._length(length)
        start = self._start(start, n)
        if self.plain:
            codes, side = self._coded(slot, n)
            return self.codec.scores_checked(codes[start:], side[start:], q, n_threads)
        e, ws = min(n, self._n_exact), self.window_start(n)
        a, b, r = self._parts(start, e, ws)
        q32 = np.asarray(q, dtype=np.float32)
        q_coded = q32 if self.channel_scales is None else q32 * self.channel_scales[slot]
        codes, side = self._coded(slot, b)
        coded = self.codec.scores_checked(codes[a - e:], side[a - e:], q_coded, n_threads)
        if self.offsets is not None and coded.shape[-1]:
            coded += (q32 @ self.offsets[slot])[..., None]
        parts = ([q32 @ self._exact[slot, start:e].T] if start < e else []) + [coded]
        if r < n:
            parts.append(q32 @ self.recent_rows(r, n, slot).T)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

    def context(self, w, slot=0, n_threads=None, start=0):
        """``sum_t w_t x^_t`` over one slot's rows start <= t < start + T.

        Parameters
        ----------
        w : array-like of shape (T,) or (m, T)
            Weights of rows ``start`` .. ``start + T - 1``.
        slot : int
        start : int
            First row read.

        Returns
        -------
        ndarray of shape (dim,) or (m, dim), dtype float32
        """
        n = self._length(start + np.shape(w)[-1])
        start = self._start(start, n)
        if self.plain:
            codes, side = self._coded(slot, n)
            return self.codec.context_checked(codes[start:], side[start:], w, n_threads)
        e, ws = min(n, self._n_exact), self.window_start(n)
        a, b, r = self._parts(start, e, ws)
        w32 = np.asarray(w, dtype=np.float32)
        codes, side = self._coded(slot, b)
        coded_w = w32[..., a - start:b - start]
        out = self.codec.context_checked(codes[a - e:], side[a - e:], coded_w, n_threads)
        if self.channel_scales is not None:
            out *= self.channel_scales[slot]
        if self.offsets is not None and b > a:
            out += coded_w.sum(axis=-1, dtype=np.float32)[..., None] * self.offsets[slot]
        if start < e:
            out += w32[..., :e - start] @ self._exact[slot, start:e]
        if r < n:
            out += w32[..., r - start:n - start] @ self.recent_rows(r, n, slot)
        return out

    def _start(self, start, n):
        if not 0 <= start <= n:
            raise ValueError(f"start {start} is outside 0..{n} (the rows read)")
        return int(start)

    @staticmethod
    def _parts(start, e, ws):
        """Rows a .. b - 1 read from codes and r .. from float32 copies, for a read from row
        ``start`` of a store with ``e`` exact (sink) rows and its window from row ``ws``."""
        a = max(start, e)
        b = max(ws, a)
        return a, b, max(ws, start)

    def decode(self, slot=0, start=0, stop=None, n_threads=None, window=True):
        """Rows [start, stop) of one slot as float32 (stop - start, dim), as a read of all rows
        sees them; ``window=False``: every row after the sinks from its codes."""
        stop = self.n_rows if stop is None else stop
        if self.plain:
            return self.codec.decode(self.encoded(slot)[start:stop], n_threads)
        if not 0 <= start <= stop <= self.n_rows:
            raise ValueError(f"rows [{start}, {stop}) are outside 0..{self.n_rows}")
        e = self._n_exact
        ws = self.window_start() if window else self.n_rows
        coded_stop = max(min(stop, ws), start)
        coded = self.codec.decode(self.encoded(slot)[max(start - e, 0):max(coded_stop - e, 0)],
                                  n_threads)
        if self.channel_scales is not None:
            coded *= self.channel_scales[slot]
        if self.offsets is not None:
            coded += self.offsets[slot]
        parts = ([self._exact[slot, start:min(stop, e)]] if start < e else []) + [coded]
        if stop > ws:
            parts.append(self.recent_rows(max(start, ws), stop, slot))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    # -- sizes -------------------------------------------------------------------------------
    def bytes_for(self, n_rows):
        """Bytes this store holds once it has ``n_rows`` rows, every slot: codes and side
        values of the coded rows, float32 sinks, the float32 copies of the last ``recent`` rows
        (besides their codes), and the offsets and scales from the first append on. (The copies
        of a long append's older rows, held until the next append for its own queries, are not
        counted.)"""
        return stream_bytes(self.codec, self.options, n_rows, self.slots)

    @property
    def nbytes(self):
        """Bytes of the stored rows (codes and side values; float32 sinks, offsets, scales)."""
        return self.bytes_for(self.n_rows)

    @property
    def fixed_bytes(self):
        """What the stream options add to ``n_rows * bytes_per_row`` per slot once the sinks
        and the window are filled (float32 sink rows in place of their codes, the window's
        float32 copies, the offset and the channel scales), every slot."""
        n = max(self.sinks + self.recent, 1)
        return self.bytes_for(n) - self.slots * n * self.codec.bytes_per_row

    @property
    def capacity_bytes(self):
        """Bytes allocated."""
        return (self._codes.nbytes + self._side.nbytes + self._exact.nbytes
                + self._recent_rows.nbytes)


def stream_bytes(codec, options, n_rows, slots=1):
    """Bytes a stream of ``codec`` with ``options`` holds once it has ``n_rows`` rows in each
    of ``slots`` slots (:meth:`StreamStore.bytes_for`)."""
    exact = min(n_rows, options.sinks)
    window = min(n_rows - exact, options.recent)
    vectors = (options.center + options.normalize) if n_rows else 0
    return slots * ((n_rows - exact) * codec.bytes_per_row
                    + 4 * codec.dim * (exact + window + vectors))


def _calibrated_vectors(options, slots, dim, offsets, channel_scales):
    """A store's calibrated (offsets, channel_scales) checked, or (None, None) without a
    calibration."""
    if not options.calibrated:
        if offsets is not None or channel_scales is not None:
            raise ValueError(f"offsets / channel scales are given to a stream whose options "
                             f"{options.as_dict()} do not say calibrated (center=calib, "
                             "normalize=calib)")
        return None, None
    out = []
    for name, vec, asked in (("offsets", offsets, options.center),
                             ("channel scales", channel_scales, options.normalize)):
        if (vec is not None) != asked:
            raise ValueError(
                f"a stream with options {options.as_dict()} needs calibrated {name} exactly "
                f"when it asks for them: " + ("give them (a calibration file: python -m "
                                              "kvquant_experiments.calibrate)" if asked else
                                              "drop them"))
        if vec is None:
            out.append(None)
            continue
        vec = np.array(vec, np.float32)
        if vec.shape != (slots, dim):
            raise ValueError(f"calibrated {name} must have shape ({slots}, {dim}), got "
                             f"{vec.shape}")
        if not np.isfinite(vec).all() or (name != "offsets" and not (vec > 0).all()):
            raise ValueError(f"calibrated {name} hold NaN, inf" + (
                "" if name == "offsets" else " or a value <= 0"))
        out.append(vec)
    return tuple(out)


@dataclass(frozen=True)
class StreamState:
    """What a :class:`StreamStore` holds (:meth:`StreamStore.state`; views): the arguments of
    :meth:`StreamStore.from_state` after the codec and options."""

    codec: Codec
    options: StreamOptions
    codes: np.ndarray            # (n_coded, slots, code_bytes) uint8
    side: np.ndarray             # (n_coded, slots, n_side) float32
    offsets: np.ndarray          # (slots, dim) float32 or None
    channel_scales: np.ndarray   # (slots, dim) float32 or None
    sinks: np.ndarray            # (n_sinks, slots, dim) float32
    recent_rows: np.ndarray      # (m, slots, dim) float32, or None without a window

    def store(self):
        """A new store holding this state (copies)."""
        return StreamStore.from_state(self.codec, self.options, self.codes, self.side,
                                      self.offsets, self.channel_scales, self.sinks,
                                      self.recent_rows)
