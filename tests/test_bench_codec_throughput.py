"""kvquant_experiments.bench.codec_throughput: a tiny run writes its table and the ratios taken in
the same run."""
import json

import numpy as np

from _experiments_env import ensure_importable

ensure_importable()
from kvquant_experiments.bench import codec_throughput  # noqa: E402


def test_tiny_run_writes_ratios(tmp_path, capsys):
    assert codec_throughput.main(["--dims", "64", "--rows", "256", "--ref-rows", "32",
                                  "--repeats", "1", "--ref-repeats", "1", "--yard-rows", "64",
                                  "--codecs", "tq4;tq6;polar4:alloc=level", "--out",
                                  str(tmp_path)]) == 0
    (path,) = tmp_path.glob("codec_throughput_d64_rows256_t2.json")
    result = json.loads(path.read_text())
    rows = {r["codec"]: r for r in result["results"]}
    assert set(rows) == {"tq4", "tq6", "polar4:alloc=level"}
    assert rows["tq4"]["encode_time_over_tq4"] == 1.0
    assert rows["tq6"]["encode_time_over_tq4"] > 0
    assert rows["polar4:alloc=level"]["encode_time_over_tq4"] is None
    for r in rows.values():
        # the yardstick was timed around every codec's encodes: its ratio is the codec's rate over it
        assert r["yard_s"] > 0
        expect = r["encode_rows_per_s"] / (result["yard_rows"] / r["yard_s"])
        assert abs(r["encode_over_yard"] - expect) <= 1e-9 * expect
    assert "enc/yard" in capsys.readouterr().out


def test_the_yardstick_is_timed_in_its_own_blocks(monkeypatch):
    """No yardstick call falls between two of a codec's encode calls: the encoder's block runs
    alone, the yardstick's blocks (of --repeats calls) right before and right after it."""
    events = []
    real_get_codec = codec_throughput.get_codec

    class Recorded:
        def __init__(self, codec):
            self.codec = codec

        def __getattr__(self, name):
            return getattr(self.codec, name)

        def encode(self, X, n_threads=1):
            events.append("e")
            return self.codec.encode(X, n_threads=n_threads)

    monkeypatch.setattr(codec_throughput, "get_codec",
                        lambda spec, d: Recorded(real_get_codec(spec, d)))
    X = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    row = codec_throughput.bench_one("tq4", 64, X, X[:16], 3, 1, 1, yard=lambda: events.append("y"))
    # warm-up encode, warm-up yardstick, its block, the encoder's block, the yardstick's block
    assert "".join(events) == "e" + "y" + "yyy" + "eee" + "yyy"
    assert row["yard_s"] is not None and row["encode_rows_per_s"] > 0


def test_a_tq_codec_is_compared_with_tq4_timed_right_around_it(monkeypatch):
    """tq4's encoder runs in its own blocks right before and right after a tq<b> encoder's block,
    and ``x tq4`` is the ratio of the two medians."""
    events = []
    real_get_codec = codec_throughput.get_codec
    fake_seconds = {"tq4": 2.0, "tq6": 3.0}
    clock = [0.0]

    class Recorded:
        def __init__(self, spec, codec):
            self.spec, self.codec = spec, codec

        def __getattr__(self, name):
            return getattr(self.codec, name)

        def encode(self, X, n_threads=1):
            events.append(self.spec)
            clock[0] += fake_seconds[self.spec]
            return self.codec.encode(X, n_threads=n_threads)

        def decode(self, enc, n_threads=1):
            clock[0] += 1.0
            return self.codec.decode(enc, n_threads=n_threads)

    monkeypatch.setattr(codec_throughput, "get_codec",
                        lambda spec, d: Recorded(spec, real_get_codec(spec, d)))
    monkeypatch.setattr(codec_throughput.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(codec_throughput, "numpy_reference", lambda codec: None)
    X = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    row = codec_throughput.bench_one("tq6", 64, X, X[:16], 3, 1, 1)
    # warm-up, tq4's warm-up and block, tq6's block, tq4's block (decode is not recorded)
    assert events == ["tq6"] + ["tq4"] * 4 + ["tq6"] * 3 + ["tq4"] * 3
    assert row["encode_time_over_tq4"] == 1.5
    # with the yardstick too: its blocks outermost, tq4's next to tq6's on both sides
    events.clear()
    row = codec_throughput.bench_one("tq6", 64, X, X[:16], 3, 1, 1, yard=lambda: events.append("y"))
    assert events == (["tq6"] + ["y"] * 4 + ["tq4"] * 4 + ["tq6"] * 3 + ["tq4"] * 3
                      + ["y"] * 3)
    assert row["encode_time_over_tq4"] == 1.5
