"""experiments/bench_codecs.py: a tiny run writes its table and the ratios taken in the same run."""
import json

from experiments import bench_codecs


def test_tiny_run_writes_ratios(tmp_path, capsys):
    assert bench_codecs.main(["--dims", "64", "--rows", "256", "--ref-rows", "32", "--repeats", "1",
                              "--ref-repeats", "1", "--yard-rows", "64",
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
        # the yardstick was timed beside every encode: its ratio is the codec's rate over it
        assert r["yard_s"] > 0
        expect = r["encode_rows_per_s"] / (result["yard_rows"] / r["yard_s"])
        assert abs(r["encode_over_yard"] - expect) <= 1e-9 * expect
    assert "enc/yard" in capsys.readouterr().out
