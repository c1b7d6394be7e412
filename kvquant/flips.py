"""Token-flip tables: what a KV codec changes in a model's next-token predictions.

Two measurements, both against the same model with an f32 cache (docs/reference.md §1.8, §3):

* **The engine's protocol** (both models). A prompt and the f32 run's 20 greedy tokens give a
  reference sequence. *Teacher forcing*: one prefill over the whole sequence with the codec's
  cache; count positions whose argmax equals the f32 argmax (X/32 on the tiny model). *Greedy*:
  the codec's run generates its own 20 tokens, compared position-wise with the reference (Y/20).
  On the real model the protocol runs over several prompts cut from ``pydoc_data.topics``.
* **Real text** (a model with a tokenizer). Chunks of a text (:func:`text_chunks`) are run in
  prefill; at every position, against the f32 cache: top-1 agreement ("same top p", as
  ``llama-perplexity --kl-divergence``), the KL divergence KL(p_f32 || p_codec) of the next-token
  distribution (mean, 99th percentile, max, and by position in the chunk) and the perplexity
  ratio PPL(codec) / PPL(f32) on the text's own next tokens (:func:`chunk_stats`,
  :func:`combine_chunks`). Chunks may be as long as the model's trained context: the metrics are
  computed in row blocks within a stated memory bound.

Every row also carries llama.cpp's ``llama-perplexity --kl-divergence`` statistic set under its
names, with the same definitions (:func:`kvquant.metrics.llama_statistics`, docs/reference.md
§3): mean PPL(Q) and PPL(base), Cor(ln PPL(Q), ln PPL(base)), mean ln(PPL(Q)/PPL(base)) and
PPL(Q)/PPL(base), mean KLD, KLD percentiles, Δp (the change of the target token's
probability) and its percentiles, RMS Δp and same top p, each mean with llama.cpp's standard
error. ``score="second-half"`` scores only the second half of each chunk, as llama-perplexity
does; the default scores every position.

Proportions carry Wilson 95% intervals. Positions of one chunk share a context, so they are not
independent trials: the Wilson intervals and llama.cpp's standard errors are nominal. The mean
KLD and the PPL ratio also get a paired bootstrap interval over chunks
(:func:`kvquant.metrics.chunk_bootstrap`), which does not assume independent positions.

A cache configuration is a cache spec (:mod:`kvquant.specs`, docs/specs.md): ``"tq4"``,
``"kv8/tq4"`` (K / V on Llama, L / R on the MLA model), a plan file, ``"ggml:q8_0/q8_0"``...

This module holds the protocol and the metrics. Texts, whole runs over an executor, their tables,
result files and the ``kvquant flips`` command are research code: ``kvquant_experiments.texts``,
``flip_runs``, ``flip_storage``, ``flip_tables``, ``flip_files`` and ``flip_command``.
"""
import math
import time

import numpy as np

from kvquant.metrics import chunk_bootstrap, llama_statistics, wilson_interval
from kvquant.models import cache_streams, decoded_streams
from kvquant.specs import parse_cache_spec

__all__ = [
    "METRIC_BLOCK_BYTES",
    "chunk_stats",
    "combine_chunks",
    "flip_protocol",
    "kl_rows",
    "metric_block_rows",
    "nll_rows",
    "position_bins",
    "scored_from",
    "protocol_prompts",
    "text_chunks",
    "text_metrics",
]

PROMPT_TOKENS = 12
NEW_TOKENS = 20
# One float64 (rows x vocab) block of the text metrics: 64 MiB (170 rows of SmolLM2's 49152).
METRIC_BLOCK_BYTES = 1 << 26
KLD_BLOCK = 256   # rows per block of kl_rows / nll_rows (the protocol's short sequences)
POSITION_BINS = 32


# --------------------------------------------------------------------------------------------
# Small pieces
# --------------------------------------------------------------------------------------------
def log_softmax64(logits):
    """log-probabilities in float64, rows of ``logits`` (one float64 copy and one temporary)."""
    x = np.array(logits, dtype=np.float64)
    x -= x.max(axis=1, keepdims=True)
    e = np.exp(x)
    x -= np.log(e.sum(axis=1, keepdims=True))
    return x


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
            # streams whose codec has no compressed-domain consumer: read as decoded rows
            "decoded_streams": decoded_streams(cache),
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
def text_chunks(tokens, n_positions, chunk_tokens, bos=None):
    """Cut a text's token ids into the prefill chunks of the text metrics.

    ``ceil(n_positions / chunk_tokens)`` chunks of ``chunk_tokens`` + 1 tokens (inputs and their
    next tokens) start at even strides over ``tokens``; the last chunk is shorter when needed so
    that the positions add up to ``n_positions``. Chunks never overlap. With ``bos`` (the id of
    a model whose inputs start with a BOS token, ``model.bos_token_id``), each chunk's first
    input is replaced by it, as llama.cpp's perplexity tool does, so that every chunk starts as
    the model was trained to start (Gemma 3 without its BOS degrades badly).

    Parameters
    ----------
    tokens : ndarray of int, shape (n_tokens,)
        The whole text, encoded.
    n_positions : int
        Positions to measure (predictions), >= 1.
    chunk_tokens : int
        Context of one chunk (one prefill from an empty cache), >= 1.
    bos : int or None
        The BOS id that starts every chunk, or None to cut the text as it is.

    Returns
    -------
    list of (int, ndarray)
        (start index in ``tokens``, ids of shape (length + 1,)) per chunk.

    Raises
    ------
    ValueError
        A count below 1, or a text too short for the positions asked (the message gives the
        tokens needed and those the text has).
    """
    tokens = np.asarray(tokens)
    n_positions, chunk_tokens = int(n_positions), int(chunk_tokens)
    if n_positions < 1 or chunk_tokens < 1:
        raise ValueError(f"positions and chunk tokens must be >= 1, got {n_positions} and "
                         f"{chunk_tokens}")
    n_chunks = math.ceil(n_positions / chunk_tokens)
    if n_chunks * (chunk_tokens + 1) > tokens.size:
        raise ValueError(
            f"{n_positions} positions in chunks of {chunk_tokens} need "
            f"{n_chunks * (chunk_tokens + 1)} tokens; the text has {tokens.size}: give a "
            "longer text, fewer positions or shorter chunks"
        )
    stride = tokens.size // n_chunks
    chunks = []
    for i in range(n_chunks):
        length = min(chunk_tokens, n_positions - i * chunk_tokens)
        start = i * stride
        ids = tokens[start:start + length + 1]
        if bos is not None:
            ids = ids.copy()
            ids[0] = bos
        chunks.append((start, ids))
    return chunks


def metric_block_rows(vocab_size, block_bytes=METRIC_BLOCK_BYTES):
    """Rows per block of the text metrics: one float64 (rows, vocab_size) array in
    ``block_bytes`` (at least one row)."""
    return max(1, int(block_bytes) // (8 * int(vocab_size)))


def chunk_stats(model, pair_specs, ids, block_rows=None):
    """One text chunk: ids[:-1] run in one prefill from an empty cache, ids[1:] the targets.

    The model runs once per spec to its final hidden rows (``model.forward_hidden``, f32 cache
    first as the reference); then, per block of rows, the reference's logits are computed once
    and each spec's from its hidden rows (``model.logits``), and the block's metrics taken.

    Memory: the hidden rows, (1 + specs) x n x hidden float32, and per block of B rows at most
    five arrays of B x vocab of 8 bytes or less (the reference's log-probabilities and
    probabilities in float64, one spec's float32 logits, its float64 log-probabilities and one
    temporary). With the default B (:func:`metric_block_rows`: B x vocab x 8 bytes <=
    :data:`METRIC_BLOCK_BYTES` = 64 MiB) that is under 320 MiB, whatever the chunk's length.

    Parameters
    ----------
    model : a kvquant model (``new_cache``, ``forward_hidden``, ``logits``, ``vocab_size``)
    pair_specs : list of str or CacheSpec
        A spec that is the f32 reference (:attr:`kvquant.specs.CacheSpec.is_reference`: ``f32``,
        ``f32/f32``...) is not run again: its rows are the reference's.
    ids : ndarray of int, shape (n + 1,)
    block_rows : int, optional
        Rows per block (default :func:`metric_block_rows` of the vocabulary).

    Returns
    -------
    dict
        ``{"n", "nll_f32", "nll_f32_at", "reference_s", "specs": {spec: {"same" (count),
        "same_at" (bool per position), "kld" (float64 per position), "nll" (sum), "nll_at"
        (float64 per position), "seconds"}}}``; position i predicts ids[i + 1] from
        ids[:i + 1]; ``nll*_at`` are -ln p(ids[i + 1]), so the per-position arrays are a few
        n-length vectors per spec.
    """
    ids = np.asarray(ids)
    inputs, targets = ids[:-1], ids[1:]
    n = int(inputs.size)
    B = metric_block_rows(model.vocab_size) if block_rows is None else int(block_rows)
    if B < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    t0 = time.perf_counter()
    reference = model.forward_hidden(inputs, model.new_cache("f32"))
    reference_s = time.perf_counter() - t0
    # a spec that is the f32 reference however spelled ("f32/f32") is not run again
    is_reference = {spec: parse_cache_spec(spec).is_reference for spec in pair_specs}
    hidden, specs = {}, {}
    for spec in pair_specs:
        t0 = time.perf_counter()
        if not is_reference[spec]:
            hidden[spec] = model.forward_hidden(inputs, model.new_cache(spec))
        specs[spec] = {"same": 0, "same_at": np.empty(n, dtype=bool), "kld": np.empty(n),
                       "nll": 0.0, "nll_at": np.empty(n), "seconds": time.perf_counter() - t0}
    nll_f32 = 0.0
    nll_f32_at = np.empty(n)
    for b0 in range(0, n, B):
        b = slice(b0, min(b0 + B, n))
        rows, tgt = np.arange(b.stop - b.start), targets[b]
        ref = model.logits(reference[b])
        ref_top = ref.argmax(axis=1)
        lp_ref = log_softmax64(ref)
        del ref
        p_ref = np.exp(lp_ref)
        nll_ref_at = -lp_ref[rows, tgt]
        nll_f32_at[b] = nll_ref_at
        nll_ref = nll_ref_at.sum()
        nll_f32 += nll_ref
        for spec, st in specs.items():
            t0 = time.perf_counter()
            if is_reference[spec]:   # the reference itself: KL 0, same top everywhere
                st["same_at"][b] = True
                st["kld"][b] = 0.0
                st["nll"] += nll_ref
                st["nll_at"][b] = nll_ref_at
            else:
                logits = model.logits(hidden[spec][b])
                st["same_at"][b] = logits.argmax(axis=1) == ref_top
                lp = log_softmax64(logits)
                del logits
                st["nll_at"][b] = -lp[rows, tgt]
                st["nll"] += st["nll_at"][b].sum()
                np.subtract(lp_ref, lp, out=lp)
                lp *= p_ref
                st["kld"][b] = np.maximum(lp.sum(axis=1), 0.0)
                del lp
            st["seconds"] += time.perf_counter() - t0
    for st in specs.values():
        st["same"] = int(st["same_at"].sum())
        st["nll"] = float(st["nll"])
    return {"n": n, "nll_f32": float(nll_f32), "nll_f32_at": nll_f32_at,
            "reference_s": reference_s, "specs": specs}


def position_bins(max_positions, n_bins=POSITION_BINS):
    """Edges of the position bins of :func:`combine_chunks`: bins of ``ceil(max_positions /
    n_bins)`` positions from 0 (the last one may be shorter), as ints."""
    max_positions = int(max_positions)
    width = max(1, math.ceil(max_positions / max(1, int(n_bins))))
    return list(range(0, max_positions, width)) + [max_positions]


SCORES = ("all", "second-half")


def scored_from(n, score="all"):
    """First scored position of a chunk of ``n`` predictions: 0 (``"all"``) or n // 2
    (``"second-half"``: as llama-perplexity, which scores the second half of each window so that
    every scored token has at least half a window of context)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    return 0 if score == "all" else int(n) // 2


def combine_chunks(pair_specs, stats, n_bins=POSITION_BINS, score="all", bootstrap=True):
    """Rows of same-top-p, KL divergence, perplexity ratio and llama.cpp's statistic set from
    :func:`chunk_stats` results.

    Parameters
    ----------
    pair_specs : list of str
    stats : list of dict
        :func:`chunk_stats` of each chunk.
    n_bins : int
        Position bins of ``by_position``.
    score : {"all", "second-half"}
        Positions that enter the statistics (:func:`scored_from`); ``by_position`` bins only
        the scored ones.
    bootstrap : bool
        Add the paired bootstrap intervals over chunks (:func:`kvquant.metrics.chunk_bootstrap`).

    Returns
    -------
    list of dict, one per spec: every key of :func:`kvquant.metrics.llama_statistics` (llama.cpp's
    statistics with their standard errors), ``same_top`` (proportion with its Wilson interval
    and llama.cpp's ``se``), ``kld_mean``, ``kld_p99``, ``kld_max``, ``ppl``, ``ppl_f32``,
    ``ppl_ratio``, ``mean_ln_ppl_ratio``, ``bootstrap`` (``kld_mean`` and ``ppl_ratio`` intervals
    over chunks, or None with one chunk), ``text_s``, and ``by_position``: the positions in a
    chunk cut into equal bins (:func:`position_bins`), with ``edges`` (bin i holds positions
    edges[i] <= p < edges[i + 1], position p predicting the token after p + 1 of context), ``n``,
    ``kld_mean`` and ``same_top`` (fraction) per bin.
    """
    starts = [scored_from(st["n"], score) for st in stats]
    n_pos = sum(st["n"] - s0 for st, s0 in zip(stats, starts))
    for st in stats:
        if "nll_f32_at" not in st:
            raise ValueError("chunk stats without per-position log-likelihoods (an older "
                             "result): recompute them with kvquant.flips.chunk_stats")
    nll_base = np.concatenate([st["nll_f32_at"][s0:] for st, s0 in zip(stats, starts)])
    edges = position_bins(max(st["n"] for st in stats), n_bins)
    pos = np.concatenate([np.arange(s0, st["n"]) for st, s0 in zip(stats, starts)])
    which = np.searchsorted(edges, pos, side="right") - 1
    counts = np.bincount(which, minlength=len(edges) - 1)
    chunk_n = np.array([st["n"] - s0 for st, s0 in zip(stats, starts)], dtype=np.float64)
    chunk_base = np.array([st["nll_f32_at"][s0:].sum() for st, s0 in zip(stats, starts)])
    rows = []
    for spec in pair_specs:
        per = [st["specs"][spec] for st in stats]
        kld = np.concatenate([p["kld"][s0:] for p, s0 in zip(per, starts)])
        same_at = np.concatenate([p["same_at"][s0:] for p, s0 in zip(per, starts)])
        nll = np.concatenate([p["nll_at"][s0:] for p, s0 in zip(per, starts)])
        with np.errstate(invalid="ignore"):
            bin_kld = np.bincount(which, weights=kld, minlength=counts.size) / counts
            bin_same = np.bincount(which, weights=same_at, minlength=counts.size) / counts
        row = {"codec": spec, **llama_statistics(nll, nll_base, kld, same_at)}
        row["same_top"] = {**proportion(int(same_at.sum()), n_pos), "se": row["same_top_se"]}
        if bootstrap:
            boot = chunk_bootstrap(
                [p["kld"][s0:].sum() for p, s0 in zip(per, starts)],
                [p["nll_at"][s0:].sum() for p, s0 in zip(per, starts)] - chunk_base, chunk_n)
            row["bootstrap"] = boot
        row.update({
            "text_s": float(sum(p["seconds"] for p in per)),
            "by_position": {"edges": edges, "n": counts.tolist(),
                            "kld_mean": bin_kld.tolist(), "same_top": bin_same.tolist()},
        })
        rows.append(row)
    return rows


def text_metrics(model, pair_specs, chunks, progress=None, block_rows=None, score="all"):
    """Same-top-p, KL divergence and perplexity ratio of each spec against the f32 cache, over
    ``chunks`` (a list of (start, ids), :func:`text_chunks`) in this process; see
    :func:`combine_chunks`.

    Examples
    --------
    >>> chunks = text_chunks(model.encode(text), 2048, 512, bos=model.bos_token_id)
    >>> rows = text_metrics(model, ["f32", "tq4"], chunks)
    """
    stats = []
    for ci, (_, ids) in enumerate(chunks):
        stats.append(chunk_stats(model, pair_specs, ids, block_rows=block_rows))
        if progress:
            progress(f"text chunk {ci + 1}/{len(chunks)} ({ids.size - 1} positions) done")
    return combine_chunks(pair_specs, stats, score=score)


def protocol_prompts(model_name, tokens=None, n_prompts=1):
    """The engine's prompt on the tiny model; ``n_prompts`` windows of ``PROMPT_TOKENS`` tokens
    of the text on a real one, half a stride away from the text chunks' starts."""
    if model_name == "tiny-mla":
        from kvquant.models.tiny_mla import ORACLE_PROMPT
        if n_prompts != 1:
            raise ValueError("the tiny model's protocol has one prompt (the engine's)")
        return [list(ORACLE_PROMPT)]
    stride = tokens.size // n_prompts
    return [tokens[i * stride + stride // 2:][:PROMPT_TOKENS].tolist() for i in range(n_prompts)]
