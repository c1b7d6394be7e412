"""HellaSwag through llama.cpp's own scorer (``llama-perplexity --hellaswag``) beside kvquant's, on
the same items and the same GGUF file: accuracy item by item, and items per second.

What llama.cpp scores (tools/perplexity/perplexity.cpp, ``hellaswag_score``): a text file of six
lines per item (the query, the gold index, the four endings), each ending scored as
``query + " " + ending`` with its tokens' mean log-probability, counted after the prefix the
four sequences share; the highest mean wins (llama.cpp calls the result acc_norm; lm-eval's
acc_norm divides by characters instead). It visits the items in a random order of its own
(std::mt19937 seeded 1), printing the running accuracy after each: the order is recomputed by
tools/hellaswag_order.cpp, compiled here with the same compiler, and each item's right/wrong
is the step of the running count.

kvquant's side comes from its task logs (``kvquant tasks ... --out DIR``: per item, every
choice's summed log-likelihood and token count), scored with llama.cpp's rule. Where the four
endings share leading tokens, llama.cpp leaves them out of the mean and kvquant's logs cannot:
those items are counted apart ("same split" = the query's tokens are exactly the shared prefix).
llama.cpp's caches pair with kvquant's specs: ``f32`` <-> ``f32``, ``q8_0`` <-> ``ggml:q8_0/q8_0``,
``q4_0`` <-> ``ggml:q4_0/q4_0`` (llama.cpp's cache types with its arithmetic and rotation).

Throughput: llama.cpp's f32 run as a whole command (model load included; its own load time is
reported beside) against kvquant's item scorer in this process (f32 and ``--codecs``), the same
first ``--timed-items`` items, each warmed, the blocks alternating over ``--rounds``.

Needs a llama.cpp build (tools only; on CPUs whose native build crashes in decode:
``cmake -B build -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_INT8=OFF
-DGGML_AMX_TILE=OFF -DLLAMA_CURL=OFF && cmake --build build --target llama-perplexity``; the
source is the ``vendor/llama.cpp`` folder of the llama-cpp-python sdist), g++, and kvquant with
the tasks data and SmolLM2::

    python tools/llama_cpp_hellaswag.py --llama-perplexity BUILD/bin/llama-perplexity \\
        --limit 2000 --kvquant-logs data/results/tasks/smollm2-hellaswag-0shot \\
        --timed-items 200 --rounds 2 --out DIR
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# llama.cpp cache type -> kvquant spec whose task log it is compared with (None: no twin)
LLAMA_CACHES = {"f32": "f32", "q8_0": "ggml:q8_0/q8_0", "q4_0": "ggml:q4_0/q4_0", "f16": None}
WHOLE, SCORING = "llama.cpp f32 (whole command)", "llama.cpp f32 (scoring only)"
RUNNING_ACC = re.compile(r"^(\d+)\t([0-9.]+)%\t\[")
# llama.cpp's log stamps each line min.ss.mmm.uuu after start (common/log.cpp)
SCORING_STARTS = re.compile(r"^(\d+)\.(\d\d)\.(\d{3})\.(\d{3}) I hellaswag_score : calculating",
                            re.M)


def write_task_file(items, path):
    """llama-perplexity's HellaSwag file of ``items`` (kvquant's, so lm-eval's preprocessing)."""
    lines = []
    for it in items:
        if len(set(it.contexts)) != 1 or len(it.choice_texts) != 4:
            raise SystemExit(f"item {it.doc_id}: not a HellaSwag item of one query, four endings")
        fields = [it.contexts[0], str(it.gold), *it.choice_texts]
        if any("\n" in f for f in fields):
            raise SystemExit(f"item {it.doc_id} holds a newline: llama.cpp's file cannot carry it")
        lines.extend(fields)
    Path(path).write_text("\n".join(lines) + "\n")


def scoring_order(n_items, work):
    """The file index of each item in the order llama.cpp scores them."""
    src = Path(__file__).with_name("hellaswag_order.cpp")
    exe = Path(work) / "hellaswag_order"
    subprocess.run(["g++", "-O2", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe), str(n_items), str(n_items)], check=True,
                         capture_output=True, text=True).stdout.split()
    order = [int(x) for x in out]
    if sorted(order) != list(range(n_items)):
        raise SystemExit("hellaswag_order did not print a permutation of the items")
    return order


def run_llama(binary, gguf, task_file, n_items, cache, threads, n_parallel, n_ctx):
    """(per-position right/wrong, wall seconds, seconds before scoring began, command)."""
    cmd = [binary, "-m", gguf, "-f", str(task_file), "--hellaswag", "--hellaswag-tasks",
           str(n_items), "-c", str(n_ctx), "-np", str(n_parallel), "-t", str(threads), "-tb",
           str(threads), "-fa", "on", "-ctk", cache, "-ctv", cache]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({proc.returncode}):\n{log[-3000:]}")
    counts = {}
    for line in log.splitlines():
        m = RUNNING_ACC.match(line)
        if m:
            i = int(m.group(1))
            counts[i] = round(float(m.group(2)) / 100 * i)
    if sorted(counts) != list(range(1, n_items + 1)):
        raise SystemExit(f"llama-perplexity printed {len(counts)} of {n_items} running "
                         f"accuracies:\n{log[-3000:]}")
    right = [counts[i] - counts.get(i - 1, 0) for i in range(1, n_items + 1)]
    if any(r not in (0, 1) for r in right):
        raise SystemExit("llama-perplexity's running accuracy is not a running count")
    m = SCORING_STARTS.search(proc.stderr)
    if m is None:
        raise SystemExit(f"llama-perplexity's log has no stamped scoring start:\n{log[-3000:]}")
    before = int(m.group(1)) * 60 + int(m.group(2)) + int(m.group(3)) / 1e3 + int(m.group(4)) / 1e6
    return right, wall, before, cmd


def read_task_log(path):
    """{doc_id: record} of a kvquant tasks log (read only: never rewritten here)."""
    records = {}
    with open(path) as f:
        for n, line in enumerate(f):
            rec = json.loads(line)
            if n == 0:
                if rec.get("kind") != "header" or rec.get("task") != "hellaswag":
                    raise SystemExit(f"{path}: not a kvquant HellaSwag task log")
                continue
            if "doc_id" in rec:
                records[rec["doc_id"]] = rec
    return records


def mean_token_prediction(rec):
    """llama.cpp's choice: the highest log-likelihood per continuation token."""
    means = [ll / n for ll, n in zip(rec["lls"], rec["choice_tokens"])]
    return max(range(len(means)), key=means.__getitem__)


def rule_right(items, records):
    """kvquant's right (1) or wrong (0) per item of ``items`` by llama.cpp's rule."""
    return [int(mean_token_prediction(records[it.doc_id]) == records[it.doc_id]["gold"])
            for it in items]


def same_split(model, item):
    """True when the four ``query + " " + ending`` token sequences share exactly the query's
    tokens (then llama.cpp's count of tokens is the log's ``choice_tokens``)."""
    query = model.encode(item.contexts[0])
    wholes = [model.encode(item.contexts[0] + " " + e) for e in item.choice_texts]
    shared = 0
    while all(len(w) > shared for w in wholes) and len({w[shared] for w in wholes}) == 1:
        shared += 1
    return shared == len(query) and all(list(w[:shared]) == list(query) for w in wholes)


def compare(items, llama_right, records, split_ok):
    from kvquant.tasks.stats import accuracy, mcnemar_exact
    missing = [it.doc_id for it in items if it.doc_id not in records]
    if missing:
        raise SystemExit(f"the kvquant log lacks {len(missing)} of the items (first: doc "
                         f"{missing[0]}); run kvquant tasks with --limit {len(items)} first")
    out = {}
    for subset, keep in (("all", lambda it: True), ("same split", lambda it: split_ok[it.doc_id])):
        chosen = [it for it in items if keep(it)]
        ll = [llama_right[it.doc_id] for it in chosen]
        kv = rule_right(chosen, records)
        table = {"both": sum(a and b for a, b in zip(ll, kv)),
                 "only_llama_cpp": sum(a and not b for a, b in zip(ll, kv)),
                 "only_kvquant": sum(b and not a for a, b in zip(ll, kv)),
                 "neither": sum(not a and not b for a, b in zip(ll, kv))}
        out[subset] = {"n": len(chosen), "llama_cpp": accuracy(ll), "kvquant": accuracy(kv),
                       "paired": table,
                       "agreement": (table["both"] + table["neither"]) / len(chosen),
                       "mcnemar_p": mcnemar_exact(table["only_llama_cpp"],
                                                  table["only_kvquant"])}
    return out


def cache_effects(items, result, kv_records):
    """Each cache's paired accuracy difference to f32 measured inside each engine: llama.cpp's
    runs against its f32 run, kvquant's twin logs (``kv_records``: cache -> its twin's log
    records) against its f32 log (llama.cpp's rule)."""
    from kvquant.tasks.stats import mcnemar_exact, paired_bootstrap
    rows = result["caches"]
    if "f32" not in rows:
        return {}

    def paired(ref, other):
        b = sum(r and not o for r, o in zip(ref, other))
        c = sum(o and not r for r, o in zip(ref, other))
        low, high = paired_bootstrap(ref, other)
        return {"diff": (sum(other) - sum(ref)) / len(ref), "low": low, "high": high,
                "only_f32": b, "only_cache": c, "mcnemar_p": mcnemar_exact(b, c)}

    effects = {}
    for cache, row in rows.items():
        if cache == "f32":
            continue
        effects[cache] = {"llama_cpp": paired(rows["f32"]["llama_cpp_right"],
                                              row["llama_cpp_right"])}
        if cache in kv_records and "f32" in kv_records:
            effects[cache]["kvquant"] = paired(rule_right(items, kv_records["f32"]),
                                               rule_right(items, kv_records[cache]))
    return effects


def _diff(e):
    return (f"{100 * e['diff']:+.1f} [{100 * e['low']:+.1f}, {100 * e['high']:+.1f}], "
            f"p {e['mcnemar_p']:.2g}")


def _pct(a):
    return f"{100 * a['acc']:.1f} [{100 * a['low']:.1f}, {100 * a['high']:.1f}]"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-perplexity", required=True, help="path of the llama-perplexity binary")
    p.add_argument("--model", default="smollm2", help="a kvquant model name or GGUF path")
    p.add_argument("--limit", type=int, default=200, help="the first N HellaSwag items")
    p.add_argument("--kvquant-logs", required=True, help="folder of kvquant tasks' logs")
    p.add_argument("--caches", default="f32,q8_0,q4_0",
                   help=f"llama.cpp cache types, of {','.join(LLAMA_CACHES)}")
    p.add_argument("--timed-items", type=int, default=200)
    p.add_argument("--warm-items", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--codecs", default="f32,tq4", help="kvquant specs timed beside llama.cpp")
    p.add_argument("--threads", type=int, default=2)
    # llama-perplexity's own defaults for --hellaswag: 4 sequences (one item) per decode
    p.add_argument("--parallel", type=int, default=4, help="llama-perplexity -np")
    p.add_argument("--ctx", type=int, default=512, help="llama-perplexity -c per sequence")
    p.add_argument("--reuse-llama-runs", action="store_true",
                   help="take llama.cpp's per-item results from this --out's earlier JSON "
                        "instead of running the caches again")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out} is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    binary = str(Path(args.llama_perplexity).resolve())
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"--llama-perplexity {binary} is not an executable file")
    caches = [c for c in args.caches.split(",") if c]
    unknown = [c for c in caches if c not in LLAMA_CACHES]
    if unknown:
        raise SystemExit(f"unknown cache type(s) {unknown}; choose from {list(LLAMA_CACHES)}")

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from kvquant.models import load_model
    from kvquant.tasks import build_items
    from kvquant_experiments.common import cpu_model, spec_tag

    model = load_model(args.model)
    gguf = str(model.path)
    items = build_items("hellaswag", limit=args.limit)
    n = len(items)
    task_file = out / f"hellaswag-n{n}.txt"
    write_task_file(items, task_file)
    order = scoring_order(n, out)
    split_ok = {it.doc_id: same_split(model, it) for it in items}

    result = {"doc_ids": [it.doc_id for it in items],
              "what": f"HellaSwag validation items 0..{n - 1}: llama.cpp's llama-perplexity "
                      "--hellaswag and kvquant's task logs scored by llama.cpp's rule (mean "
                      "log-probability per ending token)",
              "command": "python tools/llama_cpp_hellaswag.py " + " ".join(sys.argv[1:]),
              "gguf": os.path.basename(gguf), "cpu": cpu_model(), "threads": args.threads,
              "same_split_items": sum(split_ok.values()), "caches": {}, "throughput": {}}
    stem = out / f"llama-cpp-hellaswag-{Path(args.model).stem}-n{n}"
    earlier = {}
    if args.reuse_llama_runs:
        if not Path(f"{stem}.json").is_file():
            raise SystemExit(f"--reuse-llama-runs: no {stem}.json to reuse")
        old = json.loads(Path(f"{stem}.json").read_text())
        if old.get("doc_ids") != result["doc_ids"]:
            raise SystemExit(f"--reuse-llama-runs: {stem}.json holds other items")
        earlier = old["caches"]
        result["llama_cpp_runs_by"] = old.get("llama_cpp_runs_by", old["command"])
    kv_records = {}     # cache -> its kvquant twin's log, read once
    for cache in caches:
        if cache in earlier:
            row = earlier[cache]
            per_doc = dict(zip(result["doc_ids"], row["llama_cpp_right"]))
            right = [per_doc[items[order[pos]].doc_id] for pos in range(n)]
            wall, before = row["wall_s"], row["load_s"]
            cmd = ["llama-perplexity", *row["llama_cpp_command"].split()]
        else:
            right, wall, before, cmd = run_llama(binary, gguf, task_file, n, cache,
                                                 args.threads, args.parallel, args.ctx)
        per_doc = {items[order[pos]].doc_id: r for pos, r in enumerate(right)}
        # the control: the same steps read in file order, as if llama.cpp did not shuffle
        unshuffled = {items[pos].doc_id: r for pos, r in enumerate(right)}
        row = {"llama_cpp_command": " ".join(cmd[1:]), "wall_s": wall, "load_s": before,
               "llama_cpp_acc": _acc_of(per_doc),
               "llama_cpp_right": [per_doc[it.doc_id] for it in items]}
        twin = LLAMA_CACHES[cache]
        log = Path(args.kvquant_logs) / f"{spec_tag(twin)}.jsonl" if twin else None
        if log is not None and log.is_file():
            row["kvquant_spec"] = twin
            records = kv_records[cache] = read_task_log(log)
            row["compare"] = compare(items, per_doc, records, split_ok)
            row["agreement_in_file_order"] = compare(items, unshuffled, records,
                                                     split_ok)["all"]["agreement"]
        result["caches"][cache] = row
        print(f"{cache}: llama.cpp {_pct(row['llama_cpp_acc'])} in {wall:.1f} s"
              + (f"; kvquant {twin} {_pct(row['compare']['all']['kvquant'])}, agreement "
                 f"{100 * row['compare']['all']['agreement']:.1f}% (in file order "
                 f"{100 * row['agreement_in_file_order']:.1f}%)" if "compare" in row else ""),
              flush=True)

    result["effects"] = cache_effects(items, result, kv_records)
    for cache, e in result["effects"].items():
        print(f"{cache} vs f32: llama.cpp {_diff(e['llama_cpp'])}"
              + (f"; kvquant {_diff(e['kvquant'])}" if "kvquant" in e else ""), flush=True)
    if args.rounds > 0:
        result["throughput"] = throughput(args, binary, gguf, model, items, out)
        result["throughput"]["command"] = result["command"]
    elif earlier:
        result["throughput"] = old.get("throughput", {})
    tmp = Path(f"{stem}.json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, f"{stem}.json")
    table = markdown(result)
    Path(f"{stem}.md").write_text(table + "\n")
    print(table)
    print(f"wrote {stem}.json and .md")
    return 0


def throughput(args, binary, gguf, model, items, out):
    """llama.cpp's f32 command against kvquant's scorer on the first ``--timed-items`` items,
    each method warmed, the blocks alternating over ``--rounds``."""
    from threadpoolctl import threadpool_limits
    from kvquant.specs import split_spec_text
    from kvquant.tasks import ItemScorer

    timed = items[:args.timed_items]
    warm = items[:args.warm_items]
    timed_file, warm_file = out / f"timed-n{len(timed)}.txt", out / "warm.txt"
    write_task_file(timed, timed_file)
    write_task_file(warm, warm_file)

    # each method returns {row name: seconds}; llama.cpp's one run gives two rows: the whole
    # command, and from its log's stamped start of scoring to the end (model load and
    # tokenization left out)
    def llama_method(file, k):
        def run():
            _, wall, before, _ = run_llama(binary, gguf, file, k, "f32", args.threads,
                                           args.parallel, args.ctx)
            return {WHOLE: wall, SCORING: wall - before}
        return run

    def kvquant_method(spec, its):
        def run():
            t0 = time.perf_counter()
            with threadpool_limits(args.threads):
                ItemScorer(model, spec).score_many(its)
            return {f"kvquant {spec}": time.perf_counter() - t0}
        return run

    methods = {"llama.cpp": (llama_method(timed_file, len(timed)),
                             llama_method(warm_file, len(warm)))}
    for spec in split_spec_text(args.codecs):
        methods[spec] = (kvquant_method(spec, timed), kvquant_method(spec, warm))
    for _, warm_run in methods.values():
        warm_run()  # llama.cpp's runs warm its page cache, kvquant's its process
    rounds = []
    for r in range(args.rounds):
        row = {}
        for method in (list(methods) if r % 2 == 0 else list(reversed(methods))):
            for name, sec in methods[method][0]().items():
                row[name] = {"seconds": sec, "items_per_s": len(timed) / sec}
                print(f"round {r + 1}: {name:<30} {len(timed) / sec:6.2f} items/s "
                      f"({sec:.1f} s)", flush=True)
        for name in row:
            row[name]["ratio_to_llama_cpp_f32"] = (row[name]["items_per_s"]
                                                   / row[WHOLE]["items_per_s"])
            row[name]["ratio_to_llama_cpp_f32_scoring"] = (row[name]["items_per_s"]
                                                           / row[SCORING]["items_per_s"])
        rounds.append(row)
    return {"items": len(timed), "warm_items": len(warm), "rounds": rounds}


def _acc_of(per_doc):
    from kvquant.tasks.stats import accuracy
    return accuracy([per_doc[d] for d in sorted(per_doc)])


def markdown(result):
    lines = [result["what"] + f" ({result['gguf']}; {result['same_split_items']} items where "
             "the query's tokens are exactly the endings' shared prefix); "
             f"{result['threads']} threads; {result['cpu']}", "",
             "| llama.cpp cache | llama.cpp acc | kvquant spec | kvquant acc | items right/wrong "
             "alike | only llama.cpp / only kvquant | McNemar p | same split: agreement |",
             "|---|---|---|---|---|---|---|---|"]
    for cache, row in result["caches"].items():
        if "compare" not in row:
            lines.append(f"| {cache} | {_pct(row['llama_cpp_acc'])} | - | - | - | - | - | - |")
            continue
        a, s = row["compare"]["all"], row["compare"]["same split"]
        lines.append(f"| {cache} | {_pct(a['llama_cpp'])} | {row['kvquant_spec']} | "
                     f"{_pct(a['kvquant'])} | {100 * a['agreement']:.1f}% | "
                     f"{a['paired']['only_llama_cpp']} / {a['paired']['only_kvquant']} | "
                     f"{a['mcnemar_p']:.2f} | {100 * s['agreement']:.1f}% of {s['n']} |")
    if result["effects"]:
        lines += ["", "Each cache against f32 inside each engine (paired difference in points "
                  "[bootstrap 95%], exact McNemar p), llama.cpp's rule:", "",
                  "| cache | llama.cpp: vs its f32 | kvquant: vs its f32 |", "|---|---|---|"]
        for cache, e in result["effects"].items():
            lines.append(f"| {cache} | {_diff(e['llama_cpp'])} | "
                         + (_diff(e["kvquant"]) if "kvquant" in e else "-") + " |")
    if not result["throughput"]:
        lines += ["", f"`{result['command']}`"]
        if "llama_cpp_runs_by" in result:
            lines.append(f"(llama.cpp's runs: `{result['llama_cpp_runs_by']}`)")
        return "\n".join(lines)
    rounds = result["throughput"]["rounds"]
    methods = list(rounds[0])   # the first round runs the methods in their given order
    lines += ["", f"Items/s on the first {result['throughput']['items']} items, each method "
              "warmed, blocks alternating:", "",
              "| method | items/s per round | x llama.cpp f32 whole command | x its scoring "
              "only |", "|---|---|---|---|"]
    for name in methods:
        lines.append(f"| {name} | " + " | ".join(
            ", ".join(f"{r[name][key]:{fmt}}" for r in rounds)
            for key, fmt in (("items_per_s", ".2f"), ("ratio_to_llama_cpp_f32", ".2f"),
                             ("ratio_to_llama_cpp_f32_scoring", ".2f"))) + " |")
    if result["throughput"].get("command", result["command"]) != result["command"]:
        lines += ["", f"(timed by `{result['throughput']['command']}`)"]
    lines += ["", f"`{result['command']}`"]
    if "llama_cpp_runs_by" in result:
        lines.append(f"(llama.cpp's runs: `{result['llama_cpp_runs_by']}`)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
