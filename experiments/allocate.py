"""Bit allocation: spend a budget of bits per value where a sensitivity scan says they pay.

A scan (:mod:`kvquant_experiments.sensitivity`) measured, for every unit (a layer's K or V
rows, or one KV head of them), the change of the mean KLD when that unit alone moves one bit
from a base configuration. The allocator models each unit's share of the KLD as
``a_u * 4**-b`` (a rotated Lloyd-Max codec's error falls about fourfold per bit), fitted to the
measured step, so that a unit's change at width ``b`` against its base width ``b_u`` is
``delta_u(b) = a_u (4**(b_u - b) - 1) 4**-b_u``; a measured step (``--scan`` given for both
``-1`` and ``+1``) is used as measured. A unit whose measured step lowers the KLD is fitted with
``a_u = 0`` beyond it.

Greedy by KLD gained per bit: every unit starts at its lowest width (``b_u - span``), then the
move that buys the most predicted KLD per bit of the budget is taken, until no move fits. The
KLD model is a sum of convex, separable terms, for which this greedy order is the optimum of the
model; the plan is then measured, never taken on the model's word. Units a scan did not reach
stay at the base width.

Run::

    python -m kvquant_experiments.allocate \\
        --scan data/results/sensitivity-smollm2-pydoc-N512-c512-layers-step-1-4d47804f.json \\
        --budget 3.5 --budget 4.5 --out data/plans

Writes ``alloc-<model>-b<budget>-<scan tags>.json`` (a cache plan, :mod:`kvquant.models.plan`,
with the allocation's inputs and its predicted KLD in its metadata) per budget.
"""
import os
import sys

from .study import Output, study_main

__all__ = ["allocate", "read_scan", "unit_curves", "write_plans"]

RATIO = 4.0   # error ratio per bit of the KLD model


def unit_curves(scans, span=1, ratio=RATIO):
    """Per unit ``(layer, stream, head)``: ``{width: predicted KLD change against the base}``
    over the widths ``b_u - span .. b_u + span`` the family takes (``0`` at the base).

    ``scans``: sensitivity results of the same base (step -1 and, optionally, +1)."""
    from kvquant.streams.spec import StreamSpec
    bases = {(s["meta"]["base"], s["meta"].get("group", 1)) for s in scans}
    if len(bases) != 1:
        raise ValueError(f"the scans have different bases or layer groups: {sorted(bases)}")
    measured = {}
    for scan in scans:
        step = int(scan["meta"]["step"])
        for r in scan["rows"]:
            unit = (r["layer"], r["stream"], r["head"])
            spec = StreamSpec.parse(r["spec"])
            if spec.bits is None:
                raise ValueError(f"{r['spec']!r}: only polar<b> and tq<b> specs have a bit "
                                 "width to allocate")
            b = spec.bits - step
            measured.setdefault(unit, {"base": b, "widths": spec.bit_widths})
            measured[unit][b + step] = r["delta_kld"]
    curves = {}
    for unit, m in measured.items():
        b0 = m["base"]
        down = m.get(b0 - 1)
        up = m.get(b0 + 1)
        # a_u 4**-b0: the unit's share at its base width, from the measured step
        if down is not None:
            share = max(down, 0.0) / (ratio - 1.0)
        else:
            share = max(-up, 0.0) / (1.0 - 1.0 / ratio)
        curve = {}
        for b in range(b0 - span, b0 + span + 1):
            if b not in m["widths"]:
                continue
            curve[b] = m.get(b, share * (ratio ** (b0 - b) - 1.0)) if b != b0 else 0.0
        curves[unit] = curve
    return curves


def allocate(base_plan, curves, budget, head_dim, tokens, group=1):
    """The greedy allocation of :func:`unit_curves` under ``budget`` bits per value (a unit:
    ``group`` consecutive layers from its first).

    Returns
    -------
    (CachePlan, predicted KLD change against the base, bits per value)
    """
    from kvquant.codecs import get_codec
    from kvquant.streams.spec import StreamSpec
    from kvquant_experiments.sensitivity import shift_bits, spec_bits

    from kvquant_experiments.sensitivity import unit_layers

    def spec_of(unit, width, layer=None):
        _, stream, head = unit
        spec = base_plan.head_specs(unit[0] if layer is None else layer,
                                    stream)[0 if head is None else head]
        return shift_bits(spec, width - spec_bits(spec))

    def plan_of(widths):
        plan = base_plan
        for unit, width in widths.items():
            for layer in unit_layers(unit, group, base_plan.n_layers):
                plan = plan.with_unit(layer, unit[1], spec_of(unit, width, layer), unit[2])
        return plan

    heads_per_unit = {u: ((base_plan.n_kv_heads or 1) if u[2] is None else 1)
                      * len(unit_layers(u, group, base_plan.n_layers)) for u in curves}
    n_rows = sum(len(base_plan.head_specs(layer, s)) for layer in range(base_plan.n_layers)
                 for s in ("k", "v"))
    row_bits = {}

    def bits(unit, width):   # the unit's share of the mean bits per value
        key = (unit, width)
        if key not in row_bits:
            codec = get_codec(StreamSpec.parse(spec_of(unit, width)).codec_spec, head_dim)
            row_bits[key] = 8.0 * codec.bytes_per_row / head_dim * heads_per_unit[unit] / n_rows
        return row_bits[key]

    widths = {u: min(c) for u, c in curves.items()}
    start = plan_of(widths).bits_per_value(head_dim, tokens)
    if start > budget + 1e-9:
        raise ValueError(f"even the lowest widths take {start:.3f} bits per value, over the "
                         f"budget of {budget}")
    spent = start
    while True:
        best = None
        for u, w in widths.items():
            if w + 1 not in curves[u]:
                continue
            cost = bits(u, w + 1) - bits(u, w)
            if spent + cost > budget + 1e-9:
                continue
            gain = (curves[u][w] - curves[u][w + 1]) / cost
            if best is None or gain > best[0]:
                best = (gain, u, cost)
        if best is None:
            break
        _, u, cost = best
        widths[u] += 1
        spent += cost
    plan = plan_of(widths)
    exact = plan.bits_per_value(head_dim, tokens)
    if exact > budget + 1e-9:   # the row-bit bookkeeping must agree with the plan's own count
        raise AssertionError(f"allocated {exact} bits per value over the budget {budget}")
    return plan, sum(curves[u][w] for u, w in widths.items()), exact


def read_scan(path):
    """A sensitivity result (:mod:`kvquant_experiments.sensitivity`) with every field the
    allocation uses of its type.

    Raises
    ------
    ValueError
        Naming the file (and the field): not a regular file, not JSON, or not a sensitivity
        result of this version.
    """
    from kvquant_experiments.result_files import (
        FLAG, NUMBER, OBJECT, TEXT, WHOLE, Fields, read_json_file)
    scan = read_json_file(path)
    fields = Fields(path, "a sensitivity result")
    if not (isinstance(scan, dict) and isinstance(scan.get("meta"), dict)
            and isinstance(scan.get("rows"), list)):
        raise ValueError(f"{path} is not a sensitivity result (a JSON object with \"meta\" and "
                         "\"rows\")")
    meta = scan["meta"]
    fields.each(meta, "meta", ("base", "model_name"), TEXT)
    fields.get(meta, "meta", "base_kld_mean", NUMBER)
    fields.get(meta, "meta", "step", WHOLE)
    fields.get(meta, "meta", "group", WHOLE, required=False, least=1)
    fields.get(meta, "meta", "heads", FLAG)
    fields.each(fields.get(meta, "meta", "model", OBJECT), "meta.model",
                ("head_dim", "n_layers", "n_kv_heads"), WHOLE, least=1)
    text = fields.get(meta, "meta", "text", OBJECT)
    fields.get(text, "meta.text", "name", TEXT)
    fields.get(text, "meta.text", "chunk_tokens", WHOLE, least=1)
    for i, row in enumerate(scan["rows"]):
        if not isinstance(row, dict):
            raise fields.error(f"rows[{i}] is {row!r}, not an object")
        fields.get(row, f"rows[{i}]", "layer", WHOLE)
        fields.get(row, f"rows[{i}]", "head", WHOLE, null=True)
        fields.each(row, f"rows[{i}]", ("stream", "spec"), TEXT)
        fields.get(row, f"rows[{i}]", "delta_kld", NUMBER)
    return scan


def write_plans(scan_paths, budgets, out, span=1, ratio=RATIO, tokens=None):
    """Allocate every budget from the scans (each read by :func:`read_scan`); write one plan
    file per budget; return paths."""
    from kvquant.models.plan import CachePlan
    from kvquant.specs import parse_cache_spec
    from kvquant_experiments.models import model_tag
    scans = [read_scan(p) for p in scan_paths]
    meta = scans[0]["meta"]
    d = meta["model"]["head_dim"]
    L, H = meta["model"]["n_layers"], meta["model"]["n_kv_heads"]
    tokens = tokens or meta["text"]["chunk_tokens"]
    base = meta["base"]
    parsed = parse_cache_spec(base)
    base_plan = parsed if isinstance(parsed, CachePlan) else CachePlan.uniform(parsed, L, H)
    base_plan = CachePlan(base_plan.layers, H, base_plan.calibration, {})
    curves = unit_curves(scans, span, ratio)
    # the scans' base tags, units (h: KV heads, g<N>: groups of N layers) and steps
    tags = "-".join(os.path.basename(p).rsplit("-", 1)[-1].replace(".json", "")
                    + ("h" if s["meta"]["heads"] else "")
                    + (f"g{s['meta']['group']}" if s["meta"].get("group", 1) > 1 else "")
                    + f"{s['meta']['step']:+d}" for p, s in zip(scan_paths, scans))
    tags += f"-s{span}"
    os.makedirs(out, exist_ok=True)
    paths = []
    for budget in budgets:
        plan, predicted, bits = allocate(base_plan, curves, budget, d, tokens,
                                         meta.get("group", 1))
        plan = CachePlan(plan.layers, H, plan.calibration, {"allocation": {
            "model": meta["model_name"], "budget_bits_per_value": budget,
            "bits_per_value": bits, "bits_counted_over_tokens": tokens,
            "base": base, "base_kld_mean": meta["base_kld_mean"],
            "predicted_kld_mean": meta["base_kld_mean"] + predicted,
            "tune_text": meta["text"]["name"], "scans": [os.path.basename(p) for p in scan_paths],
            "units_scanned": len(curves), "layers_per_unit": meta.get("group", 1),
            "span": span, "ratio": ratio,
            "method": "greedy by predicted KLD per bit (kvquant_experiments.allocate)"}})
        path = os.path.join(out, f"alloc-{model_tag(meta['model_name'])}-b{budget:g}-{tags}.json")
        plan.save(path)
        paths.append(path)
        print(f"<= {budget} bits: {bits:.3f} bits per value, predicted mean KLD "
              f"{meta['base_kld_mean'] + predicted:.4e} (base {meta['base_kld_mean']:.4e}); "
              f"wrote {path}")
    return paths


# --------------------------------------------------------------------------------------------
# Command line (kvquant_experiments.study)
# --------------------------------------------------------------------------------------------
RESUMES = False         # seconds of work: the same command writes every plan again


def add_arguments(p):
    p.add_argument("--scan", action="append", required=True,
                   help="a sensitivity result (JSON); repeat for steps -1 and +1 of one base")
    p.add_argument("--budget", action="append", type=float, required=True,
                   help="bits per value (side values and fixed costs included); repeatable")
    p.add_argument("--span", type=int, default=1, help="widths allowed: base +- span")
    p.add_argument("--ratio", type=float, default=RATIO, help="KLD ratio per bit of the model")
    p.add_argument("--tokens", type=int, default=None,
                   help="context over which fixed costs are spread (default: the scan's chunk)")
    p.add_argument("--out", required=True, help="folder of the plan files")


def outputs(args):
    return [Output(args.out)]


def run(args, progress):
    write_plans(args.scan, args.budget, args.out, args.span, args.ratio, args.tokens)
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
