"""How the speed benchmarks time a call: clocks, warm-up, a block of timed calls, the order of
methods over rounds, BLAS held to a thread count, and the BLAS a run ran on.

The benchmarks time each method in a block of its own (warm-up calls, then timed calls back to
back) rather than one call of each in turn: OpenBLAS's workers busy-wait after a call and
libgomp's after a parallel region, so a call of one method right after another's would compete
with the other's spinning threads. Blocks run in rounds whose order changes every round, so that
a load that comes and goes on a shared machine falls on every method alike.

Where a benchmark times differently on purpose (an adaptive number of calls, the best of calls
interleaved over methods, copies of the rows visited in turn), it keeps its own loop and says why.
"""
import contextlib
import os
import time

import numpy as np

__all__ = ["CLOCKS", "blas_info", "blas_limited", "block_times", "mirrored", "rotated",
           "time_call", "warm_up"]

# wall: the elapsed time; thread: the calling thread's CPU time, which leaves out the time the
# process waits for a core on a shared machine (meaningful with one thread only)
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def warm_up(fn, calls=0, seconds=0.0):
    """Untimed calls of ``fn()``: at least ``calls`` of them, and for at least ``seconds``.

    Returns
    -------
    int
        The calls made.
    """
    t_end = time.perf_counter() + seconds
    made = 0
    while made < calls or time.perf_counter() < t_end:
        fn()
        made += 1
    return made


def block_times(fn, repeats, clock=None):
    """Seconds of each of ``repeats`` calls of ``fn()`` back to back (warm it first).

    Parameters
    ----------
    fn : callable
    repeats : int
    clock : callable, optional
        Seconds now (:data:`CLOCKS`); default ``time.perf_counter``, looked up at each call so
        that a test's fake clock reaches it.

    Returns
    -------
    list of float
    """
    clock = time.perf_counter if clock is None else clock
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def time_call(fn, min_time_s=0.2, min_repeats=5, max_repeats=10000):
    """Median seconds of one call of ``fn()`` (after one warm-up call).

    Unlike :func:`block_times`, the number of calls adapts: at least ``min_repeats``, and more
    until they add up to ``min_time_s`` (at most ``max_repeats``), so that a fast method gets as
    many samples as its time allows.
    """
    fn()
    times = []
    total = 0.0
    while len(times) < min_repeats or (total < min_time_s and len(times) < max_repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        total += dt
    return float(np.median(times))


def rotated(methods, round_index):
    """``methods`` in the order of round ``round_index``: rotated by one place a round, so that
    every method comes first (after the same neighbour) as often as the others."""
    k = round_index % len(methods)
    return methods[k:] + methods[:k]


def mirrored(methods, round_index):
    """``methods`` in order on even rounds and reversed on odd ones (for a few methods whose
    blocks are long: each is as often early as late)."""
    order = list(methods)
    return order if round_index % 2 == 0 else order[::-1]


def blas_limited(n_threads, controller=None):
    """Context manager holding BLAS (numpy's products) to ``n_threads`` threads; ``None``: BLAS
    left as it is. ``controller``: a ``threadpoolctl.ThreadpoolController`` to reuse (making one
    scans the loaded libraries)."""
    if n_threads is None:
        return contextlib.nullcontext()
    if controller is None:
        from threadpoolctl import ThreadpoolController
        controller = ThreadpoolController()
    return controller.limit(limits=n_threads, user_api="blas")


def blas_info():
    """The BLAS numpy runs (threadpoolctl) and the environment knobs that change its speed."""
    from threadpoolctl import threadpool_info
    libs = [{k: lib.get(k) for k in ("internal_api", "version", "architecture", "num_threads",
                                     "threading_layer", "filepath")}
            for lib in threadpool_info() if lib.get("user_api") == "blas"]
    knobs = ("OPENBLAS_CORETYPE", "OMP_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT",
             "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    return {"blas": libs, **{k: os.environ.get(k) for k in knobs}}
