"""Whole flip tables: the protocol and the text metrics of :mod:`kvquant.flips` over an executor,
their result files and the ``kvquant flips`` command.

:func:`run_flips` cuts a run into tasks (groups of codecs of the engine's protocol; text chunks,
each for a group of codecs with its own f32 reference) and sends them to the experiments'
executor (:func:`kvquant_experiments.executor.open_executor`): in this process, local worker
processes (each loads the model once and uses one BLAS thread) or a Dask cluster. Each task is
a pure function of its arguments, so where it runs does not change the numbers.
"""
import argparse
import csv
import functools
import json
import math
import os
import sys
import time

import numpy as np

from kvquant import flips
from kvquant_experiments.texts import Text, load_text, text_tokens

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_CODECS",
    "DEFAULT_POSITIONS",
    "POSITION_CSV_COLUMNS",
    "add_cli",
    "format_markdown",
    "model_tag",
    "run_chunks",
    "run_flips",
    "result_stem",
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
def _loaded(name, wrap):
    from kvquant.models import load_model
    model = load_model(name)
    return wrap(model) if wrap is not None else model


def model_of(source):
    """The model of a task: ``source`` is a model object (runs in this process) or
    ``(name, wrap)``: ``load_model(name)``, passed through the module-level function ``wrap``
    when not None, loaded once per worker process."""
    return _loaded(*source) if isinstance(source, tuple) else source


def protocol_task(source, specs, prompts, n_new):
    return flips.flip_protocol(model_of(source), specs, prompts, n_new)


def chunk_task(source, specs, ids):
    return flips.chunk_stats(model_of(source), specs, ids)


def _groups(items, n):
    return [g for g in (items[i::n] for i in range(max(1, n))) if g]


def run_chunks(executor, source, specs, chunks, groups_per_chunk=1, progress=None):
    """:func:`kvquant.flips.chunk_stats` of every chunk, its specs cut into ``groups_per_chunk``
    groups (each a task with its own f32 reference, so that one long chunk can spread over
    workers); returns the stats in chunk order, each with every spec in the order of ``specs``.
    """
    groups = _groups([s for s in specs if s != "f32"], groups_per_chunk) or [[]]
    groups = [["f32"] + g for g in groups]
    futures = {}
    for ci, (_, ids) in enumerate(chunks):
        for group in groups:
            futures[executor.submit(chunk_task, source, group, ids)] = ci
    parts = [[] for _ in chunks]
    import concurrent.futures as cf
    for done, future in enumerate(cf.as_completed(futures), 1):
        ci = futures[future]
        parts[ci].append(future.result())
        if progress:
            progress(f"text task {done}/{len(futures)} (chunk {ci + 1}/{len(chunks)}) done")
    stats = []
    for chunk_parts in parts:
        merged = {"n": chunk_parts[0]["n"], "nll_f32": chunk_parts[0]["nll_f32"],
                  "reference_s": sum(p["reference_s"] for p in chunk_parts), "specs": {}}
        for spec in specs:
            merged["specs"][spec] = next(p["specs"][spec] for p in chunk_parts
                                         if spec in p["specs"])
        stats.append(merged)
    return stats


def _run_protocol(executor, source, codecs, prompts, n_groups, progress):
    futures = [executor.submit(protocol_task, source, g, prompts, flips.NEW_TOKENS)
               for g in _groups(codecs, n_groups)]
    import concurrent.futures as cf
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
              scheduler=None):
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

    Returns
    -------
    dict: ``meta`` (model, protocol, text, versions, executor, elapsed) and ``rows`` (one per
    spec; see :func:`kvquant.flips.flip_protocol` and :func:`kvquant.flips.combine_chunks`).
    """
    from kvquant.models import load_model
    from kvquant_experiments.executor import open_executor
    t_start = time.perf_counter()
    kind = _kind(model_name)
    codecs = list(codecs or DEFAULT_CODECS[kind])
    if "f32" not in codecs:
        codecs.insert(0, "f32")
    if len(set(codecs)) != len(codecs):
        raise ValueError(f"a codec is listed twice in {codecs}")
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
    with open_executor(scheduler, workers) as ex:
        source = model if ex.kind == "serial" else (model_name, None)
        lanes = workers if ex.kind == "local" else 2
        proto = _run_protocol(ex, source, codecs, prompts,
                              1 if ex.kind == "serial" else lanes, progress)
        stats = run_chunks(ex, source, codecs, chunks,
                           1 if ex.kind == "serial" else math.ceil(lanes / max(1, len(chunks))),
                           progress) if chunks else []
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
                        "chunk_starts": [int(s) for s, _ in chunks]}
        for row, text_row in zip(rows, flips.combine_chunks(codecs, stats)):
            assert row["codec"] == text_row["codec"]
            row.update({k: v for k, v in text_row.items() if k != "codec"})
    import kvquant
    meta["kvquant"] = kvquant.__version__
    meta["numpy"] = np.__version__
    meta["python"] = sys.version.split()[0]
    meta["executor"] = executor_description
    meta["workers"] = workers
    meta["elapsed_s"] = time.perf_counter() - t_start
    f32_bytes = next(r["bytes_per_token"] for r in rows if r["codec"] == "f32")
    for r in rows:
        r["compression"] = f32_bytes / r["bytes_per_token"]
    return {"meta": meta, "rows": rows}


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def _frac(p):
    return f"{p['k']}/{p['n']} [{100 * p['lo']:.0f}, {100 * p['hi']:.0f}]"


def _pct(p):
    return f"{100 * p['p']:.2f} [{100 * p['lo']:.2f}, {100 * p['hi']:.2f}]"


def _streams(row):
    (na, a), (nb, b) = row["streams"].items()
    return a if a == b else f"{na.upper()} {a} / {nb.upper()} {b}"


def format_markdown(result):
    """The table as markdown (Wilson 95% intervals in brackets, in percent)."""
    meta, rows = result["meta"], result["rows"]
    has_text = "text" in meta
    lines = []
    proto = meta["protocol"]
    head = (f"Model {meta['model']['model']}; engine protocol: {proto['prompts']} prompt(s) of "
            f"{proto['prompt_tokens']} tokens + {proto['new_tokens']} greedy tokens")
    if has_text:
        t = meta["text"]
        head += (f"; real text: {t['positions']} positions of {t['source']} in chunks of "
                 f"{t['chunk_tokens']} tokens")
    lines.append(head + f". Attention: {meta['model']['attention']}.")
    lines.append("")
    cols = ["codec", "B/token", "ratio", "TF agree", "greedy agree", "TF KLD"]
    if has_text:
        cols += ["same top % [95% CI]", "mean KLD", "p99 KLD", "PPL ratio", "text s"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = [_streams(r), str(r["bytes_per_token"]), f"{r['compression']:.2f}",
                 _frac(r["tf"]), _frac(r["greedy"]), f"{r['tf_kld_mean']:.2e}"]
        if has_text:
            cells += [_pct(r["same_top"]), f"{r['kld_mean']:.2e}", f"{r['kld_p99']:.2e}",
                      f"{r['ppl_ratio']:.4f}",
                      f"{r['text_s']:.1f}" if "text_s" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if has_text:
        lines.append("")
        lines.append(f"PPL(f32) = {rows[0]['ppl_f32']:.3f}. text s: seconds of the codec's "
                     "prefills and metrics, summed over chunks (the f32 reference's prefill "
                     "not included).")
    return "\n".join(lines)


def result_stem(result):
    """``flips-<model>-p<prompts>[-<text>-N<positions>-c<chunk tokens>]``."""
    meta = result["meta"]
    stem = f"flips-{model_tag(meta.get('model_name', meta['model']['model']))}"
    stem += f"-p{meta['protocol']['prompts']}"
    if "text" in meta:
        t = meta["text"]
        stem += f"-{t.get('name', 'pydoc')}-N{t['positions']}-c{t['chunk_tokens']}"
    return stem


CSV_COLUMNS = ["codec", "streams", "bytes_per_token", "compression", "tf_k", "tf_n",
               "tf_lo", "tf_hi", "greedy_k", "greedy_n", "greedy_lo", "greedy_hi", "tf_kld_mean",
               "same_top_k", "same_top_n", "same_top_lo", "same_top_hi", "kld_mean", "kld_p99",
               "kld_max", "ppl", "ppl_f32", "ppl_ratio", "text_s"]
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
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(result))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    paths = [stem + ".json", stem + ".csv"]
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            flat = dict(r)
            flat["streams"] = " ".join(f"{k}={v}" for k, v in r["streams"].items())
            for key in ("tf", "greedy", "same_top"):
                if key in r:
                    for part in ("k", "n", "lo", "hi"):
                        flat[f"{key}_{part}"] = r[key][part]
            w.writerow(flat)
    pos = position_rows(result)
    if pos:
        with open(stem + "-positions.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=POSITION_CSV_COLUMNS)
            w.writeheader()
            w.writerows(pos)
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


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _progress(quiet):
    def progress(msg):
        if not quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return progress


def cmd_flips(args):
    from kvquant.codecs import split_spec_list
    try:
        codecs = split_spec_list(args.codecs) if args.codecs else None
        result = run_flips(args.model, codecs=codecs, positions=args.positions,
                           chunk_tokens=args.chunk_tokens, n_prompts=args.prompts,
                           workers=args.workers, progress=_progress(args.quiet), text=args.text,
                           scheduler=args.scheduler)
    except (ValueError, ImportError, OSError) as exc:
        raise SystemExit(f"kvquant flips: {exc}")
    out = args.out if args.out is not None else result_stem(result)
    paths = () if args.no_write else write_results(result, out)
    if args.json:
        print(json.dumps(result, indent=1))
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
                    "95%% intervals.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-mla",
                   help="tiny-mla, smollm2, another name load_model knows, or a GGUF file path")
    p.add_argument("--codecs", default=None,
                   help="comma-separated specs (options may follow, as in "
                        "tq3:codebook=gaussian,side=unbiased); 'A/B' gives K/V (or L/R) "
                        "different codecs; default: the model's list")
    p.add_argument("--positions", type=int, default=None,
                   help=f"real-text positions (default {DEFAULT_POSITIONS}; 0: none)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="tokens per text chunk (one prefill each), up to the model's context")
    p.add_argument("--text", default="pydoc",
                   help="a UTF-8 text file, or a built-in text: " + "; ".join(
                       f"{k}: {v[0]}" for k, v in TEXTS.items()))
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
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvquant")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cli(sub)
    args = parser.parse_args(["flips", *argv])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
