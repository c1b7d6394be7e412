"""Speed of one decode step of attention on the compressed cache, against numpy f32.

One step over T cached rows of width d: scores s = X^ q (times 1/sqrt(d)), softmax, context
w X^. Each codec runs through its compressed-domain consumers (``codec.scores``, softmax,
``codec.context``); the baseline is plain numpy on the float32 rows (``X @ q``, the same softmax,
``w @ X``) with BLAS held to the same thread count. All methods are timed in the same run,
interleaved repeat by repeat (a busy machine slows them alike), and the median is reported (the
minimum too, in the JSON/CSV).

``clock="thread"`` times with the calling thread's CPU time instead of the wall clock: on a machine
shared with other jobs this leaves out the time the process waits for a core, so it measures what
the kernels cost; it is only meaningful with one thread (and BLAS held to one).

OpenBLAS's worker threads busy-wait after a call (by default for about 2^28 cycles, a tenth of a
second) and would take the second core from whatever runs next. So each repeat times the codecs
first and numpy last, then pauses (COOL_DOWN_S) before the next repeat.
"""
import json
import os
import platform
import time

import numpy as np

from kvquant import get_codec
from kvquant.cache import softmax
from kvquant._kernels import consumers

DEFAULT_DIMS = (512, 64)
DEFAULT_CONTEXTS = (4096, 32768, 131072)
DEFAULT_CODECS = ("f32", "kv8", "kv8-g32", "kv8-g8") + tuple(f"tq{b}" for b in range(1, 9))
DEFAULT_THREADS = (1, 2)
COOL_DOWN_S = 0.15


def blas_info():
    """The BLAS numpy runs (threadpoolctl) and the environment knobs that change its speed."""
    from threadpoolctl import threadpool_info
    libs = [{k: lib.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                     "threading_layer", "filepath")}
            for lib in threadpool_info() if lib.get("user_api") == "blas"]
    return {"blas": libs, "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def _numpy_step(X, q, scale):
    s = X @ q
    s *= scale
    return softmax(s) @ X


def _codec_step(codec, enc, q, scale, n_threads):
    s = codec.scores(enc, q, n_threads)
    s *= scale
    return codec.context(enc, softmax(s), n_threads)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def time_cell(dim, T, codecs, threads=DEFAULT_THREADS, repeats=15, seed=0, warmup=2,
              stats=None, clock="wall"):
    """Median seconds of one step for numpy f32 and each codec, at each thread count.

    Returns
    -------
    times : dict
        ``{"numpy": {n_threads: s}, "<spec>": {n_threads: s}, ...}``
    errors : dict
        Relative error of each codec's context against numpy's (the timed work is the real work).
    bytes_per_row : dict
    stats : dict, optional
        When given, filled with ``{(name, n_threads): {"median": s, "min": s}}``.
    """
    from threadpoolctl import ThreadpoolController
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if clock == "thread" and tuple(threads) != (1,):
        raise ValueError("clock='thread' measures the calling thread only: use threads=(1,)")
    timer = CLOCKS[clock]
    controller = ThreadpoolController()
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((T, dim), dtype=np.float32)
    q = rng.standard_normal(dim, dtype=np.float32)
    scale = np.float32(1.0 / np.sqrt(dim))
    built = [(spec, get_codec(spec, dim)) for spec in codecs]
    encoded = [(spec, codec, codec.encode(X, n_threads=max(threads))) for spec, codec in built]
    methods = [(spec, nt, (codec, enc)) for spec, codec, enc in encoded for nt in threads]
    methods += [("numpy", nt, None) for nt in threads]    # last: see COOL_DOWN_S
    times = {(name, nt): [] for name, nt, _ in methods}
    ref = _numpy_step(X, q, scale)
    errors = {spec: float(np.linalg.norm(_codec_step(codec, enc, q, scale, max(threads)) - ref)
                          / np.linalg.norm(ref)) for spec, codec, enc in encoded}
    for r in range(warmup + repeats):
        # the first call after the pause would pay the wake-up (cold caches, clock ramp, an idle
        # core and the sleeping OpenMP workers): an untimed call on every thread first
        if methods[0][2] is not None:
            codec, enc = methods[0][2]
            _codec_step(codec, enc, q, scale, max(threads))
        for name, nt, payload in methods:
            if payload is None:
                with controller.limit(limits=nt, user_api="blas"):
                    t0 = timer()
                    _numpy_step(X, q, scale)
                    dt = timer() - t0
            else:
                codec, enc = payload
                t0 = timer()
                _codec_step(codec, enc, q, scale, nt)
                dt = timer() - t0
            if r >= warmup:
                times[(name, nt)].append(dt)
        time.sleep(COOL_DOWN_S)
    result = {}
    for (name, nt), ts in times.items():
        result.setdefault(name, {})[nt] = float(np.median(ts))
        if stats is not None:
            stats[(name, nt)] = {"median": float(np.median(ts)), "min": float(np.min(ts))}
    bytes_per_row = {spec: codec.bytes_per_row for spec, codec in built}
    return result, errors, bytes_per_row


def run(dims=DEFAULT_DIMS, contexts=DEFAULT_CONTEXTS, codecs=DEFAULT_CODECS,
        threads=DEFAULT_THREADS, repeats=15, seed=0, progress=None, clock="wall"):
    """Every cell (d, T) x codec. Returns a dict with the rows and what the run ran on."""
    threads = tuple(sorted(set(threads)))
    rows = []
    for dim in dims:
        for T in contexts:
            usable = [s for s in codecs if _builds(s, dim)]
            stats = {}
            times, errors, bpr = time_cell(dim, T, usable, threads, repeats, seed, stats=stats,
                                           clock=clock)
            for spec in usable:
                row = {"dim": dim, "T": T, "codec": spec, "bytes_per_row": bpr[spec],
                       "bytes_ratio": 4.0 * dim / bpr[spec], "context_rel_err": errors[spec]}
                for nt in threads:
                    row[f"numpy_ms_{nt}t"] = 1e3 * times["numpy"][nt]
                    row[f"codec_ms_{nt}t"] = 1e3 * times[spec][nt]
                    row[f"speedup_{nt}t"] = times["numpy"][nt] / times[spec][nt]
                    row[f"numpy_min_ms_{nt}t"] = 1e3 * stats[("numpy", nt)]["min"]
                    row[f"codec_min_ms_{nt}t"] = 1e3 * stats[(spec, nt)]["min"]
                    row[f"speedup_min_{nt}t"] = (stats[("numpy", nt)]["min"]
                                                 / stats[(spec, nt)]["min"])
                if len(threads) > 1:
                    row["thread_scaling"] = times[spec][threads[0]] / times[spec][threads[-1]]
                    row["numpy_thread_scaling"] = (times["numpy"][threads[0]]
                                                   / times["numpy"][threads[-1]])
                rows.append(row)
                if progress:
                    progress(row)
    return {"rows": rows, "threads": list(threads), "repeats": repeats, "seed": seed,
            "clock": clock,
            "simd": consumers.get_simd(), "cpu_simd": consumers.cpu_simd(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            **blas_info()}


def _builds(spec, dim):
    try:
        get_codec(spec, dim)
    except ValueError:
        return False
    return True


def result_stem(dims, contexts, threads, repeats, simd, clock="wall"):
    """File name (without extension) that records the parameters of a run."""
    return (f"bench_attention_d{'-'.join(map(str, dims))}_T{'-'.join(map(str, contexts))}"
            f"_threads{'-'.join(map(str, threads))}_r{repeats}_{simd}"
            + ("" if clock == "wall" else f"_{clock}clock"))


def format_markdown(result):
    threads = result["threads"]
    hi, lo = threads[-1], threads[0]
    clock = result.get("clock", "wall")
    lines = [
        f"One decode step (scores, softmax, context) over T rows; median of {result['repeats']} "
        f"interleaved repeats ({'wall clock' if clock == 'wall' else 'thread CPU time'}); "
        f"consumers on the {result['simd']} path; speedup = numpy f32 time / "
        f"codec time on the same rows and thread count.",
        "BLAS: " + "; ".join(f"{b['internal_api']} {b['version']} ({b['architecture']})"
                             for b in result["blas"])
        + f", OPENBLAS_CORETYPE={result['OPENBLAS_CORETYPE']}; load average at the end "
          f"{', '.join(f'{x:.2f}' for x in result['load_average'] or [])} on "
          f"{result['cpu_count']} cores.",
        "",
    ]
    head = (f"| d | T | codec | B/row | bytes vs f32 | numpy {hi}t ms | codec {hi}t ms "
            f"| speedup {hi}t |")
    rule = "|---:|---:|---|---:|---:|---:|---:|---:|"
    if lo != hi:
        head += (f" numpy {lo}t ms | codec {lo}t ms | speedup {lo}t | numpy {lo}t/{hi}t "
                 f"| codec {lo}t/{hi}t |")
        rule += "---:|---:|---:|---:|---:|"
    lines += [head, rule]
    for r in result["rows"]:
        line = (f"| {r['dim']} | {r['T']} | {r['codec']} | {r['bytes_per_row']} | "
                f"{r['bytes_ratio']:.2f}x | {r[f'numpy_ms_{hi}t']:.3f} | "
                f"{r[f'codec_ms_{hi}t']:.3f} | **{r[f'speedup_{hi}t']:.2f}x** |")
        if lo != hi:
            line += (f" {r[f'numpy_ms_{lo}t']:.3f} | {r[f'codec_ms_{lo}t']:.3f} | "
                     f"{r[f'speedup_{lo}t']:.2f}x | {r['numpy_thread_scaling']:.2f}x | "
                     f"{r['thread_scaling']:.2f}x |")
        lines.append(line)
    return "\n".join(lines)


def write_results(result, out_dir, stem):
    """Markdown, CSV and JSON files named by the run's parameters; returns their paths."""
    import csv
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(format_markdown(result) + "\n")
    with open(base + ".csv", "w", newline="", encoding="utf-8") as f:
        fields = list(result["rows"][0])
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(result["rows"])
    with open(base + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return [base + ext for ext in (".md", ".csv", ".json")]


# -- command line ----------------------------------------------------------------------------

def _ints(text):
    from kvquant.budget import parse_tokens
    return [parse_tokens(x) for x in text.split(",") if x.strip()]


def cmd_bench(args):
    try:
        dims, contexts, threads = _ints(args.dims), _ints(args.contexts), _ints(args.threads)
        codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
        for spec in codecs:
            if not any(_builds(spec, d) for d in dims):
                raise ValueError(f"codec {spec!r} is unknown or takes none of the widths {dims}")
        consumers.set_simd(args.simd)
    except ValueError as exc:
        raise SystemExit(f"kvquant bench: {exc}")

    def progress(row):
        if not args.json:
            hi = max(threads)
            print(f"  d={row['dim']:<4} T={row['T']:<7} {row['codec']:<10} "
                  f"speedup {row[f'speedup_{hi}t']:.2f}x at {hi} thread(s)", flush=True)

    try:
        result = run(dims, contexts, codecs, threads, args.repeats, args.seed, progress,
                     args.clock)
    except ValueError as exc:
        raise SystemExit(f"kvquant bench: {exc}")
    if args.out:
        paths = write_results(result, args.out, result_stem(dims, contexts, threads,
                                                            args.repeats, result["simd"],
                                                            args.clock))
        if not args.json:
            print("wrote " + ", ".join(paths))
    print(json.dumps(result, indent=1) if args.json else format_markdown(result))
    return 0


def add_cli(sub):
    p = sub.add_parser("bench", help="time one attention decode step on the compressed cache "
                                     "against numpy f32")
    p.add_argument("--dims", default=",".join(map(str, DEFAULT_DIMS)))
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                   help="cached rows T, e.g. 4096,32k,128k")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS))
    p.add_argument("--threads", default=",".join(map(str, DEFAULT_THREADS)),
                   help="thread counts (the largest is the headline)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simd", default="auto", choices=("auto", "portable", "avx512"),
                   help="consumer path (both give the same bits)")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="wall (default) or thread: the calling thread's CPU time, robust to "
                        "other jobs on the machine (one thread only)")
    p.add_argument("--out", default=None, help="directory for .md/.csv/.json result files")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
    return p
