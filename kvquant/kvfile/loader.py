"""Reading a cache file into a :class:`~kvquant.kvfile.cachefile.CacheFile`: the tier from the
magic, the engine's header words or our checksummed header, refusal on any mismatch of codec
identity or stream options, the records (cut at the first damaged block, bad token or short
tail), bad side values made inert, a v1 file upgraded in memory; every step in the load report.

:func:`load` is the one entry; the CacheFile it fills owns the records and writes the file."""
import hashlib
import os

import numpy as np

from kvquant.kvfile import engine, kvq
from kvquant.kvfile.errors import CacheFileMismatch, CacheFileRefused
from kvquant.kvfile.fileio import open_regular, pread_exact
from kvquant.kvfile.identity import build_codec, codec_identity, sanitize_rows, side_kind
from kvquant.kvfile.records import CacheRecords
from kvquant.streams.options import StreamOptions

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


def load(cf):
    """Fill ``cf`` (its records, tier, layout, commit state and report) from the file at
    ``cf.path``, or leave it empty with the reason in ``cf.report``."""
    try:
        fd, st = open_regular(cf.path, os.O_RDONLY)
    except FileNotFoundError:
        cf.report.add("new", f"no cache file at {cf.path}: starting empty")
        return
    if fd is None:   # never started over: a save would rename a file over it
        raise CacheFileMismatch(
            f"{cf.path} is {st}, not a cache file: refusing to read or replace it (give the "
            "path of a regular file)", "not-a-file", cf.path, None)
    try:
        size = st.st_size
        if cf._lock_state is not None and cf._lock_state[0] == "busy":
            # another writer holds the file: read it once, whole, and remember what was read,
            # so that a first write after that writer closes can tell whether it changed
            snapshot = pread_exact(fd, size, 0)
            size = len(snapshot)
            cf._view = (st.st_dev, st.st_ino, size, hashlib.sha256(snapshot).digest())

            def read(n, offset):
                return snapshot[offset:offset + n]
        else:
            def read(n, offset):
                return pread_exact(fd, n, offset)
        head = read(min(size, _HEAD_BYTES), 0)
        try:
            _load_from(cf, read, size, head)
        except CacheFileRefused as exc:
            _refused(cf, exc)
    finally:
        os.close(fd)


def _refused(cf, exc):
    if cf._on_mismatch == "raise":
        raise exc
    cf.records = CacheRecords(cf.streams, cf.codecs, cf.options, cf.statistics)
    cf.report.status = "started-over"
    cf.report.add("refused", f"{exc}; starting over (the file is kept until the first "
                  "save)", reason=exc.reason)
    cf._needs_rewrite = True


def _ignored(cf, message, **detail):
    cf.report.status = "ignored"
    cf.report.add("ignored", f"{message}; starting over (the file is kept until the "
                  "first save)", **detail)


def _load_from(cf, read, size, head):
    rep = cf.report
    if size == 0:
        rep.add("new", f"{cf.path} is empty: starting empty")
        return
    magic = head[:8]
    if magic == kvq.MAGIC:
        return _load_kvq(cf, read, size, head)
    known = (kvq.MAGIC, *engine.MAGICS.values())
    if size < 8 and any(m.startswith(head) for m in known):
        return _ignored(cf, f"ignoring {cf.path}: a torn header ({size} bytes)")
    if head.startswith(engine.MAGIC_PREFIX):
        if magic not in engine.TIER_OF_MAGIC:
            return _ignored(cf, f"ignoring {cf.path}: a .coli_kv of another version "
                            f"(magic {magic!r})")
        if size < engine.HEADER_BYTES:
            return _ignored(cf, f"ignoring {cf.path}: the .coli_kv header is short "
                            f"({size} of {engine.HEADER_BYTES} bytes)")
        ftier, words = engine.parse_header(head)
        return _load_engine(cf, read, size, ftier, words)
    raise CacheFileMismatch(
        f"{cf.path} is not a cache file (magic {bytes(magic)!r}): refusing to read or "
        "overwrite it", "not-a-cache", cf.path, None)


def _load_engine(cf, read, size, ftier, words):
    rep, path = cf.report, cf.path
    rep.file_tier = ftier
    count, tag = words[6], words[7]
    rep.header_count = count
    if cf.shape is None:
        return _ignored(cf, f"ignoring {path}: a .coli_kv holds an MLA model; this cache "
                        f"holds streams {[s.name for s in cf.streams]}",
                        words=list(words))
    if tuple(words[:6]) != cf.shape.engine_words:
        diff = ", ".join(f"{k} {a} != {b}" for k, a, b in zip(
            engine.WORD_NAMES[:6], words[:6], cf.shape.engine_words) if a != b)
        return _ignored(cf, f"ignoring {path}: a .coli_kv from a different model or "
                        f"version ({diff})", words=list(words))
    expected = {"v1": engine.TAG_F32, "v2": engine.TAG_FP8}.get(ftier)
    if (expected is not None and tag != expected) or (
            ftier == "v3" and engine.tier_of_tag(tag) != "v3"):
        raise CacheFileMismatch(
            f"{path}: a {engine.describe_tier(ftier)} header with format tag {tag} (the "
            f"engine writes {expected if expected is not None else 'codec<<8|bits'}): not "
            "a file this reader understands; refusing it", "tag", path, ftier)
    file_spec = {"v1": "f32", "v2": "kv8"}.get(ftier) or engine.spec_of_tag(tag)
    upgrade = ftier == "v1" and cf.tier != "v1"
    if not upgrade and ftier != cf.tier:
        resume = f" (open with mode={file_spec!r} to resume it)" if file_spec else ""
        raise CacheFileMismatch(
            f"{path} is a {engine.describe_tier(ftier, tag)} .coli_kv; the running mode is "
            f"{cf._describe_running()}: refusing it{resume}", "tier", path, ftier)
    if ftier == "v3" and tag != cf._engine_tag:
        same_codec = (tag >> 8) == (cf._engine_tag >> 8)
        raise CacheFileMismatch(
            f"{path}: v3 {engine.describe_tag(tag)} ({file_spec or 'unknown codec'}) != "
            f"running {engine.describe_tag(cf._engine_tag)} ({cf.mode['L']}): "
            "refusing it", "bits" if same_codec else "codec", path, ftier)
    if count < 0:
        rep.add("count", f"{path}: negative committed count {count}: treated as 0",
                count=count)
        count = 0
    _check_context(cf, count, ftier)
    if upgrade:
        f32 = {s.name: build_codec("f32", s.dim, "inert") for s in cf.streams}
        layout = engine.EngineLayout("v1", cf.shape, f32)
    else:
        layout = cf._layout
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
    buf = read(n * rec, engine.HEADER_BYTES)
    n = min(n, len(buf) // rec)
    tokens, codes, side = layout.from_bytes(buf, n)
    if upgrade:
        k, _ = _post_load(cf, tokens, codes, side, f32)
        _upgrade(cf, tokens, codes, side, k)
        return
    k, _ = _post_load(cf, tokens, codes, side, cf.codecs)
    cf.records.load(tokens[:k], codes, side)
    cf._needs_rewrite = False
    cf._committed = k
    cf._disk_count = words[6]
    rep.status = "loaded"
    rep.add("loaded", f"loaded {k} record(s) from {path} "
            f"({engine.describe_tier(ftier, tag)})", records=k)


def _loaded_states(cf, state, k):
    """The stream state of a kvq file for its first ``k`` records (refused when the file's
    state cannot be the state of those records)."""
    states = {}
    for name, (offset, scale, sinks) in state.items():
        opt = cf.options[name]
        if k and len(sinks) < min(k, opt.sinks):
            raise kvq._corrupt(cf.path, f"stream {name!r}: {k} record(s) but only "
                               f"{len(sinks)} of its {opt.sinks} float32 sink rows", "state")
        if k and ((offset is None) == opt.center or (scale is None) == opt.normalize):
            raise kvq._corrupt(cf.path, f"stream {name!r}: {k} record(s) but no offset or "
                               "scales in the stream state", "state")
        states[name] = (offset, scale, sinks[:k]) if k else (None, None, sinks[:0])
    return states


def _commit_with_window(cf, read, layout, valid):
    """The newest valid commit slot whose window slot (same letter) holds its count and seq,
    and that window; the other commit when the newest one's window slot is damaged."""
    slots = [layout.parse_window_slot(read(layout.window_slot_bytes,
                                                  layout.window_slot_offset(i)))
             for i in (0, 1)]
    for n, (idx, count, seq, tail_crc) in enumerate(sorted(valid, key=lambda v: -v[2])):
        got = slots[idx]
        if got is not None and got[:2] == (count, seq):
            if n:
                cf.report.add(
                    "window-slot", f"{cf.path}: the window slot of the newest commit is "
                    f"damaged; using commit slot {'AB'[idx]} (count {count}, seq {seq}) and "
                    "its window", slot=idx, count=count)
            return (idx, count, seq, tail_crc), got[2]
    raise kvq._corrupt(cf.path, "no commit slot has its recent window (both window slots "
                       "are damaged or belong to other commits)", "window")


def _loaded_window(cf, name, rows, count, k):
    """Window copies of the commit's last len(rows) rows, for the k records kept."""
    coded = count - min(count, cf.options[name].sinks)
    if len(rows) > coded:
        raise kvq._corrupt(cf.path, f"stream {name!r}: a window of {len(rows)} rows for "
                           f"{coded} coded row(s)", "window")
    return rows[:max(0, len(rows) - (count - k))]


def _upgrade(cf, tokens, codes, side, k):
    prepared, placeholders, inert = {}, {}, 0
    for s in cf.streams:
        c = cf.codecs[s.name]
        if c.spec == "f32" and cf.options[s.name].plain:
            prepared[s.name] = cf.records.prepare_encoded(s.name, codes[s.name][:k],
                                                          side[s.name][:k])
            continue
        X = codes[s.name][:k].view("<f4").reshape(k, s.rows, s.dim)
        inert += int((~np.isfinite(X).all(axis=2)).sum()) if k else 0
        prepared[s.name], placeholders[s.name] = cf._prepare_floats(
            s, X, build_codec(c.spec, c.dim, "inert"))
    cf.records.extend(tokens[:k], prepared, placeholders)
    cf.report.status = "upgraded"
    cf.report.add(
        "upgraded", f"f32 .coli_kv (v1) quantized in memory ({k} record(s)"
        + (f", {inert} row(s) with NaN/inf stored inert" if inert else "")
        + f"); it will be rewritten as {engine.describe_tier(cf.tier, cf._engine_tag)} "
        "at the first save (the v1 file is untouched until then)", records=k,
        inert_rows=inert)
    cf._needs_rewrite = True


def _check_context(cf, count, ftier):
    if cf._max_records is not None and count > cf._max_records:
        raise CacheFileMismatch(
            f"{cf.path}: saved conversation ({count} tokens) exceeds the context "
            f"({cf._max_records}): refusing it", "context", cf.path, ftier)


def _check_tokens_loaded(cf, tokens, k):
    bad = tokens[:k] < 0
    if cf.vocab:
        bad |= tokens[:k] >= cf.vocab
    if bad.any():
        first = int(np.argmax(bad))
        cf.report.add("bad-token", f"{cf.path}: record {first} holds token id "
                      f"{int(tokens[first])}, outside [0, {cf.vocab or 2**31}): cut to "
                      f"{first} record(s)", record=first, token=int(tokens[first]))
        return first
    return k


def _post_load(cf, tokens, codes, side, codecs):
    """Bad side values -> inert rows (reported); bad token ids -> cut. Returns (records
    kept, whether any row was changed)."""
    k = _check_tokens_loaded(cf, tokens, len(tokens))
    changed = False
    for s in cf.streams:
        c = codecs[s.name]
        bad_side, bad_code = sanitize_rows(codes[s.name][:k], side[s.name][:k],
                                           side_kind(c), c.family == "kv8")
        if bad_side.size:
            changed = True
            low = "<= 0" if side_kind(c) == "scale" else "< 0"
            cf.report.add(
                "bad-side", f"{cf.path}: stream {s.name}: {bad_side.size} record(s) with "
                f"side values out of range (NaN, inf, or {low}; first record "
                f"{int(bad_side[0])}): those rows were made inert",
                stream=s.name, records=bad_side.tolist()[:100], n=int(bad_side.size))
        if bad_code.size:
            changed = True
            cf.report.add(
                "bad-code", f"{cf.path}: stream {s.name}: {bad_code.size} record(s) with "
                f"fp8 NaN bytes (0x7F/0xFF; first record {int(bad_code[0])}): set to 0",
                stream=s.name, records=bad_code.tolist()[:100], n=int(bad_code.size))
    return k, changed


def _check_model_id(cf, file_id):
    """Refuse a kvq file recording another model identity (or one the running cache does not
    give); report a file that records none."""
    mine = cf.model_id
    if file_id == mine:
        return
    if file_id is None:
        cf.report.add("model-id", f"{cf.path} records no model identity: {mine} not checked "
                      "(a file written without model_id)")
        return
    if mine is None:
        raise CacheFileMismatch(
            f"{cf.path} records model identity {file_id}; this cache was opened without "
            "model_id: refusing it (open with model_id= the running model's identity, e.g. "
            "kvquant.kvfile.model_digest(model_path), to resume it)", "model", cf.path, "kvq")
    raise CacheFileMismatch(
        f"{cf.path} was written for model {file_id}, the running model is {mine}: its rows "
        "belong to other weights; refusing it", "model", cf.path, "kvq")


def _load_kvq(cf, read, size, head):
    rep, path = cf.report, cf.path
    rep.file_tier = "kvq"
    header, header_crc, data_offset, header_json = kvq.read_header(path, head, size)
    file_streams = [(s["name"], s["dim"], s["rows"]) for s in header["streams"]]
    running = [(s.name, s.dim, s.rows) for s in cf.streams]
    if header["model"] != cf._model or file_streams != running:
        return _ignored(
            cf, f"ignoring {path}: a kvq cache of a different model (file {header['model']}, "
            f"streams {file_streams}; running {cf._model}, streams {running})")
    if cf._tier_arg == "engine":
        raise CacheFileMismatch(
            f"{path} is a {engine.describe_tier('kvq')} cache file; the running mode is "
            f"{cf._describe_running()}: refusing it (open with tier='auto' or 'kvq' to "
            "resume it)", "tier", path, "kvq")
    for fs in header["streams"]:
        mine = codec_identity(cf.codecs[fs["name"]])
        for key, reason, label in _IDENTITY_CHECKS:
            fv, rv = _get(fs, key), _get(mine, key)
            if fv != rv:
                raise CacheFileMismatch(
                    f"{path}: stream {fs['name']!r} was written with {label} "
                    f"{_show(key, fv)} ({fs['spec']}), the running codec has "
                    f"{_show(key, rv)} ({mine['spec']}): refusing it", reason, path, "kvq")
        file_opts = StreamOptions(**fs.get("options", {}))
        if file_opts != cf.options[fs["name"]]:
            raise CacheFileMismatch(
                f"{path}: stream {fs['name']!r} was written as "
                f"{file_opts.stream_spec(fs['spec'])!r}, the running stream is "
                f"{cf.mode[fs['name']]!r}: its codes hold rows after another offset, "
                "scales or sinks; refusing it (open with the file's stream spec to resume it)",
                "options", path, "kvq")
        running = cf._statistics_digests.get(fs["name"])
        if fs.get("statistics") != running:
            raise CacheFileMismatch(
                f"{path}: stream {fs['name']!r} was written with calibrated statistics "
                f"{fs.get('statistics') or '(none)'}, the running stream has "
                f"{running or '(none)'}: its codes hold rows after other offsets and scales; "
                "refusing it (open with the statistics it was written with)",
                "statistics", path, "kvq")
    _check_model_id(cf, header.get("model_id"))
    layout = cf._kvq_layout(header["block_records"])
    if layout.record_bytes != header["record_bytes"]:
        raise kvq._corrupt(path, "record size disagrees with the codecs", "header")
    layout.adopt_file_header(header, header_json)
    valid, invalid = kvq.read_slots(head, header_crc)
    if not valid:
        raise kvq._corrupt(path, "both commit slots fail their checksum", "commit")
    windows = None
    if layout.window_streams:
        (idx, count, seq, tail_crc), windows = _commit_with_window(cf, read, layout, valid)
    else:
        idx, count, seq, tail_crc = max(valid, key=lambda v: v[2])
    if invalid:
        rep.add("commit-slot", f"{path}: commit slot {'AB'[invalid[0]]} is damaged; using "
                f"slot {'AB'[idx]} (count {count}, seq {seq})", slot=idx, count=count)
    rep.header_count = count
    _check_context(cf, count, "kvq")
    B, rec, stride = layout.block_records, layout.record_bytes, layout.stride
    full, tail = divmod(count, B)
    needed = full * stride + tail * rec
    avail = max(0, size - data_offset)
    buf = read(min(needed, avail), data_offset)
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
    k, changed = _post_load(cf, tokens, codes, side, cf.codecs)
    states = None
    if layout.state_streams:
        state = layout.parse_state(
            path, read(layout.state_bytes, layout.state_offset))
        states = _loaded_states(cf, state, k)
    windows = {name: _loaded_window(cf, name, rows, count, k)
               for name, rows in (windows or {}).items()}
    cf.records.load(tokens[:k], codes, side, states, windows)
    cf.tier = "kvq"
    cf._engine_tag = None
    cf._layout = layout
    cf._committed = k
    cf._disk_count = count
    cf._slot = (idx, seq)
    # Our tier keeps memory equal to disk (block checksums are extended from memory):
    # rows made inert on load are written back by a full rewrite at the first save, as is
    # a file whose commit sequence number is about to run out.
    cf._needs_rewrite = changed or seq >= 2**62
    rep.status = "loaded"
    if problem or k < good:
        rep.add("loaded", f"loaded {k} of the {count} record(s) committed in {path} (kvq; "
                f"{count - k} lost, see above)", records=k, lost=count - k)
    else:
        rep.add("loaded", f"loaded {k} record(s) from {path} (kvq, checksums verified)",
                records=k)
