"""Whole flip tables: the protocol and the text metrics of :mod:`kvquant.flips` over an executor.

:func:`run_flips` cuts a run into tasks (groups of codecs of the engine's protocol; text chunks,
each for a group of codecs with its own f32 reference) and sends them to the experiments'
executor (:func:`kvquant_experiments.executor.open_executor`): in this process, local worker
processes (each loads the model once and uses one BLAS thread) or a Dask cluster. Each task is
a pure function of its arguments, so where it runs does not change the numbers.

The rows' sizes are :mod:`kvquant_experiments.flip_storage`'s, the markdown tables
:mod:`kvquant_experiments.flip_tables`', the result files :mod:`kvquant_experiments.flip_files`'
and the ``kvquant flips`` command :mod:`kvquant_experiments.flip_command`'s.
"""
import concurrent.futures as cf
import math
import os
import sys
import time

import numpy as np

from kvquant import flips
from kvquant_experiments.texts import Text, load_text, text_tokens
from kvquant_experiments.flip_storage import add_storage
from kvquant_experiments.models import model_of

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_CODECS",
    "DEFAULT_POSITIONS",
    "run_chunks",
    "run_flips",
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


# --------------------------------------------------------------------------------------------
# Tasks: module-level functions of picklable arguments (for any executor)
# --------------------------------------------------------------------------------------------
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
    from kvquant.specs import parse_cache_spec
    # every group runs the f32 reference; a listed spec that is the reference (however
    # spelled) is the reference's row, so it goes with every group and is not run as a spec
    is_reference = [parse_cache_spec(s).is_reference for s in specs]
    references = [s for s, ref in zip(specs, is_reference) if ref] or ["f32"]
    groups = _groups([s for s, ref in zip(specs, is_reference) if not ref],
                     groups_per_chunk) or [[]]
    groups = [references + g for g in groups]
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
        Pair specs; default :data:`DEFAULT_CODECS` of the model. The f32 reference is always
        included, its row named ``f32`` (first, unless the list gives it, as ``f32`` or another
        spelling such as ``F32``; twice is an error).
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
    # parsed once here; rows are named by each spec's canonical text, the f32 reference's row
    # "f32" however the list spells it (tables, frontiers and plots find it by that name)
    parsed = parse_cache_specs(list(codecs or DEFAULT_CODECS[kind]))
    codecs = ["f32" if s.is_reference else s.text for s in parsed]
    if not any(s.is_reference for s in parsed):
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


if __name__ == "__main__":
    sys.exit("kvquant_experiments.flip_runs is the engine of kvquant flips, not a command: run "
             "kvquant flips (kvquant flips --help)")
