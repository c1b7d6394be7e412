"""The command line the studies share (kvquant_experiments.study), run against the real studies:
one parser and help formatter, ``--out`` checked before any work, one-line errors with exit
status 2, Ctrl-C as one line with exit status 130 saying whether the command resumes."""
import argparse
import importlib
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _experiments_env import ensure_importable  # noqa: E402

ensure_importable()

from kvquant.cli import DefaultsHelpFormatter, OneLineErrorParser, Terminated  # noqa: E402
from kvquant_experiments import study  # noqa: E402

# module -> arguments that satisfy its parser, with OUT where --out goes (None: no --out)
STUDIES = {
    "passkey": ["--configs", "f32", "--out", "OUT"],
    "sensitivity": ["--base", "polar4/polar3", "--out", "OUT"],
    "polar_widths": ["--dim", "16", "--out", "OUT"],
    "allocate": ["--scan", "scan.json", "--budget", "3.5", "--out", "OUT"],
    "calibrate": ["compare", "--calibration", "cal.npz", "--out", "OUT"],
    "codec_ablation": ["run.json"],
    "probes": ["--out", "OUT"],
    "frontier": ["--out", "OUT"],
    "codecs.channel_split": ["plan", "--calibration", "cal.npz", "--k", "tq2", "--v", "tq2",
                             "--out", "OUT.json"],
}
# what --out names: a folder, or a file (calibrate measure: the .npz; channel_split: a new plan)
FOLDER_OUT = [m for m, argv in STUDIES.items() if "OUT" in argv]
FILE_OUT = {"calibrate": ["measure", "--out", "OUT"], "codecs.channel_split":
            STUDIES["codecs.channel_split"]}
RESUMING = {"passkey", "sensitivity", "frontier"}


def _module(name):
    return importlib.import_module(f"kvquant_experiments.{name}")


def _argv(argv, out):
    return [str(out) if a in ("OUT", "OUT.json") else a for a in argv]


@pytest.fixture
def no_run(monkeypatch):
    """Replace a study's run with one that records the call (the check must come first)."""
    calls = []

    def install(module):
        monkeypatch.setattr(module, "run", lambda args, progress: calls.append(args) or 0)
        return calls
    return install


def _one_line(err, prefix):
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(prefix), err
    assert "Traceback" not in err
    return err.strip()


@pytest.mark.parametrize("name", FOLDER_OUT)
def test_an_out_that_is_a_file_fails_before_the_run(name, tmp_path, capsys, no_run):
    module = _module(name)
    calls = no_run(module)
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    assert module.main(_argv(STUDIES[name], taken)) == 2
    line = _one_line(capsys.readouterr().err, f"{name.rsplit('.', 1)[-1]}: --out {taken}")
    if name == "codecs.channel_split":     # a new plan file: an existing one is never replaced
        assert "exists and is not overwritten" in line
    else:
        assert "exists and is not a folder" in line
    assert calls == []
    assert taken.read_text() == "not a folder"


@pytest.mark.parametrize("name", FOLDER_OUT)
def test_an_out_that_cannot_be_created_fails_before_the_run(name, tmp_path, capsys, no_run):
    module = _module(name)
    calls = no_run(module)
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "sub" / "x.json"     # under a file: no folder can be made there
    assert module.main(_argv(STUDIES[name], out if "OUT.json" in STUDIES[name]
                             else blocker / "sub")) == 2
    line = _one_line(capsys.readouterr().err, f"{name.rsplit('.', 1)[-1]}: --out ")
    assert "cannot create the folder" in line
    assert calls == []


@pytest.mark.parametrize("name", FILE_OUT)
def test_a_file_out_that_is_a_folder_fails_before_the_run(name, tmp_path, capsys, no_run):
    module = _module(name)
    calls = no_run(module)
    assert module.main(_argv(FILE_OUT[name], tmp_path)) == 2
    line = _one_line(capsys.readouterr().err, f"{name.rsplit('.', 1)[-1]}: --out {tmp_path}")
    assert "folder" in line
    assert calls == []


@pytest.mark.parametrize("name", FOLDER_OUT)
def test_a_writable_out_is_made_and_then_the_study_runs(name, tmp_path, no_run):
    module = _module(name)
    calls = no_run(module)
    out = tmp_path / "new" / ("plan.json" if "OUT.json" in STUDIES[name] else "run")
    assert module.main(_argv(STUDIES[name], out)) == 0
    assert len(calls) == 1
    folder = out.parent if "OUT.json" in STUDIES[name] else out
    assert folder.is_dir() and not any(folder.iterdir())   # made and probed, nothing left in it


@pytest.mark.parametrize("name, argv", [
    ("passkey", ["--seed", "x"]),
    ("sensitivity", ["--base", "kv8", "--positions", "many"]),
    ("polar_widths", ["--rows", "1e4"]),
    ("allocate", ["--scan", "s.json", "--budget", "three", "--out", "o"]),
    ("calibrate", ["measure", "--out", "o.npz", "--positions", "1.5"]),
    ("probes", ["--chunk-tokens", "x"]),
    ("frontier", ["--prompts", "four"]),
    ("codecs.channel_split", ["plan", "--calibration", "c", "--k", "a", "--v", "b", "--out",
                              "o", "--k-count", "half"]),
])
def test_a_bad_number_is_one_line_and_exit_2(name, argv, capsys, no_run):
    module = _module(name)
    calls = no_run(module)
    assert module.main(argv) == 2
    sub = f" {argv[0]}" if not argv[0].startswith("-") else ""     # a subcommand names itself
    line = _one_line(capsys.readouterr().err, f"python -m kvquant_experiments.{name}{sub}: error: ")
    assert "invalid" in line
    assert calls == []


@pytest.mark.parametrize("name, argv, words", [
    ("passkey", ["--lengths", "4096,lots", "--list"], "--lengths takes comma-separated numbers"),
    ("polar_widths", ["--dim", "17"], "--dim must be a power of two"),
    ("polar_widths", ["--bits", "9"], "--bits must be in 2..6"),
    ("sensitivity", ["--base", "kv8", "--step", "0"], "--step must not be 0"),
    ("probes", ["--ideas", "fp8,telepathy", "--list"], "unknown ideas ['telepathy']"),
])
def test_a_bad_value_is_one_line_and_exit_2(name, argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _module(name).main(argv) == 2
    line = _one_line(capsys.readouterr().err, f"{name}: ")
    assert words in line
    assert not any(tmp_path.iterdir())      # refused before any folder was made


@pytest.mark.parametrize("name", STUDIES)
def test_ctrl_c_is_one_line_saying_whether_the_command_resumes(name, tmp_path, capsys,
                                                               monkeypatch):
    module = _module(name)

    def interrupted(args, progress):
        raise KeyboardInterrupt
    monkeypatch.setattr(module, "run", interrupted)
    assert module.main(_argv(STUDIES[name], tmp_path / "out")) == 130
    line = _one_line(capsys.readouterr().err, f"{name.rsplit('.', 1)[-1]}: interrupted; ")
    if name in RESUMING:
        assert line.endswith("rerun the same command to resume")
    else:
        assert line.endswith("the same command starts over")


def test_sigterm_is_143_and_an_interruption_may_say_what_it_kept(tmp_path, capsys,
                                                                 monkeypatch):
    from kvquant_experiments import passkey

    def terminated(args, progress):
        raise Terminated()
    monkeypatch.setattr(passkey, "run", terminated)
    assert passkey.main(["--out", str(tmp_path)]) == 143
    assert _one_line(capsys.readouterr().err, "passkey: terminated (SIGTERM); ").endswith(
        "rerun the same command to resume")

    def with_note(args, progress):
        raise KeyboardInterrupt("3 prompts kept in X")
    monkeypatch.setattr(passkey, "run", with_note)
    assert passkey.main(["--out", str(tmp_path)]) == 130
    assert _one_line(capsys.readouterr().err, "passkey: ") == "passkey: interrupted; 3 prompts " \
                                                              "kept in X"


def test_frontier_says_how_many_finished_units_an_interrupted_run_kept(tmp_path, capsys,
                                                                        monkeypatch):
    from kvquant_experiments import frontier

    def stopped(*args, units=None, **kwargs):
        units.bind({"run": "test"})
        units.put(units.key("chunk", {"i": 0}), {"kld": 1.0})
        raise KeyboardInterrupt
    monkeypatch.setattr(frontier, "run_frontier", stopped)
    assert frontier.main(["--out", str(tmp_path), "--configs", "kv8"]) == 130
    line = _one_line(capsys.readouterr().err, "frontier: interrupted; ")
    assert f"1 finished unit(s) are saved in {tmp_path / frontier.UNITS_FOLDER}" in line
    assert line.endswith("rerun the same command to resume")
    assert len(list((tmp_path / frontier.UNITS_FOLDER).iterdir())) == 1


def test_frontier_results_that_cannot_be_written_keep_the_units(tmp_path, capsys,
                                                               monkeypatch):
    """A full disk after the run: one line naming the folder and the units it kept (was the
    bare OSError, which did not say that the same command resumes)."""
    import errno
    from kvquant_experiments import frontier

    def measured(*args, units=None, **kwargs):
        units.bind({"run": "test"})
        units.put(units.key("chunk", {"i": 0}), {"kld": 1.0})
        return {"meta": {"text": {"positions": 1}}}

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(frontier, "run_frontier", measured)
    monkeypatch.setattr(frontier, "result_stem", lambda result: "stem")
    monkeypatch.setattr(frontier, "write_frontier", disk_full)
    assert frontier.main(["--out", str(tmp_path), "--configs", "kv8"]) == 2
    line = _one_line(capsys.readouterr().err, "frontier: cannot write the results in ")
    assert "No space left on device" in line
    assert f"1 finished unit(s) are kept in {tmp_path / frontier.UNITS_FOLDER}" in line
    assert line.endswith("run the same command to resume")
    assert len(list((tmp_path / frontier.UNITS_FOLDER).iterdir())) == 1


@pytest.mark.parametrize("argv", [["--goals", "RUN"], ["--choose-from", "RUN"],
                                  ["--plot-only", "RUN"], ["--list"]])
def test_an_interrupted_frontier_mode_that_measures_nothing_does_not_say_resume(
        argv, tmp_path, capsys, monkeypatch):
    """The frontier's modes that only read results (or list): Ctrl-C says the same command
    starts over (it said "rerun the same command to resume": there is nothing to resume)."""
    import kvquant.models
    from kvquant_experiments import frontier, frontier_picks

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(frontier, "read_result", interrupted)
    monkeypatch.setattr(kvquant.models, "load_model", interrupted)     # --list
    monkeypatch.setattr(frontier_picks, "load_choices", interrupted)
    monkeypatch.chdir(tmp_path)
    assert frontier.main([a.replace("RUN", "run.json") for a in argv]) == 130
    line = _one_line(capsys.readouterr().err, "frontier: interrupted; ")
    assert line.endswith(f"{argv[0]} measures nothing and keeps nothing to resume: the same "
                         "command starts over"), line


@pytest.mark.parametrize("error, status", [(ValueError("bad input"), 2),
                                           (OSError("disk gone"), 2)])
@pytest.mark.parametrize("name", STUDIES)
def test_expected_errors_are_one_line_and_exit_2(name, error, status, tmp_path, capsys,
                                                 monkeypatch):
    module = _module(name)

    def failing(args, progress):
        raise error
    monkeypatch.setattr(module, "run", failing)
    assert module.main(_argv(STUDIES[name], tmp_path / "out")) == status
    assert _one_line(capsys.readouterr().err, "") == f"{name.rsplit('.', 1)[-1]}: {error}"


def test_a_study_names_its_own_expected_errors_and_bugs_stay_visible(tmp_path, capsys,
                                                                     monkeypatch):
    from kvquant_experiments import frontier, polar_widths

    def missing_extra(args, progress):
        raise ImportError("the models extra is not installed")
    monkeypatch.setattr(frontier, "run", missing_extra)
    assert frontier.main(["--out", str(tmp_path)]) == 2
    assert _one_line(capsys.readouterr().err, "frontier: ").endswith("not installed")
    # polar_widths has no optional extra: an ImportError there is a bug, not a message
    monkeypatch.setattr(polar_widths, "run", missing_extra)
    with pytest.raises(ImportError):
        polar_widths.main(["--out", str(tmp_path)])

    def bug(args, progress):
        raise RuntimeError("a bug")
    monkeypatch.setattr(frontier, "run", bug)
    with pytest.raises(RuntimeError):
        frontier.main(["--out", str(tmp_path)])


@pytest.mark.parametrize("name", ["passkey", "sensitivity", "probes", "frontier"])
def test_progress_lines_are_stamped_and_quiet_silences_them(name, tmp_path, capsys,
                                                            monkeypatch):
    module = _module(name)
    monkeypatch.setattr(module, "run", lambda args, progress: progress("half way"))
    argv = _argv(STUDIES[name], tmp_path)
    assert module.main(argv) == 0
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] half way\n", capsys.readouterr().err)
    assert module.main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_has_the_same_parser_and_help(name, capsys):
    module = _module(name)
    parser = study.build_parser(module)
    for p in _parsers(parser):
        assert isinstance(p, OneLineErrorParser), p.prog
        assert p.formatter_class is DefaultsHelpFormatter, p.prog
    assert parser.prog == f"python -m kvquant_experiments.{name}"
    summary = " ".join(module.__doc__.strip().split("\n\n")[0].split())
    assert parser.description == summary
    assert module.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m kvquant_experiments.{name} ")
    for p in list(_parsers(parser))[1:]:       # each subcommand's help too
        sub = p.prog.rsplit(" ", 1)[-1]
        assert module.main([sub, "--help"]) == 0
        assert capsys.readouterr().out.split()[:len(p.prog.split()) + 1] == [
            "usage:", *p.prog.split()]
    # the formatter shows a default the help does not state
    shown = [a for p in _parsers(parser) for a in p._actions
             if a.help and a.default not in (None, False, argparse.SUPPRESS)
             and "default" not in a.help.lower() and a.option_strings]
    for p in _parsers(parser):
        text = p.format_help()
        for action in shown:
            if action in p._actions:
                assert f"(default: {action.default})" in " ".join(text.split()), \
                    (p.prog, action.dest)


def test_the_command_line_runs_as_a_module(tmp_path):
    """``python -m``: the module runs as __main__ and still names itself as installed."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*ensure_importable(), os.environ.get("PYTHONPATH", "")]))
    taken = tmp_path / "taken"
    taken.write_text("")
    proc = subprocess.run([sys.executable, "-m", "kvquant_experiments.polar_widths", "--out",
                           str(taken)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"polar_widths: --out {taken} exists and is not a folder; give a " \
                          "folder (new or existing)\n"
    proc = subprocess.run([sys.executable, "-m", "kvquant_experiments.codecs.channel_split",
                           "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: python -m kvquant_experiments.codecs.channel_split ")


def test_plans_and_statistics_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Study results written by the library's own savers (allocate's plans, calibrate's
    statistics) go through a temporary file: a failed write leaves the previous file."""
    from kvquant.models.plan import CachePlan
    from kvquant.streams.calibration import StreamStatistics
    scales = np.ones((2, 1, 8), np.float32)
    stats = StreamStatistics({}, {"k": scales})
    path = tmp_path / "cal.npz"
    stats.save(path)
    before = path.read_bytes()

    def torn(f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", torn)
    with pytest.raises(OSError, match="disk full"):
        StreamStatistics({}, {"k": 2 * scales}).save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.npz"]
    monkeypatch.undo()

    plan = CachePlan.uniform("tq4/tq3", 2, 1)
    plan_path = tmp_path / "plan.json"
    plan.save(str(plan_path))
    first = plan_path.read_text()
    import kvquant.models.plan as plan_module

    def failing_write(path, write, binary=False):
        raise OSError("disk full")
    monkeypatch.setattr(plan_module, "atomic_write", failing_write)
    with pytest.raises(OSError):
        CachePlan.uniform("tq2/tq2", 2, 1).save(str(plan_path))
    assert plan_path.read_text() == first
