"""Distortion sweep: codecs x bits x d x input kind -> relative L2 error against bits per value.

One cell = (input kind, d, codec spec, rows, seed). The rows depend on (kind, d, rows, seed) only,
so every codec of a cell group sees the same rows. Result files:
``<results>/distortion/<kind>_d<d>_<codec tag>_rows<rows>_seed<seed>.json``; the collected table
is ``distortion.csv`` (+ ``distortion.json`` with the grid and the environment).
"""
import functools
import math
from pathlib import Path

import numpy as np

from kvquant_experiments.common import (cell_stem, codec_status, environment, is_smoke,
                                        read_json, write_csv, write_json)
from kvquant_experiments.executor import run_cells
from kvquant_experiments.inputs import REAL_KINDS, SYNTHETIC_KINDS, kind_dims, make_rows

__all__ = [
    "DEFAULT_CODECS",
    "DEFAULT_DIMS",
    "LLOYD_MAX_GAUSSIAN_MSE",
    "SMOKE_CODECS",
    "collect",
    "default_grid",
    "distortion_cell",
    "make_cells",
    "run_sweep",
    "theory_curves",
]

# docs/reference.md §2: Lloyd-Max MSE per coordinate of N(0, 1), bits 1..6 (Max 1960).
LLOYD_MAX_GAUSSIAN_MSE = {1: 0.363380, 2: 0.117482, 3: 0.034548, 4: 0.009501, 5: 0.0025047,
                          6: 0.00064424}

DEFAULT_DIMS = (64, 128, 512)
DEFAULT_KINDS = SYNTHETIC_KINDS + REAL_KINDS
DEFAULT_ROWS = 4096
DEFAULT_CODECS = (
    ["kv8", "kv8-g32", "kv8-g8"]
    + [f"tq{b}" for b in range(1, 9)]
    + [f"tq{b}:codebook=gaussian" for b in range(1, 9)]
    + ["tq4:compat=colibri"]
    + [f"polar{b}" for b in range(2, 7)]
    + [f"polar{b}:compat=colibri" for b in range(2, 7)]
    + ["q8_0", "q4_0", "q8_0+rot", "q4_0+rot"]
)
SMOKE_CODECS = ["kv8", "tq2", "tq4", "tq4:compat=colibri", "polar4", "q4_0"]
STEM_ORDER = ("kind", "dim", "codec", "rows", "seed")


def default_grid(smoke=None):
    """``{"codecs", "dims", "kinds", "rows", "seed"}``, small when smoke."""
    smoke = is_smoke() if smoke is None else smoke
    if smoke:
        return {"codecs": list(SMOKE_CODECS), "dims": [64], "kinds": ["gaussian", "heavy"],
                "rows": 256, "seed": 0}
    return {"codecs": list(DEFAULT_CODECS), "dims": list(DEFAULT_DIMS),
            "kinds": list(DEFAULT_KINDS), "rows": DEFAULT_ROWS, "seed": 0}


def make_cells(codecs, dims, kinds, rows, seed=0):
    """Every (kind, dim, codec) cell; real kinds only at their own width."""
    cells = []
    for kind in kinds:
        for dim in kind_dims(kind, dims):
            for spec in codecs:
                cells.append({"sweep": "distortion", "kind": kind, "dim": int(dim),
                              "codec": spec, "rows": int(rows), "seed": int(seed)})
    return cells


def _theory_mse(codec):
    """Expected relative squared error of a rotated scalar codec: its levels under the exact
    coordinate density at d (None for other codecs)."""
    levels = getattr(codec, "levels64", None)
    if levels is None or getattr(codec, "family", None) != "tq":
        return None
    from kvquant.codebooks import beta_density, quantizer_mse
    return quantizer_mse(levels, beta_density(codec.dim))


def family_and_bits(spec):
    """The figure series and nominal bits a codec spec declares (None when it builds at no
    width)."""
    from kvquant.codecs import describe_codec
    try:
        series, bits = describe_codec(spec)
    except ValueError:
        series, bits = None, None
    return {"family": series, "bits": bits}


def distortion_cell(cell, data_dir=None):
    """Encode and decode the cell's rows; a pure function of ``cell``.

    Returns
    -------
    dict with ``available`` (False with ``reason`` when the codec cannot be built here), the
    canonical ``spec``, ``family``, ``bits``, ``bits_per_value``, ``bytes_per_row``,
    ``rel_l2_mean``, ``rel_l2_rms`` (sqrt of the mean squared per-row relative error, the number
    the Lloyd-Max theory predicts), ``rel_l2_max``, ``rel_mse`` (sum of squared errors over sum of
    squares) and ``theory_mse`` (rotated scalar codecs).
    """
    spec, dim = cell["codec"], cell["dim"]
    codec, reason = codec_status(spec, dim)
    base = {"codec": spec, **family_and_bits(spec)}
    if codec is None:
        return {**base, "available": False, "reason": reason}
    from kvquant.metrics import relative_l2
    X = make_rows(cell["kind"], dim, cell["rows"], cell["seed"], data_dir=data_dir)
    X_hat = codec.roundtrip(X, n_threads=1)
    rel = relative_l2(X, X_hat)
    X64 = X.astype(np.float64)
    theory = _theory_mse(codec)
    return {
        **base,
        "available": True,
        "spec": codec.spec,
        "bits_per_value": float(codec.bits_per_value),
        "bytes_per_row": int(codec.bytes_per_row),
        "rel_l2_mean": float(rel.mean()),
        "rel_l2_rms": float(np.sqrt(np.mean(rel * rel))),
        "rel_l2_max": float(rel.max()),
        "rel_mse": float(((X64 - X_hat) ** 2).sum() / (X64 ** 2).sum()),
        "theory_mse": theory,
    }


def run_sweep(results_dir, codecs=None, dims=None, kinds=None, rows=None, seed=None,
              executor=None, resume=True, progress=True, smoke=None, tally=None):
    """Run (or resume) the sweep and write ``distortion.csv`` / ``distortion.json``.

    Unset arguments come from :func:`default_grid`. Real kinds are dropped, with the reason
    recorded, when the real model is not installed.

    Returns
    -------
    dict with ``rows`` (one flat dict per cell, unavailable ones included with their reason),
    ``grid``, ``skipped_kinds`` ({kind: reason}) and the paths ``csv`` and ``json``.
    """
    grid = default_grid(smoke)
    for key, value in (("codecs", codecs), ("dims", dims), ("kinds", kinds), ("rows", rows),
                       ("seed", seed)):
        if value is not None:
            grid[key] = list(value) if isinstance(value, (list, tuple)) else value
    results_dir = Path(results_dir)
    data_dir = results_dir / "inputs"
    kinds, skipped = list(grid["kinds"]), {}
    if any(k in REAL_KINDS for k in kinds):
        from kvquant_experiments.inputs import capture_real_rows, real_model_status
        ok, info = real_model_status()
        if ok:
            # Once, before the cells, instead of in every worker; on the executor, where the
            # thread budget is set (it runs a model forward).
            if executor is not None:
                executor.submit(capture_real_rows, str(data_dir)).result()
            else:
                capture_real_rows(data_dir)
        else:
            for k in kinds:
                if k in REAL_KINDS:
                    skipped[k] = info
            kinds = [k for k in kinds if k not in REAL_KINDS]
    cells = make_cells(grid["codecs"], grid["dims"], kinds, grid["rows"], grid["seed"])
    results = run_cells(functools.partial(distortion_cell, data_dir=str(data_dir)), cells,
                        results_dir / "distortion", lambda c: cell_stem(c, STEM_ORDER),
                        executor=executor, resume=resume, progress=progress, desc="distortion",
                        tally=tally)
    flat = [{**{k: c[k] for k in ("kind", "dim", "rows", "seed")}, **r}
            for c, r in zip(cells, results)]
    csv_path = write_csv(results_dir / "distortion.csv", flat, columns=CSV_COLUMNS)
    json_path = write_json(results_dir / "distortion.json",
                           {"grid": grid, "skipped_kinds": skipped, "environment": environment(),
                            "rows": flat})
    return {"rows": flat, "grid": grid, "skipped_kinds": skipped, "csv": csv_path,
            "json": json_path}


CSV_COLUMNS = ["kind", "dim", "codec", "family", "bits", "available", "bits_per_value",
               "bytes_per_row", "rel_l2_mean", "rel_l2_rms", "rel_l2_max", "rel_mse",
               "theory_mse", "rows", "seed", "spec", "reason"]


def collect(results_dir):
    """The rows of ``distortion.json`` (what the figures and tables read)."""
    return read_json(Path(results_dir) / "distortion.json")["rows"]


def theory_curves(dim, bits=range(1, 9)):
    """Theory at width ``dim``, x = code bits + one f32 side value per row (bits per value stored).

    Returns
    -------
    dict with ``x``, ``bits``, ``lloyd_beta`` (relative L2 = sqrt of the Beta-d Lloyd-Max MSE, the
    stored codebooks), ``lloyd_gaussian`` (sqrt of the N(0,1) Lloyd-Max MSE) and ``bound``
    (2^-b = sqrt(4^-b), the lower bound for any b-bit quantizer).
    """
    from kvquant.codebooks import load_codebook
    bits = list(bits)
    side = 32.0 / dim
    return {
        "bits": bits,
        "x": [b + side for b in bits],
        "lloyd_beta": [math.sqrt(load_codebook("beta", dim, b).mse) for b in bits],
        "lloyd_gaussian": [math.sqrt(load_codebook("gaussian", None, b).mse) for b in bits],
        "bound": [2.0 ** -b for b in bits],
    }


if __name__ == "__main__":
    import sys
    sys.exit("kvquant_experiments.distortion is a section of the report, not a command: run "
             "kvquant report (kvquant report --help), or kvquant distortion for one table")
