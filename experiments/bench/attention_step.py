"""Speed of one decode step of attention on the compressed cache, against numpy f32:
``kvquant bench``.

One step over T cached rows of width d for m queries that read the same rows (the query heads
of one GQA group; m = 1 is a single head): scores ``S = Q X^T`` (times 1/sqrt(d)), a softmax per
query, context ``W X``. Each codec runs as the cache attends: its compressed-domain consumers
and the compiled softmax (``codec.scores(enc, Q)``, :func:`kvquant.cache.softmax`,
``codec.context(enc, W)``); the baseline is numpy on the float32 rows doing the same (``X @ q``
and ``w @ X`` for one query, ``X @ Q.T`` and ``W @ X`` for m, numpy's softmax), with BLAS held to
the same thread count.

**Fair timing.** Every method (numpy, each codec, at each thread count) is timed in a block of
its own: the thread count set, untimed warm-up calls for at least ``warmup_s`` seconds, then
``repeats`` timed calls back to back. The warm-up outlasts the other thread pool's spinning
(OpenBLAS's workers busy-wait for about 2^28 cycles after a call, a tenth of a second; libgomp's
for GOMP_SPINCOUNT spins) and warms the caches and the clock. Blocks run in ``rounds`` rounds,
the order rotated every round, so that a load that comes and goes falls on every method alike;
the median of all timed calls is reported (the minimum too, in the JSON/CSV).
``schedule="interleaved"`` is the other way, kept to compare: one call of each method in turn,
each after a pause that lets the pools fall asleep (COOL_DOWN_S) and an untimed call.

**Byte limits.** A step reads every stored row twice (scores, then context):
``2 T bytes_per_row`` bytes (the m x T scores and weights are not counted). The machine's read
bandwidth at each thread count is measured in the same cell (:func:`read_bandwidth`, before and
after the timings, the better kept); a
method's *byte limit* is its bytes over that bandwidth, and ``fraction`` = byte limit / time
(1.0: reading at the machine's bandwidth). Flagged as implausible: a method faster than its
byte limit (its rows fit in the caches, or the bandwidth was under-measured) and a method slower
at its highest thread count than at its lowest.

**Cold rows.** Timed back to back on one array, rows that fit in the last-level cache are read
from it, not from memory: at d = 64 and T = 131072 the f32 rows (33.5 MB) nearly fit a 32 MB L3,
and numpy then runs above the memory's bandwidth (flagged). In a model's forward they never are
(every layer's rows are evicted by the other layers' before its next step). ``cold=True``
gives each method ``copies_for(bytes, cache)`` copies of its rows, enough that they hold
COLD_CACHE_FACTOR times the last-level cache (:func:`last_level_cache_bytes`), and every call
(warm-up included) reads the next copy in turn, so the rows a call reads were evicted since
their last use.

``softmax="numpy"`` gives the codecs numpy's softmax, the baseline's, instead of the compiled
one the cache attends with: the two steps then differ only in how they read the rows, which
tells the consumers' gain apart from the softmax's (at d = 64 the softmax is a fifth of a
step).

``clock="thread"`` times with the calling thread's CPU time instead of the wall clock: on a machine
shared with other jobs this leaves out the time the process waits for a core, so it measures what
the kernels cost; it is only meaningful with one thread (and BLAS held to one).

    kvquant bench --dims 512,64 --contexts 4k,32k,128k --codecs f32,kv8,tq4,q4_0+rot --out DIR
    python -m kvquant_experiments.bench.attention_step --dims 64 --queries 1,3 --cold
"""
import dataclasses
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvquant import get_codec
from kvquant.specs import split_spec_text
from kvquant.cache import softmax
from kvquant.reference import softmax as numpy_softmax
from kvquant._kernels import consumers
from kvquant.outputs import atomic_write, check_out_dir, dumps_strict
from kvquant_experiments.bench.timing import (CLOCKS, blas_info, blas_limited, block_times,
                                              rotated, warm_up)

DEFAULT_DIMS = (512, 64)
DEFAULT_CONTEXTS = (4096, 32768, 131072)
DEFAULT_CODECS = ("f32", "kv8", "kv8-g32", "kv8-g8") + tuple(f"tq{b}" for b in range(1, 9))
DEFAULT_THREADS = (1, 2)
DEFAULT_QUERIES = (1,)
SCHEDULES = ("block", "interleaved")
SOFTMAXES = ("compiled", "numpy")   # the codecs' softmax: the cache's, or the baseline's
WARMUP_S = 0.2
# the baseline holds T x d float32 rows (and --cold several copies): sizes beyond are refused
MAX_ROWS_BYTES = 4 << 30
COOL_DOWN_S = 0.15          # interleaved schedule: a pause longer than OpenBLAS's spinning
# Far larger than any CPU's caches (tens of MB), so that the bandwidth is the memory's.
BANDWIDTH_BUFFER_BYTES = 512 << 20
COLD_CACHE_FACTOR = 4       # cold: the copies of a method's rows hold 4x the last-level cache
POLAR_NOTE = ("The default polar<b> (alloc=radius) allocates each row's bits on its own, which "
              "keeps its consumer ~20x slower than numpy f32: it is the quality reference and "
              "exempt from the speed floor; the fast polar is `polar<b>:alloc=level`.")


# -- bytes and bandwidth ---------------------------------------------------------------------

def step_bytes(bytes_per_row, T):
    """Bytes one decode step must read: every row once for the scores, once for the context."""
    return 2 * int(T) * int(bytes_per_row)


def read_bandwidth(n_threads, buffer=None, passes=5):
    """The machine's read bandwidth in bytes/s with ``n_threads`` threads.

    The best of ``passes`` passes of numpy's max over ``buffer`` (default BANDWIDTH_BUFFER_BYTES
    of float32), split into one chunk per Python thread (numpy's reductions release the GIL).

    Parameters
    ----------
    n_threads : int
    buffer : ndarray of shape (n,), float32, optional
        Written before (np.ones: every page mapped); reuse one across calls.
    """
    buf = np.ones(BANDWIDTH_BUFFER_BYTES // 4, np.float32) if buffer is None else buffer
    chunks = np.array_split(buf, n_threads)
    best = np.inf
    with ThreadPoolExecutor(n_threads) as pool:
        list(pool.map(np.max, chunks))
        for _ in range(passes):
            t0 = time.perf_counter()
            list(pool.map(np.max, chunks))
            best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best


def last_level_cache_bytes(sysfs="/sys/devices/system/cpu"):
    """Bytes of last-level cache the machine has (every instance of the highest level summed).

    Read from Linux's sysfs (``cpu*/cache/index*/{level,size,shared_cpu_list}``); ``None`` where
    it is not there.
    """
    import glob
    best_level, instances = 0, {}
    for index in glob.glob(os.path.join(sysfs, "cpu[0-9]*", "cache", "index[0-9]*")):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                size = f.read().strip()
            with open(os.path.join(index, "shared_cpu_list")) as f:
                shared = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        if level > best_level:
            best_level, instances = level, {}
        if level == best_level:
            instances[shared] = nbytes      # one entry per cache, however many CPUs share it
    return sum(instances.values()) or None


def copies_for(nbytes, cache_bytes, factor=COLD_CACHE_FACTOR):
    """Copies of ``nbytes`` of rows that together hold ``factor`` times ``cache_bytes``."""
    return max(1, -(-factor * int(cache_bytes) // max(1, int(nbytes))))


def copies_of(rows, n):
    """``rows`` and ``n - 1`` copies of it (a float32 array, or EncodedRows: codes and side)."""
    if isinstance(rows, np.ndarray):
        return [rows] + [rows.copy() for _ in range(n - 1)]
    return [rows] + [dataclasses.replace(rows, codes=rows.codes.copy(), side=rows.side.copy())
                     for _ in range(n - 1)]


def plausibility_flags(name, seconds, limit_seconds):
    """What is implausible in one method's times.

    Parameters
    ----------
    name : str
    seconds, limit_seconds : dict
        ``{n_threads: s}``: measured times and byte limits.

    Returns
    -------
    list of str
        ``"<name> faster than its byte limit at <n>t"`` for each thread count where
        seconds < limit, ``"<name> slower at <hi>t than at <lo>t"`` when the highest thread
        count is slower than the lowest.
    """
    flags = [f"{name} faster than its byte limit at {nt}t ({limit_seconds[nt] / s:.2f}x)"
             for nt, s in sorted(seconds.items()) if s < limit_seconds[nt]]
    lo, hi = min(seconds), max(seconds)
    if hi != lo and seconds[hi] > seconds[lo]:
        flags.append(f"{name} slower at {hi}t than at {lo}t")
    return flags


def is_speed_exempt(codec):
    """The default polar codecs (per-row bit allocation): exempt from the speed floor."""
    return getattr(codec, "alloc", None) == "radius"


# -- one step --------------------------------------------------------------------------------

def _numpy_step(X, Q, scale):
    if Q.shape[0] == 1:                 # one query: matrix-vector products
        s = X @ Q[0]
        s *= scale
        return (numpy_softmax(s, out=s) @ X)[None]
    # (m, T) rows in memory order: a softmax along a strided axis took numpy ~1.4x as long
    S = np.ascontiguousarray((X @ Q.T).T)
    S *= scale
    return numpy_softmax(S, out=S) @ X        # (m, d)


def _codec_step(codec, enc, Q, scale, n_threads, softmax_kind="compiled"):
    S = codec.scores(enc, Q, n_threads)
    if softmax_kind == "numpy":             # as _numpy_step: the product, then numpy's softmax
        S *= scale
        W = numpy_softmax(S, out=S)
    else:
        W = softmax(S, out=S, scale=scale, n_threads=n_threads)
    return codec.context(enc, W, n_threads)


class _Method:
    """One timed method: numpy or a codec's consumers, at one thread count.

    ``rows`` is a list of copies of the rows (float32 arrays for numpy, EncodedRows for a
    codec); each call reads the next one in turn (one copy: the same rows every call).
    """

    def __init__(self, name, n_threads, controller, rows, Q, scale, codec=None,
                 softmax_kind="compiled"):
        self.name, self.n_threads = name, n_threads
        self._controller, self._rows, self._Q, self._scale = controller, rows, Q, scale
        self._codec, self._next, self._softmax = codec, 0, softmax_kind

    @property
    def n_copies(self):
        return len(self._rows)

    def limited(self):
        """BLAS held to this method's thread count (numpy's work; the codecs' softmax too)."""
        return blas_limited(self.n_threads, self._controller)

    def __call__(self):
        rows = self._rows[self._next]
        self._next = (self._next + 1) % len(self._rows)
        if self._codec is None:
            return _numpy_step(rows, self._Q, self._scale)
        return _codec_step(self._codec, rows, self._Q, self._scale, self.n_threads,
                           softmax_kind=self._softmax)


def _time_blocks(methods, repeats, rounds, warmup_s, timer):
    times = {(m.name, m.n_threads): [] for m in methods}
    for r in range(rounds):
        for m in rotated(methods, r):
            with m.limited():
                # every copy of the rows read once before the timed calls (cold rows)
                warm_up(m, calls=max(2, m.n_copies), seconds=warmup_s)
                times[(m.name, m.n_threads)] += block_times(m, repeats, timer)
    return times


# The other schedule, kept to compare with the blocks: one call of each method in turn, each
# after a pause that lets the thread pools fall asleep, so it differs from the shared block loop
# on purpose.
def _time_interleaved(methods, repeats, rounds, timer):
    times = {(m.name, m.n_threads): [] for m in methods}
    for _ in range(repeats * rounds):
        for m in methods:
            with m.limited():
                time.sleep(COOL_DOWN_S)
                m()
                t0 = timer()
                m()
                times[(m.name, m.n_threads)].append(timer() - t0)
    return times


def time_cell(dim, T, codecs, threads=DEFAULT_THREADS, repeats=3, seed=0, queries=1,
              rounds=5, warmup_s=WARMUP_S, schedule="block", clock="wall", bandwidth_buffer=None,
              cold=False, cache_bytes=None, softmax="compiled"):
    """Seconds of one step for numpy f32 and each codec, at each thread count, with byte limits.

    Parameters
    ----------
    dim, T : int
        Row width and cached rows.
    codecs : list of str
        Codec specs that build at ``dim``.
    threads : tuple of int
    repeats, rounds : int
        Timed calls per block, and rounds of blocks (``repeats * rounds`` samples per method).
    queries : int
        m, the queries that read the same rows in one step.
    schedule : {"block", "interleaved"}
    bandwidth_buffer : ndarray, optional
        Buffer for :func:`read_bandwidth` (allocated here when not given).
    cold : bool
        Rows read from memory, not the caches: each method's calls go round
        ``copies_for(bytes, cache_bytes)`` copies of its rows (module docstring).
    cache_bytes : int, optional
        Last-level cache size for ``cold`` (default: :func:`last_level_cache_bytes`).
    softmax : {"compiled", "numpy"}
        The codecs' softmax (module docstring); numpy f32 always runs numpy's.

    Returns
    -------
    dict
        ``median`` and ``min``: ``{name: {n_threads: s}}`` with name ``"numpy"`` or a codec
        spec; ``bandwidth``: ``{n_threads: bytes/s}``; ``bytes_per_row``: ``{name: B}`` (numpy:
        4 d); ``limit``: ``{name: {n_threads: s}}`` (step bytes / bandwidth); ``errors``: relative
        error of each codec's context against numpy's (the timed work is the real work);
        ``copies``: ``{name: n}`` copies of the rows each method went round; ``cache_bytes``.
    """
    from threadpoolctl import ThreadpoolController
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if clock == "thread" and tuple(threads) != (1,):
        raise ValueError("clock='thread' measures the calling thread only: use threads=(1,)")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if softmax not in SOFTMAXES:
        raise ValueError(f"softmax must be one of {SOFTMAXES}, got {softmax!r}")
    for what, n in (("repeats", repeats), ("rounds", rounds), ("queries", queries)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{what} must be a positive integer, got {n!r}")
    if cold:
        cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
        if not cache_bytes or cache_bytes < 1:
            raise ValueError("cold rows need the last-level cache size, which this system does "
                             "not report: pass it (cache_bytes, or --cache-mib)")
    timer = CLOCKS[clock]
    controller = ThreadpoolController()
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((T, dim), dtype=np.float32)
    Q = rng.standard_normal((queries, dim), dtype=np.float32)
    scale = np.float32(1.0 / np.sqrt(dim))
    built = [(spec, get_codec(spec, dim)) for spec in codecs]
    encoded = [(spec, codec, codec.encode(X, n_threads=max(threads))) for spec, codec in built]
    ref = _numpy_step(X, Q, scale)
    errors = {spec: float(np.linalg.norm(_codec_step(codec, enc, Q, scale, max(threads),
                                                     softmax_kind=softmax) - ref)
                          / np.linalg.norm(ref)) for spec, codec, enc in encoded}
    copies = {"numpy": copies_for(X.nbytes, cache_bytes) if cold else 1}
    copies.update({spec: copies_for(enc.codes.nbytes + enc.side.nbytes, cache_bytes) if cold
                   else 1 for spec, codec, enc in encoded})
    X_rows = copies_of(X, copies["numpy"])
    methods = [_Method("numpy", nt, controller, X_rows, Q, scale) for nt in threads]
    for spec, codec, enc in encoded:
        enc_rows = copies_of(enc, copies[spec])
        methods += [_Method(spec, nt, controller, enc_rows, Q, scale, codec, softmax)
                    for nt in threads]
    buf = (np.ones(BANDWIDTH_BUFFER_BYTES // 4, np.float32) if bandwidth_buffer is None
           else bandwidth_buffer)
    before = {nt: read_bandwidth(nt, buf) for nt in threads}
    if schedule == "block":
        times = _time_blocks(methods, repeats, rounds, warmup_s, timer)
    else:
        times = _time_interleaved(methods, repeats, rounds, timer)
    # before and after the timings: the better of the two (other jobs come and go)
    bandwidth = {nt: max(before[nt], read_bandwidth(nt, buf)) for nt in threads}
    bytes_per_row = {"numpy": 4 * dim, **{spec: codec.bytes_per_row for spec, codec in built}}
    out = {"median": {}, "min": {}, "limit": {}, "round_medians": {}, "bandwidth": bandwidth,
           "bytes_per_row": bytes_per_row, "errors": errors, "copies": copies,
           "cache_bytes": cache_bytes if cold else None}
    for (name, nt), ts in times.items():
        out["median"].setdefault(name, {})[nt] = float(np.median(ts))
        out["min"].setdefault(name, {})[nt] = float(np.min(ts))
        out["limit"].setdefault(name, {})[nt] = step_bytes(bytes_per_row[name], T) / bandwidth[nt]
        out["round_medians"].setdefault(name, {})[nt] = per_round_medians(ts, repeats, rounds)
    return out


def per_round_medians(samples, repeats, rounds):
    """The median of each round's samples: both schedules take ``repeats`` samples of a method
    per round, in round order."""
    if len(samples) != repeats * rounds:
        raise ValueError(f"{len(samples)} samples are not {rounds} rounds of {repeats}")
    return [float(np.median(samples[r * repeats:(r + 1) * repeats])) for r in range(rounds)]


def round_speedups(cell, name, n_threads):
    """numpy's median over the codec's in each round: a round's methods ran minutes apart at
    most, so the spread of these ratios is what the machine's changing load did to the speedup."""
    numpy_rounds = cell["round_medians"]["numpy"][n_threads]
    return [a / b for a, b in zip(numpy_rounds, cell["round_medians"][name][n_threads])]


def cell_rows(dim, T, queries, cell, codecs, threads):
    """The result rows of one cell (one per codec; numpy's figures on every row)."""
    med, mn, lim, bpr = cell["median"], cell["min"], cell["limit"], cell["bytes_per_row"]
    numpy_flags = plausibility_flags("numpy", med["numpy"], lim["numpy"])
    rows = []
    for spec in codecs:
        row = {"dim": dim, "T": T, "queries": queries, "codec": spec,
               "bytes_per_row": bpr[spec], "bytes_ratio": 4.0 * dim / bpr[spec],
               "context_rel_err": cell["errors"][spec],
               "speed_exempt": is_speed_exempt(get_codec(spec, dim)),
               "numpy_copies": cell["copies"]["numpy"], "codec_copies": cell["copies"][spec]}
        for nt in threads:
            row[f"bandwidth_gbs_{nt}t"] = cell["bandwidth"][nt] / 1e9
            row[f"numpy_ms_{nt}t"] = 1e3 * med["numpy"][nt]
            row[f"codec_ms_{nt}t"] = 1e3 * med[spec][nt]
            row[f"speedup_{nt}t"] = med["numpy"][nt] / med[spec][nt]
            row[f"limit_ms_{nt}t"] = 1e3 * lim[spec][nt]
            row[f"fraction_{nt}t"] = lim[spec][nt] / med[spec][nt]
            row[f"numpy_limit_ms_{nt}t"] = 1e3 * lim["numpy"][nt]
            row[f"numpy_fraction_{nt}t"] = lim["numpy"][nt] / med["numpy"][nt]
            row[f"numpy_min_ms_{nt}t"] = 1e3 * mn["numpy"][nt]
            row[f"codec_min_ms_{nt}t"] = 1e3 * mn[spec][nt]
            row[f"speedup_min_{nt}t"] = mn["numpy"][nt] / mn[spec][nt]
            per_round = round_speedups(cell, spec, nt)
            row[f"speedup_rounds_lo_{nt}t"] = min(per_round)
            row[f"speedup_rounds_hi_{nt}t"] = max(per_round)
        if len(threads) > 1:
            row["thread_scaling"] = med[spec][threads[0]] / med[spec][threads[-1]]
            row["numpy_thread_scaling"] = med["numpy"][threads[0]] / med["numpy"][threads[-1]]
        row["flags"] = "; ".join(plausibility_flags(spec, med[spec], lim[spec]) + numpy_flags)
        rows.append(row)
    return rows


def run(dims=DEFAULT_DIMS, contexts=DEFAULT_CONTEXTS, codecs=DEFAULT_CODECS,
        threads=DEFAULT_THREADS, repeats=3, seed=0, progress=None, clock="wall",
        queries=DEFAULT_QUERIES, rounds=5, warmup_s=WARMUP_S, schedule="block", cold=False,
        cache_bytes=None, softmax="compiled"):
    """Every cell (d, m, T) x codec. Returns a dict with the rows and what the run ran on."""
    threads = tuple(sorted(set(threads)))
    for spec in codecs:     # a codec of none of the widths is a mistake, not a skipped cell
        if not any(_builds(spec, d) for d in dims):
            get_codec(spec, max(dims))   # raises, naming the spec and why
    if cold and cache_bytes is None:
        cache_bytes = last_level_cache_bytes()
    buf = np.ones(BANDWIDTH_BUFFER_BYTES // 4, np.float32)
    rows = []
    for dim in dims:
        usable = [s for s in codecs if _builds(s, dim)]
        for m in queries:
            for T in contexts:
                cell = time_cell(dim, T, usable, threads, repeats, seed, m, rounds, warmup_s,
                                 schedule, clock, buf, cold, cache_bytes, softmax)
                for row in cell_rows(dim, T, m, cell, usable, threads):
                    rows.append(row)
                    if progress:
                        progress(row)
    return {"rows": rows, "threads": list(threads), "repeats": repeats, "rounds": rounds,
            "warmup_s": warmup_s, "schedule": schedule, "seed": seed, "clock": clock,
            "cold": bool(cold), "cache_bytes": cache_bytes if cold else None,
            "softmax": softmax, "queries": list(queries),
            "bandwidth_buffer_bytes": BANDWIDTH_BUFFER_BYTES,
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


def result_stem(dims, contexts, threads, repeats, simd, clock="wall", queries=(1,),
                schedule="block", cold=False, softmax="compiled"):
    """File name (without extension) that records the parameters of a run."""
    return (f"bench_attention_d{'-'.join(map(str, dims))}"
            + ("" if tuple(queries) == (1,) else f"_m{'-'.join(map(str, queries))}")
            + f"_T{'-'.join(map(str, contexts))}"
            f"_threads{'-'.join(map(str, threads))}_r{repeats}_{simd}"
            + ("" if clock == "wall" else f"_{clock}clock")
            + ("" if schedule == "block" else f"_{schedule}")
            + ("_cold" if cold else "")
            + ("" if softmax == "compiled" else f"_{softmax}-softmax"))


def format_markdown(result):
    threads = result["threads"]
    hi, lo = threads[-1], threads[0]
    clock = result.get("clock", "wall")
    rows = result["rows"]
    bandwidth = {nt: sorted(r[f"bandwidth_gbs_{nt}t"] for r in rows) for nt in threads}
    if result["schedule"] == "block":
        how = (f"each method timed in its own block ({result['warmup_s']} s of warm-up, then "
               f"{result['repeats']} calls), {result['rounds']} rounds in rotated order, "
               "median of every call")
    else:
        how = (f"methods interleaved call by call, each after a {COOL_DOWN_S} s pause and an "
               f"untimed call, median of {result['repeats'] * result['rounds']} calls")
    lines = [
        f"One decode step (scores, softmax, context) over T rows for m queries that share them; "
        f"{how} ({'wall clock' if clock == 'wall' else 'thread CPU time'}); consumers on the "
        f"{result['simd']} path with "
        + ("numpy's softmax (the baseline's: the steps differ only in how they read the rows)"
           if result.get("softmax") == "numpy" else "the compiled softmax")
        + "; speedup = numpy f32 time / codec time on the same rows, queries "
        "and thread count; rounds = the lowest and highest of the per-round speedups (numpy's "
        "median over the codec's in one round): their spread is the machine's noise.",
        "Byte limit = bytes the step reads (every row twice: 2 T x B/row) / the read bandwidth "
        "measured in the same cell (numpy max over "
        f"{result['bandwidth_buffer_bytes'] >> 20} MiB): "
        + ", ".join(f"{nt}t {v[0]:.1f}-{v[-1]:.1f} GB/s" for nt, v in bandwidth.items())
        + "; of limit = byte limit / time (1.00 = at the machine's bandwidth); limit speedup = "
          "the speedup if both read at that bandwidth (f32 bytes / codec bytes).",
        "BLAS: " + "; ".join(f"{b['internal_api']} {b['version']} ({b['architecture']})"
                             for b in result["blas"])
        + f", OPENBLAS_CORETYPE={result['OPENBLAS_CORETYPE']}; load average at the end "
          f"{', '.join(f'{x:.2f}' for x in result['load_average'] or [])} on "
          f"{result['cpu_count']} cores.",
        POLAR_NOTE,
        "",
    ]
    if result.get("cold"):
        lines[-1:-1] = [
            f"Cold rows: each method's calls go round copies of its rows that hold "
            f"{COLD_CACHE_FACTOR}x the last-level cache ({result['cache_bytes'] >> 20} MiB), so "
            "every call reads rows evicted since their last use, as in a model's forward "
            "(copies per method in the CSV)."]
    head = (f"| d | T | codec | m | B/row | numpy {hi}t ms | codec {hi}t ms | speedup {hi}t "
            f"| rounds {hi}t | byte limit {hi}t ms | of limit {hi}t | limit speedup "
            f"| numpy of limit {hi}t |")
    rule = "|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"
    if lo != hi:
        head += (f" numpy {lo}t ms | codec {lo}t ms | speedup {lo}t | numpy {lo}t/{hi}t "
                 f"| codec {lo}t/{hi}t |")
        rule += "---:|---:|---:|---:|---:|"
    head += " flags |"
    rule += "---|"
    lines += [head, rule]
    for r in rows:
        codec = r["codec"] + (" (exempt)" if r.get("speed_exempt") else "")
        line = (f"| {r['dim']} | {r['T']} | {codec} | {r['queries']} | {r['bytes_per_row']} | "
                f"{r[f'numpy_ms_{hi}t']:.3f} | {r[f'codec_ms_{hi}t']:.3f} | "
                f"**{r[f'speedup_{hi}t']:.2f}x** | {r[f'speedup_rounds_lo_{hi}t']:.2f}-"
                f"{r[f'speedup_rounds_hi_{hi}t']:.2f}x | {r[f'limit_ms_{hi}t']:.3f} | "
                f"{r[f'fraction_{hi}t']:.2f} | {r['bytes_ratio']:.2f}x | "
                f"{r[f'numpy_fraction_{hi}t']:.2f} |")
        if lo != hi:
            line += (f" {r[f'numpy_ms_{lo}t']:.3f} | {r[f'codec_ms_{lo}t']:.3f} | "
                     f"{r[f'speedup_{lo}t']:.2f}x | {r['numpy_thread_scaling']:.2f}x | "
                     f"{r['thread_scaling']:.2f}x |")
        line += f" {r['flags']} |"
        lines.append(line)
    return "\n".join(lines)


def write_results(result, out_dir, stem):
    """Markdown, CSV and JSON files named by the run's parameters; returns their paths."""
    import csv
    base = os.path.join(out_dir, stem)
    atomic_write(base + ".md", lambda f: f.write(format_markdown(result) + "\n"))

    def write_csv(f):
        writer = csv.DictWriter(f, fieldnames=list(result["rows"][0]))
        writer.writeheader()
        writer.writerows(result["rows"])
    atomic_write(base + ".csv", write_csv)
    atomic_write(base + ".json", lambda f: json.dump(result, f, indent=1))
    return [base + ext for ext in (".md", ".csv", ".json")]


# -- command line ----------------------------------------------------------------------------

def _ints(text):
    from kvquant.budget import parse_tokens
    return [parse_tokens(x) for x in text.split(",") if x.strip()]


def max_threads():
    """The most threads ``--threads`` takes: four per CPU (a count far past the CPUs times
    nothing but the scheduler, and a million threads ran for minutes)."""
    return 4 * (os.cpu_count() or 1)


def _counts(text, option, what, example, most=None):
    """The comma-separated whole numbers of ``option`` (``"512,64"``; ``4k`` is 4096), each at
    least 1 and at most ``most``; the error names ``option``, ``what`` one number counts and
    an ``example`` of the option's value."""
    import re
    out = []
    for piece in (x.strip() for x in text.split(",")):
        if not piece:
            continue
        m = re.fullmatch(r"(\d+)\s*([kK]?)", piece)
        if not m:
            raise ValueError(f"{option}: cannot read {piece!r} as a {what}; give whole "
                             f"numbers such as {option} {example}")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 1:
            raise ValueError(f"{option}: a {what} must be at least 1, got {piece!r}")
        if most is not None and n > most:
            raise ValueError(f"{option}: a {what} must be at most {most} (4 per CPU of this "
                             f"machine's {os.cpu_count() or 1}), got {piece!r}")
        out.append(n)
    if not out:
        raise ValueError(f"{option} {text!r} names no {what}")
    return out


def cmd_bench(args):
    try:
        dims = _counts(args.dims, "--dims", "row width", "512,64")
        threads = _counts(args.threads, "--threads", "thread count", "1,2", max_threads())
        contexts = _ints(args.contexts)
        try:
            queries = [int(x) for x in args.queries.split(",") if x.strip()]
        except ValueError:
            queries = []
        codecs = split_spec_text(args.codecs)   # options stay with their spec
        for spec in codecs:
            if not any(_builds(spec, d) for d in dims):
                raise ValueError(f"codec {spec!r} is unknown or takes none of the widths {dims}")
        if not queries or min(queries) < 1:
            raise ValueError(f"--queries takes positive counts (query heads per KV head, e.g. "
                             f"1,3,4,8), got {args.queries!r}")
        if not codecs:
            raise ValueError(f"--codecs {args.codecs!r} names no codec")
        if not dims or not contexts or min(dims) < 1 or min(contexts) < 1:
            raise ValueError("--dims and --contexts take positive sizes")
        biggest = max(dims) * max(contexts) * 4
        if biggest > MAX_ROWS_BYTES:
            raise ValueError(f"T={max(contexts)} rows of width {max(dims)} are "
                             f"{biggest / 2**30:.1f} GiB of float32 (the baseline's rows), above "
                             f"the {MAX_ROWS_BYTES >> 30} GiB benchmarked at most")
        if not (math.isfinite(args.warmup_s) and args.warmup_s >= 0):
            raise ValueError(f"--warmup-s takes a finite number of seconds >= 0, got "
                             f"{args.warmup_s}")
        if args.cache_mib is not None and not (math.isfinite(args.cache_mib)
                                               and args.cache_mib > 0):
            raise ValueError(f"--cache-mib takes a positive size, got {args.cache_mib}")
        if args.seed < 0 or args.repeats < 1 or args.rounds < 1:
            raise ValueError("--seed must be >= 0, --repeats and --rounds >= 1")
        consumers.set_simd(args.simd)
        if args.out:        # before the timing, not after it
            check_out_dir(args.out)
    except ValueError as exc:
        raise SystemExit(f"kvquant bench: {exc}")

    def progress(row):
        if not args.json:
            hi = max(threads)
            print(f"  d={row['dim']:<4} m={row['queries']:<2} T={row['T']:<7} {row['codec']:<10} "
                  f"speedup {row[f'speedup_{hi}t']:.2f}x "
                  f"(rounds {row[f'speedup_rounds_lo_{hi}t']:.2f}-"
                  f"{row[f'speedup_rounds_hi_{hi}t']:.2f}x) at {hi} thread(s), "
                  f"{row[f'fraction_{hi}t']:.2f} of its byte limit"
                  + (f"  [{row['flags']}]" if row["flags"] else ""), flush=True)

    if not args.json:
        print(POLAR_NOTE, flush=True)
    try:
        cache_bytes = None if args.cache_mib is None else int(args.cache_mib * (1 << 20))
        if cache_bytes is not None and cache_bytes < 1:
            raise ValueError(f"--cache-mib takes a positive size, got {args.cache_mib}")
        result = run(dims, contexts, codecs, threads, args.repeats, args.seed, progress,
                     args.clock, queries, args.rounds, args.warmup_s, args.schedule,
                     args.cold, cache_bytes, args.softmax)
    except ValueError as exc:
        raise SystemExit(f"kvquant bench: {exc}")
    if args.out:
        try:
            paths = write_results(result, args.out, result_stem(dims, contexts, threads,
                                                                args.repeats, result["simd"],
                                                                args.clock, queries,
                                                                args.schedule, args.cold,
                                                                args.softmax))
        except OSError as exc:      # a full disk after the timing: a bench keeps no units
            raise SystemExit(f"kvquant bench: cannot write the results in {args.out} "
                             f"({exc.strerror or exc}); the timing is lost: free space there "
                             "or give another --out, then run the same command again") from None
        if not args.json:
            print("wrote " + ", ".join(paths))
    print(dumps_strict(result) if args.json else format_markdown(result))
    return 0


def add_cli(sub):
    p = sub.add_parser("bench", help="time one attention decode step on the compressed cache "
                                     "against numpy f32")
    p.add_argument("--dims", default=",".join(map(str, DEFAULT_DIMS)))
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                   help="cached rows T, e.g. 4096,32k,128k")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS))
    p.add_argument("--queries", default=",".join(map(str, DEFAULT_QUERIES)),
                   help="query heads that share one KV head (GQA), e.g. 1,3,4,8")
    p.add_argument("--threads", default=",".join(map(str, DEFAULT_THREADS)),
                   help="thread counts (the largest is the headline)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per block")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of blocks, order rotated (more rounds spread a changing load "
                        "more evenly over the methods)")
    p.add_argument("--warmup-s", type=float, default=WARMUP_S,
                   help="untimed calls for this long before each block")
    p.add_argument("--schedule", default="block", choices=SCHEDULES,
                   help="block (default): each method in its own warmed block; interleaved: "
                        "one call of each in turn, with pauses")
    p.add_argument("--cold", action="store_true",
                   help="read the rows from memory, not the caches: each call reads the next "
                        "of enough copies to hold 4x the last-level cache (as in a model's "
                        "forward)")
    p.add_argument("--cache-mib", type=float, default=None,
                   help="last-level cache size for --cold (default: read from the system)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--softmax", default="compiled", choices=SOFTMAXES,
                   help="the codecs' softmax: compiled (as the cache attends; default) or numpy "
                        "(the baseline's, so that the steps differ only in their reads)")
    p.add_argument("--simd", default="auto",
                   help="consumer path: auto or one this CPU runs (see kvquant info); every "
                        "path gives the same bits")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="wall (default) or thread: the calling thread's CPU time, robust to "
                        "other jobs on the machine (one thread only)")
    p.add_argument("--out", default=None, help="directory for .md/.csv/.json result files")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
    return p


def main(argv=None):
    """``kvquant bench ...`` (installed through the ``kvquant.commands`` entry points)."""
    from kvquant.cli import parse_subcommand
    args = parse_subcommand(add_cli, "bench", argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
