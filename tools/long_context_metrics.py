"""Mean KLD, same-top-1 and seconds per cache spec of a model on the pydoc text, at any chunk size.

    python tools/long_context_metrics.py metrics 2048 512 gemma3-270m
    python tools/long_context_metrics.py lean 4096 4096 gemma3-270m

Arguments: mode, positions, chunk tokens, model (a name or a .gguf path). The chunks are
``kvquant.flips.text_chunks(model.encode(pydoc_text()), positions, chunk_tokens)``.

- ``metrics``: ``kvquant.flips.text_metrics`` as it is (it holds several float64 arrays of
  chunk x vocab: about 26 GB for a 4096-token chunk of Gemma's 262144-token vocabulary).
- ``lean``: the same definitions (KL(p_f32 || p_spec) per position, clipped at 0, in float64
  log-softmax; same top-1 against the f32 cache's argmax) from ``forward_hidden`` and
  ``logits`` in blocks of 256 rows: every spec's final hidden rows are kept (n x hidden) and the
  logits of each block are computed when needed, so memory stays near 3 x 256 x vocab float64.
  Seconds per spec: its forward plus its logits/KLD blocks (f32's: its forward plus the reference
  log-probabilities of every block). On Gemma 3 270M at 2048 positions in 512-token chunks both
  modes gave the same mean KLD and same top-1 for every spec, to the last digit printed.
"""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvquant import flips  # noqa: E402
from kvquant.models import load_model  # noqa: E402

SPECS = ["f32", "kv8", "q8_0", "q4_0+rot", "tq4",
         "polar5:side_dtype=f16@center,normalize,sinks=1/polar4:side_dtype=f16@center,sinks=1"]


def lean_metrics(model, specs, chunks, block=256):
    """Rows {codec, kld_mean, same_top, positions, seconds} (module docstring, ``lean``)."""
    res = {s: {"same": 0, "kld": [], "s": 0.0} for s in specs}
    n_pos = 0
    for ci, (_, ids) in enumerate(chunks):
        inputs = ids[:-1]
        n_pos += inputs.size
        hidden = {}
        for spec in specs:
            t0 = time.perf_counter()
            hidden[spec] = model.forward_hidden(inputs, model.new_cache(spec))
            res[spec]["s"] += time.perf_counter() - t0
            print(f"chunk {ci} {spec} forward {res[spec]['s']:.1f}s", flush=True)
        kld = {spec: np.zeros(inputs.size) for spec in specs}
        for b in range(0, inputs.size, block):
            t0 = time.perf_counter()
            lr = flips.log_softmax64(model.logits(hidden["f32"][b:b + block]))
            pr = np.exp(lr)
            top = lr.argmax(1)
            res["f32"]["s"] += time.perf_counter() - t0
            res["f32"]["same"] += top.size
            for spec in specs[1:]:
                t0 = time.perf_counter()
                lq = model.logits(hidden[spec][b:b + block])
                res[spec]["same"] += int((lq.argmax(1) == top).sum())
                lq = flips.log_softmax64(lq)
                kld[spec][b:b + block] = np.maximum((pr * (lr - lq)).sum(1), 0.0)
                res[spec]["s"] += time.perf_counter() - t0
        for spec in specs:
            res[spec]["kld"].append(kld[spec])
    return [{"codec": spec, "kld_mean": float(np.concatenate(res[spec]["kld"]).mean()),
             "same_top": res[spec]["same"] / n_pos, "positions": n_pos,
             "seconds": round(res[spec]["s"], 1)} for spec in specs]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] not in ("metrics", "lean"):
        sys.exit(__doc__)
    mode, positions, chunk = argv[0], int(argv[1]), int(argv[2])
    model = load_model(argv[3] if len(argv) > 3 else "gemma3-270m")
    t0 = time.perf_counter()
    tokens = model.encode(flips.pydoc_text())
    print("tokens", tokens.size, "encode_s", round(time.perf_counter() - t0, 1), flush=True)
    chunks = flips.text_chunks(tokens, positions, chunk)
    if mode == "metrics":
        rows = flips.text_metrics(model, SPECS, chunks, progress=lambda m: print(m, flush=True))
        rows = [{"codec": r["codec"], "kld_mean": r["kld_mean"], "same_top": r["same_top"]["p"],
                 "ppl_ratio": r["ppl_ratio"], "seconds": round(r["text_s"], 1)} for r in rows]
    else:
        rows = lean_metrics(model, SPECS, chunks)
    for row in rows:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
