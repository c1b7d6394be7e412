"""Decode-step time of a packaged model under the decoders' two thread settings.

Prefills ``--tokens`` random tokens into one cache per codec, then times decode steps (one token)
with the decoders' default (attention on 1 thread, BLAS left as it is) and with attention on 2
threads and BLAS held to 1 for the whole step (``DECODE_ATTENTION_THREADS = 2``,
``DECODE_BLAS_THREADS = 1`` in kvquant/models/gguf_decoder.py); the settings alternate over
rounds, medians printed. Prints only; writes nothing.

    python tools/decode_threads.py --model smollm2 --tokens 4096 --codecs tq4,kv8
"""
import argparse
import time

import numpy as np

from kvquant.models import gguf_decoder, load_model

SETTINGS = {"attention 1 thread, BLAS as it is": (1, None),
            "attention 2 threads, BLAS 1 thread": (2, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4096, help="cached tokens before the steps")
    ap.add_argument("--codecs", default="tq4,kv8")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    model = load_model(args.model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.vocab_size, args.tokens)
    caches = {}
    for spec in args.codecs.split(","):
        caches[spec] = model.new_cache(spec)
        t0 = time.perf_counter()
        model.forward(prompt, caches[spec], last_only=True)
        print(f"{spec}: prefill of {args.tokens} tokens {time.perf_counter() - t0:.1f} s")
    times = {name: {spec: [] for spec in caches} for name in SETTINGS}
    previous = gguf_decoder.DECODE_ATTENTION_THREADS, gguf_decoder.DECODE_BLAS_THREADS
    try:
        for r in range(args.rounds):
            order = list(SETTINGS.items())
            for name, (attention, blas) in (order if r % 2 == 0 else order[::-1]):
                gguf_decoder.DECODE_ATTENTION_THREADS = attention
                gguf_decoder.DECODE_BLAS_THREADS = blas
                for spec, cache in caches.items():
                    for i in range(args.steps + 2):          # two untimed steps first
                        t0 = time.perf_counter()
                        model.forward(rng.integers(0, model.vocab_size, 1), cache, last_only=True)
                        if i >= 2:
                            times[name][spec].append(time.perf_counter() - t0)
    finally:
        gguf_decoder.DECODE_ATTENTION_THREADS, gguf_decoder.DECODE_BLAS_THREADS = previous
    for name in SETTINGS:
        cells = ", ".join(f"{spec} {1e3 * np.median(v):.1f} ms" for spec, v in times[name].items())
        print(f"{name}: {cells} (median decode step)")


if __name__ == "__main__":
    main()
