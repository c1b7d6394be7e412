"""How much a quantized cache's KLD moves between two equally valid computations of the same
rows: the whole prompt in one prefill against one token at a time (decode steps).

Both read exactly what the codec stores (every row is quantized before attention reads it), so
they differ only in float rounding: the order of sums in the attention and the projections. A
row that moves by an ulp can cross a codec's decision boundary, and the layers after it see
another row; from that position on the two runs differ by a quantization step, not an ulp. The
f32 cache has no boundaries and stays put. This tool measures the effect on one model, one
codec and the first tokens of a text; docs/flips.md (reproducibility) gives its figures.

    python tools/arithmetic_spread.py --model gemma3-270m --codec tq4 --text code --tokens 120
"""
import argparse
import sys

import numpy as np


def kld_rows(p_logits, q_logits):
    """KL(p || q) per row of two logit matrices, float64."""
    from scipy.special import log_softmax
    lp = log_softmax(p_logits.astype(np.float64), axis=-1)
    lq = log_softmax(q_logits.astype(np.float64), axis=-1)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def main(argv=None):
    from kvquant.models import load_model
    from kvquant_experiments.texts import text_tokens
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--codec", default="tq4", help="a cache spec (stream or K/V pair)")
    p.add_argument("--text", default="code")
    p.add_argument("--tokens", type=int, default=120)
    args = p.parse_args(argv)
    if args.tokens < 2:
        raise SystemExit("arithmetic_spread: --tokens must be at least 2")
    model = load_model(args.model)
    tokens, _ = text_tokens(model, args.text)
    ids = np.concatenate([[model.bos_token_id], tokens[:args.tokens - 1]]) \
        if model.bos_token_id is not None else tokens[:args.tokens]
    reference = model.forward(ids, model.new_cache("f32"))
    prefill = model.forward(ids, model.new_cache(args.codec))
    cache = model.new_cache(args.codec)
    steps = np.concatenate([model.forward(ids[i:i + 1], cache) for i in range(len(ids))])
    moved = np.nonzero(np.abs(prefill - steps).max(axis=-1) > 1e-3)[0]
    for name, logits in (("prefill", prefill), ("steps", steps)):
        kld = kld_rows(reference, logits)
        print(f"{args.codec} {name:8s} mean KLD {kld.mean():.4f} over {len(ids)} positions")
    print("first position where the two differ by more than 1e-3 in a logit: "
          + (str(int(moved[0])) if moved.size else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
