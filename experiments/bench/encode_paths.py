"""Encode rows/s of codecs on each vector path of the encoders, robust to a busy machine.

For each width d, every codec encodes the same Gaussian rows on every path this CPU runs
(``consumers.set_simd``: the encoders follow it), on one thread, timed by the calling thread's CPU
time, best of ``--repeats`` calls interleaved over codecs and paths; printed as rows/s, as time
relative to the widest path and relative to tq4 on the same path. Prints only; writes nothing.
The ggml formats' rotation follows ``KVQUANT_SIMD`` alone (set it for the whole run).

The calls are interleaved over codecs and paths and the best kept, not timed in warmed blocks
as :mod:`kvquant_experiments.bench.timing` does: one thread, timed by its own CPU time, has no
other method's spinning threads in its way, and each codec is timed at the same moments as the
others.

    python -m kvquant_experiments.bench.encode_paths --dims 128,512 --codecs "tq4;tq5;tq8"
    python -m kvquant_experiments.bench.encode_paths --dims 128,512 \
        --codecs "tq4;polar4;polar4:alloc=level;polar3;polar6" --paths auto
"""
import argparse
import time

import numpy as np

from kvquant import get_codec
from kvquant._kernels import consumers
from kvquant.specs import split_spec_text

ALL_PATHS = {"portable": ["portable"], "avx2": ["avx2", "portable"],
             "avx512": ["avx512", "avx2", "portable"],
             "avx512vbmi": ["avx512", "avx2", "portable"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="128,512")
    ap.add_argument("--codecs", default="tq4;tq5;tq8",
                    help="';'-separated specs (or ','-separated: options stay with their spec)")
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--paths", default="all", help="'all' (every path this CPU runs) or 'auto'")
    args = ap.parse_args(argv)
    specs = split_spec_text(args.codecs, ";" if ";" in args.codecs else ",")
    if "tq4" not in specs:
        specs.insert(0, "tq4")
    paths = ALL_PATHS[consumers.cpu_simd()] if args.paths == "all" else ["auto"]
    for d in (int(x) for x in args.dims.split(",")):
        X = np.random.default_rng(0).standard_normal((args.rows, d)).astype(np.float32)
        codecs = {s: get_codec(s, d) for s in specs}
        best = {(s, p): np.inf for s in specs for p in paths}
        try:
            for p in paths:
                consumers.set_simd(p)
                for c in codecs.values():
                    c.encode(X[:1024], n_threads=1)           # warm-up
            for _ in range(args.repeats):
                for p in paths:
                    consumers.set_simd(p)
                    for s, c in codecs.items():
                        t0 = time.thread_time()
                        c.encode(X, n_threads=1)
                        best[s, p] = min(best[s, p], time.thread_time() - t0)
        finally:
            consumers.set_simd("auto")
        for s in specs:
            cells = [f"{p} {args.rows / best[s, p] / 1e6:.3f}M rows/s "
                     f"({best[s, p] / best[s, paths[0]]:.2f}x {paths[0]}'s time, "
                     f"{best[s, p] / best['tq4', p]:.2f}x tq4's)" for p in paths]
            print(f"d={d} {s}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
