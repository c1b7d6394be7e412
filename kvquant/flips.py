"""Token-flip tables: what a KV codec changes in a model's next-token predictions.

Two measurements, both against the same model with an f32 cache (REFERENCE.md §1.8, §3):

* **The engine's protocol** (both models). A prompt and the f32 run's 20 greedy tokens give a
  reference sequence. *Teacher forcing*: one prefill over the whole sequence with the codec's
  cache; count positions whose argmax equals the f32 argmax (X/32 on the tiny model). *Greedy*:
  the codec's run generates its own 20 tokens, compared position-wise with the reference (Y/20).
  On the real model the protocol runs over several prompts cut from ``pydoc_data.topics``.
* **Real text** (the real model). Chunks of ``pydoc_data.topics`` (present in every Python; or,
  with ``text="code"``, Python source of standard-library modules) are run in prefill; at every position, against the f32 cache: top-1 agreement ("same top p", as
  ``llama-perplexity --kl-divergence``), the KL divergence KL(p_f32 || p_codec) of the next-token
  distribution (mean, 99th percentile, max) and the perplexity ratio PPL(codec) / PPL(f32) on the
  text's own next tokens.

Proportions carry Wilson 95% intervals. Positions of one chunk share a context, so they are not
independent trials: the intervals are the usual nominal ones (as llama.cpp's standard errors).

A codec configuration is a pair spec (:func:`kvquant.models.split_pair_spec`): ``"tq4"`` or
``"kv8/tq4"`` (K / V on Llama, L / R on the MLA model).
"""
import csv
import json
import math
import os
import time

import numpy as np

from kvquant.metrics import wilson_interval
from kvquant.models import cache_streams

__all__ = [
    "DEFAULT_CODECS",
    "DEFAULT_POSITIONS",
    "add_cli",
    "flip_protocol",
    "format_markdown",
    "run_flips",
    "text_metrics",
    "text_tokens",
    "write_results",
]

DEFAULT_CODECS = {
    # R rows are 8 wide: the llama.cpp block formats (32 per block) go on L only.
    "tiny-mla": [
        "f32", "kv8", "kv8-g16", "kv8-g8", "kv8-g4", "tq2", "tq3", "tq4", "tq4:compat=colibri",
        "polar3", "polar4", "polar6", "polar3:compat=colibri", "polar4:compat=colibri",
        "polar6:compat=colibri", "q8_0/f32", "q4_0/f32", "q4_0+rot/f32", "tq4/f32", "f32/tq4",
    ],
    "smollm2": [
        "f32", "kv8", "kv8-g32", "tq2", "tq3", "tq4", "tq4:compat=colibri",
        "polar3", "polar4", "polar6", "polar3:compat=colibri", "polar4:compat=colibri",
        "polar6:compat=colibri", "q8_0", "q4_0", "q4_0+rot", "kv8/tq4", "tq4/kv8", "q8_0/q4_0",
    ],
}
# Real text: 10 chunks of 1024 tokens. 10240 positions put the Wilson 95% half-width of any
# proportion under 0.97 points (p = 0.5; 0.59 points at p = 0.9).
DEFAULT_POSITIONS = 10240
DEFAULT_CHUNK_TOKENS = 1024
DEFAULT_PROMPTS = {"tiny-mla": 1, "smollm2": 8}
PROMPT_TOKENS = 12
NEW_TOKENS = 20
KLD_BLOCK = 256


# --------------------------------------------------------------------------------------------
# Small pieces
# --------------------------------------------------------------------------------------------
def log_softmax64(logits):
    """log-probabilities in float64, rows of ``logits``."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def kl_rows(ref_logits, logits):
    """KL(p_ref || p) per row, float64, computed in row blocks."""
    out = np.empty(ref_logits.shape[0])
    for i in range(0, ref_logits.shape[0], KLD_BLOCK):
        lp_ref = log_softmax64(ref_logits[i:i + KLD_BLOCK])
        lp = log_softmax64(logits[i:i + KLD_BLOCK])
        out[i:i + KLD_BLOCK] = np.maximum((np.exp(lp_ref) * (lp_ref - lp)).sum(axis=1), 0.0)
    return out


def nll_rows(logits, targets):
    """Negative log-likelihood of ``targets`` per row, float64."""
    out = np.empty(logits.shape[0])
    for i in range(0, logits.shape[0], KLD_BLOCK):
        lp = log_softmax64(logits[i:i + KLD_BLOCK])
        out[i:i + KLD_BLOCK] = -lp[np.arange(lp.shape[0]), targets[i:i + KLD_BLOCK]]
    return out


def proportion(k, n):
    """{"k", "n", "p", "lo", "hi"} with the Wilson 95% interval."""
    lo, hi = wilson_interval(int(k), int(n))
    return {"k": int(k), "n": int(n), "p": k / n, "lo": lo, "hi": hi}


def greedy(model, prompt, n_new, pair_spec):
    """The run's own greedy continuation (n_new tokens) with a cache of ``pair_spec``."""
    return greedy_many(model, [prompt], n_new, pair_spec)[0]


def greedy_many(model, prompts, n_new, pair_spec):
    """Greedy continuations of several prompts, each with its own cache of ``pair_spec``.

    The prompts are decoded together when the model has ``decode_step`` (a batch: its weights
    are read once per step for all of them).
    """
    caches = [model.new_cache(pair_spec) for _ in prompts]
    last = np.stack([model.forward(p, c)[-1] for p, c in zip(prompts, caches)])
    outs = [[] for _ in prompts]
    for step in range(n_new):
        nxt = last.argmax(axis=1)
        for out, t in zip(outs, nxt):
            out.append(int(t))
        if step == n_new - 1:
            break
        if hasattr(model, "decode_step"):
            last = model.decode_step(nxt, caches)
        else:
            last = np.stack([model.forward([t], c)[-1] for t, c in zip(nxt, caches)])
    return outs


# --------------------------------------------------------------------------------------------
# The engine's protocol
# --------------------------------------------------------------------------------------------
def flip_protocol(model, pair_specs, prompts, n_new=NEW_TOKENS, progress=None):
    """Teacher-forced and greedy agreement with the f32 cache over one or more prompts.

    Parameters
    ----------
    model : a kvquant model (``new_cache``, ``forward``)
    pair_specs : list of str
    prompts : list of sequences of token ids
    n_new : int
        Greedy tokens per prompt.

    Returns
    -------
    dict with ``references`` (per prompt: prompt ids, full ids, f32 teacher-forced argmax) and
    ``rows``: per spec, ``tf`` and ``greedy`` proportions, ``tf_kld_mean`` (KL divergence from the
    f32 distributions over the teacher-forced positions), the cache ``streams`` and its
    ``bytes_per_token``.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    references = []
    for prompt, cont in zip(prompts, greedy_many(model, prompts, n_new, "f32")):
        full = prompt + cont
        tf_logits = model.forward(full, model.new_cache("f32"))
        references.append({"prompt_ids": prompt, "full_ids": full,
                           "tf_pred": tf_logits.argmax(axis=1).tolist(), "_logits": tf_logits})
    rows = []
    for spec in pair_specs:
        t0 = time.perf_counter()
        tf_hits = tf_n = gen_hits = gen_n = 0
        klds = []
        for ref in references:
            cache = model.new_cache(spec)
            logits = model.forward(ref["full_ids"], cache)
            tf_hits += int((logits.argmax(axis=1) == np.asarray(ref["tf_pred"])).sum())
            tf_n += len(ref["full_ids"])
            klds.append(kl_rows(ref["_logits"], logits))
        for ref, gen in zip(references, greedy_many(model, prompts, n_new, spec)):
            gen_hits += sum(a == b for a, b in zip(gen, ref["full_ids"][len(ref["prompt_ids"]):]))
            gen_n += n_new
        rows.append({
            "codec": spec,
            "streams": cache_streams(cache),
            "bytes_per_token": cache.bytes_per_token,
            "fixed_bytes": cache.fixed_bytes,
            "tf": proportion(tf_hits, tf_n),
            "greedy": proportion(gen_hits, gen_n),
            "tf_kld_mean": float(np.concatenate(klds).mean()),
            "protocol_s": time.perf_counter() - t0,
        })
        if progress:
            progress(f"protocol {spec}: TF {tf_hits}/{tf_n}, greedy {gen_hits}/{gen_n}")
    for ref in references:
        del ref["_logits"]
    return {"references": references, "rows": rows}


# --------------------------------------------------------------------------------------------
# Real text
# --------------------------------------------------------------------------------------------
def pydoc_text():
    """The text of ``pydoc_data.topics``, topics in sorted order, separated by blank lines."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


# Pure-Python standard-library modules: source code, a second kind of real text beside the
# reference prose of pydoc topics (so that a result is not tuned to one text). The file contents
# depend on the Python version, which the results record.
CODE_MODULES = ("argparse", "difflib", "textwrap", "fractions", "statistics", "calendar",
                "shlex", "pprint", "dataclasses", "heapq", "string", "bisect", "enum")


def stdlib_code_text():
    """Source files of :data:`CODE_MODULES`, in that order, separated by blank lines."""
    import importlib.util
    parts = []
    for name in CODE_MODULES:
        with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
            parts.append(f.read().strip())
    return "\n\n".join(parts)


TEXTS = {
    "pydoc": ("pydoc_data.topics", pydoc_text),
    "code": ("Python standard-library source (" + ", ".join(CODE_MODULES) + ")",
             stdlib_code_text),
}


def text_tokens(model, text="pydoc"):
    """Token ids of one of the :data:`TEXTS` (``"pydoc"``: reference prose; ``"code"``: Python
    source) and its description."""
    if text not in TEXTS:
        raise ValueError(f"text {text!r} is not one of {sorted(TEXTS)}")
    source, load = TEXTS[text]
    return model.encode(load()), source


def text_chunks(tokens, n_positions, chunk_tokens):
    """Chunks of ``chunk_tokens`` + 1 tokens spread evenly over ``tokens`` (the last may be
    shorter so that the positions add up to ``n_positions``); returns a list of (start, ids)."""
    n_chunks = math.ceil(n_positions / chunk_tokens)
    if n_chunks * (chunk_tokens + 1) > tokens.size:
        raise ValueError(
            f"{n_positions} positions in chunks of {chunk_tokens} need "
            f"{n_chunks * (chunk_tokens + 1)} tokens; the text has {tokens.size}"
        )
    stride = tokens.size // n_chunks
    chunks = []
    for i in range(n_chunks):
        length = min(chunk_tokens, n_positions - i * chunk_tokens)
        start = i * stride
        chunks.append((start, tokens[start:start + length + 1]))
    return chunks


def chunk_stats(model, pair_specs, ids):
    """One text chunk: ids[:-1] run in one prefill from an empty cache, ids[1:] the targets.

    Returns {"n", "nll_f32", "specs": {spec: {"same", "kld" (per position), "nll", "seconds"}}}.
    """
    inputs, targets = ids[:-1], ids[1:]
    ref = model.forward(inputs, model.new_cache("f32"))
    ref_top = ref.argmax(axis=1)
    # The f32 distributions, once per chunk (float64, in row blocks).
    blocks = [slice(i, i + KLD_BLOCK) for i in range(0, inputs.size, KLD_BLOCK)]
    ref_lp = [log_softmax64(ref[b]) for b in blocks]
    ref_p = [np.exp(lp) for lp in ref_lp]
    rows = np.arange(inputs.size)
    out = {"n": int(inputs.size), "specs": {},
           "nll_f32": float(-sum(lp[rows[b] - b.start, targets[b]].sum()
                                 for b, lp in zip(blocks, ref_lp)))}
    for spec in pair_specs:
        t0 = time.perf_counter()
        logits = ref if spec == "f32" else model.forward(inputs, model.new_cache(spec))
        kld = np.empty(inputs.size)
        nll = 0.0
        for b, lp_ref, p_ref in zip(blocks, ref_lp, ref_p):
            lp = lp_ref if spec == "f32" else log_softmax64(logits[b])
            kld[b] = np.maximum((p_ref * (lp_ref - lp)).sum(axis=1), 0.0)
            nll -= lp[rows[b] - b.start, targets[b]].sum()
        out["specs"][spec] = {
            "same": int((logits.argmax(axis=1) == ref_top).sum()),
            "kld": kld,
            "nll": float(nll),
            "seconds": time.perf_counter() - t0,
        }
    return out


def combine_chunks(pair_specs, stats):
    """Rows of same-top-p, KL divergence and perplexity ratio from :func:`chunk_stats` results.

    Returns
    -------
    list of dict, one per spec: ``same_top`` (proportion), ``kld_mean``, ``kld_p99``,
    ``kld_max``, ``ppl``, ``ppl_f32``, ``ppl_ratio``, ``mean_ln_ppl_ratio``, ``text_s``.
    """
    n_pos = sum(st["n"] for st in stats)
    nll_ref = sum(st["nll_f32"] for st in stats)
    ppl_ref = math.exp(nll_ref / n_pos)
    rows = []
    for spec in pair_specs:
        per = [st["specs"][spec] for st in stats]
        kld = np.concatenate([p["kld"] for p in per])
        nll = sum(p["nll"] for p in per)
        rows.append({
            "codec": spec,
            "same_top": proportion(sum(p["same"] for p in per), n_pos),
            "kld_mean": float(kld.mean()),
            "kld_p99": float(np.percentile(kld, 99)),
            "kld_max": float(kld.max()),
            "ppl": math.exp(nll / n_pos),
            "ppl_f32": ppl_ref,
            "ppl_ratio": math.exp((nll - nll_ref) / n_pos),
            "mean_ln_ppl_ratio": (nll - nll_ref) / n_pos,
            "text_s": float(sum(p["seconds"] for p in per)),
        })
    return rows


def text_metrics(model, pair_specs, chunks, progress=None):
    """Same-top-p, KL divergence and perplexity ratio of each spec against the f32 cache, over
    ``chunks`` (a list of (start, ids)) in this process; see :func:`combine_chunks`."""
    stats = []
    for ci, (_, ids) in enumerate(chunks):
        stats.append(chunk_stats(model, pair_specs, ids))
        if progress:
            progress(f"text chunk {ci + 1}/{len(chunks)} ({ids.size - 1} positions) done")
    return combine_chunks(pair_specs, stats)


# --------------------------------------------------------------------------------------------
# Worker processes: each loads the model once and runs whole chunks or groups of codecs with one
# BLAS thread (two processes on two cores beat one process with two BLAS threads, whose small
# products and thread hand-offs lose more than they gain).
# --------------------------------------------------------------------------------------------
_WORKER = {}


def worker_setup(parent_pid):
    """What a pool worker running a model does first: leave when its parent is gone (a worker
    outlives a parent killed by a signal) and hold BLAS to one thread (the pool is the
    parallelism)."""
    import threading
    from threadpoolctl import threadpool_limits

    def watch_parent():
        while True:
            time.sleep(2.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    _WORKER["blas"] = threadpool_limits(limits=1, user_api="blas")


def _init_worker(model_name, parent_pid):
    from kvquant.models import load_model
    worker_setup(parent_pid)
    _WORKER["model"] = load_model(model_name)


def _worker_task(task):
    kind, index, args = task
    if kind == "protocol":
        return kind, index, flip_protocol(_WORKER["model"], *args)
    return kind, index, chunk_stats(_WORKER["model"], *args)


def _run_pool(model_name, workers, codecs, prompts, chunks, progress):
    """The protocol (codecs split in ``workers`` groups) and the text chunks in worker
    processes; returns (protocol result, chunk stats in chunk order)."""
    import multiprocessing

    groups = [g for g in (codecs[i::workers] for i in range(workers)) if g]
    tasks = [("protocol", i, (g, prompts, NEW_TOKENS)) for i, g in enumerate(groups)]
    tasks += [("chunk", i, (codecs, ids)) for i, (_, ids) in enumerate(chunks)]
    proto = [None] * len(groups)
    stats = [None] * len(chunks)
    ctx = multiprocessing.get_context("spawn")
    # Leaving the block (normally or on an exception, Ctrl-C included) terminates the workers.
    with ctx.Pool(workers, initializer=_init_worker, initargs=(model_name, os.getpid())) as pool:
        for kind, index, result in pool.imap_unordered(_worker_task, tasks):
            if kind == "protocol":
                proto[index] = result
                if progress:
                    progress("protocol: " + ", ".join(
                        f"{r['codec']} TF {r['tf']['k']}/{r['tf']['n']} greedy "
                        f"{r['greedy']['k']}/{r['greedy']['n']}" for r in result["rows"]))
            else:
                stats[index] = result
                if progress:
                    progress(f"text chunk {index + 1}/{len(chunks)} done")
    by_spec = {r["codec"]: r for part in proto for r in part["rows"]}
    return {"references": proto[0]["references"], "rows": [by_spec[c] for c in codecs]}, stats


# --------------------------------------------------------------------------------------------
# The whole table
# --------------------------------------------------------------------------------------------
def protocol_prompts(model_name, tokens=None, n_prompts=1):
    """The engine's prompt on the tiny model; windows of the text on the real one."""
    if model_name == "tiny-mla":
        from kvquant.models.tiny_mla import ORACLE_PROMPT
        if n_prompts != 1:
            raise ValueError("the tiny model's protocol has one prompt (the engine's)")
        return [list(ORACLE_PROMPT)]
    # Half a stride away from the text chunks' starts, so prompts are not chunk openings.
    stride = tokens.size // n_prompts
    return [tokens[i * stride + stride // 2:][:PROMPT_TOKENS].tolist() for i in range(n_prompts)]


def run_flips(model_name, codecs=None, positions=None, chunk_tokens=DEFAULT_CHUNK_TOKENS,
              n_prompts=None, workers=None, model=None, progress=None, text="pydoc"):
    """Build the flip table of ``model_name`` ("tiny-mla" or "smollm2").

    Parameters
    ----------
    codecs : list of str, optional
        Pair specs; default :data:`DEFAULT_CODECS` of the model. ``f32`` is always included.
    positions : int, optional
        Real-text positions (smollm2 only); default :data:`DEFAULT_POSITIONS`; 0 skips them.
    chunk_tokens : int
        Tokens per text chunk (one prefill each).
    n_prompts : int, optional
        Prompts of the engine's protocol (1 on the tiny model; default 8 on smollm2).
    workers : int, optional
        Worker processes for smollm2 (each loads the model, ~1 GB, and uses one BLAS thread);
        1 runs everything in this process. Default: 1 when ``model`` is given, else the number
        of cores, at most 2.
    model : optional
        An already built model (saves the load; the workers, if any, load their own).
    text : {"pydoc", "code"}
        The real text (smollm2): reference prose of ``pydoc_data.topics`` or Python source of
        standard-library modules (:data:`TEXTS`).

    Returns
    -------
    dict: ``meta`` (model, protocol, versions, elapsed) and ``rows`` (one per spec).
    """
    from kvquant.models import load_model
    t_start = time.perf_counter()
    codecs = list(codecs or DEFAULT_CODECS[model_name])
    if "f32" not in codecs:
        codecs.insert(0, "f32")
    if len(set(codecs)) != len(codecs):
        raise ValueError(f"a codec is listed twice in {codecs}")
    if workers is None and model is not None:
        workers = 1
    model = model if model is not None else load_model(model_name)
    # Fail on a bad spec before any long run.
    for spec in codecs:
        model.new_cache(spec)
    n_prompts = DEFAULT_PROMPTS[model_name] if n_prompts is None else int(n_prompts)
    if model_name == "tiny-mla":
        if positions:
            raise ValueError("--positions applies to the real model; the tiny model runs the "
                             "engine's protocol only (its weights are random: no text)")
        positions, tokens, workers = 0, None, 1
    else:
        positions = DEFAULT_POSITIONS if positions is None else int(positions)
        tokens, source = text_tokens(model, text)
        workers = min(2, os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    prompts = protocol_prompts(model_name, tokens, n_prompts)
    chunks = text_chunks(tokens, positions, chunk_tokens) if positions else []
    if workers == 1:
        proto = flip_protocol(model, codecs, prompts, NEW_TOKENS, progress=progress)
        stats = []
        for ci, (_, ids) in enumerate(chunks):
            stats.append(chunk_stats(model, codecs, ids))
            if progress:
                progress(f"text chunk {ci + 1}/{len(chunks)} done")
    else:
        proto, stats = _run_pool(model_name, workers, codecs, prompts, chunks, progress)
    rows = proto["rows"]
    meta = {
        "model": model.describe(),
        "protocol": {
            "prompts": len(prompts),
            "prompt_tokens": len(prompts[0]),
            "new_tokens": NEW_TOKENS,
            "references": proto["references"],
        },
    }
    if positions:
        meta["text"] = {"name": text, "source": source, "text_tokens": int(tokens.size),
                        "positions": positions, "chunk_tokens": chunk_tokens,
                        "chunk_starts": [int(s) for s, _ in chunks]}
        for row, text_row in zip(rows, combine_chunks(codecs, stats)):
            assert row["codec"] == text_row["codec"]
            row.update({k: v for k, v in text_row.items() if k != "codec"})
    import kvquant
    meta["kvquant"] = kvquant.__version__
    meta["numpy"] = np.__version__
    meta["workers"] = workers
    meta["elapsed_s"] = time.perf_counter() - t_start
    f32_bytes = next(r["bytes_per_token"] for r in rows if r["codec"] == "f32")
    for r in rows:
        r["compression"] = f32_bytes / r["bytes_per_token"]
    return {"meta": meta, "rows": rows}


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def _frac(p):
    return f"{p['k']}/{p['n']} [{100 * p['lo']:.0f}, {100 * p['hi']:.0f}]"


def _pct(p):
    return f"{100 * p['p']:.2f} [{100 * p['lo']:.2f}, {100 * p['hi']:.2f}]"


def _streams(row):
    (na, a), (nb, b) = row["streams"].items()
    return a if a == b else f"{na.upper()} {a} / {nb.upper()} {b}"


def format_markdown(result):
    """The table as markdown (Wilson 95% intervals in brackets, in percent)."""
    meta, rows = result["meta"], result["rows"]
    has_text = "text" in meta
    lines = []
    proto = meta["protocol"]
    head = (f"Model {meta['model']['model']}; engine protocol: {proto['prompts']} prompt(s) of "
            f"{proto['prompt_tokens']} tokens + {proto['new_tokens']} greedy tokens")
    if has_text:
        t = meta["text"]
        head += (f"; real text: {t['positions']} positions of {t['source']} in chunks of "
                 f"{t['chunk_tokens']} tokens")
    lines.append(head + f". Attention: {meta['model']['attention']}.")
    lines.append("")
    cols = ["codec", "B/token", "ratio", "TF agree", "greedy agree", "TF KLD"]
    if has_text:
        cols += ["same top % [95% CI]", "mean KLD", "p99 KLD", "PPL ratio"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = [_streams(r), str(r["bytes_per_token"]), f"{r['compression']:.2f}",
                 _frac(r["tf"]), _frac(r["greedy"]), f"{r['tf_kld_mean']:.2e}"]
        if has_text:
            cells += [_pct(r["same_top"]), f"{r['kld_mean']:.2e}", f"{r['kld_p99']:.2e}",
                      f"{r['ppl_ratio']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if has_text:
        lines.append("")
        lines.append(f"PPL(f32) = {rows[0]['ppl_f32']:.3f}.")
    return "\n".join(lines)


def result_stem(result):
    meta = result["meta"]
    name = "tiny-mla" if meta["model"]["model"] == "tiny-mla" else "smollm2"
    stem = f"flips-{name}-p{meta['protocol']['prompts']}"
    if "text" in meta:
        name = meta["text"].get("name", "pydoc")
        stem += ("" if name == "pydoc" else f"-{name}") + \
            f"-N{meta['text']['positions']}-c{meta['text']['chunk_tokens']}"
    return stem


CSV_COLUMNS = ["codec", "streams", "bytes_per_token", "compression", "tf_k", "tf_n",
               "tf_lo", "tf_hi", "greedy_k", "greedy_n", "greedy_lo", "greedy_hi", "tf_kld_mean",
               "same_top_k", "same_top_n", "same_top_lo", "same_top_hi", "kld_mean", "kld_p99",
               "kld_max", "ppl", "ppl_f32", "ppl_ratio"]


def write_results(result, out_dir):
    """Write ``<stem>.json`` and ``<stem>.csv`` in ``out_dir``; returns the two paths."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(result))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            flat = dict(r)
            flat["streams"] = " ".join(f"{k}={v}" for k, v in r["streams"].items())
            for key in ("tf", "greedy", "same_top"):
                if key in r:
                    for part in ("k", "n", "lo", "hi"):
                        flat[f"{key}_{part}"] = r[key][part]
            w.writerow(flat)
    return stem + ".json", stem + ".csv"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def cmd_flips(args):
    import sys
    from kvquant.codecs import split_spec_list
    codecs = split_spec_list(args.codecs) if args.codecs else None

    def progress(msg):
        if not args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    try:
        result = run_flips(args.model, codecs=codecs, positions=args.positions,
                           chunk_tokens=args.chunk_tokens, n_prompts=args.prompts,
                           workers=args.workers, progress=progress, text=args.text)
    except (ValueError, ImportError) as exc:
        raise SystemExit(f"kvquant flips: {exc}")
    paths = () if args.no_write else write_results(result, args.out)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_markdown(result))
        for p in paths:
            print(f"wrote {p}")
    return 0


def add_cli(sub):
    """Register ``kvquant flips``."""
    p = sub.add_parser(
        "flips", help="token-flip table of KV codecs on the tiny MLA model or SmolLM2",
        description="Teacher-forced and greedy agreement with the f32 cache (the engine's "
                    "protocol), and on the real model same-top-p, KL divergence and perplexity "
                    "ratio over pydoc_data.topics; Wilson 95%% intervals.")
    p.add_argument("--model", choices=("tiny-mla", "smollm2"), default="tiny-mla")
    p.add_argument("--codecs", default=None,
                   help="comma-separated specs (options may follow, as in "
                        "tq3:codebook=gaussian,side=unbiased); 'A/B' gives K/V (or L/R) "
                        "different codecs; default: the model's list")
    p.add_argument("--positions", type=int, default=None,
                   help=f"real-text positions on smollm2 (default {DEFAULT_POSITIONS}; 0: none)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="tokens per text chunk (one prefill each)")
    p.add_argument("--text", choices=sorted(TEXTS), default="pydoc",
                   help="real text on smollm2: pydoc_data.topics prose or stdlib Python source")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts of the engine's protocol (smollm2; default 8)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes on smollm2 (default: cores, at most 2; 1: none)")
    p.add_argument("--out", default=os.path.join("data", "results"),
                   help="folder for the CSV/JSON results")
    p.add_argument("--no-write", action="store_true", help="write no files")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_flips)
    return p
