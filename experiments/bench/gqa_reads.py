"""Decode-step reads of the consumers against numpy f32 doing the same queries, per SIMD path.

For each head width d and query count m (the query heads sharing a KV head), numpy computes
``X @ Q.T`` and ``W @ X`` on float32 rows and each codec computes ``scores(enc, Q)`` and
``context(enc, W)`` from its codes. Every method is warmed and timed in its own block (best of
``--repeats``), so the ratios printed are against numpy in the same run. ``--clock thread`` times
the calling thread's CPU time instead of the wall clock: with ``--threads 1`` it is robust to
other jobs on a busy machine. ``--cold`` reads the rows from memory, not the caches: every call
reads the next of enough copies of its rows to hold 4x the last-level cache (``kvquant bench``'s
cold rows, :mod:`kvquant_experiments.bench.attention_step`; a model's forward evicts each layer's
rows before its next step). Prints one line per (d, m); writes nothing.

    python -m kvquant_experiments.bench.gqa_reads --dims 64,128,512 --queries 1,3 --rows 131072 \
        --threads 2
    KVQUANT_SIMD=avx2 python -m kvquant_experiments.bench.gqa_reads --dims 512 --queries 1 \
        --threads 2
    python -m kvquant_experiments.bench.gqa_reads --dims 512 --threads 1 --clock thread
    python -m kvquant_experiments.bench.gqa_reads --dims 64,128 --queries 1,3 --threads 2 --cold
"""
import argparse

import numpy as np

from kvquant_experiments.bench.timing import CLOCKS


# Its own loop rather than timing.block_times: each call reads the next copy of the rows (picked
# outside the timed call), and the best call is kept, not the median.
def _best(fn, copies, repeats, clock):
    """Best time of fn(copy), each call on the next copy (every copy warmed first)."""
    for rows in copies + copies[:2]:
        fn(rows)
    times = []
    for k in range(repeats):
        rows = copies[k % len(copies)]
        t0 = clock()
        fn(rows)
        times.append(clock() - t0)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64,128,512")
    ap.add_argument("--queries", default="1,3", help="query heads per KV head, e.g. 1,3,4,8")
    ap.add_argument("--rows", type=int, default=131072, help="cached rows T")
    ap.add_argument("--codecs", default="kv8,tq4,q4_0+rot")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--cold", action="store_true",
                    help="rows from memory: each call reads the next of copies holding 4x the "
                         "last-level cache")
    ap.add_argument("--cache-mib", type=float, default=None,
                    help="last-level cache size for --cold (default: read from the system)")
    args = ap.parse_args(argv)

    from threadpoolctl import threadpool_limits

    from kvquant import get_codec
    from kvquant._kernels import consumers
    from kvquant.specs import split_spec_text
    from kvquant_experiments.bench.attention_step import (copies_for, copies_of,
                                                          last_level_cache_bytes)

    clock = CLOCKS[args.clock]
    T, nt = args.rows, args.threads
    cache = None
    if args.cold:
        cache = (int(args.cache_mib * (1 << 20)) if args.cache_mib
                 else last_level_cache_bytes())
        if not cache or cache < 1:
            ap.error("--cold needs the last-level cache size: pass a positive --cache-mib")

    def copies(rows, nbytes):
        return copies_of(rows, copies_for(nbytes, cache) if args.cold else 1)

    print(f"path {consumers.get_simd()} (CPU runs up to {consumers.cpu_simd()}), T={T}, "
          f"{nt} threads, {args.clock} clock, "
          + (f"cold rows (copies holding 4x the {cache >> 20} MiB last-level cache)"
             if args.cold else "warm rows (one copy, read again every call)")
          + "; ratio = numpy f32 time / codec time")
    rng = np.random.default_rng(0)
    for d in map(int, args.dims.split(",")):
        X = rng.standard_normal((T, d), dtype=np.float32)
        Xs = copies(X, X.nbytes)
        encoded = []
        for spec in split_spec_text(args.codecs):   # options stay with their spec
            codec = get_codec(spec, d)
            enc = codec.encode(X)
            encoded.append((spec, codec, copies(enc, enc.codes.nbytes + enc.side.nbytes)))
        for m in map(int, args.queries.split(",")):
            Q = rng.standard_normal((m, d), dtype=np.float32)
            W = rng.random((m, T), dtype=np.float32)
            W /= W.sum(axis=1, keepdims=True)
            with threadpool_limits(nt):
                t_s = _best(lambda X: X @ Q.T, Xs, args.repeats, clock)
                t_c = _best(lambda X: W @ X, Xs, args.repeats, clock)
            line = (f"d={d} m={m}: numpy {1e3 * (t_s + t_c):.2f} ms "
                    f"({2 * X.nbytes / (t_s + t_c) / 1e9:.1f} GB/s, {len(Xs)} copies)")
            for spec, codec, encs in encoded:
                c_s = _best(lambda e: codec.scores(e, Q, n_threads=nt), encs, args.repeats, clock)
                c_c = _best(lambda e: codec.context(e, W, n_threads=nt), encs, args.repeats, clock)
                read = 2 * (encs[0].codes.nbytes + encs[0].side.nbytes)
                line += (f" | {spec} {(t_s + t_c) / (c_s + c_c):.2f}x (scores {t_s / c_s:.2f}x,"
                         f" context {t_c / c_c:.2f}x, {read / (c_s + c_c) / 1e9:.1f} GB/s,"
                         f" {len(encs)} copies)")
            print(line, flush=True)


if __name__ == "__main__":
    main()
