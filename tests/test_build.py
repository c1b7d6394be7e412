"""The compiled kernels are what runs: no silent Python fallback."""
import importlib
import importlib.machinery
import os
import platform
import shutil
import subprocess

import pytest

KERNEL_MODULES = ["_build_info", "bitpack", "fp8", "rotation", "lloyd", "consumers", "polar",
                  "matvec", "softmax", "tablelookup",
                  "ggml"]


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernel_modules_are_extension_modules(name):
    mod = importlib.import_module(f"kvquant._kernels.{name}")
    assert mod.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), mod.__file__


def test_codecs_use_the_compiled_kernels():
    from kvquant.codecs import fp8, lloyd
    assert fp8._fp8.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert lloyd._lloyd.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _compiler_has_openmp(tmp_path):
    # the compiler setup.py used: $CC when set (e.g. CC=clang), else the system's
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    src = tmp_path / "probe.c"
    src.write_text("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
    res = subprocess.run([*cc.split(), "-fopenmp", str(src), "-o", str(tmp_path / "probe")],
                         capture_output=True)
    return res.returncode == 0


def test_openmp_is_on_where_the_compiler_has_it(tmp_path):
    from kvquant._kernels import _build_info
    if os.environ.get("KVQUANT_NO_OPENMP") == "1":
        pytest.skip("built with KVQUANT_NO_OPENMP=1")
    assert _build_info.openmp_enabled() == _compiler_has_openmp(tmp_path)


def test_the_build_names_its_compiler():
    from kvquant._kernels import _build_info
    name = _build_info.compiler()
    assert name.split()[0] in ("gcc", "clang") and any(c.isdigit() for c in name), name
    # the encoders' search tree is written with GCC's variable shuffles (rowops.h)
    assert _build_info.encoder_search_tree() == (name.startswith("gcc")
                                                 and platform.machine() in ("x86_64", "AMD64"))


def test_missing_build_fails_loudly(tmp_path):
    """Importing kvquant from a source tree without compiled kernels must raise, not fall back."""
    import kvquant
    src = os.path.dirname(kvquant.__file__)
    copy = tmp_path / "kvquant"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    res = subprocess.run(
        ["python", "-c", "import kvquant"], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert res.returncode != 0
    assert "compiled kernels are missing" in res.stderr
