"""The command line, run as a user would."""
import json
import subprocess
import sys

import numpy as np
import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "kvquant.cli", *args], capture_output=True,
                          text=True)


def test_distortion_json():
    res = run("distortion", "--codecs", "kv8,tq4:compat=colibri,tq3:codebook=gaussian,side=unbiased",
              "--dim", "128", "--rows", "512", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    rows = {r["codec"]: r for r in out["results"]}
    assert set(rows) == {"kv8", "tq4:compat=colibri", "tq3:codebook=gaussian,side=unbiased"}
    for r in rows.values():
        assert set(r) >= {"codec", "dim", "bits_per_value", "bytes_per_row", "rel_l2_mean",
                          "rel_l2_max"}
        assert r["rel_l2_max"] >= r["rel_l2_mean"] > 0
    assert rows["kv8"]["bytes_per_row"] == 132
    assert 0.094 < rows["tq4:compat=colibri"]["rel_l2_mean"] < 0.098


def test_distortion_on_user_data(tmp_path):
    X = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    path = tmp_path / "rows.npy"
    np.save(path, X)
    res = run("distortion", "--codecs", "kv8", "--data", str(path), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["results"][0]["dim"] == 32


def test_distortion_of_a_stream_spec_on_offset_rows(tmp_path):
    rng = np.random.default_rng(2)
    X = (rng.standard_normal((256, 64)) + 5 * rng.standard_normal(64)).astype(np.float32)
    path = tmp_path / "keys.npy"
    np.save(path, X)
    res = run("distortion", "--codecs", "tq4,tq4@center,sinks=2", "--data", str(path), "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["codec"]: r for r in json.loads(res.stdout)["results"]}
    plain, stream = rows["tq4"], rows["tq4@center,sinks=2"]
    # the codec sees rows minus their mean: a ~5x smaller relative error here
    assert stream["rel_l2_mean"] < 0.4 * plain["rel_l2_mean"]
    # 254 coded rows + 2 f32 sinks + the f32 offset, over 256 rows
    assert stream["bytes_per_row"] == pytest.approx((254 * 36 + 3 * 256) / 256, abs=0.01)


def test_distortion_bad_width_is_explained():
    res = run("distortion", "--codecs", "tq4", "--dim", "100")
    assert res.returncode != 0
    assert "power-of-two" in res.stderr and "kv8" in res.stderr


def test_distortion_unreadable_data(tmp_path):
    bad = tmp_path / "x.npy"
    bad.write_text("not numpy")
    res = run("distortion", "--data", str(bad))
    assert res.returncode != 0 and "cannot read" in res.stderr


def test_codebooks_fit_writes_under_the_working_directory(tmp_path):
    import kvquant.codebooks as cb
    before = sorted(p.name for p in cb.DEFAULT_DATA_DIR.iterdir())
    res = subprocess.run([sys.executable, "-m", "kvquant.cli", "codebooks", "fit", "--dist",
                          "gaussian", "--bits", "2"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    written = tmp_path / "codebooks" / "gaussian-b2.json"
    stored = cb.DEFAULT_DATA_DIR / "gaussian-b2.json"
    assert json.loads(written.read_text())["levels"] == json.loads(stored.read_text())["levels"]
    assert sorted(p.name for p in cb.DEFAULT_DATA_DIR.iterdir()) == before
