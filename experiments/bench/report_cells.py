"""The report's speed cells: encode throughput per codec, and one attention decode step
against T.

A decode step over T cached rows of width d, for one query q: ``s = scores(X, q) / sqrt(d)``,
``w = softmax(s)``, ``ctx = context(X, w)``. Each codec runs through its compressed-domain
consumers (``codec.scores`` / ``codec.context``: nothing decoded); the yardstick is numpy on the
float32 rows. The timing itself is ``kvquant bench``'s,
:func:`kvquant_experiments.bench.attention_step.time_cell` (each method warmed and timed in its
own block, rounds in rotated order, medians, BLAS held to the same thread count, the read
bandwidth measured in the cell and each time's byte limit); here it is one cell per (d, T), with
resume and the figure.

Encode throughput (and decode, for reference) is timed here per (codec, d)
(:func:`kvquant_experiments.bench.timing.time_call`).

Timings are run in one process, cells one after another (concurrent cells would time each
other). They are not reproducible numbers, so a resumed run keeps the stored ones; ask for a
fresh run to measure again.
"""
import os
import sys
from pathlib import Path

import numpy as np

from kvquant_experiments.bench.timing import time_call
from kvquant_experiments.common import (cell_stem, codec_status, environment, is_smoke,
                                        read_json, stable_seed, write_csv, write_json)
from kvquant_experiments.executor import SerialExecutor, run_cells, submit_cells

__all__ = ["collect", "default_grid", "encode_cell", "has_consumers", "run_speed", "step_cell"]

DEFAULT_CODECS = ["f32", "kv8", "kv8-g32", "tq2", "tq4", "tq8", "polar4", "q8_0", "q4_0"]
SMOKE_CODECS = ["f32", "kv8", "tq4"]
ENCODE_STEM = ("codec", "dim", "rows", "threads")


def default_grid(smoke=None):
    smoke = is_smoke() if smoke is None else smoke
    if smoke:   # bandwidth_mib: a buffer inside the caches, so smoke byte limits mean nothing
        return {"codecs": list(SMOKE_CODECS), "dims": [64], "T": [256, 1024],
                "encode_rows": 1024, "threads": [1], "repeats": 3, "rounds": 1,
                "warmup_s": 0.01, "bandwidth_mib": 16, "min_time_s": 0.01, "step_budget_s": 0.25}
    # two rounds (not three) keep the report within 4 minutes on 2 cores; kvquant bench and
    # the attention benchmarks of docs/speed.md time the published figures with more
    return {"codecs": list(DEFAULT_CODECS), "dims": [512, 128], "T": [1024, 4096, 16384, 65536],
            "encode_rows": 16384, "threads": [1, 2], "repeats": 3, "rounds": 2, "warmup_s": 0.1,
            "bandwidth_mib": 512, "min_time_s": 0.1, "step_budget_s": 0.25}


def has_consumers(codec):
    return callable(getattr(codec, "scores", None)) and callable(getattr(codec, "context", None))


def encode_cell(cell):
    """Encode throughput of one codec: rows/s and input MB/s (float32 rows)."""
    codec, reason = codec_status(cell["codec"], cell["dim"])
    if codec is None:
        return {"codec": cell["codec"], "available": False, "reason": reason}
    rng = np.random.default_rng(stable_seed("speed-rows", cell["dim"], cell["rows"]))
    X = rng.standard_normal((cell["rows"], cell["dim"])).astype(np.float32)
    n_threads = cell["threads"]
    enc = codec.encode(X, n_threads=n_threads)
    encode_s = time_call(lambda: codec.encode(X, n_threads=n_threads), cell["min_time_s"])
    decode_s = time_call(lambda: codec.decode(enc, n_threads=n_threads), cell["min_time_s"])
    mb = X.nbytes / 1e6
    return {"codec": cell["codec"], "available": True, "spec": codec.spec,
            "bits_per_value": float(codec.bits_per_value), "encode_s": encode_s,
            "decode_s": decode_s, "encode_rows_per_s": cell["rows"] / encode_s,
            "encode_mb_per_s": mb / encode_s, "decode_mb_per_s": mb / decode_s}


def step_cell(cell):
    """One (d, T) cell of the attention benchmark: ``attention_step.time_cell`` (numpy f32 and
    every codec's consumers, each in its own warmed block, medians, byte limits).

    Codecs that do not build here or have no consumers are returned in ``unavailable`` with the
    reason instead of being timed.
    """
    try:
        from kvquant_experiments.bench import attention_step as bench
    except ImportError as exc:
        return {"available": False, "reason": "kvquant_experiments.bench.attention_step is not "
                                              f"in this build ({exc})"}
    if not callable(getattr(bench, "time_cell", None)):
        return {"available": False,
                "reason": "kvquant_experiments.bench.attention_step has no time_cell()"}
    usable, unavailable = [], {}
    for spec in cell["codecs"]:
        codec, reason = codec_status(spec, cell["dim"])
        if codec is None:
            unavailable[spec] = reason
        elif not has_consumers(codec):
            unavailable[spec] = (f"{codec.spec} has no compressed-domain consumers "
                                 "(codec.scores / codec.context) in this build")
        else:
            usable.append(spec)
    threads = tuple(cell["threads"])
    timed = bench.time_cell(cell["dim"], cell["T"], usable, threads=threads,
                            repeats=cell["repeats"], rounds=cell["rounds"],
                            warmup_s=cell["warmup_s"],
                            bandwidth_buffer=np.ones(cell["bandwidth_mib"] << 18, np.float32))
    med, limit = timed["median"], timed["limit"]
    numpy_flags = bench.plausibility_flags("numpy", med["numpy"], limit["numpy"])
    rows = []
    for spec in usable:
        row = {"codec": spec, "bytes_per_row": timed["bytes_per_row"][spec],
               "context_rel_err": timed["errors"][spec],
               "speed_exempt": bench.is_speed_exempt(codec_status(spec, cell["dim"])[0])}
        for nt in threads:
            row[f"numpy_s_{nt}t"] = med["numpy"][nt]
            row[f"codec_s_{nt}t"] = med[spec][nt]
            row[f"speedup_{nt}t"] = med["numpy"][nt] / med[spec][nt]
            row[f"limit_s_{nt}t"] = limit[spec][nt]
            row[f"fraction_{nt}t"] = limit[spec][nt] / med[spec][nt]
            row[f"bandwidth_gbs_{nt}t"] = timed["bandwidth"][nt] / 1e9
        row["flags"] = "; ".join(bench.plausibility_flags(spec, med[spec], limit[spec])
                                 + numpy_flags)
        rows.append(row)
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"available": True, "rows": rows, "unavailable": unavailable, "load_average": load}


def _step_stem(c):
    codecs = format(stable_seed(c["codecs"]) & 0xFFFFFF, "06x")
    return (f"step_d{c['dim']}_T{c['T']}_n{len(c['codecs'])}-{codecs}"
            f"_t{'-'.join(map(str, c['threads']))}_r{c['repeats']}x{c['rounds']}"
            f"_w{c['warmup_s']}")


def run_speed(results_dir, codecs=None, dims=None, T=None, threads=None, resume=True,
              progress=True, smoke=None):
    """Encode throughput and decode-step cells, serially in this process.

    Writes ``speed_encode.csv``, ``speed_step.csv`` and ``speed.json``; returns
    ``{"encode": rows, "step": rows, "unavailable": {spec: reason}, "grid": grid}``.
    """
    grid = default_grid(smoke)
    for key, value in (("codecs", codecs), ("dims", dims), ("T", T), ("threads", threads)):
        if value is not None:
            grid[key] = list(value) if isinstance(value, (list, tuple)) else value
    results_dir = Path(results_dir)
    serial = SerialExecutor()
    enc_cells = [{"sweep": "speed_encode", "codec": c, "dim": int(d),
                  "rows": int(grid["encode_rows"]), "threads": int(min(grid["threads"])),
                  "min_time_s": grid["min_time_s"]}
                 for d in grid["dims"] for c in grid["codecs"]]
    enc = run_cells(encode_cell, enc_cells, results_dir / "speed",
                    lambda c: "encode_" + cell_stem(c, ENCODE_STEM), executor=serial,
                    resume=resume, progress=progress, desc="encode speed")
    # Per d, T ascending: a codec whose step exceeds the budget at some T is not timed at larger
    # T (named in the report), so one slow consumer cannot hold the report for minutes.
    step_cells, steps, slow = [], [], {}
    reused_steps = 0
    for d in grid["dims"]:
        timed = list(grid["codecs"])
        for t in sorted(grid["T"]):
            cell = {"sweep": "speed_step", "dim": int(d), "T": int(t), "codecs": timed,
                    "threads": [int(n) for n in grid["threads"]], "repeats": grid["repeats"],
                    "rounds": grid["rounds"], "warmup_s": grid["warmup_s"],
                    "bandwidth_mib": grid["bandwidth_mib"]}
            batch = submit_cells(step_cell, [cell], results_dir / "speed", _step_stem,
                                 executor=serial, resume=resume, progress=False)
            result = batch.wait()[0]
            reused_steps += batch.reused
            step_cells.append(cell)
            steps.append(result)
            nt = min(cell["threads"])
            for row in result.get("rows", []):
                if row[f"codec_s_{nt}t"] > grid["step_budget_s"]:
                    timed = [c for c in timed if c != row["codec"]]
                    slow.setdefault(row["codec"], []).append(
                        f"beyond T = {t} at d = {d} ({row[f'codec_s_{nt}t']:.2f} s per step)")
    if reused_steps and progress is not None:
        print(f"decode-step speed: reused {reused_steps} stored timing cells from "
              f"{results_dir / 'speed'} (timings of an earlier run, not re-timed; --fresh "
              "re-times them)", file=sys.stderr, flush=True)
    enc_rows = [{"dim": c["dim"], "rows": c["rows"], "threads": c["threads"], **r}
                for c, r in zip(enc_cells, enc)]
    loads = [r["load_average"] for r in steps if r.get("load_average")]
    load = [max(x[i] for x in loads) for i in range(3)] if loads else None
    step_rows, unavailable = [], {}
    for c, r in zip(step_cells, steps):
        if not r.get("available"):
            unavailable["*"] = r.get("reason")
            continue
        unavailable.update(r["unavailable"])
        step_rows += [{"dim": c["dim"], "T": c["T"], **row} for row in r["rows"]]
    for r in enc_rows:
        if not r.get("available"):
            unavailable.setdefault(r["codec"], r.get("reason"))
    for spec, where in slow.items():
        unavailable.setdefault(spec, "not timed " + "; ".join(where)
                               + f": over the budget of {grid['step_budget_s']} s per step")
    write_csv(results_dir / "speed_encode.csv", enc_rows)
    if step_rows:
        write_csv(results_dir / "speed_step.csv", step_rows)
    write_json(results_dir / "speed.json", {"grid": grid, "environment": environment(),
                                            "encode": enc_rows, "step": step_rows,
                                            "unavailable": unavailable, "load_average": load})
    return {"encode": enc_rows, "step": step_rows, "unavailable": unavailable, "grid": grid,
            "load_average": load, "reused_steps": reused_steps}


def collect(results_dir):
    return read_json(Path(results_dir) / "speed.json")


if __name__ == "__main__":
    sys.exit("kvquant_experiments.bench.report_cells is a section of the report, not a command: "
             "run kvquant report (kvquant report --help), or kvquant distortion for one table")
