"""Can a fixed-width polar layout match the radius allocation? Every split of a row's bits into
one fixed width per level, measured.

The default ``polar<b>`` splits each level's bits between its angles by their sub-radii, row by
row (``alloc=radius``); its attention consumer must redo that allocation for every row it reads,
which keeps it far slower than numpy f32 (issue: attention on the compressed cache). A layout
with one fixed width per level (``alloc=level``: the engine's split b, b-1, b-1, ...) reads at
memory speed. This sweep asks whether some other fixed split of the same bits closes the quality
gap: for Gaussian rows of width d (what a rotated row looks like), each level's angles are
quantized with a Lloyd-Max codebook fitted on that level's own angles in the sample (level 1,
uniform on the circle: the uniform grid, which is its Lloyd-Max quantizer), for every
non-increasing assignment of integer widths to levels 2.. that fits the engine's bit budget.
Fitting on the sample itself favours the fixed splits (an in-sample fit); the real codecs
``polar<b>:alloc=level`` and ``polar<b>`` (radius) run on the same rows for reference.

``python -m kvquant_experiments.polar_widths [--dim 128] [--bits 4] [--rows 20000]`` writes
``polar-fixed-widths-d<d>-b<b>-rows<n>.{md,json}`` under ``--out`` (default: a folder of that
name under the current directory).
"""
import itertools
import sys
import time
from pathlib import Path

import numpy as np

from kvquant.outputs import atomic_write
from kvquant_experiments.common import environment, markdown_table, stable_seed, write_json
from kvquant_experiments.study import Output, study_main

__all__ = ["fixed_split_errors", "format_markdown", "main", "measure_widths", "polar_angles"]

MAX_WIDTH = 6


def polar_angles(X):
    """The recursive polar transform of rows X (n, d), d a power of two: (angles per level,
    level 1 first, each (n, d >> level); final radius (n,))."""
    angles, r = [], np.asarray(X, np.float64)
    while r.shape[1] > 1:
        a, b = r[:, 0::2], r[:, 1::2]
        angles.append(np.arctan2(b, a))
        r = np.hypot(a, b)
    return angles, r[:, 0]


def _lloyd_levels(values, k, iters=60):
    """Lloyd-Max levels (k,) of an empirical distribution (a subsample of at most 2e5 values)."""
    s = np.sort(values.ravel())[::max(1, values.size // 200_000)]
    levels = np.quantile(s, (np.arange(k) + 0.5) / k)
    for _ in range(iters):
        idx = np.searchsorted((levels[1:] + levels[:-1]) / 2, s)
        count = np.bincount(idx, minlength=k)
        levels = np.where(count > 0, np.bincount(idx, s, k) / np.maximum(count, 1), levels)
    return levels


def _quantized(angles, level, width):
    A = angles[level - 1]
    if level == 1:   # uniform on the circle
        step = 2 * np.pi / (1 << width)
        return (np.floor((A + np.pi) / step) + 0.5) * step - np.pi
    levels = _lloyd_levels(A, 1 << width)
    return levels[np.searchsorted((levels[1:] + levels[:-1]) / 2, A)]


def fixed_split_errors(X, budget_bits, slack_bits=8):
    """Mean relative L2 error of rows X under every fixed split of at most ``budget_bits`` (and
    at least budget - slack) per row. Returns a list of (rel_l2, widths by level, bits), best
    first."""
    angles, radius = polar_angles(X)
    n_levels = len(angles)
    counts = [a.shape[1] for a in angles]
    cache = {}

    def rebuilt(widths):
        r = radius[:, None]
        for level in range(n_levels, 0, -1):
            key = (level, widths[level - 1])
            if key not in cache:
                cache[key] = _quantized(angles, *key)
            q = cache[key]
            nxt = np.empty((r.shape[0], 2 * r.shape[1]))
            nxt[:, 0::2], nxt[:, 1::2] = r * np.cos(q), r * np.sin(q)
            r = nxt
        return r

    norms = np.linalg.norm(X, axis=1)
    out = []
    for first in range(1, MAX_WIDTH + 2):
        for rest in itertools.product(range(1, MAX_WIDTH + 1), repeat=n_levels - 1):
            widths = (first,) + rest
            bits = sum(c * w for c, w in zip(counts, widths))
            if not budget_bits - slack_bits <= bits <= budget_bits:
                continue
            if list(rest) != sorted(rest, reverse=True):   # deeper angles concentrate
                continue
            err = np.linalg.norm(rebuilt(widths) - X, axis=1) / norms
            out.append((float(err.mean()), widths, bits))
    out.sort()
    return out


def check_widths(d, b):
    """ValueError unless the row width ``d`` and the bits ``b`` are a sweep this module runs."""
    if d < 4 or d & (d - 1) or d > 512:
        raise ValueError(f"--dim must be a power of two in 4..512 (the search grows with the "
                         f"number of levels), got {d}")
    if not 2 <= b <= 6:
        raise ValueError(f"--bits must be in 2..6 (the polar codec's widths), got {b}")


def measure_widths(d, b, n_rows):
    """Every fixed split of ``b``-bit polar rows of width ``d`` on ``n_rows`` Gaussian rows
    (seeded from the parameters), and the real codecs on the same rows.

    Returns
    -------
    dict: ``dim``, ``bits``, ``rows``, ``budget_bits``, ``best_fixed``, ``splits`` (best first),
    ``codecs`` (spec -> mean relative L2), ``seconds``, ``environment``.
    """
    from kvquant import get_codec
    check_widths(d, b)
    t0 = time.perf_counter()
    rng = np.random.default_rng(stable_seed("polar-widths", d, b, n_rows))
    X = rng.standard_normal((n_rows, d)).astype(np.float32)
    budget = (d // 2) * b + (d // 2 - 1) * max(b - 1, 1)     # the engine's bits per row
    splits = fixed_split_errors(X, budget)
    real = {}
    for spec in (f"polar{b}:alloc=level", f"polar{b}"):
        codec = get_codec(spec, d)
        X_hat = codec.decode(codec.encode(X))
        real[spec] = float((np.linalg.norm(X_hat - X, axis=1) / np.linalg.norm(X, axis=1)).mean())
    return {"dim": d, "bits": b, "rows": n_rows, "budget_bits": budget,
            "best_fixed": {"widths": splits[0][1], "bits": splits[0][2],
                           "rel_l2": splits[0][0]},
            "splits": [{"widths": w, "bits": bits, "rel_l2": err} for err, w, bits in splits],
            "codecs": real, "seconds": round(time.perf_counter() - t0, 1),
            "environment": environment()}


def format_markdown(result):
    """The best ten splits and the real codecs, as the result's ``.md``."""
    d, b, budget = result["dim"], result["bits"], result["budget_bits"]
    splits = result["splits"]
    engine_split = (b,) + (max(b - 1, 1),) * (len(splits[0]["widths"]) - 1)
    rows = [[" ".join(map(str, s["widths"])), s["bits"], f"{s['rel_l2']:.4f}",
             "engine's split" if tuple(s["widths"]) == engine_split else ""]
            for s in splits[:10]]
    return (f"# Fixed polar widths per level, d = {d}, {b} bits ({budget} bits per row), "
            f"{result['rows']} Gaussian rows\n\n"
            f"Mean relative L2 error; widths by level, level 1 first. {len(splits)} splits "
            "within 8 bits of the budget, best ten:\n\n"
            + markdown_table(["widths", "bits per row", "rel L2", ""], rows)
            + "\n\nThe real codecs on the same rows: "
            + ", ".join(f"`{k}` {v:.4f}" for k, v in result["codecs"].items()) + "\n")


# --------------------------------------------------------------------------------------------
# Command line (kvquant_experiments.study)
# --------------------------------------------------------------------------------------------
RESUMES = False         # one computation, written when it ends


def add_arguments(p):
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--out", default=None,
                   help="output folder (default: a folder named for the run, under the current "
                        "directory)")


def outputs(args):
    check_widths(args.dim, args.bits)   # a bad width fails before --out is created
    return [Output(args.out if args.out is not None else ".")]


def run(args, progress):
    result = measure_widths(args.dim, args.bits, args.rows)
    name = f"polar-fixed-widths-d{args.dim}-b{args.bits}-rows{args.rows}"
    stem = Path(args.out or name) / name
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_json(stem.with_suffix(".json"), result)
    text = format_markdown(result)
    atomic_write(stem.with_suffix(".md"), lambda f: f.write(text))
    print(text)
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
