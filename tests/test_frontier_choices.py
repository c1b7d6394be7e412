"""Held-out discipline: the frontier's picks come from a tune-text run only, the committed choices
file is what the command makes, and a rerun of the cells says what it reused."""
import json

import pytest

from _experiments_env import ROOT, ensure_importable

ensure_importable()

from kvquant_experiments import executor, flip_report, frontier, frontier_picks  # noqa: E402

RESULTS = ROOT / "data" / "results"
TUNE_RUN = RESULTS / "frontier-smollm2-N2048-c512-p4.json"
# further runs on the tune text (recent windows split between K and V) the picks also come from
TUNE_MORE = sorted([*(RESULTS / "tune-windows").glob("frontier-smollm2-pydoc-*.json"),
                    *(RESULTS / "tune-field-codecs").glob("frontier-smollm2-pydoc-*.json")])


@pytest.fixture(scope="module")
def tune_run():
    return json.loads(TUNE_RUN.read_text())


def test_committed_choices_are_the_picks_of_the_tune_runs(tune_run):
    committed = json.loads((RESULTS / "frontier-choices.json").read_text())
    assert TUNE_MORE
    runs = [tune_run] + [json.loads(p.read_text()) for p in TUNE_MORE]
    assert {r["meta"]["text"]["name"] for r in runs} == {"pydoc"}
    made = frontier_picks.choose(frontier_picks.merge_tune_runs(runs))
    assert {b: (c["pair"], c["bits"], c["tune_text"]) for b, c in made.items()} == {
        b: (c["pair"], c["bits"], c["tune_text"]) for b, c in committed.items()}
    assert list(committed) == ["2.5", "3", "3.5", "4.5", "5.5", "8.5"]
    assert {c["tune_text"] for c in committed.values()} == {"pydoc"}
    assert tune_run["meta"]["text"]["name"] == "pydoc"
    # the report runs exactly these picks
    assert [c["pair"] for c in committed.values()] == flip_report.PICKS


def test_each_pick_is_the_lowest_kld_within_its_budget(tune_run):
    rows = [r for r in tune_run["rows"] if r["codec"] != "f32"]
    picks = frontier_picks.choose(tune_run)
    assert "2.5" not in picks     # the grid has nothing this small: no pick, not an error
    for budget, pick in picks.items():
        fits = [r for r in rows if r["bits_per_value"] <= float(budget) + 1e-9]
        best = min(r["kld_mean"] for r in fits)
        assert pick["tune_kld_mean"] == best
        assert pick["bits"] <= float(budget)


def test_a_run_of_the_picks_measures_the_baselines_and_each_pick_once(tune_run):
    choices = frontier_picks.choose(tune_run)
    configs = frontier_picks.choice_configs(choices, extra=["tq4", "polar5/polar4"])
    assert configs[:9] == ["f32", "kv8", "q8_0", "q8_0+rot", "q4_0", "q4_0+rot", "tq4",
                           "ggml:q8_0/q8_0", "ggml:q4_0/q4_0"]
    assert configs[9:13] == [c["pair"] for c in choices.values()]
    assert configs[13:] == ["polar5/polar4"]
    # a baseline that spells the f32 reference otherwise is the reference, listed once
    assert frontier_picks.choice_configs({}, baselines=["F32", "f32/f32", "kv8"]) == ["f32", "kv8"]


def test_choose_from_writes_where_asked_and_bad_files_are_refused(tmp_path, capsys):
    out = tmp_path / "picks.json"
    assert frontier.main(["--choose-from", str(TUNE_RUN), "--choices-out", str(out)]) == 0
    assert set(json.loads(out.read_text())) == {"3.5", "4.5", "5.5", "8.5"}
    printed = capsys.readouterr().out
    assert "<= 4.5 bits" in printed and "<= 2.5 bits: no pick" in printed
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"four": {"pair": "tq4/tq4", "bits": 4.5, "tune_text": "pydoc"}}))
    with pytest.raises(ValueError, match="not a budget"):
        frontier_picks.load_choices(bad)
    bad.write_text(json.dumps({"4.5": {"pair": "tq4/tq4"}}))
    with pytest.raises(ValueError, match="lacks"):
        frontier_picks.load_choices(bad)


def _cell(cell):
    return {"available": True, "x": cell["x"] * 2}


def test_a_rerun_announces_the_cells_it_reused(tmp_path, capsys):
    cells = [{"x": i} for i in range(3)]
    tally = {}
    executor.run_cells(_cell, cells, tmp_path, lambda c: f"c{c['x']}", progress=False,
                       desc="toy", tally=tally)
    assert tally["computed"] == 3 and tally["reused"] == 0 and tally["work_seconds"] >= 0
    assert "reused" not in capsys.readouterr().err
    again = {}
    executor.run_cells(_cell, cells, tmp_path, lambda c: f"c{c['x']}", progress=False,
                       desc="toy", tally=again)
    assert again == {"reused": 3, "computed": 0, "work_seconds": 0.0}
    assert f"toy: reused 3 cells from {tmp_path}" in capsys.readouterr().err


def test_picks_can_come_from_several_runs_on_one_tune_text(tune_run, tmp_path, capsys):
    import copy
    more = copy.deepcopy(tune_run)
    rows = [r for r in tune_run["rows"] if r["codec"] != "f32"]
    # the fewest bits and half the lowest KLD of the grid: the pick of every budget it fits
    smallest = min(rows, key=lambda r: r["bytes_per_token"])
    extra = dict(copy.deepcopy(smallest), codec="polar3/polar3",
                 kld_mean=min(r["kld_mean"] for r in rows) / 2)
    more["rows"] = [tune_run["rows"][0], extra]
    merged = frontier_picks.merge_tune_runs([tune_run, more])
    assert len(merged["rows"]) == len(tune_run["rows"]) + 1
    picks = frontier_picks.choose(merged)
    bits = next(r for r in frontier.frontier_rows(merged)
                if r["codec"] == "polar3/polar3")["bits_per_value"]
    fits = [b for b in picks if float(b) >= bits]
    assert fits and all(picks[b]["pair"] == "polar3/polar3" for b in fits)   # best where it fits
    other = copy.deepcopy(more)
    other["meta"]["text"]["name"] = "code"
    with pytest.raises(ValueError, match="not a run on the same tune text.*text 'pydoc' vs 'code'"):
        frontier_picks.merge_tune_runs([tune_run, other], ["grid.json", "code.json"])
    paths = []
    for name, r in (("grid.json", tune_run), ("code.json", other)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(r))
    assert frontier.main(["--choose-from", *map(str, paths), "--choices-out",
                          str(tmp_path / "c.json")]) == 2
    assert "code.json is not a run on the same tune text" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("name", ["x/../../../t/PWNED", "../up", ".hidden", "a\\b:c"])
def test_plot_only_file_names_stay_in_out_whatever_the_json_says(tmp_path, capsys, name):
    # the names come from the JSON's meta (a text's name): values from a file, not from the user
    result = json.loads(TUNE_RUN.read_text())
    result["meta"]["text"]["name"] = name
    src = tmp_path / "in" / "run.json"
    src.parent.mkdir()
    src.write_text(json.dumps(result))
    out = tmp_path / "deep" / "out"
    assert frontier.main(["--plot-only", str(src), "--out", str(out)]) == 0
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p != src)
    assert written and all(p.parent == out for p in written)
    assert not any(p.name.startswith(".") for p in written)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("content, match", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "not a frontier result"),
    ('{"meta": {}, "rows": [1]}', "not a frontier result"),
    ('{"meta": {}, "rows": [{"codec": "kv8"}]}', "of this version"),
])
def test_frontier_json_readers_name_a_bad_file(tmp_path, capsys, content, match):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    for argv in (["--plot-only", str(bad), "--out", str(tmp_path / "o")], ["--goals", str(bad)],
                 ["--choose-from", str(bad), "--choices-out", str(tmp_path / "c.json")]):
        if match == "of this version" and argv[0] == "--goals":
            continue        # a result without picks: the goals table says "(no run of the picks)"
        assert frontier.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("frontier: ") and err.count("\n") == 1, (argv, err)
        assert "bad.json" in err, argv
        if match != "of this version" or argv[0] == "--plot-only":
            assert match in err, (argv, err)
    bad.write_text('{"4.5": 7}')
    with pytest.raises(ValueError, match="not a pick"):
        frontier_picks.load_choices(bad)


def test_evidence_adds_each_picks_held_out_runs_and_task_rows(tmp_path):
    choices = {"3.5": {"pair": "a/b", "bits": 3.4, "tune_text": "pydoc", "model": "smollm2"},
               "4.5": {"pair": "c/d", "bits": 4.4, "tune_text": "pydoc", "model": "smollm2",
                       "tasks": ["stale"]}}

    def run(text, model, rows):
        return {"meta": {"text": {"name": text, "source": text, "positions": 1024,
                                  "chunk_tokens": 512}, "model_name": model,
                         "protocol": {"prompts": 1}},
                "rows": rows}
    row = lambda codec, kld, bits: {"codec": codec, "kld_mean": kld, "bits_per_value": bits}
    tune = run("pydoc", "smollm2", [row("a/b", 0.01, 3.4)])
    held = run("code", "gemma3-270m", [row("a/b", 0.02, 3.2), row("tq4", 0.1, 4.5)])
    paired = {"diff": -0.01, "diff_low": -0.02, "diff_high": 0.0, "mcnemar_p": 0.04}
    summary = {"primary_metric": "acc_norm",
               "meta": {"model": "smollm2", "task": "hellaswag", "num_fewshot": 0},
               "rows": [{"spec": "f32", "n": 10, "acc_norm": {"acc": 0.5, "low": 0.2,
                                                               "high": 0.8}},
                        {"spec": "c/d", "n": 10, "acc_norm": {"acc": 0.4, "low": 0.1,
                                                               "high": 0.7},
                         "paired": {"acc_norm": paired}}]}
    frontier_rows = lambda r: r["rows"]
    import unittest.mock as mock
    with mock.patch.object(frontier_picks, "frontier_rows", frontier_rows), \
            mock.patch.object(frontier_picks, "result_stem", lambda r: r["meta"]["text"]["name"]):
        out = frontier_picks.pick_evidence(choices, [tune, held], [summary])
    assert out["3.5"]["held_out"] == [{"model": "gemma3-270m", "text": "code",
                                       "positions": 1024, "chunk_tokens": 512, "bits": 3.2,
                                       "kld_mean": 0.02, "from": "code"}]   # the tune run not
    assert out["3.5"]["tasks"] == [] and out["4.5"]["held_out"] == []
    assert out["4.5"]["tasks"] == [{"model": "smollm2", "task": "hellaswag", "shots": 0,
                                    "n": 10, "metric": "acc_norm", "accuracy": 0.4,
                                    "wilson95": [0.1, 0.7], "diff_to_f32": -0.01,
                                    "paired95": [-0.02, 0.0], "mcnemar_p": 0.04}]
    assert "tasks" not in choices["3.5"] and choices["4.5"]["tasks"] == ["stale"]


def test_the_ablation_finds_every_comparison_in_the_committed_tune_runs():
    """docs/field-codecs.md's ablation table: each technique beside its base, both measured in
    the committed tune runs (nothing missing, nothing guessed)."""
    from kvquant_experiments import codec_ablation
    runs = [json.loads(TUNE_RUN.read_text())] + [json.loads(p.read_text()) for p in TUNE_MORE]
    merged = frontier_picks.merge_tune_runs(runs)
    entries = codec_ablation.ablation_rows({r["codec"]: r for r in merged["rows"]})
    assert [e for e in entries if "missing" in e] == []
    for e in entries:
        assert e["kld"] > 0 and e["base_kld"] > 0 and e["config"] != e["base_config"]
        # a technique costs bits or is free; it never makes the cache smaller
        assert e["bits"] >= e["base_bits"] - 1e-9 or e["technique"].startswith("stacked")


def _result_file(tmp_path, change, name="bad.json"):
    """The tune run with ``change`` applied, written to ``tmp_path / name``."""
    result = json.loads(TUNE_RUN.read_text())
    change(result)
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return path


@pytest.mark.parametrize("change, field", [
    # meta.text not an object: an AttributeError traceback (--choose-from, --plot-only)
    (lambda r: r["meta"].__setitem__("text", "pydoc"), "meta.text is 'pydoc', not an object"),
    # a string KLD: "Unknown format code 'e'", or written into the picks by --choose-from
    (lambda r: r["rows"][3].__setitem__("kld_mean", "0.01"),
     "rows[3].kld_mean is '0.01', not a number"),
    (lambda r: r["rows"][2]["same_top"].__setitem__("p", None),
     "rows[2].same_top.p is None, not a number"),
    (lambda r: r["meta"]["text"].__setitem__("chunk_tokens", 512.5),
     "meta.text.chunk_tokens is 512.5, not a whole number"),
    (lambda r: r["meta"]["text"].__setitem__("chunk_tokens", 0),
     "meta.text.chunk_tokens is 0, not a whole number >= 1"),
    (lambda r: r["rows"][1].__setitem__("codec", 8), "rows[1].codec is 8, not a text"),
    (lambda r: r["rows"].pop(0), "no row is the f32 reference"),
])
def test_frontier_readers_check_the_fields_they_use(tmp_path, capsys, change, field):
    from kvquant_experiments import codec_ablation
    bad = _result_file(tmp_path, change)
    picks = tmp_path / "c.json"
    for argv in (["--choose-from", str(bad), "--choices-out", str(picks)],
                 ["--plot-only", str(bad), "--out", str(tmp_path / "o")], ["--goals", str(bad)]):
        assert frontier.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("frontier: ") and err.count("\n") == 1, (argv, err)
        assert f"{bad} is not a frontier result of this version: {field}" in err, (argv, err)
    assert not picks.exists()
    # the ablation reads the runs with the frontier's reader
    assert codec_ablation.main([str(TUNE_RUN), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("codec_ablation: ") and err.count("\n") == 1 and field in err, err


def _returns_within(seconds, call):
    """``call()``'s value, or a failure when it has not returned after ``seconds`` (a read
    that waits for a FIFO's writer; the thread is left blocked, as a daemon)."""
    import threading
    box = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"still running after {seconds} s"
    return box[0]


def test_frontier_readers_refuse_a_fifo_before_reading_it(tmp_path, capsys):
    """A FIFO given for a result or a choices file hung every reader; it is refused by name."""
    import os
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    choices = tmp_path / "choices.json"
    choices.write_text((RESULTS / "frontier-choices.json").read_text())
    for argv in (["--choose-from", str(fifo), "--choices-out", str(tmp_path / "c.json")],
                 ["--goals", str(fifo)], ["--plot-only", str(fifo)],
                 ["--choices", str(fifo), "--list"],
                 ["--choices", str(choices), "--evidence", str(fifo)]):
        assert _returns_within(30, lambda: frontier.main(argv)) == 2, argv
        err = capsys.readouterr().err
        assert err == f"frontier: {fifo} is a FIFO, not a JSON file: give a regular file\n", err


@pytest.mark.parametrize("pick, field", [
    ({"pair": 7, "bits": 4.4, "tune_text": "pydoc"}, '["4.5"].pair is 7, not a text'),
    ({"pair": "tq4/tq4", "bits": "4.4", "tune_text": "pydoc"},
     '["4.5"].bits is \'4.4\', not a number'),
    ({"pair": "tq4/tq4", "bits": 4.4, "tune_text": ["pydoc"]},
     '["4.5"].tune_text is [\'pydoc\'], not a text'),
])
def test_a_choices_file_with_a_field_of_another_type_is_named(tmp_path, capsys, pick, field):
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"4.5": pick}))
    assert frontier.main(["--choices", str(path), "--list"]) == 2
    err = capsys.readouterr().err
    assert err == f"frontier: {path} is not a choices file of this version: {field}\n", err
    path.write_text(json.dumps({"nan": pick}))
    with pytest.raises(ValueError, match="key 'nan' is not a budget"):
        frontier_picks.load_choices(path)


def test_what_the_frontier_writes_its_readers_take(tmp_path, capsys):
    """The checks take every field as a run writes it (a run of the picks too), and the
    committed results."""
    pytest.importorskip("gguf")
    from test_llama_gguf import write_tiny_llama
    from kvquant.models.gguf_decoder import GGUFDecoder
    from kvquant_experiments import texts
    write_tiny_llama(tmp_path / "tiny-llama.gguf")
    tiny_llama = GGUFDecoder(str(tmp_path / "tiny-llama.gguf"))
    text = tmp_path / "notes.txt"
    text.write_text(texts.pydoc_text()[:400], encoding="utf-8")
    result = frontier.run_frontier(["tq4", "polar4@center,sinks=1/polar3"], positions=64,
                                   chunk_tokens=32, prompts=1, model=tiny_llama.path,
                                   loaded=tiny_llama, text=str(text))
    result["meta"]["frontier"]["choices"] = {"4.5": {
        "pair": "tq4", "bits": 4.5, "tune_text": "pydoc", "model": "smollm2",
        "tune_kld_mean": 0.01, "from": "a run"}}
    path = frontier.write_frontier(result, tmp_path / "run")[0]
    assert frontier.read_result(path)["rows"] == json.loads(open(path).read())["rows"]
    assert frontier.main(["--goals", path]) == 0 and "<= 4.5" in capsys.readouterr().out
    for committed in [TUNE_RUN, *TUNE_MORE, *RESULTS.glob("frontier-choices-*.json")]:
        frontier.read_result(committed)
    frontier_picks.load_choices(RESULTS / "frontier-choices.json")
