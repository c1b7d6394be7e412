"""The attention-speed benchmark of issue 4: one decode step on the compressed cache vs numpy f32.

Runs :func:`kvquant.bench.run` on the issue's grid (d = 512 and 64; T = 4096, 32768, 131072; 1 and
2 threads; every codec) and writes the table as Markdown, CSV and JSON named by the run's
parameters, plus a short verdict on the issue's targets, into ``--out`` (default: a folder of
the run's name under the current directory).

    python -m experiments.bench_attention                      # the full grid (a few minutes)
    python -m experiments.bench_attention --contexts 4096 --repeats 3   # a quick look
    python -m experiments.bench_attention --simd portable      # the portable path's speed
"""
import argparse
import sys

from kvquant import bench
from kvquant._kernels import consumers

# polar: the fixed-width layouts (the engine's compat tiers and alloc=level) have vector
# consumers; alloc=radius (the default polar<b>) allocates every row's bits with a per-level
# selection and stays far slower than numpy f32: time it separately (--codecs polar4).
CODECS = ("f32", "kv8", "kv8-g32", "kv8-g8", "tq1", "tq2", "tq3", "tq4", "tq5", "tq6", "tq7",
          "tq8", "q8_0", "q4_0", "q4_0+rot", "polar2:compat=colibri", "polar3:compat=colibri",
          "polar4:compat=colibri", "polar5:compat=colibri", "polar6:compat=colibri",
          "polar4:alloc=level")


def verdict(result):
    """The issue's targets, checked on the result rows (largest thread count)."""
    hi = max(result["threads"])
    rows = {(r["dim"], r["T"], r["codec"]): r for r in result["rows"]}
    lines = []
    for spec, target in (("kv8", 3.0), ("tq4", 4.0)):
        r = rows.get((512, 131072, spec))
        if r:
            got = r[f"speedup_{hi}t"]
            lines.append(f"- {spec} at T=131072, d=512, {hi} thread(s): {got:.2f}x numpy f32 "
                         f"(target {target}x at 2 threads): "
                         + ("met" if got >= target else "NOT met"))
    slow = [r for r in result["rows"] if r["T"] >= 32768 and r[f"speedup_{hi}t"] < 1.0]
    lines.append(f"- no codec slower than numpy f32 at T >= 32768 ({hi} thread(s)): "
                 + ("met" if not slow else "NOT met: " + ", ".join(
                     f"{r['codec']} (d={r['dim']}, T={r['T']}: {r[f'speedup_{hi}t']:.2f}x)"
                     for r in slow)))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="512,64")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simd", default="auto", choices=("auto", "portable", "avx512", "avx512vbmi"))
    p.add_argument("--clock", default="wall", choices=("wall", "thread"),
                   help="thread: CPU time of the calling thread (one thread only), robust to "
                        "other jobs sharing the machine")
    p.add_argument("--out", default=None,
                   help="output folder (default: a folder named for the run, under the current "
                        "directory)")
    args = p.parse_args(argv)

    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    dims, contexts, threads = ints(args.dims), ints(args.contexts), ints(args.threads)
    codecs = [c for c in args.codecs.split(",") if c.strip()]
    consumers.set_simd(args.simd)
    result = bench.run(dims, contexts, codecs, threads, args.repeats, args.seed,
                       progress=lambda r: print(f"  d={r['dim']} T={r['T']} {r['codec']}: "
                                                f"{r[f'speedup_{max(threads)}t']:.2f}x",
                                                file=sys.stderr, flush=True),
                       clock=args.clock)
    result["verdict"] = verdict(result)
    stem = bench.result_stem(dims, contexts, threads, args.repeats, result["simd"], args.clock)
    paths = bench.write_results(result, args.out or stem, stem)
    with open(paths[0], "a", encoding="utf-8") as f:
        f.write("\nTargets (issue 4):\n" + result["verdict"] + "\n")
    print(bench.format_markdown(result))
    print("\nTargets (issue 4):\n" + result["verdict"])
    print("\nwrote " + ", ".join(paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
