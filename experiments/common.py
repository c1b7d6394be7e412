"""What every sweep shares: the environment record, seeds and file names from parameters, result
files, codec availability."""
import csv
import hashlib
import json
import os
import platform
import re
import sys
from pathlib import Path

import numpy as np

from kvquant.outputs import atomic_write

__all__ = [
    "SMOKE_ENV",
    "cell_stem",
    "codec_status",
    "cpu_model",
    "environment",
    "is_smoke",
    "markdown_table",
    "read_json",
    "results_dir",
    "spec_tag",
    "stable_seed",
    "write_csv",
    "write_json",
]

SMOKE_ENV = "KVQUANT_SMOKE"
RESULTS_ENV = "KVQUANT_RESULTS"


def is_smoke():
    """True when ``KVQUANT_SMOKE`` asks for the small grids (CI, notebooks)."""
    return os.environ.get(SMOKE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def results_dir(default="results"):
    """Where notebooks and ad-hoc runs put result files: ``$KVQUANT_RESULTS`` or ``default``
    (relative to the working directory), created if needed."""
    path = Path(os.environ.get(RESULTS_ENV) or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def stable_seed(*params):
    """A 63-bit seed from parameters (a SHA-256 of their JSON): the same cell gets the same rows in
    any process, on any machine, in any order."""
    text = json.dumps(params, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def safe_stem(stem):
    """``stem`` with every character outside ``[A-Za-z0-9._+-]`` replaced by ``_`` and no
    leading dot: a result's file name built from values read from a JSON file (a text's name,
    a model's) can neither leave its folder nor hide."""
    return _UNSAFE.sub("_", str(stem)).lstrip(".") or "_"


def spec_tag(spec):
    """A file-name-safe tag of a codec (pair) spec: ``"tq3:codebook=gaussian,side=unbiased"`` ->
    ``"tq3-codebook-gaussian-side-unbiased"``, ``"kv8/tq4"`` -> ``"kv8_tq4"``."""
    tag = spec.replace("/", "_")
    tag = _UNSAFE.sub("-", tag.replace(":", "-").replace("=", "-").replace(",", "-"))
    return tag.strip("-")


def cell_stem(cell, order):
    """File stem of a cell, parameters in ``order``: ``gaussian_d128_tq4_rows4096_seed0``.

    Each key of ``order`` is written as ``<prefix><value>`` with the prefixes of
    :data:`_PREFIXES` (none for kind and codec).
    """
    parts = []
    for key in order:
        value = cell[key]
        if key in ("codec", "codecs"):
            value = spec_tag(str(value))
        parts.append(f"{_PREFIXES.get(key, '')}{value}")
    return "_".join(str(p) for p in parts)


_PREFIXES = {"dim": "d", "rows": "rows", "seed": "seed", "queries": "q", "T": "T",
             "repeats": "r", "threads": "t"}


def cpu_model():
    """The CPU's model name (Linux /proc/cpuinfo, else platform), or "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _version(module):
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - any failure means "not there"
        return None
    return getattr(mod, "__version__", "?")


def environment():
    """Versions, threads and CPU of this process: stored beside every result."""
    import kvquant
    from kvquant._kernels import _build_info
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "openmp": bool(_build_info.openmp_enabled()),
        "openmp_max_threads": int(_build_info.openmp_max_threads()),
        # what can move a result's last bits: the BLAS and its kernel (OPENBLAS_CORETYPE), the
        # consumers' instruction set (every path gives the same bits; recorded all the same)
        **_numerics(),
        "versions": {
            "kvquant": kvquant.__version__,
            "numpy": np.__version__,
            "scipy": _version("scipy"),
            "matplotlib": _version("matplotlib"),
            "dask": _version("dask"),
            "distributed": _version("distributed"),
        },
    }


def _numerics():
    try:
        from kvquant._kernels import consumers
        from kvquant_experiments.bench.timing import blas_info
        return {"blas": blas_info(), "simd": consumers.get_simd()}
    except Exception as exc:  # noqa: BLE001 - an environment record never stops a result
        return {"blas": f"unknown ({exc})"}


def write_json(path, obj):
    """Write JSON atomically (a half-written file never looks like a finished cell)."""
    def write(f):
        json.dump(obj, f, indent=1, sort_keys=False, default=_json_default)
        f.write("\n")
    return atomic_write(path, write)


def _json_default(obj):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot store {type(obj).__name__} in JSON")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_csv(path, rows, columns=None):
    """Rows (dicts) as CSV; columns default to the union of keys in first-seen order."""
    if columns is None:
        columns = []
        for row in rows:
            columns += [k for k in row if k not in columns]

    def write(f):
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: _csv_cell(row.get(k)) for k in columns})
    return atomic_write(path, write)


def _csv_cell(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return value


def codec_status(spec, dim):
    """``(codec, None)`` when ``spec`` builds for width ``dim``, else ``(None, reason)``.

    The reason is the registry's own message (an unknown spec while a codec family is still being
    written, a width the codec cannot take, ...): the report prints it as "not available".
    """
    from kvquant import get_codec
    try:
        return get_codec(spec, dim), None
    except (ValueError, TypeError, ImportError) as exc:
        return None, str(exc)


def markdown_table(columns, rows):
    """A markdown table (str) from column names and rows of cells."""
    lines = ["| " + " | ".join(str(c) for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
