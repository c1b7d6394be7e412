"""Stream options in the kvq cache file: the offset, channel scales and float32 sink rows are
stored (kvq version 2), read back bit for bit, agree with the in-memory RowStream and with a
plain-numpy statement of the options, and a file is never read under other options."""
import os
import struct
import zlib

import numpy as np
import pytest

from _kvfile_data import SHAPE, hand_engine_bytes, make_rows
from kvquant import cli, get_codec
from kvquant.cache import RowStream
from kvquant.kvfile import (
    CacheFile, CacheFileCorrupt, CacheFileMismatch, CacheFileSaveError, Stream, inspect_file,
    kvq)
from kvquant.kvfile import cachefile as cachefile_module
from kvquant.streams.options import split_stream_spec

DIM = 64
SLOTS = 3           # row slots per token (layers x KV heads)
CHUNKS = (1, 4, 7)  # appends: a 1-token prompt, then 4, then the rest


def read(path):
    with open(path, "rb") as f:
        return f.read()


def keys(rng, n):
    """Key-like rows: a large shared per-channel mean, one outlier channel."""
    X = rng.standard_normal((n, SLOTS, DIM)).astype(np.float32)
    X += np.linspace(-3, 3, DIM, dtype=np.float32)
    X[..., 5] *= 8.0
    return X


def write(path, specs, rows, chunks=CHUNKS, **kw):
    cf = CacheFile.open(path, streams=[Stream(name, DIM, SLOTS, spec)
                                       for name, spec in specs.items()], **kw)
    start = 0
    for size in chunks:
        stop = min(len(next(iter(rows.values()))), start + size)
        cf.append(np.arange(start, stop), streams={k: v[start:stop] for k, v in rows.items()})
        start = stop
    return cf


def row_streams(spec, X, chunks=CHUNKS):
    """The same rows appended, in the same chunks, to one RowStream per row slot."""
    codec_spec, opts = split_stream_spec(spec)
    out = []
    for j in range(X.shape[1]):
        stream = RowStream(get_codec(codec_spec, DIM), **opts.as_dict())
        start = 0
        for size in chunks:
            stream.append(X[start:start + size, j])
            start += size
        out.append(stream)
    return out


def numpy_rows(spec, X, first):
    """What the options mean, in plain numpy: offset = mean of the first append's rows, scale =
    sqrt(sigma / rms(sigma)) floored at sqrt(1e-3), the first `sinks` rows exact, the others
    decode(encode((x - offset) / scale)) * scale + offset. (A single first row: its offset is
    that row, its scales all ones.)"""
    codec_spec, opts = split_stream_spec(spec)
    codec = get_codec(codec_spec, DIM)
    out = np.empty_like(X)
    for j in range(X.shape[1]):
        F = X[:first, j].astype(np.float64)
        offset = F.mean(axis=0).astype(np.float32) if opts.center else np.zeros(DIM, np.float32)
        scale = np.ones(DIM, np.float32)
        sigma = F.std(axis=0) if first > 1 else np.zeros(DIM)
        if opts.normalize and (sigma > 0).any():   # rows that do not vary: scales stay 1
            scale = np.sqrt(np.maximum(sigma / np.sqrt((sigma**2).mean()), 1e-3)).astype(
                np.float32)
        s = opts.sinks
        out[:s, j] = X[:s, j]
        coded = codec.decode(codec.encode((X[s:, j] - offset) / scale))
        out[s:, j] = coded * scale + offset
    return out


SPECS = ["polar5:side_dtype=f16@center,normalize,sinks=1", "tq4@center", "tq3@normalize",
         "kv8@sinks=2", "q4_0+rot@center,sinks=3", "tq4:side_dtype=f16@center,normalize,sinks=2"]


@pytest.mark.parametrize("spec", SPECS)
def test_rows_survive_the_file_as_the_stream_and_numpy_hold_them(tmp_path, rng, spec):
    X = keys(rng, sum(CHUNKS))
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": spec}, {"K": X})
    assert cf.tier == "kvq" and cf.committed == len(X)
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    assert back.report.loaded == len(X) and back.report.status == "loaded"
    got = back.records.decode("K")
    np.testing.assert_array_equal(got, cf.records.decode("K"))
    # the first append here is a single row: offset = that row, scales all ones
    np.testing.assert_allclose(got, numpy_rows(spec, X, first=1), rtol=1e-6, atol=1e-5)
    q = rng.standard_normal((2, DIM)).astype(np.float32)
    w = rng.random((2, len(X))).astype(np.float32)
    for j, stream in enumerate(row_streams(spec, X)):
        np.testing.assert_array_equal(got[:, j], stream.decode())
        loaded = back.records.row_stream("K", j)
        assert loaded.spec == stream.spec and len(loaded) == len(X)
        np.testing.assert_array_equal(loaded.scores(q), stream.scores(q))
        np.testing.assert_array_equal(loaded.context(w), stream.context(w))


@pytest.mark.parametrize("spec", ["tq4@center,normalize,sinks=2", "polar4@center,sinks=1"])
def test_offset_and_scales_come_from_the_first_append(tmp_path, rng, spec):
    X = keys(rng, 12)
    cf = write(tmp_path / "c.kvq", {"K": spec}, {"K": X}, chunks=(8, 4))
    back = CacheFile.open(tmp_path / "c.kvq", streams=[Stream("K", DIM, SLOTS, spec)])
    rec = back.records
    _, opts = split_stream_spec(spec)
    np.testing.assert_allclose(rec.offset("K"), X[:8].mean(axis=0), rtol=1e-5, atol=1e-5)
    if opts.normalize:
        assert rec.channel_scale("K").shape == (SLOTS, DIM)
        assert (rec.channel_scale("K")[:, 5] > 2.0).all()   # the outlier channel: ~sqrt(8)
    else:
        assert rec.channel_scale("K") is None
    np.testing.assert_array_equal(rec.sink_rows("K"), X[:opts.sinks])
    np.testing.assert_allclose(rec.decode("K"), numpy_rows(spec, X, first=8),
                               rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(rec.decode("K"), cf.records.decode("K"))


def test_plain_streams_keep_version_1_and_options_write_version_2(tmp_path, rng):
    X = keys(rng, 6)
    write(tmp_path / "plain.kvq", {"K": "tq4"}, {"K": X})
    write(tmp_path / "opts.kvq", {"K": "tq4@center", "V": "tq4"}, {"K": X, "V": X})
    for name, version in (("plain.kvq", 1), ("opts.kvq", 2)):
        data = read(tmp_path / name)
        assert struct.unpack_from("<I", data, 8)[0] == version
        header = inspect_file(tmp_path / name)["header"]
        assert header["version"] == version
        assert ("state_bytes" in header) == (version == 2)
    streams = inspect_file(tmp_path / "opts.kvq")["header"]["streams"]
    assert streams[0]["options"] == {"center": True, "normalize": False, "sinks": 0}
    assert streams[0]["spec"] == "tq4" and "options" not in streams[1]
    # the state area: CRC, then the K stream's flags, sinks held, offset (SLOTS x DIM) f32
    assert streams[0]["name"] == "K"
    assert inspect_file(tmp_path / "opts.kvq")["header"]["state_bytes"] == 8 + 8 + 4 * SLOTS * DIM


@pytest.mark.parametrize("written, running", [
    ("tq4@center", "tq4"), ("tq4", "tq4@center"), ("tq4@center", "tq4@center,normalize"),
    ("tq4@center,sinks=1", "tq4@center,sinks=2"), ("tq4@normalize", "tq4@center")])
def test_other_stream_options_are_refused_and_the_file_untouched(tmp_path, rng, written,
                                                                 running):
    path = tmp_path / "c.kvq"
    write(path, {"K": written}, {"K": keys(rng, 5)})
    before = read(path)
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, running)])
    assert exc.value.reason == "options"
    assert repr(written) in str(exc.value) and repr(running) in str(exc.value)
    fresh = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, running)],
                           on_mismatch="start_over")
    assert len(fresh.records) == 0 and fresh.report.status == "started-over"
    assert read(path) == before


def test_a_damaged_stream_state_is_refused(tmp_path, rng):
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": "tq4@center,sinks=1"}, {"K": keys(rng, 5)})
    start = cf._layout.state_offset
    for at in (start + 4 * 5, start + cf._layout.state_bytes - 1):   # offset, last sink value
        b = bytearray(read(path))
        b[at] ^= 0x40
        bad = tmp_path / f"bad{at}.kvq"
        bad.write_bytes(bytes(b))
        with pytest.raises(CacheFileCorrupt) as exc:
            CacheFile.open(bad, streams=[Stream("K", DIM, SLOTS, "tq4@center,sinks=1")])
        assert exc.value.reason == "state" and "checksum" in str(exc.value)
        assert read(bad) == bytes(b)


def test_a_state_inconsistent_with_the_records_is_refused(tmp_path, rng):
    """A valid-checksum state that holds no offset for records that need one."""
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": "tq4@center"}, {"K": keys(rng, 3)})
    layout = cf._layout
    b = bytearray(read(path))
    at = layout.state_offset + 8
    struct.pack_into("<I", b, at, 0)                        # flags: offset not set
    payload = bytes(b[layout.state_offset + 8:layout.state_offset + layout.state_bytes])
    struct.pack_into("<I", b, layout.state_offset, zlib.crc32(payload, layout.header_crc))
    path.write_bytes(bytes(b))
    with pytest.raises(CacheFileCorrupt) as exc:
        CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, "tq4@center")])
    assert exc.value.reason == "state" and "no offset" in str(exc.value)


def test_a_header_whose_state_runs_past_the_file_is_refused(tmp_path, rng):
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": "tq4@sinks=2"}, {"K": keys(rng, 1)}, chunks=(1,))
    data = read(path)
    path.write_bytes(data[:cf._layout.state_offset + 10])
    with pytest.raises(CacheFileCorrupt) as exc:
        CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, "tq4@sinks=2")])
    assert exc.value.reason == "state"


def test_truncate_below_the_sinks_then_append(tmp_path, rng):
    spec = "tq4@center,sinks=3"
    X, Y = keys(rng, 8), keys(rng, 6)
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": spec}, {"K": X}, chunks=(8,))
    cf.truncate(2)
    cf.close()   # one writer at a time: `back` appends below
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    assert len(back.records) == 2
    np.testing.assert_array_equal(back.records.sink_rows("K"), X[:2])
    back.append(np.arange(6), streams={"K": Y})      # row 2 is a sink again: a rewrite
    again = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    expected = []
    for j in range(SLOTS):
        s = RowStream(get_codec("tq4", DIM), center=True, sinks=3)
        s.append(X[:, j])
        s.truncate(2)
        s.append(Y[:, j])
        expected.append(s.decode())
    np.testing.assert_array_equal(again.records.decode("K"), np.stack(expected, axis=1))
    np.testing.assert_array_equal(again.records.sink_rows("K"), np.concatenate([X[:2], Y[:1]]))


def test_truncate_to_zero_forgets_the_offset(tmp_path, rng):
    spec = "tq4@center,normalize"
    X, Y = keys(rng, 5), keys(rng, 4) * 3.0 + 1.0
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": spec}, {"K": X}, chunks=(5,))
    cf.truncate(0)
    assert cf.records.offset("K") is None
    cf.close()   # one writer at a time: `back` appends below
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    assert len(back.records) == 0 and back.records.offset("K") is None
    back.append(np.arange(4), streams={"K": Y})
    again = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    np.testing.assert_allclose(again.records.offset("K"), Y.mean(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(again.records.decode("K"), numpy_rows(spec, Y, first=4),
                               rtol=1e-6, atol=1e-5)


def test_appends_after_the_sinks_do_not_rewrite(tmp_path, rng, monkeypatch):
    spec = "tq4@center,sinks=2"
    X = keys(rng, 9)
    path = tmp_path / "c.kvq"
    rewrites = []
    real = cachefile_module.write_new_file
    monkeypatch.setattr(cachefile_module, "write_new_file",
                        lambda *a, **k: rewrites.append(1) or real(*a, **k))
    write(path, {"K": spec}, {"K": X}, chunks=(1, 1, 1, 3, 3))
    assert len(rewrites) == 2      # the first append and the second sink; then commits by count
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    np.testing.assert_array_equal(back.records.decode("K"), np.stack(
        [s.decode() for s in row_streams(spec, X, (1, 1, 1, 3, 3))], axis=1))


def test_a_failed_state_rewrite_keeps_the_old_file(tmp_path, rng, monkeypatch):
    spec = "tq4@sinks=3"
    X = keys(rng, 4)
    path = tmp_path / "c.kvq"
    write(path, {"K": spec}, {"K": X[:1]}, chunks=(1,))
    before = read(path)
    cf = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])

    def fail(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cachefile_module, "write_new_file", fail)
    with pytest.raises(CacheFileSaveError):
        cf.append([1], streams={"K": X[1:2]})
    assert read(path) == before
    monkeypatch.undo()
    assert cf.save() == 2                      # the retry rewrites, sinks and all
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    np.testing.assert_array_equal(back.records.sink_rows("K"), X[:2])


def test_bad_rows_change_nothing(tmp_path, rng):
    spec = "tq4@center,sinks=2"
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": spec, "V": "tq4"}, {"K": keys(rng, 1), "V": keys(rng, 1)},
               chunks=(1,))
    before = read(path)
    X = keys(rng, 3)
    X[0, 1, 7] = np.nan                       # a sink row
    with pytest.raises(ValueError, match="sink row"):
        cf.append([1, 2, 3], streams={"K": X, "V": keys(rng, 3)})
    enc = get_codec("tq4", DIM).encode(keys(rng, 2)[:, 0])
    with pytest.raises(ValueError, match="append the float rows"):
        cf.append([1, 2], streams={"K": [enc] * SLOTS, "V": keys(rng, 2)})
    assert len(cf.records) == 1 and read(path) == before
    inert = CacheFile.open(tmp_path / "i.kvq", streams=[Stream("K", DIM, SLOTS, spec)],
                           nonfinite="inert")
    inert.append([0, 1, 2], streams={"K": X})
    assert (inert.records.sink_rows("K")[0, 1] == 0).all()
    assert np.isfinite(inert.records.decode("K")).all()


def test_options_have_no_engine_tier(tmp_path, rng):
    mode = "tq4:compat=colibri@center"
    cf = CacheFile.open(tmp_path / "m", SHAPE, mode=mode)
    assert cf.tier == "kvq" and cf.mode["L"] == mode
    with pytest.raises(ValueError, match="stream options"):
        CacheFile.open(tmp_path / "m", SHAPE, mode=mode, tier="engine")
    with pytest.raises(ValueError, match="stream 'L'.*unknown stream option"):
        CacheFile.open(tmp_path / "m", SHAPE, mode="tq4@centre")


def test_v1_upgrade_under_options_is_one_first_append(tmp_path, rng):
    rows = make_rows(rng, 5, mode="f32")
    path = tmp_path / "c.coli_kv"
    path.write_bytes(hand_engine_bytes("v1", SHAPE, 0, rows))
    mode = "tq4@center,sinks=1"
    cf = CacheFile.open(path, SHAPE, mode=mode)
    assert cf.report.status == "upgraded" and cf.tier == "kvq"
    for j in range(SHAPE.n_layers):
        s = RowStream(get_codec("tq4", SHAPE.kv_lora, nonfinite="inert"), center=True, sinks=1)
        s.append(rows["Lf"][:, j])
        np.testing.assert_array_equal(cf.records.decode("L")[:, j], s.decode())
    cf.save()
    back = CacheFile.open(path, SHAPE, mode=mode)
    np.testing.assert_array_equal(back.records.decode("L"), cf.records.decode("L"))
    np.testing.assert_array_equal(back.records.index, rows["index"])


@pytest.mark.parametrize("spec", ["q4_0+rot@sinks=4", "f32@center,sinks=4", "q4_0"])
def test_few_or_no_rows_decode(tmp_path, rng, spec):
    """Only sink rows held, or none: no codes to decode (q4_0 has no side values)."""
    X = keys(rng, 2)
    cf = CacheFile.open(tmp_path / "c.kvq", streams=[Stream("K", DIM, SLOTS, spec)])
    assert cf.records.decode("K").shape == (0, SLOTS, DIM)
    cf.append([0, 1], streams={"K": X})
    back = CacheFile.open(tmp_path / "c.kvq", streams=[Stream("K", DIM, SLOTS, spec)])
    got = back.records.decode("K")
    if "sinks" in spec:
        np.testing.assert_array_equal(got, X)
    else:
        np.testing.assert_allclose(got, X, atol=0.2 * np.abs(X).max())


def test_codes_of_an_option_stream_are_not_handed_out_as_rows(tmp_path, rng):
    cf = write(tmp_path / "c.kvq", {"K": "tq4@center", "V": "tq4"},
               {"K": keys(rng, 3), "V": keys(rng, 3)}, chunks=(3,))
    with pytest.raises(ValueError, match="records.decode"):
        cf.records.rows("K", 0)
    plain = cf.records.row_stream("V", 1)
    np.testing.assert_array_equal(plain.decode(), cf.records.decode("V")[:, 1])


def test_inspect_shows_the_stream_spec_and_reopens_it(tmp_path, rng, capsys):
    spec = "polar4@center,normalize,sinks=1"
    write(tmp_path / "c.kvq", {"K": spec}, {"K": keys(rng, 4)})
    info = inspect_file(tmp_path / "c.kvq", mode="polar4")
    assert info["codec"] == {"K": spec}
    assert info["as_written"]["result"] == "loads" and info["as_written"]["records"] == 4
    assert info["load"]["result"] == "refused" and info["load"]["reason"] == "options"
    assert cli.main(["inspect", os.fspath(tmp_path / "c.kvq")]) == 0
    out = capsys.readouterr().out
    assert spec in out and "(K: offset, scales, 1 sink row(s))" in out
    assert inspect_file(tmp_path / "c.kvq")["state"] == {
        "K": {"offset": True, "scales": True, "sink_rows": 1}}


@pytest.mark.parametrize("spec", ["tq4", "tq4@center,sinks=1"])
def test_a_file_from_another_kvquant_version_resumes(tmp_path, rng, monkeypatch, spec):
    """The header's writer field changes with the version: slots, state checksum and data
    offset are the file's, so appends land where the file's reader looks."""
    import kvquant
    X = keys(rng, 9)
    path = tmp_path / "c.kvq"
    monkeypatch.setattr(kvquant, "__version__", "0.0.1")
    write(path, {"K": spec}, {"K": X[:4]}, chunks=(4,))
    monkeypatch.setattr(kvquant, "__version__", "0.0.1-a-longer-version-string")
    cf = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    assert cf.report.status == "loaded" and len(cf.records) == 4
    assert cf.append(np.arange(4, 9), streams={"K": X[4:]}) == 9
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    assert back.report.kinds() == ["loaded"] and len(back.records) == 9
    np.testing.assert_array_equal(back.records.decode("K"), cf.records.decode("K"))
    assert inspect_file(path)["header"]["writer"] == "kvquant 0.0.1"   # never rewritten


def test_truncate_while_the_state_is_unsaved_reaches_the_disk(tmp_path, rng):
    spec = "tq4@sinks=8"
    X = keys(rng, 6)
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": spec}, {"K": X[:5]}, chunks=(5,))
    assert cf.append([5], streams={"K": X[5:]}, save=False) == 5   # 5 still durable
    assert cf.truncate(2) == 2 and cf.committed == 2
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])   # as after a crash
    assert len(back.records) == 2
    np.testing.assert_array_equal(back.records.sink_rows("K"), X[:2])


def test_sinks_beyond_the_limit_are_refused_up_front(tmp_path):
    from kvquant.streams.options import MAX_SINKS
    with pytest.raises(ValueError, match=f"0 <= N <= {MAX_SINKS}"):
        CacheFile.open(tmp_path / "c.kvq",
                       streams=[Stream("K", 4, 1, f"f32@sinks={MAX_SINKS + 1}")])
    with pytest.raises(ValueError, match="sinks"):
        RowStream(get_codec("f32", 4), sinks=MAX_SINKS + 1)


def test_the_state_area_holds_only_the_sink_rows_held(tmp_path, rng):
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": "tq4@sinks=1000"}, {"K": keys(rng, 3)}, chunks=(3,))
    assert cf._layout.state_bytes == 8 + 8 + 3 * 4 * SLOTS * DIM
    assert os.path.getsize(path) < cf._layout.data_offset + 3 * cf._layout.record_bytes + 64


def _forge_header(path, edit):
    """Rewrite a kvq file's header JSON through ``edit``, every checksum seeded with the header
    made valid again (prefix, commit slots, stream state); state area and data follow at their
    new offsets, unchanged."""
    import json
    data = read(path)
    magic, version, hlen, _, _ = kvq.PREFIX.unpack_from(data)
    old = json.loads(data[72:72 + hlen])
    state_at = kvq._align8(72 + hlen)
    rest = bytearray(data[state_at:])
    edited = edit(old)
    new = json.dumps(edited, sort_keys=True, separators=(",", ":")).encode()
    crc = zlib.crc32(new)
    version = edited["version"] if isinstance(edited["version"], int) else version
    head = kvq.PREFIX.pack(magic, version, len(new), crc, 0)[:20]
    slots = bytearray(data[24:72])
    for at in (0, 24):
        struct.pack_into("<I", slots, at + 20, zlib.crc32(bytes(slots[at:at + 20]), crc))
    if "state_bytes" in old:
        struct.pack_into("<I", rest, 0, zlib.crc32(bytes(rest[8:old["state_bytes"]]), crc))
    body = head + struct.pack("<I", zlib.crc32(head)) + bytes(slots) + new
    path.write_bytes(body + b"\0" * (kvq._align8(len(body)) - len(body)) + bytes(rest))


@pytest.mark.parametrize("forge, reason", [
    (float, "header"), (str, "header"), (lambda v: -8, "header"), (lambda v: 10**12, "header"),
    (lambda v: v + 2, "header"), (lambda v: v - 4, "state"), (lambda v: v - 768, "state")])
def test_a_malformed_state_size_is_refused(tmp_path, rng, forge, reason):
    path = tmp_path / "c.kvq"
    write(path, {"K": "tq4@center,sinks=1"}, {"K": keys(rng, 2)}, chunks=(2,))
    _forge_header(path, lambda h: {**h, "state_bytes": forge(h["state_bytes"])})
    with pytest.raises(CacheFileCorrupt) as exc:
        CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, "tq4@center,sinks=1")])
    assert exc.value.reason == reason
    info = inspect_file(path)   # inspect describes it without raising
    assert info["problem"] if reason == "header" else info["as_written"]["result"] == "refused"


def test_options_in_a_version_1_header_are_refused(tmp_path, rng):
    path = tmp_path / "c.kvq"
    write(path, {"K": "tq4@center"}, {"K": keys(rng, 2)}, chunks=(2,))
    _forge_header(path, lambda h: {k: v for k, v in h.items() if k != "state_bytes"}
                  | {"version": 1})
    assert struct.unpack_from("<I", read(path), 8)[0] == 1
    with pytest.raises(CacheFileCorrupt, match="options in a version 1 header"):
        CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, "tq4@center")])


# -- recent windows ------------------------------------------------------------------------------
WINDOW_SPECS = ["tq3@recent=4", "polar4@center,sinks=1,recent=3", "kv8@normalize,recent=16"]
WINDOW_CHUNKS = (9, 1, 1, 6, 1)


@pytest.mark.parametrize("spec", WINDOW_SPECS)
def test_a_recent_window_survives_the_file(tmp_path, rng, spec):
    X = keys(rng, sum(WINDOW_CHUNKS))
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": spec}, {"K": X}, chunks=WINDOW_CHUNKS)
    streams = row_streams(spec, X, WINDOW_CHUNKS)
    want = np.stack([s.decode() for s in streams], axis=1)
    np.testing.assert_array_equal(cf.records.decode("K"), want)
    cf.close()   # one writer at a time: `back` truncates below
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    assert back.report.kinds() == ["loaded"]
    np.testing.assert_array_equal(back.records.decode("K"), want)
    q = rng.standard_normal(DIM).astype(np.float32)
    w = rng.random(len(X)).astype(np.float32)
    for j, stream in enumerate(streams):
        loaded = back.records.row_stream("K", j)
        np.testing.assert_array_equal(loaded.scores(q), stream.scores(q))
        np.testing.assert_array_equal(loaded.context(w), stream.context(w))
        loaded.append(X[-1:, j])                  # and it goes on as the original does
        stream.append(X[-1:, j])
        np.testing.assert_array_equal(loaded.decode(), stream.decode())
    # truncation (the count, then the window of that count) and a reload: the loaded stream
    # holds copies of its last window only, so it truncates as a stream restored from that state
    back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    restored = [back.records.row_stream("K", j) for j in range(SLOTS)]
    for stream in restored:
        stream.truncate(len(X) - 3)
    back.truncate(len(X) - 3)
    np.testing.assert_array_equal(back.records.decode("K"),
                                  np.stack([s.decode() for s in restored], axis=1))
    again = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
    np.testing.assert_array_equal(again.records.decode("K"), back.records.decode("K"))


def test_dropping_an_append_gives_the_window_back(tmp_path, rng):
    """Speculative rows appended and then truncated away: memory and file read as before."""
    spec = "tq3@center,recent=4"
    X = keys(rng, 14)
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": spec}, {"K": X[:10]}, chunks=(9, 1))
    before = cf.records.decode("K")
    stream = row_streams(spec, X[:10], (9, 1))[0]
    q = rng.standard_normal(DIM).astype(np.float32)
    scores = stream.scores(q)
    for save in (False, True):
        cf.append(np.arange(10, 14), streams={"K": X[10:]}, save=save)
        cf.truncate(10)
        np.testing.assert_array_equal(cf.records.decode("K"), before)
        back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
        np.testing.assert_array_equal(back.records.decode("K"), before)
    stream.append(X[10:, 0])
    stream.truncate(10)
    np.testing.assert_array_equal(stream.scores(q), scores)


def test_a_failed_commit_keeps_the_last_window(tmp_path, rng, monkeypatch):
    """Fail each write of an append in turn: the file reopens at the old commit with its old
    window, or at the new one with the new window, never a mix."""
    spec = "tq3@recent=4"
    X = keys(rng, 12)
    path = tmp_path / "c.kvq"
    write(path, {"K": spec}, {"K": X[:8]}, chunks=(8,))
    old = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)]).records.decode("K")
    new = np.stack([s.decode() for s in row_streams(spec, X, (8, 4))], axis=1)
    original = read(path)
    real = cachefile_module.pwrite_all
    outcomes = set()
    for fail_at in range(4):   # records, window slot, commit slot, then nothing fails
        path.write_bytes(original)
        calls = []

        def flaky(fd, data, offset):
            calls.append(offset)
            if len(calls) == fail_at + 1:
                raise OSError(5, "Input/output error")
            return real(fd, data, offset)
        monkeypatch.setattr(cachefile_module, "pwrite_all", flaky)
        cf = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
        try:
            cf.append(np.arange(8, 12), streams={"K": X[8:]})
        except CacheFileSaveError:
            # a retry that writes its window and then fails at the commit slot (a crash there)
            def no_commit(fd, data, offset):
                if offset in kvq.SLOT_OFFSETS:
                    raise OSError(5, "Input/output error")
                return real(fd, data, offset)
            monkeypatch.setattr(cachefile_module, "pwrite_all", no_commit)
            with pytest.raises(CacheFileSaveError):
                cf.save()
        monkeypatch.setattr(cachefile_module, "pwrite_all", real)
        back = CacheFile.open(path, streams=[Stream("K", DIM, SLOTS, spec)])
        got = back.records.decode("K")
        if len(got) == 8:
            np.testing.assert_array_equal(got, old)
            outcomes.add("old")
        else:
            np.testing.assert_array_equal(got, new)
            outcomes.add("new")
    assert outcomes == {"old", "new"}


def test_a_damaged_window_slot(tmp_path, rng):
    spec = "tq3@recent=4"
    path = tmp_path / "c.kvq"
    cf = write(path, {"K": spec}, {"K": keys(rng, 10)}, chunks=(8, 2))
    layout, used = cf._layout, cf._slot[0]
    for index, refused in ((1 - used, False), (used, True)):
        b = bytearray(read(path))
        b[layout.window_slot_offset(index) + 40] ^= 0x10
        bad = tmp_path / f"bad{index}.kvq"
        bad.write_bytes(bytes(b))
        if refused:   # the older commit (8 records) and its window are used instead
            back = CacheFile.open(bad, streams=[Stream("K", DIM, SLOTS, spec)])
            assert "window-slot" in back.report.kinds() and len(back.records) == 8
            np.testing.assert_array_equal(back.records.codes("K"), cf.records.codes("K")[:8])
        else:   # the spare slot is not read
            back = CacheFile.open(bad, streams=[Stream("K", DIM, SLOTS, spec)])
            np.testing.assert_array_equal(back.records.decode("K"), cf.records.decode("K"))
        slots = inspect_file(bad)["window_slots"]
        assert slots[index] is None and slots[1 - index] in (8, 10)


def test_inspect_exits_1_on_a_file_this_kvquant_refuses_as_written(tmp_path, rng, monkeypatch,
                                                                     capsys):
    """A file written under another codebook than the one installed here (simulated: the
    running codec's codebook checksum changed) is refused by the loader even under its own
    header's settings: inspect says so and exits 1, not 0."""
    from kvquant.kvfile import loader
    path = tmp_path / "c.kvq"
    write(path, {"K": "tq4"}, {"K": keys(rng, 4)})
    assert cli.main(["inspect", os.fspath(path)]) == 0
    capsys.readouterr()
    real = loader.codec_identity

    def another_codebook(codec):
        ident = real(codec)
        if ident.get("codebook"):
            ident = {**ident, "codebook": {**ident["codebook"], "checksum": "0" * 16}}
        return ident
    monkeypatch.setattr(loader, "codec_identity", another_codebook)
    assert cli.main(["inspect", os.fspath(path)]) == 1
    out = capsys.readouterr().out
    assert "refuses it as written" in out and "codebook" in out
