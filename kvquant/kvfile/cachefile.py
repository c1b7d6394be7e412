"""``CacheFile``: open a cache file under a running mode (reading it: :mod:`.loader`), append
with commit-by-count, truncate, save; the rules of docs/engine-arithmetic.md §6 plus our own
tier. Rows reach the records through the streams' stores (:mod:`.records`): nothing here encodes
a row."""
import hashlib
import os
import struct
import zlib

import numpy as np

from kvquant.codecs import EncodedRows
from kvquant.kvfile import engine, kvq
from kvquant.kvfile import lock
from kvquant.kvfile.errors import (
    CacheFileInUse, CacheFileMismatch, CacheFileSaveError, LoadReport)
from kvquant.kvfile.fileio import (
    open_regular, pread_exact, pwrite_all, remove_stale_temps, write_new_file)
from kvquant.kvfile.identity import build_codec, check_side_values, side_kind
from kvquant.kvfile.loader import load
from kvquant.kvfile.modelid import check_model_id
from kvquant.kvfile.records import CacheRecords
from kvquant.kvfile.schema import INT32_MAX, KVFileShape, Stream
from kvquant.streams.spec import StreamSpec

TIERS = ("auto", "engine", "kvq")
ON_MISMATCH = ("raise", "start_over")


class CacheFile:
    """A KV cache on disk: load under a running mode, append (commit by count), truncate.

    Build it with :meth:`open`. Records live in memory (``records``); ``committed`` of them are
    durable on disk. Nothing is written before the first ``append``/``save``.

    One writer per file: a cache opened for writing holds the file's lock
    (:mod:`kvquant.kvfile.lock`) until :meth:`close` (or a ``with`` block's end, or garbage
    collection); another writer of the same file, in this process or another, is refused with
    :class:`CacheFileInUse` at its first write. After ``close()`` the records stay readable and
    writing raises.
    """

    def __init__(self):
        raise TypeError("use CacheFile.open(path, shape, mode=...)")

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path, shape=None, mode="f32", *, streams=None, vocab=0, tier="auto",
             on_mismatch="raise", max_records=None, nonfinite="raise", block_records=None,
             readonly=False, n_threads=None, model_id=None, statistics=None):
        """Open (or prepare to create) the cache file at ``path``.

        Parameters
        ----------
        path : str or os.PathLike
        shape : KVFileShape, optional
            An MLA model's shape: streams ``L``, ``R`` (and ``index`` when the model has an
            indexer). Give either ``shape`` or ``streams``.
        mode : str or mapping, default "f32"
            Codec spec of L and R (``"f32"``, ``"kv8"``, ``"tq4:compat=colibri"``, ...), or a
            mapping ``{"L": spec, "R": spec, "index": spec}``. Ignored with ``streams``.
        streams : list of Stream, optional
            Any streams (e.g. K and V of a GQA model); always our ``kvq`` tier.
        vocab : int, default 0
            With ``streams``: vocabulary size (0 = unchecked).
        tier : {"auto", "engine", "kvq"}
            ``auto``: the engine tier of the mode's codec when it has one (f32 -> v1, kv8 -> v2,
            a codec with an ``engine_tag`` -> v3), else ``kvq``; an existing kvq file whose
            codecs match the mode is kept as kvq. ``engine`` insists on an engine tier;
            ``kvq`` on ours.
        on_mismatch : {"raise", "start_over"}
            A file written under another tier, codec, bit width, seed, codebook or side kind
            (or a damaged kvq header): raise :class:`CacheFileMismatch` /
            :class:`CacheFileCorrupt` (default), or start empty; either way the old file is
            untouched until the first save.
        max_records : int, optional
            Refuse a file committing more tokens than this (the engine's context check).
        nonfinite : {"raise", "inert"}
            Policy of the codecs for float rows given to ``append``. (A v1 file upgraded to a
            quantized mode always uses ``inert``, as the engine does.)
        block_records : int, optional
            kvq tier: records per checksummed block for a new file (default ~64 KiB blocks).
        readonly : bool
            Load only; ``append``/``save`` raise. A reader takes no lock: it reads what the
            writer has committed.
        n_threads : int or None
            Threads of the codec kernels when rows are encoded here (append of floats, v1
            upgrade); None: the OpenMP default, -1: all cores.
        model_id : str, optional
            The model's identity (``"sha256:..."``; :func:`~kvquant.kvfile.model_digest` gives
            one for a GGUF file): recorded in a kvq file's header and compared on opening. A
            file recording another identity, or recording one when none is given here, is
            refused (:class:`CacheFileMismatch`, reason ``"model"``); a file recording none is
            read (not checked; reported). The engine's ``.coli_kv`` tiers have no field for it:
            with an engine tier it is neither recorded nor checked (reported).
        statistics : dict, optional
            By stream name, the calibrated ``(offsets, channel_scales)`` (each (rows, dim)
            float32, or None where the stream does not ask for it) of a stream whose spec says
            ``center=calib`` / ``normalize=calib`` (:mod:`kvquant.streams.calibration`). The
            kvq header records their digest; a file written with other statistics is refused
            (:class:`CacheFileMismatch`, reason ``"statistics"``).

        Returns
        -------
        CacheFile
            With ``records`` loaded and ``report`` (a :class:`LoadReport`).

        Raises
        ------
        CacheFileMismatch, CacheFileCorrupt
            With ``on_mismatch="raise"`` (both are :class:`CacheFileRefused`, a ValueError,
            with ``.reason``). A path that is not a regular file (a directory, FIFO, device) is
            refused whatever ``on_mismatch`` says (reason ``"not-a-file"``), without blocking.
        ValueError
            Bad arguments (unknown spec, a codec that cannot take a width, ...).
        OSError
            The file exists but cannot be read.
        """
        self = object.__new__(cls)
        self._fd = self._lock_fd = None
        self._lock_state = None
        self._view = None   # what was read while another writer held the file (loader)
        self.path = os.fspath(path)
        if tier not in TIERS:
            raise ValueError(f"tier={tier!r} is not one of {TIERS}")
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch={on_mismatch!r} is not one of {ON_MISMATCH}")
        if max_records is not None and (not isinstance(max_records, (int, np.integer))
                                        or max_records < 0):
            raise ValueError(f"max_records must be a non-negative integer, got {max_records!r}")
        self._tier_arg = tier
        self._on_mismatch = on_mismatch
        self._max_records = max_records
        self._nonfinite = nonfinite
        self._readonly = bool(readonly)
        self._n_threads = n_threads
        self.model_id = check_model_id(model_id)
        self._closed = False
        self._set_streams(shape, mode, streams, vocab)
        self._set_statistics(statistics)
        self._resolve_tier(block_records)
        self.records = CacheRecords(self.streams, self.codecs, self.options, self.statistics)
        self.report = LoadReport(self.path, tier=self.tier)
        self._needs_rewrite = True
        self._state_dirty = False   # a stream's state changed since the file was written
        self._committed = 0
        self._disk_count = 0
        self._slot = (0, 1)
        # writes go to the link's target: a rewrite replaces the target, the link stays
        self._target = os.path.realpath(self.path)
        if not self._readonly:
            self._take_lock()
        try:
            load(self)
        except BaseException:
            self.close()
            raise
        if self.model_id is not None and self.tier != "kvq":
            self.report.add(
                "model-id", f"{self.path}: the engine's .coli_kv header has no field for a "
                f"model identity: {self.model_id} is neither recorded nor checked (use "
                "tier='kvq' to record it)")
        self.report.tier = self.tier
        self.report.loaded = len(self.records)
        return self

    def _take_lock(self):
        """Take the writer lock before reading, so that what is read stays what is on disk."""
        try:
            fd, holder = lock.try_lock(self._target)
        except OSError as exc:
            self._lock_state = ("unavailable", exc)
            return
        if fd is None:
            self._lock_state = ("busy", holder)
            return
        self._lock_fd = fd
        self._lock_state = ("held", None)
        remove_stale_temps(self._target)

    def _set_streams(self, shape, mode, streams, vocab):
        if (shape is None) == (streams is None):
            raise ValueError("give either shape (an MLA KVFileShape) or streams (a list of "
                             "Stream), not both or neither")
        if shape is not None:
            if not isinstance(shape, KVFileShape):
                raise TypeError(f"shape must be a KVFileShape, got {type(shape).__name__}")
            self.shape = shape
            self.streams = shape.streams(mode)
            self.vocab = shape.vocab
            self._model = shape.as_dict()
        else:
            streams = list(streams)
            if not streams or not all(isinstance(s, Stream) for s in streams):
                raise TypeError("streams must be a non-empty list of Stream")
            if len({s.name for s in streams}) != len(streams):
                raise ValueError("stream names must be unique")
            if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or not (
                    0 <= vocab <= INT32_MAX):
                raise ValueError(f"vocab must be an integer in 0..{INT32_MAX}, got {vocab!r}")
            self.shape = None
            self.streams = streams
            self.vocab = int(vocab)
            self._model = {"kind": "streams", "vocab": self.vocab}
        self.options, self.codecs = {}, {}
        for s in self.streams:
            try:
                spec = StreamSpec.of(s.spec)
            except ValueError as exc:
                raise ValueError(f"stream {s.name!r}: {exc}") from None
            self.options[s.name] = spec.options
            self.codecs[s.name] = build_codec(spec.codec_spec, s.dim, self._nonfinite)
        self.mode = {s.name: self.options[s.name].stream_spec(self.codecs[s.name].spec)
                     for s in self.streams}

    def _set_statistics(self, statistics):
        """The calibrated statistics by stream (checked by the stores) and their digests."""
        from kvquant.streams.calibration import statistics_digest
        statistics = dict(statistics or {})
        unknown = set(statistics) - {s.name for s in self.streams if
                                     self.options[s.name].calibrated}
        if unknown:
            raise ValueError(f"statistics given for stream(s) {sorted(unknown)}, whose specs do "
                             "not say center=calib / normalize=calib")
        self.statistics = {}
        for s in self.streams:
            if not self.options[s.name].calibrated:
                continue
            if s.name not in statistics:
                raise ValueError(f"stream {s.name!r} ({self.mode[s.name]}) reads calibrated "
                                 "statistics: give statistics={name: (offsets, channel_scales)}")
            offsets, scales = statistics[s.name]
            self.statistics[s.name] = (
                None if offsets is None else np.asarray(offsets, np.float32),
                None if scales is None else np.asarray(scales, np.float32))
        self._statistics_digests = {name: statistics_digest(*vecs)
                                    for name, vecs in self.statistics.items()}

    def _engine_tier_problem(self):
        """Why the running streams have no engine tier, or None."""
        if self.shape is None:
            return "engine .coli_kv files hold MLA models (L and R rows) only"
        if not all(opt.plain for opt in self.options.values()):
            return "stream options (center, normalize, sinks, recent) are ours: the engine has "\
                   "no field for an offset, scales or float32 rows"
        cl, cr = self.codecs["L"], self.codecs["R"]
        if cl.engine_tag is None:
            hint = (" (the engine has no grouped-scale format: KV8_GS turns persistence off)"
                    if cl.family == "kv8" else "")
            if cl.side_dtype != "f32":
                hint = " (the engine stores f32 side values)"
            return f"codec {cl.spec!r} has no engine tier{hint}"
        if cl.spec != cr.spec or cr.engine_tag != cl.engine_tag:
            return f"L ({cl.spec!r}) and R ({cr.spec!r}) use different codecs"
        if "index" in self.codecs and self.codecs["index"].spec != "f32":
            return "the engine stores indexer rows as f32"
        return None

    def _resolve_tier(self, block_records):
        problem = None if self._tier_arg == "kvq" else self._engine_tier_problem()
        if self._tier_arg == "engine" and problem:
            raise ValueError(f"no engine .coli_kv tier for this mode: {problem}; "
                             "use tier='kvq' (or 'auto')")
        if self._tier_arg != "kvq" and problem is None:
            tag = int(self.codecs["L"].engine_tag)
            self.tier = engine.tier_of_tag(tag)
            self._engine_tag = tag
            self._layout = engine.EngineLayout(self.tier, self.shape, self.codecs)
        else:
            self.tier = "kvq"
            self._engine_tag = None
            self._layout = self._kvq_layout(block_records)

    def _kvq_layout(self, block_records, codecs=None, held=None):
        import kvquant
        return kvq.KvqLayout(self._model, self.streams, codecs or self.codecs, block_records,
                             writer=f"kvquant {kvquant.__version__}", options=self.options,
                             held=held, model_id=self.model_id,
                             statistics=self._statistics_digests)

    def _describe_running(self):
        spec = self.mode["L"] if self.shape is not None and "L" in self.mode else ", ".join(
            f"{k}={v}" for k, v in self.mode.items())
        return f"'{spec}', tier {engine.describe_tier(self.tier, self._engine_tag)}"

    # -- state -------------------------------------------------------------------------------
    @property
    def committed(self):
        """Records durable on disk under this cache's tier (0 until the first save after an
        upgrade, an ignored or a refused file)."""
        return 0 if self._needs_rewrite else self._committed

    @property
    def pending(self):
        """Records in memory not yet committed to disk."""
        return len(self.records) - self.committed

    def __len__(self):
        return len(self.records)

    def __repr__(self):
        return (f"<CacheFile {self.path!r} tier={self.tier} mode={self.mode} "
                f"records={len(self.records)} committed={self.committed}>")

    def close(self):
        """Close the file and release the writer lock; the records stay readable, writing
        raises."""
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            lock.unlock(self._lock_fd, self._target)
            self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- appending ---------------------------------------------------------------------------
    def append(self, tokens, L=None, R=None, index=None, *, streams=None, save=True):
        """Append tokens with their rows, then (by default) commit them to disk.

        Parameters
        ----------
        tokens : array-like of int, shape (n,)
        L, R : rows of an MLA cache, each either a list with one EncodedRows per layer
            (n rows each, encoded by this cache's codec), or floats of shape
            (n, n_layers, width) which are encoded here.
        index : floats of shape (n, n_index_layers, index_hd), when the shape has an indexer.
        streams : mapping, optional
            Rows by stream name (the way to pass streams of a ``streams=`` cache).
        save : bool, default True
            Commit to disk now (records written and fsynced, then the count, then fsync).

        Returns
        -------
        int
            Records committed on disk.

        Raises
        ------
        CacheFileSaveError
            Writing failed: the rows stay in memory (``pending``), the committed records on
            disk are unchanged, and the next ``append``/``save`` retries.
        """
        self._check_writable()
        given = dict(streams or {})
        for name, value in (("L", L), ("R", R), ("index", index)):
            if value is not None:
                if name in given:
                    raise ValueError(f"stream {name!r} given twice")
                given[name] = value
        unknown = set(given) - set(self.codecs)
        if unknown:
            raise ValueError(f"unknown stream(s) {sorted(unknown)}; this cache has "
                             f"{[s.name for s in self.streams]}")
        tokens = self._check_tokens(tokens)
        n = len(tokens)
        prepared, placeholders = {}, {}
        for s in self.streams:
            if s.name not in given:
                raise ValueError(f"rows of stream {s.name!r} are missing")
            prepared[s.name], placeholders[s.name] = self._prepare_stream(s, given[s.name], n)
        held = len(self.records)
        self.records.extend(tokens, prepared, placeholders)
        if n and any(self._changes_state(s.name, held) for s in self.streams
                     if not self.options[s.name].plain):
            self._state_dirty = True   # the state lives before the records: a rewrite
        return self.save() if save else self.committed

    def _changes_state(self, name, held):
        """Whether appending to ``held`` records sets the stream's offset or scales, or adds
        sink rows."""
        opt = self.options[name]
        return held < opt.sinks or (held == 0 and (opt.center or opt.normalize))

    def _check_writable(self):
        if self._readonly:
            raise ValueError(f"{self.path} was opened readonly")
        if self._closed:
            raise ValueError(f"{self.path}: this cache was closed; reopen it to write")
        state, detail = self._lock_state
        if state == "unavailable":
            raise CacheFileSaveError(OSError(
                detail.errno, f"cannot create the writer lock {lock.lock_path(self._target)} "
                f"({detail.strerror}); a writer needs it to keep other writers out (open with "
                "readonly=True to read)"), self.committed)
        if state == "busy":
            self._lock_late(detail)

    def _lock_late(self, holder):
        """Take the lock that another writer held when this cache read the file: refused while
        it still holds it, or when the file changed since it was read."""
        try:
            fd, now = lock.try_lock(self._target)
        except OSError as exc:
            self._lock_state = ("unavailable", exc)
            return self._check_writable()
        if fd is None:
            pid = now if now is not None else holder
            who = "another writer" if pid is None else f"pid {pid}" + (
                " (this process: close the other CacheFile first)" if pid == os.getpid()
                else "")
            raise CacheFileInUse(
                f"{self.path} is in use: {who} has it open for writing; nothing was written "
                "(close that writer and reopen this file, or open it with readonly=True to "
                "read)", self.path, self.tier, holder_pid=pid)
        changed = self._changed_since_read()
        if changed:
            lock.unlock(fd, self._target)
            raise CacheFileInUse(
                f"{self.path} was written by another writer after this cache read it "
                f"({changed}): what this cache holds is out of date, nothing was written; "
                "reopen the file to write", self.path, self.tier, holder_pid=holder)
        self._lock_fd = fd
        self._lock_state = ("held", None)
        self._view = None
        remove_stale_temps(self._target)

    def _changed_since_read(self):
        """How the file differs from what the loader read (``_view``), or None."""
        try:
            fd, st = open_regular(self._target, os.O_RDONLY)
        except FileNotFoundError:
            return None   # removed: nobody's records are in it any more
        if fd is None:
            return f"it is {st} now"
        try:
            if self._view is None:
                return "it was created"
            dev, ino, size, digest = self._view
            if (st.st_dev, st.st_ino) != (dev, ino):
                return "it was replaced"
            if st.st_size < size or (size == 0 and st.st_size):
                return "it is shorter" if st.st_size < size else "it was written"
            if hashlib.sha256(pread_exact(fd, size, 0)).digest() != digest:
                return "its bytes differ"
        finally:
            os.close(fd)
        return None

    def _check_tokens(self, tokens):
        t = np.asarray(tokens)
        if t.ndim == 0:
            t = t.reshape(1)
        if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
            raise ValueError(f"tokens must be a 1-D array of integers, got {t.dtype} {t.shape}")
        hi = self.vocab if self.vocab else INT32_MAX + 1
        if t.size and (t.min() < 0 or t.max() >= hi):
            raise ValueError(f"token ids must lie in [0, {hi}), got {t.min()}..{t.max()}")
        return t.astype(np.int32)

    def _prepare_stream(self, s, value, n):
        """(PreparedRows, placeholders or None) of the rows ``value`` given for stream ``s``:
        EncodedRows per row slot (plain streams) or floats, encoded through the stream's store."""
        c = self.codecs[s.name]
        if isinstance(value, EncodedRows):
            value = [value]
        if isinstance(value, (list, tuple)) and not self.options[s.name].plain and any(
                isinstance(v, EncodedRows) for v in value):
            raise ValueError(
                f"stream {s.name!r} is {self.mode[s.name]!r}: rows encoded elsewhere carry no "
                "offset, scales or float32 sinks; append the float rows instead")
        if isinstance(value, (list, tuple)) and not self.options[s.name].plain:
            value = np.stack([np.asarray(v) for v in value], axis=1) if len(value) else value
        if isinstance(value, (list, tuple)):
            if len(value) != s.rows:
                raise ValueError(f"stream {s.name!r}: expected {s.rows} row slot(s) (one per "
                                 f"layer), got {len(value)}")
            encs = [v if isinstance(v, EncodedRows)
                    else self.records.encode_slot(s.name, v, self._n_threads) for v in value]
            checked = [c.check_encoded(e) for e in encs]
            if any(cd.shape[0] != n for cd, _ in checked):
                raise ValueError(f"stream {s.name!r}: every row slot needs {n} rows (one per "
                                 f"token), got {[cd.shape[0] for cd, _ in checked]}")
            codes = np.stack([cd for cd, _ in checked], axis=1) if n else np.zeros(
                (0, s.rows, c.code_bytes), np.uint8)
            side = np.stack([sd for _, sd in checked], axis=1) if n else np.zeros(
                (0, s.rows, c.n_side), np.float32)
            check_side_values(side, side_kind(c), s.name)
            return self.records.prepare_encoded(s.name, codes, side), None
        X = np.asarray(value)
        if X.ndim == 2 and s.rows == 1:
            X = X[:, None, :]
        if X.shape != (n, s.rows, s.dim):
            raise ValueError(f"stream {s.name!r}: expected rows of shape ({n}, {s.rows}, "
                             f"{s.dim}), got {X.shape}")
        return self._prepare_floats(s, X, c)

    def _prepare_floats(self, s, X, codec):
        """(PreparedRows, placeholders of the new sink tokens' records or None) of float rows
        (n, rows, dim) of stream ``s``, encoded by ``codec`` (this stream's, or one of its
        nonfinite policy) through the stream's store; nothing changed."""
        prepared = self.records.prepare(s.name, X, self._n_threads, codec)
        placeholders = None
        side = prepared.side
        if prepared.sinks.shape[0]:
            placeholders = self.records.placeholder(s.name, prepared.sinks.shape[0], codec)
            side = np.concatenate([placeholders[1], side])
        check_side_values(side, side_kind(codec), s.name)
        return prepared, placeholders

    # -- writing -----------------------------------------------------------------------------
    def save(self):
        """Commit the records in memory that are not on disk yet.

        A file that needs a rewrite (new, upgraded, ignored or refused-and-started-over) is
        written whole to a temporary file, fsynced and renamed over ``path``: the old file stays
        whole until the new one is complete. Otherwise the new records are written after the
        committed ones and fsynced, then the count is written and fsynced.

        Returns
        -------
        int
            Records committed.
        """
        self._check_writable()
        n = len(self.records)
        try:
            if not self._needs_rewrite and self._fd is None:
                try:
                    self._fd = self._open_rw()
                except FileNotFoundError:
                    self._needs_rewrite = True
            if self._needs_rewrite or self._state_dirty:
                self._rewrite(n)
                return self._committed
            if self._disk_count != self._committed:
                self._write_count(self._committed)
            if n > self._committed:
                self._write_records(self._committed, n)
                self._write_count(n)
                self._committed = n
        except OSError as exc:
            raise CacheFileSaveError(exc, self.committed) from exc
        return self._committed

    def truncate(self, n):
        """Keep the first ``n`` records, in memory and (if the file is in sync) on disk.

        The engine's rule: the count on disk becomes min(n, committed), written and fsynced.
        On failure the file will be rewritten whole at the next save.
        """
        self._check_writable()
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"truncate needs a non-negative integer, got {n!r}")
        n = min(int(n), len(self.records))
        self.records.truncate(n)
        if self._needs_rewrite:
            return n
        new = min(n, self._committed)
        if new == self._committed == self._disk_count:
            return n   # only rows not yet committed were dropped: the file stays as it is
        try:
            if self._fd is None:
                self._fd = self._open_rw()
            self._write_count(new)
            self._committed = new
        except OSError as exc:
            self._needs_rewrite = True
            raise CacheFileSaveError(exc, 0, what="truncate") from exc
        return n

    def _open_rw(self):
        fd, kind = open_regular(self._target, os.O_RDWR)
        if fd is None:
            raise CacheFileMismatch(
                f"{self.path} is {kind}, not a cache file: refusing to write to it",
                "not-a-file", self.path, None)
        return fd

    def _raw(self, start, stop):
        return self._layout.to_bytes(*self.records.slice(start, stop))

    def _tail_crc(self, count):
        if self.tier != "kvq":
            return 0
        start = count - count % self._layout.block_records
        return zlib.crc32(self._raw(start, count))

    def _rewrite(self, n):
        if self.tier == "kvq":
            # a new file gets this kvquant's header, its state area sized by the sinks held
            layout = self._kvq_layout(
                self._layout.block_records,
                held={s.name: len(self.records.sink_rows(s.name)) for s in self.streams})
            data, tail_crc = layout.data_bytes(0, self._raw(0, n), 0)
            chunks = (layout.file_head(n, tail_crc, self.records), data)
        else:
            chunks = (self._layout.header(n), self._raw(0, n))
        fd = write_new_file(self._target, chunks)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        if self.tier == "kvq":
            self._layout = layout
        self._needs_rewrite = self._state_dirty = False
        self._committed = self._disk_count = n
        self._slot = (0, 1)

    def _write_records(self, start, stop):
        raw = self._raw(start, stop)
        if self.tier == "kvq":
            data, _ = self._layout.data_bytes(start, raw, self._tail_crc(start))
            pwrite_all(self._fd, data, self._layout.record_offset(start))
        else:
            pwrite_all(self._fd, raw, engine.HEADER_BYTES + start * self._layout.record_bytes)
        os.fsync(self._fd)

    def _write_count(self, count):
        if self.tier == "kvq":
            idx, seq = self._slot
            new = (1 - idx, seq + 1)
            if self._layout.window_streams:   # the new commit's window first, same letter
                pwrite_all(self._fd, self._layout.window_slot(count, new[1], self.records),
                           self._layout.window_slot_offset(new[0]))
                os.fsync(self._fd)
            pwrite_all(self._fd, self._layout.slot(count, new[1], self._tail_crc(count)),
                       kvq.SLOT_OFFSETS[new[0]])
            os.fsync(self._fd)
            self._slot = new
        else:
            if count > INT32_MAX:
                raise OSError(27, "the engine's count word is int32: too many records")
            pwrite_all(self._fd, struct.pack("<i", count), engine.COUNT_OFFSET)
            os.fsync(self._fd)
        self._disk_count = count

