"""`kvquant report`: the command, the folder it writes, and missing pieces named, never dropped."""
import json
import re
import subprocess
import sys

import pytest

from _experiments_env import ROOT, ensure_importable, subprocess_env

ensure_importable()

from kvquant_experiments import distortion, report  # noqa: E402

SECTIONS = ["Distortion", "Codebooks", "Inner products", "Token flips: the tiny MLA model",
            "Token flips: the real model", "Quality per byte: the frontier's picks on held-out "
            "texts", "Speed", "Memory", "Cache files",
            "Environment and timings"]


def run_cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "kvquant.cli", *args], capture_output=True,
                           text=True, env=subprocess_env(**env), cwd=ROOT)


def check_report_folder(out):
    md = (out / "REPORT.md").read_text()
    for title in SECTIONS:
        assert f"## {title}" in md, title
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(figures) >= 6
    for rel in figures:
        assert (out / rel).is_file() and (out / rel).stat().st_size > 5000, rel
    for name in ("distortion.csv", "distortion.json", "inner_products.csv", "speed.json",
                 "report.json", "flips/flips-tiny-mla-p1.csv"):
        assert (out / "data" / name).is_file(), name
    assert (out / "data" / "distortion" / "gaussian_d64_tq4_rows256_seed0.json").is_file()
    return md


def test_cli_report_smoke(tmp_path):
    res = run_cli("report", "--smoke", "--out", str(tmp_path / "rep"), "--no-progress",
                  "--real", "no")
    assert res.returncode == 0, res.stderr[-3000:]
    md = check_report_folder(tmp_path / "rep")
    assert "smoke size" in md and "local process pool" in md
    assert "not available**: the real-model table — skipped on request" in md
    meta = json.loads((tmp_path / "rep" / "data" / "report.json").read_text())
    assert meta["smoke"] is True and meta["seconds"] > 0


def test_cli_report_help_comes_from_the_research_package():
    res = run_cli("report", "--help")
    assert res.returncode == 0, res.stderr
    assert "--scheduler" in res.stdout and "--out" in res.stdout


def test_missing_pieces_are_named_not_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(distortion, "SMOKE_CODECS", distortion.SMOKE_CODECS + ["nosuch4"])
    import kvquant
    import kvquant_experiments.bench
    # as if these modules were not built yet
    for package, piece in ((kvquant_experiments.bench, "attention_step"), (kvquant, "budget")):
        monkeypatch.setitem(sys.modules, f"{package.__name__}.{piece}", None)
        monkeypatch.delattr(package, piece, raising=False)
    res = report.run_report(tmp_path / "rep", smoke=True, scheduler="serial", progress=False,
                            real="no", log=lambda msg: None)
    md = (tmp_path / "rep" / "REPORT.md").read_text()
    assert re.search(r"not available\*\*: codec `nosuch4` — unknown codec spec", md)
    assert ("not available**: decode-step timing — kvquant_experiments.bench.attention_step is "
            "not in this build") in md
    assert "not available**: the memory budget — kvquant.budget is not in this build" in md
    assert len(res["unavailable"]) >= 4
    # Every codec of the grid is either in a table or named as not available.
    for spec in distortion.default_grid(smoke=True)["codecs"]:
        assert f"`{spec}`" in md, spec
    # A second run reuses the stored cells, and copies the README's figures.
    figs = tmp_path / "figs"
    again = report.run_report(tmp_path / "rep", smoke=True, scheduler="serial", progress=False,
                              real="no", figures_to=figs, log=lambda msg: None)
    # computed again: only the two `nosuch4` cells (distortion, inner products), whose
    # "not available" results are never stored
    assert again["reused"] >= 2 and again["computed"] == 2
    copied = {p.name for p in figs.iterdir()}
    assert {"distortion_gaussian.png", "flips_tiny-mla_pareto.png"} <= copied
    assert copied <= set(report.HEADLINE_FIGURES)


def test_a_registered_codec_joins_every_section(tmp_path):
    """`kvquant report --codecs NAME`: a plug-in codec measured beside the built-in grid."""
    import kvquant
    from _toy_codec import factory
    kvquant.register_codec("toysign", factory)
    try:
        report.run_report(tmp_path / "rep", smoke=True, scheduler="serial", progress=False,
                          real="no", log=lambda msg: None, codecs=["toysign"])
    finally:
        kvquant.unregister_codec("toysign")
    data = tmp_path / "rep" / "data"
    rows = json.loads((data / "distortion.json").read_text())["rows"]
    toy = [r for r in rows if r["codec"] == "toysign"]
    assert toy and all(r["available"] and r["rel_l2_rms"] > 0 for r in toy)
    md = (tmp_path / "rep" / "REPORT.md").read_text()
    assert md.count("toysign") >= 2   # the sweep's table and the tiny model's flip table
    res = run_cli("report", "--codecs", "nosuch9", "--smoke", "--out", str(tmp_path / "x"))
    assert res.returncode != 0 and "nosuch9" in res.stderr and not (tmp_path / "x").exists()


def test_a_position_strip_cut_into_cells_is_joined_in_the_table_order():
    """The real model's position strip runs in one cell per worker; joined, it holds every
    codec's row in the table's order, each row the one its own cell computed."""
    from kvquant_experiments.flip_report import merge_positions, position_cells
    codecs = ["kv8", "tq4", "polar4", "q8_0", "tq2"]
    cells = position_cells("tiny-mla", codecs, smoke=True, n_groups=2)
    assert [c["codecs"] for c in cells] == [["kv8", "polar4", "tq2"], ["tq4", "q8_0"]]
    assert len({c["group"] for c in cells}) == 2
    results = [{"source": "s", "n_positions": 3, "codecs": c["codecs"],
                "flipped": [[i, 0, 1] for i, _ in enumerate(c["codecs"])],
                "kld": [[float(len(name))] * 3 for name in c["codecs"]]} for c in cells]
    joined = merge_positions(results[::-1], codecs)
    assert joined["codecs"] == codecs
    assert [k[0] for k in joined["kld"]] == [float(len(c)) for c in codecs]
    assert joined["flipped"][codecs.index("q8_0")] == [1, 0, 1]
    results[1]["source"] = "other tokens"
    with pytest.raises(ValueError, match="different tokens"):
        merge_positions(results, codecs)


def test_merged_flip_tables_find_rows_by_canonical_spec_and_never_drop_one():
    """A row carries its spec's canonical text (``kv8/kv8`` runs as ``kv8``, ``F32`` as
    ``f32``): merging finds it whatever the spelling asked for; a codec without a row is an
    error, not a table one row short."""
    from kvquant_experiments.flip_report import merge_tables
    results = [{"meta": {"group": 1}, "rows": [{"codec": "f32", "g": 1}, {"codec": "kv8"}]},
               {"meta": {"group": 2}, "rows": [{"codec": "f32", "g": 2}, {"codec": "tq4"}]}]
    table = merge_tables(results, ["F32", "tq4", "kv8/kv8"])
    assert [r["codec"] for r in table["rows"]] == ["f32", "tq4", "kv8"]
    assert table["rows"][0]["g"] == 1 and table["meta"] == {"group": 1}
    with pytest.raises(ValueError, match="polar4"):
        merge_tables(results, ["kv8", "polar4"])
