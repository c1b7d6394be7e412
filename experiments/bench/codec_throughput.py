"""Codec throughput: encode and decode rows/s of the compiled codecs against their numpy references.

For each width d and codec, times ``codec.encode`` and ``codec.decode`` on Gaussian rows (median
of ``--repeats``, ``--threads`` OpenMP threads) and the plain-numpy reference of the same codec
from :mod:`kvquant.reference` (on ``--ref-rows`` rows, BLAS held to the same thread count), prints
a table and writes CSV + JSON named by the parameters, e.g.
``codec_throughput_d128-512_rows65536_t2.csv``, into ``--out`` (default: a folder of that name
under the current directory). The whole-array references (f32 copy, q8_0, q4_0)
run on all the rows; the others (Python loops, large temporaries) on the first ``--ref-rows``.

Read on a loaded machine through ratios taken in the same run: a fixed numpy yardstick (the
numpy q8_0 reference encoder on ``--yard-rows`` rows) is timed in a block of ``--repeats`` calls
right before and right after each codec's block of encode calls, so both see about the same load
while every method is timed in its own block (a numpy call between two encode calls would leave
BLAS and OpenMP workers spinning on the cores the encoder needs), and ``enc/yard`` (the codec's
encode rate over the yardstick's median rate) moves little when the machine is busy; ``x tq4``
is a tq<b> codec's encode time over tq4's at the same width (the encoders aim to stay within
1.5), tq4's encoder timed the same way, in a block right before and right after each tq<b>
block, so that the two are compared at the same moment (codecs timed a minute apart on a shared
machine differed by up to 2x). Every codec, reference and the yardstick get an untimed warm-up
call first.

    python -m kvquant_experiments.bench.codec_throughput        # d = 128, 512; 65536 rows
    python -m kvquant_experiments.bench.codec_throughput --rows 4096 --repeats 3  # a quick look
    python -m kvquant_experiments.bench.codec_throughput --codecs "tq4;tq5;tq8"   # ';'-separated
"""
import argparse
import os
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from kvquant import get_codec, reference
from kvquant.specs import split_spec_text
from kvquant_experiments.bench.timing import block_times
from kvquant_experiments.common import environment, write_csv, write_json

# references that are whole-array numpy (no Python loop, no (rows, d, levels) temporaries)
FULL_SIZE_REFERENCES = ("f32", "q8_0", "q4_0")
CODECS = ("f32", "kv8", "tq2", "tq3", "tq4", "tq5", "tq6", "tq8", "tq4:compat=colibri", "polar4",
          "polar4:alloc=level", "polar4:compat=colibri", "q8_0", "q4_0", "q4_0+rot")


def _polar_tables(codec):
    cb = codec.codebooks
    return (cb.centroids64, cb.log2_cos2, cb.log2_sin2, cb.gains, codec.level_total_bits,
            codec.alloc)


def numpy_reference(codec):
    """``(encode, decode)`` callables of the plain-numpy reference of ``codec``, or None."""
    spec, d = codec.spec, codec.dim
    if spec == "f32":
        return (lambda X: X.view(np.uint8).copy()), (lambda c: c.view(np.float32).copy())
    if spec == "kv8":
        return (lambda X: reference.fp8_encode_rows(X),
                lambda enc: reference.fp8_decode_rows(*enc))
    if spec == "tq4:compat=colibri":
        levels = codec.levels64
        return (lambda X: reference.engine_tq4_encode_rows(X, levels),
                lambda enc: reference.tq_decode_rows(enc[0], enc[1], levels, 4, d))
    if codec.family == "tq":
        levels, bits = codec.levels64, codec.bits
        return (lambda X: reference.tq_encode_rows(X, levels, bits),
                lambda enc: reference.tq_decode_rows(enc[0], enc[1], levels, bits, d))
    if codec.family == "polar" and codec.compat:
        bits = codec.bits
        return (lambda X: reference.polar_engine_encode_rows(X, bits),
                lambda enc: reference.polar_engine_decode_rows(enc[0], enc[1], bits, d))
    if codec.family == "polar":
        tables = _polar_tables(codec)
        return (lambda X: reference.polar_lloyd_encode_rows(X, *tables),
                lambda enc: reference.polar_lloyd_decode_rows(enc[0], enc[1], *tables, d))
    if spec in ("q8_0", "q4_0"):
        enc_fn = getattr(reference, f"{spec}_encode_rows")
        dec_fn = getattr(reference, f"{spec}_decode_rows")
        return enc_fn, (lambda c: dec_fn(c, d))
    if spec in ("q8_0+rot", "q4_0+rot"):
        kind = spec[:4]
        enc_fn = getattr(reference, f"{kind}_encode_rows")
        dec_fn = getattr(reference, f"{kind}_decode_rows")
        return ((lambda X: enc_fn(reference.rotate(X).astype(np.float32))),
                (lambda c: reference.unrotate(dec_fn(c, d))))
    return None


# Its own loop rather than timing.block_times: it keeps the last call's output (the encoded rows
# that the decode is then timed on) without a call more.
def _median_time(fn, arg, repeats):
    """Median seconds of ``fn(arg)`` over ``repeats`` calls, and its last output."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(arg)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def yardstick(X_yard, threads):
    """The fixed numpy workload timed around every codec's encode block: q8_0's numpy reference
    encoder."""
    def run():
        with threadpool_limits(limits=threads):
            reference.q8_0_encode_rows(X_yard)
    return run


def bench_one(spec, d, X, X_ref, repeats, ref_repeats, threads, yard=None):
    codec = get_codec(spec, d)
    codec.decode(codec.encode(X[:256], n_threads=threads), n_threads=threads)   # warm-up
    # blocks timed right before and right after the encoder's: the yardstick, and for a tq<b>
    # codec tq4's encoder (each warmed)
    around = {"yard": yard}
    if codec.family == "tq" and codec.spec != "tq4":
        tq4 = get_codec("tq4", d)
        around["tq4"] = lambda: tq4.encode(X, n_threads=threads)
    times = {name: [] for name, fn in around.items() if fn is not None}
    for name in times:
        around[name]()
        times[name] += block_times(around[name], repeats)
    enc_s, enc = _median_time(lambda A: codec.encode(A, n_threads=threads), X, repeats)
    for name in reversed(list(times)):   # mirrored: the nearest blocks before and after alike
        times[name] += block_times(around[name], repeats)
    yard_s = float(np.median(times["yard"])) if "yard" in times else None
    dec_s, _ = _median_time(lambda e: codec.decode(e, n_threads=threads), enc, repeats)
    row = {"codec": spec, "dim": d, "bytes_per_row": codec.bytes_per_row,
           "bits_per_value": codec.bits_per_value, "rows": X.shape[0],
           "encode_rows_per_s": X.shape[0] / enc_s, "decode_rows_per_s": X.shape[0] / dec_s,
           "yard_s": yard_s, "encode_over_yard": None,
           "encode_time_over_tq4": (enc_s / float(np.median(times["tq4"])) if "tq4" in times
                                    else 1.0 if spec == "tq4" else None),
           "ref_rows": None, "ref_encode_rows_per_s": None, "ref_decode_rows_per_s": None,
           "encode_speedup": None, "decode_speedup": None}
    ref = numpy_reference(codec)
    if ref is not None:
        ref_encode, ref_decode = ref
        # vectorized references run on the same rows; the slow ones on the first --ref-rows
        X_ref = X if spec in FULL_SIZE_REFERENCES else X_ref
        with threadpool_limits(limits=threads):
            ref_decode(ref_encode(X_ref[:64]))                          # warm-up
            ref_enc_s, ref_enc = _median_time(ref_encode, X_ref, ref_repeats)
            ref_dec_s, _ = _median_time(ref_decode, ref_enc, ref_repeats)
        row.update(ref_rows=X_ref.shape[0],
                   ref_encode_rows_per_s=X_ref.shape[0] / ref_enc_s,
                   ref_decode_rows_per_s=X_ref.shape[0] / ref_dec_s)
        row["encode_speedup"] = row["encode_rows_per_s"] / row["ref_encode_rows_per_s"]
        row["decode_speedup"] = row["decode_rows_per_s"] / row["ref_decode_rows_per_s"]
    return row


def add_ratios(rows, yard_rows):
    """``encode_over_yard``: the codec's encode rows/s over the yardstick's, timed in blocks
    around the codec's. (``encode_time_over_tq4`` is set by :func:`bench_one`.)"""
    for r in rows:
        if r["yard_s"]:
            r["encode_over_yard"] = r["encode_rows_per_s"] / (yard_rows / r["yard_s"])
    return rows


def _rate(x):
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"


def format_table(rows):
    head = (f"| {'codec':<22} | {'d':>4} | {'B/row':>5} | {'encode/s':>9} | {'decode/s':>9} | "
            f"{'numpy rows':>10} | {'numpy enc/s':>11} | {'numpy dec/s':>11} | {'enc x':>6} | "
            f"{'dec x':>6} | {'enc/yard':>8} | {'x tq4':>5} |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        ratio = (lambda v: "-" if v is None else (f"{v:.0f}" if v >= 10 else f"{v:.2f}"))
        lines.append(
            f"| {r['codec']:<22} | {r['dim']:>4} | {r['bytes_per_row']:>5} | "
            f"{_rate(r['encode_rows_per_s']):>9} | {_rate(r['decode_rows_per_s']):>9} | "
            f"{r['ref_rows'] or '-':>10} | "
            f"{_rate(r['ref_encode_rows_per_s']):>11} | {_rate(r['ref_decode_rows_per_s']):>11} | "
            f"{ratio(r['encode_speedup']):>6} | {ratio(r['decode_speedup']):>6} | "
            f"{ratio(r.get('encode_over_yard')):>8} | {ratio(r.get('encode_time_over_tq4')):>5} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="128,512")
    p.add_argument("--rows", type=int, default=65536, help="rows per timed call")
    p.add_argument("--ref-rows", type=int, default=1024,
                   help="rows for the (slow) numpy references")
    p.add_argument("--codecs", default=",".join(CODECS),
                   help="';'-separated specs (commas belong to spec options)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ref-repeats", type=int, default=3)
    p.add_argument("--yard-rows", type=int, default=4096,
                   help="rows of the numpy yardstick timed in a block before and after each "
                        "codec's encode block (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="output folder (default: a folder named for the run, under the current "
                        "directory)")
    args = p.parse_args(argv)

    dims = [int(x) for x in args.dims.split(",") if x.strip()]
    # ';' between specs (docs/speed.md's commands), or ',' with options kept with their spec
    codecs = split_spec_text(args.codecs, ";" if ";" in args.codecs else ",")
    rng = np.random.default_rng(args.seed)
    rows = []
    for d in dims:
        X = rng.standard_normal((args.rows, d)).astype(np.float32)
        X_ref = np.ascontiguousarray(X[:args.ref_rows])
        yard = (yardstick(np.ascontiguousarray(X[:args.yard_rows]), args.threads)
                if args.yard_rows > 0 else None)
        for spec in codecs:
            row = bench_one(spec, d, X, X_ref, args.repeats, args.ref_repeats, args.threads, yard)
            rows.append(row)
            print(f"  d={d} {spec}: encode {_rate(row['encode_rows_per_s'])}/s, "
                  f"decode {_rate(row['decode_rows_per_s'])}/s", file=sys.stderr, flush=True)
    add_ratios(rows, min(args.yard_rows, args.rows))
    stem = (f"codec_throughput_d{'-'.join(map(str, dims))}_rows{args.rows}_t{args.threads}")
    meta = {"dims": dims, "rows": args.rows, "ref_rows": args.ref_rows, "threads": args.threads,
            "repeats": args.repeats, "ref_repeats": args.ref_repeats, "seed": args.seed,
            "yard_rows": args.yard_rows,
            "yardstick": "numpy q8_0 reference encoder, timed in a block of repeats before and "
                         "after each codec's encode block (median of both)",
            "statistic": "median of repeats; rows/s = rows / seconds per call",
            "environment": environment()}
    out = args.out or stem
    csv_path = write_csv(os.path.join(out, stem + ".csv"), rows)
    json_path = write_json(os.path.join(out, stem + ".json"), {**meta, "results": rows})
    print(format_table(rows))
    print(f"\nwrote {csv_path}, {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
