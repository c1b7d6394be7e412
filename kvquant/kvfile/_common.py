"""What every tier of the cache file shares: shapes, streams, in-memory records, the load report,
the exceptions, side-value rules and the low-level I/O (whole writes, fsync, atomic replace)."""
import errno
import os
import re
from dataclasses import dataclass, field

import numpy as np

from kvquant.codecs import EncodedRows, get_codec
from kvquant.codecs.base import SIDE_DTYPES
from kvquant.rotation import ORDERING, SIGN_HASH
from kvquant.stream_options import StreamOptions, window_start

INT32_MAX = 2**31 - 1
# The engine's "< 3.4e38f" bound on side values (a float32 literal, just below FLT_MAX).
SIDE_MAX = np.float32(3.4e38)
_STREAM_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,31}\Z")


# -- exceptions ----------------------------------------------------------------------------------
class CacheFileRefused(ValueError):
    """A cache file that will not be read under the running mode; nothing was loaded or written.

    Attributes
    ----------
    reason : str
        Short machine-readable cause: ``"tier"``, ``"codec"``, ``"bits"``, ``"tag"``, ``"seed"``,
        ``"rotation"``, ``"codebook"``, ``"side"`` (side-value kind or dtype), ``"options"``
        (stream options), ``"context"``, ``"version"``, ``"not-a-cache"`` (mismatches) or
        ``"header"``, ``"commit"``, ``"state"`` (the stream state of a kvq file) (corruption).
    path : str
    file_tier : str or None
        ``"v1"``, ``"v2"``, ``"v3"``, ``"kvq"`` or None when unknown.
    """

    def __init__(self, message, reason, path=None, file_tier=None):
        super().__init__(message)
        self.reason = reason
        self.path = path
        self.file_tier = file_tier

    @property
    def message(self):
        return str(self)


class CacheFileMismatch(CacheFileRefused):
    """The file is intact but was written under another tier, codec, bit width, seed, codebook,
    side-value kind or dtype, or holds more tokens than allowed."""


class CacheFileCorrupt(CacheFileRefused):
    """The file carries our magic but its header or both commit slots fail their checksums: it is
    refused rather than overwritten, so that nothing is lost without the caller's consent."""


class CacheFileSaveError(OSError):
    """Writing to disk failed. The committed records on disk are unchanged (``committed``) and
    the records in memory are kept: the next ``save()`` or ``append()`` retries."""

    def __init__(self, err, committed, what="save"):
        code = getattr(err, "errno", None) or errno.EIO
        text = getattr(err, "strerror", None) or str(err)
        if what == "truncate":
            msg = (f"could not persist the shorter prefix: {text} "
                   "(the file will be rewritten at the next save)")
        else:
            msg = f"save failed: {text} (will retry on the next save)"
        super().__init__(code, msg, getattr(err, "filename", None))
        self.committed = committed


# -- the load report -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadEvent:
    """One thing the loader did.

    ``kind`` is one of: ``new``, ``loaded``, ``ignored``, ``refused``, ``upgraded``,
    ``truncated`` (file shorter than its count), ``uncommitted-tail`` (bytes past the count),
    ``corrupt-block`` (our tier: checksum failure, cut there), ``commit-slot`` (our tier: the
    newest commit slot is damaged, the older one is used), ``count`` (a negative count),
    ``bad-side``, ``bad-code``, ``bad-token``.
    """

    kind: str
    message: str
    detail: dict = field(default_factory=dict)


@dataclass
class LoadReport:
    """What opening a cache file found and did.

    Attributes
    ----------
    path : str
    status : str
        ``new`` (no file or an empty one), ``loaded``, ``upgraded`` (v1 quantized in memory),
        ``ignored`` (another model or version) or ``started-over`` (refused, but the caller chose
        ``on_mismatch="start_over"``). Except after ``loaded``, the file on disk is untouched
        until the first save, which rewrites it atomically.
    file_tier : str or None
        The tier found on disk.
    tier : str
        The tier this cache writes.
    header_count : int or None
        The committed count the file claimed.
    loaded : int
        Records loaded into memory.
    events : list of LoadEvent
    """

    path: str
    status: str = "new"
    file_tier: str | None = None
    tier: str = ""
    header_count: int | None = None
    loaded: int = 0
    events: list = field(default_factory=list)

    def add(self, kind, message, **detail):
        self.events.append(LoadEvent(kind, message, detail))

    @property
    def messages(self):
        return [e.message for e in self.events]

    def kinds(self):
        return [e.kind for e in self.events]

    def as_dict(self):
        return {"path": self.path, "status": self.status, "file_tier": self.file_tier,
                "tier": self.tier, "header_count": self.header_count, "loaded": self.loaded,
                "events": [{"kind": e.kind, "message": e.message, "detail": e.detail}
                           for e in self.events]}

    def __str__(self):
        return "\n".join(f"[kvfile] {m}" for m in self.messages) or f"[kvfile] {self.status}"


# -- shapes and streams --------------------------------------------------------------------------
def _check_int(value, name, low, high=INT32_MAX):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
            low <= value <= high):
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class KVFileShape:
    """The model shape an MLA cache file belongs to (the engine's header words h0..h5).

    Parameters
    ----------
    n_layers : int
        Layers with a cache row (L and R) per token.
    kv_lora : int
        Width of the latent row L.
    qk_rope : int
        Width of the rope row R.
    index_hd : int, default 0
        Width of an indexer row (f32); 0 when the model has no indexer.
    n_index_layers : int, default 0
        Layers owning an indexer row.
    vocab : int, default 0
        Vocabulary size; token ids must lie in [0, vocab) when it is > 0.
    """

    n_layers: int
    kv_lora: int
    qk_rope: int
    index_hd: int = 0
    n_index_layers: int = 0
    vocab: int = 0

    def __post_init__(self):
        _check_int(self.n_layers, "n_layers", 1)
        _check_int(self.kv_lora, "kv_lora", 1)
        _check_int(self.qk_rope, "qk_rope", 1)
        _check_int(self.index_hd, "index_hd", 0)
        _check_int(self.n_index_layers, "n_index_layers", 0)
        _check_int(self.vocab, "vocab", 0)

    @property
    def engine_words(self):
        """Header words h0..h5 as the engine writes them."""
        return (self.n_layers, self.kv_lora, self.qk_rope, self.index_hd, self.n_index_layers,
                self.vocab)

    @property
    def has_index(self):
        return self.index_hd > 0 and self.n_index_layers > 0

    def as_dict(self):
        return {"kind": "mla", "n_layers": self.n_layers, "kv_lora": self.kv_lora,
                "qk_rope": self.qk_rope, "index_hd": self.index_hd,
                "n_index_layers": self.n_index_layers, "vocab": self.vocab}

    def streams(self, mode):
        """The streams L, R (and ``index``, always f32) for ``mode``: one spec for L and R, or a
        mapping ``{"L": spec, "R": spec, "index": spec}``."""
        if isinstance(mode, str):
            specs = {"L": mode, "R": mode, "index": "f32"}
        elif isinstance(mode, dict):
            unknown = set(mode) - {"L", "R", "index"}
            if unknown or not {"L", "R"} <= set(mode):
                raise ValueError(
                    f"an MLA mode mapping needs keys 'L' and 'R' (and optionally 'index'), "
                    f"got {sorted(mode)}")
            specs = {"index": "f32", **mode}
        else:
            raise TypeError(f"mode must be a codec spec string or a mapping, got {mode!r}")
        out = [Stream("L", self.kv_lora, self.n_layers, specs["L"]),
               Stream("R", self.qk_rope, self.n_layers, specs["R"])]
        if self.has_index:
            out.append(Stream("index", self.index_hd, self.n_index_layers, specs["index"]))
        return out


@dataclass(frozen=True)
class Stream:
    """Rows of one kind stored per token: ``rows`` rows of width ``dim``, encoded by ``spec``.

    Examples: the latent rows of an MLA model, ``Stream("L", 512, rows=n_layers, spec="kv8")``;
    the keys of a GQA model, ``Stream("K", 64, rows=n_layers * n_kv_heads, spec="tq4")``.
    Row ``j`` of a token is layer ``j // n_kv_heads``, head ``j % n_kv_heads`` by convention.
    """

    name: str
    dim: int
    rows: int = 1
    spec: str = "f32"

    def __post_init__(self):
        if not isinstance(self.name, str) or not _STREAM_NAME.match(self.name):
            raise ValueError(f"stream name {self.name!r} must be 1..32 characters of "
                             "[A-Za-z0-9_.-] starting with a letter")
        _check_int(self.dim, f"stream {self.name!r} dim", 1, 1 << 24)
        _check_int(self.rows, f"stream {self.name!r} rows", 1, 1 << 24)


def side_kind(codec):
    """What a codec's side values are: ``scale`` (> 0), ``none``, or a radius-like value
    (``norm``, ``unbiased``, ``radius``: >= 0)."""
    if codec.n_side == 0:
        return "none"
    if getattr(codec, "family", None) == "kv8":
        return "scale"
    return str(getattr(codec, "side_kind", "radius"))


def codec_identity(codec):
    """Everything that fixes what a codec's stored bytes mean, as a JSON-able dict."""
    rotation = getattr(codec, "rotation", None)
    ident = {
        "spec": codec.spec,
        "family": getattr(codec, "family", type(codec).__name__),
        "bits": getattr(codec, "bits", None),
        "dim": int(codec.dim),
        "code_bytes": int(codec.code_bytes),
        "n_side": int(codec.n_side),
        "side": side_kind(codec),
        "side_dtype": codec.side_dtype,
        "engine_tag": None if codec.engine_tag is None else int(codec.engine_tag),
        "rotation": None,
        "codebook": None,
    }
    if rotation is not None:
        ident["rotation"] = {
            "identity": rotation.identity,
            "seed": int(rotation.seed),
            "sign_hash": getattr(rotation, "sign_hash", SIGN_HASH),
            "ordering": getattr(rotation, "ordering", ORDERING),
        }
    if getattr(codec, "codebook_identity", None) is not None:
        ident["codebook"] = {"identity": codec.codebook_identity,
                             "checksum": getattr(codec, "codebook_checksum", None)}
    return ident


def side_bytes(side_dtype):
    """Bytes of one stored side value, or None for a dtype this kvquant does not know."""
    dtype = SIDE_DTYPES.get(side_dtype)
    return None if dtype is None else dtype.itemsize


def build_codec(spec, dim, nonfinite):
    return get_codec(spec, dim, nonfinite=nonfinite)


# -- bad side values -----------------------------------------------------------------------------
def sanitize_rows(codes, side, kind, kv8):
    """Make rows with bad side values inert, in place, as the engine's loader does.

    codes : (n, rows, code_bytes) uint8; side : (n, rows, n_side) float32.
    ``scale`` rows (fp8): a scale that is not in (0, 3.4e38) zeroes its group's bytes and
    becomes 1; radius-like rows: a radius not in [0, 3.4e38) becomes 0. fp8 bytes 0x7F/0xFF
    (NaN, never written by an encoder) become 0.

    Returns
    -------
    (bad_side_tokens, bad_code_tokens) : ndarray of token indices
    """
    n = side.shape[0]
    empty = np.zeros(0, np.int64)
    bad_side = bad_code = empty
    if kind != "none" and side.size:
        with np.errstate(invalid="ignore"):
            if kind == "scale":
                bad = ~((side > 0) & (side < SIDE_MAX))
            else:
                bad = ~((side >= 0) & (side < SIDE_MAX))
        if bad.any():
            bad_side = np.flatnonzero(bad.reshape(n, -1).any(axis=1))
            if kind == "scale":
                group = codes.shape[2] // side.shape[2]
                codes[np.repeat(bad, group, axis=2)] = 0
                side[bad] = 1.0
            else:
                side[bad] = 0.0
    if kv8 and codes.size:
        nan_bytes = (codes & 0x7F) == 0x7F
        if nan_bytes.any():
            bad_code = np.flatnonzero(nan_bytes.reshape(n, -1).any(axis=1))
            codes[nan_bytes] = 0
    return bad_side, bad_code


def check_side_values(side, kind, stream):
    """Refuse (ValueError) side values that the loader would have to make inert."""
    if kind == "none" or side.size == 0:
        return
    with np.errstate(invalid="ignore"):
        ok = (side > 0) if kind == "scale" else (side >= 0)
        ok &= side < SIDE_MAX
    if not ok.all():
        tokens = np.flatnonzero(~ok.reshape(side.shape[0], -1).all(axis=1))
        shown = ", ".join(str(t) for t in tokens[:10]) + (" ..." if tokens.size > 10 else "")
        rule = "in (0, 3.4e38)" if kind == "scale" else "in [0, 3.4e38)"
        raise ValueError(f"stream {stream!r}: side values ({kind}) must be {rule}; "
                         f"bad in token(s) {shown}: nothing was appended")


# -- records in memory ---------------------------------------------------------------------------
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

    def __init__(self, streams, codecs, options=None):
        self._streams = list(streams)
        self._codecs = dict(codecs)
        self._options = {s.name: (options or {}).get(s.name, StreamOptions())
                         for s in self._streams}
        self._n = 0
        self._cap = 0
        self._tokens = np.zeros(0, np.int32)
        self._codes = {}
        self._side = {}
        self._offset = {}   # name -> (rows, dim) float32, once a centered stream has rows
        self._scale = {}    # name -> (rows, dim) float32, once a normalized stream has rows
        self._exact = {}    # name -> (m, rows, dim) float32, m <= sinks; min(n, sinks) are held
        self._recent_start = {}   # name -> first row with a float32 copy (recent=W streams)
        self._recent_rows = {}    # name -> (n - start, rows, dim) float32 copies
        for s in self._streams:
            c = self._codecs[s.name]
            self._codes[s.name] = np.zeros((0, s.rows, c.code_bytes), np.uint8)
            self._side[s.name] = np.zeros((0, s.rows, c.n_side), np.float32)
            self._offset[s.name] = self._scale[s.name] = None
            self._exact[s.name] = np.zeros((0, s.rows, c.dim), np.float32)
            self._recent_start[s.name] = 0
            self._recent_rows[s.name] = np.zeros((0, s.rows, c.dim), np.float32)

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

    def codes(self, name):
        """Codes of stream ``name``, shape (n, rows, code_bytes), uint8, as stored: for a stream
        with stream options, codes of the centered and scaled rows, and a zero row's codes for
        the sink tokens (see :meth:`decode`)."""
        return self._ro(self._codes[name][:self._n])

    def side(self, name):
        """Side values of stream ``name``, shape (n, rows, n_side), float32, as stored."""
        return self._ro(self._side[name][:self._n])

    def options(self, name):
        """The :class:`~kvquant.stream_options.StreamOptions` of stream ``name``."""
        return self._options[name]

    def offset(self, name):
        """Offset of every row slot, (rows, dim) float32, or None (not centered, or no rows)."""
        return self._ro(self._offset[name])

    def channel_scale(self, name):
        """Channel scales of every row slot, (rows, dim) float32, or None."""
        return self._ro(self._scale[name])

    def sink_rows(self, name):
        """The float32 rows of the first min(n, sinks) tokens, (n_exact, rows, dim)."""
        return self._ro(self._exact[name][:self._n_exact(name)])

    def _n_exact(self, name):
        return min(self._n, self._options[name].sinks)

    def window_start(self, name, length=None):
        """First row that a query reading the first ``length`` rows (default all) reads from a
        float32 copy (``recent=W`` streams; ``length`` for others), as RowStream.window_start."""
        n = self._n if length is None else length
        opt = self._options[name]
        return int(window_start(n, opt.recent, self._recent_start[name], opt.sinks))

    def window_rows(self, name, length=None):
        """The float32 copies a query reading the first ``length`` rows takes from its window,
        (length - window_start, rows, dim)."""
        n = self._n if length is None else length
        start, ws = self._recent_start[name], self.window_start(name, n)
        if ws >= n:
            return self._ro(self._recent_rows[name][:0])
        return self._ro(self._recent_rows[name][ws - start:n - start])

    def _check_plain(self, name, what):
        if not self._options[name].plain:
            spec = self._options[name].stream_spec(self._codecs[name].spec)
            raise ValueError(
                f"stream {name!r} is {spec!r}: its codes hold rows after an offset, scales or "
                f"float32 sinks, so {what} would not be its rows; read it with "
                f"records.decode({name!r}) or records.row_stream({name!r}, row)")

    def rows(self, name, row):
        """EncodedRows of row slot ``row`` (e.g. a layer) of stream ``name``, one per token
        (streams without stream options)."""
        self._check_plain(name, "EncodedRows of its codes")
        c = self._codecs[name]
        return EncodedRows(np.array(self._codes[name][:self._n, row], order="C"),
                           np.array(self._side[name][:self._n, row], order="C"), c.spec, c.dim)

    def stream(self, name):
        """A list with one EncodedRows per row slot of stream ``name``."""
        n_rows = self._codes[name].shape[1]
        return [self.rows(name, j) for j in range(n_rows)]

    def row_stream(self, name, row):
        """Row slot ``row`` of stream ``name`` as a :class:`kvquant.cache.RowStream` (a copy),
        with its offset, scales and sinks: attention reads it through the consumers."""
        from kvquant.cache import RowStream
        c = self._codecs[name]
        e = self._n_exact(name)
        off, scale = self._offset[name], self._scale[name]
        return RowStream.from_state(
            c, self._options[name], self._codes[name][e:self._n, row],
            self._side[name][e:self._n, row],
            offset=None if off is None else off[row],
            channel_scale=None if scale is None else scale[row],
            exact=self._exact[name][:e, row],
            recent_rows=self._recent_rows[name][:, row] if self._options[name].recent else None)

    def floats(self, name):
        """Rows of an f32 stream as float32 of shape (n, rows, dim)."""
        c = self._codecs[name]
        if c.spec != "f32":
            raise ValueError(f"stream {name!r} is {c.spec!r}, not f32: decode it with its codec")
        self._check_plain(name, "its f32 codes")
        return self._ro(np.ascontiguousarray(self._codes[name][:self._n]).view("<f4"))

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
        return self.floats("index") if "index" in self._codes else None

    def decode(self, name, n_threads=None):
        """Rows of stream ``name`` as the model sees them, float32 of shape (n, rows, dim):
        decoded (then scaled and offset, for a stream with those options), sinks exact."""
        c = self._codecs[name]
        e = self._n_exact(name)
        n, rows = self._n - e, self._codes[name].shape[1]
        enc = EncodedRows(
            np.ascontiguousarray(self._codes[name][e:self._n]).reshape(n * rows, c.code_bytes),
            np.ascontiguousarray(self._side[name][e:self._n]).reshape(n * rows, c.n_side),
            c.spec, c.dim)
        coded = c.decode(enc, n_threads).reshape(n, rows, c.dim)
        if self._scale[name] is not None:
            coded *= self._scale[name]
        if self._offset[name] is not None:
            coded += self._offset[name]
        if self._options[name].recent:   # the window of a query after the last row
            ws = self.window_start(name)
            coded[ws - e:] = self.window_rows(name)
        return np.concatenate([self._exact[name][:e], coded]) if e else coded

    # -- mutation (the CacheFile's business) ------------------------------------------------
    def _reserve(self, n_new):
        need = self._n + n_new
        if need <= self._cap:
            return
        cap = max(need, 2 * self._cap, 16)
        tokens = np.zeros(cap, np.int32)
        tokens[:self._n] = self._tokens[:self._n]
        self._tokens = tokens
        for name in self._codes:
            for store in (self._codes, self._side):
                old = store[name]
                new = np.zeros((cap,) + old.shape[1:], old.dtype)
                new[:self._n] = old[:self._n]
                store[name] = new
        self._cap = cap

    def _extend(self, tokens, codes, side, states=None):
        """Append records; ``states`` maps a stream with options to (offset, scales, new sink
        rows, float32 copies of the new coded rows or None) after these records (see
        :func:`kvquant.stream_options.split_rows`)."""
        k = len(tokens)
        self._reserve(k)
        a, b = self._n, self._n + k
        self._tokens[a:b] = tokens
        for name in self._codes:
            self._codes[name][a:b] = codes[name]
            self._side[name][a:b] = side[name]
        for name, (offset, scale, exact, window) in (states or {}).items():
            self._offset[name], self._scale[name] = offset, scale
            e = min(a, self._options[name].sinks)
            held = self._exact[name]
            if e + len(exact) > len(held):   # grow (geometrically, at most to `sinks` rows)
                m = min(self._options[name].sinks, max(e + len(exact), 2 * len(held)))
                self._exact[name] = np.zeros((m,) + held.shape[1:], np.float32)
                self._exact[name][:e] = held[:e]
            self._exact[name][e:e + len(exact)] = exact
            if window is not None:
                self._keep_recent(name, a + len(exact), window)
        self._n = b

    def _keep_recent(self, name, before, window):
        """As RowStream: keep the copies of the last ``recent`` rows before this append (rows
        < ``before``) and of every coded row of it."""
        start0 = self._recent_start[name]
        start = self.window_start(name, before)
        kept = self._recent_rows[name][start - start0:before - start0]
        self._recent_rows[name] = np.concatenate([kept, np.asarray(window, np.float32)])
        self._recent_start[name] = start

    def _set_window(self, name, rows):
        """Copies of the last ``len(rows)`` records' rows (a loaded window)."""
        self._recent_rows[name] = np.array(rows, np.float32)
        self._recent_start[name] = self._n - len(rows)

    def _truncate(self, n):
        self._n = min(self._n, n)
        for name, start in self._recent_start.items():
            # as RowStream.truncate: the copies the new window needs, where still held
            keep = self.window_start(name)
            self._recent_rows[name] = np.array(self._recent_rows[name][keep - start:
                                                                      self._n - start])
            self._recent_start[name] = keep
        if self._n == 0:   # a stream with no rows has no offset or scales (as RowStream)
            for name in self._offset:
                self._offset[name] = self._scale[name] = None

    def _slice(self, start, stop):
        """(tokens, codes, side) of records start..stop-1 (views)."""
        return (self._tokens[start:stop],
                {k: v[start:stop] for k, v in self._codes.items()},
                {k: v[start:stop] for k, v in self._side.items()})


# -- low-level I/O -------------------------------------------------------------------------------
def pwrite_all(fd, data, offset):
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]
        offset += n


def pread_exact(fd, size, offset):
    """Read up to ``size`` bytes (fewer at end of file)."""
    chunks = []
    while size > 0:
        b = os.pread(fd, min(size, 1 << 26), offset)
        if not b:
            break
        chunks.append(b)
        size -= len(b)
        offset += len(b)
    return b"".join(chunks)


def fsync_dir(path):
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is done
    finally:
        os.close(fd)


def temp_path(path):
    return f"{path}.kvq-tmp"


def write_new_file(path, chunks):
    """Write ``chunks`` to a temporary file beside ``path``, fsync it and rename it over
    ``path``: the old file stays whole until the new one is complete. Returns an fd (O_RDWR) of
    the new file."""
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        for chunk in chunks:
            pwrite_all(fd, chunk, offset)
            offset += len(chunk)
        os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path)
    return fd
