"""Where commands write: a bad --out is refused before any work (the work would be lost at its
end), and result files are replaced atomically (a failure mid-write leaves the old file)."""
import errno
import os

import pytest

from _experiments_env import ensure_importable

ensure_importable()

from kvquant import cli  # noqa: E402
from kvquant.outputs import atomic_write, check_out_dir, check_out_file  # noqa: E402


def _no_work(*args, **kwargs):
    raise AssertionError("the work started before --out was checked")


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "taken"
    path.write_text("keep me\n")
    return path


@pytest.fixture
def unwritable():
    """A folder nobody may create, root included."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    return "/proc/kvquant-no-such-folder"


def _refused(capsys, argv, *needles):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_flips_checks_out_before_the_run(monkeypatch, capsys, a_file):
    from kvquant_experiments import flip_command
    monkeypatch.setattr(flip_command, "run_flips", _no_work)
    _refused(capsys, ["flips", "--model", "tiny-mla", "--out", str(a_file)],
             "kvquant flips", "--out", "not a folder")
    assert a_file.read_text() == "keep me\n"


def test_dump_kv_checks_out_before_loading_the_model(monkeypatch, capsys, a_file, tmp_path):
    import kvquant.models
    monkeypatch.setattr(kvquant.models, "load_model", _no_work)
    _refused(capsys, ["dump-kv", "--out", str(tmp_path)], "kvquant dump-kv", "is a folder")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused(capsys, ["dump-kv", "--out", str(fifo)], "not a regular file")
    _refused(capsys, ["dump-kv", "--out", str(a_file / "x.npz")], "not a folder")


def test_dump_kv_and_codebooks_where_nothing_can_be_created(monkeypatch, capsys, unwritable):
    import kvquant.models
    monkeypatch.setattr(kvquant.models, "load_model", _no_work)
    _refused(capsys, ["dump-kv", "--out", unwritable + "/rows.npz"], "cannot create the folder")
    from kvquant.codebooks import store
    monkeypatch.setattr(store, "regenerate", _no_work)
    with pytest.raises(SystemExit):
        cli.main(["codebooks", "fit", "--dist", "gaussian", "--bits", "2", "--out", unwritable])
    assert "cannot create the folder" in capsys.readouterr().err


def test_bench_checks_out_before_timing(monkeypatch, capsys, a_file):
    from kvquant_experiments.bench import attention_step
    monkeypatch.setattr(attention_step, "run", _no_work)
    _refused(capsys, ["bench", "--codecs", "kv8", "--dims", "64", "--contexts", "64",
                      "--out", str(a_file)], "kvquant bench", "not a folder")


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_flips_on_a_full_disk_keeps_its_units_and_the_same_command_resumes(
        monkeypatch, capsys, tmp_path):
    """The results cannot be written after the run (a full disk): one line naming the folder
    and the units kept in it, exit 2 (was a traceback); the same command then resumes."""
    from kvquant_experiments import flip_command
    out = tmp_path / "D"
    argv = ["flips", "--model", "tiny-mla", "--codecs", "kv8", "--workers", "1", "--quiet",
            "--json", "--out", str(out)]
    real = flip_command.write_results
    monkeypatch.setattr(flip_command, "write_results", _disk_full)
    _refused(capsys, argv, f"kvquant flips: cannot write the results in {out}",
             "No space left on device", f"finished unit(s) are kept in {out / '.flips-units'}",
             "run the same command to resume")
    units = sorted(os.listdir(out / ".flips-units"))
    assert units
    monkeypatch.setattr(flip_command, "write_results", real)
    argv.remove("--quiet")
    assert cli.main(argv) == 0
    assert f"{len(units)} finished unit(s) reused" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["flips-tiny-mla-p1.csv", "flips-tiny-mla-p1.json"]


def test_bench_on_a_full_disk_is_one_line_after_the_timing(monkeypatch, capsys, tmp_path):
    """The write after the timing fails (a full disk): one line naming the folder and saying
    the timing is lost, exit 2 (was a traceback)."""
    from kvquant_experiments.bench import attention_step
    monkeypatch.setattr(attention_step, "run", lambda *a, **k: {"rows": [], "simd": "scalar"})
    monkeypatch.setattr(attention_step, "atomic_write", _disk_full)
    _refused(capsys, ["bench", "--codecs", "kv8", "--dims", "64", "--contexts", "64",
                      "--threads", "1", "--json", "--out", str(tmp_path)],
             "kvquant bench: cannot write the results in " + str(tmp_path),
             "No space left on device", "the timing is lost", "--out")


def test_codebooks_fit_checks_out_before_fitting(monkeypatch, capsys, a_file):
    from kvquant.codebooks import store
    monkeypatch.setattr(store, "regenerate", _no_work)
    with pytest.raises(SystemExit) as exc:      # argparse's parser.error: exit 2, usage + line
        cli.main(["codebooks", "fit", "--dist", "gaussian", "--bits", "2",
                  "--out", str(a_file)])
    assert exc.value.code == 2
    assert "not a folder" in capsys.readouterr().err


def test_the_checks_name_what_is_wrong(tmp_path, a_file):
    assert check_out_dir(tmp_path / "new" / "deeper").is_dir()         # created
    with pytest.raises(ValueError, match="--out .* exists and is not a folder"):
        check_out_dir(a_file)
    with pytest.raises(ValueError, match="--figure .* is a folder"):
        check_out_file(tmp_path, arg="--figure")
    assert check_out_file(a_file) == a_file          # an existing file is replaced at the end
    with pytest.raises(ValueError, match="cannot create the folder"):
        check_out_dir(a_file / "below")


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "result.json"
    atomic_write(path, lambda f: f.write("old\n"))

    def half_then_fail(f):
        f.write("new but only ha")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_flips_results_are_replaced_whole(tmp_path, monkeypatch):
    """A flips run's files written twice, the second write failing inside the CSV: the first
    run's files are intact (the old code rewrote them in place: a 0-byte or truncated file)."""
    from kvquant_experiments import flip_files, flip_runs
    result = flip_runs.run_flips("tiny-mla", codecs=["kv8"], n_prompts=1, workers=1)
    paths = flip_files.write_results(result, tmp_path, figure=False)
    before = {p: open(p, "rb").read() for p in paths}

    def fail(f, rows):
        f.write("codec,")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(flip_files, "_write_rows_csv", fail)
    with pytest.raises(OSError):
        flip_files.write_results(result, tmp_path, figure=False)
    assert {p: open(p, "rb").read() for p in paths} == before
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths)
