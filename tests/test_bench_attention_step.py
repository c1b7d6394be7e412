"""The attention bench's logic (``kvquant bench``, kvquant_experiments.bench.attention_step): byte
accounting, byte limits, flags, the step it times, its files. Nothing here asserts a speed."""
import contextlib
import csv
import json

import numpy as np
import pytest

from kvquant import get_codec
from kvquant.reference import softmax

from _experiments_env import ensure_importable

ensure_importable()
from kvquant_experiments.bench import attention_step as bench  # noqa: E402

SMALL_BUFFER = np.ones(1 << 18, np.float32)   # 1 MiB: the bandwidth probe, fast in tests


def test_step_bytes_are_what_the_codec_stores_read_twice(rng):
    X = rng.standard_normal((300, 64), dtype=np.float32)
    for spec in ("f32", "kv8", "tq4", "q4_0+rot", "polar4:alloc=level"):
        codec = get_codec(spec, 64)
        enc = codec.encode(X)
        stored = enc.codes.nbytes + enc.side.nbytes          # bytes actually held for 300 rows
        assert bench.step_bytes(codec.bytes_per_row, 300) == 2 * stored, spec


def test_byte_limit_speedups_at_512_and_64():
    # f32 bytes over codec bytes: fp8 + a float32 scale per row, 4-bit codes + a float32 norm
    for d, kv8, tq4 in ((512, 2048 / 516, 2048 / 260), (64, 256 / 68, 256 / 36)):
        for spec, expected in (("kv8", kv8), ("tq4", tq4)):
            codec = get_codec(spec, d)
            assert bench.step_bytes(4 * d, 1000) / bench.step_bytes(codec.bytes_per_row, 1000) \
                == pytest.approx(expected)
    assert 2048 / 516 == pytest.approx(3.97, abs=0.005) and 2048 / 260 == pytest.approx(7.88,
                                                                                          abs=0.005)


def test_flags_name_what_is_implausible():
    limit = {1: 1.0, 2: 0.5}
    assert bench.plausibility_flags("kv8", {1: 2.0, 2: 1.0}, limit) == []
    flags = bench.plausibility_flags("kv8", {1: 0.8, 2: 1.0}, limit)
    assert flags == ["kv8 faster than its byte limit at 1t (1.25x)", "kv8 slower at 2t than at 1t"]
    assert bench.plausibility_flags("numpy", {1: 2.0}, {1: 1.0}) == []   # one count: no scaling
    assert bench.plausibility_flags("numpy", {1: 2.0, 2: 2.0}, limit) == []  # equal: not slower


def test_read_bandwidth_is_a_rate():
    bw = bench.read_bandwidth(2, SMALL_BUFFER, passes=2)
    assert np.isfinite(bw) and bw > 0


def test_numpy_step_for_several_queries_matches_one_query_at_a_time(rng):
    X = rng.standard_normal((500, 64), dtype=np.float32)
    Q = rng.standard_normal((3, 64), dtype=np.float32)
    scale = np.float32(0.125)
    got = bench._numpy_step(X, Q, scale)
    for i in range(3):
        s = (X.astype(np.float64) @ Q[i]) * scale
        w = np.exp(s - s.max())
        w /= w.sum()
        np.testing.assert_allclose(got[i], w @ X, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bench._numpy_step(X, Q[:1], scale)[0],
                               softmax((X @ Q[0]) * scale) @ X, rtol=1e-6)


@pytest.mark.parametrize("schedule", bench.SCHEDULES)
def test_a_cell_times_the_real_work_and_derives_limits_from_its_bandwidth(schedule, monkeypatch):
    monkeypatch.setattr(bench, "COOL_DOWN_S", 0.0)
    cell = bench.time_cell(64, 400, ["kv8", "tq4"], threads=(1, 2), repeats=2, queries=3,
                           rounds=2, warmup_s=0.0, schedule=schedule,
                           bandwidth_buffer=SMALL_BUFFER)
    assert set(cell["median"]) == {"numpy", "kv8", "tq4"}
    for name in ("numpy", "kv8", "tq4"):
        for nt in (1, 2):
            assert cell["min"][name][nt] <= cell["median"][name][nt]
            assert cell["limit"][name][nt] == pytest.approx(
                2 * 400 * cell["bytes_per_row"][name] / cell["bandwidth"][nt])
    assert cell["bytes_per_row"] == {"numpy": 256, "kv8": 68, "tq4": 36}
    assert cell["errors"]["kv8"] < 0.05 and cell["errors"]["tq4"] < 0.2   # the codecs' context
    rows = bench.cell_rows(64, 400, 3, cell, ["kv8", "tq4"], (1, 2))
    for row in rows:
        spec = row["codec"]
        assert row["queries"] == 3
        assert row["fraction_2t"] == pytest.approx(cell["limit"][spec][2] / cell["median"][spec][2])
        assert row["speedup_1t"] == pytest.approx(cell["median"]["numpy"][1]
                                                  / cell["median"][spec][1])
        assert row["bytes_ratio"] == pytest.approx(256 / cell["bytes_per_row"][spec])
        per_round = [a / b for a, b in zip(cell["round_medians"]["numpy"][2],
                                           cell["round_medians"][spec][2])]
        assert len(per_round) == 2
        assert (row["speedup_rounds_lo_2t"], row["speedup_rounds_hi_2t"]) == (min(per_round),
                                                                              max(per_round))
        expected = bench.plausibility_flags(spec, cell["median"][spec], cell["limit"][spec]) \
            + bench.plausibility_flags("numpy", cell["median"]["numpy"], cell["limit"]["numpy"])
        assert row["flags"] == "; ".join(expected)


@pytest.mark.parametrize("schedule", bench.SCHEDULES)
def test_round_medians_keep_each_rounds_samples_apart(schedule, monkeypatch):
    """A method that slows by 10 s a round (on a fake clock) has round medians 10 s apart, in
    round order, under both schedules; the per-round speedups divide round by round."""
    monkeypatch.setattr(bench, "COOL_DOWN_S", 0.0)
    repeats, rounds, clock = 3, 4, [0.0]

    class Stub:
        n_threads, n_copies = 1, 1

        def __init__(self, name, base):
            self.name, self.base, self.calls = name, base, 0

        def limited(self):
            return contextlib.nullcontext()

        def __call__(self):
            # block: two warm-up calls and `repeats` timed ones a round; interleaved: one
            # untimed call before each timed one
            per_round = 2 + repeats if schedule == "block" else 2 * repeats
            clock[0] += self.base + 10.0 * (self.calls // per_round)
            self.calls += 1

    methods = [Stub("numpy", 4.0), Stub("kv8", 1.0)]
    if schedule == "block":
        times = bench._time_blocks(methods, repeats, rounds, 0.0, lambda: clock[0])
    else:
        times = bench._time_interleaved(methods, repeats, rounds, lambda: clock[0])
    numpy_rounds = bench.per_round_medians(times[("numpy", 1)], repeats, rounds)
    kv8_rounds = bench.per_round_medians(times[("kv8", 1)], repeats, rounds)
    assert numpy_rounds == [4.0, 14.0, 24.0, 34.0]
    assert kv8_rounds == [1.0, 11.0, 21.0, 31.0]
    cell = {"round_medians": {"numpy": {1: numpy_rounds}, "kv8": {1: kv8_rounds}}}
    assert bench.round_speedups(cell, "kv8", 1) == pytest.approx([4.0, 14 / 11, 24 / 21, 34 / 31])
    with pytest.raises(ValueError, match="4 rounds of 3"):
        bench.per_round_medians(times[("kv8", 1)][:-1], repeats, rounds)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="schedule"):
        bench.time_cell(64, 10, ["kv8"], threads=(1,), schedule="random")
    with pytest.raises(ValueError, match="queries"):
        bench.time_cell(64, 10, ["kv8"], threads=(1,), queries=0)
    with pytest.raises(ValueError, match="threads=\\(1,\\)"):
        bench.time_cell(64, 10, ["kv8"], threads=(1, 2), clock="thread")


def test_default_polar_is_marked_exempt():
    assert bench.is_speed_exempt(get_codec("polar4", 64))
    for spec in ("polar4:alloc=level", "polar4:compat=colibri", "tq4", "kv8"):
        assert not bench.is_speed_exempt(get_codec(spec, 64)), spec


def test_the_command_writes_its_files_with_limits_flags_and_the_polar_line(tmp_path, capsys,
                                                                            monkeypatch):
    from kvquant.cli import main
    monkeypatch.setattr(bench, "BANDWIDTH_BUFFER_BYTES", SMALL_BUFFER.nbytes)
    assert main(["bench", "--dims", "64", "--contexts", "300", "--codecs", "kv8,polar4",
                 "--queries", "1,4", "--threads", "1,2", "--repeats", "1", "--rounds", "1",
                 "--warmup-s", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert bench.POLAR_NOTE in out and "Byte limit" in out
    assert "| 64 | 300 | polar4 (exempt) | 4 |" in out
    files = sorted(p.name for p in tmp_path.iterdir())
    stem = "bench_attention_d64_m1-4_T300_threads1-2_r1_" + json.loads(
        (tmp_path / files[1]).read_text())["simd"]
    assert files == [stem + ext for ext in (".csv", ".json", ".md")]
    with open(tmp_path / (stem + ".csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["codec"], r["queries"]) for r in rows] == [("kv8", "1"), ("polar4", "1"),
                                                          ("kv8", "4"), ("polar4", "4")]
    for r in rows:
        assert float(r["limit_ms_2t"]) == pytest.approx(
            1e3 * 2 * 300 * int(r["bytes_per_row"]) / (1e9 * float(r["bandwidth_gbs_2t"])))
        assert "flags" in r


def test_the_command_refuses_bad_queries_and_paths(capsys):
    from kvquant.cli import main
    for bad in ("0", "three"):
        assert main(["bench", "--queries", bad, "--codecs", "kv8", "--dims", "64"]) == 2
        assert "kvquant bench: --queries takes positive counts" in capsys.readouterr().err
    assert main(["bench", "--simd", "sse9", "--codecs", "kv8", "--dims", "64"]) == 2
    assert "kvquant bench:" in capsys.readouterr().err


def _fake_cache(root, cpu, index, level, size, shared):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(f"{value}\n")


def test_the_last_level_cache_is_the_highest_level_counted_once_per_instance(tmp_path):
    shared = tmp_path / "shared"
    for cpu in (0, 1):                     # one L3 of 32 MiB shared by both, an L2 each
        _fake_cache(shared, cpu, 2, 2, "1024K", str(cpu))
        _fake_cache(shared, cpu, 3, 3, "32768K", "0-1")
    assert bench.last_level_cache_bytes(str(shared)) == 32 << 20
    split = tmp_path / "split"             # two L3s of 16 MiB (two core complexes)
    for cpu in (0, 1):
        _fake_cache(split, cpu, 3, 3, "16M", str(cpu))
    assert bench.last_level_cache_bytes(str(split)) == 32 << 20
    assert bench.last_level_cache_bytes(str(tmp_path / "none")) is None


def test_cold_copies_hold_four_times_the_cache():
    assert bench.copies_for(32 << 20, 32 << 20) == 4
    assert bench.copies_for(33_554_432 + 1, 32 << 20) == 4      # ceil(4 * 32 MiB / size)
    assert bench.copies_for(1 << 30, 32 << 20) == 1
    assert bench.copies_for(1000, 1000, factor=2) == 2


def test_a_cold_cell_reads_every_copy_in_turn_and_does_the_same_work(monkeypatch):
    seen = {"numpy": [], "codec": []}
    numpy_step, codec_step = bench._numpy_step, bench._codec_step
    monkeypatch.setattr(bench, "_numpy_step",
                        lambda X, Q, scale: seen["numpy"].append(id(X)) or numpy_step(X, Q, scale))
    monkeypatch.setattr(bench, "_codec_step", lambda codec, enc, Q, scale, n, **kw: seen[
        "codec"].append(id(enc.codes)) or codec_step(codec, enc, Q, scale, n, **kw))
    kwargs = dict(threads=(1,), repeats=3, rounds=2, warmup_s=0.0, bandwidth_buffer=SMALL_BUFFER)
    warm = bench.time_cell(64, 400, ["kv8"], **kwargs)
    assert warm["copies"] == {"numpy": 1, "kv8": 1} and warm["cache_bytes"] is None
    seen["numpy"].clear()
    seen["codec"].clear()
    cold = bench.time_cell(64, 400, ["kv8"], cold=True, cache_bytes=100_000, **kwargs)
    # numpy: 400 x 256 B = 102400 B a copy; kv8: 400 x (64 + 4) = 27200 B
    assert cold["copies"] == {"numpy": 4, "kv8": 15} and cold["cache_bytes"] == 100_000
    timed = seen["numpy"][1:]                  # the first call is the reference step
    assert len(set(timed)) == 4                # every copy read, each in turn
    assert all(timed[i] != timed[i + 1] for i in range(len(timed) - 1))
    assert len(set(seen["codec"][1:])) == 15
    assert cold["errors"] == warm["errors"]    # the same rows, the same work
    rows = bench.cell_rows(64, 400, 1, cold, ["kv8"], (1,))
    assert rows[0]["numpy_copies"] == 4 and rows[0]["codec_copies"] == 15


def test_cold_rows_without_a_cache_size_are_refused(monkeypatch):
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: None)
    with pytest.raises(ValueError, match="last-level cache size.*--cache-mib"):
        bench.time_cell(64, 10, ["kv8"], threads=(1,), cold=True)


def test_the_command_names_a_cold_run_in_its_files(tmp_path, capsys, monkeypatch):
    from kvquant.cli import main
    monkeypatch.setattr(bench, "BANDWIDTH_BUFFER_BYTES", SMALL_BUFFER.nbytes)
    assert main(["bench", "--dims", "64", "--contexts", "200", "--codecs", "tq4",
                 "--threads", "1", "--repeats", "1", "--rounds", "1", "--warmup-s", "0",
                 "--cold", "--cache-mib", "0.1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Cold rows:" in out
    (md,) = [p for p in tmp_path.iterdir() if p.suffix == ".md"]
    assert md.name.endswith("_cold.md")
    result = json.loads(md.with_suffix(".json").read_text())
    assert result["cold"] is True and result["cache_bytes"] == int(0.1 * (1 << 20))
    assert main(["bench", "--dims", "64", "--codecs", "kv8", "--cold", "--cache-mib", "0"]) == 2
    assert "--cache-mib takes a positive size" in capsys.readouterr().err


def test_the_codec_step_with_numpy_softmax_differs_only_in_the_softmax(rng):
    """softmax_kind="numpy": the codec's scores, numpy's softmax of them times the scale (the
    baseline's own function), the codec's context of those weights; the compiled softmax gives
    the same weights to rounding."""
    X = rng.standard_normal((700, 64), dtype=np.float32)
    Q = rng.standard_normal((3, 64), dtype=np.float32)
    scale = np.float32(0.125)
    for spec in ("kv8", "tq4"):
        codec = get_codec(spec, 64)
        enc = codec.encode(X)
        S = codec.scores(enc, Q)
        W = softmax(S * scale)
        expected = codec.context(enc, W)
        got = bench._codec_step(codec, enc, Q, scale, 1, softmax_kind="numpy")
        np.testing.assert_array_equal(got, expected)
        compiled = bench._codec_step(codec, enc, Q, scale, 1)
        np.testing.assert_allclose(compiled, expected, rtol=1e-5, atol=1e-6)
    # the f32 codec with numpy's softmax is the baseline's step, to rounding of the products
    f32 = get_codec("f32", 64)
    np.testing.assert_allclose(
        bench._codec_step(f32, f32.encode(X), Q, scale, 1, softmax_kind="numpy"),
        bench._numpy_step(X, Q, scale), rtol=1e-5, atol=1e-6)


def test_a_numpy_softmax_run_says_so_in_its_files(tmp_path, capsys, monkeypatch):
    from kvquant.cli import main
    monkeypatch.setattr(bench, "BANDWIDTH_BUFFER_BYTES", SMALL_BUFFER.nbytes)
    assert main(["bench", "--dims", "64", "--contexts", "200", "--codecs", "tq4",
                 "--threads", "1", "--repeats", "1", "--rounds", "1", "--warmup-s", "0",
                 "--softmax", "numpy", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "numpy's softmax (the baseline's" in out
    (md,) = [p for p in tmp_path.iterdir() if p.suffix == ".md"]
    assert md.name.endswith("_numpy-softmax.md")
    assert json.loads(md.with_suffix(".json").read_text())["softmax"] == "numpy"
    with pytest.raises(ValueError, match="softmax must be one of"):
        bench.time_cell(64, 10, ["kv8"], threads=(1,), softmax="scipy")
