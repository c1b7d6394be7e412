"""The compiled softmax (kvquant.cache.softmax) against numpy's (kvquant.reference.softmax).

For each shape (m rows of T scores), both run in place on a copy of the same scores, each method
warmed and timed in its own block; printed: median microseconds (the copy's time subtracted) and
numpy's time over the compiled one's. Prints only; writes nothing.

    python -m kvquant_experiments.bench.softmax --queries 1,3 --contexts 4096,32768,131072 \
        --threads 1,2
"""
import argparse

import numpy as np

from kvquant.cache import softmax
from kvquant.reference import softmax as numpy_softmax
from kvquant_experiments.bench.timing import block_times, warm_up


def _median_us(fn, repeats):
    warm_up(fn, calls=max(5, repeats // 10))
    return 1e6 * float(np.median(block_times(fn, repeats)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", default="1,3")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    for m in (int(x) for x in args.queries.split(",")):
        for T in (int(x) for x in args.contexts.split(",")):
            scores = (rng.standard_normal((m, T)) * 3).astype(np.float32)
            work = scores.copy()
            copy_us = _median_us(lambda: np.copyto(work, scores), args.repeats)
            numpy_us = _median_us(lambda: (np.copyto(work, scores),
                                           numpy_softmax(work, out=work)), args.repeats) - copy_us
            cells = [f"numpy {numpy_us:.1f} us"]
            for n in (int(x) for x in args.threads.split(",")):
                us = _median_us(lambda: (np.copyto(work, scores),
                                         softmax(work, out=work, n_threads=n)),
                                args.repeats) - copy_us
                cells.append(f"compiled {n}t {us:.1f} us ({numpy_us / us:.1f}x)")
            print(f"m={m} T={T}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
