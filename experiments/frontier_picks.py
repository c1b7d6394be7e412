"""The frontier's picks and their held-out evidence: per budget, the configuration with the
lowest mean KLD on a tune text (:func:`choose`, the layout of
``data/results/frontier-choices.json``); the runs of those picks on other texts and models and
the task summaries that ran them, attached to each pick (:func:`pick_evidence`); the held-out
goals, cell by cell, over runs of the picks (:func:`goals_table`). Measuring is
:mod:`kvquant_experiments.frontier`'s job; this module only reads its results. Its command line is
the frontier's (``--choose-from``, ``--choices``, ``--evidence``, ``--goals``).
"""
import copy

from kvquant.ggml_attention import GGML_FAMILY

from .frontier import (BUDGET_HIGH, CHOICE_BUDGETS, MODEL, _model_tag, _pair, check_choices,
                       frontier_rows, result_stem)
from .result_files import Fields, read_json_file

__all__ = ["AS_RUN_FACTOR", "AS_RUN_Q8_0", "CHOICE_BUDGETS", "HELD_OUT_BASELINES",
           "HELD_OUT_GOALS", "TUNE_TEXT", "choice_configs", "choose", "goal_cells",
           "goals_table", "load_choices", "merge_tune_runs", "pick_evidence", "run_command",
           "run_label"]


TUNE_TEXT = "pydoc"
# What a run of the picks measures beside them, on the same text.
HELD_OUT_BASELINES = ["f32", "kv8", "q8_0", "q8_0+rot", "q4_0", "q4_0+rot", "tq4",
                      "ggml:q8_0/q8_0", "ggml:q4_0/q4_0"]


def choose(result, budgets=CHOICE_BUDGETS, source=None):
    """The frontier's picks: per budget, the configuration with the lowest mean KLD among those
    at or under that many bits per value (f32 and llama.cpp's attention as it runs excluded;
    ties: fewer bits), on the result's text.

    Returns
    -------
    dict ``{"<budget>": {"pair": "<K spec>/<V spec>", "bits", "tune_text", "model",
    "tune_kld_mean", "from"}}``, the layout of ``data/results/frontier-choices.json``.
    """
    # llama.cpp's own attention is a bar to measure against, not a configuration to store with
    rows = [x for x in frontier_rows(result) if x["codec"] != "f32"
            and x["family"] != GGML_FAMILY]
    t = result["meta"]["text"]
    out = {}
    for budget in budgets:
        fits = [x for x in rows if x["bits_per_value"] <= budget + 1e-9]
        if not fits:     # a grid without configurations this small: no pick, said by the CLI
            continue
        best = min(fits, key=lambda x: (x["kld_mean"], x["bits_per_value"]))
        k_spec, v_spec = _pair(best["codec"])
        out[f"{budget:g}"] = {
            "pair": best["codec"] if best["family"] == "cache plan" else f"{k_spec}/{v_spec}",
            "bits": round(best["bits_per_value"], 4),
            "tune_text": t.get("name", t["source"]),
            "model": result["meta"].get("model_name", MODEL),
            "tune_kld_mean": best["kld_mean"],
            "from": source or result_stem(result),
        }
    if not out:
        raise ValueError(f"no configuration of the result fits any of the budgets "
                         f"{', '.join(f'{b:g}' for b in budgets)} bits per value")
    return out


def _protocol(result):
    """What makes two runs' KLDs comparable: model, text and its chunks, positions, prompts,
    the positions scored."""
    t, m = result["meta"]["text"], result["meta"]
    return {"model": m.get("model_name", MODEL), "text": t.get("name", t["source"]),
            "positions": t["positions"], "chunk_tokens": t["chunk_tokens"],
            "chunk_starts": t.get("chunk_starts"), "prompts": m["protocol"]["prompts"],
            "score": t.get("score", "all")}


def merge_tune_runs(results, names=None):
    """One result holding the rows of several runs on the same tune text (a grid run, then
    runs of more configurations), for :func:`choose`. The runs must share the model, the text
    and its chunks, the positions and the prompts, or their KLDs are not comparable: a
    ``ValueError`` names what differs. A configuration in several runs keeps its first row."""
    names = names or [f"result {i}" for i in range(1, len(results) + 1)]
    first = _protocol(results[0])
    for name, r in zip(names[1:], results[1:]):
        differ = {k: (first[k], v) for k, v in _protocol(r).items() if first[k] != v}
        if differ:
            raise ValueError(f"{name} is not a run on the same tune text as {names[0]}: "
                             + "; ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in differ.items())
                             + ". Pick from runs of one model, text, chunking and protocol.")
    merged = copy.deepcopy(results[0])
    seen = {r["codec"] for r in merged["rows"]}
    for r in results[1:]:
        for row in r["rows"]:
            if row["codec"] not in seen:
                merged["rows"].append(copy.deepcopy(row))
                seen.add(row["codec"])
    return merged


def load_choices(path):
    """Read a choices file (:func:`choose`), checking its layout and the type of each field
    used (:func:`kvquant_experiments.frontier.check_choices`); returns the dict. ValueError
    naming the file (and the field) otherwise."""
    choices = read_json_file(path)
    if not isinstance(choices, dict) or not choices:
        raise ValueError(f"{path}: a choices file maps budgets to picks, got "
                         f"{type(choices).__name__}")
    check_choices(choices, Fields(path, "a choices file"), "")
    return choices


def pick_evidence(choices, results=(), summaries=()):
    """Each pick's figures away from its tune text: ``choices`` (a choices file's dict) with
    ``held_out`` (per run of the picks in ``results`` on another text or model: its bits and
    mean KLD) and ``tasks`` (per task summary in ``summaries`` of ``kvquant tasks`` that ran the
    pick: accuracy with its Wilson 95% interval, the paired difference to f32 on the same items
    with its 95% interval and the exact McNemar p) added to every pick; earlier evidence is
    replaced."""
    out = {}
    for budget, pick in choices.items():
        out[budget] = {k: v for k, v in pick.items() if k not in ("held_out", "tasks")}
        out[budget]["held_out"], out[budget]["tasks"] = [], []
    for result in results:
        proto = _protocol(result)
        rows = {x["codec"]: x for x in frontier_rows(result)}
        for pick in out.values():
            x = rows.get(pick["pair"])
            if x is None or (proto["text"], proto["model"]) == (pick["tune_text"],
                                                                pick.get("model", MODEL)):
                continue
            pick["held_out"].append({
                "model": proto["model"], "text": proto["text"], "positions": proto["positions"],
                "chunk_tokens": proto["chunk_tokens"], "bits": round(x["bits_per_value"], 4),
                "kld_mean": x["kld_mean"], "from": result_stem(result)})
    for summary in summaries:
        metric, meta = summary["primary_metric"], summary["meta"]
        for row in summary["rows"]:
            for pick in out.values():
                paired = (row.get("paired") or {}).get(metric)
                if row["spec"] != pick["pair"] or paired is None:
                    continue
                pick["tasks"].append({
                    "model": meta["model"], "task": meta["task"], "shots": meta["num_fewshot"],
                    "n": row["n"], "metric": metric, "accuracy": row[metric]["acc"],
                    "wilson95": [row[metric]["low"], row[metric]["high"]],
                    "diff_to_f32": paired["diff"],
                    "paired95": [paired["diff_low"], paired["diff_high"]],
                    "mcnemar_p": paired["mcnemar_p"]})
    return out


def choice_configs(choices, extra=(), baselines=None):
    """The configurations a run of the picks measures: the baselines (default
    :data:`HELD_OUT_BASELINES`; f32 always first, a baseline that is the f32 reference however
    spelled not again), then each pick once, then ``extra``."""
    from kvquant.specs import parse_cache_spec
    configs = ["f32"] + [b for b in (HELD_OUT_BASELINES if baselines is None else baselines)
                         if not parse_cache_spec(b).is_reference]
    for pick in choices.values():
        if pick["pair"] not in configs:
            configs.append(pick["pair"])
    configs += [c for c in extra if c not in configs]
    return configs


# The goals of the held-out frontier (issue 20): mean KLD against the f32 cache, on texts the
# picks were not chosen on, per budget in bits per value.
HELD_OUT_GOALS = {"2.5": 0.06, "3.5": 0.03, "4.5": 0.015, "5.5": 0.004}
NO_GOAL = "no goal set"
# At 8.5 bits: under the storage-only q8_0+rot of the same run, and AS_RUN_FACTOR times under
# llama.cpp's q8_0 as it runs (its quantized attention arithmetic), when the run has that row.
AS_RUN_Q8_0 = "ggml:q8_0/q8_0"
AS_RUN_FACTOR = 10.0


def _row(rows, codec):
    return next((x for x in rows if x["codec"] == codec), None)


def goal_cells(result):
    """The held-out goals, one cell per pick of a run of the picks (``--choices``).

    Returns
    -------
    list of dict
        Per budget of the run's choices, in increasing budget: ``budget``, ``pair``, ``bits``
        (on this run: fixed costs spread over its chunk), ``kld_mean``, ``goal`` (words) and
        ``met`` (True, False, or None when a baseline the goal names was not run).
    """
    rows = frontier_rows(result)
    choices = result["meta"].get("frontier", {}).get("choices") or {}
    out = []
    for budget, pick in sorted(choices.items(), key=lambda kv: float(kv[0])):
        x = _row(rows, pick["pair"])
        if x is None:
            continue
        cell = {"budget": budget, "pair": pick["pair"], "bits": x["bits_per_value"],
                "kld_mean": x["kld_mean"]}
        checks = [x["bits_per_value"] <= float(budget) + 1e-9]
        if budget in HELD_OUT_GOALS:
            cell["goal"] = f"<= {HELD_OUT_GOALS[budget]:g}"
            checks.append(x["kld_mean"] <= HELD_OUT_GOALS[budget])
        elif float(budget) != BUDGET_HIGH:      # a budget measured without a goal (3 bits)
            cell["goal"] = NO_GOAL
            checks.append(None)
        else:
            parts = []
            for codec, factor in (("q8_0+rot", 1.0), (AS_RUN_Q8_0, AS_RUN_FACTOR)):
                base = _row(rows, codec)
                if base is None:
                    parts.append(f"{codec}: not in this run")
                    checks.append(None)
                    continue
                bar = base["kld_mean"] / factor
                parts.append(f"{codec}" + (f" / {factor:g}" if factor != 1 else "")
                             + f" = {bar:.2e}")
                checks.append(x["kld_mean"] < bar)
            cell["goal"] = "under " + ", ".join(parts)
        # False when a check fails; open (None) when one could not be made
        cell["met"] = False if False in checks else (None if None in checks else True)
        out.append(cell)
    return out


def run_label(result):
    """``<model> <text> c<chunk tokens>`` of a run (a column of :func:`goals_table`)."""
    t = result["meta"]["text"]
    return f"{_model_tag(result)} {t.get('name', t['source'])} c{t['chunk_tokens']}"


def run_command(result, choices_path="data/results/frontier-choices.json"):
    """The command that measures a run of the picks again."""
    t, meta = result["meta"]["text"], result["meta"]
    codecs = [r["codec"] for r in result["rows"]]
    baselines = [b for b in HELD_OUT_BASELINES if b in codecs]
    extra = [c for c in codecs
             if c not in choice_configs(meta["frontier"]["choices"], baselines=baselines)]
    return (f"python -m kvquant_experiments.frontier --model {meta.get('model_name', MODEL)} "
            f"--choices {choices_path} --text {t.get('name', t['source'])} "
            f"--positions {t['positions']} --chunk-tokens {t['chunk_tokens']} "
            f"--prompts {meta['protocol']['prompts']}"
            + (" --score second-half" if t.get("score") == "second-half" else "")
            + (f" --budgets {','.join(meta['frontier']['choices'])}"
               if len(meta["frontier"]["choices"]) < len(CHOICE_BUDGETS) else "")
            + (f" --baselines {','.join(baselines)}" if baselines != HELD_OUT_BASELINES else "")
            + (f" --configs '{','.join(extra)}'" if extra else ""))


def _run_key(result):
    """Runs of the picks that measure the same cell (:func:`_protocol`), in column order."""
    p = _protocol(result)
    return (_model_tag(result), p["chunk_tokens"], p["text"], p["positions"], p["prompts"],
            p["score"])


def _merged_cells(runs, current=None):
    """The goal cells of runs of one key, per budget: the cell whose goal could be checked (a
    later run may add a baseline, such as the as-run q8_0, that an earlier one lacked). With
    ``current`` (a choices dict), cells of picks it has replaced are left out."""
    merged = {}
    for r in runs:
        for c in goal_cells(r):
            if current is not None and (current.get(c["budget"]) or {}).get("pair") != c["pair"]:
                continue
            known = merged.get(c["budget"])
            if known is not None and known["pair"] != c["pair"]:
                raise ValueError(
                    f"runs of {run_label(r)} measure different picks at {c['budget']} bits "
                    f"({known['pair']} and {c['pair']}): pass the runs of one choices file, "
                    "or the current choices file with --choices (older picks are left out)")
            if known is None or known["met"] is None:
                merged[c["budget"]] = c
    return list(merged.values())


def goals_table(results, current=None):
    """Markdown: the held-out goals per budget (rows) on each run of the picks (columns), each
    cell the pick's mean KLD and bits on that run and whether it meets the goal; then the
    command(s) of each column. ``results``: runs of the picks (``--choices``); runs of the same
    model, text, chunk, positions and prompts share a column."""
    groups = {}
    for r in results:
        if r["meta"].get("frontier", {}).get("choices"):
            groups.setdefault(_run_key(r), []).append(r)
    if not groups:
        return "(no run of the picks)"
    keys = sorted(groups)
    cols = [_merged_cells(groups[k], current) for k in keys]
    keep = [i for i, col in enumerate(cols) if col]
    keys, cols = [keys[i] for i in keep], [cols[i] for i in keep]
    if not keys:
        return "(no run of the current picks)"
    budgets = sorted({c["budget"] for col in cols for c in col}, key=float)
    mark = {True: "**met**", False: "missed", None: "open"}
    lines = ["| budget | goal | " + " | ".join(f"({i}) {run_label(groups[k][0])}"
                                               for i, k in enumerate(keys, 1)) + " |",
             "|---|---|" + "---|" * len(keys)]
    for b in budgets:
        goal = (f"mean KLD <= {HELD_OUT_GOALS[b]:g}" if b in HELD_OUT_GOALS else
                f"under q8_0+rot, {AS_RUN_FACTOR:g}x under q8_0 as llama.cpp runs it"
                if float(b) == BUDGET_HIGH else NO_GOAL)
        cells = []
        for col in cols:
            c = next((c for c in col if c["budget"] == b), None)
            if c is not None and c["goal"] == NO_GOAL:
                cells.append(f"{c['kld_mean']:.3g} at {c['bits']:.2f} bits")
                continue
            cells.append("–" if c is None else
                         f"{c['kld_mean']:.3g} at {c['bits']:.2f} bits: {mark[c['met']]}"
                         + ("" if b in HELD_OUT_GOALS else f" ({c['goal']})"))
        lines.append(f"| <= {b} | {goal} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"({i}) " + "; ".join(f"`{run_command(r)}`" for r in groups[k])
              + ("" if i == len(keys) else "  ") for i, k in enumerate(keys, 1)]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    sys.exit("kvquant_experiments.frontier_picks is read by the frontier's command line, not a "
             "command: run python -m kvquant_experiments.frontier with --choose-from, --choices, "
             "--evidence or --goals (its --help)")
