"""Shared by the research-layer tests: make ``kvquant_experiments`` importable when the tests run
on a source tree that is not installed (``pip install`` maps ``experiments/`` to that name), in
this process and in subprocesses (the CLI, notebook kernels)."""
import functools
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SHIM = None


def _under_root(spec):
    return spec is not None and spec.origin and Path(spec.origin).resolve().is_relative_to(ROOT)


def ensure_importable():
    """Make ``import kvquant_experiments`` work here; return the PYTHONPATH entries a subprocess
    needs for ``kvquant`` and ``kvquant_experiments`` (empty when both are installed)."""
    global _SHIM
    extra = []
    # Another tree's installed copy (an editable install elsewhere) is not this tree's code.
    if not _under_root(importlib.util.find_spec("kvquant_experiments")):
        if _SHIM is None:
            _SHIM = Path(tempfile.mkdtemp(prefix="kvquant-experiments-"))
            (_SHIM / "kvquant_experiments").symlink_to(ROOT / "experiments",
                                                       target_is_directory=True)
        sys.path.insert(0, str(_SHIM))
        importlib.invalidate_caches()
    if _SHIM is not None:
        extra.append(str(_SHIM))
    if _under_root(importlib.util.find_spec("kvquant")) and not _installed_editable():
        extra.append(str(ROOT))
    return extra


@functools.lru_cache(maxsize=1)
def _installed_editable():
    # An editable install finds kvquant from any working directory; a bare source tree only
    # from ROOT (sys.path[0] of pytest's rootdir).
    import subprocess
    res = subprocess.run([sys.executable, "-c", "import kvquant"], cwd=tempfile.gettempdir(),
                         capture_output=True, env={k: v for k, v in os.environ.items()
                                                   if k != "PYTHONPATH"})
    return res.returncode == 0


def subprocess_env(**extra_env):
    """os.environ plus the PYTHONPATH of :func:`ensure_importable` and ``extra_env``."""
    env = dict(os.environ)
    paths = ensure_importable()
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.update({k: str(v) for k, v in extra_env.items()})
    return env
