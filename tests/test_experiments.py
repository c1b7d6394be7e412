"""The research layer (kvquant_experiments): packaging, pure cells, resume, Dask = local."""
import configparser
import json
import subprocess
import sys

import numpy as np
import pytest

from _experiments_env import ROOT, ensure_importable, subprocess_env

ensure_importable()

from kvquant_experiments import distortion, inner_products  # noqa: E402
from kvquant_experiments.common import cell_stem, spec_tag, stable_seed  # noqa: E402
from kvquant_experiments.executor import SerialExecutor, open_executor, run_cells  # noqa: E402
from kvquant_experiments.inputs import make_rows  # noqa: E402


# -- packaging ---------------------------------------------------------------------------------
def test_setup_cfg_lists_every_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvquant").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders <= listed, f"add {sorted(folders - listed)} to [options] packages in setup.cfg"
    assert "kvquant_experiments" in listed
    assert "kvquant_experiments = experiments" in cfg["options"]["package_dir"]


def test_library_never_imports_experiments():
    code = ("import sys, kvquant, kvquant.cli, kvquant.flips, kvquant.models\n"
            "kvquant.cli.build_parser()\n"
            "assert not [m for m in sys.modules if m.startswith('kvquant_experiments')]\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=subprocess_env(), cwd=ROOT)
    assert res.returncode == 0, res.stderr


# -- names and seeds ---------------------------------------------------------------------------
def test_files_are_named_by_their_parameters():
    cell = {"kind": "gaussian", "dim": 128, "codec": "tq4", "rows": 4096, "seed": 0}
    assert cell_stem(cell, distortion.STEM_ORDER) == "gaussian_d128_tq4_rows4096_seed0"
    assert spec_tag("tq3:codebook=gaussian,side=unbiased") == "tq3-codebook-gaussian-side-unbiased"
    assert spec_tag("kv8/tq4") == "kv8_tq4"
    assert stable_seed("a", 1) == stable_seed("a", 1) != stable_seed("a", 2)


def test_rows_are_a_pure_function_of_their_parameters():
    a = make_rows("heavy", 64, 300, seed=3)
    assert np.array_equal(a, make_rows("heavy", 64, 300, seed=3))
    assert not np.array_equal(a, make_rows("heavy", 64, 300, seed=4))
    # Outlier channels: the same channels are large in every row.
    scale = np.median(np.abs(a), axis=0)
    assert (scale > 5 * np.median(scale)).sum() == 64 // 32
    with pytest.raises(ValueError, match="unknown input kind"):
        make_rows("uniform", 64, 4)


# -- cells -------------------------------------------------------------------------------------
def test_distortion_cell_matches_theory_and_marks_missing_codecs():
    cell = {"kind": "gaussian", "dim": 128, "codec": "tq4", "rows": 2048, "seed": 0}
    r = distortion.distortion_cell(cell)
    assert r == distortion.distortion_cell(cell)
    assert r["available"] and r["bits_per_value"] == 4.25
    assert r["rel_l2_rms"] ** 2 == pytest.approx(r["theory_mse"], rel=0.05)
    missing = distortion.distortion_cell({**cell, "codec": "nosuch4"})
    assert missing["available"] is False and "nosuch4" in missing["reason"]


def test_inner_product_shrink_and_unbiased_side():
    base = {"kind": "gaussian", "dim": 128, "rows": 1024, "queries": 32, "seed": 0}
    shrunk = inner_products.inner_product_cell({**base, "codec": "tq2"})
    fixed = inner_products.inner_product_cell({**base, "codec": "tq2:side=unbiased"})
    assert shrunk["slope"] == pytest.approx(shrunk["theory_slope"], abs=0.01)
    assert shrunk["theory_slope"] == pytest.approx(0.883, abs=0.01)
    assert fixed["slope"] == pytest.approx(1.0, abs=0.01)


# -- runner ------------------------------------------------------------------------------------
def _count_cell(cell):
    return {"available": cell["x"] != 3, "value": cell["x"] ** 2, "reason": "three"}


def test_run_cells_writes_resumes_and_never_stores_missing(tmp_path):
    cells = [{"x": i} for i in range(5)]
    stem = lambda c: f"x{c['x']}"  # noqa: E731
    first = run_cells(_count_cell, cells, tmp_path, stem, progress=False)
    assert [r["value"] for r in first] == [0, 1, 4, 9, 16]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x0.json", "x1.json", "x2.json",
                                                         "x4.json"]
    stored = json.loads((tmp_path / "x2.json").read_text())
    assert stored["params"] == {"x": 2} and "versions" in stored["environment"]
    # Resume: a stored result is reused (made visible by editing it); a changed cell is not.
    stored["result"]["value"] = -1
    (tmp_path / "x2.json").write_text(json.dumps(stored))
    again = run_cells(_count_cell, cells, tmp_path, stem, progress=False)
    assert again[2]["value"] == -1
    fresh = run_cells(_count_cell, cells, tmp_path, stem, resume=False, progress=False)
    assert fresh[2]["value"] == 4
    # a cell file that is valid JSON but not an object (or lacks its result) is recomputed
    for junk in ("[1, 2]", '"text"', '{"params": {"x": 3}}'):
        (tmp_path / "x3.json").write_text(junk)
        again = run_cells(_count_cell, cells, tmp_path, stem, progress=False)
        assert again[3]["value"] == 9


def test_a_unit_that_cannot_be_saved_is_said_once_and_the_run_goes_on(tmp_path, capsys,
                                                                       monkeypatch):
    """A full disk under a run's units: one line on stderr, the results still returned (it was
    a traceback per unit, logged by concurrent.futures, and the count of saved units said
    nothing of it)."""
    from kvquant_experiments import executor as executor_module
    from kvquant_experiments.executor import UnitStore

    def full_disk(path, obj):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(executor_module, "write_json", full_disk)
    units = UnitStore(tmp_path / "units", identity={"run": 1})
    futures = []
    ex = SerialExecutor()
    for x in range(3):
        future = ex.submit(_count_cell, {"x": x})
        future.add_done_callback(units.done_callback(units.key("cell", {"x": x})))
        futures.append(future)
    assert [f.result()["value"] for f in futures] == [0, 1, 4]
    assert (units.saved, units.unsaved) == (0, 3)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == [
        f"kvquant: cannot save finished units in {tmp_path / 'units'} (No space left on "
        "device); the run goes on, but an interrupted run will compute them again"]


SMALL = {"codecs": ["kv8", "tq2", "tq4:compat=colibri"], "dims": [64], "kinds": ["gaussian",
                                                                                "heavy"],
         "rows": 128, "seed": 1}


def test_dask_cluster_gives_the_local_numbers(tmp_path):
    distributed = pytest.importorskip("distributed")
    with open_executor(workers=2) as ex:
        local = distortion.run_sweep(tmp_path / "local", executor=ex, progress=False, **SMALL)
    # Loopback only: the scheduler listens on tcp://127.0.0.1, the worker runs in this process.
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  protocol="tcp", host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        with open_executor(cluster.scheduler_address) as ex:
            assert ex.kind == "dask"
            remote = distortion.run_sweep(tmp_path / "dask", executor=ex, progress=False,
                                          **SMALL)
    serial = distortion.run_sweep(tmp_path / "serial", executor=SerialExecutor(),
                                  progress=False, **SMALL)
    assert len(local["rows"]) == 6
    assert local["rows"] == remote["rows"] == serial["rows"]
    assert (tmp_path / "dask" / "distortion" / "heavy_d64_tq2_rows128_seed1.json").is_file()


def test_local_workers_run_one_thread_each():
    from kvquant_experiments.common import environment
    with open_executor(workers=1) as ex:
        env = ex.submit(environment).result()
    assert env["openmp_max_threads"] == 1


# -- frontier bookkeeping --------------------------------------------------------------------------
@pytest.mark.parametrize("pair", ["tq4", "q8_0/tq4", "polar5@center,sinks=1/polar4@sinks=1",
                                  "q4_0+rot@sinks=3/q4_0+rot", "tq3@center/kv8"])
@pytest.mark.parametrize("tokens", [1, 2, 37, 512])
def test_frontier_bits_are_the_bytes_a_cache_holds(rng, pair, tokens):
    from kvquant.cache import QuantizedKVCache
    from kvquant.specs import parse_cache_spec
    from kvquant_experiments.frontier import bits_per_value
    k_spec, v_spec = parse_cache_spec(pair).streams
    cache = QuantizedKVCache(1, {"k": (k_spec, 64), "v": (v_spec, 64)})
    K, V = (rng.standard_normal((tokens, 64)).astype(np.float32) for _ in range(2))
    cache.append(0, k=K, v=V)
    assert bits_per_value(pair, 64, tokens=tokens) == pytest.approx(
        8.0 * cache.nbytes / (tokens * 2 * 64), rel=1e-12)
    assert bits_per_value(pair, 64) == pytest.approx(8.0 * cache.bytes_per_token / (2 * 64))
    if tokens >= 3:   # every sink filled: the cache's own account of its fixed bytes
        assert cache.nbytes == tokens * cache.bytes_per_token + cache.fixed_bytes


def test_pareto_front_keeps_only_undominated_points():
    from kvquant_experiments.frontier import pareto_front
    pts = [{"bits_per_value": b, "kld_mean": k}
           for b, k in [(4.0, 0.05), (4.5, 0.03), (4.5, 0.02), (5.0, 0.04), (8.5, 0.001)]]
    assert [pts[i]["kld_mean"] for i in pareto_front(pts)] == [0.05, 0.02, 0.001]


# -- fixed polar widths --------------------------------------------------------------------------
def test_polar_fixed_widths_sweep(tmp_path):
    from kvquant_experiments import polar_widths
    rng = np.random.default_rng(7)
    X = rng.standard_normal((3000, 16))
    angles, radius = polar_widths.polar_angles(X)
    assert [a.shape[1] for a in angles] == [8, 4, 2, 1]
    np.testing.assert_allclose(radius, np.linalg.norm(X, axis=1), rtol=1e-12)
    budget = 8 * 4 + 7 * 3
    splits = polar_widths.fixed_split_errors(X, budget)
    assert all(budget - 8 <= bits <= budget for _, _, bits in splits)
    assert [e for e, _, _ in splits] == sorted(e for e, _, _ in splits)
    # more bits never hurt: the full budget's best beats the best split 8 bits below it
    assert splits[0][0] <= min(e for e, _, bits in splits if bits <= budget - 6)
    # the sweep's own fit of the engine's split agrees with the codec's fitted codebooks
    assert polar_widths.main(["--dim", "16", "--bits", "4", "--rows", "3000",
                              "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "polar-fixed-widths-d16-b4-rows3000.json").read_text())
    engine = next(s for s in result["splits"] if s["widths"] == [4, 3, 3, 3])
    assert abs(engine["rel_l2"] - result["codecs"]["polar4:alloc=level"]) < 0.03 * engine["rel_l2"]
    assert result["codecs"]["polar4"] < engine["rel_l2"]
    assert (tmp_path / "polar-fixed-widths-d16-b4-rows3000.md").exists()


def test_result_files_get_the_mode_a_plain_open_gives(tmp_path):
    """Results are written through a temporary file (atomic); they must not stay private (0600)
    as the temporary was, but get the mode ``open(path, "w")`` gives under the umask."""
    import os
    import stat
    from kvquant_experiments.common import write_json
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    written = write_json(tmp_path / "result.json", {"a": 1})
    assert stat.S_IMODE(os.stat(written).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
    assert json.loads(written.read_text()) == {"a": 1}
