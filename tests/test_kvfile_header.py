"""Bad inputs of the cache file, each a named refusal:

* kvq headers with valid CRCs (forged here with struct and zlib, independently of the writer)
  whose fields have the wrong type or range, field by field: CacheFileCorrupt from
  ``CacheFile.open``, a problem from ``inspect_file``, never TypeError/KeyError;
* a FIFO, a directory, a device: refused without blocking (a deadline turns a hang into a
  failure);
* ``kvquant inspect`` on a file whose records are lost: exit 1 and how many.
"""
import copy
import json
import os
import struct
import zlib

import numpy as np
import pytest

from _kvfile_data import deadline
from kvquant import cli
from kvquant.kvfile import (
    CacheFile, CacheFileCorrupt, CacheFileMismatch, CacheFileRefused, KVFileShape, Stream,
    inspect_file)

DIM, SLOTS = 8, 2
PLAIN = [Stream("K", DIM, SLOTS, "tq4"), Stream("V", DIM, SLOTS, "kv8")]
OPTIONS = [Stream("K", DIM, SLOTS, "tq4@center,sinks=1,recent=2")]
CALIBRATED = [Stream("K", DIM, SLOTS, "tq4@center=calib,normalize=calib,sinks=1")]
# calibrated statistics of CALIBRATED's stream (offsets, channel scales), (SLOTS, DIM) each
STATISTICS = {"K": (np.linspace(-1, 1, SLOTS * DIM, dtype=np.float32).reshape(SLOTS, DIM),
                    np.full((SLOTS, DIM), 0.5, np.float32))}


def _statistics(streams):
    return {"statistics": STATISTICS} if streams is CALIBRATED else {}


def write(path, streams, n=12):
    g = np.random.default_rng(5)
    cf = CacheFile.open(path, streams=streams, vocab=100, block_records=4,
                        **_statistics(streams))
    cf.append(np.arange(n), streams={s.name: g.standard_normal((n, SLOTS, DIM))
                                     for s in streams})
    cf.close()
    return open(path, "rb").read()


def _align8(n):
    return (n + 7) // 8 * 8


def forge(data, header):
    """The kvq file ``data`` with its header JSON replaced by ``header``, every checksum that
    depends on the header recomputed (prefix, both commit slots, the stream state and window
    slots, which are seeded with the header's CRC), the rest moved along."""
    magic, version, hlen, _, _ = struct.unpack_from("<8sIIII", data)
    orig = header_of(data)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    hcrc = zlib.crc32(raw)
    prefix = struct.pack("<8sIII", magic, version, len(raw), hcrc)
    out = bytearray(prefix + struct.pack("<I", zlib.crc32(prefix)))
    for off in (24, 48):
        count, seq, tail = struct.unpack_from("<QQI", data, off)
        body = struct.pack("<QQI", count, seq, tail)
        out += body + struct.pack("<I", zlib.crc32(body, hcrc))
    out += raw
    out += b"\0" * (_align8(len(out)) - len(out))
    rest = bytearray(data[_align8(72 + hlen):])
    state, window = orig.get("state_bytes", 0), orig.get("window_slot_bytes", 0)
    if state:
        struct.pack_into("<I", rest, 0, zlib.crc32(bytes(rest[8:state]), hcrc))
    for i in range(2 if window else 0):
        off = _align8(state) + i * window
        count, seq = struct.unpack_from("<QQ", rest, off)
        body = struct.pack("<QQ", count, seq) + bytes(rest[off + 24:off + window])
        struct.pack_into("<I", rest, off + 16, zlib.crc32(body, hcrc))
    return bytes(out) + bytes(rest)


def header_of(data):
    hlen = struct.unpack_from("<I", data, 12)[0]
    return json.loads(data[72:72 + hlen])


# Values of the wrong JSON type or out of range for each kind of field.
NOT_INT = [{}, [], "4", 4.5, None, True, -1, 2**70, float("nan")]
NOT_STR = [{}, [], 4, None, True, "", "x" * 300]
NOT_NULLABLE_INT = [{}, [], "4", 4.5, True, -1, 2**70]
NOT_DICT = [[], "d", 4, True, {"extra": 1}]
FIELDS = {   # field path -> bad values (a stream field is under ("streams", 0, ...))
    ("format",): NOT_STR + ["another-format"],
    ("version",): NOT_INT + [7],
    ("byteorder",): NOT_STR + ["big"],
    ("token",): NOT_STR + ["int64"],
    ("model",): [[], "m", 4, None, {"kind": "streams"}, {"kind": "streams", "vocab": "100"},
                 {"kind": "mla", "n_layers": 1}, {"kind": {}, "vocab": 100}],
    ("model", "vocab"): NOT_INT,
    ("record_bytes",): NOT_INT,
    ("block_records",): NOT_INT + [0],
    ("streams",): [{}, "s", 4, None, [], [[]], ["K"]],
    ("writer",): [{}, [], 4, None, True],
    ("model_id",): NOT_STR + ["has space", "tab\there"],
    ("streams", 0, "name"): NOT_STR + ["0starts-with-a-digit", "V"],
    ("streams", 0, "rows"): NOT_INT + [0],
    ("streams", 0, "dim"): NOT_INT + [0],
    ("streams", 0, "code_bytes"): NOT_INT,
    ("streams", 0, "n_side"): NOT_INT,
    ("streams", 0, "spec"): NOT_STR,
    ("streams", 0, "family"): NOT_STR,
    ("streams", 0, "bits"): NOT_NULLABLE_INT + [0, 65],
    ("streams", 0, "side"): NOT_STR,
    ("streams", 0, "side_dtype"): NOT_STR + ["f64", {"f32": 1}, ["f32"]],
    ("streams", 0, "engine_tag"): NOT_NULLABLE_INT + [0x10000],
    ("streams", 0, "rotation"): NOT_DICT,
    ("streams", 0, "rotation", "seed"): NOT_INT,
    ("streams", 0, "rotation", "identity"): NOT_STR,
    ("streams", 0, "rotation", "sign_hash"): NOT_STR,
    ("streams", 0, "rotation", "ordering"): NOT_STR,
    ("streams", 0, "codebook"): NOT_DICT,
    ("streams", 0, "codebook", "identity"): NOT_STR,
    ("streams", 0, "codebook", "checksum"): [{}, [], 4, True, ""],
}
OPTION_FIELDS = {
    ("state_bytes",): NOT_INT + [0, 3],
    ("window_slot_bytes",): NOT_INT + [0],
    ("streams", 0, "options"): NOT_DICT + [{}, {"center": 1, "normalize": False, "sinks": 1}],
    ("streams", 0, "options", "center"): [0, 1, "yes", None, {}, []],
    ("streams", 0, "options", "sinks"): NOT_INT,
    ("streams", 0, "options", "recent"): NOT_INT + [0],
}
CALIBRATED_FIELDS = {
    ("streams", 0, "statistics"): NOT_STR + ["sha256:" + "0" * 63, "md5:" + "0" * 32],
    ("streams", 0, "options", "calibrated"): [False, 1, "yes", None, {}],
}


def _set(h, path, value):
    h = copy.deepcopy(h)
    node = h
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return h


def _cases():
    for fields, streams in ((FIELDS, PLAIN), (OPTION_FIELDS, OPTIONS),
                            (CALIBRATED_FIELDS, CALIBRATED)):
        for path, values in fields.items():
            for value in values:
                yield path, value, streams


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hdr")
    return {"plain": write(d / "plain.kvq", PLAIN), "options": write(d / "options.kvq", OPTIONS),
            "calibrated": write(d / "calibrated.kvq", CALIBRATED)}


FILES = {id(PLAIN): "plain", id(OPTIONS): "options", id(CALIBRATED): "calibrated"}


def test_the_forger_rebuilds_a_valid_file(tmp_path, files):
    """An unchanged header forged back loads every record: the forger is right, so the
    refusals below come from the fields, not from the forgery."""
    for name, streams in (("plain", PLAIN), ("options", OPTIONS), ("calibrated", CALIBRATED)):
        data = files[name]
        assert forge(data, header_of(data)) == data
        p = tmp_path / name
        p.write_bytes(forge(data, _set(header_of(data), ("writer",), "another writer 1.0")))
        cf = CacheFile.open(p, streams=streams, vocab=100, readonly=True, **_statistics(streams))
        assert len(cf) == 12 and cf.report.kinds() == ["loaded"]


@pytest.mark.parametrize("path, value, streams", list(_cases()),
                         ids=lambda v: repr(v)[:40] if not isinstance(v, list) else "")
def test_a_forged_header_field_is_refused_as_corrupt(tmp_path, files, path, value, streams):
    data = files[FILES[id(streams)]]
    forged = _set(header_of(data), path, value)
    p = tmp_path / "f.kvq"
    p.write_bytes(forge(data, forged))
    for kw in ({}, {"readonly": True}, {"on_mismatch": "start_over"}):
        try:
            cf = CacheFile.open(p, streams=streams, vocab=100, model_id="sha256:00", **kw,
                                **_statistics(streams))
        except CacheFileCorrupt as exc:
            assert exc.reason == "header" and "damaged" in str(exc)
            continue
        # start_over: refused and reported, the file untouched until a save
        assert kw == {"on_mismatch": "start_over"} and cf.report.status == "started-over"
        assert cf.report.events[-1].detail["reason"] == "header"
        cf.close()
    info = inspect_file(p)
    assert info["problem"] and "damaged" in info["problem"]
    assert cli.main(["inspect", str(p)]) == 1


def test_an_unknown_header_field_is_refused_as_from_a_newer_version(tmp_path, files):
    data = files["plain"]
    for path in (("streams", 0, "new_field"), ("new_field",)):
        p = tmp_path / "u.kvq"
        p.write_bytes(forge(data, _set(header_of(data), path, 1)))
        with pytest.raises(CacheFileMismatch) as exc:
            CacheFile.open(p, streams=PLAIN, vocab=100)
        assert exc.value.reason == "version" and "new_field" in str(exc.value)


def test_deep_or_odd_json_is_refused_as_corrupt(tmp_path, files):
    data = files["plain"]
    magic = data[:8]
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"format": NaN}', b"\xff\xfe", b"42"):
        hcrc = zlib.crc32(raw)
        prefix = struct.pack("<8sIII", magic, 1, len(raw), hcrc)
        slots = b""
        for _ in range(2):
            body = struct.pack("<QQI", 0, 0, 0)
            slots += body + struct.pack("<I", zlib.crc32(body, hcrc))
        p = tmp_path / "j.kvq"
        p.write_bytes(prefix + struct.pack("<I", zlib.crc32(prefix)) + slots + raw)
        with pytest.raises(CacheFileCorrupt):
            CacheFile.open(p, streams=PLAIN, vocab=100)
        assert inspect_file(p)["problem"]


# -- not a regular file ---------------------------------------------------------------------------
def _not_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link-to-fifo"
    link.symlink_to(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    return {"a FIFO": fifo, "a FIFO ": link, "a directory": folder,
            "a character device": "/dev/null"}


@pytest.mark.parametrize("kw", [{}, {"readonly": True}, {"on_mismatch": "start_over"}])
def test_a_fifo_directory_or_device_is_refused_without_blocking(tmp_path, kw, capsys):
    for kind, path in _not_files(tmp_path).items():
        with deadline():
            with pytest.raises(CacheFileMismatch) as exc:
                CacheFile.open(path, streams=PLAIN, vocab=100, **kw)
        assert exc.value.reason == "not-a-file" and kind.strip() in str(exc.value)
        with deadline():
            with pytest.raises(CacheFileMismatch) as exc:
                inspect_file(path)
        assert exc.value.reason == "not-a-file"
        with deadline():
            assert cli.main(["inspect", str(path)]) == 2     # a bad input: one line, status 2
        assert kind.strip() in capsys.readouterr().err.strip().splitlines()[-1]
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    assert sorted(os.listdir(tmp_path)) == ["fifo", "folder", "link-to-fifo"]


# -- inspect on lost records ----------------------------------------------------------------------
def test_inspect_exits_1_and_counts_the_lost_records(tmp_path, files, capsys):
    data = files["plain"]
    good = tmp_path / "good.kvq"
    good.write_bytes(data)
    assert cli.main(["inspect", str(good)]) == 0
    out = capsys.readouterr().out
    assert "checksums verified" in out and "lost" not in out
    # one flipped byte in the first block: every record after it is lost
    data_offset = len(data) - 3 * (4 * CacheFile.open(good, streams=PLAIN, vocab=100,
                                                        readonly=True)._layout.record_bytes + 4)
    bad = bytearray(data)
    bad[data_offset + 5] ^= 1
    p = tmp_path / "bad.kvq"
    p.write_bytes(bytes(bad))
    assert cli.main(["inspect", str(p)]) == 1
    out = capsys.readouterr().out
    assert "checksums verified" not in out
    assert "12 of the 12 committed record(s) are lost" in out
    assert "lost       12 of 12 committed record(s); 0 recoverable" in out
    info = inspect_file(p)
    assert (info["lost_records"], info["recoverable_records"], info["verified"]) == (12, 0,
                                                                                    False)
    cf = CacheFile.open(p, streams=PLAIN, vocab=100, readonly=True)
    assert not any("checksums verified" in m for m in cf.report.messages)
    # the last block damaged: 4 of 12 lost
    bad = bytearray(data)
    bad[len(data) - 10] ^= 1
    p.write_bytes(bytes(bad))
    assert cli.main(["inspect", str(p)]) == 1
    assert "4 of the 12 committed record(s) are lost" in capsys.readouterr().out


def test_inspect_engine_file_cut_short_or_with_an_uncommitted_tail(tmp_path, capsys):
    shape = KVFileShape(n_layers=2, kv_lora=32, qk_rope=8, vocab=100)
    g = np.random.default_rng(2)
    p = tmp_path / "c.coli_kv"
    cf = CacheFile.open(p, shape, mode="kv8")
    cf.append(np.arange(5), L=g.standard_normal((5, 2, 32)), R=g.standard_normal((5, 2, 8)))
    cf.close()
    data = p.read_bytes()
    rec = (len(data) - 40) // 5
    p.write_bytes(data + b"\1" * (rec + 3))          # an append that never committed
    assert cli.main(["inspect", str(p)]) == 0
    p.write_bytes(data[:40 + 3 * rec + 7])            # cut inside record 3
    assert cli.main(["inspect", str(p)]) == 1
    out = capsys.readouterr().out
    assert "2 of the 5 committed record(s) are lost" in out
    assert "checksums verified" not in out


def test_every_refusal_is_a_cache_file_refused(tmp_path):
    """The new refusals share the base class callers already catch."""
    from kvquant.kvfile import CacheFileInUse
    assert issubclass(CacheFileInUse, CacheFileRefused)
    assert issubclass(CacheFileRefused, ValueError)
