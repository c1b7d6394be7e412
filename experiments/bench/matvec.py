"""The products of one decode step of a SmolLM2-shaped decoder: kvquant's matvec (matvec.h) on 1
and 2 OpenMP threads against numpy's (BLAS on 1 and 2 threads).

Random float32 matrices of SmolLM2-135M's shapes (30 layers of q, k, v, o, gate, up, down and the
49152 x 576 output matrix: 211 matrices, 538 MB), each multiplied by one row; each method timed
in its own block (3 untimed passes, then --repeats timed ones), the blocks in --rounds rounds;
medians printed. Prints only; writes nothing.

    python -m kvquant_experiments.bench.matvec --rounds 2
"""
import argparse

import numpy as np

from kvquant._kernels.matvec import matvec
from kvquant_experiments.bench.forward_attention import SMOLLM2_SHAPE
from kvquant_experiments.bench.timing import blas_limited, block_times, warm_up


def step_shapes(shape=SMOLLM2_SHAPE):
    """(rows, cols) of every matrix a decode step multiplies: each layer's q, k, v, o, gate, up,
    down, then the output matrix."""
    D, F = shape["hidden"], shape["ffn"]
    q, kv = shape["n_heads"] * shape["head_dim"], shape["n_kv"] * shape["head_dim"]
    layer = [(q, D), (kv, D), (kv, D), (D, q), (F, D), (F, D), (D, F)]
    return layer * shape["n_layers"] + [(shape["vocab"], D)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal(s, dtype=np.float32) for s in step_shapes()]
    xs = [rng.standard_normal((1, W.shape[1]), dtype=np.float32) for W in mats]
    ys = [np.empty(W.shape[0], np.float32) for W in mats]

    def numpy_step():
        for W, x in zip(mats, xs):
            x @ W.T

    def kvquant_step(n_threads):
        for W, x, y in zip(mats, xs, ys):
            matvec(W, x[0], y, n_threads)

    methods = {"numpy, BLAS 1 thread": (numpy_step, 1),
               "numpy, BLAS 2 threads": (numpy_step, 2),
               "matvec, 1 thread": (lambda: kvquant_step(1), 1),
               "matvec, 2 threads": (lambda: kvquant_step(2), 1)}
    times = {name: [] for name in methods}
    for _ in range(args.rounds):     # the same order every round, as the committed runs
        for name, (step, blas) in methods.items():
            with blas_limited(blas):
                warm_up(step, calls=3)
                times[name] += block_times(step, args.repeats)
    print(f"{len(mats)} matrices, {sum(W.nbytes for W in mats) / 1e6:.0f} MB, one row each")
    for name, ts in times.items():
        print(f"{name}: {1e3 * np.median(ts):.1f} ms a step (median), {1e3 * min(ts):.1f} best")


if __name__ == "__main__":
    main()
