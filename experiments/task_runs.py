"""Task-accuracy tables: ``kvquant tasks``.

A run scores one task's items (:mod:`kvquant.tasks`) on one model under several cache specs and
compares each spec with the f32 cache on the same items. The items of a spec are cut into blocks
that go to the experiments' executor (this process, local worker processes that each load the
model once, or a Dask cluster); each finished block is appended to the spec's log,
``<out>/<spec tag>.jsonl``: a header line naming model, task, shots and spec, then one line per
item (gold, prediction, every choice's log-likelihood). The logs are append-only and fsynced
block by block; a run resumes from them (a header that differs is refused, an incomplete last
line from a killed run is dropped), and a larger ``--limit`` reuses the items already scored.
The summary of a limit, ``<out>/summary-n<N>.json`` and ``.md``, is computed from the logs.
"""
import functools
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np

from kvquant.cli import DefaultsHelpFormatter
from kvquant_experiments.common import read_json, spec_tag, write_json
from kvquant.outputs import atomic_write, check_out_dir

__all__ = ["DEFAULT_CODECS", "add_cli", "format_markdown", "read_log", "run_tasks",
           "summarize", "task_meta"]

DEFAULT_CODECS = ("f32", "kv8", "tq4")
BLOCK_ITEMS = 16     # items per executor call, run together; little is lost on a kill
IN_FLIGHT_BLOCKS = 64  # blocks submitted ahead to a pool or cluster (results are small)
LOG_VERSION = 1
TIMING_KIND = "timing"  # a log line after a block: its seconds, tokens run and items


# --------------------------------------------------------------------------------------------
# Work done in workers (module-level functions of picklable arguments)
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _model(model_name, backend, gguf_file):
    if backend == "hf":
        from kvquant.hf import load_hf_model
        # the file's tokenizer first: its damaged fields are named errors here, before
        # transformers' own GGUF tokenizer conversion meets them as an IndexError
        encode = _gguf_encoder(os.path.join(model_name, gguf_file)) if gguf_file else None
        model = load_hf_model(model_name, gguf_file=gguf_file)
        if encode is not None:
            model.encode = encode
        # A llama GGUF's keys are stored with RoPE pairs adjacent (its converter permutes them;
        # llama.cpp and kvquant's numpy model keep that order): the cache takes them in that
        # order, so that a rotated codec sees the same rows on both backends.
        if gguf_file and model.model.config.model_type == "llama":
            model.key_channels = "interleaved"
        return model
    from kvquant.models import load_model
    return load_model(model_name)


def _gguf_encoder(path):
    """The GGUF file's own tokenizer, with its BOS where the file asks for one: the tokens
    kvquant's numpy model and llama.cpp run. transformers 5.x builds a wrong tokenizer from
    Gemma 3's GGUF (a Unigram model over BPE scores, no BOS: docs/tasks.md), so the hf backend
    takes the file's tokens too, and both backends score the same tokens."""
    from kvquant.models.gguf_config import gguf_field
    from kvquant.models.gguf_file import GGUFFile
    from kvquant.models.tokenizer import tokenizer_from_gguf
    reader = GGUFFile(path)
    try:
        tokenizer = tokenizer_from_gguf(reader)
    except ValueError as exc:       # the fields are the file's: the message names it
        raise ValueError(f"{path}: {exc}") from None
    add_bos = gguf_field(reader, "tokenizer.ggml.add_bos_token", False, required=False)
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id", None, required=False)
    if add_bos and bos is not None and (isinstance(bos, bool) or not isinstance(bos, int) or
                                        not 0 <= bos < tokenizer.get_vocab_size()):
        raise ValueError(f"{path}: tokenizer.ggml.bos_token_id is {bos!r}; the vocabulary's "
                         f"ids are 0..{tokenizer.get_vocab_size() - 1}")
    first = [bos] if add_bos and bos is not None else []

    def encode(text):
        return np.array(first + tokenizer.encode(text).ids, dtype=np.int64)
    return encode


@functools.lru_cache(maxsize=4)
def _items(task, num_fewshot, limit):
    from kvquant.tasks import build_items
    return build_items(task, limit=limit, num_fewshot=num_fewshot)


def score_block(cell):
    """Score items ``cell["indices"]`` of a task under one cache spec; returns their results
    and the block's seconds and tokens run."""
    from kvquant.tasks import ItemScorer
    model = _model(cell["model"], cell["backend"], cell.get("gguf_file"))
    items = _items(cell["task"], cell["num_fewshot"], cell["limit"])
    scorer = ItemScorer(model, cell["cache"])   # a CacheSpec: parsed once, in the parent
    results = scorer.score_many([items[i] for i in cell["indices"]])
    return {"items": results, "seconds": scorer.seconds, "tokens": scorer.tokens_run}


# --------------------------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------------------------
def _header(meta, spec):
    return {"kind": "header", "version": LOG_VERSION, "model": meta["model"],
            "backend": meta["backend"], "task": meta["task"],
            "num_fewshot": meta["num_fewshot"], "spec": spec}


def read_log(path, header=None):
    """(header, item results, timing) of a spec's log. An incomplete last line (a killed write)
    is cut off the file; a header other than ``header`` (when given) is refused. ``timing``
    sums the log's timing records (``{"seconds", "tokens", "items"}`` of every block whose time
    was logged, whichever run computed it)."""
    path = Path(path)
    if not path.is_file():
        return None, [], {"seconds": 0.0, "tokens": 0, "items": 0}
    raw = path.read_bytes()
    good = raw.rfind(b"\n") + 1
    if good < len(raw):
        print(f"kvquant tasks: {path}: dropping an incomplete last line ({len(raw) - good} "
              "bytes) left by an interrupted run", file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
        raw = raw[:good]
    lines = raw.decode("utf-8").splitlines()
    timing = {"seconds": 0.0, "tokens": 0, "items": 0}
    if not lines:
        return None, [], timing
    try:
        stored = json.loads(lines[0])
        records = [json.loads(line) for line in lines[1:] if line.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a kvquant tasks log ({exc.msg}); move it away or give "
                         "another --out") from None
    if stored.get("kind") != "header":
        raise ValueError(f"{path}: its first line is not a kvquant tasks header; move it away "
                         "or give another --out")
    if header is not None and stored != header:
        diff = sorted(k for k in set(stored) | set(header) if stored.get(k) != header.get(k))
        raise ValueError(f"{path} was written for another run ({', '.join(diff)} differ: "
                         f"{ {k: stored.get(k) for k in diff} }); give another --out or "
                         "--fresh to start it over")
    items = []
    for r in records:
        if r.get("kind") == TIMING_KIND:
            for key in timing:
                timing[key] += r[key]
        else:
            items.append(r)
    return stored, items, timing


def _append(path, header, records, timing=None):
    """Append item results to a log (its header first when new) and, when given, the block's
    timing record (``{"seconds", "tokens", "items"}``: a resumed run's summary times every
    logged block, not only its own), fsynced."""
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write(json.dumps(header) + "\n")
        for r in records:
            f.write(json.dumps(r) + "\n")
        if timing is not None:
            f.write(json.dumps({"kind": TIMING_KIND, **timing}) + "\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------
def _storage(model, spec):
    """Bytes one token adds to the cache under ``spec``, the fixed bytes of its stream options
    (float32 sinks and window copies, offsets), and bits per cached value as the context grows
    long (the fixed bytes spread to nothing)."""
    from kvquant.models import decoded_streams
    cache = model.new_cache(spec)
    per_token = float(cache.bytes_per_token)
    values = 2 * model.n_layers * model.n_kv_heads * model.head_dim
    return {"bytes_per_token": per_token, "fixed_bytes": float(getattr(cache, "fixed_bytes", 0)),
            "values_per_token": values, "bits_per_value": 8.0 * per_token / values,
            # streams attention reads as decoded rows (no compressed-domain consumer)
            "decoded_streams": decoded_streams(cache)}


def run_tasks(meta, specs, out_dir, executor=None, progress=True, fresh=False):
    """Score the items of ``meta`` (``meta["limit"]`` of them) under each spec, resuming from
    the logs in ``out_dir``; returns ``{spec: item results}`` of those items and a timing
    dict ``{spec: {"seconds", "tokens", "items"}}`` over every block whose time is logged
    (this run's and earlier runs' on the same log; logs written before timing records
    were kept time only the blocks computed since)."""
    from kvquant_experiments.executor import SerialExecutor
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    items = _items(meta["task"], meta["num_fewshot"], _member_limit(meta))
    keys = [it.key for it in items]
    from kvquant.specs import parse_cache_spec
    done, paths, todo, timing = {}, {}, [], {}
    for spec in specs:
        cache = parse_cache_spec(spec)
        path = paths[spec] = out_dir / f"{spec_tag(spec)}.jsonl"
        if fresh and path.exists():
            path.unlink()
        _, records, logged = read_log(path, _header(meta, spec))
        done[spec] = {(r["task"], r["doc_id"]): r for r in records}
        timing[spec] = logged
        missing = [i for i, k in enumerate(keys) if k not in done[spec]]
        for b in range(0, len(missing), BLOCK_ITEMS):
            todo.append({"model": meta["model"], "backend": meta["backend"],
                         "gguf_file": meta.get("gguf_file"), "task": meta["task"],
                         "num_fewshot": meta["num_fewshot"],
                         "limit": _member_limit(meta), "spec": spec, "cache": cache,
                         "indices": missing[b:b + BLOCK_ITEMS]})
    n_todo = sum(len(c["indices"]) for c in todo)
    bar = None
    if progress and n_todo:
        try:
            from tqdm import tqdm
            bar = tqdm(total=n_todo, desc=f"{meta['task']} on {meta['model_tag']}", unit="item",
                       file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None
    executor = executor if executor is not None else SerialExecutor()
    import concurrent.futures as cf
    # A window of blocks in flight, each appended to its log as it finishes: a serial executor
    # computes a block when it is submitted, so it gets one block at a time (submitting every
    # block first would compute them all before writing any: a kill would lose the whole run).
    window = 1 if isinstance(executor, SerialExecutor) else IN_FLIGHT_BLOCKS
    pending, in_flight = iter(todo), {}
    try:
        while True:
            for cell in itertools.islice(pending, window - len(in_flight)):
                in_flight[executor.submit(score_block, cell)] = cell
            if not in_flight:
                break
            finished, _ = cf.wait(in_flight, return_when=cf.FIRST_COMPLETED)
            for future in finished:
                cell = in_flight.pop(future)
                block = future.result()
                spec = cell["spec"]
                _append(paths[spec], _header(meta, spec), block["items"],
                        {"seconds": block["seconds"], "tokens": block["tokens"],
                         "items": len(block["items"])})
                for r in block["items"]:
                    done[spec][(r["task"], r["doc_id"])] = r
                t = timing[spec]
                t["seconds"] += block["seconds"]
                t["tokens"] += block["tokens"]
                t["items"] += len(block["items"])
                if bar is not None:
                    bar.update(len(block["items"]))
    finally:
        if bar is not None:
            bar.close()
        for f in in_flight:
            f.cancel()
    return {s: [done[s][k] for k in keys] for s in specs}, timing


def summarize(meta, results, storage=None, timing=None, reference="f32"):
    """Per spec: acc (and acc_norm) with Wilson intervals; against ``reference`` on the same
    items: the paired statistics and the verdict (:mod:`kvquant.tasks.stats`)."""
    from kvquant.tasks import accuracy, compare_runs, get_task, task_members, verdict
    metrics = list(get_task(task_members(meta["task"])[0]).metrics)
    primary = "acc_norm" if "acc_norm" in metrics else "acc"
    rows = []
    for spec, recs in results.items():
        row = {"spec": spec, "n": len(recs)}
        for m in metrics:
            key = "pred_norm" if m == "acc_norm" else "pred"
            row[m] = accuracy([r[key] == r["gold"] for r in recs])
        if storage and spec in storage:
            row.update(storage[spec])
            # what the cache held per value on this run's sequences (context + choice): the
            # fixed bytes weigh on short sequences
            tokens = np.mean([np.mean(np.add(r["context_tokens"], r["choice_tokens"]))
                              for r in recs])
            row["mean_tokens"] = float(tokens)
            row["bits_per_value_at_mean"] = 8.0 * (row["bytes_per_token"] * tokens
                                                   + row["fixed_bytes"]) / (
                row["values_per_token"] * tokens)
        if timing and timing.get(spec, {}).get("items"):
            t = timing[spec]
            row["items_per_s"] = t["items"] / t["seconds"] if t["seconds"] else None
            row["tokens_per_s"] = t["tokens"] / t["seconds"] if t["seconds"] else None
            row["timed_items"] = t["items"]
        rows.append(row)
    by_spec = {r["spec"]: r for r in rows}
    if reference in results:
        for row in rows:
            if row["spec"] == reference:
                continue
            row["paired"] = {m: compare_runs(results[reference], results[row["spec"]], metric=m)
                             for m in metrics}
            row["verdict"] = verdict(by_spec[reference][primary], row[primary],
                                     row["paired"][primary])
    return {"meta": meta, "metrics": metrics, "primary_metric": primary, "reference": reference,
            "rows": rows}


def _pct(x):
    return f"{100 * x:.1f}"


def format_markdown(summary):
    """The reviewer's row and the paired table, as Markdown."""
    meta, primary = summary["meta"], summary["primary_metric"]
    lines = [f"### {meta['task']} ({meta['num_fewshot']}-shot), {meta['model_tag']}, "
             f"n = {meta['limit']} ({meta['items_note']})", ""]
    head = ["cache", "bits/value: long context / this run"] + [
        f"{m} % [Wilson 95%]" for m in summary["metrics"]]
    head += [f"vs {summary['reference']}: right both / only f32 / only codec / neither",
             "McNemar p", "diff pts [paired 95%]", "choice flips %", "choice KLD",
             "items for 1 pt", "verdict"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["rows"]:
        cells = [f"`{r['spec']}`", f"{r['bits_per_value']:.2f} / "
                 f"{r['bits_per_value_at_mean']:.2f}" if "bits_per_value" in r else ""]
        for m in summary["metrics"]:
            a = r[m]
            cells.append(f"{_pct(a['acc'])} [{_pct(a['low'])}, {_pct(a['high'])}] "
                         f"({a['k']}/{a['n']})")
        p = r.get("paired", {}).get(primary)
        if p is None:
            cells += ["(reference)"] + [""] * 6
        else:
            cells += [f"{p['both_right']} / {p['only_ref']} / {p['only_other']} / "
                      f"{p['both_wrong']}", f"{p['mcnemar_p']:.3g}",
                      f"{100 * p['diff']:+.1f} [{100 * p['diff_low']:+.1f}, "
                      f"{100 * p['diff_high']:+.1f}]",
                      f"{_pct(p['flip_rate'])} [{_pct(p['flip_low'])}, {_pct(p['flip_high'])}]",
                      f"{p['choice_kld_mean']:.2e}",
                      str(p["items_for_1pt"]) if p["items_for_1pt"] else "-",
                      r["verdict"]["rule"]]
        lines.append("| " + " | ".join(cells) + " |")
    tokens = [r["mean_tokens"] for r in summary["rows"] if "mean_tokens" in r]
    lines += ["", "Bits per cached value: codes and side values per token (a long context), "
              "and with the stream options' fixed bytes (float32 sinks and window copies) spread "
              f"over this run's sequences (context + choice, {tokens[0]:.0f} tokens on average)."
              if tokens else ""]
    decoded = [f"`{r['spec']}` ({', '.join(r['decoded_streams'])})" for r in summary["rows"]
               if r.get("decoded_streams")]
    if decoded:
        lines += ["", "Read as decoded rows (the codec has no compressed-domain consumer: "
                  "attention decodes, then multiplies in float32): " + "; ".join(decoded) + "."]
    lines += ["", f"Paired statistics on {primary}; the verdict is the engine reviewer's rule "
              "(within f32's Wilson interval -> recommended opt-in, unless the paired test "
              "finds the codec worse). Items for 1 pt: items a paired test needs to detect a "
              "1-point difference at the observed discordance (alpha 0.05, power 0.8)."]
    speeds = [r for r in summary["rows"] if r.get("items_per_s")]
    if speeds:
        lines += ["", "Throughput over the items whose blocks' time is logged (worker seconds; "
                  "the runs of a resumed log may have shared the machine): " + "; ".join(
                      f"`{r['spec']}` {r['items_per_s']:.2f} items/s, "
                      f"{r['tokens_per_s']:.0f} tokens/s ({r['timed_items']} items)"
                      for r in speeds) + "."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _model_tag(name, gguf_file=None):
    from kvquant_experiments.models import model_tag
    return model_tag(gguf_file or name)


def _items_note(task, n, member_limit=None):
    if task == "hellaswag" and n <= 1000:
        return "the first validation items: all ActivityNet contexts, no WikiHow"
    members = _members(task)
    if len(members) > 1:
        each = "all documents" if member_limit is None else f"the first {member_limit} documents"
        return f"{each} of each of its {len(members)} subtasks, in file order"
    return "the first items of the split in file order"


def _members(task):
    from kvquant.tasks import task_members
    return (task,) if str(task).endswith(".jsonl") else task_members(task)


def _member_limit(meta):
    """The --limit a run's items were chosen by: per member for a group (``meta["limit"]`` is
    the number of items; summaries written before the two were told apart hold only that)."""
    return meta.get("member_limit", meta["limit"])


def task_meta(model, task, limit=None, num_fewshot=0, backend="numpy", gguf_file=None):
    """The description of a run that :func:`run_tasks` and :func:`summarize` take: ``limit``
    is the number of items there are, ``member_limit`` the --limit that chose them (per
    subtask of a group such as MMLU, as lm-eval applies it)."""
    n = len(_items(task, num_fewshot, limit))
    return {"model": model, "model_tag": _model_tag(model, gguf_file), "backend": backend,
            "gguf_file": gguf_file, "task": task, "num_fewshot": num_fewshot, "limit": n,
            "member_limit": limit, "items_note": _items_note(task, n, limit)}


def _read_summary(path):
    try:
        return read_json(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--plot-beside {path}: {exc}") from None


def cmd_tasks(args):
    from kvquant.specs import parse_cache_spec, parse_cache_specs
    from kvquant.tasks import task_members
    from kvquant_experiments.executor import open_executor
    try:
        # parsed once; logs and rows are named by each spec's canonical text
        specs = [s.text for s in parse_cache_specs(args.codecs)]
        if not specs:
            raise ValueError("--codecs names no cache spec")
        args.reference = parse_cache_spec(args.reference).text
        if args.reference not in specs:
            specs = [args.reference] + specs
        task_members(args.task)        # an unknown task fails here, before any work
        beside = [_read_summary(path) for path in args.plot_beside]
        for path, other in zip(args.plot_beside, beside):
            if not (isinstance(other, dict) and "rows" in other and "meta" in other):
                raise ValueError(f"--plot-beside {path} is not a kvquant tasks summary "
                                 "(summary-n<N>.json)")
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        tag = _model_tag(args.model, args.gguf_file)
        out = check_out_dir(
            args.out or f"tasks-{tag}-{Path(args.task).stem}-{args.num_fewshot}shot")
        if args.backend == "hf" and (args.workers or 1) > 1:
            raise ValueError("--backend hf runs in this process: drop --workers")
        model = _model(args.model, args.backend, args.gguf_file)
        for spec in specs:                 # a bad spec fails here, naming it
            model.new_cache(spec)
        meta = task_meta(args.model, args.task, args.limit, args.num_fewshot, args.backend,
                         args.gguf_file)
        storage = {s: _storage(model, s) for s in specs}
        workers = args.workers if args.workers is not None else (
            1 if args.backend == "hf" else min(2, os.cpu_count() or 1))
        scheduler = "serial" if workers == 1 and args.scheduler is None else args.scheduler
        with open_executor(scheduler, workers=workers) as ex:
            results, timing = run_tasks(meta, specs, out, executor=ex,
                                        progress=not args.quiet, fresh=args.fresh)
    except (ValueError, ImportError, OSError, KeyError) as exc:
        raise SystemExit(f"kvquant tasks: {exc}")
    summary = summarize(meta, results, storage, timing, reference=args.reference)
    summary["command"] = "kvquant tasks " + " ".join(sys.argv[2:]) if sys.argv[1:2] == [
        "tasks"] else None
    stem = out / f"summary-n{meta['limit']}"
    text = format_markdown(summary)
    try:
        write_json(f"{stem}.json", summary)
        atomic_write(f"{stem}.md", lambda f: f.write(text))
        written = [f"{stem}.json", f"{stem}.md"]
        try:
            from kvquant_experiments.plots import plot_task_accuracy
            written.append(str(plot_task_accuracy([summary] + beside, f"{stem}.png")))
        except ImportError:        # matplotlib is the plot extra's
            pass
    except OSError as exc:         # a full disk: every item is in the logs already
        raise SystemExit(f"kvquant tasks: writing the summary in {out} failed "
                         f"({exc.strerror or exc}); the item logs there hold every item "
                         "scored: free space and rerun the same command to write it")
    if args.json:
        print(json.dumps(summary, indent=1, default=float))
    else:
        print(text)
        print(f"wrote {', '.join(written)} and the item logs in {out}")
    return 0


def add_cli(sub):
    """Register ``kvquant tasks``."""
    p = sub.add_parser(
        "tasks", help="multiple-choice task accuracy per cache spec, paired against f32",
        description="Score a task (lm-eval's definitions, offline data) on a model with its KV "
                    "cache through each codec; accuracy with Wilson 95% intervals, the paired "
                    "table against f32 with exact McNemar, a paired bootstrap interval, choice "
                    "flips and the engine reviewer's verdict.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="smollm2, gemma3-270m, a GGUF file path; with --backend hf a local "
                        "transformers checkpoint folder")
    p.add_argument("--backend", choices=("numpy", "hf"), default="numpy",
                   help="numpy: kvquant's forward; hf: transformers with kvquant's cache and "
                        "attention (kvquant.hf)")
    p.add_argument("--gguf-file", default=None,
                   help="with --backend hf: a GGUF file in the --model folder, loaded by "
                        "transformers")
    p.add_argument("--task", default="hellaswag",
                   help="hellaswag, arc_easy, arc_challenge, piqa, winogrande, boolq, mmlu, "
                        "mmlu_<subject>, or a JSONL file (context, choices, gold per line)")
    p.add_argument("--limit", type=int, default=None,
                   help="the first N items (per subject for mmlu); default all")
    p.add_argument("--num-fewshot", type=int, default=0,
                   help="few-shot examples (MMLU: the first k of its dev split)")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                   help="comma-separated cache specs: pair specs (kv8/tq4), stream options, "
                        "plan files, llama.cpp as run (ggml:q8_0/q8_0)")
    p.add_argument("--reference", default="f32", help="the spec the others are paired with")
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: cores, at most 2; 1: this process)")
    p.add_argument("--scheduler", default=None,
                   help="a Dask scheduler address (tcp://host:8786), or 'serial'")
    p.add_argument("--out", default=None,
                   help="folder of the item logs and summaries (default: "
                        "./tasks-<model>-<task>-<k>shot)")
    p.add_argument("--plot-beside", action="append", default=[], metavar="SUMMARY.json",
                   help="draw this summary (another model's or task's summary-n<N>.json) as a "
                        "panel beside this run's in the figure; repeatable")
    p.add_argument("--fresh", action="store_true", help="discard the logs in --out and rescore")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_tasks)
    return p


def main(argv=None):
    """``kvquant tasks ...`` (also ``python -m kvquant_experiments.task_runs ...``)."""
    from kvquant.cli import parse_subcommand
    args = parse_subcommand(add_cli, "tasks", argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
