"""``kvquant tasks``: the table, the item logs that resume, and inputs refused before any work."""
import json
import os
import sys

import pytest

from kvquant.cli import main

sys.path.insert(0, os.path.dirname(__file__))
from kvquant.models.random_gguf import write_random_gguf  # noqa: E402

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("kvquant_experiments")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("task_runs")
    model = root / "llama.gguf"
    write_random_gguf(model, "llama", seed=7)
    task = root / "mine.jsonl"
    rows = [{"context": f"item {i} is", "choices": ["a b", "c", "d e f"], "gold": i % 3}
            for i in range(7)]
    task.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(model), str(task)


def _run(capsys, *argv):
    status = main(["tasks", *argv, "--workers", "1", "--quiet"])
    out = capsys.readouterr()
    return status, out.out, out.err


def _lines(path):
    return path.read_text().splitlines()


def _items(lines):
    """The item records of a log's lines after its header (timing records left out)."""
    return [r for r in map(json.loads, lines) if r.get("kind") != "timing"]


def test_table_logs_and_resume(setup, tmp_path, capsys):
    model, task = setup
    out = tmp_path / "run"
    status, text, err = _run(capsys, "--model", model, "--task", task, "--limit", "4",
                             "--codecs", "f32,tq4", "--out", str(out))
    assert status == 0, err
    assert "| `tq4` |" in text and "(reference)" in text and "McNemar" in text
    summary = json.loads((out / "summary-n4.json").read_text())
    rows = {r["spec"]: r for r in summary["rows"]}
    # tq4 on rows of 16: 4 bits a value + one f32 radius a row
    assert rows["f32"]["acc"]["n"] == 4 and rows["tq4"]["bits_per_value"] == 4 + 32 / 16
    assert rows["f32"]["bits_per_value"] == 32
    assert rows["tq4"]["paired"]["acc_norm"]["n"] == 4
    assert "verdict" in rows["tq4"]
    log = out / "tq4.jsonl"
    header = json.loads(_lines(log)[0])
    records = _items(_lines(log)[1:])
    assert header["kind"] == "header" and header["spec"] == "tq4"
    assert [r["doc_id"] for r in records] == [0, 1, 2, 3]
    assert all(len(r["lls"]) == 3 for r in records)
    timings = [json.loads(x) for x in _lines(log)[1:] if '"kind": "timing"' in x]
    assert sum(t["items"] for t in timings) == 4 and all(t["seconds"] > 0 for t in timings)
    speed = rows["tq4"]["items_per_s"]
    assert rows["tq4"]["timed_items"] == 4 and speed > 0

    # a rerun computes nothing: the logs are unchanged, and the summary it writes again keeps
    # the throughput of the blocks the logs timed
    before = log.read_bytes()
    status, _, _ = _run(capsys, "--model", model, "--task", task, "--limit", "4", "--codecs",
                        "f32,tq4", "--out", str(out))
    assert status == 0 and log.read_bytes() == before
    again = {r["spec"]: r for r in json.loads((out / "summary-n4.json").read_text())["rows"]}
    assert again["tq4"]["items_per_s"] == speed and again["tq4"]["timed_items"] == 4

    # a killed write left half a line: it is dropped, the item scored again, nothing else lost
    log.write_bytes(before + b'{"task": "x", "doc_')
    status, _, err = _run(capsys, "--model", model, "--task", task, "--limit", "6", "--codecs",
                          "f32,tq4", "--out", str(out),
                          "--plot-beside", str(out / "summary-n4.json"))
    assert status == 0 and "incomplete last line" in err
    assert log.read_bytes().startswith(before)
    records = _items(_lines(log)[1:])
    assert sorted(r["doc_id"] for r in records) == list(range(6))
    assert (out / "summary-n6.json").is_file() and (out / "summary-n4.json").is_file()
    # the first four items are the n=4 run's, untouched
    assert records[:4] == _items(before.decode().splitlines()[1:])


def test_a_log_of_another_run_is_refused(setup, tmp_path, capsys):
    model, task = setup
    out = tmp_path / "run"
    out.mkdir()
    (out / "tq4.jsonl").write_text(json.dumps({"kind": "header", "version": 1, "model": "other",
                                               "backend": "numpy", "task": task,
                                               "num_fewshot": 0, "spec": "tq4"}) + "\n")
    status, _, err = _run(capsys, "--model", model, "--task", task, "--limit", "2", "--codecs",
                          "tq4", "--out", str(out))
    assert status == 2 and "was written for another run (model differ" in err
    assert "--fresh" in err


@pytest.mark.parametrize("argv,message", [
    (["--codecs", "tq4,nonsense9"], "nonsense9"),
    (["--task", "hellaswg"], "unknown task 'hellaswg'"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--num-fewshot", "2"], "no few-shot split"),
    (["--plot-beside", "no-such-summary.json"], "--plot-beside no-such-summary.json"),
])
def test_bad_inputs_are_refused_before_any_work(setup, tmp_path, capsys, argv, message):
    model, task = setup
    out = tmp_path / "never"
    base = ["--model", model, "--task", task, "--codecs", "f32", "--out", str(out)]
    for i in range(0, len(argv), 2):        # the case's options replace the defaults
        j = base.index(argv[i]) if argv[i] in base else None
        if j is None:
            base += argv[i:i + 2]
        else:
            base[j + 1] = argv[i + 1]
    status, _, err = _run(capsys, *base)
    assert status == 2 and message in err, err
    assert not list(out.glob("*.jsonl")) if out.exists() else True


def test_out_that_is_a_file_is_refused(setup, tmp_path, capsys):
    model, task = setup
    target = tmp_path / "a-file"
    target.write_text("keep me")
    status, _, err = _run(capsys, "--model", model, "--task", task, "--out", str(target))
    assert status == 2 and "is not a folder" in err
    assert target.read_text() == "keep me"


def test_a_full_disk_at_the_summary_is_one_line_and_keeps_the_logs(setup, tmp_path, capsys,
                                                                    monkeypatch):
    """The summary's files fail to write (a full disk): one line naming the folder, exit 2,
    the item logs kept and no temp file left (the .md went through a fixed .md.tmp name,
    left behind, and the failure was a traceback after the run)."""
    from kvquant_experiments import task_runs
    model, task = setup
    out = tmp_path / "run"

    def full_disk(path, write, binary=False):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(task_runs, "atomic_write", full_disk)
    status, _, err = _run(capsys, "--model", model, "--task", task, "--limit", "2",
                          "--codecs", "f32", "--out", str(out))
    assert status == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"kvquant tasks: writing the summary in {out} failed (No space left on device); the "
        "item logs there hold every item scored: free space and rerun the same command to "
        "write it")
    assert len(_items(_lines(out / "f32.jsonl")[1:])) == 2
    assert not list(out.glob("*.tmp"))
    monkeypatch.undo()
    status, text, err = _run(capsys, "--model", model, "--task", task, "--limit", "2",
                             "--codecs", "f32", "--out", str(out))
    assert status == 0 and (out / "summary-n2.md").is_file()


def _token_type_count_claiming(src, dst, count):
    """``src`` with the length of tokenizer.ggml.token_type set to ``count``."""
    import struct
    blob = bytearray(src.read_bytes())
    key = b"tokenizer.ggml.token_type"
    at = blob.index(key) + len(key) + 4 + 4          # value type, item type: the length
    blob[at:at + 8] = struct.pack("<Q", count)
    dst.write_bytes(bytes(blob))


@pytest.mark.parametrize("arch, damage, message", [
    # the gguf package's reader under transformers: a struct.error traceback
    ("llama", lambda src, dst: _token_type_count_claiming(src, dst, 1 << 40),
     "an array of 1099511627776 items"),
    # transformers' GGUF tokenizer conversion: an IndexError traceback
    ("gemma3", lambda src, dst: dst.write_bytes(src.read_bytes().replace(
        b"tokenizer.ggml.unknown_token_id\x04\x00\x00\x00\x03\x00\x00\x00",
        b"tokenizer.ggml.unknown_token_id\x04\x00\x00\x00\x40\x42\x0f\x00")),
     "tokenizer.ggml.unknown_token_id is 1000000"),
])
def test_a_damaged_gguf_file_on_the_hf_backend_is_one_line(setup, tmp_path, capsys, arch,
                                                           damage, message):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _, task = setup
    src = tmp_path / "ok.gguf"
    write_random_gguf(src, arch)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    damage(src, folder / "bad.gguf")
    assert (folder / "bad.gguf").read_bytes() != src.read_bytes()
    status, _, err = _run(capsys, "--backend", "hf", "--model", str(folder), "--gguf-file",
                          "bad.gguf", "--task", task, "--limit", "2", "--codecs", "f32",
                          "--out", str(tmp_path / "run"))
    assert status == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"kvquant tasks: {folder / 'bad.gguf'}: ") and message in line


def test_a_group_limit_applies_to_each_member(setup, tmp_path, capsys, monkeypatch):
    # lm-eval's --limit on a group (MMLU) takes the first N documents of every subtask; the
    # run must score exactly those, not N x members documents of each
    import kvquant.tasks.requests as requests
    model, task = setup
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"context": f"other {i} is", "choices": ["x", "y z"],
                                           "gold": i % 2}) for i in range(5)) + "\n")
    monkeypatch.setitem(requests.TASK_GROUPS, "pair", (task, str(other)))
    out = tmp_path / "group"
    status, text, err = _run(capsys, "--model", model, "--task", "pair", "--limit", "2",
                             "--codecs", "f32", "--out", str(out))
    assert status == 0, err
    records = _items(_lines(out / "f32.jsonl")[1:])
    per_task = {}
    for r in records:
        per_task.setdefault(r["task"], []).append(r["doc_id"])
    assert sorted(map(sorted, per_task.values())) == [[0, 1], [0, 1]]
    summary = json.loads((out / "summary-n4.json").read_text())
    assert summary["meta"]["member_limit"] == 2
    assert "first 2 documents of each of its 2 subtasks" in summary["meta"]["items_note"]


def test_a_serial_run_writes_each_block_as_it_finishes(setup, tmp_path, capsys, monkeypatch):
    """One process (--workers 1): a block is in the log before the next one is scored, so a
    run stopped midway keeps what it finished (it once scored every block before writing)."""
    from kvquant_experiments import task_runs
    model, task = setup
    monkeypatch.setattr(task_runs, "BLOCK_ITEMS", 2)
    real, calls = task_runs.score_block, []

    def second_block_fails(cell):
        calls.append(cell["indices"])
        if len(calls) == 2:
            raise KeyboardInterrupt   # as Ctrl-C in the middle of the run
        return real(cell)

    monkeypatch.setattr(task_runs, "score_block", second_block_fails)
    out = tmp_path / "run"
    status, _, _ = _run(capsys, "--model", model, "--task", task, "--limit", "6", "--codecs",
                        "f32", "--out", str(out))
    assert status == 130 and calls == [[0, 1], [2, 3]]
    assert [r["doc_id"] for r in _items(_lines(out / "f32.jsonl")[1:])] == [0, 1]
    # the rerun scores only what is missing
    monkeypatch.setattr(task_runs, "score_block", real)
    status, _, err = _run(capsys, "--model", model, "--task", task, "--limit", "6",
                          "--codecs", "f32", "--out", str(out))
    assert status == 0, err
    assert [r["doc_id"] for r in _items(_lines(out / "f32.jsonl")[1:])] == list(range(6))


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")
def test_sigterm_stops_the_run_and_its_workers(setup, tmp_path):
    """`kill` of a `kvquant tasks` run with worker processes: it stops as Ctrl-C stops it (one
    line, status 143, its finished blocks kept) and its workers stop with it (they once went on
    computing blocks nobody would read)."""
    import subprocess
    import time
    model, _ = setup
    task = tmp_path / "long.jsonl"
    rows = [{"context": f"item {i} is", "choices": ["a b", "c", "d e f"], "gold": i % 3}
            for i in range(3000)]
    task.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kvquant.cli", "tasks", "--model", model,
                             "--task", str(task), "--codecs", "f32,tq4,kv8", "--workers", "2",
                             "--quiet", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        log = out / "f32.jsonl"
        while time.time() < deadline and not (log.exists() and len(_lines(log)) > 1):
            time.sleep(0.2)
        assert log.exists(), "the run wrote no block"
        workers = _children(proc.pid)
        assert workers, "no worker processes"
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "interrupted" in err and "Traceback" not in err, err
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)
    assert len(_lines(log)) > 1   # the finished blocks are kept


def test_task_panel_points_at_the_same_bits_are_drawn_apart():
    import math
    from kvquant_experiments.plots import TASK_DODGE, free_slot
    placed = []
    for bits in [8.5, 8.5, 8.5, 7.79, 4.5, 32.0]:
        placed.append(free_slot(bits, placed))
    assert placed[0] == 8.5 and placed[4] == 4.5 and placed[5] == 32.0    # alone: where they are
    for i, a in enumerate(placed):
        for b in placed[:i]:
            assert abs(math.log(a / b)) >= math.log1p(TASK_DODGE) * 0.999
    # the crowded ones stay as near their own bits as the room allows
    assert all(abs(math.log(p / 8.5)) <= 2.01 * math.log1p(TASK_DODGE) for p in placed[:3])
