"""The cache file (kvquant.kvfile): engine tiers byte for byte, our kvq tier, every refusal,
load rules, commit-by-count under injected faults, inspect."""
import errno
import glob
import json
import os
import shutil
import struct

import numpy as np
import pytest

from _kvfile_data import (
    ENGINE_MODES, HAND_MAGIC, SHAPE, hand_engine_bytes, make_rows,
    records_equal)
from kvquant import cli, get_codec
from kvquant.codecs import EncodedRows
from kvquant.kvfile import (
    CacheFile, CacheFileCorrupt, CacheFileMismatch, CacheFileRefused, CacheFileSaveError,
    KVFileShape, Stream, inspect_file, kvq)

ENGINE_TAGS = {"v1": 0, "v2": 1, "v3": 0x104}


def write_cache(path, rows, mode, shape=SHAPE, batches=(3,), **kw):
    """Append ``rows`` in batches of the given sizes (the rest last); return the CacheFile."""
    cf = CacheFile.open(path, shape, mode=mode, **kw)
    n = len(rows["tokens"])
    cuts = [0]
    for b in batches:
        cuts.append(min(n, cuts[-1] + b))
    cuts.append(n)
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b > a:
            cf.append(rows["tokens"][a:b], L=[e[a:b] for e in rows["L"]],
                      R=[e[a:b] for e in rows["R"]], index=rows["index"][a:b])
    return cf


def copy_records(src, path, **kw):
    """A new cache at ``path`` holding src's records (one append)."""
    dst = CacheFile.open(path, src.shape, mode=src.mode if src.shape is None else
                         {k: v for k, v in src.mode.items()}, **kw)
    r = src.records
    dst.append(r.tokens, streams={name: r.stream(name) for name in r.stream_names})
    return dst


def take(rows, a, b):
    """Records a..b-1 of make_rows' output."""
    return {k: ([e[a:b] for e in v] if isinstance(v, list) else v[a:b]) for k, v in rows.items()}


def read(path):
    with open(path, "rb") as f:
        return f.read()


# -- engine tiers: byte for byte ------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["v1", "v2", "v3"])
def test_engine_writer_matches_hand_built_file(tmp_path, rng, tier):
    rows = make_rows(rng, 7, mode=ENGINE_MODES[tier])
    path = tmp_path / "ours.coli_kv"
    cf = write_cache(path, rows, ENGINE_MODES[tier], batches=(2, 1))
    assert cf.tier == tier and cf.committed == 7
    expected = hand_engine_bytes(tier, SHAPE, ENGINE_TAGS[tier], rows)
    assert read(path) == expected
    # Header fields at the offsets the engine reads them.
    assert read(path)[:8] == HAND_MAGIC[tier]
    assert struct.unpack_from("<i", read(path), 32)[0] == 7
    assert struct.unpack_from("<i", read(path), 36)[0] == ENGINE_TAGS[tier]


@pytest.mark.parametrize("tier", ["v1", "v2", "v3"])
def test_engine_round_trip_byte_identical(tmp_path, rng, tier):
    rows = make_rows(rng, 9, mode=ENGINE_MODES[tier])
    hand = tmp_path / "hand.coli_kv"
    hand.write_bytes(hand_engine_bytes(tier, SHAPE, ENGINE_TAGS[tier], rows))
    cf = CacheFile.open(hand, SHAPE, mode=ENGINE_MODES[tier])
    assert cf.report.status == "loaded" and len(cf) == 9 and cf.report.file_tier == tier
    np.testing.assert_array_equal(cf.records.tokens, rows["tokens"])
    for j in range(SHAPE.n_layers):
        np.testing.assert_array_equal(cf.records.L[j].codes, rows["L"][j].codes)
        np.testing.assert_array_equal(cf.records.R[j].side, rows["R"][j].side)
    np.testing.assert_array_equal(cf.records.index, rows["index"])
    copy = copy_records(cf, tmp_path / "copy.coli_kv")
    assert read(tmp_path / "copy.coli_kv") == read(hand)
    assert copy.tier == tier


def test_real_polar_is_v3_with_tag_bits(tmp_path, rng):
    """polar b bits (codec 0) writes COLIKV3 with h7 = b; another width or codec is refused."""
    rows = make_rows(rng, 5, mode="polar3:compat=colibri")
    path = tmp_path / "p.coli_kv"
    assert write_cache(path, rows, "polar3:compat=colibri").tier == "v3"
    assert read(path) == hand_engine_bytes("v3", SHAPE, 3, rows)
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(path, SHAPE, mode="polar4:compat=colibri")
    assert exc.value.reason == "bits"
    assert "codec 0, 3-bit (polar3:compat=colibri) != running codec 0, 4-bit" in str(exc.value)
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(path, SHAPE, mode="tq4:compat=colibri")
    assert exc.value.reason == "codec"
    assert "codec 0, 3-bit" in str(exc.value) and "codec 1, 4-bit" in str(exc.value)
    write_cache(tmp_path / "k", make_rows(rng, 3, mode="polar3"), "polar3")
    assert CacheFile.open(tmp_path / "k", SHAPE, mode="polar3").report.loaded == 3
    with pytest.raises(CacheFileMismatch):
        CacheFile.open(tmp_path / "k", SHAPE, mode="polar4")


def test_f16_side_values_are_two_bytes_in_the_kvq_file(tmp_path, rng):
    mode = "tq4:side_dtype=f16"
    rows = make_rows(rng, 7, mode=mode)
    write_cache(tmp_path / "h.kvq", rows, mode, batches=())
    info = inspect_file(tmp_path / "h.kvq")
    assert [s["side_dtype"] for s in info["header"]["streams"]] == ["f16", "f16", "f32"]
    # the record as laid out by hand: token, L codes, L sides <f2, R codes, R sides <f2, index
    cl, cr = get_codec(mode, SHAPE.kv_lora), get_codec(mode, SHAPE.qk_rope)
    n = SHAPE.n_layers
    record = np.dtype([("token", "<i4"), ("Lc", "u1", (n, cl.code_bytes)), ("Ls", "<f2", (n, 1)),
                       ("Rc", "u1", (n, cr.code_bytes)), ("Rs", "<f2", (n, 1)),
                       ("index", "<f4", (SHAPE.n_index_layers, SHAPE.index_hd))])
    assert info["record_bytes"] == record.itemsize == (
        4 + n * (cl.bytes_per_row + cr.bytes_per_row) + 4 * SHAPE.n_index_layers * SHAPE.index_hd)
    f32_file = write_cache(tmp_path / "f.kvq", make_rows(rng, 1, mode="tq4"), "tq4")
    assert f32_file._layout.record_bytes == record.itemsize + 2 * 2 * n
    data = read(tmp_path / "h.kvq")[info["data_offset"]:]
    arr = np.frombuffer(data, record, count=7)
    for j in range(n):
        assert np.array_equal(arr["Ls"][:, j, 0].astype(np.float32), rows["L"][j].side[:, 0])
        assert np.array_equal(arr["Rs"][:, j, 0].astype(np.float32), rows["R"][j].side[:, 0])
        assert np.array_equal(arr["Lc"][:, j], rows["L"][j].codes)
    back = CacheFile.open(tmp_path / "h.kvq", SHAPE, mode=mode)
    assert back.report.status == "loaded"
    for j in range(n):
        assert np.array_equal(back.records.L[j].side, rows["L"][j].side)
        assert back.records.L[j].nbytes == 7 * cl.bytes_per_row


def test_kvq_header_without_side_dtype_means_f32(tmp_path, rng, monkeypatch):
    # a file from before side_dtype was recorded: its header lacks the key
    def old_identity(codec, real=kvq.codec_identity):
        return {k: v for k, v in real(codec).items() if k != "side_dtype"}
    monkeypatch.setattr(kvq, "codec_identity", old_identity)
    rows = make_rows(rng, 4, mode="tq4")
    write_cache(tmp_path / "old.kvq", rows, "tq4")
    monkeypatch.undo()
    assert "side_dtype" not in inspect_file(tmp_path / "old.kvq")["header"]["streams"][0]
    back = CacheFile.open(tmp_path / "old.kvq", SHAPE, mode="tq4")
    assert back.report.status == "loaded" and records_equal(back.records, write_cache(
        tmp_path / "new.kvq", rows, "tq4").records)
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(tmp_path / "old.kvq", SHAPE, mode="tq4:side_dtype=f16")
    assert exc.value.reason == "side" and "side-value dtype 'f32'" in str(exc.value)
    # appends commit under the old file's own header bytes (its checksum seeds and offsets)
    more = make_rows(rng, 3, mode="tq4")
    back.append(more["tokens"], L=more["L"], R=more["R"], index=more["index"])
    again = CacheFile.open(tmp_path / "old.kvq", SHAPE, mode="tq4")
    assert again.report.kinds() == ["loaded"] and len(again.records) == 7
    assert records_equal(again.records, back.records)


def test_no_engine_tier_for_f16_side_values(tmp_path):
    for mode in ("tq4:side_dtype=f16", "polar4:side_dtype=f16"):
        assert CacheFile.open(tmp_path / "x", SHAPE, mode=mode).tier == "kvq"
        with pytest.raises(ValueError, match="no engine tier.*engine stores f32 side values"):
            CacheFile.open(tmp_path / "x", SHAPE, mode=mode, tier="engine")


def test_append_refuses_f16_rows_with_f32_side_values(tmp_path, rng):
    mode = "tq4:side_dtype=f16"
    rows = make_rows(rng, 3, mode="tq4")
    forged = [EncodedRows(e.codes, e.side * np.float32(1.0001), mode, e.dim, "f16")
              for e in rows["L"]]
    cf = CacheFile.open(tmp_path / "x", SHAPE, mode=mode)
    with pytest.raises(ValueError, match="float16 cannot represent"):
        cf.append(rows["tokens"], L=forged, R=rows["Rf"], index=rows["index"])
    assert len(cf) == 0


def test_no_engine_tier_for_codecs_without_tag(tmp_path):
    for mode in ("kv8-g8", "tq4", "tq4:compat=colibri,seed=7", {"L": "kv8", "R": "f32"}):
        assert CacheFile.open(tmp_path / "x", SHAPE, mode=mode).tier == "kvq"
    with pytest.raises(ValueError, match="KV8_GS"):
        CacheFile.open(tmp_path / "x", SHAPE, mode="kv8-g8", tier="engine")
    with pytest.raises(ValueError, match="different codecs"):
        CacheFile.open(tmp_path / "x", SHAPE, mode={"L": "kv8", "R": "f32"}, tier="engine")


# -- our tier -----------------------------------------------------------------------------------
KVQ_MODES = ["f32", "kv8", "kv8-g8", "tq3", "tq4:side=unbiased", "tq2:codebook=gaussian,seed=5",
             {"L": "kv8-g4", "R": "tq4:compat=colibri"}, "tq4:side_dtype=f16",
             {"L": "polar4:side_dtype=f16", "R": "tq3:side=unbiased,side_dtype=f16"}]


@pytest.mark.parametrize("mode", KVQ_MODES, ids=str)
def test_kvq_round_trip_byte_identical(tmp_path, rng, mode):
    spec = mode if isinstance(mode, str) else mode["L"]
    rows = make_rows(rng, 11, mode=spec)
    if not isinstance(mode, str):
        cr = get_codec(mode["R"], SHAPE.qk_rope)
        rows["R"] = [cr.encode(rows["Rf"][:, j], n_threads=1) for j in range(SHAPE.n_layers)]
    a = write_cache(tmp_path / "a.kvq", rows, mode, batches=(), tier="kvq", block_records=4)
    b = write_cache(tmp_path / "b.kvq", rows, mode, batches=(2, 3, 1), tier="kvq",
                    block_records=4)
    assert a.tier == b.tier == "kvq"
    back = CacheFile.open(tmp_path / "a.kvq", SHAPE, mode=mode, tier="kvq")
    assert back.report.status == "loaded" and records_equal(back.records, a.records)
    copy_records(back, tmp_path / "c.kvq", tier="kvq", block_records=4)
    assert read(tmp_path / "c.kvq") == read(tmp_path / "a.kvq")
    # Several appends leave the same bytes except the commit slots.
    da, db = read(tmp_path / "a.kvq"), read(tmp_path / "b.kvq")
    assert da[:24] == db[:24] and da[72:] == db[72:]
    assert CacheFile.open(tmp_path / "b.kvq", SHAPE, mode=mode, tier="kvq").report.loaded == 11


def test_kvq_header_records_what_the_engine_forgets(tmp_path, rng):
    rows = make_rows(rng, 3, mode="tq3:seed=0x1234")
    write_cache(tmp_path / "h.kvq", rows, "tq3:seed=0x1234")
    info = inspect_file(tmp_path / "h.kvq")
    L = info["header"]["streams"][0]
    assert L["spec"] == "tq3:seed=0x1234" and L["bits"] == 3 and L["side"] == "norm"
    assert L["side_dtype"] == "f32"
    assert L["rotation"]["seed"] == 0x1234
    assert L["rotation"]["sign_hash"] == "murmur3-fmix32+golden"
    assert L["rotation"]["ordering"] == "sylvester"
    assert L["codebook"]["identity"] == "beta-d32-b3"
    assert L["codebook"]["checksum"] == get_codec("tq3", 32).codebook_checksum
    assert (L["dim"], L["rows"], L["code_bytes"], L["n_side"]) == (32, 3, 12, 1)
    assert info["header"]["streams"][2]["spec"] == "f32"
    assert info["integrity"].startswith("CRC32")


def test_gqa_streams_with_different_codecs(tmp_path, rng):
    streams = [Stream("K", 64, rows=4, spec="tq4"), Stream("V", 64, rows=4, spec="kv8-g16")]
    K = rng.standard_normal((6, 4, 64)).astype(np.float32)
    V = rng.standard_normal((6, 4, 64)).astype(np.float32)
    cf = CacheFile.open(tmp_path / "g.kvq", streams=streams, vocab=100)
    cf.append(np.arange(6), streams={"K": K, "V": V})
    back = CacheFile.open(tmp_path / "g.kvq", streams=streams, vocab=100)
    assert back.tier == "kvq" and records_equal(back.records, cf.records)
    np.testing.assert_allclose(back.records.decode("V"), V, atol=0.1 * np.abs(V).max())
    rel = np.linalg.norm(back.records.decode("K") - K) / np.linalg.norm(K)
    assert rel < 0.15
    other = [streams[0], Stream("V", 64, rows=4, spec="kv8")]
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(tmp_path / "g.kvq", streams=other, vocab=100)
    assert exc.value.reason == "codec" and "'V'" in str(exc.value)
    wider = [streams[0], Stream("V", 64, rows=5, spec="kv8-g16")]
    ign = CacheFile.open(tmp_path / "g.kvq", streams=wider, vocab=100)
    assert ign.report.status == "ignored" and len(ign) == 0


# -- refusals -------------------------------------------------------------------------------------
REFUSALS = [
    # (written under, tier, opened under, tier, reason, fragments of the message)
    ("kv8", "auto", "f32", "auto", "tier", ["v2 (fp8)", "'f32', tier v1 (f32)", "mode='kv8'"]),
    ("tq4:compat=colibri", "auto", "f32", "auto", "tier",
     ["v3 (rotated, tag 0x104 = codec 1, 4-bit: tq4:compat=colibri)",
      "mode='tq4:compat=colibri'"]),
    ("tq4:compat=colibri", "auto", "kv8", "auto", "tier", ["v3 (rotated", "tier v2 (fp8)"]),
    ("kv8", "auto", "tq4:compat=colibri", "auto", "tier", ["v2 (fp8)", "tier v3"]),
    ("kv8", "auto", "kv8", "kvq", "tier", ["v2 (fp8)", "kvq (self-describing)"]),
    ("kv8", "kvq", "kv8", "engine", "tier", ["kvq (self-describing)", "tier='auto' or 'kvq'"]),
    ("tq4:compat=colibri", "auto", "tq4", "auto", "tier", ["v3 (rotated", "tier kvq"]),
    ("tq4:seed=0x1234", "auto", "tq4", "auto", "seed",
     ["rotation seed 0x00001234", "0x9e3779b9"]),
    ("tq4", "auto", "tq4:codebook=gaussian", "auto", "codebook",
     ["codebook 'beta-d32-b4'", "'gaussian-b4'"]),
    ("tq4", "auto", "tq4:side=unbiased", "auto", "side", ["side-value kind 'norm'", "'unbiased'"]),
    ("tq4", "auto", "tq4:side_dtype=f16", "auto", "side",
     ["side-value dtype 'f32' (tq4)", "'f16' (tq4:side_dtype=f16)"]),
    ("polar3:side_dtype=f16", "auto", "polar3", "auto", "side",
     ["side-value dtype 'f16' (polar3:side_dtype=f16)", "'f32' (polar3)"]),
    ("tq4:compat=colibri", "auto", "tq4:side_dtype=f16", "auto", "tier",
     ["v3 (rotated", "tier kvq"]),
    ("tq3", "auto", "tq4", "auto", "bits", ["bit width 3", "4"]),
    ("kv8-g8", "auto", "kv8-g4", "auto", "codec", ["kv8-g8", "kv8-g4"]),
    ("tq4", "auto", "kv8-g8", "auto", "codec", ["codec family 'tq'", "'kv8'"]),
]


@pytest.mark.parametrize("written, wtier, opened, otier, reason, fragments", REFUSALS,
                         ids=[f"{r[0]}-{r[1]}-under-{r[2]}-{r[3]}" for r in REFUSALS])
def test_refusal(tmp_path, rng, written, wtier, opened, otier, reason, fragments):
    path = tmp_path / "c"
    rows = make_rows(rng, 5, mode=written)
    write_cache(path, rows, written, tier=wtier)
    before = read(path)
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(path, SHAPE, mode=opened, tier=otier)
    err = exc.value
    assert err.reason == reason and isinstance(err, ValueError) and err.path == str(path)
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))
    # Starting over: empty, the reason in the report, the old file untouched until a save.
    cf = CacheFile.open(path, SHAPE, mode=opened, tier=otier, on_mismatch="start_over")
    assert cf.report.status == "started-over" and len(cf) == 0 and cf.committed == 0
    assert cf.report.events[-1].detail["reason"] == reason
    assert read(path) == before
    fresh = make_rows(rng, 2, mode=opened)
    cf.append(fresh["tokens"], L=fresh["L"], R=fresh["R"], index=fresh["index"])
    assert read(path) != before
    again = CacheFile.open(path, SHAPE, mode=opened, tier=otier)
    assert again.report.status == "loaded" and len(again) == 2


def test_kvq_file_kept_under_auto_when_codecs_match(tmp_path, rng):
    """mode kv8 would start a v2 file; an existing kvq file of kv8 rows is resumed as kvq."""
    rows = make_rows(rng, 4, mode="kv8")
    write_cache(tmp_path / "c", rows, "kv8", tier="kvq")
    cf = CacheFile.open(tmp_path / "c", SHAPE, mode="kv8")
    assert cf.report.status == "loaded" and cf.tier == "kvq" and len(cf) == 4
    cf.append(rows["tokens"][:1], L=[e[:1] for e in rows["L"]], R=[e[:1] for e in rows["R"]],
              index=rows["index"][:1])
    assert read(tmp_path / "c")[:8] == b"KVQCACHE"
    assert CacheFile.open(tmp_path / "c", SHAPE, mode="kv8").report.loaded == 5
    assert CacheFile.open(tmp_path / "new", SHAPE, mode="kv8").tier == "v2"


def test_engine_file_under_a_streams_cache_is_ignored(tmp_path, rng):
    write_cache(tmp_path / "c", make_rows(rng, 2, mode="kv8"), "kv8")
    cf = CacheFile.open(tmp_path / "c", streams=[Stream("K", 8, 2, "kv8")])
    assert cf.report.status == "ignored" and "MLA" in cf.report.messages[0]


def test_refusal_kvq_codebook_checksum(tmp_path, rng, monkeypatch):
    """Same codebook name, other levels (a refit): refused by the checksum."""
    write_cache(tmp_path / "c", make_rows(rng, 3, mode="tq4"), "tq4")
    import kvquant.codecs.lloyd as lloyd
    monkeypatch.setattr(lloyd, "levels_checksum", lambda levels: "0" * 64)
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(tmp_path / "c", SHAPE, mode="tq4")
    assert exc.value.reason == "codebook" and "codebook checksum" in str(exc.value)


def test_refusal_v3_other_bits_and_codec_hand_built(tmp_path, rng):
    rows = make_rows(rng, 2, mode="tq4:compat=colibri")
    for tag, reason, text in [(0x103, "bits", "v3 codec 1, 3-bit (tq3:compat=colibri) != "
                                               "running codec 1, 4-bit"),
                              (0x004, "codec", "v3 codec 0, 4-bit (polar4:compat=colibri)")]:
        path = tmp_path / f"t{tag}"
        path.write_bytes(hand_engine_bytes("v3", SHAPE, tag, rows))
        with pytest.raises(CacheFileMismatch) as exc:
            CacheFile.open(path, SHAPE, mode="tq4:compat=colibri")
        assert exc.value.reason == reason and text in str(exc.value)


def test_refusal_bad_tag_context_not_a_cache(tmp_path, rng):
    rows = make_rows(rng, 4, mode="kv8")
    p = tmp_path / "tag"
    p.write_bytes(hand_engine_bytes("v2", SHAPE, 7, rows))
    with pytest.raises(CacheFileMismatch, match="format tag 7") as exc:
        CacheFile.open(p, SHAPE, mode="kv8")
    assert exc.value.reason == "tag"
    p = tmp_path / "ctx"
    p.write_bytes(hand_engine_bytes("v2", SHAPE, 1, rows))
    with pytest.raises(CacheFileMismatch, match=r"4 tokens\) exceeds the context \(3\)") as exc:
        CacheFile.open(p, SHAPE, mode="kv8", max_records=3)
    assert exc.value.reason == "context"
    assert CacheFile.open(p, SHAPE, mode="kv8", max_records=4).report.loaded == 4
    p = tmp_path / "notes.txt"
    p.write_bytes(b"my precious notes")
    with pytest.raises(CacheFileMismatch, match="not a cache file") as exc:
        CacheFile.open(p, SHAPE, mode="kv8")
    assert exc.value.reason == "not-a-cache" and p.read_bytes() == b"my precious notes"


# -- ignored files, v1 upgrade ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["kv8", "tq4"])
def test_other_model_is_ignored_and_kept_until_first_save(tmp_path, rng, mode):
    path = tmp_path / "c"
    write_cache(path, make_rows(rng, 4, mode=mode), mode)
    before = read(path)
    other = KVFileShape(4, 32, 8, 4, 2, 256)
    cf = CacheFile.open(path, other, mode=mode)
    assert cf.report.status == "ignored" and len(cf) == 0
    assert "different model" in cf.report.messages[0]
    if mode == "kv8":
        assert "n_layers 3 != 4" in cf.report.messages[0]
    assert read(path) == before
    rows = make_rows(rng, 1, shape=other, mode=mode)
    cf.append(rows["tokens"], L=rows["L"], R=rows["R"], index=rows["index"])
    assert CacheFile.open(path, other, mode=mode).report.loaded == 1


@pytest.mark.parametrize("head", [b"COLIKV1\x00" + b"\x03\x00", b"COLIKV9\x00" + b"\0" * 40,
                                  b"COLI", b""])
def test_torn_or_other_version_header_ignored(tmp_path, rng, head):
    path = tmp_path / "c"
    path.write_bytes(head)
    cf = CacheFile.open(path, SHAPE, mode="kv8")
    assert cf.report.status == ("new" if head == b"" else "ignored")
    rows = make_rows(rng, 2, mode="kv8")
    cf.append(rows["tokens"], L=rows["L"], R=rows["R"], index=rows["index"])
    assert read(path) == hand_engine_bytes("v2", SHAPE, 1, rows)


@pytest.mark.parametrize("mode, tier, new_tier", [("kv8", "auto", "v2"),
                                                  ("tq4:compat=colibri", "auto", "v3"),
                                                  ("tq3", "auto", "kvq"), ("kv8", "kvq", "kvq")])
def test_v1_upgrade(tmp_path, rng, mode, tier, new_tier):
    path = tmp_path / "c"
    rows = make_rows(rng, 6, mode="f32")
    rows["Lf"][2, 1, 5] = np.nan  # the engine stores such a row inert
    rows["L"] = [get_codec("f32", 32, nonfinite="inert").encode(rows["Lf"][:, j])
                 for j in range(3)]
    path.write_bytes(hand_engine_bytes("v1", SHAPE, 0, rows))
    before = read(path)
    cf = CacheFile.open(path, SHAPE, mode=mode, tier=tier)
    assert cf.report.status == "upgraded" and cf.tier == new_tier
    assert len(cf) == 6 and cf.committed == 0 and cf.pending == 6
    assert "1 row(s) with NaN/inf stored inert" in cf.report.messages[0]
    codec = get_codec(mode, 32, nonfinite="inert")
    for j in range(3):
        want = codec.encode(rows["Lf"][:, j], n_threads=1)
        np.testing.assert_array_equal(cf.records.L[j].codes, want.codes)
        np.testing.assert_array_equal(cf.records.L[j].side, want.side)
    np.testing.assert_array_equal(cf.records.index, rows["index"])
    assert read(path) == before  # untouched until the first save
    more = make_rows(rng, 2, mode=mode)
    cf.append(more["tokens"], L=more["L"], R=more["R"], index=more["index"])
    assert cf.committed == 8
    back = CacheFile.open(path, SHAPE, mode=mode, tier=tier)
    assert back.report.file_tier == new_tier and records_equal(back.records, cf.records)
    with pytest.raises(CacheFileMismatch):
        CacheFile.open(path, SHAPE, mode="f32")


# -- load rules -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["v1", "v2", "v3"])
def test_engine_truncated_tail_cut_then_repaired(tmp_path, rng, tier):
    mode = ENGINE_MODES[tier]
    rows = make_rows(rng, 7, mode=mode)
    path = tmp_path / "c"
    full = hand_engine_bytes(tier, SHAPE, ENGINE_TAGS[tier], rows)
    rec = (len(full) - 40) // 7
    path.write_bytes(full[:40 + 4 * rec + rec // 2])
    cf = CacheFile.open(path, SHAPE, mode=mode)
    assert len(cf) == 4 and cf.report.header_count == 7
    assert "truncated" in cf.report.kinds()
    assert "4 complete record(s) of the 7 committed" in " ".join(cf.report.messages)
    extra = make_rows(rng, 2, mode=mode)
    cf.append(extra["tokens"], L=extra["L"], R=extra["R"], index=extra["index"])
    assert struct.unpack_from("<i", read(path), 32)[0] == 6
    back = CacheFile.open(path, SHAPE, mode=mode)
    assert back.report.kinds() == ["loaded"] and len(back) == 6
    assert records_equal(back.records, cf.records)


def test_engine_uncommitted_tail_and_negative_count(tmp_path, rng):
    rows = make_rows(rng, 5, mode="kv8")
    path = tmp_path / "c"
    path.write_bytes(hand_engine_bytes("v2", SHAPE, 1, rows, count=3))
    cf = CacheFile.open(path, SHAPE, mode="kv8")
    assert len(cf) == 3 and "uncommitted-tail" in cf.report.kinds()
    path.write_bytes(hand_engine_bytes("v2", SHAPE, 1, rows, count=-5))
    cf = CacheFile.open(path, SHAPE, mode="kv8")
    assert len(cf) == 0 and "count" in cf.report.kinds()
    cf.append(rows["tokens"][:1], L=[e[:1] for e in rows["L"]], R=[e[:1] for e in rows["R"]],
              index=rows["index"][:1])
    assert CacheFile.open(path, SHAPE, mode="kv8").report.loaded == 1


def test_engine_bad_side_values_make_rows_inert(tmp_path, rng):
    rows = make_rows(rng, 6, mode="kv8")
    L1, R0 = rows["L"][1], rows["R"][0]
    bad = {0: np.nan, 2: -1.0, 3: 0.0, 4: np.inf}
    for t, v in bad.items():
        L1.side[t, 0] = v
    R0.side[5, 0] = 3.4e38 * 1.0000001  # above the engine's bound, still finite in f32
    rows["L"][2].codes[1, 7] = 0x7F      # an fp8 NaN byte
    path = tmp_path / "c"
    path.write_bytes(hand_engine_bytes("v2", SHAPE, 1, rows))
    cf = CacheFile.open(path, SHAPE, mode="kv8")
    assert len(cf) == 6
    events = {e.kind: e for e in cf.report.events if e.kind in ("bad-side", "bad-code")}
    side_events = [e for e in cf.report.events if e.kind == "bad-side"]
    assert {e.detail["stream"] for e in side_events} == {"L", "R"}
    L_event = [e for e in side_events if e.detail["stream"] == "L"][0]
    assert L_event.detail["records"] == [0, 2, 3, 4]
    assert events["bad-code"].detail["records"] == [1]
    L = cf.records.L[1]
    for t in bad:
        assert L.side[t, 0] == 1.0 and not L.codes[t].any()
    assert L.side[1, 0] == rows["L"][1].side[1, 0]
    np.testing.assert_array_equal(L.codes[1], rows["L"][1].codes[1])
    assert cf.records.R[0].side[5, 0] == 1.0
    assert cf.records.L[2].codes[1, 7] == 0

    rows = make_rows(rng, 4, mode="tq4:compat=colibri")
    for t, v in {0: -0.5, 1: np.nan, 2: np.inf}.items():
        rows["R"][2].side[t, 0] = v
    path.write_bytes(hand_engine_bytes("v3", SHAPE, 0x104, rows))
    cf = CacheFile.open(path, SHAPE, mode="tq4:compat=colibri")
    R = cf.records.R[2]
    assert list(R.side[:3, 0]) == [0, 0, 0] and R.side[3, 0] == rows["R"][2].side[3, 0]
    np.testing.assert_array_equal(R.codes, rows["R"][2].codes)  # the engine keeps the codes
    assert [e.kind for e in cf.report.events].count("bad-side") == 1


def test_bad_token_ids_cut(tmp_path, rng):
    rows = make_rows(rng, 6, mode="kv8")
    rows["tokens"][3] = 300
    path = tmp_path / "c"
    path.write_bytes(hand_engine_bytes("v2", SHAPE, 1, rows))
    cf = CacheFile.open(path, SHAPE, mode="kv8")
    assert len(cf) == 3 and "bad-token" in cf.report.kinds()


def test_kvq_bad_side_values_rewritten(tmp_path, rng, monkeypatch):
    rows = make_rows(rng, 3, mode="tq3")
    rows["L"][0].side[1, 0] = -2.0
    import kvquant.kvfile.cachefile as cfmod
    monkeypatch.setattr(cfmod, "check_side_values", lambda *a: None)  # forge a bad writer
    write_cache(tmp_path / "c", rows, "tq3")
    monkeypatch.undo()
    cf = CacheFile.open(tmp_path / "c", SHAPE, mode="tq3")
    assert "bad-side" in cf.report.kinds() and cf.records.L[0].side[1, 0] == 0
    assert cf.committed == 0  # the inert row is written back by a rewrite at the first save
    cf.save()
    back = CacheFile.open(tmp_path / "c", SHAPE, mode="tq3")
    assert back.report.kinds() == ["loaded"] and records_equal(back.records, cf.records)


def test_kvq_damage_detected(tmp_path, rng):
    rows = make_rows(rng, 10, mode="kv8-g8")
    path = tmp_path / "c"
    writer = write_cache(path, rows, "kv8-g8", batches=(6,), block_records=4)
    newest = writer._slot[0]  # the slot of the last commit (count 10; the other says 6)
    good = read(path)
    layout_offset = writer._layout.record_offset
    writer.close()   # one writer at a time: a cut file is appended to below

    def damaged(pos, xor=0x10):
        b = bytearray(good)
        b[pos] ^= xor
        path.write_bytes(bytes(b))
        return path

    # A flipped byte in block 1 (records 4..7): cut to 4, never decoded as data.
    cf = CacheFile.open(damaged(layout_offset(5) + 3), SHAPE, mode="kv8-g8")
    assert len(cf) == 4 and "corrupt-block" in cf.report.kinds()
    assert "block 1 (records 4..7) fails its checksum: cut to 4 record(s), 6 dropped" in \
        " ".join(cf.report.messages)
    # ... in the tail block (records 8, 9: covered by the commit slot's tail CRC).
    assert len(CacheFile.open(damaged(layout_offset(9)), SHAPE, mode="kv8-g8")) == 8
    # The newest commit slot damaged: the older one (count 6) is used.
    cf = CacheFile.open(damaged(kvq.SLOT_OFFSETS[newest] + 2), SHAPE, mode="kv8-g8")
    assert len(cf) == 6 and "commit-slot" in cf.report.kinds()
    # Both slots damaged, the header, the prefix: refused, never overwritten silently.
    b = bytearray(good)
    b[26] ^= 1
    b[50] ^= 1
    path.write_bytes(bytes(b))
    with pytest.raises(CacheFileCorrupt) as exc:
        CacheFile.open(path, SHAPE, mode="kv8-g8")
    assert exc.value.reason == "commit"
    for pos in (kvq.HEADER_OFFSET + 5, 13):
        with pytest.raises(CacheFileCorrupt) as exc:
            CacheFile.open(damaged(pos), SHAPE, mode="kv8-g8")
        assert exc.value.reason == "header"
    with pytest.raises(CacheFileMismatch) as exc:  # a flipped magic: not ours any more
        CacheFile.open(damaged(2), SHAPE, mode="kv8-g8")
    assert exc.value.reason == "not-a-cache"
    # A cut inside block 1: cut to the last intact block; the next append repairs the commit.
    path.write_bytes(good[:layout_offset(6)])
    cf = CacheFile.open(path, SHAPE, mode="kv8-g8")
    assert len(cf) == 4 and "truncated" in cf.report.kinds()
    more = make_rows(rng, 3, mode="kv8-g8")
    cf.append(more["tokens"], L=more["L"], R=more["R"], index=more["index"])
    back = CacheFile.open(path, SHAPE, mode="kv8-g8")
    assert back.report.kinds() == ["loaded"] and records_equal(back.records, cf.records)
    assert len(back) == 7


def test_kvq_version_mismatch_refused(tmp_path, rng):
    path = tmp_path / "c"
    write_cache(path, make_rows(rng, 2, mode="tq4"), "tq4")
    b = bytearray(read(path))
    struct.pack_into("<I", b, 8, max(kvq.VERSIONS) + 1)
    import zlib
    struct.pack_into("<I", b, 20, zlib.crc32(bytes(b[:20])))
    path.write_bytes(bytes(b))
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(path, SHAPE, mode="tq4")
    assert exc.value.reason == "version"


# -- append, truncate, records ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["kv8", "tq4"])
def test_truncate_then_append(tmp_path, rng, mode):
    path = tmp_path / "c"
    rows = make_rows(rng, 9, mode=mode)
    cf = write_cache(path, rows, mode, block_records=2)
    cf.truncate(5)
    assert len(cf) == 5 and cf.committed == 5
    assert CacheFile.open(path, SHAPE, mode=mode).report.loaded == 5
    more = make_rows(rng, 3, mode=mode)
    cf.append(more["tokens"], L=more["L"], R=more["R"], index=more["index"])
    back = CacheFile.open(path, SHAPE, mode=mode)
    assert len(back) == 8 and records_equal(back.records, cf.records)
    np.testing.assert_array_equal(back.records.tokens[5:], more["tokens"])
    cf.truncate(0)
    assert CacheFile.open(path, SHAPE, mode=mode).report.loaded == 0


def test_append_floats_and_records_api(tmp_path, rng):
    cf = CacheFile.open(tmp_path / "c", SHAPE, mode="kv8")
    rows = make_rows(rng, 4, mode="kv8")
    assert cf.append(rows["tokens"], L=rows["Lf"], R=rows["Rf"], index=rows["index"]) == 4
    r = cf.records
    assert len(r.L) == 3 and isinstance(r.L[0], EncodedRows) and r.L[0].n_rows == 4
    np.testing.assert_array_equal(r.L[1].codes, rows["L"][1].codes)
    assert r.codes("R").shape == (4, 3, 8) and r.side("R").shape == (4, 3, 1)
    assert r.decode("L").shape == (4, 3, 32)
    assert not r.tokens.flags.writeable
    np.testing.assert_array_equal(r.index, rows["index"])


def test_append_validation(tmp_path, rng):
    cf = CacheFile.open(tmp_path / "c", SHAPE, mode="kv8")
    rows = make_rows(rng, 2, mode="kv8")
    ok = {"L": rows["L"], "R": rows["R"], "index": rows["index"]}
    with pytest.raises(ValueError, match="token ids must lie in"):
        cf.append([1, 256], **ok)
    with pytest.raises(ValueError, match="missing"):
        cf.append([1, 2], L=rows["L"], R=rows["R"])
    with pytest.raises(ValueError, match="expected 3 row slot"):
        cf.append([1, 2], L=rows["L"][:2], R=rows["R"], index=rows["index"])
    tq = make_rows(rng, 2, mode="tq4:compat=colibri")
    with pytest.raises(ValueError, match="encoded by 'tq4:compat=colibri'"):
        cf.append([1, 2], L=tq["L"], R=rows["R"], index=rows["index"])
    bad = [EncodedRows(e.codes, e.side * -1, e.spec, e.dim) for e in rows["L"]]
    with pytest.raises(ValueError, match=r"side values \(scale\) must be in \(0, 3.4e38\)"):
        cf.append([1, 2], L=bad, R=rows["R"], index=rows["index"])
    with pytest.raises(ValueError, match="unknown stream"):
        cf.append([1, 2], streams={"K": rows["L"]}, **ok)
    assert len(cf) == 0 and not os.path.exists(tmp_path / "c")
    ro = CacheFile.open(tmp_path / "c", SHAPE, mode="kv8", readonly=True)
    with pytest.raises(ValueError, match="readonly"):
        ro.append([1, 2], **ok)


# -- faults at every write and fsync --------------------------------------------------------------
class Faults:
    """Make the k-th pwrite/fsync/replace fail with ENOSPC (k = 0: never)."""

    def __init__(self, monkeypatch):
        self.calls, self.fail_at = 0, 0
        for name in ("pwrite", "fsync", "replace"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._wrap(real))

    def _wrap(self, real):
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(*args, **kwargs)
        return call

    def arm(self, k):
        self.calls, self.fail_at = 0, k


@pytest.mark.parametrize("mode, tier", [("f32", "auto"), ("kv8", "auto"),
                                        ("tq4:compat=colibri", "auto"), ("kv8", "kvq")])
def test_append_fault_at_every_step(tmp_path, rng, monkeypatch, mode, tier):
    """Each write and fsync of an append fails in turn: the committed records stay readable,
    the count is unchanged (or, if only the last fsync failed, already the new one), and the
    retry commits everything."""
    rows = make_rows(rng, 9, mode=mode)
    base = tmp_path / "base"
    write_cache(base, take(rows, 0, 6), mode, batches=(), tier=tier, block_records=4)
    faults = Faults(monkeypatch)
    path = tmp_path / "c"
    k = 1
    while True:
        shutil.copyfile(base, path)
        cf = CacheFile.open(path, SHAPE, mode=mode, tier=tier)
        faults.arm(k)
        try:
            cf.append(rows["tokens"][6:], L=[e[6:] for e in rows["L"]],
                      R=[e[6:] for e in rows["R"]], index=rows["index"][6:])
        except CacheFileSaveError as exc:
            assert exc.errno == errno.ENOSPC and exc.committed == 6
            assert "will retry on the next save" in str(exc)
            assert cf.committed == 6 and cf.pending == 3
            faults.arm(0)
            back = CacheFile.open(path, SHAPE, mode=mode, tier=tier)
            assert len(back) in (6, 9) and records_equal(back.records, cf.records, len(back))
            assert cf.save() == 9
            back = CacheFile.open(path, SHAPE, mode=mode, tier=tier)
            assert back.report.kinds() == ["loaded"] and records_equal(back.records, cf.records)
            k += 1
            continue
        faults.arm(0)
        break
    assert k >= 5  # records write, fsync, count write, fsync (+ retries) were all exercised


def test_rewrite_fault_at_every_step_keeps_old_file(tmp_path, rng, monkeypatch):
    """A v1 upgrade's first save fails at each step: the v1 file stays whole (or the new file
    is whole), never a mix."""
    rows = make_rows(rng, 5, mode="f32")
    v1 = hand_engine_bytes("v1", SHAPE, 0, rows)
    path = tmp_path / "c"
    faults = Faults(monkeypatch)
    for k in range(1, 8):
        path.write_bytes(v1)
        cf = CacheFile.open(path, SHAPE, mode="kv8")
        faults.arm(k)
        try:
            cf.save()
            failed = False
        except CacheFileSaveError:
            failed = True
        faults.arm(0)
        assert not glob.glob(str(path) + ".kvq-tmp*")
        if failed:
            assert read(path) == v1
            cf.save()
        back = CacheFile.open(path, SHAPE, mode="kv8")
        assert back.report.file_tier == "v2" and records_equal(back.records, cf.records)


def test_truncate_fault_rewrites_at_next_save(tmp_path, rng, monkeypatch):
    rows = make_rows(rng, 6, mode="kv8")
    path = tmp_path / "c"
    cf = write_cache(path, rows, "kv8")
    faults = Faults(monkeypatch)
    faults.arm(1)
    with pytest.raises(CacheFileSaveError, match="could not persist the shorter prefix"):
        cf.truncate(2)
    faults.arm(0)
    assert len(cf) == 2 and cf.committed == 0
    assert CacheFile.open(path, SHAPE, mode="kv8").report.loaded == 6  # still the old prefix
    cf.save()
    assert CacheFile.open(path, SHAPE, mode="kv8").report.loaded == 2


# -- inspect ------------------------------------------------------------------------------------
def test_inspect_cli(tmp_path, rng, capsys):
    p2 = tmp_path / "v2.coli_kv"
    write_cache(p2, make_rows(rng, 4, mode="kv8"), "kv8")
    assert cli.main(["inspect", str(p2)]) == 0
    out = capsys.readouterr().out
    assert "tier       v2: v2 (fp8)" in out and "count=4 tag=1" in out
    assert "4 committed, 180 bytes each, 4 complete in the file" in out
    assert "no checksum" in out
    assert cli.main(["inspect", str(p2), "--mode", "f32"]) == 1
    assert "'f32': refused (tier)" in capsys.readouterr().out
    assert cli.main(["inspect", str(p2), "--mode", "kv8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["load"]["result"] == "loads" and info["load"]["records"] == 4
    pk = tmp_path / "c.kvq"
    write_cache(pk, make_rows(rng, 3, mode="tq4"), "tq4")
    assert cli.main(["inspect", str(pk), "--mode", "tq4"]) == 0
    out = capsys.readouterr().out
    assert "rotation seed 0x9e3779b9" in out and "codebook beta-d32-b4" in out
    assert "1 side (norm, f32)" in out
    assert "'tq4': loads, 3 record(s)" in out
    assert cli.main(["inspect", str(pk), "--mode", "tq4:seed=3"]) == 1
    assert "refused (seed)" in capsys.readouterr().out
    p1 = tmp_path / "v1"
    p1.write_bytes(hand_engine_bytes("v1", SHAPE, 0, make_rows(rng, 2, mode="f32")))
    assert cli.main(["inspect", str(p1), "--mode", "kv8"]) == 0
    assert "'kv8': upgrade, 2 record(s)" in capsys.readouterr().out
    junk = tmp_path / "junk"
    junk.write_bytes(b"hello")
    assert cli.main(["inspect", str(junk)]) == 1
    assert "not a cache file" in capsys.readouterr().out


def test_refused_is_the_documented_base(tmp_path):
    assert issubclass(CacheFileMismatch, CacheFileRefused)
    assert issubclass(CacheFileCorrupt, CacheFileRefused)
    assert issubclass(CacheFileRefused, ValueError) and issubclass(CacheFileSaveError, OSError)
