"""The in-forward attention benchmark's logic on a tiny random-weight file: the numpy yardstick
computes attention, the timing wrapper changes nothing, remedies run and restore the decoder's
settings, results are written. Nothing here asserts a speed."""
import json
import os

import numpy as np
import pytest

from kvquant.models import gguf_decoder

from _experiments_env import ensure_importable, subprocess_env

ensure_importable()
from kvquant_experiments.bench import forward_attention  # noqa: E402

TINY = dict(forward_attention.SMOLLM2_SHAPE, n_layers=2, hidden=96, ffn=128, n_heads=3, n_kv=1,
            head_dim=32, vocab=256, context=4096)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fwd") / "tiny.gguf")
    forward_attention.write_shape_gguf(path, TINY)
    return path


def test_the_written_file_has_the_shape_asked(tiny_file):
    cfg = gguf_decoder.GGUFDecoder(tiny_file).config
    assert (cfg.n_layers, cfg.hidden_size, cfg.intermediate_size, cfg.n_heads, cfg.n_kv_heads,
            cfg.head_dim, cfg.vocab_size, cfg.context_length) == (2, 96, 128, 3, 1, 32, 256, 4096)
    shape = dict(forward_attention.SMOLLM2_SHAPE)
    assert (shape["n_layers"], shape["hidden"], shape["n_heads"], shape["n_kv"],
            shape["head_dim"], shape["ffn"]) == (30, 576, 9, 3, 64, 1536)   # SmolLM2-135M


def test_numpy_yardstick_is_softmax_attention_per_kv_head(rng):
    cache = forward_attention.NumpyAttentionCache(n_layers=2, n_kv_heads=2, head_dim=16,
                                                  capacity=50)
    K = rng.standard_normal((40, 2, 16), dtype=np.float32)
    V = rng.standard_normal((40, 2, 16), dtype=np.float32)
    cache.append(1, k=K[:30], v=V[:30])
    cache.append(1, k=K[30:], v=V[30:])
    assert cache.length(1) == 40 and cache.length(0) == 0
    q = rng.standard_normal((6, 16), dtype=np.float32)
    got = cache.attend(1, q, scale=0.25)
    for head in range(6):
        kv = head // 3
        s = (K[:, kv].astype(np.float64) @ q[head]) * 0.25
        w = np.exp(s - s.max())
        np.testing.assert_allclose(got[head], (w / w.sum()) @ V[:, kv], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="holds 50 tokens"):
        cache.append(1, k=K[:11], v=V[:11])


def test_timing_wrapper_passes_results_through(rng):
    from kvquant.cache import QuantizedKVCache
    raw = QuantizedKVCache(1, {"k": ("kv8", 32), "v": ("kv8", 32)}, n_kv_heads=1)
    timed = forward_attention.TimedAttention(raw, blas_threads=1)
    X = rng.standard_normal((20, 1, 32), dtype=np.float32)
    timed.append(0, k=X, v=X)
    q = rng.standard_normal((2, 32), dtype=np.float32)
    assert np.array_equal(timed.attend(0, q, scale=0.5), raw.attend(0, q, scale=0.5))
    assert timed.attend_s > 0 and timed.append_s > 0 and len(timed) == 20
    assert timed.stream(0, "k") is raw.stream(0, "k")


def test_a_remedy_times_every_method_and_restores_the_decoder(tiny_file):
    settings = ("CACHE_THREADS", "DECODE_ATTENTION_THREADS", "DECODE_BLAS_THREADS",
                "DECODE_PROJECTIONS")
    before = [getattr(gguf_decoder, key) for key in settings]
    res = forward_attention.run_remedy(tiny_file, "cache2+blas1-attend", codecs=("kv8", "tq4"),
                                   tokens=200, steps=1, warmup=1, rounds=1)
    assert [getattr(gguf_decoder, key) for key in settings] == before
    assert set(res["methods"]) == {"numpy", "kv8", "tq4"}
    assert res["methods"]["numpy"]["attention_speedup"] == 1.0
    for m in res["methods"].values():
        assert 0 < m["attention_ms"] < m["step_ms"]
    assert res["shape"]["n_heads"] == 3 and res["cache_threads"] == 2


def test_a_remedy_refuses_to_run_without_its_environment(tiny_file, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(RuntimeError, match="OMP_WAIT_POLICY=passive"):
        forward_attention.run_remedy(tiny_file, "cache2+omp-passive", tokens=10, steps=1)


def test_remedies_run_in_processes_of_their_own_and_are_written(tiny_file, tmp_path,
                                                                 monkeypatch):
    for key, value in subprocess_env().items():
        monkeypatch.setenv(key, value)
    results = forward_attention.run_remedies(tiny_file, ["cache1", "cache2+omp-passive"],
                                         codecs=("kv8",), tokens=100, steps=1, warmup=0,
                                         rounds=1)
    assert [r["remedy"] for r in results] == ["cache1", "cache2+omp-passive"]
    assert results[1]["environment"] == {"OMP_WAIT_POLICY": "passive"}
    paths = forward_attention.write_results(results, str(tmp_path), "fwd")
    assert [os.path.basename(p) for p in paths] == ["fwd.md", "fwd.csv", "fwd.json"]
    md = open(paths[0]).read()
    assert "| cache2+omp-passive |" in md and "kv8 speedup" in md
    assert len(json.load(open(paths[2]))["results"]) == 2
