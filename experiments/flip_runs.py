"""Whole flip tables: the protocol and the text metrics of :mod:`kvquant.flips` over an executor,
their result files and the ``kvquant flips`` command.

:func:`run_flips` cuts a run into tasks (groups of codecs of the engine's protocol; text chunks,
each for a group of codecs with its own f32 reference) and sends them to the experiments'
executor (:func:`kvquant_experiments.executor.open_executor`): in this process, local worker
processes (each loads the model once and uses one BLAS thread) or a Dask cluster. Each task is
a pure function of its arguments, so where it runs does not change the numbers.
"""
import concurrent.futures as cf
import csv
import functools
import math
import os
import sys
import time

import numpy as np

from kvquant.cli import DefaultsHelpFormatter
from kvquant import flips
from kvquant_experiments.texts import Text, load_text, text_tokens
from kvquant_experiments.common import safe_stem, write_json
from kvquant.outputs import atomic_write, check_out_dir, dumps_strict
from kvquant_experiments.executor import UnitStore

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_CODECS",
    "DEFAULT_POSITIONS",
    "POSITION_CSV_COLUMNS",
    "add_cli",
    "add_storage",
    "format_llama_tables",
    "format_markdown",
    "model_tag",
    "run_chunks",
    "run_flips",
    "result_stem",
    "storage_context",
    "write_results",
]

DEFAULT_CODECS = {
    # R rows are 8 wide: the llama.cpp block formats (32 per block) go on L only.
    "tiny-mla": [
        "f32", "kv8", "kv8-g16", "kv8-g8", "kv8-g4", "tq2", "tq3", "tq4", "tq4:compat=colibri",
        "polar3", "polar4", "polar6", "polar3:compat=colibri", "polar4:compat=colibri",
        "polar6:compat=colibri", "q8_0/f32", "q4_0/f32", "q4_0+rot/f32", "tq4/f32", "f32/tq4",
    ],
    # every model with a text (SmolLM2, other GGUF files)
    "real": [
        "f32", "kv8", "kv8-g32", "tq2", "tq3", "tq4", "tq4:compat=colibri",
        "polar3", "polar4", "polar6", "polar3:compat=colibri", "polar4:compat=colibri",
        "polar6:compat=colibri", "q8_0", "q4_0", "q4_0+rot", "kv8/tq4", "tq4/kv8", "q8_0/q4_0",
    ],
}
# Real text: 10 chunks of 1024 tokens. 10240 positions put the Wilson 95% half-width of any
# proportion under 0.97 points (p = 0.5; 0.59 points at p = 0.9).
DEFAULT_POSITIONS = 10240
DEFAULT_CHUNK_TOKENS = 1024
DEFAULT_PROMPTS = {"tiny-mla": 1, "real": 8}


def _kind(model_name):
    return "tiny-mla" if model_name == "tiny-mla" else "real"


def model_tag(model_name):
    """A model's name in file names: the name given, or a GGUF file's stem."""
    name = str(model_name)
    if name.lower().endswith(".gguf") or os.sep in name:
        name = os.path.splitext(os.path.basename(name))[0]
    return "".join(c if c.isalnum() or c in "._+-" else "_" for c in name)


# --------------------------------------------------------------------------------------------
# Tasks: module-level functions of picklable arguments (for any executor)
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _loaded(name):
    from kvquant.models import load_model
    return load_model(name)


def model_of(source):
    """The model of a task: ``source`` is a model object (runs in this process) or a model
    name, loaded once per worker process. The caches come from the spec texts alone, so a
    plug-in kind's specs (``sim:``, ``probe:``) need nothing more than the model."""
    return _loaded(source) if isinstance(source, str) else source


def protocol_task(source, specs, prompts, n_new):
    return flips.flip_protocol(model_of(source), specs, prompts, n_new)


def chunk_task(source, specs, ids):
    return flips.chunk_stats(model_of(source), specs, ids)


def _groups(items, n):
    return [g for g in (items[i::n] for i in range(max(1, n))) if g]


def _submit_unit(executor, units, kind, params, fn, *args):
    """``executor.submit(fn, *args)``, or the unit's stored result when ``units`` (a
    :class:`~kvquant_experiments.executor.UnitStore`) has it; a computed result is stored as
    soon as it is done, so an interrupted run keeps every finished unit."""
    if units is None:
        return executor.submit(fn, *args)
    key = units.key(kind, params)
    stored = units.get(key)
    if stored is not None:
        future = cf.Future()
        future.set_result(stored)
        return future
    future = executor.submit(fn, *args)
    future.add_done_callback(units.done_callback(key))
    return future


def run_chunks(executor, source, specs, chunks, groups_per_chunk=1, progress=None, units=None):
    """:func:`kvquant.flips.chunk_stats` of every chunk, its specs cut into ``groups_per_chunk``
    groups (each a task with its own f32 reference, so that one long chunk can spread over
    workers); returns the stats in chunk order, each with every spec in the order of ``specs``.
    With ``units``, finished tasks are stored and a rerun reuses them.
    """
    groups = _groups([s for s in specs if s != "f32"], groups_per_chunk) or [[]]
    groups = [["f32"] + g for g in groups]
    futures = {}
    for ci, (_, ids) in enumerate(chunks):
        for group in groups:
            futures[_submit_unit(executor, units, "chunk", {"specs": group, "ids": ids},
                                 chunk_task, source, group, ids)] = ci
    parts = [[] for _ in chunks]
    for done, future in enumerate(cf.as_completed(futures), 1):
        ci = futures[future]
        parts[ci].append(future.result())
        if progress:
            progress(f"text task {done}/{len(futures)} (chunk {ci + 1}/{len(chunks)}) done")
    stats = []
    for chunk_parts in parts:
        merged = {"n": chunk_parts[0]["n"], "nll_f32": chunk_parts[0]["nll_f32"],
                  "nll_f32_at": chunk_parts[0]["nll_f32_at"],
                  "reference_s": sum(p["reference_s"] for p in chunk_parts), "specs": {}}
        for spec in specs:
            merged["specs"][spec] = next(p["specs"][spec] for p in chunk_parts
                                         if spec in p["specs"])
        stats.append(merged)
    return stats


def _run_protocol(executor, source, codecs, prompts, n_groups, progress, units=None):
    if units is not None:       # one unit per codec: an interruption loses at most one
        n_groups = len(codecs)
    futures = [_submit_unit(executor, units, "protocol",
                            {"specs": g, "prompts": prompts, "new": flips.NEW_TOKENS},
                            protocol_task, source, g, prompts, flips.NEW_TOKENS)
               for g in _groups(codecs, n_groups)]
    for future in cf.as_completed(futures):
        if progress:
            progress("protocol: " + ", ".join(
                f"{r['codec']} TF {r['tf']['k']}/{r['tf']['n']} greedy "
                f"{r['greedy']['k']}/{r['greedy']['n']}" for r in future.result()["rows"]))
    parts = [f.result() for f in futures]
    by_spec = {r["codec"]: r for part in parts for r in part["rows"]}
    return {"references": parts[0]["references"], "rows": [by_spec[c] for c in codecs]}


# --------------------------------------------------------------------------------------------
# The whole table
# --------------------------------------------------------------------------------------------
def run_flips(model_name, codecs=None, positions=None, chunk_tokens=DEFAULT_CHUNK_TOKENS,
              n_prompts=None, workers=None, model=None, progress=None, text="pydoc",
              scheduler=None, score="all", units=None):
    """Build the flip table of a model.

    Parameters
    ----------
    model_name : str
        ``"tiny-mla"`` (the engine's protocol only: random weights, no text), ``"smollm2"``, or
        any name or GGUF path :func:`kvquant.models.load_model` takes.
    codecs : list of str, optional
        Pair specs; default :data:`DEFAULT_CODECS` of the model. ``f32`` is always included.
    positions : int, optional
        Real-text positions; default :data:`DEFAULT_POSITIONS`; 0 skips them.
    chunk_tokens : int
        Tokens per text chunk (one prefill each), at most the model's ``context_length``.
    n_prompts : int, optional
        Prompts of the engine's protocol (1 on the tiny model; default 8 otherwise).
    workers : int, optional
        Local worker processes (each loads the model and uses one BLAS thread); 1 runs
        everything in this process. Default: 1 when ``model`` is given, else the cores, at
        most 2.
    model : optional
        An already built model (saves the load; worker processes load their own).
    text : str, os.PathLike or Text
        A built-in text name (:data:`kvquant_experiments.texts.TEXTS`) or a UTF-8 file.
    scheduler : None, "serial", Dask address or distributed.Client
        Where the tasks run (:func:`kvquant_experiments.executor.open_executor`); None: as
        ``workers`` says.
    score : {"all", "second-half"}
        Text positions that enter the statistics: every one (default), or the second half of
        each chunk as llama-perplexity scores (:func:`kvquant.flips.scored_from`).
    units : kvquant_experiments.executor.UnitStore, optional
        Keep each finished unit (a chunk's task, a codec's protocol) there as it finishes and
        reuse the ones it holds, so that the same call after an interruption computes only the
        rest and gives the same numbers (its identity is bound here: the model and version).

    Returns
    -------
    dict: ``meta`` (model, protocol, text, versions, executor, elapsed) and ``rows`` (one per
    spec; see :func:`kvquant.flips.flip_protocol` and :func:`kvquant.flips.combine_chunks`).
    """
    from kvquant.models import load_model
    from kvquant_experiments.executor import open_executor
    from kvquant.specs import parse_cache_specs
    t_start = time.perf_counter()
    # counts fail before any work, with the option's name
    for name, value, low in (("positions", positions, 0), ("chunk tokens", chunk_tokens, 1),
                             ("prompts", n_prompts, 1), ("workers", workers, 1)):
        if value is not None and (isinstance(value, bool) or int(value) != value
                                  or value < low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    kind = _kind(model_name)
    # parsed once here; rows are named by each spec's canonical text
    codecs = [s.text for s in parse_cache_specs(list(codecs or DEFAULT_CODECS[kind]))]
    if "f32" not in codecs:
        codecs.insert(0, "f32")
    if len(set(codecs)) != len(codecs):
        raise ValueError(f"a codec is listed twice in {codecs}")
    flips.scored_from(1, score)   # a bad score fails before any work
    if workers is None and (model is not None or scheduler is not None):
        workers = 1
    # a bad text fails before the model loads
    resolved = None if kind == "tiny-mla" else (
        text if isinstance(text, Text) else load_text(text))
    model = model if model is not None else load_model(model_name)
    for spec in codecs:          # fail on a bad spec before any long run
        model.new_cache(spec)
    n_prompts = DEFAULT_PROMPTS[kind] if n_prompts is None else int(n_prompts)
    if kind == "tiny-mla":
        if positions:
            raise ValueError("--positions applies to a real model with a text; the tiny model "
                             "runs the engine's protocol only (its weights are random: no text)")
        positions, tokens = 0, None
    else:
        positions = DEFAULT_POSITIONS if positions is None else int(positions)
        tokens, resolved = text_tokens(model, resolved)
        context = getattr(model, "context_length", None)
        if positions and context and chunk_tokens > context:
            raise ValueError(f"chunks of {chunk_tokens} tokens exceed the trained context of "
                             f"{model_name} ({context} tokens): use --chunk-tokens {context} "
                             "or less")
    workers = min(2, os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    prompts = flips.protocol_prompts(model_name, tokens, n_prompts)
    try:
        chunks = (flips.text_chunks(tokens, positions, chunk_tokens, bos=model.bos_token_id)
                  if positions else [])
    except ValueError as exc:
        raise ValueError(f"text {resolved.name!r} ({resolved.source}): {exc}") from None
    if scheduler is None and workers == 1:
        scheduler = "serial"
    if units is not None:
        import kvquant
        units.bind({"model": model.describe(), "model_name": str(model_name),
                    "kvquant": kvquant.__version__})
    with open_executor(scheduler, workers) as ex:
        source = model if ex.kind == "serial" else model_name
        lanes = workers if ex.kind == "local" else 2
        proto = _run_protocol(ex, source, codecs, prompts,
                              1 if ex.kind == "serial" else lanes, progress, units)
        stats = run_chunks(ex, source, codecs, chunks,
                           1 if ex.kind == "serial" else math.ceil(lanes / max(1, len(chunks))),
                           progress, units) if chunks else []
        executor_description = ex.description
    rows = proto["rows"]
    meta = {
        "model": model.describe(),
        "model_name": str(model_name),
        "protocol": {
            "prompts": len(prompts),
            "prompt_tokens": len(prompts[0]),
            "new_tokens": flips.NEW_TOKENS,
            "references": proto["references"],
        },
    }
    if positions:
        meta["text"] = {**resolved.describe(), "text_tokens": int(tokens.size),
                        "positions": positions, "chunk_tokens": chunk_tokens,
                        "chunk_starts": [int(s) for s, _ in chunks], "score": score}
        for row, text_row in zip(rows, flips.combine_chunks(codecs, stats, score=score)):
            assert row["codec"] == text_row["codec"]
            row.update({k: v for k, v in text_row.items() if k != "codec"})
    import kvquant
    meta["kvquant"] = kvquant.__version__
    meta["numpy"] = np.__version__
    meta["python"] = sys.version.split()[0]
    meta["executor"] = executor_description
    meta["workers"] = workers
    meta["elapsed_s"] = time.perf_counter() - t_start
    if units is not None:
        meta["resumed_units"] = units.loaded
        if units.loaded and progress:
            progress(f"resumed: {units.loaded} finished unit(s) reused from {units.folder}")
    add_storage(rows, meta)
    return {"meta": meta, "rows": rows}


UNITS_FOLDER = ".flips-units"


def storage_context(meta):
    """Tokens over which a table spreads the fixed bytes of stream options: the text chunk's
    context, or the protocol's sequence (prompt + greedy tokens) without text."""
    if "text" in meta:
        return int(meta["text"]["chunk_tokens"])
    return int(meta["protocol"]["prompt_tokens"]) + int(meta["protocol"]["new_tokens"])


def add_storage(rows, meta):
    """Every byte in the rows' sizes: ``marginal_bytes_per_token`` (what each further token
    adds), ``fixed_bytes`` (stream options: f32 sink rows, recent-window copies, offsets and
    scales), ``context_tokens`` (:func:`storage_context`), ``bytes_per_token`` = marginal +
    fixed / context (all the cache stores, per token of that context), ``bits_per_value`` and
    ``compression`` (f32 bytes per token over it). Rows of older results, whose
    ``bytes_per_token`` was the marginal one, are read as such."""
    from kvquant.specs import parse_cache_spec
    context = storage_context(meta)
    for r in rows:
        if "marginal_bytes_per_token" not in r:
            r["marginal_bytes_per_token"] = r["bytes_per_token"]
        r["fixed_bytes"] = int(r.get("fixed_bytes", 0))
        spec = parse_cache_spec(r["codec"])
        if hasattr(spec, "fixed_bytes"):
            # a cache whose fixed rows depend on the length (a simulation's float32 residual):
            # counted at this context
            m = meta["model"]
            r["fixed_bytes"] = int(round(spec.fixed_bytes(
                m["n_layers"], m["n_kv_heads"], m["head_dim"], context)))
        r["context_tokens"] = context
        r["bytes_per_token"] = r["marginal_bytes_per_token"] + r["fixed_bytes"] / context
    f32 = next(r for r in rows if r["codec"] == "f32")
    values_per_token = f32["marginal_bytes_per_token"] / 4.0
    for r in rows:
        r["compression"] = f32["bytes_per_token"] / r["bytes_per_token"]
        r["bits_per_value"] = 8.0 * r["bytes_per_token"] / values_per_token
    return rows


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def _frac(p):
    return f"{p['k']}/{p['n']} [{100 * p['lo']:.0f}, {100 * p['hi']:.0f}]"


def _pct(p):
    return f"{100 * p['p']:.2f} [{100 * p['lo']:.2f}, {100 * p['hi']:.2f}]"


def _streams(row):
    from kvquant.models.plan import CachePlan
    from kvquant.specs import parse_cache_spec
    if isinstance(parse_cache_spec(row["codec"]), CachePlan):   # specs by layer: its file
        return "plan " + row["codec"]
    (na, a), (nb, b) = row["streams"].items()
    return a if a == b else f"{na.upper()} {a} / {nb.upper()} {b}"


def _pm(r, key, se_key, fmt="{:.3e}", scale=1.0):
    v = r.get(key)
    if v is None:
        return "-"
    cell = fmt.format(scale * v)
    se = r.get(se_key) if se_key else None
    return cell + (" ± " + fmt.format(scale * se) if se is not None else "")


def _boot(r, key, fmt="{:.3e}"):
    b = (r.get("bootstrap") or {}).get(key)
    return f" [{fmt.format(b[0])}, {fmt.format(b[1])}]" if b else ""


def intervals_note(result):
    """What the brackets and ± of the tables are."""
    rows = result["rows"]
    boot = next((r["bootstrap"] for r in rows if r.get("bootstrap")), None)
    note = ("±: llama.cpp's standard error (positions taken as independent, so nominal: "
            "positions of a chunk share a context); ")
    if boot:
        note += (f"[lo, hi] after mean KLD and PPL ratio: {100 * boot['level']:.0f}% "
                 f"{boot['method']}; ")
    else:
        note += "no bootstrap interval (one chunk); "
    return note + "same top: Wilson 95% interval (percent)."


def format_markdown(result, llama=True):
    """The table as markdown: sizes with every byte (fixed bytes of stream options spread over
    the context), agreement with Wilson 95% intervals (percent), and with text the mean KLD and
    PPL ratio with llama.cpp's standard error and the bootstrap interval over chunks; with
    ``llama``, llama.cpp's whole statistic set in two more tables."""
    meta, rows = result["meta"], result["rows"]
    add_storage(rows, meta)
    has_text = "text" in meta
    lines = []
    proto = meta["protocol"]
    head = (f"Model {meta['model']['model']}; engine protocol: {proto['prompts']} prompt(s) of "
            f"{proto['prompt_tokens']} tokens + {proto['new_tokens']} greedy tokens")
    if has_text:
        t = meta["text"]
        scored = ("the second half of each chunk scored, as llama-perplexity"
                  if t.get("score") == "second-half" else "every position scored")
        head += (f"; real text: {t['positions']} positions of {t['source']} in chunks of "
                 f"{t['chunk_tokens']} tokens ({scored})")
    lines.append(head + f". Attention: {meta['model']['attention']}.")
    lines.append("")
    context = storage_context(meta)
    cols = ["codec", "B/token", "fixed B", "bits/value", "ratio", "TF agree", "greedy agree",
            "TF KLD"]
    if has_text:
        cols += ["same top % [95% CI]", "mean KLD ± SE [bootstrap]", "p99 KLD",
                 "PPL ratio ± SE [bootstrap]", "text s"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = [_streams(r), f"{r['bytes_per_token']:.1f}", str(r["fixed_bytes"]),
                 f"{r['bits_per_value']:.2f}", f"{r['compression']:.2f}",
                 _frac(r["tf"]), _frac(r["greedy"]), f"{r['tf_kld_mean']:.2e}"]
        if has_text:
            cells += [_pct(r["same_top"]),
                      _pm(r, "kld_mean", "kld_mean_se") + _boot(r, "kld_mean"),
                      f"{r['kld_p99']:.2e}",
                      _pm(r, "ppl_ratio", "ppl_ratio_se", "{:.4f}") + _boot(r, "ppl_ratio",
                                                                             "{:.4f}"),
                      f"{r['text_s']:.1f}" if "text_s" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    decoded = [f"{r['codec']} ({', '.join(r['decoded_streams'])})" for r in rows
               if r.get("decoded_streams")]
    if decoded:
        lines.append("")
        lines.append("Read as decoded rows (the codec has no compressed-domain consumer: "
                     "attention decodes, then multiplies in float32): " + "; ".join(decoded)
                     + ".")
    lines.append("")
    lines.append(f"B/token: every stored byte per token of a {context}-token context: each token's "
                 "codes and side values, plus the fixed bytes of stream options (fixed B: f32 "
                 "sink rows, recent-window copies, offsets and scales, per cache) spread over "
                 f"the {context} tokens; bits/value and ratio (against f32) from it.")
    if has_text:
        lines.append("")
        lines.append(f"PPL(f32) = {rows[0]['ppl_f32']:.3f}. " + intervals_note(result)
                     + " text s: seconds of the codec's prefills and metrics, summed over "
                     "chunks (the f32 reference's prefill not included).")
        if llama and "ppl_se" in rows[0]:
            lines += ["", *format_llama_tables(result)]
    return "\n".join(lines)


def format_llama_tables(result):
    """llama.cpp's ``--kl-divergence`` statistics under its names (Δp in percent, as it prints
    them): one table of means and KLD percentiles, one of Δp percentiles."""
    from kvquant.metrics import DP_PERCENTILES, KLD_PERCENTILES
    rows = [r for r in result["rows"] if "ppl_se" in r]
    lines = ["llama.cpp's statistics (`llama-perplexity --kl-divergence`, same definitions; "
             "± its standard error):", ""]
    cols = ["codec", "Mean PPL(Q)", "Mean PPL(base)", "Cor(ln PPL(Q), ln PPL(base))",
            "Mean ln(PPL(Q)/PPL(base))", "Mean PPL(Q)/PPL(base)", "Mean KLD",
            "Maximum KLD"] + [f"{100 * f:g}% KLD" for _, f in KLD_PERCENTILES[:4]] + [
            "Median KLD"] + [f"{100 * f:g}% KLD" for _, f in KLD_PERCENTILES[4:]] + [
            "Minimum KLD", "Mean Δp", "RMS Δp", "Same top p"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cor = r.get("cor_ln_ppl")
        cells = [_streams(r), _pm(r, "ppl", "ppl_se", "{:.4f}"),
                 _pm(r, "ppl_f32", "ppl_f32_se", "{:.4f}"),
                 f"{100 * cor:.2f}%" if cor is not None else "-",
                 _pm(r, "mean_ln_ppl_ratio", "mean_ln_ppl_ratio_se", "{:.5f}"),
                 _pm(r, "ppl_ratio", "ppl_ratio_se", "{:.5f}"),
                 _pm(r, "kld_mean", "kld_mean_se"), f"{r['kld_max']:.3e}"]
        cells += [f"{r['kld_' + k]:.3e}" for k, _ in KLD_PERCENTILES[:4]]
        cells += [f"{r['kld_median']:.3e}"]
        cells += [f"{r['kld_' + k]:.3e}" for k, _ in KLD_PERCENTILES[4:]]
        cells += [f"{r['kld_min']:.3e}", _pm(r, "dp_mean", "dp_mean_se", "{:.3f}%", 100),
                  _pm(r, "dp_rms", "dp_rms_se", "{:.3f}%", 100),
                  _pm(r, "same_top_p", "same_top_se", "{:.3f}%", 100)]
        lines.append("| " + " | ".join(cells) + " |")
    cols = (["codec", "Maximum Δp"] + [f"{100 * f:g}% Δp" for _, f in DP_PERCENTILES[:5]]
            + ["Median Δp"] + [f"{100 * f:g}% Δp" for _, f in DP_PERCENTILES[5:]]
            + ["Minimum Δp"])
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [_streams(r), f"{100 * r['dp_max']:.3f}%"]
        cells += [f"{100 * r['dp_' + k]:.3f}%" for k, _ in DP_PERCENTILES[:5]]
        cells += [f"{100 * r['dp_median']:.3f}%"]
        cells += [f"{100 * r['dp_' + k]:.3f}%" for k, _ in DP_PERCENTILES[5:]]
        cells += [f"{100 * r['dp_min']:.3f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def result_stem(result):
    """``flips-<model>-p<prompts>[-<text>-N<positions>-c<chunk tokens>]``."""
    meta = result["meta"]
    stem = f"flips-{model_tag(meta.get('model_name', meta['model']['model']))}"
    stem += f"-p{meta['protocol']['prompts']}"
    if "text" in meta:
        t = meta["text"]
        stem += f"-{t.get('name', 'pydoc')}-N{t['positions']}-c{t['chunk_tokens']}"
        if t.get("score") == "second-half":
            stem += "-half"
    return safe_stem(stem)


def _llama_keys():
    from kvquant.metrics import LLAMA_STATISTICS
    keys = []
    for _, value, se in LLAMA_STATISTICS:
        keys += [value] + ([se] if se else [])
    return keys


CSV_COLUMNS = (["codec", "streams", "bytes_per_token", "fixed_bytes", "marginal_bytes_per_token",
                "context_tokens", "bits_per_value", "compression", "tf_k", "tf_n",
                "tf_lo", "tf_hi", "greedy_k", "greedy_n", "greedy_lo", "greedy_hi",
                "tf_kld_mean", "same_top_k", "same_top_n", "same_top_lo", "same_top_hi"]
               + [k for k in _llama_keys() if k not in ("same_top_p",)]
               + ["n_scored", "kld_mean_boot_lo", "kld_mean_boot_hi", "ppl_ratio_boot_lo",
                  "ppl_ratio_boot_hi", "boot_chunks", "text_s"])
POSITION_CSV_COLUMNS = ["codec", "pos_lo", "pos_hi", "n", "kld_mean", "same_top"]


def position_rows(result):
    """Flat rows of the per-position bins: one per (codec, bin)."""
    out = []
    for r in result["rows"]:
        bins = r.get("by_position")
        if not bins:
            continue
        e = bins["edges"]
        for i, n in enumerate(bins["n"]):
            out.append({"codec": r["codec"], "pos_lo": e[i], "pos_hi": e[i + 1], "n": n,
                        "kld_mean": bins["kld_mean"][i], "same_top": bins["same_top"][i]})
    return out


def write_results(result, out_dir, figure=True):
    """Write ``<stem>.json``, ``<stem>.csv`` and, with text metrics, ``<stem>-positions.csv``
    and the KL-divergence-by-position figure ``<stem>-kld-by-position.png`` (when matplotlib
    is installed and ``figure``) in ``out_dir``; returns the paths written."""
    add_storage(result["rows"], result["meta"])
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(result))
    # each file atomically: a kill or a full disk leaves the previous file, never half a new one
    write_json(stem + ".json", result)
    paths = [stem + ".json", stem + ".csv"]
    atomic_write(stem + ".csv", lambda f: _write_rows_csv(f, result["rows"]))
    pos = position_rows(result)
    if pos:
        def write_positions(f):
            w = csv.DictWriter(f, fieldnames=POSITION_CSV_COLUMNS)
            w.writeheader()
            w.writerows(pos)
        atomic_write(stem + "-positions.csv", write_positions)
        paths.append(stem + "-positions.csv")
        if figure:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                pass
            else:
                from kvquant_experiments.plots import plot_kld_by_position
                paths.append(str(plot_kld_by_position(result, stem + "-kld-by-position.png")))
    return paths


def _write_rows_csv(f, rows):
    w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        flat = dict(r)
        flat["streams"] = " ".join(f"{k}={v}" for k, v in r["streams"].items())
        for key in ("tf", "greedy", "same_top"):
            if key in r:
                for part in ("k", "n", "lo", "hi"):
                    flat[f"{key}_{part}"] = r[key][part]
        for key, (lo, hi) in ((k, v) for k, v in (r.get("bootstrap") or {}).items()
                              if k in ("kld_mean", "ppl_ratio")):
            flat[f"{key}_boot_lo"], flat[f"{key}_boot_hi"] = lo, hi
        if r.get("bootstrap"):
            flat["boot_chunks"] = r["bootstrap"]["n_chunks"]
        w.writerow(flat)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _progress(quiet):
    def progress(msg):
        if not quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return progress


def _hf_model(args):
    """The ``--backend hf`` model: a local transformers checkpoint folder through
    :mod:`kvquant.hf` (one process: worker processes would load the numpy models)."""
    if args.model == "tiny-mla":
        raise ValueError("--backend hf needs --model DIR, a local transformers checkpoint folder")
    if (args.workers or 1) > 1 or args.scheduler not in (None, "serial"):
        raise ValueError("--backend hf runs in this process: drop --workers / --scheduler")
    if not os.path.isdir(args.model):
        raise ValueError(f"--backend hf: {args.model!r} is not a folder; give a local "
                         "transformers checkpoint folder (config.json and safetensors)")
    try:
        from kvquant.hf import load_hf_model
    except ImportError as exc:
        raise ImportError(f"--backend hf needs the hf extra ({exc}): pip install "
                          "torch==2.13.0, then pip install -e '.[hf]'") from None
    return load_hf_model(args.model)


def cmd_flips(args):
    from kvquant.specs import split_spec_text
    try:
        if not args.no_write:   # before any work: a run must not find out at its end
            check_out_dir(args.out if args.out is not None else ".")
        codecs = split_spec_text(args.codecs) if args.codecs is not None else None
        if codecs == []:
            raise ValueError(f"--codecs {args.codecs!r} names no codec; give specs such as "
                             "kv8,tq4, or leave --codecs out for the model's list")
        if args.plan:   # cache plans: configurations beside (or instead of) the pair specs
            from kvquant.models.plan import CachePlan
            for path in args.plan:
                CachePlan.load(path)   # a bad file fails here, naming it
            codecs = (codecs if codecs is not None else ["f32"]) + list(args.plan)
        model = None
        if args.backend == "hf":
            model = _hf_model(args)
        # finished units are kept beside the results (or in the working folder until the
        # run's own folder is known) so that the same command resumes after an interruption
        units = None if args.no_write else UnitStore(os.path.join(
            args.out if args.out is not None else ".", UNITS_FOLDER))
        result = run_flips(args.model, codecs=codecs, positions=args.positions,
                           chunk_tokens=args.chunk_tokens, n_prompts=args.prompts,
                           workers=args.workers, progress=_progress(args.quiet), text=args.text,
                           scheduler=args.scheduler, score=args.score, model=model,
                           units=units)
    except (ValueError, ImportError, OSError) as exc:
        raise SystemExit(f"kvquant flips: {exc}")
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"{units.saved + units.loaded} finished unit(s) are saved in {units.folder}: rerun "
            "the same command to resume" if units else "nothing was saved (--no-write)") from None
    out = args.out if args.out is not None else result_stem(result)
    paths = () if args.no_write else write_results(result, out)
    if units is not None:       # the results hold everything the units did
        units.discard()
    if args.json:
        print(dumps_strict(result))
    else:
        print(format_markdown(result))
        for p in paths:
            print(f"wrote {p}")
    return 0


def add_cli(sub):
    """Register ``kvquant flips``."""
    from kvquant_experiments.texts import TEXTS
    p = sub.add_parser(
        "flips", help="token-flip table of KV codecs on a model (tiny MLA, SmolLM2, a GGUF file)",
        description="Teacher-forced and greedy agreement with the f32 cache (the engine's "
                    "protocol), and on a model with a tokenizer same-top-p, KL divergence "
                    "(also by position in the chunk) and perplexity ratio over a text; Wilson "
                    "95% intervals.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-mla",
                   help="tiny-mla, smollm2, gemma3-270m, a GGUF file path, or with --backend "
                        "hf a local transformers checkpoint folder")
    p.add_argument("--backend", choices=("numpy", "hf"), default="numpy",
                   help="numpy: kvquant's own forward of the model; hf: the model in "
                        "transformers with kvquant's cache and attention (kvquant.hf)")
    p.add_argument("--codecs", default=None,
                   help="comma-separated specs (options may follow, as in "
                        "tq3:codebook=gaussian,side=unbiased); 'A/B' gives K/V (or L/R) "
                        "different codecs; 'ggml:q8_0/q8_0' (GGUF models) is llama.cpp's "
                        "cache types with its attention arithmetic, as it runs; default: the "
                        "model's list")
    p.add_argument("--plan", action="append", default=None, metavar="JSON",
                   help="a cache plan file (stream specs per layer and KV head, "
                        "kvquant.models.plan; e.g. from python -m kvquant_experiments.allocate) "
                        "measured as one more configuration; repeatable")
    p.add_argument("--positions", type=int, default=None,
                   help=f"real-text positions (default {DEFAULT_POSITIONS}; 0: none)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="tokens per text chunk (one prefill each), up to the model's context")
    p.add_argument("--text", default="pydoc",
                   help="a UTF-8 text file, or a built-in text: " + "; ".join(
                       f"{k}: {v[0]}" for k, v in TEXTS.items()))
    p.add_argument("--score", choices=flips.SCORES, default="all",
                   help="text positions in the statistics: all, or the second half of each "
                        "chunk as llama-perplexity scores")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts of the engine's protocol (default 8; 1 on tiny-mla)")
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: cores, at most 2; 1: this process)")
    p.add_argument("--scheduler", default=None,
                   help="Dask scheduler address (tcp://host:8786) to run the chunks on a "
                        "cluster, or 'serial'")
    p.add_argument("--out", default=None,
                   help="folder for the CSV/JSON results and figure (default: a folder named "
                        "for the run, e.g. ./flips-smollm2-p8-pydoc-N10240-c1024)")
    p.add_argument("--no-write", action="store_true", help="write no files")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_flips)
    return p


def main(argv=None):
    """``kvquant flips ...`` (also ``python -m kvquant_experiments.flip_runs ...``)."""
    from kvquant.cli import parse_subcommand
    args = parse_subcommand(add_cli, "flips", argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
