"""Quality-per-byte frontier of a model (SmolLM2-135M by default; any name or GGUF path
:func:`kvquant.models.load_model` takes): mean KLD from the f32 cache against bits per value, for
uniform and K/V-split codec pairs, with the llama.cpp KV formats as baselines.

Bits per value of a pair ``"K/V"`` = (K bytes + V bytes per row) x 8 / (2 x head_dim), side values
(norms, scales) included, head_dim the model's (64 on SmolLM2). The numbers come from
:func:`kvquant_experiments.flip_runs.run_flips` (a text in prefill chunks: ``pydoc_data.topics``
by default, any UTF-8 file with ``--text``; same-top-1, mean KLD, PPL ratio, all against the f32
cache on the same text; plus the engine's teacher-forced / greedy protocol on a few prompts).

Goals (issue 8): at <= 4.5 bits per value a mean KLD <= 0.02; at <= 8.5 bits a mean KLD at or
under q8_0's (measured in the same run). Held-out goals (issue 20,
:data:`kvquant_experiments.frontier_picks.HELD_OUT_GOALS`; the
picks' mean KLD on texts they were not chosen on): <= 0.06 at 2.5 bits (issue 36), <= 0.03 at 3.5
bits, <= 0.015 at 4.5, <= 0.004 at 5.5; at 8.5 under the storage-only q8_0+rot and 10x under llama.cpp's q8_0 as it runs
(``--goals``).

Run::

    python -m kvquant_experiments.frontier                 # default grid (58 pairs), ~12 min on 2 cores
    python -m kvquant_experiments.frontier --model PATH.gguf --text FILE
    python -m kvquant_experiments.frontier --list          # configurations and their bits only
    python -m kvquant_experiments.frontier --plot-only RUN/frontier-....json
    # a cache plan (specs per layer, kvquant.models.plan) is a config like a pair spec
    python -m kvquant_experiments.frontier --configs data/plans/PLAN.json,tq4 --text code

Held out: the picks are made on a tune text only (pydoc), and the headline numbers measured on
texts they were not picked on::

    # per budget (2.5, 3, 3.5, 4.5, 5.5, 8.5 bits), the lowest mean KLD of a grid run on the tune text
    python -m kvquant_experiments.frontier \
        --choose-from data/results/frontier-smollm2-N2048-c512-p4.json \
        --choices-out data/results/frontier-choices.json
    # exactly those picks, plus f32, kv8, q8_0, q8_0+rot, q4_0, q4_0+rot, tq4, on any text
    python -m kvquant_experiments.frontier --choices data/results/frontier-choices.json --text code
    # the held-out goals (frontier_picks.HELD_OUT_GOALS), cell by cell, over runs of the picks
    python -m kvquant_experiments.frontier --goals data/results/frontier-choices-*.json

The field's other schemes run as simulations (``sim:`` specs of
:mod:`kvquant_experiments.simulated_caches`: KIVI, transformers' QuantizedCache default, pre-RoPE
keys; a spec kind installed by entry point, so worker processes run them too)::

    python -m kvquant_experiments.frontier --configs "q4_0+rot,sim:kivi4,sim:hf-quanto4,sim:chan4-g128@prerope/tok4-g64"

Writes ``frontier-<model>-<text>-N<positions>-c<chunk>-p<prompts>.{json,csv,md,png}`` into
``--out`` (default: a folder of that name under the current directory). ``--figure PATH`` writes
the figure there instead (the README's: ``--figure data/figures/frontier_smollm2.png``).
"""
import math
import os
import sys
import time

from kvquant.ggml_attention import GGML_FAMILY
from kvquant.outputs import atomic_write
from .common import environment, safe_stem, write_csv, write_json
from .result_files import LIST, NUMBER, OBJECT, TEXT, WHOLE, Fields, is_kind, read_json_file
from .study import FILE, Output, add_executor_arguments, add_quiet_argument, study_main

__all__ = [
    "BUDGET_HIGH",
    "BUDGET_LOW",
    "DEFAULT_CONFIGS",
    "KLD_GOAL_LOW",
    "bits_per_value",
    "format_markdown",
    "frontier_rows",
    "main",
    "pareto_front",
    "run_frontier",
    "write_frontier",
]

MODEL = "smollm2"
BUDGET_LOW, KLD_GOAL_LOW = 4.5, 0.02   # bits per value, mean KLD (nats)
BUDGET_HIGH = 8.5                      # bits per value; goal: KLD <= q8_0's
DEFAULTS = {"positions": 2048, "chunk_tokens": 512, "prompts": 4}
CHOICE_BUDGETS = (2.5, 3.0, 3.5, 4.5, 5.5, 8.5)   # the budgets the picks are made for

UNIFORM = [
    "f32", "kv8", "kv8-g32", "q8_0", "q8_0+rot", "tq8", "tq6", "tq5", "tq4", "tq4:side=unbiased",
    "tq4:codebook=gaussian", "tq3", "polar6", "polar5", "polar4", "q4_0", "q4_0+rot",
]
# K/V splits at <= 4.5 bits per value (d = 64: tq<b> is b + 0.5 bits, polar<b> is b bits,
# q8_0 / kv8 are 8.5): more bits on keys.
SPLITS_LOW = ["tq5/tq3", "tq6/tq2", "tq5/polar3", "polar5/tq3", "polar5/polar4", "polar6/polar3",
              "tq6/polar2"]
# K/V splits at <= 8.5 bits per value.
SPLITS_HIGH = ["tq6/tq4", "q8_0/tq4", "tq8/tq4", "q8_0/tq6", "tq8/tq6"]
# Between the two budgets (q8_0 keys cannot fit 4.5 bits: V would need <= 0.5 bits).
SPLITS_MID = ["tq6/tq3", "q8_0/tq2"]
# Stream options (kvquant.streams.options.parse_stream_spec): keys centered on the prompt's mean
# key, the first row of K and V kept in f32; fp16 side values (tq / polar `side_dtype=f16`) pay
# for them.
_H = ":side_dtype=f16"
_K = "@center,normalize,sinks=1"      # keys: centered, half-way normalized, first row in f32
_V = "@center,sinks=1"                # values: centered, first row in f32
STREAM_OPTION_CONFIGS = [
    f"polar5{_H}{_K}/polar4{_H}{_V}", f"polar5{_K}/polar4{_V}", f"polar6{_H}{_K}/polar3{_H}{_V}",
    # the fixed-width polar layout, whose consumer runs at numpy f32 speed or faster
    f"polar5:alloc=level{_H.replace(':', ',')}{_K}/polar4:alloc=level{_H.replace(':', ',')}{_V}",
    f"polar4{_H}{_K}/polar4{_H}{_V}", f"polar4{_H}{_K}/polar3{_H}{_V}",
    f"tq5{_H}{_K}/tq3{_H}{_V}", f"tq4{_H}{_K}/tq4{_H}{_V}", f"q4_0+rot{_K}/q4_0+rot{_V}",
    f"polar6{_H}{_K}/polar5{_H}{_V}", f"tq6{_H}{_K}/tq6{_H}{_V}", f"tq8{_H}{_K}/tq6{_H}{_V}",
    f"tq8{_H}{_K}/tq7{_H}{_V}", f"tq8{_H}{_K}/tq8{_H}{_V}", f"q8_0{_K}/q8_0{_V}",
    # what each option brings, one at a time, on polar5/polar4
    "polar5@center/polar4", "polar5@sinks=1/polar4@sinks=1", "polar5@center,sinks=1/polar4@sinks=1",
    "polar5@center,normalize,sinks=1/polar4@sinks=1",
]
# A recent window (kvquant.streams.options: each query reads the 16 rows before it in f32).
# Its f32 rows are a fixed cost per stream: ~1 bit per value at the 512-token chunks measured
# here, 0.25 at 2048, nothing at long contexts (``bits_per_value(pair)`` without tokens).
_W = ",recent=16"
WINDOW_CONFIGS = [
    f"polar5{_H}{_K}{_W}/polar4{_H}{_V}{_W}", f"polar4{_H}{_K}{_W}/polar3{_H}{_V}{_W}",
    "tq4@recent=16/tq4@recent=16", "q4_0+rot@recent=16/q4_0+rot@recent=16",
    f"polar5{_H}{_K},recent=64/polar4{_H}{_V},recent=64",
]
# llama.cpp's cache types with its attention arithmetic (kvquant.ggml_attention), "as it
# runs", beside the storage-only baselines (q8_0+rot, ...)
GGML_CONFIGS = ["ggml:f16/f16", "ggml:q8_0/q8_0", "ggml:q4_0/q4_0"]
DEFAULT_CONFIGS = (UNIFORM + SPLITS_LOW + SPLITS_HIGH + SPLITS_MID + STREAM_OPTION_CONFIGS
                   + WINDOW_CONFIGS + GGML_CONFIGS)

# the field's formats and schemes: the bar, not entrants (llama.cpp's cache types, simulations of
# KIVI / transformers' QuantizedCache / pre-RoPE keys)
BASELINES = tuple(k + r for k in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
                  for r in ("", "+rot")) + ("simulation", GGML_FAMILY)


# --------------------------------------------------------------------------------------------
# Bits, families, front
# --------------------------------------------------------------------------------------------
def bits_per_value(spec, head_dim, tokens=None):
    """(K bytes + V bytes per row) x 8 / (2 x head_dim), side values included
    (:meth:`kvquant.specs.CacheSpec.bits_per_value`).

    With ``tokens`` (the context length measured), the fixed cost of stream options is spread
    over the rows: a centered stream stores its f32 offset (head_dim floats), a stream with sinks
    stores those rows in f32 instead of their codes. Without it: the bytes each further token adds.
    """
    from kvquant.specs import parse_cache_spec
    return parse_cache_spec(spec).bits_per_value(head_dim, tokens)


def pair_family(spec):
    """The family a configuration is drawn in (:attr:`kvquant.specs.CacheSpec.family`)."""
    from kvquant.specs import parse_cache_spec
    return parse_cache_spec(spec).family


def pareto_front(points):
    """Indices of the points no other point beats on both bits and mean KLD, by increasing bits."""
    from .flip_report import pareto_front as front
    return front(points, key="kld_mean")


def _boot_columns(row):
    boot = row.get("bootstrap") or {}
    out = {}
    for key in ("kld_mean", "ppl_ratio"):
        lo, hi = boot.get(key) or (None, None)
        out[f"{key}_boot_lo"], out[f"{key}_boot_hi"] = lo, hi
    return out


def _pair(config):
    """(K spec, V spec) texts of a pair spec; the configuration's text for both when it is of
    another kind (a cache plan's specs differ by layer)."""
    from kvquant.specs import PairSpec, parse_cache_spec
    spec = parse_cache_spec(config)
    return tuple(map(str, spec.streams)) if isinstance(spec, PairSpec) else (spec.text,) * 2


def frontier_rows(result):
    """Flat rows of a frontier result: bits, family, metrics, front membership, goal flags."""
    from kvquant_experiments.flip_storage import add_storage
    add_storage(result["rows"], result["meta"])
    rows = []
    for r in result["rows"]:
        k_spec, v_spec = _pair(r["codec"])
        rows.append({
            "codec": r["codec"], "k": k_spec, "v": v_spec, "family": pair_family(r["codec"]),
            "bits_per_value": r["bits_per_value"], "bytes_per_token": r["bytes_per_token"],
            "same_top": r["same_top"]["p"], "same_top_lo": r["same_top"]["lo"],
            "same_top_hi": r["same_top"]["hi"], "kld_mean": r["kld_mean"],
            "kld_p99": r["kld_p99"], "kld_max": r["kld_max"], "ppl_ratio": r["ppl_ratio"],
            **{k: r.get(k) for k in ("kld_mean_se", "ppl_ratio_se", "ppl", "ppl_f32",
                                     "mean_ln_ppl_ratio", "mean_ln_ppl_ratio_se", "cor_ln_ppl",
                                     "kld_median", "kld_p99_9", "kld_p95", "kld_p90",
                                     "dp_mean", "dp_mean_se", "dp_rms", "dp_rms_se")},
            **_boot_columns(r),
            "fixed_bytes": r.get("fixed_bytes", 0),
            "tf_k": r["tf"]["k"], "tf_n": r["tf"]["n"], "greedy_k": r["greedy"]["k"],
            "greedy_n": r["greedy"]["n"], "tf_kld_mean": r["tf_kld_mean"],
        })
    q8 = next((x["kld_mean"] for x in rows if x["codec"] == "q8_0"), None)
    q8r = next((x["kld_mean"] for x in rows if x["codec"] == "q8_0+rot"), None)
    quant = [x for x in rows if x["codec"] != "f32"]
    front = {quant[i]["codec"] for i in pareto_front(quant)}
    for x in rows:
        x["on_front"] = x["codec"] in front
        x["goal_4p5"] = x["bits_per_value"] <= BUDGET_LOW and x["kld_mean"] <= KLD_GOAL_LOW
        # Goal B is for our codecs: the llama.cpp formats themselves are the bar, not entrants.
        ours = x["codec"] != "f32" and x["family"] not in BASELINES
        x["goal_8p5"] = (q8 is not None and ours and x["bits_per_value"] <= BUDGET_HIGH
                         and x["kld_mean"] <= q8)
        x["beats_q8_0_rot"] = (q8r is not None and ours and x["bits_per_value"] <= BUDGET_HIGH
                               and x["kld_mean"] <= q8r)
    return rows


# --------------------------------------------------------------------------------------------
# Run and write
# --------------------------------------------------------------------------------------------
def run_frontier(configs=None, positions=DEFAULTS["positions"],
                 chunk_tokens=DEFAULTS["chunk_tokens"], prompts=DEFAULTS["prompts"],
                 workers=None, progress=None, text="pydoc", model=MODEL, scheduler=None,
                 loaded=None, score="all", units=None):
    """``run_flips`` of ``model`` (a name or GGUF path) over ``configs`` (pair specs) on
    ``text`` (``loaded``: that model already built, run in this process); adds
    ``bits_per_value`` per row (the model's head_dim; fixed costs of stream
    options spread over ``chunk_tokens`` rows, the context measured). ``units`` (a
    :class:`~kvquant_experiments.executor.UnitStore`): finished units kept there, so that the
    same call after an interruption computes only the rest.

    The bits per further token from the codecs are checked against the cache's bytes per token.
    """
    from kvquant.specs import parse_cache_spec
    from kvquant_experiments.flip_runs import run_flips
    configs = list(configs or DEFAULT_CONFIGS)
    t0 = time.perf_counter()
    result = run_flips(model, codecs=configs, positions=positions, chunk_tokens=chunk_tokens,
                       n_prompts=prompts, workers=workers, progress=progress, text=text,
                       scheduler=scheduler, model=loaded, score=score, units=units)
    cfg = result["meta"]["model"]
    d = cfg["head_dim"]
    rows_per_token = 2 * cfg["n_layers"] * cfg["n_kv_heads"]  # K and V rows
    for r in result["rows"]:
        spec = parse_cache_spec(r["codec"])      # once a row (a plan is a file read)
        r["bits_per_value"] = spec.bits_per_value(d, chunk_tokens)
        per_token = spec.bits_per_value(d)
        from_cache = 8.0 * r["marginal_bytes_per_token"] / (rows_per_token * d)
        if abs(from_cache - per_token) > 1e-9:
            raise AssertionError(f"{r['codec']}: {per_token} bits from the codecs, "
                                 f"{from_cache} from the cache")
    result["meta"]["frontier"] = {
        "budget_low_bits": BUDGET_LOW, "kld_goal_low": KLD_GOAL_LOW,
        "budget_high_bits": BUDGET_HIGH, "goal_high": "KLD <= q8_0's in this run",
        "bits_per_value": ("(K + V bytes per row) * 8 / (2 * head_dim), side values included; "
                           "f32 offsets and sinks of stream options spread over chunk_tokens"),
        "wall_s": time.perf_counter() - t0,
    }
    return result


def _model_tag(result):
    from kvquant_experiments.models import model_tag
    meta = result["meta"]
    return model_tag(meta.get("model_name", MODEL))


def result_stem(result):
    """``frontier-<model>-<text>-N<positions>-c<chunk tokens>-p<prompts>``; a run of some of the
    picks adds ``-b<budget>-...`` (so that it does not take the name of a run of all of them)."""
    t = result["meta"]["text"]
    choices = result["meta"].get("frontier", {}).get("choices")
    kind = "frontier-choices" if choices else "frontier"
    some = choices and len(choices) < len(CHOICE_BUDGETS)
    return safe_stem(f"{kind}-{_model_tag(result)}-{t.get('name', 'pydoc')}-N{t['positions']}"
                     f"-c{t['chunk_tokens']}-p{result['meta']['protocol']['prompts']}"
                     + ("-half" if t.get("score") == "second-half" else "")
                     + ("-b" + "-b".join(sorted(choices, key=float)) if some else ""))


CSV_COLUMNS = ["codec", "k", "v", "family", "bits_per_value", "bytes_per_token", "fixed_bytes",
               "same_top", "same_top_lo", "same_top_hi", "kld_mean", "kld_mean_se",
               "kld_mean_boot_lo", "kld_mean_boot_hi", "kld_median", "kld_p90", "kld_p95",
               "kld_p99", "kld_p99_9", "kld_max", "ppl", "ppl_f32", "cor_ln_ppl",
               "mean_ln_ppl_ratio", "mean_ln_ppl_ratio_se", "ppl_ratio", "ppl_ratio_se",
               "ppl_ratio_boot_lo", "ppl_ratio_boot_hi", "dp_mean", "dp_mean_se", "dp_rms",
               "dp_rms_se", "tf_k", "tf_n", "greedy_k", "greedy_n", "tf_kld_mean", "on_front",
               "goal_4p5",
               "goal_8p5", "beats_q8_0_rot"]


def write_frontier(result, out_dir):
    """``<stem>.json`` (the full run_flips result and the environment), ``<stem>.csv``, ``<stem>.md``."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(result))
    result.setdefault("environment", environment())
    write_json(stem + ".json", result)
    write_csv(stem + ".csv", frontier_rows(result), CSV_COLUMNS)
    text = format_markdown(result) + "\n"
    atomic_write(stem + ".md", lambda f: f.write(text))
    return [stem + ".json", stem + ".csv", stem + ".md"]


def _with_error(x, key, fmt):
    cell = fmt.format(x[key])
    if x.get(key + "_se") is not None:
        cell += " ± " + fmt.format(x[key + "_se"])
    if x.get(key + "_boot_lo") is not None:
        cell += f" [{fmt.format(x[key + '_boot_lo'])}, {fmt.format(x[key + '_boot_hi'])}]"
    return cell


def _intervals_note(result):
    from kvquant_experiments.flip_tables import intervals_note
    if not any("kld_mean_se" in r for r in result["rows"]):
        return ("(A result of an earlier version: no standard errors or bootstrap intervals; "
                "rerun for them.)")
    return intervals_note(result)


def format_markdown(result):
    """The table sorted by bits per value, then KLD; front and goals marked."""
    rows = sorted(frontier_rows(result), key=lambda x: (x["bits_per_value"], x["kld_mean"]))
    meta = result["meta"]
    t, p = meta["text"], meta["protocol"]
    q8 = next((x for x in rows if x["codec"] == "q8_0"), None)
    q8r = next((x for x in rows if x["codec"] == "q8_0+rot"), None)
    d = meta["model"]["head_dim"]
    lines = [
        f"{meta['model']['model']}, real text: {t['positions']} positions of {t['source']} in "
        f"chunks of "
        f"{t['chunk_tokens']} tokens; engine protocol: {p['prompts']} prompts x "
        f"{p['new_tokens']} greedy tokens. Against the f32 cache; PPL(f32) = "
        f"{result['rows'][0]['ppl_f32']:.3f}. "
        f"Bits/value = (K + V bytes per row) x 8 / (2 x {d}), side values included; the f32 "
        f"offset and sink rows of stream options (@center, @sinks=N) spread over the "
        f"{t['chunk_tokens']} rows of a chunk. F: on the Pareto front; "
        f"goal: <= {BUDGET_LOW} bits and KLD <= {KLD_GOAL_LOW} (A), <= {BUDGET_HIGH} bits and "
        f"KLD <= q8_0's (B)" + (f" = {q8['kld_mean']:.2e}" if q8 else "")
        + ("; B+: also <= q8_0+rot's (llama.cpp rotates a quantized cache since PR #21038)"
           + (f" = {q8r['kld_mean']:.2e}" if q8r else "")) + ".",
        "",
        "",
        _intervals_note(result),
        "",
        "| K/V | bits/value | same top-1 % [95% CI] | mean KLD ± SE [bootstrap] | p99 KLD | "
        "PPL ratio ± SE [bootstrap] | TF agree | greedy agree | F | goal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    picks = picks_of(result)
    if picks:
        tune = {p["tune_text"] for p in meta["frontier"]["choices"].values()}
        text_name = t.get("name", t["source"])
        lines[0] += (f" Picks (`pick <= b`) were chosen on {', '.join(sorted(tune))}"
                     + (" (this text: not held out)." if text_name in tune
                        else f"; {text_name} is held out."))
    for x in rows:
        goal = ",".join(g for g, ok in (("A", x["goal_4p5"]), ("B", x["goal_8p5"]),
                                        ("B+", x["beats_q8_0_rot"])) if ok)
        if x["codec"] in picks:
            goal = ", ".join(filter(None, [goal, "pick " + picks[x["codec"]]]))
        lines.append(
            f"| {x['codec']} | {x['bits_per_value']:.2f} | {100 * x['same_top']:.2f} "
            f"[{100 * x['same_top_lo']:.2f}, {100 * x['same_top_hi']:.2f}] | "
            f"{_with_error(x, 'kld_mean', '{:.2e}')} | {x['kld_p99']:.2e} | "
            f"{_with_error(x, 'ppl_ratio', '{:.4f}')} | "
            f"{x['tf_k']}/{x['tf_n']} | {x['greedy_k']}/{x['greedy_n']} | "
            f"{'F' if x['on_front'] else ''} | {goal} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Result files
# --------------------------------------------------------------------------------------------
def read_result(path, what="a frontier result"):
    """A frontier result JSON: an object with ``meta`` and a list of ``rows``, every field the
    frontier's readers use of them of its type (:func:`check_result`).

    Raises
    ------
    ValueError
        Naming the file (and the field): not a regular file (a FIFO is refused before it is
        read), not JSON, or not a frontier result of this version.
    """
    result = read_json_file(path)
    if not (isinstance(result, dict) and isinstance(result.get("meta"), dict)
            and isinstance(result.get("rows"), list)
            and all(isinstance(r, dict) for r in result["rows"])):
        raise ValueError(f"{path} is not {what} (a JSON object with \"meta\" and \"rows\")")
    check_result(result, Fields(path, what))
    return result


# What the readers use of a result (frontier_rows, format_markdown, result_stem, the picks):
# read as numbers, texts, counts, so a file of another shape is named here, not met as a
# traceback (or a string KLD written into the picks) later.
_ROW_NUMBERS = ("bytes_per_token", "kld_mean", "kld_p99", "kld_max", "ppl_ratio", "ppl_f32",
                "tf_kld_mean")
_ROW_OPTIONAL_NUMBERS = ("bits_per_value", "marginal_bytes_per_token", "fixed_bytes",
                         "kld_mean_se", "ppl_ratio_se", "ppl", "mean_ln_ppl_ratio",
                         "mean_ln_ppl_ratio_se", "cor_ln_ppl", "kld_median", "kld_p99_9",
                         "kld_p95", "kld_p90", "dp_mean", "dp_mean_se", "dp_rms", "dp_rms_se")


def check_result(result, fields):
    """Check the fields of ``result`` (an object with ``meta`` and a list of row objects) that
    the frontier's readers use, by :class:`kvquant_experiments.result_files.Fields`
    ``fields`` (whose errors name the file)."""
    from kvquant.specs import parse_cache_spec
    meta = result["meta"]
    text = fields.get(meta, "meta", "text", OBJECT)
    fields.get(text, "meta.text", "source", TEXT)
    fields.each(text, "meta.text", ("name", "score"), TEXT, required=False)
    fields.each(text, "meta.text", ("positions", "chunk_tokens"), WHOLE, least=1)
    fields.get(text, "meta.text", "chunk_starts", LIST, required=False, null=True)
    fields.each(fields.get(meta, "meta", "protocol", OBJECT), "meta.protocol",
                ("prompts", "new_tokens"), WHOLE)
    model = fields.get(meta, "meta", "model", OBJECT)
    fields.get(model, "meta.model", "model", TEXT)
    fields.each(model, "meta.model", ("head_dim", "n_layers", "n_kv_heads"), WHOLE, least=1)
    fields.get(meta, "meta", "model_name", TEXT, required=False)
    frontier = fields.get(meta, "meta", "frontier", OBJECT, required=False) or {}
    choices = fields.get(frontier, "meta.frontier", "choices", OBJECT, required=False,
                         null=True)
    if choices:
        check_choices(choices, fields, "meta.frontier.choices")
    if not result["rows"]:
        raise fields.error("rows is empty (a result has a row per configuration, f32 first)")
    reference = False
    for i, row in enumerate(result["rows"]):
        name = f"rows[{i}]"
        codec = fields.get(row, name, "codec", TEXT)
        try:
            reference |= parse_cache_spec(codec).is_reference
        except ValueError as exc:
            raise fields.error(f"{name}.codec {codec!r}: {exc}") from None
        fields.each(row, name, _ROW_NUMBERS, NUMBER)
        fields.each(row, name, _ROW_OPTIONAL_NUMBERS, NUMBER, required=False, null=True)
        fields.each(fields.get(row, name, "same_top", OBJECT), f"{name}.same_top",
                    ("p", "lo", "hi"), NUMBER)
        for key in ("tf", "greedy"):
            fields.each(fields.get(row, name, key, OBJECT), f"{name}.{key}", ("k", "n"), WHOLE)
        boot = fields.get(row, name, "bootstrap", OBJECT, required=False, null=True) or {}
        for key in ("kld_mean", "ppl_ratio"):
            pair = fields.get(boot, f"{name}.bootstrap", key, LIST, required=False, null=True)
            if pair is not None and not (len(pair) == 2 and all(is_kind(v, NUMBER)
                                                                for v in pair)):
                raise fields.error(f"{name}.bootstrap.{key} is {pair!r}, not two numbers "
                                   "(an interval)")
    if not reference:       # every size and bit count is measured against its row
        raise fields.error("no row is the f32 reference (a row with codec f32)")


def check_choices(choices, fields, name):
    """Check a choices object (budget -> pick, :func:`kvquant_experiments.frontier_picks.choose`)
    by ``fields``; ``name``: where it is in the file (``""``: the whole file)."""
    for budget, pick in choices.items():
        try:
            bits = float(budget)
        except ValueError:
            bits = math.nan
        if not math.isfinite(bits):
            raise fields.error(f"key {budget!r}{' of ' + name if name else ''} is not a budget "
                               "in bits")
        where = f'{name}["{budget}"]'
        if not isinstance(pick, dict):
            raise fields.error(f"{where} is {pick!r}, not a pick (an object)")
        missing = {"pair", "bits", "tune_text"} - set(pick)
        if missing:
            raise fields.error(f"{where} lacks {sorted(missing)}")
        fields.each(pick, where, ("pair", "tune_text"), TEXT)
        fields.get(pick, where, "bits", NUMBER)
        fields.each(pick, where, ("model", "from"), TEXT, required=False)
        fields.get(pick, where, "tune_kld_mean", NUMBER, required=False)
        fields.each(pick, where, ("held_out", "tasks"), LIST, required=False)



def picks_of(result):
    """{pair spec: budget label} of the picks a result was run with (empty for a grid run)."""
    choices = result["meta"].get("frontier", {}).get("choices") or {}
    out = {}
    for budget, pick in choices.items():
        out.setdefault(pick["pair"], []).append(budget)
    return {k: "<= " + ", ".join(v) for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
UNITS_FOLDER = ".frontier-units"


def _plot(result, out):
    from kvquant_experiments.plots import plot_frontier
    return plot_frontier(result, out)


def _from_files(paths, what, read):
    """``read()``, a file of another shape said as a ValueError naming the files."""
    try:
        return read()
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{', '.join(paths)}: not {what} of this version "
                         f"({type(exc).__name__}: {exc})") from None


RESUMES = True          # finished units are kept in UNITS_FOLDER (the run says how many)
ERRORS = (ImportError,)  # a model format or --scheduler whose extra is not installed


def add_arguments(p):
    from kvquant_experiments.texts import TEXTS

    from .frontier_picks import HELD_OUT_BASELINES
    p.add_argument("--model", default=MODEL,
                   help="smollm2, another name load_model knows, or a GGUF file path")
    p.add_argument("--configs", default=None,
                   help="comma-separated pair specs (K/V), or cache plan files (a .json of "
                        "specs per layer: kvquant.models.plan); default: the built-in grid")
    p.add_argument("--positions", type=int, default=DEFAULTS["positions"])
    p.add_argument("--chunk-tokens", type=int, default=DEFAULTS["chunk_tokens"])
    p.add_argument("--prompts", type=int, default=DEFAULTS["prompts"],
                   help="prompts of the engine's teacher-forced / greedy protocol")
    p.add_argument("--text", default="pydoc",
                   help="a UTF-8 text file or a built-in text (" + ", ".join(TEXTS) + ")")
    add_executor_arguments(p)
    p.add_argument("--out", default=None,
                   help="output folder (default: ./frontier-<model>-<text>-N..-c..-p..)")
    p.add_argument("--figure", default=None,
                   help="figure path (default: <stem>.png in the output folder; the README's "
                        "is data/figures/frontier_smollm2.png)")
    p.add_argument("--score", choices=("all", "second-half"), default="all",
                   help="text positions in the statistics (second-half: as llama-perplexity)")
    p.add_argument("--choose-from", metavar="JSON", nargs="+", default=None,
                   help="write the picks of frontier results on their (tune) text, one per "
                        f"budget ({', '.join(f'{b:g}' for b in CHOICE_BUDGETS)} bits), to "
                        "--choices-out; several results must share model, text, chunks and "
                        "prompts (a grid, then more configurations); run nothing")
    p.add_argument("--choices-out", default="frontier-choices.json",
                   help="where --choose-from writes (the repo's: "
                        "data/results/frontier-choices.json)")
    p.add_argument("--choices", metavar="JSON", default=None,
                   help="run exactly the picks of a choices file (plus the baselines "
                        + ", ".join(HELD_OUT_BASELINES) + "; --configs adds more) on --text")
    p.add_argument("--baselines", default=None,
                   help="with --choices: the baselines measured beside the picks "
                        "(comma-separated; default " + ",".join(HELD_OUT_BASELINES) + "; f32 "
                        "is always measured)")
    p.add_argument("--budgets", default=None,
                   help="with --choices: run only the picks of these budgets (comma-separated, "
                        "e.g. 4.5)")
    p.add_argument("--goals", metavar="JSON", nargs="+", default=None,
                   help="print the held-out goals table of runs of the picks (their JSON "
                        "files, e.g. data/results/frontier-choices-*.json; with --choices, "
                        "only the cells of its picks: runs of replaced picks are left out); "
                        "run nothing")
    p.add_argument("--evidence", metavar="JSON", nargs="+", default=None,
                   help="with --choices: add to each pick of the choices file its held-out "
                        "figures from these runs of the picks (frontier JSON) and its task "
                        "accuracy from these task summaries (summary-n*.json), rewriting the "
                        "file; run nothing")
    p.add_argument("--list", action="store_true", help="print configurations and bits, run nothing")
    p.add_argument("--plot-only", metavar="JSON", default=None,
                   help="redraw the figure from a frontier JSON (and its CSV and markdown table "
                        "into --out when given)")
    add_quiet_argument(p)


def outputs(args):
    """What the mode asked for writes: the picks file, the choices file --evidence rewrites, or
    the run's folder (the current one without --out) and --figure."""
    if args.choose_from:
        return [Output(args.choices_out, FILE, "--choices-out")]
    if args.goals:
        return []
    if args.evidence:
        return [Output(args.choices, FILE, "--choices")] if args.choices else []
    if args.list:
        return []
    figure = [Output(args.figure, FILE, "--figure")] if args.figure else []
    if args.plot_only:      # the figure beside the JSON read unless --out or --figure says
        return ([Output(args.out)] if args.out else []) + figure
    return [Output(args.out if args.out is not None else ".")] + figure


# the modes that read files (and write one at their end), measuring nothing: nothing of theirs
# is kept to resume from
READ_ONLY_MODES = ("--choose-from", "--goals", "--evidence", "--plot-only", "--list")


def read_only_mode(args):
    """The option of a mode that measures nothing (:data:`READ_ONLY_MODES`), or None for a run
    that measures (and keeps its finished units)."""
    for option in READ_ONLY_MODES:
        if getattr(args, option[2:].replace("-", "_")):
            return option
    return None


def run(args, progress):
    mode = read_only_mode(args)
    try:
        return _run(args, progress)
    except KeyboardInterrupt as exc:
        if mode is None:        # a measuring run: it says what it kept
            raise
        # the same kind (Ctrl-C or SIGTERM), not the study's "rerun to resume"
        raise type(exc)(f"{mode} measures nothing and keeps nothing to resume: the same "
                        "command starts over") from None


def _run(args, progress):
    # the picks read this module's results; imported here, not at the top, to keep one direction
    from .frontier_picks import (choice_configs, choose, goals_table, load_choices,
                                 merge_tune_runs, pick_evidence)
    if args.choose_from:
        names = [os.path.basename(p) for p in args.choose_from]
        choices = _from_files(
            args.choose_from, "frontier results",
            lambda: choose(merge_tune_runs([read_result(p) for p in args.choose_from], names),
                           source=", ".join(names)))
        write_json(args.choices_out, choices)
        for budget, pick in choices.items():
            print(f"<= {budget} bits: {pick['pair']} ({pick['bits']:.2f} bits, mean KLD "
                  f"{pick['tune_kld_mean']:.3e} on {pick['tune_text']})")
        for budget in CHOICE_BUDGETS:
            if f"{budget:g}" not in choices:
                print(f"<= {budget:g} bits: no pick (no configuration of the runs is this small)")
        print(f"wrote {args.choices_out}")
        return 0
    if args.goals:
        print(_from_files(args.goals, "frontier results", lambda: goals_table(
            [read_result(path) for path in args.goals],
            load_choices(args.choices) if args.choices else None)))
        return 0
    if args.evidence:
        if not args.choices:
            raise ValueError("--evidence adds to a choices file: give it with --choices")

        def evidence_of_files():
            docs = [(path, read_json_file(path)) for path in args.evidence]
            is_summary = [isinstance(d, dict) and "primary_metric" in d for _, d in docs]
            return pick_evidence(
                load_choices(args.choices),
                [read_result(p) for (p, _), summ in zip(docs, is_summary) if not summ],
                [d for (_, d), summ in zip(docs, is_summary) if summ])
        evidence = _from_files(args.evidence, "frontier results or task summaries",
                               evidence_of_files)
        write_json(args.choices, evidence)
        for budget, pick in evidence.items():
            print(f"{budget} bits: {len(pick['held_out'])} held-out run(s), "
                  f"{len(pick['tasks'])} task summar(ies)")
        return 0
    choices = None
    extra = []
    from kvquant.specs import split_spec_text
    if args.configs:
        extra = configs = split_spec_text(args.configs)
    else:
        configs = list(DEFAULT_CONFIGS)
    if args.choices:
        choices = load_choices(args.choices)
        if args.budgets:
            wanted = [f"{float(b):g}" for b in args.budgets.split(",") if b.strip()]
            missing = [b for b in wanted if b not in choices]
            if missing:
                raise ValueError(f"{args.choices} has no pick for {missing} bits; it has "
                                 f"{', '.join(choices)}")
            choices = {b: choices[b] for b in wanted}
        baselines = split_spec_text(args.baselines) if args.baselines else None
        configs = choice_configs(choices, extra, baselines)
    if args.list:
        from kvquant.models import load_model
        head_dim = load_model(args.model).head_dim
        for c in configs:
            print(f"{bits_per_value(c, head_dim, tokens=args.chunk_tokens):5.2f}  {c}")
        return 0
    if args.plot_only:
        def redraw():
            result = read_result(args.plot_only)
            # the CSV and markdown again only where --out says; the figure beside the JSON or
            # at --figure
            paths = write_frontier(result, args.out)[1:] if args.out else []
            out = args.out or os.path.dirname(os.path.abspath(args.plot_only))
            paths.append(_plot(result, args.figure or os.path.join(
                out, result_stem(result) + ".png")))
            return paths, format_markdown(result)
        paths, table = _from_files([args.plot_only], "a frontier result", redraw)
        print(table)
        for path in paths:
            print(f"wrote {path}")
        return 0

    from kvquant_experiments.executor import UnitStore
    # finished units kept beside the results (the working folder without --out), so that the
    # same command resumes after an interruption; removed once the results are written
    units = UnitStore(os.path.join(args.out or ".", UNITS_FOLDER))
    try:
        result = run_frontier(configs, positions=args.positions, chunk_tokens=args.chunk_tokens,
                              prompts=args.prompts, workers=args.workers, progress=progress,
                              text=args.text, model=args.model, scheduler=args.scheduler,
                              score=args.score, units=units)
    except KeyboardInterrupt as exc:
        # the same kind (Ctrl-C or SIGTERM), saying what a rerun picks up
        raise type(exc)(f"{units.saved + units.loaded} finished unit(s) are saved in "
                        f"{units.folder}: rerun the same command to resume") from None
    if choices:
        result["meta"]["frontier"]["choices"] = choices
    out = args.out or result_stem(result)
    try:
        paths = write_frontier(result, out)
        paths.append(_plot(result, args.figure or os.path.join(
            out, result_stem(result) + ".png")))
    except OSError as exc:      # a full disk after the run: its finished units stay for a rerun
        raise ValueError(f"cannot write the results in {out} ({exc.strerror or exc}); the "
                         f"{units.saved + units.loaded} finished unit(s) are kept in "
                         f"{units.folder}: free space, then run the same command to "
                         "resume") from None
    units.discard()             # the results hold everything the units did
    print(format_markdown(result))
    for path in paths:
        print(f"wrote {path}")
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
