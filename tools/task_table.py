"""The cross-task table of docs/tasks.md, regenerated from committed ``kvquant tasks`` summaries.

    python tools/task_table.py data/results/tasks/*/summary-n*.json

For each model, one row per cache and one column per task summary given: f32's accuracy with its
Wilson 95% interval, and each cache's paired difference to f32 on the same items in points with
its paired-bootstrap 95% interval; ``*`` marks a McNemar p below 0.05. The frontier's picks are
named by their budget (read from ``data/results/frontier-choices.json``). A task with several
summaries (n=200 and n=2,000) has a column for each.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_ORDER = ["hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "mmlu"]
MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}
# picks the frontier has since replaced, still in the task runs (docs/field-codecs.md)
EARLIER_PICKS = {
    "polar3:side_dtype=f16@center,normalize,sinks=1,recent=12/polar3:side_dtype=f16@center,"
    "sinks=1,recent=4": "polar3 W12/W4 (3.5-bit pick before vq)",
    "polar4:side_dtype=f16@center,normalize,sinks=1,recent=12/polar4:side_dtype=f16@center,"
    "sinks=1,recent=4": "polar4 W12/W4 (4.5-bit pick before vq)",
    "vq3:side=match,side_dtype=f16@center,normalize,sinks=1,recent=8/polar3:side_dtype=f16@center,"
    "sinks=1,recent=2": "vq3 W8 / polar3 W2 (an earlier 3.5-bit pick)",
}


def spec_names():
    """Short names for long specs: the frontier's picks by their budget."""
    names = {"ggml:q8_0/q8_0": "q8_0 (llama.cpp)", "ggml:q4_0/q4_0": "q4_0 (llama.cpp)"}
    names.update(EARLIER_PICKS)
    choices = ROOT / "data" / "results" / "frontier-choices.json"
    if choices.is_file():
        for budget, pick in json.loads(choices.read_text()).items():
            if isinstance(pick, dict) and "pair" in pick:
                names[pick["pair"]] = f"frontier {budget}-bit pick"
    return names


def load(paths):
    """{model: {(task, shots, n): summary}}."""
    tables = {}
    for path in paths:
        s = json.loads(Path(path).read_text())
        meta = s["meta"]
        column = (meta["task"], meta["num_fewshot"], meta["limit"])
        tables.setdefault(meta["model_tag"], {})[column] = s
    return tables


def _task_key(column):
    task, shots, n = column
    return (TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task, shots, n)


def _title(column, summary):
    task, shots, n = column
    return (f"{task}{f' {shots}-shot' if shots else ''} ({summary['primary_metric']}, "
            f"n={n:,})")


def _pts(x):
    return f"{100 * x:+.1f}"


def model_table(columns, names):
    order = sorted(columns, key=_task_key)
    specs = []
    for column in order:
        for row in columns[column]["rows"]:
            if row["spec"] not in specs:
                specs.append(row["spec"])
    head = ["cache"] + [_title(c, columns[c]) for c in order]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec in specs:
        cells = [names.get(spec, f"`{spec}`")]
        for column in order:
            s = columns[column]
            row = next((r for r in s["rows"] if r["spec"] == spec), None)
            metric = s["primary_metric"]
            if row is None:
                cells.append("")
            elif spec == s["reference"]:
                m = row[metric]
                cells.append(f"{100 * m['acc']:.1f} [{100 * m['low']:.1f}, {100 * m['high']:.1f}]")
            else:
                p = row["paired"][metric]
                star = "*" if p["mcnemar_p"] < 0.05 else ""
                cells.append(f"{_pts(p['diff'])} [{_pts(p['diff_low'])}, "
                             f"{_pts(p['diff_high'])}]{star}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summaries", nargs="+", help="summary-n<N>.json files of kvquant tasks")
    args = ap.parse_args(argv)
    missing = [p for p in args.summaries if not Path(p).is_file()]
    if missing:
        sys.exit(f"task_table: no such summary: {', '.join(missing)}")
    names = spec_names()
    for model, columns in load(args.summaries).items():
        print(f"#### {MODEL_NAMES.get(model, model)}\n")
        print(model_table(columns, names) + "\n")


if __name__ == "__main__":
    main()
