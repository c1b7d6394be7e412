"""Evaluate a local Hugging Face model with lm-eval-harness, its KV cache through kvquant.

A worked example (not run in CI; it needs ``pip install lm-eval`` besides kvquant's ``hf``
extra). lm-eval's ``HFLM`` calls the model without a cache for log-likelihoods and with
transformers' default cache for generation; the subclass below gives every call a fresh
:class:`kvquant.hf.KVQuantCache` instead, so that every K and V row is encoded by the codec
before attention reads it, prompt included, and the ``"kvquant"`` attention reads the codes.

One sequence per call (batch_size=1: the kvquant attention refuses padded batches), on CPU::

    python docs/hf_lm_eval_example.py --model path/to/checkpoint --spec polar5/polar4@center \\
        --tasks hellaswag --limit 200
    python docs/hf_lm_eval_example.py --model path/to/folder --gguf model.Q8_0.gguf --spec tq4

Run it once with ``--spec f32`` for the baseline: its numbers are the model's own (to float
rounding), and the difference is what the codec costs on the task.
"""
import argparse
import inspect
import json

import torch

import kvquant.hf  # registers attn_implementation="kvquant"
from kvquant.hf import KVQuantCache


def kvquant_lm(model, tokenizer, spec, key_channels="model"):
    """An lm-eval ``HFLM`` over ``model`` whose every forward and generate call runs on a new
    :class:`KVQuantCache` of ``spec``."""
    from lm_eval.models.huggingface import HFLM

    # the keyword the model takes: transformers 5.x renamed past_key_values to cache (5.25 and
    # later warn on the old one)
    cache_kw = ("cache" if "cache" in inspect.signature(type(model).forward).parameters
                else "past_key_values")

    class KVQuantHFLM(HFLM):
        def _new_cache(self):
            return KVQuantCache(self.model.config, spec, key_channels=key_channels)

        def _model_call(self, inps, attn_mask=None, labels=None):
            with torch.no_grad():
                return self.model(inps, use_cache=True,
                                  **{cache_kw: self._new_cache()}).logits

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            generation_kwargs.setdefault(cache_kw, self._new_cache())
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    return KVQuantHFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local checkpoint folder")
    p.add_argument("--gguf", help="a GGUF file in that folder (transformers dequantizes it)")
    p.add_argument("--spec", default="f32", help="kvquant stream spec, e.g. tq4, kv8/tq4, "
                   "polar5/polar4@center")
    p.add_argument("--key-channels", default="model", choices=("model", "interleaved"),
                   help="interleaved: keys in a GGUF's channel order (as llama.cpp stores them)")
    p.add_argument("--tasks", default="hellaswag")
    p.add_argument("--limit", type=int, default=None, help="examples per task")
    p.add_argument("--out", help="write lm-eval's results as JSON here")
    args = p.parse_args(argv)

    import lm_eval
    from transformers import AutoModelForCausalLM, AutoTokenizer
    extra = {"gguf_file": args.gguf} if args.gguf else {}
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="kvquant", **extra).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, **extra)
    lm = kvquant_lm(model, tokenizer, args.spec, args.key_channels)
    results = lm_eval.simple_evaluate(model=lm, tasks=args.tasks.split(","), limit=args.limit)
    print(json.dumps(results["results"], indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"spec": args.spec, "results": results["results"]}, f, indent=1,
                      default=str)


if __name__ == "__main__":
    main()
