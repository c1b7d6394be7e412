"""What a forward of a 1B GGUF model costs: seconds and peak RSS per 1k tokens.

Writes (once) a random-weight GGUF shaped like Llama-3.2-1B (16 layers, width 2048, FFN 8192,
32 heads, 8 KV heads of 64, vocab 128256, tied embeddings) with its matrices quantized to Q8_0
by ``gguf.quants.quantize``, then runs one prefill of ``--tokens`` tokens through kvquant's
GGUF decoder with an f32 cache (or ``--spec``) and prints the load time, the forward time and
the process's peak resident memory. Each run is its own process, so the peak is that of one
policy (``--budget-gib``: float32 copies kept, see kvquant/models/gguf_weights.py).

    python -m kvquant_experiments.bench.gguf_prefill --file /tmp/llama1b-q8_0.gguf --tokens 1024
    python -m kvquant_experiments.bench.gguf_prefill --file /tmp/llama1b-q8_0.gguf --tokens 1024 \
        --budget-gib 0

The file (1.3 GB) goes where ``--file`` says; keep it out of the repository.
"""
import argparse
import json
import os
import resource
import sys
import time

import numpy as np

LLAMA_1B = dict(n_layers=16, hidden=2048, ffn=8192, n_heads=32, n_kv=8, head_dim=64,
                vocab=128256, rope_base=500000.0, context=131072)


def write_llama_1b(path, seed=0, qtype="Q8_0"):
    from kvquant_experiments.bench.forward_attention import write_shape_gguf
    write_shape_gguf(path, LLAMA_1B, seed=seed, weight_type=qtype)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", required=True, help="the GGUF file (written when missing)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="float32 copies to keep (default: the decoder's default)")
    parser.add_argument("--spec", default="f32", help="cache pair spec")
    args = parser.parse_args(argv)
    if not os.path.exists(args.file):
        t0 = time.perf_counter()
        write_llama_1b(args.file)
        print(f"wrote {args.file} ({os.path.getsize(args.file) / 1e9:.2f} GB) in "
              f"{time.perf_counter() - t0:.0f} s; run again to measure a fresh process")
        return 0
    from kvquant.models.gguf_decoder import GGUFDecoder
    kwargs = {} if args.budget_gib is None else {"budget_bytes": int(args.budget_gib * 2**30)}
    t0 = time.perf_counter()
    model = GGUFDecoder(args.file, **kwargs)
    load_s = time.perf_counter() - t0
    ids = np.random.default_rng(1).integers(0, model.vocab_size, args.tokens)
    t0 = time.perf_counter()
    hidden = model.forward_hidden(ids, model.new_cache(args.spec))
    forward_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r0 in range(0, args.tokens, 256):
        model.logits(hidden[r0:r0 + 256])
    logits_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "file_bytes": os.path.getsize(args.file), "tokens": args.tokens, "spec": args.spec,
        "budget_bytes": model.weights.budget_bytes, "kept_bytes": model.weights.kept_bytes,
        "load_s": round(load_s, 2), "forward_hidden_s": round(forward_s, 2),
        "logits_s": round(logits_s, 2),
        "seconds_per_1k_tokens": round((forward_s + logits_s) * 1000 / args.tokens, 2),
        "peak_rss_gib": round(peak / 2**30, 2),
        "threads": os.environ.get("OMP_NUM_THREADS", "default")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
