"""``kvquant inspect FILE [--mode SPEC]``: the header and a summary of any supported cache file."""
import json
import os
import zlib

from kvquant.kvfile import engine, kvq
from kvquant.kvfile.cachefile import CacheFile
from kvquant.kvfile.errors import CacheFileMismatch, CacheFileRefused
from kvquant.kvfile.fileio import open_regular, pread_exact
from kvquant.kvfile.identity import build_codec
from kvquant.kvfile.schema import KVFileShape, Stream
from kvquant.streams.options import StreamOptions

# Header-derived sizes above these are reported, not acted on (no codec is built for them, so
# a lying header cannot make inspect allocate).
_MAX_DIM = 1 << 20
_MAX_ROWS = 1 << 16

# Load events that mean committed records were lost or changed (an uncommitted tail is not).
DAMAGE = ("truncated", "corrupt-block", "bad-token", "bad-side", "bad-code", "commit-slot",
          "window-slot", "count")

ENGINE_INTEGRITY = ("engine tiers carry no checksum: a flipped byte reads as data unless it puts "
                    "a side value out of range, makes an fp8 NaN byte, or a token id leaves the "
                    "vocabulary")


def _try_open(path, **kw):
    """Readonly dry run: what opening under these settings would do."""
    try:
        cf = CacheFile.open(path, readonly=True, **kw)
    except CacheFileRefused as exc:
        return {"result": "refused", "reason": exc.reason, "records": 0, "messages": [str(exc)]}
    except ValueError as exc:
        return {"result": "error", "reason": "mode", "records": 0, "messages": [str(exc)]}
    rep = cf.report
    cf.close()
    result = {"loaded": "loads", "upgraded": "upgrade", "ignored": "ignored",
              "new": "empty", "started-over": "refused"}[rep.status]
    return {"result": result, "reason": None, "records": rep.loaded, "tier": cf.tier,
            "messages": rep.messages, "events": [e.kind for e in rep.events],
            "damage": [e.message for e in rep.events if e.kind in DAMAGE]}


def _check_losses(info):
    """Compare what the header commits with what reading the file as written recovers: lost
    or changed records are the file's problem (``inspect`` exits 1)."""
    r = info.get("as_written")
    if r and r["result"] in ("refused", "error", "ignored"):
        # a file this kvquant will not load even under its own header's settings (e.g. its
        # codebook differs from the one installed here): a problem, whatever else it holds
        info["problem"] = ("this kvquant refuses it as written: "
                           + ("; ".join(r["messages"]) or r["result"]))
        return
    if not r or r["result"] not in ("loads", "upgrade"):
        return
    committed = max(0, info.get("count") or 0)
    info["recoverable_records"] = r["records"]
    info["lost_records"] = committed - r["records"]
    info["verified"] = not r["damage"]
    if r["damage"]:
        lost = (f"{info['lost_records']} of the {committed} committed record(s) are lost"
                if info["lost_records"] else "records were damaged")
        info["problem"] = f"{lost}: " + "; ".join(r["damage"])


def inspect_file(path, mode=None):
    """Describe a cache file: tier, header, shape, counts, bytes, codec, integrity, and
    whether it would load under ``mode`` (a codec spec; for MLA files it applies to L and R).

    Returns
    -------
    dict
        JSON-able. ``supported`` is False for files that are not cache files of a known tier.
    """
    path = os.fspath(path)
    info = {"path": path, "supported": False, "tier": None, "problem": None}
    fd, st = open_regular(path, os.O_RDONLY)
    if fd is None:
        raise CacheFileMismatch(f"{path} is {st}, not a cache file (give the path of a regular "
                                "file)", "not-a-file", path, None)
    try:
        size = st.st_size
        head = pread_exact(fd, min(size, kvq.HEADER_OFFSET + kvq.MAX_HEADER_BYTES), 0)
    finally:
        os.close(fd)
    info["bytes"] = size
    info["magic"] = repr(bytes(head[:8]))
    if head[:8] == kvq.MAGIC:
        _inspect_kvq(path, head, size, info, mode)
        _check_losses(info)
    elif head[:8] in engine.TIER_OF_MAGIC:
        _inspect_engine(path, head, size, info, mode)
        _check_losses(info)
    elif size == 0:
        info["problem"] = "empty file"
    else:
        info["problem"] = "not a cache file of a known tier"
    return info


def _inspect_engine(path, head, size, info, mode):
    info["tier"] = engine.TIER_OF_MAGIC[head[:8]]
    if size < engine.HEADER_BYTES:
        info["problem"] = f"short header ({size} of {engine.HEADER_BYTES} bytes)"
        return
    info["supported"] = True
    _, words = engine.parse_header(head)
    info["header"] = dict(zip(engine.WORD_NAMES, words))
    n_layers, kv_lora, qk_rope, index_hd, nic, vocab, count, tag = words
    info["count"] = count
    info["tag"] = tag
    info["tier_name"] = engine.describe_tier(info["tier"], tag)
    spec = {"v1": "f32", "v2": "kv8"}.get(info["tier"]) or engine.spec_of_tag(tag)
    info["codec"] = spec
    info["integrity"] = ENGINE_INTEGRITY
    if not (1 <= n_layers <= _MAX_ROWS and 1 <= kv_lora <= _MAX_DIM and 1 <= qk_rope <= _MAX_DIM
            and 0 <= index_hd <= _MAX_DIM and 0 <= nic <= _MAX_ROWS and vocab >= 0):
        info["problem"] = "implausible header words (negative or huge sizes)"
        return
    shape = KVFileShape(n_layers, kv_lora, qk_rope, index_hd, nic, vocab)
    info["shape"] = shape.as_dict()
    try:
        if spec is None:
            raise ValueError(f"tag {tag:#x} names no codec of this kvquant")
        cl, cr = build_codec(spec, kv_lora, "inert"), build_codec(spec, qk_rope, "inert")
        per_layer = (4 * (kv_lora + qk_rope) if info["tier"] == "v1"
                     else cl.code_bytes + cr.code_bytes + 8)
        rec = 4 + n_layers * per_layer + (4 * nic * index_hd if shape.has_index else 0)
    except ValueError as exc:
        info["problem"] = f"codec of this file unknown here: {exc}"
        return
    info["record_bytes"] = rec
    info["complete_records"] = (size - engine.HEADER_BYTES) // rec
    info["as_written"] = _try_open(path, shape=shape, mode=spec)
    if mode is not None:
        info["load"] = {"mode": mode, **_try_open(path, shape=shape, mode=mode)}


def _stream_spec(entry):
    """The stream spec of a kvq header's stream entry (codec spec + stream options)."""
    try:
        return StreamOptions(**entry.get("options", {})).stream_spec(entry["spec"])
    except (TypeError, ValueError):
        return entry["spec"]


def _inspect_state(path, header, header_json, info):
    """What the stream-state area holds, per stream with options (or why it cannot be read)."""
    streams = [(s["name"], s["rows"], s["dim"], StreamOptions(**s["options"]))
               for s in header["streams"] if "options" in s]
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = pread_exact(fd, header["state_bytes"], kvq._align8(kvq.HEADER_OFFSET
                                                                  + len(header_json)))
    finally:
        os.close(fd)
    try:
        if len(buf) != header["state_bytes"]:
            raise kvq._corrupt(path, "the stream state is cut short", "state")
        state = kvq.parse_state(path, buf, streams, zlib.crc32(header_json))
    except CacheFileRefused as exc:
        info["state"] = None
        info["problem"] = str(exc)
        return
    info["state"] = {name: {"offset": offset is not None, "scales": scale is not None,
                            "sink_rows": len(sinks)}
                     for name, (offset, scale, sinks) in state.items()}
    if header.get("window_slot_bytes"):
        info["window_slots"] = _window_slots(path, header, header_json)


def _window_slots(path, header, header_json):
    """The count each window slot holds (None: empty or damaged)."""
    size = header["window_slot_bytes"]
    start = kvq._align8(kvq._align8(kvq.HEADER_OFFSET + len(header_json))
                       + header["state_bytes"])
    fd = os.open(path, os.O_RDONLY)
    try:
        slots = [pread_exact(fd, size, start + i * size) for i in (0, 1)]
    finally:
        os.close(fd)
    return [(kvq.window_slot_tag(buf, size, zlib.crc32(header_json)) or (None,))[0]
            for buf in slots]


def _inspect_kvq(path, head, size, info, mode):
    info["tier"] = "kvq"
    info["tier_name"] = engine.describe_tier("kvq")
    try:
        header, header_crc, data_offset, header_json = kvq.read_header(path, head, size)
    except CacheFileRefused as exc:
        info["problem"] = str(exc)
        return
    info["supported"] = True
    info["header"] = header
    info["data_offset"] = data_offset
    info["record_bytes"] = header["record_bytes"]
    info["block_records"] = header["block_records"]
    valid, invalid = kvq.read_slots(head, header_crc)
    info["slots"] = [{"slot": "AB"[i], "count": c, "seq": s} for i, c, s, _ in valid]
    info["damaged_slots"] = ["AB"[i] for i in invalid]
    info["count"] = max(valid, key=lambda v: v[2])[1] if valid else None
    info["codec"] = {s["name"]: _stream_spec(s) for s in header["streams"]}
    info["integrity"] = "CRC32 per block of records, per commit slot and over the header"
    if header.get("state_bytes"):
        info["integrity"] += ", and over the stream state"
        _inspect_state(path, header, header_json, info)
    streams = header["streams"]
    if any(s["dim"] > _MAX_DIM or s["rows"] > _MAX_ROWS for s in streams):
        info["problem"] = "implausible stream sizes"
        return
    model = dict(header["model"])
    kind = model.pop("kind", None)
    try:
        if kind == "mla":
            shape = KVFileShape(**model)
            own = {s["name"]: _stream_spec(s) for s in streams}
            opener = {"shape": shape}
            as_written = {"mode": own}
            asked = ({"mode": {"L": mode, "R": mode, "index": own.get("index", "f32")}}
                     if shape.has_index else {"mode": mode})
        else:
            vocab = model.get("vocab", 0)
            opener = {"vocab": vocab}
            as_written = {"streams": [Stream(s["name"], s["dim"], s["rows"], _stream_spec(s))
                                      for s in streams]}
            asked = {"streams": [Stream(s["name"], s["dim"], s["rows"], mode) for s in streams]}
    except (TypeError, ValueError) as exc:
        info["problem"] = f"header model not understood: {exc}"
        return
    opener["model_id"] = header.get("model_id")
    info["as_written"] = _try_open(path, tier="kvq", **opener, **as_written)
    if mode is not None:
        info["load"] = {"mode": mode, **_try_open(path, **opener, **asked)}


def format_inspection(info):
    """Human-readable lines for :func:`inspect_file`'s dict."""
    lines = [f"file       {info['path']} ({info['bytes']} bytes, magic {info['magic']})"]
    if info.get("tier"):
        lines.append(f"tier       {info['tier']}: {info.get('tier_name', '')}")
    if info["tier"] in ("v1", "v2", "v3") and "header" in info:
        h = info["header"]
        lines.append("header     " + " ".join(f"{k}={v}" for k, v in h.items()))
        lines.append(f"codec      {info.get('codec') or 'unknown'} (L and R"
                     + (", index rows f32)" if h["n_index_layers"] and h["index_hd"] else ")"))
    elif info["tier"] == "kvq" and "header" in info:
        h = info["header"]
        lines.append(f"model      {h['model']}")
        if h.get("model_id"):
            lines.append(f"model id   {h['model_id']}")
        for s in h["streams"]:
            extra = ""
            if s.get("rotation"):
                r = s["rotation"]
                extra += (f"  rotation seed {r['seed']:#010x} ({r['sign_hash']}, "
                          f"{r['ordering']})")
            if s.get("codebook"):
                cb = s["codebook"]
                extra += f"  codebook {cb['identity']} (sha256 {str(cb['checksum'])[:12]}...)"
            lines.append(f"stream     {s['name']}: {s['rows']} x {s['dim']}  "
                         f"{_stream_spec(s)}  "
                         f"{s['code_bytes']} B + {s['n_side']} side ({s['side']}, "
                         f"{s.get('side_dtype', 'f32')}){extra}")
        slots = ", ".join(f"{s['slot']} count {s['count']} seq {s['seq']}"
                          for s in info["slots"])
        damaged = (f"; damaged: {', '.join(info['damaged_slots'])}"
                   if info["damaged_slots"] else "")
        lines.append(f"commit     {slots or 'no valid slot'}{damaged}")
        if h.get("state_bytes"):
            held = "; ".join(
                f"{name}: " + ", ".join([w for w, on in (("offset", st["offset"]),
                                                        ("scales", st["scales"])) if on]
                                       + [f"{st['sink_rows']} sink row(s)"])
                for name, st in (info.get("state") or {}).items())
            lines.append(f"state      {h['state_bytes']} bytes of stream state before the data"
                         + (f" ({held})" if held else " (unreadable)"))
        if info.get("window_slots"):
            a, b = info["window_slots"]
            lines.append(f"windows    two slots of {h['window_slot_bytes']} bytes: A holds the "
                         f"window of count {a}, B of count {b}")
        lines.append(f"blocks     {info['block_records']} records per block + CRC32, data from "
                     f"byte {info['data_offset']}")
    if "record_bytes" in info:
        complete = info.get("complete_records")
        lines.append(f"records    {info.get('count')} committed, {info['record_bytes']} bytes each"
                     + (f", {complete} complete in the file" if complete is not None else ""))
    if info.get("integrity"):
        verdict = ""
        if "verified" in info and info["tier"] == "kvq":
            verdict = (": checksums verified" if info["verified"]
                       else ": damage found (see problem)")
        lines.append(f"integrity  {info['integrity']}{verdict}")
    if info.get("lost_records"):
        lines.append(f"lost       {info['lost_records']} of {max(0, info['count'])} committed "
                     f"record(s); {info['recoverable_records']} recoverable")
    if info.get("as_written"):
        r = info["as_written"]
        lines.append(f"as written {r['result']}: {r['records']} record(s)")
        lines.extend(f"           {m}" for m in r["messages"])
    if info.get("load"):
        r = info["load"]
        tail = f" ({r['reason']})" if r.get("reason") else ""
        lines.append(f"mode       {r['mode']!r}: {r['result']}{tail}, {r['records']} record(s)")
        lines.extend(f"           {m}" for m in r["messages"])
    if info.get("problem"):
        lines.append(f"problem    {info['problem']}")
    return "\n".join(lines)


def cmd_inspect(args):
    try:
        info = inspect_file(args.file, args.mode)
    except OSError as exc:
        raise SystemExit(f"kvquant inspect: cannot read {args.file!r}: {exc.strerror}")
    except CacheFileRefused as exc:
        raise SystemExit(f"kvquant inspect: {exc}")
    print(json.dumps(info, indent=1, default=str) if args.json else format_inspection(info))
    ok = info["supported"] and not info.get("problem")
    if args.mode is not None:
        ok = ok and info.get("load", {}).get("result") in ("loads", "upgrade")
    return 0 if ok else 1


def add_cli(subparsers):
    """Register ``kvquant inspect FILE [--mode SPEC] [--json]``.

    Exit status 0 when the file is a supported cache file whose committed records all read back
    intact (and, with ``--mode``, would load or be upgraded under it), 1 otherwise (records
    lost or damaged: the problem line says how many).
    """
    p = subparsers.add_parser(
        "inspect", help="header and summary of a cache file (.coli_kv v1/v2/v3 or kvq)",
        description="Print the header and a summary of a cache file: tier, shape, count, "
                    "bytes, codec, and whether it would load under --mode.")
    p.add_argument("file", help="the cache file")
    p.add_argument("--mode", default=None,
                   help="a codec spec (e.g. kv8, tq4:compat=colibri): would the file load "
                        "under it?")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_inspect)
    return p
