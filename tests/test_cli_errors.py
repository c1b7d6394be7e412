"""Every bad input to the command line: one line on stderr naming the problem, exit status 2,
no traceback; and output into a closed pipe ends quietly."""
import os
import subprocess
import sys

import numpy as np
import pytest


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kvquant.cli", *args], capture_output=True,
                          text=True, cwd=cwd)


def assert_one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _npy(tmp_path, name, array):
    path = tmp_path / name
    np.save(path, array)
    return str(path)


@pytest.mark.parametrize("make, needles", [
    (lambda d: _npy(d, "ints.npy", np.arange(64).reshape(8, 8)), ("int64", "float32")),
    (lambda d: _npy(d, "empty.npy", np.zeros((0, 64), np.float32)), ("(0, 64)", "one row")),
    (lambda d: _npy(d, "flat.npy", np.zeros(64, np.float32)), ("(64,)", "2-D")),
    (lambda d: _npy(d, "nan.npy", np.where(np.eye(64, dtype=bool)[:4], np.nan, 1.0)
                    .astype(np.float32)), ("kv8", "row")),
])
def test_distortion_bad_data(tmp_path, make, needles):
    res = run("distortion", "--codecs", "kv8", "--data", make(tmp_path))
    assert_one_line_error(res, "kvquant distortion", *needles)


def test_distortion_csv_is_not_a_npy(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("1.0,2.0\n3.0,4.0\n")
    assert_one_line_error(run("distortion", "--data", str(path)), "cannot read", "rows.csv")


@pytest.mark.parametrize("rows", ["0", "-5"])
def test_distortion_rows_must_be_positive(rows):
    assert_one_line_error(run("distortion", "--rows", rows), "--rows must be >= 1", rows)


def test_distortion_dims_must_be_positive():
    assert_one_line_error(run("distortion", "--dim", "0"), "--dim")


@pytest.mark.parametrize("args, needle", [
    (["distortion", "--dim", "x"], "comma-separated integers"),
    (["distortion", "--no-such-flag"], "unrecognized arguments"),
    (["no-such-command"], "invalid choice"),
    (["budget", "--ram"], "expected one argument"),
])
def test_argument_errors_are_one_line(args, needle):
    assert_one_line_error(run(*args), needle, "--help")


def test_output_into_a_closed_pipe_ends_quietly():
    # `kvquant distortion ... | head -0`: the reader is gone before the first line is written
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, "-m", "kvquant.cli", "distortion", "--codecs",
                              "kv8", "--dim", "64", "--rows", "64"],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


@pytest.mark.parametrize("args, needle", [
    (["--prompts", "0"], "prompts must be an integer >= 1, got 0"),
    (["--positions", "-5"], "positions must be an integer >= 0, got -5"),
    (["--chunk-tokens", "0"], "chunk tokens must be an integer >= 1, got 0"),
    (["--workers", "0"], "workers must be an integer >= 1, got 0"),
    (["--text", "no-such-file.txt"], "no-such-file.txt"),
    (["--codecs", "tq4,nosuch9"], "nosuch9"),
    (["--prompts", "x"], "invalid int value"),
])
def test_flips_bad_counts_and_names(tmp_path, args, needle):
    res = run("flips", "--model", "tiny-mla" if args[0] == "--codecs" else "smollm2", *args,
              cwd=tmp_path)
    assert_one_line_error(res, needle)
    assert list(tmp_path.iterdir()) == []          # nothing written


@pytest.mark.parametrize("args, needles", [
    (["distortion", "--codecs", ","], ("names no codec",)),
    (["distortion", "--codecs", ""], ("names no codec",)),
    (["distortion", "--seed", "-1"], ("--seed must be >= 0",)),
    (["distortion", "--dim", "1048576"], ("GiB of float32", "lower --rows or --dim")),
    (["bench", "--warmup-s", "inf"], ("--warmup-s takes a finite",)),
    (["bench", "--warmup-s", "nan"], ("--warmup-s takes a finite",)),
    (["bench", "--warmup-s", "-1"], ("--warmup-s takes a finite",)),
    (["bench", "--cold", "--cache-mib", "inf"], ("--cache-mib takes a positive size",)),
    (["bench", "--contexts", "100000000k"], ("GiB of float32",)),
    (["bench", "--codecs", ","], ("names no codec",)),
    # each list names its own option and rule (both said "a context must be at least 1 token")
    (["bench", "--dims", "0"], ("--dims: a row width must be at least 1",)),
    (["bench", "--threads", "0"], ("--threads: a thread count must be at least 1",)),
    (["bench", "--threads", "two"], ("--threads: cannot read 'two' as a thread count",)),
    # a million threads ran for minutes
    (["bench", "--threads", "1000000"], ("--threads: a thread count must be at most",
                                         "4 per CPU")),
])
def test_numbers_out_of_range_and_empty_lists_are_refused_at_once(args, needles):
    assert_one_line_error(run(*args), *needles)


def test_json_output_is_standard_json(tmp_path):
    """NaN is not JSON: a value without a finite number is null (a strict parser reads it)."""
    import json
    from kvquant.outputs import dumps_strict
    text = dumps_strict({"a": float("nan"), "b": [1.0, float("inf")], "c": np.float64("nan")})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard {c}")) == {
        "a": None, "b": [1.0, None], "c": None}
    res = run("distortion", "--codecs", "kv8", "--dim", "8", "--rows", "4", "--json")
    json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"non-standard {c}"))


@pytest.mark.parametrize("command", ["flips", "tasks", "dump-kv", "report"])
def test_help_texts_show_each_default_once_and_no_doubled_percent(command):
    res = run(command, "--help")
    assert res.returncode == 0, res.stderr
    assert "%%" not in res.stdout
    assert "(default: None)" not in res.stdout and "(default: False)" not in res.stdout
    for block in res.stdout.split("\n  -")[1:]:          # one option's help each
        assert block.lower().count("default") <= 1, block


def _sigint_default():
    """In the child: SIGINT back to its default, so that Python installs its Ctrl-C handler (a
    job started in the background by a non-interactive shell inherits SIGINT ignored)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """SIGINT during a run: "interrupted", status 130, no traceback."""
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-m", "kvquant.cli", "bench", "--codecs", "kv8",
                             "--dims", "64", "--contexts", "4096", "--threads", "1",
                             "--rounds", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default)
    try:
        time.sleep(3)                        # past the imports, inside the work
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()                          # never left running when the test fails
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and err.strip().splitlines() == ["kvquant: interrupted"]


@pytest.mark.parametrize("module, command", [
    ("distortion", "kvquant report"),
    # modules that other commands run: each printed nothing and exited 0
    ("flip_runs", "kvquant flips"),
    ("frontier_picks", "python -m kvquant_experiments.frontier"),
])
def test_python_m_on_a_report_section_says_what_to_run(module, command):
    res = subprocess.run([sys.executable, "-m", f"kvquant_experiments.{module}", "--help"],
                         capture_output=True, text=True)
    assert res.returncode != 0 and command in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def _lying_npy(path, shape):
    """A .npy whose header claims ``shape`` over 256 bytes of data."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": shape})
        f.write(b"\0" * 256)
    return str(path)


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _dump_meta():
    import json
    return np.array(json.dumps({"format": "kvquant-kv-rows/1"}))


@pytest.mark.parametrize("make, needles", [
    (lambda d: _lying_npy(d / "huge.npy", (2 ** 33, 64)), ("cannot read", "huge.npy")),
    (lambda d: (os.mkfifo(d / "rows.npy"), str(d / "rows.npy"))[1], ("is not a file",)),
    (lambda d: (os.mkfifo(d / "rows.npz"), str(d / "rows.npz"))[1], ("is not a file",)),
    (lambda d: _npz(d / "ints.npz", meta=_dump_meta(), k=np.zeros((1, 1, 4, 8), np.int32)),
     ("stream 'k' holds int32",)),
    (lambda d: _npz(d / "list.npz", meta=np.array("[1, 2]"), k=np.zeros((1, 1, 4, 8))),
     ("'meta' entry is not a JSON object",)),
    (lambda d: _npz(d / "strs.npz", meta=np.array(["a", "b"]), k=np.zeros((1, 1, 4, 8))),
     ("'meta' entry is not a JSON string",)),
    (lambda d: _npz(d / "nowidth.npz", meta=_dump_meta(), k=np.zeros((1, 1, 4, 0), np.float32)),
     ("shape (1, 1, 4, 0)", "none of them empty")),     # was numpy's "zero-size array" message
])
def test_distortion_data_files_that_lie_or_block(tmp_path, make, needles):
    res = run("distortion", "--codecs", "kv8", "--data", make(tmp_path))
    assert_one_line_error(res, "kvquant distortion", *needles)


def test_an_npz_member_claiming_more_than_it_holds(tmp_path):
    import zipfile
    path = tmp_path / "lying.npz"
    _lying_npy(tmp_path / "k.npy", (2 ** 33, 1, 1, 64))
    with zipfile.ZipFile(path, "w") as zf:
        import io
        meta = io.BytesIO()
        np.save(meta, _dump_meta())
        zf.writestr("meta.npy", meta.getvalue())
        zf.write(tmp_path / "k.npy", "k.npy")
    res = run("distortion", "--codecs", "kv8", "--data", str(path))
    assert_one_line_error(res, "cannot read", "claims shape")


def _zip_size_patched(path, member, size):
    """Set the uncompressed size of ``member`` in the local header and the central directory."""
    import struct
    blob = bytearray(path.read_bytes())
    for signature, size_at, name_len_at, name_at in ((b"PK\x03\x04", 22, 26, 30),
                                                      (b"PK\x01\x02", 24, 28, 46)):
        at = blob.find(signature)
        while at >= 0:
            n = struct.unpack_from("<H", blob, at + name_len_at)[0]
            if blob[at + name_at:at + name_at + n] == member.encode():
                struct.pack_into("<I", blob, at + size_at, size)
            at = blob.find(signature, at + 4)
    path.write_bytes(bytes(blob))


def test_an_npz_whose_directory_lies_about_a_member_allocates_nothing(tmp_path):
    """A 1 KB archive whose directory (and the array header inside it) claim a 3.5 GiB member:
    refused from the sizes, before numpy allocates the array (under a 4 GB address-space
    limit that allocation was a MemoryError traceback; without one, 3.5 GiB reserved)."""
    import io
    import resource
    import zipfile
    claim = (1, 1, 56 << 20, 16)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": claim})
    meta = io.BytesIO()
    np.save(meta, _dump_meta())
    path = tmp_path / "lying-directory.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("meta.npy", meta.getvalue())
        zf.writestr("k.npy", header.getvalue() + b"\0" * 4096)
    _zip_size_patched(path, "k.npy", 4 * int(np.prod(claim)) + len(header.getvalue()))

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    res = subprocess.run([sys.executable, "-m", "kvquant.cli", "distortion", "--codecs", "kv8",
                          "--data", str(path)], capture_output=True, text=True,
                         preexec_fn=limit_memory)
    assert_one_line_error(res, "lying-directory.npz", "member 'k.npy' claims", "hold at most")
