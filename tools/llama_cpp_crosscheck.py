"""Check kvquant's model of llama.cpp's attention (``ggml:`` pair specs) against llama.cpp itself.

Both run the same token chunks of a text (those of the frontier: ``text_chunks`` of the text's
tokens, BOS first in every chunk) through the same GGUF file, with llama.cpp's cache types,
and measure the KL divergence of each cache's next-token distributions from the f16 cache's, at
every position:

* llama.cpp (llama-cpp-python, flash attention on, logits of every position; each cache type
  with its rotation on, as it runs by default, and off, ``LLAMA_ATTN_ROT_DISABLE=1``) against
  its own f16 run;
* kvquant's ``ggml:<K>/<V>`` caches (kvquant.ggml_attention) against ``ggml:f16/f16``, and
  against kvquant's exact f32 cache; and the storage-only ``q8_0+rot`` / ``q4_0+rot`` beside
  them.

Three steps, since llama-cpp-python lives in its own environment (a from-source build: on CPUs
whose native build crashes, CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON
-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF"); each writes into ``--out``::

    python tools/llama_cpp_crosscheck.py chunks  --out DIR [--model smollm2] [--text pydoc]
                                                 [--positions 2048] [--chunk-tokens 512]
    LLAMA_PY=/path/to/llama-venv/bin/python
    $LLAMA_PY tools/llama_cpp_crosscheck.py llama --out DIR [--threads 2]
    python tools/llama_cpp_crosscheck.py kvquant --out DIR     # runs kvquant, writes the table

``chunks`` writes ``chunks.json`` (the GGUF path, the token ids); ``llama`` (numpy and
llama_cpp only) writes ``llama_cpp.json``; ``kvquant`` writes ``kvquant.json`` and
``crosscheck.json`` / ``crosscheck.md``: per configuration, mean KLD with its standard error
over chunks, same-top-1 and the PPL ratio, for both engines side by side.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np

# llama.cpp cache configurations: name -> (K type, V type, rotation on[, tokens per batch])
LLAMA_CONFIGS = {
    "f16": ("f16", "f16", True),
    # the same cache read by the one-query path (batches under 64 tokens): llama.cpp against
    # itself, what its KLD can resolve
    "f16 batches of 32": ("f16", "f16", True, 32),
    "q8_0": ("q8_0", "q8_0", True),
    "q8_0 norot": ("q8_0", "q8_0", False),
    "q4_0": ("q4_0", "q4_0", True),
    "q4_0 norot": ("q4_0", "q4_0", False),
    "K q8_0 / V f16": ("q8_0", "f16", True),
    "K f16 / V q8_0": ("f16", "q8_0", True),
    "K q8_0 / V f16 norot": ("q8_0", "f16", False),
    "K f16 / V q8_0 norot": ("f16", "q8_0", False),
}
# the storage-only baselines measured beside them (exact float32 attention)
STORAGE_ONLY = {"q8_0": "q8_0+rot", "q8_0 norot": "q8_0", "q4_0": "q4_0+rot",
                "q4_0 norot": "q4_0", "K q8_0 / V f16": "q8_0+rot/f32",
                "K f16 / V q8_0": "f32/q8_0+rot", "K q8_0 / V f16 norot": "q8_0/f32",
                "K f16 / V q8_0 norot": "f32/q8_0"}


def ggml_spec(name):
    k, v, rot = LLAMA_CONFIGS[name][:3]
    return f"{'ggml' if rot else 'ggml-norot'}:{k}/{v}"


def batch_tokens(name, n_ctx):
    config = LLAMA_CONFIGS[name]
    return config[3] if len(config) > 3 else n_ctx


# --------------------------------------------------------------------------------------------
# Metrics (numpy only: the llama step runs where kvquant may not be installed)
# --------------------------------------------------------------------------------------------
def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def chunk_metrics(ref_logits, logits, targets):
    """Per position KL(p_ref || p), top-1 agreement, and both NLLs of the text's next tokens."""
    a, b = _log_softmax(ref_logits), _log_softmax(logits)
    kld = np.maximum((np.exp(a) * (a - b)).sum(axis=1), 0.0)
    rows = np.arange(len(targets))
    return {"kld": kld, "same_top": a.argmax(axis=1) == b.argmax(axis=1),
            "nll_ref": -a[rows, targets], "nll": -b[rows, targets]}


def summarize(per_chunk):
    """Mean KLD (and its standard error over chunks), same-top-1, PPL ratio, KLD p99."""
    kld = np.concatenate([c["kld"] for c in per_chunk])
    chunk_means = np.array([c["kld"].mean() for c in per_chunk])
    se = float(chunk_means.std(ddof=1) / math.sqrt(len(chunk_means))) if len(
        chunk_means) > 1 else float("nan")
    nll = np.concatenate([c["nll"] for c in per_chunk])
    nll_ref = np.concatenate([c["nll_ref"] for c in per_chunk])
    return {"kld_mean": float(kld.mean()), "kld_mean_se_chunks": se,
            "kld_chunk_means": chunk_means.tolist(),
            "kld_p99": float(np.percentile(kld, 99)),
            "same_top": float(np.concatenate([c["same_top"] for c in per_chunk]).mean()),
            "ppl_ratio": float(math.exp(nll.mean() - nll_ref.mean())),
            "positions": int(kld.size)}


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def _read_json(path, step):
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing: run the '{step}' step first with the same --out")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------
# Step 1: the chunks (kvquant)
# --------------------------------------------------------------------------------------------
def cmd_chunks(args):
    from kvquant.flips import text_chunks
    from kvquant.models import load_model
    from kvquant_experiments.texts import text_tokens
    model = load_model(args.model)
    tokens, text = text_tokens(model, args.text)
    chunks = text_chunks(tokens, args.positions, args.chunk_tokens, bos=model.bos_token_id)
    os.makedirs(args.out, exist_ok=True)
    llama_gguf = model.path
    if args.f32_weights:
        llama_gguf = os.path.join(args.out, "model-f32.gguf")
        write_f32_gguf(model.path, llama_gguf)
    _write_json(os.path.join(args.out, "chunks.json"), {
        "model": args.model, "gguf": llama_gguf, "weights": "f32" if args.f32_weights else
        "as in the file", "source_gguf": model.path, "text": text.name,
        "positions": args.positions, "chunk_tokens": args.chunk_tokens,
        "chunks": [{"start": int(s), "ids": [int(t) for t in ids]} for s, ids in chunks]})
    print(f"{len(chunks)} chunks of {args.chunk_tokens} tokens from {text.name} -> {args.out}")


def write_f32_gguf(src, dst):
    """A copy of the GGUF file ``src`` with every tensor dequantized to float32 (the values
    kvquant's forward computes with), metadata unchanged. llama.cpp then runs its matrix
    products in float32 instead of quantizing their inputs to the weights' dot type (q8_1 for
    Q4_1 weights): differences that would otherwise mask the cache's (see docs/llama-cpp-as-run.md)."""
    import gguf
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue   # written by the writer itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --------------------------------------------------------------------------------------------
# Step 2: llama.cpp (llama_cpp + numpy only)
# --------------------------------------------------------------------------------------------
def _llama_logits(path, ids, k_type, v_type, rotation, threads, n_ctx, batch=None):
    import llama_cpp
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
             "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    # llama.cpp reads the switch when it builds a cache
    if rotation:
        os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
    else:
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
    batch = batch or n_ctx
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=batch, n_ubatch=batch,
                          n_threads=threads, n_threads_batch=threads, logits_all=True,
                          flash_attn=True, type_k=types[k_type], type_v=types[v_type],
                          verbose=False)
    out = []
    for chunk in ids:
        llm.reset()
        llm.eval(chunk)
        out.append(np.array(llm.scores[:len(chunk)], dtype=np.float32))
    del llm
    return out


def cmd_llama(args):
    import llama_cpp
    meta = _read_json(os.path.join(args.out, "chunks.json"), "chunks")
    inputs = [c["ids"][:-1] for c in meta["chunks"]]
    targets = [np.array(c["ids"][1:]) for c in meta["chunks"]]
    n_ctx = max(len(x) for x in inputs)
    names = args.configs.split(",") if args.configs else list(LLAMA_CONFIGS)
    unknown = [n for n in names if n not in LLAMA_CONFIGS]
    if unknown or "f16" not in names:
        raise SystemExit(f"--configs: {unknown or 'f16 (the reference) missing'}; known: "
                         + ", ".join(LLAMA_CONFIGS))
    logits, seconds = {}, {}
    for name in names:
        t0 = time.perf_counter()
        logits[name] = _llama_logits(meta["gguf"], inputs, *LLAMA_CONFIGS[name][:3],
                                     args.threads, n_ctx, batch_tokens(name, n_ctx))
        seconds[name] = time.perf_counter() - t0
        print(f"llama.cpp {name}: {seconds[name]:.1f} s", flush=True)
    # run-to-run: the f16 and q8_0 runs once more
    repeat = {name: _llama_logits(meta["gguf"], inputs, *LLAMA_CONFIGS[name][:3], args.threads,
                                  n_ctx) for name in ("f16", "q8_0") if name in names}
    rows = {}
    for name in names:
        per_chunk = [chunk_metrics(r, x, t) for r, x, t in
                     zip(logits["f16"], logits[name], targets)]
        rows[name] = {"k": LLAMA_CONFIGS[name][0], "v": LLAMA_CONFIGS[name][1],
                      "rotation": LLAMA_CONFIGS[name][2], "seconds": seconds[name],
                      "batch_tokens": batch_tokens(name, n_ctx),
                      **summarize(per_chunk)}
    for name, again in repeat.items():
        diff = max(float(np.abs(a - b).max()) for a, b in zip(logits[name], again))
        rows[name]["rerun_max_abs_logit_diff"] = diff
    _write_json(os.path.join(args.out, "llama_cpp.json"), {
        "llama_cpp_python": llama_cpp.__version__, "threads": args.threads,
        "flash_attn": True, "n_ctx": n_ctx, "reference": "llama.cpp's own f16 cache",
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "rows": rows})
    print(f"-> {os.path.join(args.out, 'llama_cpp.json')}")


# --------------------------------------------------------------------------------------------
# Step 3: kvquant, and the comparison
# --------------------------------------------------------------------------------------------
def _kvquant_logits(model, inputs, spec, batch=None):
    """Logits of each chunk, fed ``batch`` tokens at a time (default: the whole chunk)."""
    out = []
    for x in inputs:
        x, cache = np.array(x), model.new_cache(spec)
        step = batch or x.size
        out.append(np.concatenate([model.forward(x[i:i + step], cache)
                                   for i in range(0, x.size, step)]))
    return out


def cmd_kvquant(args):
    from kvquant.models import load_model
    meta = _read_json(os.path.join(args.out, "chunks.json"), "chunks")
    llama = _read_json(os.path.join(args.out, "llama_cpp.json"), "llama")
    model = load_model(meta["model"])
    inputs = [c["ids"][:-1] for c in meta["chunks"]]
    targets = [np.array(c["ids"][1:]) for c in meta["chunks"]]
    t0 = time.perf_counter()
    f32 = _kvquant_logits(model, inputs, "f32")
    f16 = _kvquant_logits(model, inputs, ggml_spec("f16"))
    names = args.configs.split(",") if args.configs else list(llama["rows"])
    unknown = [n for n in names if n not in llama["rows"]]
    if unknown:
        raise SystemExit(f"--configs: {unknown} not in the llama step's rows "
                         f"{list(llama['rows'])}")
    names = ["f16"] + [n for n in names if n != "f16"]
    rows = {}
    for name in names:
        specs = {"as_run": ggml_spec(name)}
        if args.storage_only and name in STORAGE_ONLY:
            specs["storage_only"] = STORAGE_ONLY[name]
        row = {}
        batch = llama["rows"][name].get("batch_tokens")
        for kind, spec in specs.items():
            if spec == ggml_spec("f16") and batch == llama["n_ctx"]:
                logits = f16
            else:
                logits = _kvquant_logits(model, inputs, spec, batch)
            row[kind] = {"spec": spec,
                         "vs_ggml_f16": summarize([chunk_metrics(r, x, t) for r, x, t in
                                                   zip(f16, logits, targets)]),
                         "vs_f32": summarize([chunk_metrics(r, x, t) for r, x, t in
                                              zip(f32, logits, targets)])}
            print(f"kvquant {spec}: mean KLD {row[kind]['vs_ggml_f16']['kld_mean']:.3e} vs "
                  f"ggml:f16/f16", flush=True)
        rows[name] = row
        # written after every row: a long run that stops keeps what it measured
        result = {"model": meta["model"], "gguf": os.path.basename(meta["source_gguf"]),
                  "llama_cpp_weights": meta["weights"],
                  "text": meta["text"], "positions": meta["positions"],
                  "chunk_tokens": meta["chunk_tokens"], "n_chunks": len(inputs),
                  "llama_cpp": llama, "kvquant": rows,
                  "kvquant_seconds": time.perf_counter() - t0}
        _write_json(os.path.join(args.out, "crosscheck.json"), result)
        with open(os.path.join(args.out, "crosscheck.md"), "w", encoding="utf-8") as f:
            f.write(format_markdown(result))
    print(format_markdown(result))


def _e(x, se=None):
    s = f"{x:.3e}"
    return s if se is None or not math.isfinite(se) else f"{s} ± {se:.1e}"


def format_markdown(result):
    lines = [
        f"llama.cpp against kvquant's model of its attention: {result['model']} "
        f"({result['gguf']}; llama.cpp's weights: {result['llama_cpp_weights']}), text "
        f"`{result['text']}`, {result['n_chunks']} chunks of "
        f"{result['chunk_tokens']} tokens ({result['positions']} positions), llama-cpp-python "
        f"{result['llama_cpp']['llama_cpp_python']}, flash attention, "
        f"threads: {result['llama_cpp']['threads']}.",
        "",
        "Mean KLD against each engine's own f16 cache (± standard error over chunks); "
        "same-top-1 and PPL ratio as llama.cpp's; kvquant's `ggml:` row against `ggml:f16/f16`, "
        "its storage-only row against the same. Last column: the `ggml:` cache against "
        "kvquant's exact f32 cache.",
        "",
        "| cache K / V (rotation) | llama.cpp mean KLD | same top-1 | PPL ratio | "
        "kvquant `ggml:` mean KLD | ratio | same top-1 | storage only | `ggml:` vs f32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, lrow in result["llama_cpp"]["rows"].items():
        if name == "f16":
            continue
        krow = result["kvquant"].get(name)
        if krow is None:   # measured by llama.cpp only
            lines.append(f"| {name} | {_e(lrow['kld_mean'], lrow['kld_mean_se_chunks'])} | "
                         f"{100 * lrow['same_top']:.2f}% | {lrow['ppl_ratio']:.4f} | "
                         "not run | | | | |")
            continue
        a = krow["as_run"]["vs_ggml_f16"]
        so = krow.get("storage_only")
        lines.append(
            f"| {name} | {_e(lrow['kld_mean'], lrow['kld_mean_se_chunks'])} | "
            f"{100 * lrow['same_top']:.2f}% | {lrow['ppl_ratio']:.4f} | "
            f"{_e(a['kld_mean'], a['kld_mean_se_chunks'])} | "
            f"{a['kld_mean'] / lrow['kld_mean']:.2f} | {100 * a['same_top']:.2f}% | "
            + (f"`{so['spec']}` {_e(so['vs_ggml_f16']['kld_mean'])}" if so else "-")
            + f" | {_e(krow['as_run']['vs_f32']['kld_mean'])} |")
    f16 = result["kvquant"]["f16"]["as_run"]["vs_f32"]
    lines += ["", f"kvquant's `ggml:f16/f16` against its f32 cache: mean KLD "
                  f"{_e(f16['kld_mean'])}."]
    reruns = {n: r["rerun_max_abs_logit_diff"] for n, r in result["llama_cpp"]["rows"].items()
              if "rerun_max_abs_logit_diff" in r}
    if reruns:
        lines.append("llama.cpp run twice: largest logit difference " + ", ".join(
            f"{n} {d:.3g}" for n, d in reruns.items()) + ".")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("chunks", help="token chunks of a text (kvquant)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", default="pydoc")
    p.add_argument("--positions", type=int, default=2048)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--f32-weights", action="store_true",
                   help="run llama.cpp on a copy of the file with float32 weights")
    p = sub.add_parser("llama", help="run llama.cpp on the chunks (llama_cpp + numpy)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", help="comma-separated names among: " + ", ".join(LLAMA_CONFIGS)
                   + " (default: all)")
    p = sub.add_parser("kvquant", help="run kvquant's ggml: caches and write the comparison")
    p.add_argument("--configs", help="comma-separated names of the llama step's rows (default: "
                   "all; an f16 V summed by the one-query path is slow here: minutes a chunk)")
    p.add_argument("--storage-only", action="store_true",
                   help="also run the storage-only baseline of each row (q8_0+rot, ...)")
    for p in sub.choices.values():
        p.add_argument("--out", required=True, help="folder for this run's files")
    args = parser.parse_args(argv)
    {"chunks": cmd_chunks, "llama": cmd_llama, "kvquant": cmd_kvquant}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
