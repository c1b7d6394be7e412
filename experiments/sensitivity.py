"""Where bits pay: the KLD a model loses when one layer's K or V rows (or one KV head's) take
one bit fewer (or more) than a base configuration, every other row staying at the base.

Each *unit* (layer, stream ``k`` / ``v``, and with ``--heads`` KV head) in turn gets the base
spec shifted by ``--step`` bits (``polar4`` -> ``polar3``, ``tq5`` -> ``tq4``; the spec's other
options kept), through a cache plan (:class:`kvquant.models.plan.CachePlan`). The model runs the
frontier's text chunks (:func:`kvquant.flips.text_chunks`, one prefill each from an empty
cache) and the mean KL(p_f32 || p) over their positions is compared with the base's on the same
positions: ``delta_kld`` (paired, with the standard error of the per-position differences,
nominal: positions of a chunk share a context). The bit allocator
(:mod:`kvquant_experiments.allocate`) reads the result.

Run (resumable: units already in ``--out``'s result file are not run again)::

    nice -n 10 python -m kvquant_experiments.sensitivity --model smollm2 --text pydoc \\
        --base "polar4:side_dtype=f16@center,normalize,sinks=1/polar3:side_dtype=f16@center,sinks=1" \\
        --positions 512 --step -1 --out data/results

Writes ``sensitivity-<model>-<text>-N<positions>-c<chunk>-<layers|heads>-step<step>-<base
tag>.{json,csv}``.
"""
import hashlib
import json
import os
import sys
import time

import numpy as np

from .common import environment, write_csv, write_json
from .study import Output, add_quiet_argument, study_main

__all__ = ["CSV_COLUMNS", "result_stem", "run_sensitivity", "shift_bits", "units_of"]

def _laddered(stream_spec):
    """The :class:`~kvquant.streams.spec.StreamSpec` of ``stream_spec``, whose codec's name must
    carry a bit width (:attr:`~kvquant.streams.spec.StreamSpec.bits`)."""
    from kvquant.streams.spec import StreamSpec
    spec = StreamSpec.of(stream_spec)
    if spec.bits is None:
        raise ValueError(f"{str(spec)!r}: only polar<b> and tq<b> specs have a bit width to "
                         "shift")
    return spec


def shift_bits(stream_spec, step):
    """``stream_spec`` (a string or StreamSpec) with its codec's bit width moved by ``step``
    (``"polar4@center"``, -1 -> ``"polar3@center"``), as text; None when the width leaves the
    family's range (polar 2..6, tq 1..8). A codec without a bit ladder (kv8, q8_0, f32) raises
    ValueError."""
    spec = _laddered(stream_spec)
    bits = spec.bits + int(step)
    if bits not in spec.bit_widths:
        return None
    return str(spec.with_bits(bits))


def spec_bits(stream_spec):
    """The bit width of a polar<b> / tq<b> stream spec."""
    return _laddered(stream_spec).bits


def units_of(n_layers, n_kv_heads, heads=False, group=1):
    """The units of a scan: (first layer, stream, head or None), layers outermost; a unit
    spans ``group`` layers (a coarse scan; the last group may be shorter)."""
    return [(layer, stream, head) for layer in range(0, n_layers, group) for stream in ("k", "v")
            for head in (range(n_kv_heads) if heads else (None,))]


def unit_layers(unit, group, n_layers):
    """The layers a unit spans."""
    return range(unit[0], min(unit[0] + group, n_layers))


def _unit_plan(base, unit, step, group=1):
    _, stream, head = unit
    plan = base
    for layer in unit_layers(unit, group, base.n_layers):
        spec = base.head_specs(layer, stream)[0 if head is None else head]
        shifted = shift_bits(spec, step)
        if shifted is None:
            return None
        plan = plan.with_unit(layer, stream, shifted, head)
    return plan


def _tag(text):
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def result_stem(model_name, text, positions, chunk_tokens, heads, step, base, group=1):
    from kvquant_experiments.models import model_tag
    return (f"sensitivity-{model_tag(model_name)}-{text}-N{positions}-c{chunk_tokens}-"
            f"{'heads' if heads else 'layers'}{'' if group == 1 else f'{group}'}-"
            f"step{step:+d}-{_tag(base)}")


def _klds(model, plan, chunks, refs):
    """Per-position KL(p_f32 || p) over every chunk, one array."""
    from kvquant.flips import kl_rows
    out = []
    for (_, ids), ref in zip(chunks, refs):
        hidden = model.forward_hidden(np.asarray(ids)[:-1], model.new_cache(plan))
        out.append(kl_rows(ref, model.logits(hidden)))
    return np.concatenate(out)


def run_sensitivity(model_name="smollm2", base="polar4/polar3", text="pydoc", positions=512,
                    chunk_tokens=512, step=-1, heads=False, done=None, progress=None,
                    on_row=None, model=None, group=1):
    """Scan every unit of ``model_name`` (see the module docstring).

    Parameters
    ----------
    base : str
        The base configuration: a pair spec or a plan file.
    step : int
        Bits added to each unit in turn (-1: one bit fewer).
    heads : bool
        Units are KV heads of a layer's stream (else a layer's stream, every head).
    group : int
        Layers per unit (1: every layer on its own; more: a coarse scan, each unit a run of
        consecutive layers shifted together).
    done : dict, optional
        ``{(layer, stream, head): row}`` already measured (kept, not run again).
    on_row : callable, optional
        Called with the result so far after each unit (to write it).

    Returns
    -------
    dict: ``meta`` and ``rows`` (per unit: layer, stream, head, spec, bits_delta, kld_mean,
    delta_kld, delta_kld_se; units whose width would leave the family's range are absent).
    """
    from kvquant import flips
    from kvquant.models import load_model
    from kvquant.models.plan import CachePlan
    from kvquant.specs import parse_cache_spec
    from kvquant_experiments.texts import load_text, text_tokens
    resolved = load_text(text)
    model = model if model is not None else load_model(model_name)
    L, H, d = model.n_layers, model.n_kv_heads, model.head_dim
    parsed = parse_cache_spec(base)
    plan = parsed if isinstance(parsed, CachePlan) else CachePlan.uniform(parsed, L, H)
    plan = CachePlan(plan.layers, H, plan.calibration, plan.meta)
    plan.check(L, H, d)
    tokens, resolved = text_tokens(model, resolved)
    chunks = flips.text_chunks(tokens, positions, chunk_tokens, bos=model.bos_token_id)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    refs = [model.logits(model.forward_hidden(np.asarray(ids)[:-1], model.new_cache("f32")))
            for _, ids in chunks]
    base_kld = _klds(model, plan, chunks, refs)
    say(f"base {base}: mean KLD {base_kld.mean():.4e} ({time.perf_counter() - t0:.0f} s)")
    meta = {
        "model": model.describe(), "model_name": str(model_name), "base": str(base),
        "base_bits_per_value": plan.bits_per_value(d, chunk_tokens),
        "base_kld_mean": float(base_kld.mean()), "step": int(step), "heads": bool(heads),
        "group": int(group),
        "text": {**resolved.describe(), "positions": int(positions),
                 "chunk_tokens": int(chunk_tokens),
                 "chunk_starts": [int(s) for s, _ in chunks]},
        "delta_kld": "mean over positions of KL(f32 || unit shifted) - KL(f32 || base)",
    }
    rows = dict(done or {})
    result = {"meta": meta, "rows": []}
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive number of layers, got {group!r}")
    for unit in units_of(L, H, heads, group):
        if unit in rows:
            continue
        unit_plan = _unit_plan(plan, unit, step, group)
        if unit_plan is None:
            continue
        t1 = time.perf_counter()
        kld = _klds(model, unit_plan, chunks, refs)
        diff = kld - base_kld
        layer, stream, head = unit
        rows[unit] = {
            "layer": layer, "layers": len(unit_layers(unit, group, L)), "stream": stream,
            "head": head,
            "spec": unit_plan.head_specs(layer, stream)[0 if head is None else head],
            "bits_delta": unit_plan.bits_per_value(d, chunk_tokens) - meta["base_bits_per_value"],
            "kld_mean": float(kld.mean()), "delta_kld": float(diff.mean()),
            "delta_kld_se": float(diff.std(ddof=1) / np.sqrt(diff.size)),
            "seconds": time.perf_counter() - t1,
        }
        result["rows"] = [rows[u] for u in units_of(L, H, heads, group) if u in rows]
        say(f"layer {layer} {stream}{'' if head is None else f' head {head}'}: "
            f"delta KLD {diff.mean():+.3e} ({rows[unit]['seconds']:.0f} s)")
        if on_row:
            on_row(result)
    result["rows"] = [rows[u] for u in units_of(L, H, heads, group) if u in rows]
    meta["elapsed_s"] = time.perf_counter() - t0
    return result


CSV_COLUMNS = ["layer", "layers", "stream", "head", "spec", "bits_delta", "kld_mean", "delta_kld",
               "delta_kld_se", "seconds"]


def load_result(path):
    """A sensitivity result file (JSON)."""
    with open(path) as f:
        result = json.load(f)
    if "rows" not in result or "base" not in result.get("meta", {}):
        raise ValueError(f"{path}: not a sensitivity result")
    return result


# --------------------------------------------------------------------------------------------
# Command line (kvquant_experiments.study)
# --------------------------------------------------------------------------------------------
RESUMES = True          # the result file is written after every unit and read back


def add_arguments(p):
    from kvquant_experiments.texts import TEXTS
    p.add_argument("--model", default="smollm2")
    p.add_argument("--base", required=True, help="base configuration: a pair spec or a plan file")
    p.add_argument("--text", default="pydoc", help="built-in text (" + ", ".join(TEXTS) +
                   ") or a UTF-8 file: the tune text")
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--step", type=int, default=-1, help="bits added to one unit at a time")
    p.add_argument("--heads", action="store_true", help="units are KV heads (else layers)")
    p.add_argument("--group", type=int, default=1,
                   help="consecutive layers per unit (a coarse scan)")
    p.add_argument("--out", default=".", help="folder of the result files")
    add_quiet_argument(p)


def outputs(args):
    return [Output(args.out)]


def run(args, progress):
    if args.step == 0:
        raise ValueError("--step must not be 0")
    name = os.path.splitext(os.path.basename(args.text))[0] if os.path.isfile(args.text) \
        else args.text
    stem = os.path.join(args.out, result_stem(args.model, name, args.positions,
                                              args.chunk_tokens, args.heads, args.step,
                                              args.base, args.group))
    done = {}
    if os.path.exists(stem + ".json"):
        old = load_result(stem + ".json")
        done = {(r["layer"], r["stream"], r["head"]): r for r in old["rows"]}

    def write(result):
        os.makedirs(args.out, exist_ok=True)
        result.setdefault("environment", environment())
        write_json(stem + ".json", result)
        write_csv(stem + ".csv", result["rows"], CSV_COLUMNS)

    result = run_sensitivity(args.model, args.base, args.text, args.positions,
                             args.chunk_tokens, args.step, args.heads, done, progress,
                             write, group=args.group)
    write(result)
    print(f"wrote {stem}.json, {stem}.csv")
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
