"""Inner products through a codec: the bias (slope) and the error of q . x^ against q . x.

An MSE-optimal codec shrinks inner products: regressing q . x^ on q . x gives a slope of 1 - D
(D the relative MSE; 0.883, 0.966, 0.990 at 2, 3, 4 bits, docs/reference.md §2). Storing the
unbiased side value |x|^2 / <x, x^> instead of the norm puts the slope back at 1 at no storage
cost. Per cell (input kind, d, codec): rows X, Gaussian queries Q (independent, seeded from the
parameters), S = Q X^T and S^ = Q X^^T in float64:

* ``slope`` = sum(S S^) / sum(S^2) (1 = unbiased),
* ``rel_rmse`` = sqrt(sum((S^ - S)^2) / sum(S^2)) (the whole error),
* ``rel_rmse_debiased`` = the same after dividing S^ by the slope (the variance part).

Files: ``<results>/inner_products/<kind>_d<d>_<codec>_rows<n>_q<m>_seed<s>.json``, collected in
``inner_products.csv`` / ``.json``.
"""
import functools
from pathlib import Path

import numpy as np

from kvquant_experiments.common import (cell_stem, codec_status, environment, is_smoke,
                                        read_json, stable_seed, write_csv, write_json)
from kvquant_experiments.distortion import family_and_bits
from kvquant_experiments.executor import run_cells
from kvquant_experiments.inputs import make_rows

__all__ = ["DEFAULT_CODECS", "collect", "default_grid", "inner_product_cell", "run_sweep",
           "shrink_theory"]

DEFAULT_CODECS = (
    [f"tq{b}" for b in range(1, 9)]
    + [f"tq{b}:side=unbiased" for b in range(1, 9)]
    + ["tq4:compat=colibri", "kv8"]
    + [f"polar{b}" for b in range(2, 7)]
    + ["q8_0", "q4_0", "q4_0+rot"]
)
SMOKE_CODECS = ["kv8", "tq2", "tq2:side=unbiased", "tq4", "tq4:side=unbiased"]
STEM_ORDER = ("kind", "dim", "codec", "rows", "queries", "seed")
CSV_COLUMNS = ["kind", "dim", "codec", "family", "bits", "available", "bits_per_value", "slope",
               "rel_rmse", "rel_rmse_debiased", "theory_slope", "rows", "queries", "seed",
               "reason"]


def default_grid(smoke=None):
    smoke = is_smoke() if smoke is None else smoke
    if smoke:
        return {"codecs": list(SMOKE_CODECS), "dims": [64], "kinds": ["gaussian"], "rows": 256,
                "queries": 16, "seed": 0}
    return {"codecs": list(DEFAULT_CODECS), "dims": [128], "kinds": ["gaussian", "heavy"],
            "rows": 2048, "queries": 64, "seed": 0}


def shrink_theory(dim, bits):
    """1 - D of the Beta-d Lloyd-Max codebook (the slope an MSE codec with the norm should show)."""
    from kvquant.codebooks import load_codebook
    return 1.0 - load_codebook("beta", dim, bits).mse


def inner_product_cell(cell, data_dir=None):
    """Slope and errors of q . x^ for one (kind, d, codec); a pure function of ``cell``."""
    spec, dim = cell["codec"], cell["dim"]
    codec, reason = codec_status(spec, dim)
    base = {"codec": spec, **family_and_bits(spec)}
    if codec is None:
        return {**base, "available": False, "reason": reason}
    X = make_rows(cell["kind"], dim, cell["rows"], cell["seed"], data_dir=data_dir)
    rng = np.random.default_rng(stable_seed("queries", dim, cell["queries"], cell["seed"]))
    Q = rng.standard_normal((cell["queries"], dim))
    S = Q @ X.astype(np.float64).T
    S_hat = Q @ codec.roundtrip(X, n_threads=1).astype(np.float64).T
    ss = float((S * S).sum())
    slope = float((S * S_hat).sum() / ss)
    theory = None
    if base["family"] == "tq" and base["bits"] is not None:
        theory = shrink_theory(dim, base["bits"])
    elif base["family"] == "tq unbiased":
        theory = 1.0
    return {
        **base,
        "available": True,
        "bits_per_value": float(codec.bits_per_value),
        "slope": slope,
        "rel_rmse": float(np.sqrt(((S_hat - S) ** 2).sum() / ss)),
        "rel_rmse_debiased": float(np.sqrt(((S_hat / slope - S) ** 2).sum() / ss)),
        "theory_slope": theory,
    }


def run_sweep(results_dir, codecs=None, dims=None, kinds=None, rows=None, queries=None, seed=None,
              executor=None, resume=True, progress=True, smoke=None, tally=None):
    """Run (or resume) the sweep; writes ``inner_products.csv`` / ``.json``; returns the rows."""
    grid = default_grid(smoke)
    for key, value in (("codecs", codecs), ("dims", dims), ("kinds", kinds), ("rows", rows),
                       ("queries", queries), ("seed", seed)):
        if value is not None:
            grid[key] = list(value) if isinstance(value, (list, tuple)) else value
    results_dir = Path(results_dir)
    cells = [{"sweep": "inner_products", "kind": kind, "dim": int(dim), "codec": spec,
              "rows": int(grid["rows"]), "queries": int(grid["queries"]),
              "seed": int(grid["seed"])}
             for kind in grid["kinds"] for dim in grid["dims"] for spec in grid["codecs"]]
    results = run_cells(functools.partial(inner_product_cell,
                                          data_dir=str(results_dir / "inputs")),
                        cells, results_dir / "inner_products",
                        lambda c: cell_stem(c, STEM_ORDER), executor=executor, resume=resume,
                        progress=progress, desc="inner products", tally=tally)
    flat = [{**{k: c[k] for k in ("kind", "dim", "rows", "queries", "seed")}, **r}
            for c, r in zip(cells, results)]
    write_csv(results_dir / "inner_products.csv", flat, columns=CSV_COLUMNS)
    write_json(results_dir / "inner_products.json",
               {"grid": grid, "environment": environment(), "rows": flat})
    return {"rows": flat, "grid": grid}


def collect(results_dir):
    return read_json(Path(results_dir) / "inner_products.json")["rows"]


if __name__ == "__main__":
    import sys
    sys.exit("kvquant_experiments.inner_products is a section of the report, not a command: run "
             "kvquant report (kvquant report --help), or kvquant distortion for one table")
