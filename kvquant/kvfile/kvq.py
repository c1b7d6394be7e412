"""Our self-describing tier (``kvq``): everything the engine's header forgets, and checksums.

Layout (little-endian)::

    0    8  magic b"KVQCACHE"
    8    4  u32 format version: 1, or 2 when a stream has stream options (below)
    12   4  u32 header length J
    16   4  u32 CRC32 of the header JSON
    20   4  u32 CRC32 of bytes 0..19
    24  24  commit slot A: u64 count, u64 seq, u32 tail CRC, u32 CRC32(slot bytes 0..19, seeded
            with the header CRC, so that a slot never validates against another header)
    48  24  commit slot B (same)
    72   J  header JSON (sorted keys): model shape, streams with codec spec, family, bits,
            dim, code bytes, side-value count, kind and dtype, engine tag, rotation (identity,
            seed, sign hash, ordering), codebook (identity, SHA-256 of its levels), record bytes,
            records per block, and ``model_id`` (the model's identity) only when one was given.
            Every field's type and range is checked on reading; a field this kvquant does not
            know is refused (a newer writer's)
    S       version 2 only, S = 72 + J rounded up to 8: the stream state, ``state_bytes`` long:
            u32 CRC32 of the rest (seeded with the header CRC), u32 0, then per stream with
            options, in header order: u32 flags (1: offset set, 2: scales set), u32 sink rows
            held h (<= sinks), f32 offset (rows x dim) if ``center``, f32 scales (rows x dim)
            if ``normalize``, f32 sink rows (h x rows x dim)
    R       version 2 with a ``recent`` window only, R = S + state_bytes rounded up to 8: two
            window slots A and B (paired with commit slots A and B), ``window_slot_bytes``
            each: u64 count, u64 seq (those of the commit it belongs to), u32 CRC32 of count,
            seq and the rest (seeded with the header CRC), u32 0, then per stream with a
            window, in header order: u32 rows held h (<= recent), u32 0, f32 copies of the
            last h rows (recent x rows x dim; unheld ones zero)
    D       data, D = 72 + J (version 2: the end of S, or of R) rounded up to 8: blocks of
            ``block_records`` records; a full block is followed by the u32 CRC32 of its bytes

A record is: i32 token, then per stream in header order its codes (rows x code_bytes) and
its side values (rows x n_side, f32 or f16 as the stream's ``side_dtype`` says; a header without
``side_dtype``, written before it existed, means f32). The commit slot with the highest seq whose
CRC holds is the commit: its count says how many records exist and its tail CRC covers the
records of the last, partial block (whose trailer is not written yet). Appends write the records
(and the trailers of the blocks they complete), fsync, then write the other slot and fsync: a
crash at any point leaves the previous slot valid and every block it covers intact.

Stream options (``"polar5@center,normalize,sinks=1"``, :mod:`kvquant.streams.options`) are in
the stream's header entry (``options``); a stream with calibrated statistics
(``center=calib``, :mod:`kvquant.streams.calibration`) also records their digest
(``statistics``, ``"sha256:<hex>"``), and a file is resumed only under the same statistics; the
state they build (offset and scales from the first
append, float32 rows of the first ``sinks`` tokens, whose records hold a zero row's codes) is
written only by a whole-file rewrite, which the cache does whenever an append changes it (the
first append, and appends while fewer than ``sinks`` tokens are held). A commit count below the
sink rows held means the first ``count`` of them; a count of 0 means no offset or scales.

A ``recent=W`` window's float32 copies of the last rows change with every append: before a
commit slot is written, the window slot of the same letter is written with the window of the
new count and seq, and fsynced. The loader takes the newest valid commit slot whose window slot
holds its count and seq (falling back to the other commit when that window slot is damaged);
a crash before a commit leaves the old commit slot and its window slot untouched.
"""
import json
import re
import struct
import zlib

import numpy as np

from kvquant.codecs.base import SIDE_DTYPES
from kvquant.kvfile.errors import CacheFileCorrupt, CacheFileMismatch
from kvquant.kvfile.identity import codec_identity, side_bytes
from kvquant.kvfile.modelid import is_model_id
from kvquant.kvfile.schema import INT32_MAX, SIDE_MAX, STREAM_NAME
from kvquant.streams.options import MAX_RECENT, MAX_SINKS, StreamOptions

MAGIC = b"KVQCACHE"
VERSION = 1            # files without stream options (unchanged since the first kvq files)
STATE_VERSION = 2      # files with a stream-state area
VERSIONS = (VERSION, STATE_VERSION)
STATE_HEAD = struct.Struct("<II")
WINDOW_HEAD = struct.Struct("<QQII")
NO_COUNT = (1 << 64) - 1   # the count of a window slot that holds no window
PREFIX = struct.Struct("<8sIIII")
SLOT = struct.Struct("<QQII")
SLOT_BODY = struct.Struct("<QQI")
SLOT_OFFSETS = (24, 48)
HEADER_OFFSET = 72
MAX_HEADER_BYTES = 1 << 20
MAX_STREAMS = 64
MAX_RECORD_BYTES = 1 << 31
DEFAULT_BLOCK_BYTES = 1 << 16
MAX_BLOCK_RECORDS = 1 << 16
FORMAT_NAME = "kvquant-cache"


def _align8(n):
    return (n + 7) & ~7


class KvqLayout:
    """Record and block layout of a kvq file for given streams and codecs."""

    def __init__(self, model, streams, codecs, block_records=None, writer="", options=None,
                 held=None, model_id=None, statistics=None):
        """``options``: StreamOptions by stream name; ``held``: sink rows held by stream name
        (they size the state area of a file written with this layout); ``model_id``: the
        model's identity (a header without it is byte for byte the one written before it
        existed); ``statistics``: by stream name, the digest of the calibrated statistics of
        a stream whose options say calibrated (recorded in its header entry)."""
        self.statistics = dict(statistics or {})
        self.model = dict(model)
        self.streams = list(streams)
        self.codecs = dict(codecs)
        options, held = options or {}, held or {}
        self.options = {s.name: options.get(s.name, StreamOptions()) for s in self.streams}
        self.state_streams = [s for s in self.streams if not self.options[s.name].plain]
        self.version = STATE_VERSION if self.state_streams else VERSION
        self.state_bytes = (STATE_HEAD.size + sum(_stream_state_bytes(
            s.rows, s.dim, self.options[s.name], held.get(s.name, 0))
            for s in self.state_streams) if self.state_streams else 0)
        self.window_streams = [s for s in self.state_streams if self.options[s.name].recent]
        self.window_slot_bytes = (WINDOW_HEAD.size + sum(_window_bytes(
            s.rows, s.dim, self.options[s.name]) for s in self.window_streams)
            if self.window_streams else 0)
        fields = [("token", "<i4")]
        for s in self.streams:
            c = self.codecs[s.name]
            fields.append((s.name + ".codes", "u1", (s.rows, c.code_bytes)))
            if c.n_side:
                fields.append((s.name + ".side", SIDE_DTYPES[c.side_dtype], (s.rows, c.n_side)))
        self.dtype = np.dtype(fields)
        self.record_bytes = self.dtype.itemsize
        if self.record_bytes > MAX_RECORD_BYTES:
            raise ValueError(f"a record of {self.record_bytes} bytes is too large")
        if block_records is None:
            block_records = max(1, min(MAX_BLOCK_RECORDS, DEFAULT_BLOCK_BYTES // self.record_bytes))
        if not (1 <= int(block_records) <= MAX_BLOCK_RECORDS):
            raise ValueError(
                f"block_records must be in 1..{MAX_BLOCK_RECORDS}, got {block_records}")
        self.block_records = int(block_records)
        self.stride = self.block_records * self.record_bytes + 4
        stream_entries = []
        for s in self.streams:
            entry = {"name": s.name, "rows": s.rows, **codec_identity(self.codecs[s.name])}
            if not self.options[s.name].plain:
                entry["options"] = self.options[s.name].as_dict()
            if s.name in self.statistics:
                entry["statistics"] = self.statistics[s.name]
            stream_entries.append(entry)
        self.header = {
            "format": FORMAT_NAME,
            "version": self.version,
            "byteorder": "little",
            "token": "int32",
            "model": self.model,
            "record_bytes": self.record_bytes,
            "block_records": self.block_records,
            "streams": stream_entries,
            "writer": writer,
        }
        if self.state_streams:
            self.header["state_bytes"] = self.state_bytes
        if self.window_streams:
            self.header["window_slot_bytes"] = self.window_slot_bytes
        if model_id is not None:
            self.header["model_id"] = model_id
        header_json = json.dumps(self.header, sort_keys=True, separators=(",", ":")).encode()
        if len(header_json) > MAX_HEADER_BYTES:
            raise ValueError("the kvq header would exceed 1 MiB")
        self._set_header_json(header_json)

    def _set_header_json(self, header_json):
        self.header_json = header_json
        self.header_crc = zlib.crc32(header_json)
        self.state_offset = _align8(HEADER_OFFSET + len(header_json))
        self.window_offset = _align8(self.state_offset + self.state_bytes)
        self.data_offset = _align8(self.window_offset + 2 * self.window_slot_bytes)

    def adopt_file_header(self, header, header_json):
        """Take the header of the file being resumed (already checked to describe these
        streams and codecs): its bytes seed the commit-slot and state checksums and place the
        data, and they differ from this layout's own whenever the file was written by another
        kvquant version (the ``writer`` field) or before a header field existed."""
        self.header = header
        self.version = header["version"]
        self.state_bytes = header.get("state_bytes", 0)
        self.window_slot_bytes = header.get("window_slot_bytes", 0)
        self._set_header_json(bytes(header_json))

    # -- fixed parts ---------------------------------------------------------------------------
    def prefix(self):
        head = PREFIX.pack(MAGIC, self.version, len(self.header_json), self.header_crc, 0)[:20]
        return head + struct.pack("<I", zlib.crc32(head))

    def slot(self, count, seq, tail_crc):
        body = SLOT_BODY.pack(count, seq, tail_crc)
        return body + struct.pack("<I", zlib.crc32(body, self.header_crc))

    def file_head(self, count, tail_crc, records=None):
        """Everything before the data: prefix, slot A (the commit), slot B (empty), header, and
        (version 2) the stream state of ``records``."""
        head = (self.prefix() + self.slot(count, 1, tail_crc) + self.slot(0, 0, 0)
                + self.header_json)
        head += b"\0" * (self.state_offset - len(head))
        if self.state_streams:
            head += self.state_area(records)
        if self.window_streams:
            head += b"\0" * (self.window_offset - len(head))
            head += self.window_slot(count, 1, records) + self.window_slot(NO_COUNT, 0, None)
        return head + b"\0" * (self.data_offset - len(head))

    # -- recent windows ------------------------------------------------------------------------
    def window_slot_offset(self, index):
        return self.window_offset + index * self.window_slot_bytes

    def window_slot(self, count, seq, records):
        """A window slot holding the window of the first ``count`` records for the commit of
        sequence number ``seq`` (``records`` a CacheRecords; None with NO_COUNT: an empty
        slot)."""
        parts = []
        for s in self.window_streams:
            W = self.options[s.name].recent
            rows = np.zeros((W, s.rows, s.dim), "<f4")
            held = records.window_rows(s.name, count) if records is not None else rows[:0]
            rows[:len(held)] = held
            parts.append(STATE_HEAD.pack(len(held), 0) + rows.tobytes())
        payload = b"".join(parts)
        crc = zlib.crc32(struct.pack("<QQ", count, seq) + payload, self.header_crc)
        return WINDOW_HEAD.pack(count, seq, crc, 0) + payload

    def parse_window_slot(self, buf):
        """(count, seq, {name: copies of the last rows held (h, rows, dim)}) of a window slot,
        or None when its checksum fails (a slot being written, or never written)."""
        tag = window_slot_tag(buf, self.window_slot_bytes, self.header_crc)
        if tag is None:
            return None
        out, pos = {}, WINDOW_HEAD.size
        for s in self.window_streams:
            W = self.options[s.name].recent
            held, _ = STATE_HEAD.unpack_from(buf, pos)
            pos += STATE_HEAD.size
            rows = np.frombuffer(buf, "<f4", W * s.rows * s.dim, pos).reshape(W, s.rows, s.dim)
            pos += 4 * W * s.rows * s.dim
            if held > W or not np.isfinite(rows[:held]).all():
                return None
            out[s.name] = np.array(rows[:held], np.float32)
        return tag + (out,)

    # -- stream state --------------------------------------------------------------------------
    def state_area(self, records):
        """The stream-state area for the state held by ``records`` (a CacheRecords)."""
        parts = []
        for s in self.state_streams:
            opt = self.options[s.name]
            offset, scale = records.offset(s.name), records.channel_scale(s.name)
            held = records.sink_rows(s.name)
            parts.append(STATE_HEAD.pack((offset is not None) | (scale is not None) << 1,
                                         len(held)))
            for asked, vec in ((opt.center, offset), (opt.normalize, scale)):
                if asked:
                    parts.append((np.zeros((s.rows, s.dim), "<f4") if vec is None
                                  else np.asarray(vec, "<f4")).tobytes())
            parts.append(np.asarray(held, "<f4").tobytes())
        payload = b"".join(parts)
        if STATE_HEAD.size + len(payload) != self.state_bytes:
            raise ValueError("the stream state does not fit this layout (its sink rows held "
                             "changed): build the layout from the records")
        return STATE_HEAD.pack(zlib.crc32(payload, self.header_crc), 0) + payload

    def parse_state(self, path, buf):
        """The stream state in ``buf`` (the state area as read), see :func:`parse_state`."""
        if len(buf) != self.state_bytes:
            raise _corrupt(path, f"the stream state is cut short ({len(buf)} of "
                           f"{self.state_bytes} bytes)", "state")
        return parse_state(path, buf, [(s.name, s.rows, s.dim, self.options[s.name])
                                       for s in self.state_streams], self.header_crc)

    def record_offset(self, i):
        b, r = divmod(i, self.block_records)
        return self.data_offset + b * self.stride + r * self.record_bytes

    # -- records -------------------------------------------------------------------------------
    def to_bytes(self, tokens, codes, side):
        arr = np.zeros(len(tokens), self.dtype)
        arr["token"] = tokens
        for s in self.streams:
            arr[s.name + ".codes"] = codes[s.name]
            if self.codecs[s.name].n_side:
                arr[s.name + ".side"] = side[s.name]  # exact: f16 streams hold fp16-exact values
        return arr.tobytes()

    def from_bytes(self, buf, n):
        arr = np.frombuffer(buf, self.dtype, count=n)
        codes, side = {}, {}
        for s in self.streams:
            c = self.codecs[s.name]
            codes[s.name] = np.array(arr[s.name + ".codes"], dtype=np.uint8, order="C")
            if c.n_side:
                side[s.name] = np.array(arr[s.name + ".side"], dtype=np.float32, order="C")
            else:
                side[s.name] = np.zeros((n, s.rows, 0), np.float32)
        return arr["token"].astype(np.int32), codes, side

    def data_bytes(self, start, raw, tail_crc):
        """Lay out serialized records ``raw`` starting at record index ``start``: insert the
        trailer of every block they complete. Returns (bytes, new tail CRC).

        ``tail_crc`` is the CRC of the records already in the block that ``start`` falls in.
        """
        B, rec = self.block_records, self.record_bytes
        out = []
        crc = tail_crc if start % B else 0
        i, pos, n = start, 0, len(raw) // rec
        end = start + n
        while i < end:
            block_end = (i // B + 1) * B
            stop = min(end, block_end)
            chunk = raw[pos:pos + (stop - i) * rec]
            crc = zlib.crc32(chunk, crc)
            out.append(chunk)
            pos += len(chunk)
            if stop == block_end:
                out.append(struct.pack("<I", crc))
                crc = 0
            i = stop
        return b"".join(out), crc


def window_slot_tag(buf, slot_bytes, header_crc):
    """(count, seq) of the commit whose window a window slot holds, or None (empty, torn or
    damaged)."""
    if len(buf) != slot_bytes:
        return None
    count, seq, crc, _ = WINDOW_HEAD.unpack_from(buf)
    body = struct.pack("<QQ", count, seq) + bytes(buf[WINDOW_HEAD.size:])
    if zlib.crc32(body, header_crc) != crc or count == NO_COUNT:
        return None
    return count, seq


def parse_state(path, buf, streams, header_crc):
    """The stream state in ``buf`` (a kvq file's state area as read) of ``streams``, a list of
    (name, rows, dim, StreamOptions) in header order: ``{name: (offset or None, scales or None,
    sink rows (held, rows, dim))}``. A damaged area raises CacheFileCorrupt (reason "state")."""
    if len(buf) < STATE_HEAD.size:
        raise _corrupt(path, f"the stream state is cut short ({len(buf)} bytes)", "state")
    crc, _ = STATE_HEAD.unpack_from(buf)
    if zlib.crc32(memoryview(buf)[STATE_HEAD.size:], header_crc) != crc:
        raise _corrupt(path, "the stream state fails its checksum", "state")
    state, pos = {}, STATE_HEAD.size
    for name, rows, dim, opt in streams:
        if pos + STATE_HEAD.size > len(buf):
            raise _corrupt(path, "the stream state is shorter than its streams", "state")
        flags, held = STATE_HEAD.unpack_from(buf, pos)
        pos += STATE_HEAD.size
        size = 4 * rows * dim * (opt.center + opt.normalize + held)
        if flags & ~3 or held > opt.sinks or pos + size > len(buf):
            raise _corrupt(path, f"stream {name!r}: state flags {flags:#x} / {held} sink "
                           f"rows do not fit its options {opt.as_dict()} or the state's "
                           "size", "state")
        vecs = []
        for bit, asked in ((1, opt.center), (2, opt.normalize)):
            vec = None
            if asked:
                vec = np.frombuffer(buf, "<f4", rows * dim, pos).reshape(rows, dim)
                pos += 4 * rows * dim
            if flags & bit and not asked:
                raise _corrupt(path, f"stream {name!r}: state flags {flags:#x} set for an "
                               "option the stream does not have", "state")
            vecs.append(np.array(vec, np.float32) if flags & bit else None)
        sinks = np.frombuffer(buf, "<f4", held * rows * dim, pos).reshape(
            held, rows, dim)
        pos += 4 * held * rows * dim
        offset, scale = vecs
        if not (np.isfinite(sinks).all() and (offset is None or np.isfinite(offset).all())
                and (scale is None or ((scale > 0) & (scale <= SIDE_MAX)).all())):
            raise _corrupt(path, f"stream {name!r}: the stream state holds NaN, inf or "
                           "a scale <= 0", "state")
        state[name] = (offset, scale, np.array(sinks, np.float32))
    if pos != len(buf):
        raise _corrupt(path, f"the stream state holds {len(buf) - pos} byte(s) past its "
                       "streams", "state")
    return state


# -- reading -----------------------------------------------------------------------------------
def _corrupt(path, what, reason="header"):
    return CacheFileCorrupt(
        f"{path}: kvq cache file is damaged ({what}); refusing it rather than overwriting it "
        "(open with on_mismatch='start_over' to replace it at the first save)",
        reason, path, "kvq")


def read_header(path, head, size):
    """Validate the prefix and header of a kvq file. ``head`` holds at least the first
    min(size, 72 + 1 MiB) bytes. Returns (header dict, header_crc, data_offset, header bytes)."""
    if size < HEADER_OFFSET:
        raise _corrupt(path, f"the file is {size} bytes, shorter than the 72-byte kvq prefix")
    magic, version, hlen, hcrc, pcrc = PREFIX.unpack_from(head)
    if zlib.crc32(head[:20]) != pcrc:
        raise _corrupt(path, "the prefix checksum does not match")
    if version not in VERSIONS:
        raise CacheFileMismatch(
            f"{path}: kvq cache file of format version {version}; this kvquant reads versions "
            f"{', '.join(map(str, VERSIONS))}: refusing it", "version", path, "kvq")
    if hlen > MAX_HEADER_BYTES or HEADER_OFFSET + hlen > size:
        raise _corrupt(path, f"header length {hlen} runs past the end of the file ({size} bytes)")
    raw = bytes(head[HEADER_OFFSET:HEADER_OFFSET + hlen])
    if len(raw) != hlen or zlib.crc32(raw) != hcrc:
        raise _corrupt(path, "the header checksum does not match")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _corrupt(path, "the header is not valid JSON") from None
    unknown = _unknown_fields(header)
    if unknown:
        raise CacheFileMismatch(
            f"{path}: kvq header field(s) {', '.join(unknown)} unknown to this kvquant (a file "
            "written by a newer version?): refusing it rather than ignoring what they say",
            "version", path, "kvq")
    problem = _header_problem(header, version)
    if problem:
        raise _corrupt(path, f"the header is not a valid kvq header: {problem}")
    state_end = _align8(HEADER_OFFSET + hlen) + header.get("state_bytes", 0)
    state_end = _align8(state_end) + 2 * header.get("window_slot_bytes", 0)
    if state_end > size:
        raise _corrupt(path, f"the stream state runs past the end of the file ({state_end} > "
                       f"{size} bytes)", "state")
    return header, hcrc, _align8(state_end), raw


def _is_int(v, low, high):
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _stream_state_bytes(rows, dim, options, held):
    return STATE_HEAD.size + 4 * rows * dim * (options.center + options.normalize + held)


def _window_bytes(rows, dim, options):
    return STATE_HEAD.size + 4 * options.recent * rows * dim


def _options_problem(opts):
    """Why a header's stream options are not valid, or None."""
    if not (isinstance(opts, dict) and {"center", "normalize", "sinks"} <= set(opts)
            <= {"center", "normalize", "sinks", "recent", "calibrated"}
            and isinstance(opts["center"], bool) and isinstance(opts["normalize"], bool)
            and _is_int(opts["sinks"], 0, MAX_SINKS)
            and _is_int(opts.get("recent", 1), 1, MAX_RECENT)
            and opts.get("calibrated", True) is True):
        return "options"
    if opts.get("calibrated") and not (opts["center"] or opts["normalize"]):
        return "options (calibrated without center or normalize)"
    if not (opts["center"] or opts["normalize"] or opts["sinks"] or opts.get("recent")):
        return "options (none set)"
    return None


# The fields of a kvq header, each with the check of its value (None: absent is allowed).
_HEADER_FIELDS = ("format", "version", "byteorder", "token", "model", "record_bytes",
                  "block_records", "streams", "writer", "state_bytes", "window_slot_bytes",
                  "model_id")
_MLA_MODEL = ("n_layers", "kv_lora", "qk_rope", "index_hd", "n_index_layers", "vocab")
_ROTATION_FIELDS = {"identity": str, "seed": int, "sign_hash": str, "ordering": str}
_CODEBOOK_FIELDS = {"identity": str, "checksum": (str, type(None))}


def _is_str(v, longest=256):
    return isinstance(v, str) and 1 <= len(v) <= longest


def _stream_fields():
    return {
        "name": lambda v: isinstance(v, str) and STREAM_NAME.match(v) is not None,
        "rows": lambda v: _is_int(v, 1, 1 << 24),
        "dim": lambda v: _is_int(v, 1, 1 << 24),
        "code_bytes": lambda v: _is_int(v, 0, 1 << 28),
        "n_side": lambda v: _is_int(v, 0, 1 << 24),
        "spec": _is_str,
        "family": lambda v: _is_str(v, 64),
        "bits": lambda v: v is None or _is_int(v, 1, 64),
        "side": lambda v: _is_str(v, 64),
        "side_dtype": lambda v: isinstance(v, str) and v in SIDE_DTYPES,
        "engine_tag": lambda v: v is None or _is_int(v, 0, 0xFFFF),
        "rotation": lambda v: v is None or _is_record(v, _ROTATION_FIELDS),
        "codebook": lambda v: v is None or _is_record(v, _CODEBOOK_FIELDS),
        "options": lambda v: _options_problem(v) is None,
        "statistics": lambda v: isinstance(v, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", v)
        is not None,
    }


_STREAM_FIELDS = _stream_fields()
_STREAM_REQUIRED = ("name", "rows", "dim", "code_bytes", "n_side", "spec")


def _is_record(v, fields):
    """A dict with exactly ``fields``, each of its type (ints: 0..2^64-1, not bool)."""
    if not isinstance(v, dict) or set(v) != set(fields):
        return False
    for key, kind in fields.items():
        if kind is int:
            if not _is_int(v[key], 0, (1 << 64) - 1):
                return False
        elif not isinstance(v[key], kind) or isinstance(v[key], bool):
            return False
        elif isinstance(v[key], str) and not 1 <= len(v[key]) <= 256:
            return False
    return True


def _unknown_fields(h):
    """Header fields (top level and stream entries) this kvquant does not know."""
    if not isinstance(h, dict):
        return []
    unknown = [repr(k) for k in h if k not in _HEADER_FIELDS]
    for s in h.get("streams") if isinstance(h.get("streams"), list) else ():
        if isinstance(s, dict):
            unknown += [f"streams[].{k!r}" for k in s if k not in _STREAM_FIELDS]
    return sorted(set(unknown))


def _model_problem(m):
    if not isinstance(m, dict):
        return "model"
    if m.get("kind") == "mla":
        if set(m) != {"kind", *_MLA_MODEL} or not all(
                _is_int(m[k], 1 if k in ("n_layers", "kv_lora", "qk_rope") else 0, INT32_MAX)
                for k in _MLA_MODEL):
            return "model (an MLA shape needs integer n_layers, kv_lora, qk_rope >= 1 and " \
                   "index_hd, n_index_layers, vocab >= 0)"
    elif m.get("kind") == "streams":
        if set(m) != {"kind", "vocab"} or not _is_int(m["vocab"], 0, INT32_MAX):
            return "model (streams need an integer vocab >= 0)"
    else:
        return f"model kind {m.get('kind')!r}"
    return None


def _header_problem(h, version):
    if not isinstance(h, dict):
        return "not an object"
    if h.get("format") != FORMAT_NAME or not _is_int(h.get("version"), version, version):
        return "format/version fields"
    if h.get("byteorder") != "little" or h.get("token") != "int32":
        return "byte order or token type"
    problem = _model_problem(h.get("model"))
    if problem:
        return problem
    if "writer" in h and not isinstance(h["writer"], str):
        return "writer"
    if "model_id" in h and not is_model_id(h["model_id"]):
        return "model_id (1..256 printable ASCII characters)"
    if not _is_int(h.get("block_records"), 1, MAX_BLOCK_RECORDS):
        return "block_records"
    if not _is_int(h.get("record_bytes"), 4, MAX_RECORD_BYTES):
        return "record_bytes"
    streams = h.get("streams")
    if not isinstance(streams, list) or not 1 <= len(streams) <= MAX_STREAMS:
        return "streams"
    total, names, state, state_max, window = 4, set(), STATE_HEAD.size, 0, WINDOW_HEAD.size
    for i, s in enumerate(streams):
        if not isinstance(s, dict) or not isinstance(s.get("name"), str) or s["name"] in names:
            return f"stream {i} name"
        names.add(s["name"])
        missing = [k for k in _STREAM_REQUIRED if k not in s]
        if missing:
            return f"stream {s['name']!r} lacks {', '.join(missing)}"
        for key, valid in _STREAM_FIELDS.items():
            if key in s and not valid(s[key]):
                return f"stream {s['name']!r} {key} {repr(s[key])[:60]}"
        side_size = side_bytes(s.get("side_dtype", "f32"))
        total += s["rows"] * (s["code_bytes"] + side_size * s["n_side"])
        if "options" in s:
            if version != STATE_VERSION:
                return f"stream {s['name']!r} options in a version {version} header"
            problem = _options_problem(s["options"])
            if problem:
                return f"stream {s['name']!r} {problem}"
            opts = StreamOptions(**s["options"])
            state += _stream_state_bytes(s["rows"], s["dim"], opts, 0)
            state_max += 4 * s["rows"] * s["dim"] * opts.sinks
            if opts.recent:
                window += _window_bytes(s["rows"], s["dim"], opts)
    if total != h["record_bytes"]:
        return f"record_bytes {h['record_bytes']} != {total} from the streams"
    if version == STATE_VERSION and (state == STATE_HEAD.size or not _is_int(
            h.get("state_bytes"), state, state + state_max) or h["state_bytes"] % 4):
        return (f"state_bytes {h.get('state_bytes')!r} is not a multiple of 4 in "
                f"{state}..{state + state_max}, the range of the streams' options")
    if version == VERSION and "state_bytes" in h:
        return "state_bytes in a version 1 header"
    expected = window if window > WINDOW_HEAD.size else 0
    if not _is_int(h.get("window_slot_bytes", 0), expected, expected):
        return f"window_slot_bytes {h.get('window_slot_bytes')!r} != {expected} from the options"
    return None


def read_slots(head, header_crc):
    """Both commit slots: list of (index, count, seq, tail_crc) for the valid ones, and the
    indices of invalid ones."""
    valid, invalid = [], []
    for idx, off in enumerate(SLOT_OFFSETS):
        count, seq, tail_crc, crc = SLOT.unpack_from(head, off)
        if zlib.crc32(SLOT_BODY.pack(count, seq, tail_crc), header_crc) == crc:
            valid.append((idx, count, seq, tail_crc))
        else:
            invalid.append(idx)
    return valid, invalid


def verify_blocks(buf, count, layout, tail_crc):
    """Check the blocks of the first ``count`` records in ``buf`` (the data region as read).

    Returns (records verified, problem or None, raw record bytes without trailers), where
    problem is ("truncated" | "corrupt", first bad record index).
    """
    B, rec, stride = layout.block_records, layout.record_bytes, layout.stride
    mv = memoryview(buf)
    parts, good = [], 0
    full, tail = divmod(count, B)
    for k in range(full):
        start = k * stride
        end = start + B * rec
        if end + 4 > len(buf):
            return good, ("truncated", good), parts
        (trailer,) = struct.unpack_from("<I", buf, end)
        if zlib.crc32(mv[start:end]) != trailer:
            return good, ("corrupt", good), parts
        parts.append(mv[start:end])
        good += B
    if tail:
        start = full * stride
        end = start + tail * rec
        if end > len(buf):
            return good, ("truncated", good), parts
        if zlib.crc32(mv[start:end]) != tail_crc:
            return good, ("corrupt", good), parts
        parts.append(mv[start:end])
        good += tail
    return good, None, parts
