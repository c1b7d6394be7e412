"""Statistics that can decide between a codec and the f32 cache on the same items.

* accuracy with its Wilson 95% interval (:func:`kvquant.metrics.wilson_interval`; the same as
  ``scipy.stats.binomtest(k, n).proportion_ci(method="wilson")``);
* the paired table on the items both runs scored: both right, only f32 right (b), only the codec
  right (c), both wrong; the exact McNemar test, a two-sided binomial test of b against
  b + c at 1/2 (scipy's ``binomtest``);
* a paired bootstrap interval of the accuracy difference (items resampled with replacement,
  both runs together), the choice-flip rate (items whose predicted choice changes: the task's
  token flip) and the mean KL divergence between the choice distributions (softmax of the
  choices' log-likelihoods), f32 as the reference;
* the items needed to detect a difference d at the observed discordance rate p_d (two-sided
  alpha 0.05, power 0.8): n = (z_a sqrt(p_d) + z_b sqrt(p_d - d^2))^2 / d^2 (Connor 1987);
* the engine reviewer's decision rule as a verdict (docs/tasks.md).
"""
import math

import numpy as np

from kvquant.metrics import wilson_interval

__all__ = ["BOOTSTRAP_RESAMPLES", "accuracy", "choice_kld", "compare_runs", "items_needed",
           "mcnemar_exact", "paired_bootstrap", "verdict"]

BOOTSTRAP_RESAMPLES = 10000
Z_ALPHA = 1.959963984540054     # two-sided 5%
Z_BETA = 0.8416212335729143     # power 0.8


def accuracy(correct):
    """{"k", "n", "acc", "low", "high"} of a 0/1 sequence: the proportion and its Wilson 95%
    interval."""
    correct = np.asarray(correct, dtype=bool)
    n, k = int(correct.size), int(correct.sum())
    low, high = wilson_interval(k, n)
    return {"k": k, "n": n, "acc": k / n, "low": low, "high": high}


def mcnemar_exact(b, c):
    """Two-sided exact McNemar p-value of the discordant counts ``b`` (only the reference
    right) and ``c`` (only the other right): binomtest(b, b + c, 1/2); 1.0 when b + c = 0."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest
    return float(binomtest(int(b), int(b + c), 0.5).pvalue)


def paired_bootstrap(ref_correct, other_correct, n_resamples=BOOTSTRAP_RESAMPLES, seed=0,
                     level=0.95):
    """Percentile interval of mean(other) - mean(ref) over items resampled together
    (a fixed seed: the same interval on every run)."""
    a = np.asarray(ref_correct, dtype=np.float64)
    b = np.asarray(other_correct, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError("paired_bootstrap needs two equal-length, non-empty 0/1 sequences")
    diff = b - a
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    for start in range(0, n_resamples, 1000):    # bounded memory for large n
        m = min(1000, n_resamples - start)
        idx = rng.integers(0, diff.size, size=(m, diff.size))
        means[start:start + m] = diff[idx].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def choice_kld(ref_lls, other_lls):
    """KL(p_ref || p_other) of each item's choice distribution p = softmax(log-likelihoods);
    one value per item (lists of per-choice log-likelihoods, items may differ in choice
    count)."""
    out = np.empty(len(ref_lls))
    for i, (a, b) in enumerate(zip(ref_lls, other_lls)):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        la = a - a.max() - np.log(np.exp(a - a.max()).sum())
        lb = b - b.max() - np.log(np.exp(b - b.max()).sum())
        out[i] = float(np.sum(np.exp(la) * (la - lb)))
    return out


def items_needed(discordance, d, z_alpha=Z_ALPHA, z_beta=Z_BETA):
    """Items for a paired test to detect an accuracy difference ``d`` when a fraction
    ``discordance`` of items are discordant (two-sided alpha 0.05, power 0.8); None when
    d^2 > discordance (no such difference is possible at that discordance) or d = 0."""
    if d == 0 or discordance <= 0 or d * d > discordance:
        return None
    return math.ceil((z_alpha * math.sqrt(discordance)
                      + z_beta * math.sqrt(discordance - d * d)) ** 2 / (d * d))


def compare_runs(ref, other, metric="acc_norm", seed=0):
    """Paired statistics of two runs on the same items.

    Parameters
    ----------
    ref, other : list of dict
        Item results (:meth:`kvquant.tasks.scoring.ItemScorer.score`), matched by (task,
        doc_id); only items in both are compared.
    metric : {"acc", "acc_norm"}

    Returns
    -------
    dict with ``n``, ``both_right``, ``only_ref`` (b), ``only_other`` (c), ``both_wrong``,
    ``mcnemar_p``, ``diff`` (other - ref accuracy), ``diff_low``/``diff_high`` (paired
    bootstrap 95%), ``flip_rate`` (items whose predicted choice differs, with Wilson interval),
    ``choice_kld_mean``, ``discordance``, ``items_for_1pt`` (items needed to detect a 1-point
    difference at that discordance).
    """
    pred_key = "pred_norm" if metric == "acc_norm" else "pred"
    by_key = {(r["task"], r["doc_id"]): r for r in other}
    pairs = [(r, by_key[(r["task"], r["doc_id"])]) for r in ref
             if (r["task"], r["doc_id"]) in by_key]
    if not pairs:
        raise ValueError("the two runs share no items")
    a = np.array([r[pred_key] == r["gold"] for r, _ in pairs])
    b = np.array([o[pred_key] == o["gold"] for _, o in pairs])
    flips = np.array([r[pred_key] != o[pred_key] for r, o in pairs])
    n = len(pairs)
    only_ref, only_other = int(np.sum(a & ~b)), int(np.sum(~a & b))
    low, high = paired_bootstrap(a, b, seed=seed)
    flip_low, flip_high = wilson_interval(int(flips.sum()), n)
    discordance = (only_ref + only_other) / n
    return {
        "metric": metric, "n": n,
        "both_right": int(np.sum(a & b)), "only_ref": only_ref, "only_other": only_other,
        "both_wrong": int(np.sum(~a & ~b)),
        "mcnemar_p": mcnemar_exact(only_ref, only_other),
        "diff": float(b.mean() - a.mean()), "diff_low": low, "diff_high": high,
        "flip_rate": float(flips.mean()), "flip_low": flip_low, "flip_high": flip_high,
        "choice_kld_mean": float(choice_kld([r["lls"] for r, _ in pairs],
                                            [o["lls"] for _, o in pairs]).mean()),
        "discordance": discordance,
        "items_for_1pt": items_needed(discordance, 0.01),
    }


def verdict(ref_acc, other_acc, paired):
    """The engine reviewer's rule, in words: the codec's accuracy inside f32's Wilson interval
    -> "recommended opt-in"; outside it (or the paired test rejecting equality at 5% with the
    codec worse) -> "experimental". The paired test is stated beside it, with what it can and
    cannot exclude."""
    inside = ref_acc["low"] <= other_acc["acc"] <= ref_acc["high"]
    worse = paired["mcnemar_p"] < 0.05 and paired["diff"] < 0
    better = paired["mcnemar_p"] < 0.05 and paired["diff"] > 0
    if inside and not worse:
        rule = "within f32's interval: recommended opt-in"
    else:
        rule = "outside f32's interval" if not inside else "within f32's interval"
        rule += ": experimental (trades quality for KV RAM)"
    pct = 100.0
    test = (f"paired: {paired['diff'] * pct:+.1f} pts [{paired['diff_low'] * pct:+.1f}, "
            f"{paired['diff_high'] * pct:+.1f}], McNemar p={paired['mcnemar_p']:.3g}")
    if worse:
        test += " (worse than f32)"
    elif better:
        test += " (better than f32)"
    else:
        test += " (no difference detected)"
    return {"rule": rule, "paired": test, "inside_ref_interval": bool(inside),
            "paired_worse": bool(worse)}
