"""The attention-speed benchmark on its fixed grids, and its verdict on the speed targets.

Runs :func:`kvquant_experiments.bench.attention_step.run` (what ``kvquant bench`` runs: each
method warmed and timed in its own block, the read bandwidth and every time's byte limit
measured in the same run) on one of two grids and writes the table as Markdown, CSV and JSON
named by the run's parameters, plus a verdict on the targets, into ``--out`` (default: a folder
of the run's name under the current directory):

- ``--grid single`` (default): d = 512 and 64; T = 4096, 32768, 131072; one query; 1 and 2
  threads; every codec;
- ``--grid gqa``: the query heads of a GQA group reading one KV head, d = 64, 128, 256 with
  m = 1, 3, 4, 8 queries at T = 131072, against numpy doing the same (``X @ Q.T``, ``W @ X``).

    python -m kvquant_experiments.bench.attention_targets --out /tmp/bench  # the single-query grid
    python -m kvquant_experiments.bench.attention_targets --grid gqa --out /tmp/bench  # GQA shapes
    python -m kvquant_experiments.bench.attention_targets --contexts 4096 --repeats 2 --rounds 1
    python -m kvquant_experiments.bench.attention_targets --simd portable  # the portable path
    python -m kvquant_experiments.bench.attention_targets --softmax numpy  # the reads alone
"""
import argparse
import sys

from kvquant._kernels import consumers
from kvquant_experiments.bench import attention_step as bench

# polar: the fixed-width layouts (the engine's compat tiers and alloc=level) have vector
# consumers; alloc=radius (the default polar<b>) allocates every row's bits with a per-level
# selection and stays far slower than numpy f32 (bench.POLAR_NOTE): time it with --codecs polar4.
CODECS = ("f32", "kv8", "kv8-g32", "kv8-g8", "tq1", "tq2", "tq3", "tq4", "tq5", "tq6", "tq7",
          "tq8", "q8_0", "q4_0", "q4_0+rot", "polar2:compat=colibri", "polar3:compat=colibri",
          "polar4:compat=colibri", "polar5:compat=colibri", "polar6:compat=colibri",
          "polar4:alloc=level")
GQA_CODECS = ("f32", "kv8", "tq4", "q4_0+rot", "polar4:alloc=level")
GRIDS = {
    "single": {"dims": "512,64", "contexts": "4096,32768,131072", "queries": "1",
               "codecs": ",".join(CODECS)},
    "gqa": {"dims": "64,128,256", "contexts": "131072", "queries": "1,3,4,8",
            "codecs": ",".join(GQA_CODECS)},
}
# (spec, d, queries, target speedup over numpy f32 at T = 131072 and the largest thread count)
TARGETS = ((("kv8", 512, 1, 3.6), ("tq4", 512, 1, 6.0))
           + tuple((spec, d, m, target) for d in (64, 128) for m in (1, 3)
                   for spec, target in (("kv8", 3.0), ("tq4", 5.0))))
TARGET_T = 131072


def verdict(result):
    """The targets, checked on the result rows that measure them (largest thread count)."""
    hi = max(result["threads"])
    rows = {(r["dim"], r.get("queries", 1), r["T"], r["codec"]): r for r in result["rows"]}
    lines = []
    for spec, d, m, target in TARGETS:
        r = rows.get((d, m, TARGET_T, spec))
        if r:
            got = r[f"speedup_{hi}t"]
            lo_r, hi_r = r[f"speedup_rounds_lo_{hi}t"], r[f"speedup_rounds_hi_{hi}t"]
            lines.append(f"- {spec} at T={TARGET_T}, d={d}, m={m}, {hi} thread(s): {got:.2f}x "
                         f"numpy f32, rounds {lo_r:.2f}-{hi_r:.2f}x (target {target}x at 2 "
                         "threads): " + ("met" if got >= target else "NOT met")
                         + ("" if lo_r >= target or hi_r < target else
                            " (the rounds fall on both sides)"))
    # the default polar (per-row allocation) is exempt from the speed floor (bench.POLAR_NOTE)
    slow = [r for r in result["rows"] if r["T"] >= 32768 and r[f"speedup_{hi}t"] < 1.0
            and not r.get("speed_exempt")]
    lines.append(f"- no codec slower than numpy f32 at T >= 32768 ({hi} thread(s); the default "
                 "polar exempt): "
                 + ("met" if not slow else "NOT met: " + ", ".join(
                     f"{r['codec']} (d={r['dim']}, m={r.get('queries', 1)}, T={r['T']}: "
                     f"{r[f'speedup_{hi}t']:.2f}x)" for r in slow)))
    flagged = [r for r in result["rows"] if r.get("flags")]
    if flagged:
        lines.append(f"- {len(flagged)} row(s) flagged as implausible (see the flags column)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="single", choices=sorted(GRIDS),
                   help="defaults for --dims, --contexts, --queries and --codecs")
    for name in ("dims", "contexts", "queries", "codecs"):
        p.add_argument(f"--{name}", default=None)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per block")
    p.add_argument("--rounds", type=int, default=5, help="rounds of blocks, order rotated")
    p.add_argument("--warmup-s", type=float, default=bench.WARMUP_S)
    p.add_argument("--schedule", default="block", choices=bench.SCHEDULES)
    p.add_argument("--softmax", default="compiled", choices=bench.SOFTMAXES,
                   help="the codecs' softmax: compiled (as the cache attends) or numpy's (the "
                        "baseline's, so that the steps differ only in their reads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simd", default="auto", help="consumer path: auto or one this CPU runs")
    p.add_argument("--clock", default="wall", choices=("wall", "thread"),
                   help="thread: CPU time of the calling thread (one thread only), robust to "
                        "other jobs sharing the machine")
    p.add_argument("--out", default=None,
                   help="output folder (default: a folder named for the run, under the current "
                        "directory)")
    args = p.parse_args(argv)

    grid = {k: getattr(args, k) or v for k, v in GRIDS[args.grid].items()}
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    dims, contexts, threads = ints(grid["dims"]), ints(grid["contexts"]), ints(args.threads)
    queries = ints(grid["queries"])
    from kvquant.specs import split_spec_text
    codecs = split_spec_text(grid["codecs"])   # "ds:inner=tq3,k=1": the option stays with its spec
    try:
        consumers.set_simd(args.simd)
    except ValueError as exc:
        p.error(str(exc))
    print(bench.POLAR_NOTE, file=sys.stderr)
    result = bench.run(dims, contexts, codecs, threads, args.repeats, args.seed,
                       progress=lambda r: print(f"  d={r['dim']} m={r['queries']} T={r['T']} "
                                                f"{r['codec']}: "
                                                f"{r[f'speedup_{max(threads)}t']:.2f}x, "
                                                f"{r[f'fraction_{max(threads)}t']:.2f} of its "
                                                "byte limit", file=sys.stderr, flush=True),
                       clock=args.clock, queries=queries, rounds=args.rounds,
                       warmup_s=args.warmup_s, schedule=args.schedule, softmax=args.softmax)
    result["verdict"] = verdict(result)
    stem = bench.result_stem(dims, contexts, threads, args.repeats, result["simd"], args.clock,
                             queries, args.schedule, softmax=args.softmax)
    paths = bench.write_results(result, args.out or stem, stem)
    with open(paths[0], "a", encoding="utf-8") as f:
        f.write("\nTargets:\n" + result["verdict"] + "\n")
    print(bench.format_markdown(result))
    print("\nTargets:\n" + result["verdict"])
    print("\nwrote " + ", ".join(paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
