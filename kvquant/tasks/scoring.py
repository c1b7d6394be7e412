"""Score multiple-choice items on a model whose KV cache goes through a codec.

A context is run once into the model's cache (every K and V row encoded before attention reads
it, the prompt's prefill included), and that cache is reused for each choice: the choice's
tokens run after it, then the cache is cut back to the context (as a serving engine reuses a
shared prefix). The log-likelihood of a choice is the sum over its tokens of log p(token | what
precedes), the first token predicted by the context's last position, exactly the positions
lm-eval scores when it runs context + continuation in one forward. On an f32 cache this is
lm-eval's number to float rounding.

Two things differ from one forward over context + continuation, by design: a codec state set on
the first append (``@center`` offsets, channel scales) is taken from the context alone, and the
continuation's rows are encoded after the context's, as a decode would write them.

The model is anything with kvquant's model contract (:mod:`kvquant.models`): ``encode``,
``new_cache(spec)``, ``forward(tokens, cache)``, ``context_length``; the numpy GGUF decoders and
:class:`kvquant.hf.HFModel` both have it.
"""
import time

import numpy as np

from kvquant.specs import parse_cache_spec
from kvquant.tasks.requests import encode_pair

__all__ = ["ItemScorer", "choice_predictions", "score_items"]


def _log_softmax_rows(logits):
    """float64 log-probabilities of each row."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def _rewind(cache, length):
    """Cut a cache back to its first ``length`` tokens (kvquant caches: truncate; a
    transformers cache: crop by a negative count)."""
    if hasattr(cache, "truncate"):
        cache.truncate(length)
        return
    held = cache.get_seq_length()
    if held > length:
        cache.crop(length - held)


def _cache_length(cache):
    return len(cache) if hasattr(cache, "truncate") else int(cache.get_seq_length())


def choice_predictions(lls, choice_texts):
    """(pred, pred_norm) as lm-eval: argmax of the log-likelihoods, and of the log-likelihoods
    per character of each choice text (the first index on a tie, as numpy's argmax)."""
    lls = np.asarray(lls, dtype=np.float64)
    lengths = np.array([float(len(c)) for c in choice_texts])
    return int(np.argmax(lls)), int(np.argmax(lls / lengths))


class ItemScorer:
    """Scores items on ``model`` with caches of ``cache_spec``.

    Parameters
    ----------
    model : a kvquant model (``kvquant.models.load_model`` or ``kvquant.hf.HFModel``)
    cache_spec : str or CacheSpec
        A cache spec (:mod:`kvquant.specs`): ``"f32"``, ``"tq4"``, ``"kv8/tq4"``, a stream spec
        with options, a plan file, ``"ggml:q8_0/q8_0"`` (llama.cpp's cache types and attention).
    """

    def __init__(self, model, cache_spec="f32"):
        self.model = model
        self.cache_spec = parse_cache_spec(cache_spec)   # parsed once for every cache it makes
        self.cache = model.new_cache(self.cache_spec)
        self._pool = []          # caches of score_many, one per context of a batch
        self.tokens_run = 0      # tokens run through the model (contexts + choices)
        self.seconds = 0.0

    def _check_length(self, where, n_ctx, n_cont):
        limit = getattr(self.model, "context_length", None)
        if limit and n_ctx + n_cont > limit:
            raise ValueError(f"{where}: {n_ctx} context + {n_cont} "
                             f"choice tokens exceed the model's trained context of {limit} "
                             "(lm-eval would cut the context's left end; refused here)")

    def loglikelihoods(self, pairs, where="request"):
        """Log-likelihood of each (context, continuation) pair, each distinct context run once.

        Returns
        -------
        list of (ll, greedy, context_tokens, continuation_tokens), in the order of ``pairs``
        """
        t0 = time.perf_counter()
        out = [None] * len(pairs)
        encode = self.model.encode
        by_context = {}
        for i, (ctx, cont) in enumerate(pairs):
            by_context.setdefault(ctx, []).append((i, cont))
        for ctx, choices in by_context.items():
            encoded = [(i, *encode_pair(encode, ctx, cont)) for i, cont in choices]
            # every pair of a context shares the context's ids (the context is encoded alone)
            ctx_ids = encoded[0][1]
            for i, _, cont_ids in encoded:
                if not cont_ids:
                    raise ValueError(f"{where}: continuation {i} encodes to no tokens after its "
                                     "context")
                self._check_length(where, len(ctx_ids), len(cont_ids))
            _rewind(self.cache, 0)
            last = _log_softmax_rows(self.model.forward(np.asarray(ctx_ids, np.int64), self.cache,
                                                        last_only=True))[0]
            self.tokens_run += len(ctx_ids)
            held = _cache_length(self.cache)
            for i, _, cont_ids in encoded:
                rows = [last]
                if len(cont_ids) > 1:
                    logits = self.model.forward(np.asarray(cont_ids[:-1], np.int64), self.cache)
                    rows.extend(_log_softmax_rows(logits))
                    self.tokens_run += len(cont_ids) - 1
                    _rewind(self.cache, held)
                logp = np.stack(rows)
                ll = float(logp[np.arange(len(cont_ids)), cont_ids].sum())
                greedy = bool(np.all(logp.argmax(axis=1) == np.asarray(cont_ids)))
                out[i] = (ll, greedy, len(ctx_ids), len(cont_ids))
        self.seconds += time.perf_counter() - t0
        return out

    def score(self, item):
        """Score one :class:`~kvquant.tasks.requests.Item`.

        Returns
        -------
        dict
            ``task``, ``doc_id``, ``gold``, ``lls`` (log-likelihood of each choice),
            ``greedy`` (whether each choice is the greedy continuation), ``pred``,
            ``pred_norm``, ``context_tokens`` (per choice), ``choice_tokens`` (per choice).
        """
        scored = self.loglikelihoods(list(zip(item.contexts, item.continuations)),
                                     where=f"{item.task} document {item.doc_id}")
        return _item_result(item, scored)

    def score_many(self, items):
        """Score several items, their sequences run together where the model can
        (``forward_sequences``: the weights read once for all of them); the same results as
        :meth:`score` of each to float rounding (the products' row counts differ)."""
        if not hasattr(self.model, "forward_sequences") or not hasattr(self.cache, "truncate"):
            return [self.score(it) for it in items]
        t0 = time.perf_counter()
        encode = self.model.encode
        groups = []     # (item index, context ids, [(pair index, continuation ids)])
        for n, item in enumerate(items):
            by_context = {}
            for i, (ctx, cont) in enumerate(zip(item.contexts, item.continuations)):
                by_context.setdefault(ctx, []).append((i, cont))
            where = f"{item.task} document {item.doc_id}"
            for ctx, pairs in by_context.items():
                encoded = [(i, *encode_pair(encode, ctx, cont)) for i, cont in pairs]
                for i, ctx_ids, cont_ids in encoded:
                    if not cont_ids:
                        raise ValueError(f"{where}: continuation {i} encodes to no tokens after "
                                         "its context")
                    self._check_length(where, len(ctx_ids), len(cont_ids))
                groups.append((n, encoded[0][1], [(i, c) for i, _, c in encoded]))
        while len(self._pool) < len(groups):
            self._pool.append(self.model.new_cache(self.cache_spec))
        caches = self._pool[:len(groups)]
        for cache in caches:
            cache.truncate(0)
        # the contexts, together; the last row of each predicts its choices' first token
        hidden = self.model.forward_sequences(
            [(c, np.asarray(g[1], np.int64)) for c, g in zip(caches, groups)])
        ends = np.cumsum([len(g[1]) for g in groups]) - 1
        self.tokens_run += int(ends[-1] + 1)
        last = _log_softmax_rows(self.model.logits(hidden[ends]))
        held = [len(c) for c in caches]
        scored = [[None] * len(it.contexts) for it in items]
        rounds = max(len(g[2]) for g in groups)
        for r in range(rounds):
            picks = {}   # group -> (logp of each choice token, whether it is the argmax)
            runs = []
            for gi, g in enumerate(groups):
                if r < len(g[2]):
                    cont = g[2][r][1]
                    picks[gi] = ([last[gi, cont[0]]], [last[gi].argmax() == cont[0]])
                    if len(cont) > 1:
                        runs.append((gi, cont))
            if runs:
                hidden = self.model.forward_sequences(
                    [(caches[gi], np.asarray(cont[:-1], np.int64)) for gi, cont in runs])
                targets = np.concatenate([cont[1:] for _, cont in runs])
                logp, top = self._target_logp(hidden, targets)
                self.tokens_run += int(targets.size)
                a = 0
                for gi, cont in runs:
                    b = a + len(cont) - 1
                    picks[gi][0].extend(logp[a:b])
                    picks[gi][1].extend(top[a:b])
                    caches[gi].truncate(held[gi])
                    a = b
            for gi, (lp, top) in picks.items():
                n, ctx_ids, pairs = groups[gi]
                i, cont = pairs[r]
                scored[n][i] = (float(np.sum(lp)), bool(np.all(top)), len(ctx_ids), len(cont))
        self.seconds += time.perf_counter() - t0
        return [_item_result(it, sc) for it, sc in zip(items, scored)]

    def _target_logp(self, hidden, targets, block=64):
        """log p(target) of each row of final hidden states, and whether the target is the
        row's argmax; logits a block of rows at a time (a vocabulary of 262k makes one
        (rows, vocab) array large)."""
        logp = np.empty(len(targets))
        top = np.empty(len(targets), bool)
        for a in range(0, len(targets), block):
            rows = _log_softmax_rows(self.model.logits(hidden[a:a + block]))
            t = targets[a:a + block]
            logp[a:a + block] = rows[np.arange(len(t)), t]
            top[a:a + block] = rows.argmax(axis=1) == t
        return logp, top


def _item_result(item, scored):
    """An item's result from its pairs' (ll, greedy, context tokens, continuation tokens)."""
    lls = [s[0] for s in scored]
    pred, pred_norm = choice_predictions(lls, item.choice_texts)
    return {"task": item.task, "doc_id": item.doc_id, "gold": item.gold, "lls": lls,
            "greedy": [s[1] for s in scored], "pred": pred, "pred_norm": pred_norm,
            "context_tokens": [s[2] for s in scored],
            "choice_tokens": [s[3] for s in scored]}


def score_items(model, items, cache_spec="f32", progress=None, batch=16):
    """Score ``items`` with one :class:`ItemScorer`, ``batch`` items run together
    (:meth:`ItemScorer.score_many`); ``progress(n_done)`` is called after each batch. Returns
    the list of item results (:meth:`ItemScorer.score`)."""
    scorer = ItemScorer(model, cache_spec)
    out = []
    for a in range(0, len(items), batch):
        out.extend(scorer.score_many(items[a:a + batch]))
        if progress is not None:
            progress(len(out))
    return out
