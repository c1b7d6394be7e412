"""Decode-step time of a GGUF model under the decoders' thread settings.

Prefills ``--tokens`` random tokens into one cache per codec, then times decode steps (one token)
with numpy's products (``DECODE_PROJECTIONS = "blas"`` in kvquant/models/gguf_decoder.py) and
attention on 1 thread, BLAS left as it is; with attention on 2 threads and BLAS held to 1 for
the whole step; with ``DECODE_ATTENTION_THREADS = "auto"``, which picks one of those two from the
step's long-context ratio (printed); and with one pool (``DECODE_PROJECTIONS = "pool"``: the
products on kvquant's OpenMP threads, as many as OpenMP allows, the attention on the same). The
settings alternate over rounds, medians printed. Prints only; writes nothing.

    python -m kvquant_experiments.bench.decode_threads --model smollm2 --tokens 4096 \
        --codecs tq4,kv8
    python -m kvquant_experiments.bench.decode_threads --model /tmp/smollm2-shape.gguf \
        --tokens 32768 --random-rows

``--random-rows`` appends random Gaussian K/V rows to every layer instead of prefilling tokens
(what :mod:`kvquant_experiments.bench.forward_attention` does; a 32k-token prefill would take
long), for a GGUF whose context allows ``--tokens`` (such as the SmolLM2-shaped file that
benchmark writes). Each round times every setting in turn in this one process, so a drift of the
machine over minutes falls on all of them; the per-round ratios to the first setting are printed
beside the medians.
"""
import argparse
import time

import numpy as np

from kvquant.models import gguf_decoder, load_model
from kvquant.specs import split_spec_text
from kvquant_experiments.bench.timing import block_times, mirrored, warm_up

SETTINGS = {"attention 1 thread, BLAS as it is": (1, None, "blas"),
            "attention 2 threads, BLAS 1 thread": (2, 1, "blas"),
            "auto, numpy's products": ("auto", None, "blas"),
            "one pool: attention and projections on OpenMP's threads": ("auto", None, "pool")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4096, help="cached tokens before the steps")
    ap.add_argument("--codecs", default="tq4,kv8")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--random-rows", action="store_true",
                    help="append random K/V rows instead of prefilling random tokens")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    if not isinstance(model, gguf_decoder.GGUFDecoder):
        raise SystemExit(f"{args.model}: the thread settings are the GGUF decoders'; give a "
                         "packaged GGUF model or a GGUF file")
    needed = args.tokens + args.rounds * len(SETTINGS) * (args.steps + 2)
    if needed > model.context_length:
        raise SystemExit(f"{args.tokens} cached tokens and {needed - args.tokens} decode steps "
                         f"pass the model's context of {model.context_length}: use fewer tokens, "
                         "rounds or steps")
    ratio = model.long_context_ratio(args.tokens)
    print(f"long-context ratio at {args.tokens} tokens: {ratio:.2f} (auto takes 2 attention "
          f"threads from {gguf_decoder.LONG_CONTEXT_RATIO})")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.vocab_size, args.tokens)
    caches = {}
    for spec in split_spec_text(args.codecs):   # options stay with their spec
        caches[spec] = model.new_cache(spec)
        t0 = time.perf_counter()
        if args.random_rows:
            from kvquant_experiments.bench.forward_attention import fill
            caches[spec].reserve(needed)
            fill([caches[spec]], model.n_layers, model.n_kv_heads, model.head_dim, args.tokens)
        else:
            model.forward(prompt, caches[spec], last_only=True)
        print(f"{spec}: {args.tokens} tokens cached in {time.perf_counter() - t0:.1f} s")
    times = {name: {spec: [] for spec in caches} for name in SETTINGS}
    per_round = {name: {spec: [] for spec in caches} for name in SETTINGS}
    knobs = ("DECODE_ATTENTION_THREADS", "DECODE_BLAS_THREADS", "DECODE_PROJECTIONS")
    previous = [getattr(gguf_decoder, knob) for knob in knobs]
    try:
        for r in range(args.rounds):
            for name, setting in mirrored(SETTINGS.items(), r):
                for knob, value in zip(knobs, setting):
                    setattr(gguf_decoder, knob, value)
                for spec, cache in caches.items():
                    def step(cache=cache):
                        model.forward(rng.integers(0, model.vocab_size, 1), cache, last_only=True)
                    warm_up(step, calls=2)                   # two untimed steps first
                    block = block_times(step, args.steps)
                    times[name][spec] += block
                    per_round[name][spec].append(np.median(block))
    finally:
        for knob, value in zip(knobs, previous):
            setattr(gguf_decoder, knob, value)
    first = next(iter(SETTINGS))
    for name in SETTINGS:
        cells = []
        for spec, v in times[name].items():
            ratios = np.array(per_round[name][spec]) / np.array(per_round[first][spec])
            cells.append(f"{spec} {1e3 * np.median(v):.1f} ms (rounds {ratios.min():.2f}-"
                         f"{ratios.max():.2f}x the first setting's)")
        print(f"{name}: {', '.join(cells)} (median decode step)")


if __name__ == "__main__":
    main()
