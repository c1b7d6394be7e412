"""Calibrated stream statistics: measure them on a calibration text, and what they change.

``measure``: the f32 K and V rows of a model over a text's chunks (one prefill each, the rows
after RoPE as the cache stores them), pooled per layer, stream and KV head, give the offsets and
channel scales of ``center=calib`` / ``normalize=calib``
(:class:`kvquant.streams.calibration.StreamStatistics`), written to a ``.npz``::

    nice -n 10 python -m kvquant_experiments.calibrate measure --model smollm2 --text pydoc \\
        --positions 1024 --out data/calibration/smollm2-pydoc-N1024-c512.npz

``compare``: on another (held-out) text, each pair with first-append statistics against the
same pair with calibrated ones, in two ways of filling the cache:

* ``prefill``: each chunk in one prefill (the first append is the whole chunk);
* ``decode-only``: the first token alone, then the rest (the first append is one row, as a
  stream fed one token at a time, or started empty, gets: its offset is that row and its
  scales all ones). The rows' codes are those one-token appends would store; attention reads
  the rest of the chunk through the decoded-block prefill, which agrees with one-query decode
  steps to rounding.

::

    nice -n 10 python -m kvquant_experiments.calibrate compare --model smollm2 --text code \\
        --calibration data/calibration/smollm2-pydoc-N1024-c512.npz --positions 1024 \\
        --out data/results

writes ``calibration-<model>-<text>-N<positions>-c<chunk>.{json,csv,md}``.
"""
import os
import sys
import time

import numpy as np

from kvquant.outputs import atomic_write
from .common import environment, write_csv, write_json
from .study import FILE, FOLDER, Output, add_quiet_argument, add_subcommand, study_main

__all__ = ["CALIBRATION_PAIRS", "compare_calibration", "measure_statistics", "pair_specs"]

_H = ":side_dtype=f16"
# the frontier's picks at <= 3.5 and <= 4.5 bits (without a recent window): first-append
# statistics, and the same pair calibrated
CALIBRATION_PAIRS = [
    f"polar4{_H}@center,normalize,sinks=1/polar3{_H}@center,sinks=1",
    f"polar5{_H}@center,normalize,sinks=1/polar4{_H}@center,sinks=1",
]
MODES = ("prefill", "decode-only")


def pair_specs(text):
    """The :class:`~kvquant.specs.PairSpec` of each item of ``--pairs``: pair specs separated by
    ``;`` (their options hold commas). A spec that is no pair, or whose codec does not exist, is
    a ValueError naming it."""
    from kvquant.codecs import describe_codec
    from kvquant.specs import PairSpec, parse_cache_spec, split_spec_text
    pairs = []
    for item in split_spec_text(text, separator=";"):
        pair = parse_cache_spec(item)
        if not isinstance(pair, PairSpec):
            raise ValueError(f"{pair.text!r} is a {pair.kind} spec; calibrated statistics apply "
                             "to a pair spec's streams")
        for stream in pair.streams:
            describe_codec(stream.codec_spec)      # an unknown codec is named here
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"no pair spec in {text!r}")
    return pairs


def _pairs_argument(text):
    import argparse
    try:
        return pair_specs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def calibrated(pair_spec):
    """The pair with ``center``/``normalize`` taken from the calibration (``center=calib``)."""
    from dataclasses import replace

    from kvquant.specs import PairSpec, parse_cache_spec
    from kvquant.streams.spec import StreamSpec
    pair = parse_cache_spec(pair_spec)
    if not isinstance(pair, PairSpec):
        raise ValueError(f"{pair.text!r}: calibrated statistics apply to a pair spec's streams")
    streams = [StreamSpec(s.codec_spec, replace(s.options, calibrated=s.options.center
                                                 or s.options.normalize))
               for s in pair.streams]
    # both sides written out: a plan stores the two streams' texts
    return "/".join(map(str, streams))


def _chunks(model, text, positions, chunk_tokens):
    from kvquant import flips
    from kvquant_experiments.texts import load_text, text_tokens
    tokens, resolved = text_tokens(model, load_text(text))
    return resolved, flips.text_chunks(tokens, positions, chunk_tokens, bos=model.bos_token_id)


def measure_statistics(model, text="pydoc", positions=1024, chunk_tokens=512, model_name=None):
    """:class:`~kvquant.streams.calibration.StreamStatistics` of the model's f32 K and V rows over
    the text's chunks (offsets and scales for both streams)."""
    from kvquant.streams.calibration import StreamStatistics
    resolved, chunks = _chunks(model, text, positions, chunk_tokens)
    L, H = model.n_layers, model.n_kv_heads
    rows = {"k": [[] for _ in range(L)], "v": [[] for _ in range(L)]}
    for _, ids in chunks:
        cache = model.new_cache("f32")
        model.forward_hidden(np.asarray(ids)[:-1], cache)
        for layer in range(L):
            for name in rows:
                rows[name][layer].append(np.stack(
                    [cache.stream(layer, name, h).decode() for h in range(H)], axis=1))
    pooled = {name: [np.concatenate(parts) for parts in per_layer]
              for name, per_layer in rows.items()}
    meta = {"model": str(model_name or model.describe().get("model")),
            "text": resolved.describe(), "positions": int(positions),
            "chunk_tokens": int(chunk_tokens), "rows_per_head": int(pooled["k"][0].shape[0]),
            "rows": "K after RoPE and V, f32 cache, one prefill per chunk"}
    return StreamStatistics.from_rows(pooled, meta=meta)


def _kld(model, spec, ids, ref, mode):
    from kvquant.flips import kl_rows
    ids = np.asarray(ids)[:-1]
    cache = model.new_cache(spec)
    if mode == "prefill":
        hidden = model.forward_hidden(ids, cache)
    else:
        hidden = np.concatenate([model.forward_hidden(ids[:1], cache),
                                 model.forward_hidden(ids[1:], cache)])
    return kl_rows(ref, model.logits(hidden))


def compare_calibration(model, calibration, text="code", positions=1024, chunk_tokens=512,
                        pairs=CALIBRATION_PAIRS, progress=None, model_name=None):
    """Mean KLD (against the f32 cache) of each pair (a pair spec or its text) with
    first-append and calibrated statistics, in both modes; rows with the paired difference per
    position."""
    from kvquant.models.plan import CachePlan
    from kvquant.specs import parse_cache_spec
    pairs = [parse_cache_spec(p) for p in pairs]
    say = progress or (lambda msg: None)
    resolved, chunks = _chunks(model, text, positions, chunk_tokens)
    L, H = model.n_layers, model.n_kv_heads
    refs = [model.logits(model.forward_hidden(np.asarray(ids)[:-1], model.new_cache("f32")))
            for _, ids in chunks]
    rows = []
    for pair in pairs:
        plans = {"first-append": pair,
                 "calibrated": CachePlan.uniform(calibrated(pair), L, H, calibration)}
        for mode in MODES:
            klds = {}
            for stats, spec in plans.items():
                t0 = time.perf_counter()
                klds[stats] = np.concatenate([_kld(model, spec, ids, ref, mode)
                                              for (_, ids), ref in zip(chunks, refs)])
                say(f"{pair} {mode} {stats}: mean KLD {klds[stats].mean():.4e} "
                    f"({time.perf_counter() - t0:.0f} s)")
            diff = klds["calibrated"] - klds["first-append"]
            for stats, kld in klds.items():
                rows.append({"pair": pair.text, "mode": mode, "statistics": stats,
                             "spec": pair.text if stats == "first-append" else calibrated(pair),
                             "kld_mean": float(kld.mean()),
                             "kld_mean_se": float(kld.std(ddof=1) / np.sqrt(kld.size)),
                             "calibrated_minus_first": float(diff.mean()),
                             "calibrated_minus_first_se": float(
                                 diff.std(ddof=1) / np.sqrt(diff.size))})
    meta = {"model_name": str(model_name), "model": model.describe(),
            "calibration": os.path.relpath(calibration) if isinstance(calibration, str)
            else None,
            "text": {**resolved.describe(), "positions": int(positions),
                     "chunk_tokens": int(chunk_tokens),
                     "chunk_starts": [int(s) for s, _ in chunks]},
            "modes": {"prefill": "each chunk in one prefill",
                      "decode-only": "the first token alone, then the rest of the chunk"}}
    return {"meta": meta, "rows": rows}


CSV_COLUMNS = ["pair", "mode", "statistics", "spec", "kld_mean", "kld_mean_se",
               "calibrated_minus_first", "calibrated_minus_first_se"]


def format_markdown(result):
    meta = result["meta"]
    t = meta["text"]
    lines = [f"{meta['model']['model']}: mean KLD against the f32 cache, {t['positions']} "
             f"positions of {t['source']} in chunks of {t['chunk_tokens']}; calibrated "
             f"statistics from {meta['calibration']}. decode-only: each chunk's first token "
             "alone, then the rest (the first append is one row).", "",
             "| pair | mode | first-append KLD ± SE | calibrated KLD ± SE | calibrated - first "
             "± SE (paired) |", "|---|---|---|---|---|"]
    by = {(r["pair"], r["mode"], r["statistics"]): r for r in result["rows"]}
    for pair in dict.fromkeys(r["pair"] for r in result["rows"]):
        for mode in MODES:
            a, b = by[(pair, mode, "first-append")], by[(pair, mode, "calibrated")]
            lines.append(f"| {pair} | {mode} | {a['kld_mean']:.4e} ± {a['kld_mean_se']:.1e} | "
                         f"{b['kld_mean']:.4e} ± {b['kld_mean_se']:.1e} | "
                         f"{b['calibrated_minus_first']:+.3e} ± "
                         f"{b['calibrated_minus_first_se']:.1e} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line (kvquant_experiments.study)
# --------------------------------------------------------------------------------------------
RESUMES = False         # both commands write their files when they end


def add_arguments(p):
    sub = p.add_subparsers(dest="command", required=True)
    m = add_subcommand(sub, "measure", "measure the statistics on a calibration text")
    c = add_subcommand(sub, "compare", "first-append against calibrated statistics")
    for q in (m, c):
        q.add_argument("--model", default="smollm2")
        q.add_argument("--positions", type=int, default=1024)
        q.add_argument("--chunk-tokens", type=int, default=512)
        q.add_argument("--out", required=True, help="measure: the .npz to write; compare: a "
                                                     "folder")
        add_quiet_argument(q)
    m.add_argument("--text", default="pydoc", help="the calibration text")
    c.add_argument("--text", default="code", help="a held-out text")
    c.add_argument("--calibration", required=True, help="the .npz `measure` wrote")
    c.add_argument("--pairs", default=None, type=_pairs_argument,
                   help="';'-separated pair specs (default: the frontier's 3.5- and 4.5-bit "
                        "picks)")


def outputs(args):
    return [Output(args.out, FILE if args.command == "measure" else FOLDER)]


def run(args, progress):
    from kvquant.models import load_model
    from kvquant_experiments.models import model_tag
    model = load_model(args.model)
    if args.command == "measure":
        stats = measure_statistics(model, args.text, args.positions, args.chunk_tokens,
                                   args.model)
        stats.save(args.out)
        print(f"wrote {args.out} ({stats.digest()})")
        return 0
    pairs = args.pairs or CALIBRATION_PAIRS
    result = compare_calibration(model, args.calibration, args.text, args.positions,
                                 args.chunk_tokens, pairs, progress, args.model)
    result["environment"] = environment()
    t = result["meta"]["text"]
    stem = os.path.join(args.out, f"calibration-{model_tag(args.model)}-{t['name']}-"
                                  f"N{t['positions']}-c{t['chunk_tokens']}")
    os.makedirs(args.out, exist_ok=True)
    write_json(stem + ".json", result)
    write_csv(stem + ".csv", result["rows"], CSV_COLUMNS)
    text = format_markdown(result)
    atomic_write(stem + ".md", lambda f: f.write(text + "\n"))
    print(text)
    print(f"wrote {stem}.json, .csv, .md")
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
