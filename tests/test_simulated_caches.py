"""Simulated caches (KIVI, transformers' QuantizedCache default, pre-RoPE keys): their grids, which
rows each query reads dequantized, the bits they cost, and their runs through the models."""
import os
import sys

import numpy as np
import pytest

from _experiments_env import ensure_importable

ensure_importable()

from kvquant import get_codec  # noqa: E402
from kvquant_experiments import frontier  # noqa: E402
from kvquant_experiments.simulated_caches import (  # noqa: E402
    Side, SimulatedCache, bits_per_value, expand, parse)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_llama_gguf import write_tiny_llama
    from kvquant.models.gguf_decoder import GGUFDecoder
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama(path)
    return GGUFDecoder(str(path))


# -- grids -----------------------------------------------------------------------------------------

def test_per_token_grid_is_kivis_min_max_grid(rng):
    X = rng.standard_normal((50, 3, 64)).astype(np.float32)
    Y = Side("tok4-g32", 64, False).roundtrip(X)
    G, H = X.reshape(50, 3, 2, 32).astype(np.float64), Y.reshape(50, 3, 2, 32).astype(np.float64)
    lo, hi = G.min(axis=3), G.max(axis=3)
    step = (hi - lo) / 15
    # at most 16 levels per group, each within half a step (plus the fp16 rounding of the grid)
    assert max(len(np.unique(h)) for h in H.reshape(-1, 32)) <= 16
    slack = 0.5 * step[..., None] * (1 + 2e-3) + 2e-3 * np.abs(lo)[..., None] + 1e-6
    assert np.all(np.abs(H - G) <= slack)
    # the group's extremes map onto the grid's ends
    np.testing.assert_allclose(H.min(axis=3), lo, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(H.max(axis=3), hi, rtol=2e-3, atol=2e-3)


def test_per_channel_grid_runs_along_tokens(rng):
    X = rng.standard_normal((64, 2, 32)).astype(np.float32)
    X[:, :, 5] += 40.0                                          # an outlier channel
    Y = Side("chan2-g32", 32, True).roundtrip(X)
    for t0 in (0, 32):
        block = Y[t0:t0 + 32]
        for h in range(2):
            for c in range(32):
                assert len(np.unique(block[:, h, c])) <= 4      # 2 bits along each channel
    # per-channel grids do not let the outlier channel spoil the others (a per-token grid does)
    err_chan = np.abs(Y - X)[..., :5].mean()
    err_tok = np.abs(Side("tok2-g32", 32, False).roundtrip(X) - X)[..., :5].mean()
    assert err_chan < 0.3 * err_tok


def test_codec_sides_are_the_codec(rng):
    X = rng.standard_normal((10, 3, 64)).astype(np.float32)
    codec = get_codec("q4_1+rot", 64)
    np.testing.assert_array_equal(Side("q4_1+rot", 64, True).roundtrip(X),
                                  codec.roundtrip(X.reshape(-1, 64)).reshape(X.shape))


# -- which rows a query reads dequantized ----------------------------------------------------------

def test_residual_rules():
    kivi_k, kivi_v = parse("sim:kivi4", 64)
    assert (kivi_k.text, kivi_v.text) == ("chan4-g32@res=128", "tok4-g32@res=128")
    # KIVI's keys: the newest n mod 128 rows stay float32; its values: the newest 128
    assert [kivi_k.quantized_rows(n) for n in (1, 127, 128, 200, 256, 300)] == \
        [0, 0, 128, 128, 256, 256]
    assert [kivi_v.quantized_rows(n) for n in (1, 128, 129, 300)] == [0, 0, 1, 172]
    # no residual: a per-channel side still holds its partial group in float32
    assert [Side("chan4-g32", 64, True).quantized_rows(n) for n in (31, 32, 70)] == [0, 32, 64]
    assert [Side("tok4-g32", 64, False).quantized_rows(n) for n in (1, 70)] == [1, 70]
    # what a token's query reads: the cache before the token, plus its own rows in float32
    # (KIVI attends, then flushes); without a residual rows are quantized before any read
    assert [kivi_k.read_quantized_rows(n) for n in (128, 129, 256, 257)] == [0, 128, 128, 256]
    assert [kivi_v.read_quantized_rows(n) for n in (129, 130, 300)] == [0, 1, 171]
    assert Side("tok4-g32", 64, False).read_quantized_rows(70) == 70
    assert Side("chan4-g32", 64, True).read_quantized_rows(64) == 64
    hf_k, hf_v = parse("sim:hf-quanto4", 64)
    assert hf_k.text == hf_v.text == "tok4-g64@flush=128"
    assert [hf_k.quantized_rows(n) for n in (127, 128, 255, 256)] == [0, 128, 128, 256]


def _reference_attention(sim, layer, Q, K, V, Kq, Vq):
    """Each query p reads rows j < read_quantized_rows(p + 1) dequantized: a loop over
    positions."""
    T, S = K.shape[0], Q.shape[0]
    group = Q.shape[1] // K.shape[1]
    out = np.empty(Q.shape)
    for s in range(S):
        p = T - S + s
        nk, nv = sim.k_side.read_quantized_rows(p + 1), sim.v_side.read_quantized_rows(p + 1)
        Kr = np.concatenate([Kq[:nk], K[nk:p + 1]]).astype(np.float64)
        Vr = np.concatenate([Vq[:nv], V[nv:p + 1]]).astype(np.float64)
        for h in range(Q.shape[1]):
            g = h // group
            sc = Kr[:, g] @ Q[s, h] / np.sqrt(Q.shape[2])
            w = np.exp(sc - sc.max())
            out[s, h] = (w / w.sum()) @ Vr[:, g]
    return out


@pytest.mark.parametrize("spec", ["sim:chan4-g4@res=8/tok4-g8@res=4", "sim:kivi2-g4-r8",
                                  "sim:tok4-g8@flush=8/q4_0+rot@res=5", "sim:chan3-g4/tq4"])
def test_prefill_and_decode_read_what_kivi_holds(rng, spec):
    T, H, Hq, d = 37, 2, 4, 32
    K = rng.standard_normal((T, H, d)).astype(np.float32)
    V = rng.standard_normal((T, H, d)).astype(np.float32)
    Q = rng.standard_normal((T, Hq, d)).astype(np.float32)
    prefill = SimulatedCache(spec, 1, H, d)
    prefill.append(0, k=K[:20], v=V[:20])
    first = prefill.attend_prefill(0, Q[:20])
    prefill.append(0, k=K[20:], v=V[20:])
    second = prefill.attend_prefill(0, Q[20:])
    decode = SimulatedCache(spec, 1, H, d)
    steps = []
    for t in range(T):
        decode.append(0, k=K[t:t + 1], v=V[t:t + 1])
        steps.append(decode.attend(0, Q[t]))
    steps = np.stack(steps)
    np.testing.assert_allclose(np.concatenate([first, second]), steps, rtol=1e-5, atol=1e-6)
    k_side, v_side = parse(spec, d)
    n_full = (T // k_side.group) * k_side.group if k_side.kind == "chan" else T
    Kq = np.concatenate([k_side.roundtrip(K[:n_full]), np.zeros((T - n_full, H, d), np.float32)])
    Vq = v_side.roundtrip(V)
    ref = _reference_attention(prefill, 0, Q, K, V, Kq, Vq)
    np.testing.assert_allclose(steps, ref, rtol=1e-4, atol=1e-5)


# -- bits ------------------------------------------------------------------------------------------

def test_bits_per_value_count_scales_zeros_and_residuals():
    # KIVI-4 at 512 tokens: keys 4 + 32/32 bits (512 mod 128 = 0 rows in float32); values
    # 5 bits on 384 rows and 32 on the newest 128
    assert bits_per_value("sim:kivi4", 64, 512) == pytest.approx((5 + (384 * 5 + 128 * 32) / 512) / 2)
    assert bits_per_value("sim:kivi4", 64) == 5.0
    assert bits_per_value("sim:kivi2-g64-r128", 64, 640) == pytest.approx(
        (2.5 + (512 * 2.5 + 128 * 32) / 640) / 2)
    assert bits_per_value("sim:hf-quanto4", 64, 512) == 4.5
    # a partial group is held in float32: 100 tokens = 96 quantized + 4 float32 keys
    assert bits_per_value("sim:chan4-g32/q8_0", 64, 100) == pytest.approx(
        ((96 * 5 + 4 * 32) / 100 + 8.5) / 2)
    cache = SimulatedCache("sim:kivi4", 3, 2, 64)
    assert cache.bytes_per_token == 3 * 2 * (5 + 5) * 64 / 8
    # at 512 tokens only the values' 128-row window is float32 (27 bits a value more)
    from kvquant_experiments.simulated_caches import fixed_bytes
    assert fixed_bytes("sim:kivi4", 3, 2, 64, 512) == 3 * 2 * 128 * 27 * 64 / 8
    assert fixed_bytes("sim:kivi4", 3, 2, 64, 600) == 3 * 2 * (88 + 128) * 27 * 64 / 8


def test_bad_specs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiple of the group"):
        parse("sim:chan4-g32@res=100/tok4-g32", 64)
    with pytest.raises(ValueError, match="keys only"):
        parse("sim:tok4-g32/tok4-g32@prerope", 64)
    with pytest.raises(ValueError, match="do not divide"):
        parse("sim:tok4-g48/tok4-g32", 64)
    with pytest.raises(ValueError, match="unknown option"):
        parse("sim:tok4-g32@window=3/tok4-g32", 64)
    with pytest.raises(ValueError, match="sim:<K side>/<V side>"):
        parse("sim:tok4-g32", 64)
    with pytest.raises(ValueError, match="unknown codec spec"):
        parse("sim:q3_9/tok4-g32", 64)
    assert expand("sim:kivi2-g64") == "sim:chan2-g64@res=128/tok2-g64@res=128"


# -- through the model -----------------------------------------------------------------------------

def test_a_float32_simulation_is_the_float32_cache(tiny_llama):
    model = tiny_llama   # sim: specs are a plug-in kind (entry point kvquant.cache_specs)
    ids = (np.arange(1, 50) * 7) % 50 + 3
    ref = model.forward(ids, model.new_cache("f32"))
    for spec in ("sim:f32/f32", "sim:f32@prerope/f32"):
        out = model.forward(ids, model.new_cache(spec))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())
    # a codec side reads what the library's cache of that codec reads, to rounding
    lib = model.forward(ids, model.new_cache("q8_0/q4_1"))
    sim = model.forward(ids, model.new_cache("sim:q8_0/q4_1"))
    np.testing.assert_allclose(sim, lib, rtol=1e-4, atol=1e-4 * np.abs(lib).max())


def test_pre_rope_keys_are_quantized_unrotated_and_rotated_after(tiny_llama):
    model = tiny_llama   # sim: specs are a plug-in kind (entry point kvquant.cache_specs)
    ids = (np.arange(1, 41) * 5) % 50 + 3
    cache = model.new_cache("sim:chan4-g8@prerope/f32")
    assert cache.keys_before_rope
    model.forward(ids[:30], cache)
    model.forward(ids[30:], cache)                              # a second append
    from kvquant.models.gguf_decoder import rope_adjacent, rope_halves
    rope = rope_adjacent if tiny_llama.config.rope_pairs == "adjacent" else rope_halves
    base = tiny_llama.config.rope_bases[0]
    pos = np.arange(40)
    # the model gave the cache the keys before RoPE: rotating them gives the keys it stores
    np.testing.assert_allclose(rope(cache._k_src[0], pos, base, tiny_llama.rope_factors),
                               cache._k[0], rtol=1e-5, atol=1e-5)
    # the dequantized keys are the rotation of the per-channel grid of the unrotated keys
    side = Side("chan4-g8", tiny_llama.head_dim, True)
    np.testing.assert_allclose(cache._kq[0], rope(side.roundtrip(cache._k_src[0]), pos, base,
                                                  tiny_llama.rope_factors), rtol=1e-5, atol=1e-5)
    plain = model.new_cache("sim:chan4-g8/f32")
    model.forward(ids, plain)
    assert not np.allclose(plain._kq[0], cache._kq[0], atol=1e-3)


def test_the_frontier_and_flips_run_simulations(tiny_llama, tmp_path):
    from kvquant_experiments import texts
    text = tmp_path / "notes.txt"
    text.write_text(texts.pydoc_text()[:400], encoding="utf-8")
    specs = ["q4_1", "sim:kivi4-g8-r16", "sim:tok4-g32@flush=16/tok4-g32@flush=16"]
    result = frontier.run_frontier(specs, positions=64, chunk_tokens=32, prompts=1,
                                   model=tiny_llama.path, loaded=tiny_llama, text=str(text))
    rows = {r["codec"]: r for r in result["rows"]}
    assert rows["q4_1"]["bits_per_value"] == 5.0
    # 32 tokens, head_dim 32: keys all quantized (32 mod 16 = 0), 4 + 32/8 bits; values
    # 16 quantized at 8 bits, the newest 16 in float32
    assert rows["sim:kivi4-g8-r16"]["bits_per_value"] == pytest.approx(
        (8 + (16 * 8 + 16 * 32) / 32) / 2)
    for spec in specs[1:]:
        assert rows[spec]["kld_mean"] > 0 and np.isfinite(rows[spec]["kld_mean"])
    assert frontier.pair_family("sim:kivi4") == "simulation"
    # a plug-in kind parses in spawned workers too (its entry point): the same numbers
    from kvquant_experiments.flip_runs import run_flips
    args = dict(codecs=["sim:kivi4-g8-r16"], positions=64, chunk_tokens=32, n_prompts=1,
                text=str(text))
    here = run_flips(tiny_llama.path, workers=1, model=tiny_llama, **args)["rows"]
    spawned = run_flips(tiny_llama.path, workers=2, **args)["rows"]
    assert [r["kld_mean"] for r in spawned] == [r["kld_mean"] for r in here]
    assert here[1]["kld_mean"] > 0
