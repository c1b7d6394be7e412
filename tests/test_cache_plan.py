"""Cache plans (stream specs per layer and KV head, a JSON file) through the cache, the GGUF
models, the frontier and ``kvquant flips``; the sensitivity scan and the bit allocator on them."""
import itertools
import json
import os
import sys

import numpy as np
import pytest

from _experiments_env import ensure_importable

ensure_importable()

from kvquant import get_codec  # noqa: E402
from kvquant.cache import QuantizedKVCache  # noqa: E402
from kvquant.models.plan import CachePlan  # noqa: E402
from kvquant.specs import parse_cache_spec  # noqa: E402
from kvquant.streams.calibration import StreamStatistics  # noqa: E402
from kvquant_experiments import allocate, sensitivity, texts  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """2 layers, 2 KV heads of width 32 (tests/test_llama_gguf.py's file)."""
    pytest.importorskip("gguf")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_llama_gguf import write_tiny_llama
    from kvquant.models.gguf_decoder import GGUFDecoder
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama(path)
    return GGUFDecoder(str(path))


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "prose.txt"
    path.write_text(texts.pydoc_text()[:600], encoding="utf-8")
    return str(path)


def ids(model, n=40):
    return np.arange(3, 3 + n) % model.vocab_size


# -- the file ------------------------------------------------------------------------------------
def test_a_plan_round_trips_through_its_file(tmp_path):
    plan = CachePlan.uniform("polar4@center,sinks=1/polar3", 3, 2)
    plan = plan.with_unit(1, "k", "polar5@center,sinks=1").with_unit(2, "v", "tq2", head=1)
    path = str(tmp_path / "p.json")
    plan.save(path)
    back = CachePlan.load(path)
    assert back == plan == parse_cache_spec(path) and back.source == path
    obj = json.load(open(path))
    assert obj["layers"][1] == {"k": "polar5@center,sinks=1", "v": "polar3"}
    assert obj["layers"][2]["v"] == ["polar3", "tq2"]
    assert back.head_specs(2, "v") == ["polar3", "tq2"] and back.head_specs(0, "k") == [
        "polar4@center,sinks=1"] * 2


@pytest.mark.parametrize("obj, match", [
    ({"kind": "other"}, "not a cache plan"),
    ({"kind": "kvquant-cache-plan", "version": 9, "layers": []}, "version 9"),
    ({"kind": "kvquant-cache-plan", "version": 1, "layers": [{"k": "tq4"}]}, "layer 0"),
    ({"kind": "kvquant-cache-plan", "version": 1, "layers": [{"k": "tq4", "v": "tq4@bogus"}]},
     "layer 0 v"),
    ({"kind": "kvquant-cache-plan", "version": 1, "n_kv_heads": 2,
      "layers": [{"k": ["tq4"], "v": "tq4"}]}, "1 specs per head for 2"),
    ({"kind": "kvquant-cache-plan", "version": 1, "pair": "tq4"}, "needs \"n_layers\""),
    # an 80-byte file claiming 2e8 layers: refused before any list of them is built
    ({"kind": "kvquant-cache-plan", "version": 1, "pair": "tq4", "n_layers": 200000000},
     "n_layers.* is 200000000"),
    ({"kind": "kvquant-cache-plan", "version": 1, "pair": "tq4", "n_layers": 1.5}, "is 1.5"),
    ({"kind": "kvquant-cache-plan", "version": 1, "pair": "tq4", "n_layers": True}, "is True"),
])
def test_bad_plans_are_refused_naming_the_problem(tmp_path, obj, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=match):
        CachePlan.load(str(path))


def test_a_plan_is_checked_against_the_model(tiny_llama, tmp_path):
    path = str(tmp_path / "p.json")
    CachePlan.uniform("tq4", 3).save(path)
    with pytest.raises(ValueError, match="3 layers, the model has 2"):
        tiny_llama.new_cache(path)
    CachePlan.uniform("tq4@center=calib", 2).save(path)
    with pytest.raises(ValueError, match="names no \"calibration\""):
        tiny_llama.new_cache(path)


def test_plan_bits_are_the_mean_over_rows():
    plan = CachePlan.uniform("polar4/polar3", 2, 2).with_unit(0, "k", "tq2", head=0)
    d = 64
    rows = ([get_codec("tq2", d)] + [get_codec("polar4", d)] * 3 + [get_codec("polar3", d)] * 4)
    assert plan.bits_per_value(d) == pytest.approx(
        np.mean([8 * c.bytes_per_row / d for c in rows]))


# -- the cache and the models --------------------------------------------------------------------
def test_a_uniform_plan_gives_the_pair_specs_logits(tiny_llama, tmp_path):
    pair = "polar4@center,normalize,sinks=1/tq3@center"
    path = str(tmp_path / "u.json")
    CachePlan.uniform(pair, tiny_llama.n_layers).save(path)
    x = ids(tiny_llama)
    np.testing.assert_array_equal(tiny_llama.forward(x, tiny_llama.new_cache(path)),
                                  tiny_llama.forward(x, tiny_llama.new_cache(pair)))


def test_each_layer_and_kv_head_gets_its_planned_codec(tiny_llama):
    plan = CachePlan.uniform("f32", 2, 2).with_unit(1, "k", "tq3", head=1).with_unit(
        1, "v", "polar4")
    cache = tiny_llama.new_cache(plan)
    specs = {(layer, name, h): cache.stream(layer, name, h).codec.spec
             for layer in range(2) for name in "kv" for h in range(2)}
    assert specs[(1, "k", 1)] == "tq3" and specs[(1, "k", 0)] == "f32"
    assert specs[(1, "v", 0)] == specs[(1, "v", 1)] == "polar4" and specs[(0, "v", 0)] == "f32"
    d = tiny_llama.head_dim
    assert cache.bytes_per_token == sum(get_codec(s, d).bytes_per_row for s in specs.values())
    x = ids(tiny_llama)
    tiny_llama.forward(x, cache)
    # layer 0 is f32: layer 1's planned head holds the f32 cache's rows, encoded and decoded
    ref = tiny_llama.new_cache("f32")
    tiny_llama.forward(x, ref)
    codec = get_codec("tq3", d)
    np.testing.assert_allclose(cache.stream(1, "k", 1).decode(),
                               codec.decode(codec.encode(ref.stream(1, "k", 1).decode())),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.stream(1, "k", 0).decode(),
                                  ref.stream(1, "k", 0).decode())


def test_a_plan_with_a_calibration_hands_each_head_its_statistics(tiny_llama, tmp_path):
    L, H, d = tiny_llama.n_layers, tiny_llama.n_kv_heads, tiny_llama.head_dim
    rng = np.random.default_rng(0)
    stats = StreamStatistics({"k": rng.standard_normal((L, H, d))},
                             {"k": rng.uniform(0.5, 2, (L, H, d))})
    stats.save(str(tmp_path / "calib.npz"))
    path = str(tmp_path / "c.json")
    CachePlan.uniform("tq4@center=calib,normalize=calib/tq4", L, H,
                      str(tmp_path / "calib.npz")).save(path)
    assert json.load(open(path))["calibration"] == "calib.npz"   # relative to the plan
    cache = tiny_llama.new_cache(path)
    for layer in range(L):
        for h in range(H):
            np.testing.assert_array_equal(cache.stream(layer, "k", h).offset,
                                          stats.offsets["k"][layer, h])
    StreamStatistics({"k": np.zeros((L, H + 1, d))}, {}).save(str(tmp_path / "calib.npz"))
    with pytest.raises(ValueError, match="made for another model"):
        tiny_llama.new_cache(path)


def test_per_head_specs_must_cover_every_head():
    with pytest.raises(ValueError, match="1 specs for the 2 KV heads"):
        QuantizedKVCache(1, {"k": ([("tq4",)], 32), "v": ("tq4", 32)}, n_kv_heads=2)


# -- the frontier and kvquant flips --------------------------------------------------------------
def test_the_frontier_measures_a_plan_as_a_config(tiny_llama, prose, tmp_path):
    from kvquant_experiments import frontier
    from kvquant_experiments import frontier_picks
    path = str(tmp_path / "mixed.json")
    CachePlan.uniform("tq4", 2, 2).with_unit(1, "v", "tq2").save(path)
    result = frontier.run_frontier(["tq4", path], positions=64, chunk_tokens=32, prompts=1,
                                   model=tiny_llama.path, loaded=tiny_llama, text=prose)
    rows = {r["codec"]: r for r in frontier.frontier_rows(result)}
    # d = 32: tq4 is 4 + 32/32 = 5 bits, tq2 is 3: one of four layer streams at 3
    assert rows[path]["bits_per_value"] == pytest.approx((3 * 5 + 3) / 4)
    assert rows[path]["family"] == "cache plan" and rows[path]["k"] == path
    assert rows[path]["kld_mean"] > rows["tq4"]["kld_mean"]
    choices = frontier_picks.choose(result, budgets=(4.6,))
    assert choices["4.6"]["pair"] == path


def test_flips_takes_plan_files_and_refuses_a_bad_one(tmp_path, capsys):
    from kvquant import cli
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli.main(["flips", "--model", "tiny-mla", "--plan", str(bad), "--no-write"]) != 0
    err = capsys.readouterr().err.strip()
    assert "bad.json: not a cache plan" in err and len(err.splitlines()) == 1


# -- sensitivity and allocation ------------------------------------------------------------------
def test_shift_bits_keeps_the_options():
    assert sensitivity.shift_bits("polar4:side_dtype=f16@center,sinks=1", -1) == \
        "polar3:side_dtype=f16@center,sinks=1"
    assert sensitivity.shift_bits("tq8", 1) is None and sensitivity.shift_bits("polar2", -1) \
        is None
    with pytest.raises(ValueError, match="bit width"):
        sensitivity.shift_bits("kv8", -1)


def test_a_scan_row_is_the_unit_plans_own_kld(tiny_llama, prose):
    from kvquant import flips
    base = "polar4/polar3"
    result = sensitivity.run_sensitivity(tiny_llama.path, base, prose, positions=32,
                                         chunk_tokens=32, step=-1, model=tiny_llama)
    rows = {(r["layer"], r["stream"]): r for r in result["rows"]}
    assert sorted(rows) == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]
    assert all(r["bits_delta"] == pytest.approx(-1 / 4) for r in rows.values())
    # recompute one unit through the flips module's own chunk statistics
    tokens, _ = texts.text_tokens(tiny_llama, prose)
    (_, chunk), = flips.text_chunks(tokens, 32, 32, bos=tiny_llama.bos_token_id)
    plan = CachePlan.uniform(base, 2, 2).with_unit(1, "v", "polar2")
    st = flips.chunk_stats(tiny_llama, [plan, "polar4/polar3"], chunk)["specs"]
    assert rows[(1, "v")]["kld_mean"] == pytest.approx(st[plan]["kld"].mean(), rel=1e-9)
    assert rows[(1, "v")]["delta_kld"] == pytest.approx(
        st[plan]["kld"].mean() - st["polar4/polar3"]["kld"].mean(), rel=1e-6, abs=1e-12)


def _scan(deltas, base="polar4/polar3"):
    """A sensitivity result of step -1 with the given delta KLD per (layer, stream)."""
    rows = []
    for (layer, stream), delta in deltas.items():
        spec = {"k": "polar3", "v": "polar2"}[stream]
        rows.append({"layer": layer, "stream": stream, "head": None, "spec": spec,
                     "delta_kld": delta})
    meta = {"base": base, "step": -1, "heads": False, "base_kld_mean": 0.1,
            "model_name": "m", "model": {"head_dim": 64, "n_layers": 2, "n_kv_heads": 1},
            "text": {"name": "t", "chunk_tokens": 64}}
    return {"meta": meta, "rows": rows}


def test_the_greedy_allocation_is_the_models_optimum():
    deltas = {(0, "k"): 0.04, (0, "v"): 0.002, (1, "k"): 0.01, (1, "v"): 0.02}
    curves = allocate.unit_curves([_scan(deltas)], span=1)
    # the KLD model: a unit's change at width b is delta/3 * (4**(b0 - b) - 1)
    assert curves[(0, "k", None)] == pytest.approx({3: 0.04, 4: 0.0, 5: -0.01})
    base = CachePlan.uniform("polar4/polar3", 2, 1)
    units = sorted(curves)
    for budget in (3.0, 3.5, 4.0):
        plan, predicted, bits = allocate.allocate(base, curves, budget, 64, None)
        assert bits <= budget + 1e-9
        best = min((sum(curves[u][w] for u, w in zip(units, ws)), ws)
                   for ws in itertools.product(*(sorted(curves[u]) for u in units))
                   if np.mean([w for w in ws]) <= budget + 1e-9)
        assert predicted == pytest.approx(best[0])
    # the most sensitive unit gets the most bits
    plan, _, _ = allocate.allocate(base, curves, 3.5, 64, None)
    assert plan.head_specs(0, "k") == ["polar5"] and plan.head_specs(0, "v") == ["polar2"]


def test_allocation_plans_are_written_and_load(tmp_path):
    scan = tmp_path / "sensitivity-m-t-N64-c64-layers-step-1-abcd.json"
    scan.write_text(json.dumps(_scan({(0, "k"): 0.04, (0, "v"): 0.002, (1, "k"): 0.01,
                                      (1, "v"): 0.02})))
    (path,) = allocate.write_plans([str(scan)], [3.5], str(tmp_path / "plans"))
    plan = CachePlan.load(path)
    assert plan.meta["allocation"]["budget_bits_per_value"] == 3.5
    assert plan.bits_per_value(64, 64) <= 3.5
    with pytest.raises(ValueError, match="over the budget"):
        allocate.write_plans([str(scan)], [1.0], str(tmp_path / "plans"))


@pytest.mark.parametrize("content, words", [
    ("{not json", "is not valid JSON"),
    ("[1]", "is not a sensitivity result (a JSON object"),
    # each was a KeyError or TypeError traceback
    ('{"meta": {}, "rows": []}', "is not a sensitivity result of this version: meta.base is "
                                 "missing"),
    (json.dumps({**_scan({}), "meta": {**_scan({})["meta"], "text": "t"}}),
     "meta.text is 't', not an object"),
    (json.dumps({**_scan({}), "rows": [{"layer": 0, "stream": "k", "head": None,
                                        "spec": "polar3", "delta_kld": "0.1"}]}),
     "rows[0].delta_kld is '0.1', not a number"),
])
def test_allocate_names_a_bad_scan_file(tmp_path, capsys, content, words):
    scan = tmp_path / "scan.json"
    scan.write_text(content)
    argv = ["--scan", str(scan), "--budget", "3.5", "--out", str(tmp_path / "plans")]
    assert allocate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"allocate: {scan}") and err.count("\n") == 1 and words in err, err


def test_a_coarse_scan_moves_a_group_of_layers_together():
    assert sensitivity.units_of(5, 2, group=2) == [
        (0, "k", None), (0, "v", None), (2, "k", None), (2, "v", None), (4, "k", None),
        (4, "v", None)]
    assert list(sensitivity.unit_layers((4, "k", None), 2, 5)) == [4]
    scan = _scan({(0, "k"): 0.04, (0, "v"): 0.001})
    scan["meta"].update(group=2)
    curves = allocate.unit_curves([scan], span=1)
    base = CachePlan.uniform("polar4/polar3", 2, 1)
    plan, _, bits = allocate.allocate(base, curves, 3.5, 64, None, group=2)
    # K of both layers up a bit (4 -> 5), V of both down (3 -> 2): 3.5 bits on the mean
    assert [plan.head_specs(i, "k") for i in range(2)] == [["polar5"], ["polar5"]]
    assert [plan.head_specs(i, "v") for i in range(2)] == [["polar2"], ["polar2"]]
    assert bits == pytest.approx(3.5)


def test_calibration_statistics_are_the_f32_rows_moments(tiny_llama, prose, tmp_path):
    from kvquant import flips
    from kvquant_experiments import calibrate
    assert calibrate.calibrated("tq4@center,normalize,sinks=1/tq3@center") == \
        "tq4@center=calib,normalize=calib,sinks=1/tq3@center=calib"
    stats = calibrate.measure_statistics(tiny_llama, prose, positions=64, chunk_tokens=32)
    tokens, _ = texts.text_tokens(tiny_llama, prose)
    rows = []
    for _, chunk in flips.text_chunks(tokens, 64, 32, bos=tiny_llama.bos_token_id):
        cache = tiny_llama.new_cache("f32")
        tiny_llama.forward(np.asarray(chunk)[:-1], cache)
        rows.append(cache.stream(1, "v", 0).decode())
    X = np.concatenate(rows).astype(np.float64)
    np.testing.assert_allclose(stats.vectors(1, "v")[0][0], X.mean(axis=0), rtol=1e-5,
                               atol=1e-6)
    sigma = X.std(axis=0)
    np.testing.assert_allclose(stats.vectors(1, "v")[1][0],
                               np.sqrt(np.maximum(sigma / np.sqrt((sigma ** 2).mean()), 1e-3)),
                               rtol=1e-5)
    path = str(tmp_path / "calib.npz")
    stats.save(path)
    result = calibrate.compare_calibration(tiny_llama, path, prose, positions=32,
                                           chunk_tokens=32, pairs=["tq3@center,normalize/tq3"])
    cells = {(r["mode"], r["statistics"]): r for r in result["rows"]}
    assert set(cells) == {(m, s) for m in calibrate.MODES for s in ("first-append",
                                                                     "calibrated")}
    # a pair whose V has no stream options is left as it is
    assert cells[("prefill", "calibrated")]["spec"] == "tq3@center=calib,normalize=calib/tq3"
    assert all(r["kld_mean"] > 0 for r in result["rows"])
    assert "| decode-only |" in calibrate.format_markdown(result)


def test_calibrate_pairs_are_pair_specs_made_at_the_door(tmp_path, capsys):
    from kvquant.specs import PairSpec
    from kvquant_experiments import calibrate
    pairs = calibrate.pair_specs("polar4:side_dtype=f16@center,normalize,sinks=1/polar3; tq4")
    assert all(isinstance(p, PairSpec) for p in pairs)
    assert [p.text for p in pairs] == ["polar4:side_dtype=f16@center,normalize,sinks=1/polar3",
                                       "tq4"]
    for bad, words in (("tq4;nope", "unknown codec spec 'nope'"),
                       ("tq4;ggml:q8_0", "is a ggml spec"), (" ; ", "no pair spec"),
                       ("tq4@bogus", "unknown stream option 'bogus'")):
        assert calibrate.main(["compare", "--calibration", "c.npz", "--out",
                               str(tmp_path / "out"), "--pairs", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "argument --pairs: " in err and words in err
    assert not any(tmp_path.iterdir())      # refused before anything was made


def test_a_head_scan_moves_one_kv_head(tiny_llama, prose):
    result = sensitivity.run_sensitivity(tiny_llama.path, "tq3", prose, positions=32,
                                         chunk_tokens=32, step=1, heads=True, model=tiny_llama)
    assert [(r["layer"], r["stream"], r["head"]) for r in result["rows"]] == \
        sensitivity.units_of(2, 2, heads=True)
    # d = 32: tq3 is 3 + 1 bits per value, tq4 one more, on one of 8 rows
    assert all(r["bits_delta"] == pytest.approx(1 / 8) and r["spec"] == "tq4"
               for r in result["rows"])
    curves = allocate.unit_curves([result], span=1)
    assert set(curves[(0, "k", 1)]) == {2, 3, 4}


def test_a_calibration_that_is_not_a_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "stats.npz"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="no such regular file"):
        StreamStatistics.load(str(fifo))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kind": "kvquant-cache-plan", "version": 1, "pair": "tq4",
                                "n_layers": 2, "calibration": "stats.npz"}))
    with pytest.raises(ValueError, match="no such regular file"):
        CachePlan.load(str(plan)).statistics()
