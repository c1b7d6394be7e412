"""``CacheFile``: open a cache file under a running mode, load what may be loaded, append with
commit-by-count, truncate; the rules of docs/engine-arithmetic.md §6 plus our own tier."""
import os
import struct
import zlib

import numpy as np

from kvquant.codecs import EncodedRows
from kvquant.kvfile import engine, kvq
from kvquant.kvfile.errors import (
    CacheFileMismatch, CacheFileRefused, CacheFileSaveError, LoadReport)
from kvquant.kvfile.fileio import pread_exact, pwrite_all, write_new_file
from kvquant.kvfile.identity import (
    build_codec, check_side_values, codec_identity, sanitize_rows, side_kind)
from kvquant.kvfile.records import CacheRecords
from kvquant.kvfile.schema import INT32_MAX, KVFileShape, Stream
from kvquant.streams.options import StreamOptions
from kvquant.streams.spec import StreamSpec

TIERS = ("auto", "engine", "kvq")
ON_MISMATCH = ("raise", "start_over")
_HEAD_BYTES = kvq.HEADER_OFFSET + kvq.MAX_HEADER_BYTES

# Identity fields compared between a kvq file and the running codec, in the order that names
# the most specific reason first.
_IDENTITY_CHECKS = (
    ("family", "codec", "codec family"),
    ("bits", "bits", "bit width"),
    ("rotation.seed", "seed", "rotation seed"),
    ("rotation.sign_hash", "rotation", "rotation sign hash"),
    ("rotation.ordering", "rotation", "Hadamard ordering"),
    ("rotation.identity", "rotation", "rotation"),
    ("codebook.identity", "codebook", "codebook"),
    ("codebook.checksum", "codebook", "codebook checksum"),
    ("side", "side", "side-value kind"),
    ("side_dtype", "side", "side-value dtype"),
    ("spec", "codec", "codec spec"),
    ("code_bytes", "codec", "code bytes per row"),
    ("n_side", "codec", "side values per row"),
    ("engine_tag", "codec", "engine tag"),
)


# What a kvq header written before a field existed means by its absence.
_IDENTITY_DEFAULTS = {"side_dtype": "f32"}


def _get(d, dotted):
    for key in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return _IDENTITY_DEFAULTS.get(dotted) if d is None else d


def _show(key, value):
    if key == "rotation.seed" and isinstance(value, int):
        return f"{value:#010x}"
    if key == "engine_tag" and isinstance(value, int):
        return f"{value:#x}"
    return repr(value)


class CacheFile:
    """A KV cache on disk: load under a running mode, append (commit by count), truncate.

    Build it with :meth:`open`. Records live in memory (``records``); ``committed`` of them are
    durable on disk. Nothing is written before the first ``append``/``save``.
    """

    def __init__(self):
        raise TypeError("use CacheFile.open(path, shape, mode=...)")

    # -- opening -----------------------------------------------------------------------------
    @classmethod
    def open(cls, path, shape=None, mode="f32", *, streams=None, vocab=0, tier="auto",
             on_mismatch="raise", max_records=None, nonfinite="raise", block_records=None,
             readonly=False, n_threads=None):
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
            Load only; ``append``/``save`` raise.
        n_threads : int or None
            Threads of the codec kernels when rows are encoded here (append of floats, v1
            upgrade); None: the OpenMP default, -1: all cores.

        Returns
        -------
        CacheFile
            With ``records`` loaded and ``report`` (a :class:`LoadReport`).

        Raises
        ------
        CacheFileMismatch, CacheFileCorrupt
            With ``on_mismatch="raise"`` (both are :class:`CacheFileRefused`, a ValueError,
            with ``.reason``).
        ValueError
            Bad arguments (unknown spec, a codec that cannot take a width, ...).
        OSError
            The file exists but cannot be read.
        """
        self = object.__new__(cls)
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
        self._fd = None
        self._set_streams(shape, mode, streams, vocab)
        self._resolve_tier(block_records)
        self.records = CacheRecords(self.streams, self.codecs, self.options)
        self.report = LoadReport(self.path, tier=self.tier)
        self._needs_rewrite = True
        self._state_dirty = False   # a stream's state changed since the file was written
        self._committed = 0
        self._disk_count = 0
        self._slot = (0, 1)
        self._load()
        self.report.tier = self.tier
        self.report.loaded = len(self.records)
        return self

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
                             held=held)

    def _describe_running(self):
        spec = self.mode["L"] if self.shape is not None and "L" in self.mode else ", ".join(
            f"{k}={v}" for k, v in self.mode.items())
        return f"'{spec}', tier {engine.describe_tier(self.tier, self._engine_tag)}"

    # -- loading -----------------------------------------------------------------------------
    def _load(self):
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self.report.add("new", f"no cache file at {self.path}: starting empty")
            return
        try:
            size = os.fstat(fd).st_size
            head = pread_exact(fd, min(size, _HEAD_BYTES), 0)
            try:
                self._load_from(fd, size, head)
            except CacheFileRefused as exc:
                self._refused(exc)
        finally:
            os.close(fd)

    def _refused(self, exc):
        if self._on_mismatch == "raise":
            raise exc
        self.records = CacheRecords(self.streams, self.codecs, self.options)
        self.report.status = "started-over"
        self.report.add("refused", f"{exc}; starting over (the file is kept until the first "
                        "save)", reason=exc.reason)
        self._needs_rewrite = True

    def _ignored(self, message, **detail):
        self.report.status = "ignored"
        self.report.add("ignored", f"{message}; starting over (the file is kept until the "
                        "first save)", **detail)

    def _load_from(self, fd, size, head):
        rep = self.report
        if size == 0:
            rep.add("new", f"{self.path} is empty: starting empty")
            return
        magic = head[:8]
        if magic == kvq.MAGIC:
            return self._load_kvq(fd, size, head)
        known = (kvq.MAGIC, *engine.MAGICS.values())
        if size < 8 and any(m.startswith(head) for m in known):
            return self._ignored(f"ignoring {self.path}: a torn header ({size} bytes)")
        if head.startswith(engine.MAGIC_PREFIX):
            if magic not in engine.TIER_OF_MAGIC:
                return self._ignored(f"ignoring {self.path}: a .coli_kv of another version "
                                     f"(magic {magic!r})")
            if size < engine.HEADER_BYTES:
                return self._ignored(f"ignoring {self.path}: the .coli_kv header is short "
                                     f"({size} of {engine.HEADER_BYTES} bytes)")
            ftier, words = engine.parse_header(head)
            return self._load_engine(fd, size, ftier, words)
        raise CacheFileMismatch(
            f"{self.path} is not a cache file (magic {bytes(magic)!r}): refusing to read or "
            "overwrite it", "not-a-cache", self.path, None)

    def _load_engine(self, fd, size, ftier, words):
        rep, path = self.report, self.path
        rep.file_tier = ftier
        count, tag = words[6], words[7]
        rep.header_count = count
        if self.shape is None:
            return self._ignored(f"ignoring {path}: a .coli_kv holds an MLA model; this cache "
                                 f"holds streams {[s.name for s in self.streams]}",
                                 words=list(words))
        if tuple(words[:6]) != self.shape.engine_words:
            diff = ", ".join(f"{k} {a} != {b}" for k, a, b in zip(
                engine.WORD_NAMES[:6], words[:6], self.shape.engine_words) if a != b)
            return self._ignored(f"ignoring {path}: a .coli_kv from a different model or "
                                 f"version ({diff})", words=list(words))
        expected = {"v1": engine.TAG_F32, "v2": engine.TAG_FP8}.get(ftier)
        if (expected is not None and tag != expected) or (
                ftier == "v3" and engine.tier_of_tag(tag) != "v3"):
            raise CacheFileMismatch(
                f"{path}: a {engine.describe_tier(ftier)} header with format tag {tag} (the "
                f"engine writes {expected if expected is not None else 'codec<<8|bits'}): not "
                "a file this reader understands; refusing it", "tag", path, ftier)
        file_spec = {"v1": "f32", "v2": "kv8"}.get(ftier) or engine.spec_of_tag(tag)
        upgrade = ftier == "v1" and self.tier != "v1"
        if not upgrade and ftier != self.tier:
            resume = f" (open with mode={file_spec!r} to resume it)" if file_spec else ""
            raise CacheFileMismatch(
                f"{path} is a {engine.describe_tier(ftier, tag)} .coli_kv; the running mode is "
                f"{self._describe_running()}: refusing it{resume}", "tier", path, ftier)
        if ftier == "v3" and tag != self._engine_tag:
            same_codec = (tag >> 8) == (self._engine_tag >> 8)
            raise CacheFileMismatch(
                f"{path}: v3 {engine.describe_tag(tag)} ({file_spec or 'unknown codec'}) != "
                f"running {engine.describe_tag(self._engine_tag)} ({self.mode['L']}): "
                "refusing it", "bits" if same_codec else "codec", path, ftier)
        if count < 0:
            rep.add("count", f"{path}: negative committed count {count}: treated as 0",
                    count=count)
            count = 0
        self._check_context(count, ftier)
        if upgrade:
            f32 = {s.name: build_codec("f32", s.dim, "inert") for s in self.streams}
            layout = engine.EngineLayout("v1", self.shape, f32)
        else:
            layout = self._layout
        rec = layout.record_bytes
        present = (size - engine.HEADER_BYTES) // rec
        n = min(count, present)
        if count > present:
            rep.add("truncated", f"{path} is shorter than its count: {present} complete "
                    f"record(s) of the {count} committed; cut to {present}",
                    count=count, kept=present)
        elif size > engine.HEADER_BYTES + count * rec:
            rep.add("uncommitted-tail", f"{path}: {size - engine.HEADER_BYTES - count * rec} "
                    "byte(s) past the committed records ignored (an append that did not "
                    "commit, or a truncation)")
        buf = pread_exact(fd, n * rec, engine.HEADER_BYTES)
        n = min(n, len(buf) // rec)
        tokens, codes, side = layout.from_bytes(buf, n)
        if upgrade:
            k, _ = self._post_load(tokens, codes, side, f32)
            self._upgrade(tokens, codes, side, k)
            return
        k, _ = self._post_load(tokens, codes, side, self.codecs)
        self.records.load(tokens[:k], codes, side)
        self._needs_rewrite = False
        self._committed = k
        self._disk_count = words[6]
        rep.status = "loaded"
        rep.add("loaded", f"loaded {k} record(s) from {path} "
                f"({engine.describe_tier(ftier, tag)})", records=k)

    def _loaded_states(self, state, k):
        """The stream state of a kvq file for its first ``k`` records (refused when the file's
        state cannot be the state of those records)."""
        states = {}
        for name, (offset, scale, sinks) in state.items():
            opt = self.options[name]
            if k and len(sinks) < min(k, opt.sinks):
                raise kvq._corrupt(self.path, f"stream {name!r}: {k} record(s) but only "
                                   f"{len(sinks)} of its {opt.sinks} float32 sink rows", "state")
            if k and ((offset is None) == opt.center or (scale is None) == opt.normalize):
                raise kvq._corrupt(self.path, f"stream {name!r}: {k} record(s) but no offset or "
                                   "scales in the stream state", "state")
            states[name] = (offset, scale, sinks[:k]) if k else (None, None, sinks[:0])
        return states

    def _commit_with_window(self, fd, layout, valid):
        """The newest valid commit slot whose window slot (same letter) holds its count and seq,
        and that window; the other commit when the newest one's window slot is damaged."""
        slots = [layout.parse_window_slot(pread_exact(fd, layout.window_slot_bytes,
                                                      layout.window_slot_offset(i)))
                 for i in (0, 1)]
        for n, (idx, count, seq, tail_crc) in enumerate(sorted(valid, key=lambda v: -v[2])):
            got = slots[idx]
            if got is not None and got[:2] == (count, seq):
                if n:
                    self.report.add(
                        "window-slot", f"{self.path}: the window slot of the newest commit is "
                        f"damaged; using commit slot {'AB'[idx]} (count {count}, seq {seq}) and "
                        "its window", slot=idx, count=count)
                return (idx, count, seq, tail_crc), got[2]
        raise kvq._corrupt(self.path, "no commit slot has its recent window (both window slots "
                           "are damaged or belong to other commits)", "window")

    def _loaded_window(self, name, rows, count, k):
        """Window copies of the commit's last len(rows) rows, for the k records kept."""
        coded = count - min(count, self.options[name].sinks)
        if len(rows) > coded:
            raise kvq._corrupt(self.path, f"stream {name!r}: a window of {len(rows)} rows for "
                               f"{coded} coded row(s)", "window")
        return rows[:max(0, len(rows) - (count - k))]

    def _upgrade(self, tokens, codes, side, k):
        prepared, placeholders, inert = {}, {}, 0
        for s in self.streams:
            c = self.codecs[s.name]
            if c.spec == "f32" and self.options[s.name].plain:
                prepared[s.name] = self.records.prepare_encoded(s.name, codes[s.name][:k],
                                                                side[s.name][:k])
                continue
            X = codes[s.name][:k].view("<f4").reshape(k, s.rows, s.dim)
            inert += int((~np.isfinite(X).all(axis=2)).sum()) if k else 0
            prepared[s.name], placeholders[s.name] = self._prepare_floats(
                s, X, build_codec(c.spec, c.dim, "inert"))
        self.records.extend(tokens[:k], prepared, placeholders)
        self.report.status = "upgraded"
        self.report.add(
            "upgraded", f"f32 .coli_kv (v1) quantized in memory ({k} record(s)"
            + (f", {inert} row(s) with NaN/inf stored inert" if inert else "")
            + f"); it will be rewritten as {engine.describe_tier(self.tier, self._engine_tag)} "
            "at the first save (the v1 file is untouched until then)", records=k,
            inert_rows=inert)
        self._needs_rewrite = True

    def _check_context(self, count, ftier):
        if self._max_records is not None and count > self._max_records:
            raise CacheFileMismatch(
                f"{self.path}: saved conversation ({count} tokens) exceeds the context "
                f"({self._max_records}): refusing it", "context", self.path, ftier)

    def _check_tokens_loaded(self, tokens, k):
        bad = tokens[:k] < 0
        if self.vocab:
            bad |= tokens[:k] >= self.vocab
        if bad.any():
            first = int(np.argmax(bad))
            self.report.add("bad-token", f"{self.path}: record {first} holds token id "
                            f"{int(tokens[first])}, outside [0, {self.vocab or 2**31}): cut to "
                            f"{first} record(s)", record=first, token=int(tokens[first]))
            return first
        return k

    def _post_load(self, tokens, codes, side, codecs):
        """Bad side values -> inert rows (reported); bad token ids -> cut. Returns (records
        kept, whether any row was changed)."""
        k = self._check_tokens_loaded(tokens, len(tokens))
        changed = False
        for s in self.streams:
            c = codecs[s.name]
            bad_side, bad_code = sanitize_rows(codes[s.name][:k], side[s.name][:k],
                                               side_kind(c), c.family == "kv8")
            if bad_side.size:
                changed = True
                low = "<= 0" if side_kind(c) == "scale" else "< 0"
                self.report.add(
                    "bad-side", f"{self.path}: stream {s.name}: {bad_side.size} record(s) with "
                    f"side values out of range (NaN, inf, or {low}; first record "
                    f"{int(bad_side[0])}): those rows were made inert",
                    stream=s.name, records=bad_side.tolist()[:100], n=int(bad_side.size))
            if bad_code.size:
                changed = True
                self.report.add(
                    "bad-code", f"{self.path}: stream {s.name}: {bad_code.size} record(s) with "
                    f"fp8 NaN bytes (0x7F/0xFF; first record {int(bad_code[0])}): set to 0",
                    stream=s.name, records=bad_code.tolist()[:100], n=int(bad_code.size))
        return k, changed

    def _load_kvq(self, fd, size, head):
        rep, path = self.report, self.path
        rep.file_tier = "kvq"
        header, header_crc, data_offset, header_json = kvq.read_header(path, head, size)
        file_streams = [(s["name"], s["dim"], s["rows"]) for s in header["streams"]]
        running = [(s.name, s.dim, s.rows) for s in self.streams]
        if header["model"] != self._model or file_streams != running:
            return self._ignored(
                f"ignoring {path}: a kvq cache of a different model (file {header['model']}, "
                f"streams {file_streams}; running {self._model}, streams {running})")
        if self._tier_arg == "engine":
            raise CacheFileMismatch(
                f"{path} is a {engine.describe_tier('kvq')} cache file; the running mode is "
                f"{self._describe_running()}: refusing it (open with tier='auto' or 'kvq' to "
                "resume it)", "tier", path, "kvq")
        for fs in header["streams"]:
            mine = codec_identity(self.codecs[fs["name"]])
            for key, reason, label in _IDENTITY_CHECKS:
                fv, rv = _get(fs, key), _get(mine, key)
                if fv != rv:
                    raise CacheFileMismatch(
                        f"{path}: stream {fs['name']!r} was written with {label} "
                        f"{_show(key, fv)} ({fs['spec']}), the running codec has "
                        f"{_show(key, rv)} ({mine['spec']}): refusing it", reason, path, "kvq")
            file_opts = StreamOptions(**fs.get("options", {}))
            if file_opts != self.options[fs["name"]]:
                raise CacheFileMismatch(
                    f"{path}: stream {fs['name']!r} was written as "
                    f"{file_opts.stream_spec(fs['spec'])!r}, the running stream is "
                    f"{self.mode[fs['name']]!r}: its codes hold rows after another offset, "
                    "scales or sinks; refusing it (open with the file's stream spec to resume it)",
                    "options", path, "kvq")
        layout = self._kvq_layout(header["block_records"])
        if layout.record_bytes != header["record_bytes"]:
            raise kvq._corrupt(path, "record size disagrees with the codecs", "header")
        layout.adopt_file_header(header, header_json)
        valid, invalid = kvq.read_slots(head, header_crc)
        if not valid:
            raise kvq._corrupt(path, "both commit slots fail their checksum", "commit")
        windows = None
        if layout.window_streams:
            (idx, count, seq, tail_crc), windows = self._commit_with_window(fd, layout, valid)
        else:
            idx, count, seq, tail_crc = max(valid, key=lambda v: v[2])
        if invalid:
            rep.add("commit-slot", f"{path}: commit slot {'AB'[invalid[0]]} is damaged; using "
                    f"slot {'AB'[idx]} (count {count}, seq {seq})", slot=idx, count=count)
        rep.header_count = count
        self._check_context(count, "kvq")
        B, rec, stride = layout.block_records, layout.record_bytes, layout.stride
        full, tail = divmod(count, B)
        needed = full * stride + tail * rec
        avail = max(0, size - data_offset)
        buf = pread_exact(fd, min(needed, avail), data_offset)
        good, problem, parts = kvq.verify_blocks(buf, count, layout, tail_crc)
        if problem:
            kind, at = problem
            if kind == "truncated":
                rep.add("truncated", f"{path} is shorter than its count: {count} record(s) "
                        f"committed, intact blocks hold {good}; cut to {good}",
                        count=count, kept=good)
            else:
                rep.add("corrupt-block", f"{path}: block {at // B} (records {at}.."
                        f"{min(count, at + B) - 1}) fails its checksum: cut to {at} record(s), "
                        f"{count - at} dropped", block=at // B, kept=at, count=count)
        elif avail > needed:
            rep.add("uncommitted-tail", f"{path}: {avail - needed} byte(s) past the committed "
                    "records ignored (an append that did not commit, or a truncation)")
        tokens, codes, side = layout.from_bytes(b"".join(parts), good)
        k, changed = self._post_load(tokens, codes, side, self.codecs)
        states = None
        if layout.state_streams:
            state = layout.parse_state(
                path, pread_exact(fd, layout.state_bytes, layout.state_offset))
            states = self._loaded_states(state, k)
        windows = {name: self._loaded_window(name, rows, count, k)
                   for name, rows in (windows or {}).items()}
        self.records.load(tokens[:k], codes, side, states, windows)
        self.tier = "kvq"
        self._engine_tag = None
        self._layout = layout
        self._committed = k
        self._disk_count = count
        self._slot = (idx, seq)
        # Our tier keeps memory equal to disk (block checksums are extended from memory):
        # rows made inert on load are written back by a full rewrite at the first save, as is
        # a file whose commit sequence number is about to run out.
        self._needs_rewrite = changed or seq >= 2**62
        rep.status = "loaded"
        rep.add("loaded", f"loaded {k} record(s) from {path} (kvq, checksums verified)",
                records=k)

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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

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
            encs = [v if isinstance(v, EncodedRows) else c.encode(v, self._n_threads)
                    for v in value]
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
                    self._fd = os.open(self.path, os.O_RDWR)
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
                self._fd = os.open(self.path, os.O_RDWR)
            self._write_count(new)
            self._committed = new
        except OSError as exc:
            self._needs_rewrite = True
            raise CacheFileSaveError(exc, 0, what="truncate") from exc
        return n

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
        fd = write_new_file(self.path, chunks)
        self.close()
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

