"""KVQUANT_SIMD: a bad value stops the library's import by name, and the ``kvquant`` command
says so in one line with exit status 2 (the command cannot catch an error raised while its own
package is imported, so the check itself knows the command)."""
import os
import subprocess
import sys
from pathlib import Path

BAD = dict(os.environ, KVQUANT_SIMD="sse9")


def _one_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_the_command_prints_one_line_and_exits_2():
    script = Path(sys.executable).with_name("kvquant")
    if script.exists():
        cmd = [str(script), "info"]
    else:   # not installed as a script: the same program name, the same import
        cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'kvquant'; import kvquant.cli"]
    res = subprocess.run(cmd, env=BAD, capture_output=True, text=True)
    assert res.returncode == 2
    line = _one_line(res.stderr)
    assert line.startswith("kvquant: environment variable KVQUANT_SIMD='sse9' is not valid")
    assert "auto, portable, avx2, avx512 or avx512vbmi" in line


def test_the_library_import_still_fails():
    res = subprocess.run([sys.executable, "-c", "import kvquant"], env=BAD, capture_output=True,
                         text=True)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith(
        "ImportError: environment variable KVQUANT_SIMD='sse9' is not valid")
