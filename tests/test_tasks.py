"""kvquant.tasks: prompts, tokenization, shared-context scoring and the paired statistics,
against independent references (scipy, direct sums, one forward over the whole sequence)."""
import json
import math
import os
import sys

import numpy as np
import pytest

from kvquant.tasks import (ItemScorer, accuracy, build_items, choice_predictions, compare_runs,
                           encode_pair, get_task, items_needed, jsonl_task, mcnemar_exact,
                           verdict)
from kvquant.tasks.definitions import hellaswag_preprocess
from kvquant.tasks.stats import choice_kld, paired_bootstrap

sys.path.insert(0, os.path.dirname(__file__))
from kvquant.models.random_gguf import write_random_gguf  # noqa: E402

scipy_stats = pytest.importorskip("scipy.stats")


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n", [(139, 200), (0, 10), (10, 10), (158, 200), (4321, 10042)])
def test_accuracy_interval_is_scipys_wilson(k, n):
    a = accuracy([1] * k + [0] * (n - k))
    ci = scipy_stats.binomtest(k, n).proportion_ci(method="wilson")
    assert a["k"] == k and a["n"] == n and a["acc"] == pytest.approx(k / n)
    assert a["low"] == pytest.approx(ci.low, abs=1e-12)
    assert a["high"] == pytest.approx(ci.high, abs=1e-12)


def test_wilson_reference_value():
    # docs/reference.md §3: 139/200 -> [62.8, 75.5]
    a = accuracy([1] * 139 + [0] * 61)
    assert (round(100 * a["low"], 1), round(100 * a["high"], 1)) == (62.8, 75.5)


@pytest.mark.parametrize("b,c", [(0, 0), (5, 0), (3, 9), (12, 11), (40, 25)])
def test_mcnemar_exact_is_the_two_sided_binomial_sum(b, c):
    n = b + c
    if n == 0:
        assert mcnemar_exact(b, c) == 1.0
        return
    # two-sided exact binomial at 1/2: twice the smaller tail, capped at 1
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2 ** n
    assert mcnemar_exact(b, c) == pytest.approx(min(1.0, 2 * tail), rel=1e-9)


def test_items_needed_formula():
    # n = (1.96 sqrt(p) + 0.84 sqrt(p - d^2))^2 / d^2 at p_d = 0.1, d = 0.01
    p, d = 0.1, 0.01
    expect = (1.959963984540054 * math.sqrt(p) + 0.8416212335729143 * math.sqrt(p - d * d)) ** 2
    assert items_needed(p, d) == math.ceil(expect / d ** 2)
    assert 7800 < items_needed(p, d) < 7900
    assert items_needed(0.0, 0.01) is None
    assert items_needed(1e-5, 0.01) is None      # d^2 > p_d: impossible difference


def test_paired_bootstrap_brackets_the_difference_and_is_reproducible():
    rng = np.random.default_rng(1)
    a = rng.random(400) < 0.6
    b = a.copy()
    flip = rng.choice(400, 40, replace=False)
    b[flip] = ~b[flip]
    low, high = paired_bootstrap(a, b, n_resamples=2000, seed=3)
    diff = b.mean() - a.mean()
    assert low < diff < high
    assert (low, high) == paired_bootstrap(a, b, n_resamples=2000, seed=3)
    # identical runs: no difference under any resample
    assert paired_bootstrap(a, a, n_resamples=500) == (0.0, 0.0)
    # the normal approximation of the paired difference's standard error, as a yardstick
    d = b.astype(float) - a.astype(float)
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert (high - low) == pytest.approx(2 * 1.96 * se, rel=0.2)


def test_choice_kld_is_scipys_entropy_of_the_choice_softmax():
    rng = np.random.default_rng(0)
    ref = [rng.normal(-20, 5, size=k) for k in (2, 4, 4, 3)]
    other = [r + rng.normal(0, 0.5, size=r.size) for r in ref]
    got = choice_kld(ref, other)
    for g, r, o in zip(got, ref, other):
        p = np.exp(r - r.max()); p /= p.sum()
        q = np.exp(o - o.max()); q /= q.sum()
        assert g == pytest.approx(scipy_stats.entropy(p, q), rel=1e-9, abs=1e-15)
    assert np.all(choice_kld(ref, ref) == 0)


def _runs(n, seed=0):
    rng = np.random.default_rng(seed)
    ref, other = [], []
    for i in range(n):
        lls = rng.normal(-30, 3, size=4)
        noisy = lls + rng.normal(0, 0.8, size=4)
        gold = int(rng.integers(4))
        texts = ["a" * int(k) for k in rng.integers(3, 30, size=4)]
        for out, v in ((ref, lls), (other, noisy)):
            pred, pred_norm = choice_predictions(v, texts)
            out.append({"task": "t", "doc_id": i, "gold": gold, "lls": list(v), "pred": pred,
                        "pred_norm": pred_norm})
    return ref, other


def test_compare_runs_counts_the_paired_table():
    ref, other = _runs(300)
    other = other[::-1]                     # matched by (task, doc_id), not by position
    p = compare_runs(ref, other, metric="acc")
    by = {r["doc_id"]: r for r in other}
    a = np.array([r["pred"] == r["gold"] for r in ref])
    b = np.array([by[r["doc_id"]]["pred"] == r["gold"] for r in ref])
    assert p["n"] == 300
    assert (p["both_right"], p["only_ref"], p["only_other"], p["both_wrong"]) == (
        int(np.sum(a & b)), int(np.sum(a & ~b)), int(np.sum(~a & b)), int(np.sum(~a & ~b)))
    assert p["diff"] == pytest.approx(b.mean() - a.mean())
    flips = np.mean([r["pred"] != by[r["doc_id"]]["pred"] for r in ref])
    assert p["flip_rate"] == pytest.approx(flips)
    assert p["mcnemar_p"] == pytest.approx(mcnemar_exact(p["only_ref"], p["only_other"]))
    assert p["discordance"] == pytest.approx((p["only_ref"] + p["only_other"]) / 300)
    # only the shared items are compared
    assert compare_runs(ref, other[:50], metric="acc")["n"] == 50
    with pytest.raises(ValueError, match="share no items"):
        compare_runs(ref, [dict(r, task="other") for r in other])


def test_verdict_follows_the_reviewers_rule():
    ref = accuracy([1] * 80 + [0] * 120)            # 40% [33.5, 46.9]
    same = accuracy([1] * 78 + [0] * 122)
    worse = accuracy([1] * 50 + [0] * 150)
    paired_same = {"mcnemar_p": 0.8, "diff": -0.01, "diff_low": -0.03, "diff_high": 0.01}
    paired_worse = {"mcnemar_p": 1e-4, "diff": -0.15, "diff_low": -0.2, "diff_high": -0.1}
    v = verdict(ref, same, paired_same)
    assert v["inside_ref_interval"] and "recommended opt-in" in v["rule"]
    v = verdict(ref, worse, paired_worse)
    assert not v["inside_ref_interval"] and "experimental" in v["rule"]
    assert "worse than f32" in v["paired"]
    # inside the interval yet found worse by the paired test: not recommended
    v = verdict(ref, same, dict(paired_worse, diff=-0.01))
    assert v["inside_ref_interval"] and "experimental" in v["rule"]


# --------------------------------------------------------------------------------------------
# Prompts and tokens
# --------------------------------------------------------------------------------------------
def test_hellaswag_preprocess():
    # lm-eval's clean-up: strip, " [title]" -> ". ", brackets dropped, double spaces halved once
    assert hellaswag_preprocess("  Fix a tire [title] Remove the wheel.  ") == \
        "Fix a tire. Remove the wheel."
    assert hellaswag_preprocess("a [step] b [header] c") == "a b c"
    assert hellaswag_preprocess("x    y") == "x  y"


def test_encode_pair_moves_trailing_space_and_takes_the_tail():
    # a toy encoder whose tokens merge across the boundary: words with their leading space
    def encode(text):
        import re
        return [hash(w) % 1000 for w in re.findall(r" ?\S+| +$", text)]

    ctx_ids, cont_ids = encode_pair(encode, "Question: why?\nAnswer: ", "because")
    # the trailing space moved: the continuation is " because", one token, as the whole's tail
    assert ctx_ids == encode("Question: why?\nAnswer:")
    assert cont_ids == encode(" because")
    whole = encode("Question: why?\nAnswer: because")
    assert ctx_ids + cont_ids == whole
    with pytest.raises(ValueError, match="non-empty context"):
        encode_pair(encode, "", "x")


def test_jsonl_task_reads_checks_and_builds(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"context": "2 + 2 =", "choices": ["4", "5"], "gold": 0},
            {"context": "Sky is", "choices": ["blue", "green", "red"], "gold": 0, "id": "x"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = build_items(str(path))
    assert [it.doc_id for it in items] == [0, 1]
    assert items[1].contexts == ("Sky is",) * 3
    assert items[1].continuations == (" blue", " green", " red")
    assert items[1].choice_texts == ("blue", "green", "red")
    assert get_task(str(path)).metrics == ("acc", "acc_norm")
    assert len(build_items(str(path), limit=1)) == 1

    for bad, message in [
        ('{"context": "a", "choices": ["x"], "gold": 0}', "line 1: choices must be a list of "
                                                          "at least 2"),
        ('{"context": "a", "choices": ["x", "y"], "gold": 2}', "line 1: gold must be"),
        ('{"context": "a", "choices": ["x", "y"], "gold": true}', "line 1: gold must be"),
        ('{"context": "", "choices": ["x", "y"], "gold": 0}', "context must be a non-empty"),
        ('{"choices": ["x", "y"], "gold": 0}', "missing context"),
        ('{"context": "a", "choices": ["x", "y"], "gold": 0}\n[1, 2]', "line 2: expected a JSON"),
        ('{"context": "a", ', "line 1: not valid JSON"),
    ]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            jsonl_task(str(path))
    path.write_text("")
    with pytest.raises(ValueError, match="no items"):
        jsonl_task(str(path))
    with pytest.raises(FileNotFoundError, match="no task file"):
        jsonl_task(str(tmp_path / "absent.jsonl"))


def test_unknown_task_and_fewshot_without_a_split():
    with pytest.raises(ValueError, match="unknown task 'hellaswg'"):
        get_task("hellaswg")
    with pytest.raises(ValueError, match="no few-shot split"):
        build_items("hellaswag", limit=1, num_fewshot=1)


# --------------------------------------------------------------------------------------------
# Scoring on a small random-weight GGUF model
# --------------------------------------------------------------------------------------------
def _random_model(tmp_path_factory, entry):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from kvquant.models import load_model
    path = tmp_path_factory.mktemp("tasks") / f"{entry}.gguf"
    write_random_gguf(path, entry, seed=5)
    return load_model(str(path))


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return _random_model(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """head_dim 128: llama.cpp's block types (32 values a block) fit it."""
    return _random_model(tmp_path_factory, "qwen3")


def _items(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"context": "the cat sat", "choices": ["on mat", "in a hat", "up"], "gold": 0},
            {"context": "one two ", "choices": ["three", "four five"], "gold": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return build_items(str(path))


def _whole_forward_lls(model, item):
    """Each choice's log-likelihood from one f32 forward over context + continuation."""
    out = []
    for ctx, cont in zip(item.contexts, item.continuations):
        ctx_ids, cont_ids = encode_pair(model.encode, ctx, cont)
        ids = np.array(ctx_ids + cont_ids, np.int64)
        logits = model.forward(ids[:-1], model.new_cache("f32")).astype(np.float64)
        logp = logits - logits.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        rows = logp[len(ctx_ids) - 1:]
        out.append(float(rows[np.arange(len(cont_ids)), cont_ids].sum()))
    return out


def test_shared_context_f32_equals_one_forward(small_model, tmp_path):
    for item in _items(tmp_path):
        got = ItemScorer(small_model, "f32").score(item)
        want = _whole_forward_lls(small_model, item)
        np.testing.assert_allclose(got["lls"], want, rtol=0, atol=2e-4)
        assert got["pred"] == int(np.argmax(want))
        assert got["gold"] == item.gold
        assert len(set(got["context_tokens"])) == 1


@pytest.mark.parametrize("spec,model", [("tq4", "small"), ("kv8/polar4", "small"),
                                        ("polar3@center,sinks=1,recent=4", "small"),
                                        ("ggml:q4_0/q8_0", "wide")])
def test_reused_cache_equals_a_fresh_cache_per_choice(request, tmp_path, spec, model):
    """Cutting the cache back to the context gives back exactly the context's cache: the
    lls with one reused cache equal those with a new cache per choice, bit for bit."""
    small_model = request.getfixturevalue(f"{model}_model")
    items = _items(tmp_path)
    scorer = ItemScorer(small_model, spec)
    reused = [scorer.score(it)["lls"] for it in items]      # one cache for every item
    for item, lls in zip(items, reused):
        fresh = []
        for ctx, cont in zip(item.contexts, item.continuations):
            fresh.append(ItemScorer(small_model, spec).loglikelihoods([(ctx, cont)])[0][0])
        assert lls == fresh
    # and the codec does change them (the cache is really quantized)
    f32 = [ItemScorer(small_model, "f32").score(it)["lls"] for it in items]
    assert f32 != reused


def test_context_longer_than_the_model_is_refused(small_model):
    scorer = ItemScorer(small_model, "f32")
    with pytest.raises(ValueError, match="exceed the model's trained context"):
        scorer.loglikelihoods([("word " * 80, " end")])


@pytest.mark.parametrize("spec,model", [("f32", "small"), ("tq4", "small"),
                                        ("kv8/polar4@center", "small"),
                                        ("ggml:q8_0/q4_0", "wide")])
def test_items_run_together_equal_items_run_alone(request, tmp_path, spec, model):
    """score_many runs every item's sequences through the weights at once: each sequence's
    cache is written and read as alone, so the lls agree with score() to float rounding (a
    rounding can move a quantized element by one step: up to 5e-5 of the ll on this random
    model, whose lls reach -250) and the predictions are
    the same."""
    m = request.getfixturevalue(f"{model}_model")
    path = tmp_path / "w.jsonl"
    rows = [{"context": "the cat sat", "choices": ["on mat", "in a hat", "up"], "gold": 0},
            {"context": "one two ", "choices": ["three", "four five"], "gold": 1},
            {"context": "a b c", "choices": ["d", "e f g h"], "gold": 0}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    items = build_items(str(path))
    # a winogrande-like item: one context per choice, a shared continuation
    from kvquant.tasks.requests import Item
    items.append(Item("w", 9, ("Sarah was so Sarah", "Sarah was so Maria"), (" won", " won"), 1,
                      ("Sarah was so Sarah", "Sarah was so Maria")))
    alone = [ItemScorer(m, spec).score(it) for it in items]
    scorer = ItemScorer(m, spec)
    together = scorer.score_many(items)
    again = scorer.score_many(items[::-1])[::-1]     # pooled caches reused in another order
    for a, t, g in zip(alone, together, again):
        np.testing.assert_allclose(t["lls"], a["lls"], rtol=5e-5, atol=1e-4)
        assert t["lls"] == g["lls"]
        assert (t["pred"], t["pred_norm"], t["greedy"], t["context_tokens"],
                t["choice_tokens"]) == (a["pred"], a["pred_norm"], a["greedy"],
                                        a["context_tokens"], a["choice_tokens"])
