"""llama.cpp's KL-divergence statistics (docs/reference.md §3) against independent numpy
restatements of their definitions, on synthetic logits run through chunk_stats and
combine_chunks."""
import math

import numpy as np
import pytest
from scipy.special import log_softmax as sp_log_softmax

from kvquant import flips
from kvquant.metrics import chunk_bootstrap, llama_statistics, mean_se

VOCAB = 97


class LogitModel:
    """A stand-in model whose 'hidden rows' are fixed logits per spec: chunk_stats then sees
    exactly the logits a test chose."""

    vocab_size = VOCAB

    def __init__(self, logits_by_spec):
        self.logits_by_spec = logits_by_spec

    def new_cache(self, spec):
        return spec

    def forward_hidden(self, inputs, cache):
        return self.logits_by_spec[cache][: len(inputs)].astype(np.float32)

    def logits(self, hidden):
        return np.asarray(hidden, dtype=np.float32)


def synthetic(n, rng, noise=0.4):
    base = (2.0 * rng.standard_normal((n, VOCAB))).astype(np.float32)
    quant = (base + noise * rng.standard_normal((n, VOCAB))).astype(np.float32)
    ids = rng.integers(0, VOCAB, n + 1)
    return base, quant, ids


def reference_stats(base, quant, targets):
    """The definitions, restated with scipy/numpy from llama-perplexity's description."""
    lb = sp_log_softmax(base.astype(np.float64), axis=1)
    lq = sp_log_softmax(quant.astype(np.float64), axis=1)
    rows = np.arange(targets.size)
    nll_b, nll_q = -lb[rows, targets], -lq[rows, targets]
    kld = (np.exp(lb) * (lb - lq)).sum(axis=1)
    dp = np.exp(-nll_q) - np.exp(-nll_b)
    n = targets.size

    def se(x):  # population variance over n - 1, as the tool divides
        return np.std(x) / math.sqrt(n - 1)

    same = base.argmax(axis=1) == quant.argmax(axis=1)
    p = same.mean()
    ratio = math.exp(nll_q.mean() - nll_b.mean())
    rms = math.sqrt((dp ** 2).mean())
    return {
        "ppl": math.exp(nll_q.mean()), "ppl_se": math.exp(nll_q.mean()) * se(nll_q),
        "ppl_f32": math.exp(nll_b.mean()), "ppl_f32_se": math.exp(nll_b.mean()) * se(nll_b),
        # cov(means) / (SE SE) is Pearson's r of the per-position values
        "cor_ln_ppl": np.corrcoef(nll_q, nll_b)[0, 1],
        # SE_q^2 + SE_b^2 - 2 cov = var(nll_q - nll_b) / (n - 1)
        "mean_ln_ppl_ratio": nll_q.mean() - nll_b.mean(),
        "mean_ln_ppl_ratio_se": se(nll_q - nll_b),
        "ppl_ratio": ratio, "ppl_ratio_se": ratio * se(nll_q - nll_b),
        "kld_mean": kld.mean(), "kld_mean_se": se(kld),
        "kld_max": kld.max(), "kld_min": kld.min(), "kld_median": np.sort(kld)[n // 2]
        if n % 2 else np.sort(kld)[n // 2 - 1: n // 2 + 1].mean(),
        "dp_mean": dp.mean(), "dp_mean_se": se(dp), "dp_max": dp.max(), "dp_min": dp.min(),
        "dp_rms": rms, "dp_rms_se": 0.5 / rms * se(dp ** 2),
        "same_top_p": p, "same_top_se": math.sqrt(p * (1 - p) / (n - 1)),
        "_kld": kld, "_dp": dp,
    }


def interpolated(values, fraction):
    """The tool's percentile: linear between sorted values at fraction x (n - 1)."""
    v = np.sort(values)
    x = fraction * (v.size - 1)
    i = int(math.floor(x))
    j = min(i + 1, v.size - 1)
    return (1 - (x - i)) * v[i] + (x - i) * v[j]


@pytest.mark.parametrize("n", [300, 301])
def test_statistics_match_their_definitions(n):
    rng = np.random.default_rng(n)
    base, quant, ids = synthetic(n, rng)
    model = LogitModel({"f32": base, "q": quant})
    stats = flips.chunk_stats(model, ["f32", "q"], ids, block_rows=37)
    row = flips.combine_chunks(["f32", "q"], [stats])[1]
    ref = reference_stats(base, quant, ids[1:])
    for key, want in ref.items():
        if not key.startswith("_"):
            assert row[key] == pytest.approx(want, rel=1e-9, abs=1e-12), key
    for key, f in [("p99_9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.9), ("p10", 0.1),
                   ("p5", 0.05), ("p1", 0.01), ("p0_1", 0.001)]:
        assert row[f"kld_{key}"] == pytest.approx(interpolated(ref["_kld"], f), rel=1e-9)
    for key, f in [("p99_9", 0.999), ("p75", 0.75), ("p25", 0.25), ("p0_1", 0.001)]:
        assert row[f"dp_{key}"] == pytest.approx(interpolated(ref["_dp"], f), rel=1e-9,
                                                 abs=1e-15)
    assert row["same_top"]["se"] == row["same_top_se"]
    assert row["same_top"]["k"] == int(round(ref["same_top_p"] * n))


def test_second_half_scores_only_the_second_half_of_each_chunk():
    rng = np.random.default_rng(7)
    chunks, stats = [], []
    for n in (200, 161):
        base, quant, ids = synthetic(n, rng)
        chunks.append((base, quant, ids))
        stats.append(flips.chunk_stats(LogitModel({"f32": base, "q": quant}), ["f32", "q"], ids))
    row = flips.combine_chunks(["f32", "q"], stats, score="second-half")[1]
    base = np.concatenate([b[n // 2:] for (b, _, _), n in zip(chunks, (200, 161))])
    quant = np.concatenate([q[n // 2:] for (_, q, _), n in zip(chunks, (200, 161))])
    targets = np.concatenate([i[1:][n // 2:] for (_, _, i), n in zip(chunks, (200, 161))])
    ref = reference_stats(base, quant, targets)
    assert row["n_scored"] == 100 + 81
    for key in ("kld_mean", "kld_mean_se", "ppl_ratio", "ppl_ratio_se", "dp_rms", "cor_ln_ppl"):
        assert row[key] == pytest.approx(ref[key], rel=1e-9), key
    bins = row["by_position"]
    assert all(n == 0 for n, hi in zip(bins["n"], bins["edges"][1:]) if hi <= 80)
    assert sum(bins["n"]) == 181
    with pytest.raises(ValueError, match="score must be one of"):
        flips.combine_chunks(["f32", "q"], stats, score="half")


def test_identical_logits_give_exactly_zero_kld_and_dp_and_ratio_one():
    rng = np.random.default_rng(3)
    base, _, ids = synthetic(150, rng)
    # "copy" is not the f32 row's shortcut: its metrics are computed like any codec's
    model = LogitModel({"f32": base, "copy": base.copy()})
    stats = [flips.chunk_stats(model, ["f32", "copy"], ids, block_rows=40)]
    for row in flips.combine_chunks(["f32", "copy"], stats):
        assert row["kld_max"] == 0.0 and row["kld_mean"] == 0.0 and row["kld_min"] == 0.0
        assert row["dp_max"] == 0.0 and row["dp_min"] == 0.0 and row["dp_rms"] == 0.0
        assert row["ppl_ratio"] == 1.0 and row["mean_ln_ppl_ratio"] == 0.0
        assert row["mean_ln_ppl_ratio_se"] == 0.0 and row["same_top_p"] == 1.0
        assert row["ppl"] == row["ppl_f32"]


def test_mean_se_follows_the_tool_small_counts_and_constants():
    assert mean_se(np.arange(10.0)) == (4.5, 0.0)          # 10 values or fewer: no SE
    m, se = mean_se(np.arange(11.0))
    assert m == 5.0 and se == pytest.approx(np.std(np.arange(11.0)) / math.sqrt(10))
    assert mean_se(np.full(50, 2.0)) == (2.0, 0.0)


def test_chunk_bootstrap_pairs_chunks_and_is_seeded():
    rng = np.random.default_rng(11)
    counts = np.array([100, 120, 90, 110, 100, 95])
    kld = rng.uniform(0.5, 1.5, counts.size) * counts * 0.01
    # a constant shift of nll per position: every resample has the same ratio, exactly e^0.02
    dnll = 0.02 * counts
    a = chunk_bootstrap(kld, dnll, counts, n_resamples=999, seed=5)
    b = chunk_bootstrap(kld, dnll, counts, n_resamples=999, seed=5)
    assert a == b
    assert a["ppl_ratio"][0] == pytest.approx(math.exp(0.02), rel=1e-12)
    assert a["ppl_ratio"][1] == pytest.approx(math.exp(0.02), rel=1e-12)
    point = kld.sum() / counts.sum()
    lo, hi = a["kld_mean"]
    assert lo < point < hi
    # the bounds lie within the range of per-chunk means (a resample mixes whole chunks)
    assert (kld / counts).min() <= lo and hi <= (kld / counts).max()
    assert chunk_bootstrap(kld[:1], dnll[:1], counts[:1]) is None


def test_statistics_refuse_mismatched_arrays():
    with pytest.raises(ValueError, match="equal non-empty"):
        llama_statistics(np.ones(5), np.ones(4), np.ones(5), np.ones(5, bool))


def test_flip_tables_show_every_byte_and_the_intervals(tmp_path):
    from kvquant.models import load_model
    from kvquant_experiments import flip_files, flip_runs, flip_tables
    model = load_model("tiny-mla")
    result = flip_runs.run_flips("tiny-mla", codecs=["f32", "kv8", "tq4@sinks=1,recent=4"],
                                 model=model)
    rows = {r["codec"]: r for r in result["rows"]}
    win = rows["tq4@sinks=1,recent=4"]
    context = 32                                             # 12 prompt + 20 greedy tokens
    cache = model.new_cache("tq4@sinks=1,recent=4")
    assert win["fixed_bytes"] == cache.fixed_bytes > 0
    assert win["bytes_per_token"] == pytest.approx(cache.bytes_per_token
                                                   + cache.fixed_bytes / context)
    f32 = rows["f32"]["bytes_per_token"]
    assert win["compression"] == pytest.approx(f32 / win["bytes_per_token"])
    assert win["bits_per_value"] == pytest.approx(32 * win["bytes_per_token"] / f32)
    text = flip_tables.format_markdown(result)
    assert f"| {win['bytes_per_token']:.1f} | {cache.fixed_bytes} |" in text
    paths = flip_files.write_results(result, tmp_path)
    header = open(paths[1]).readline().strip().split(",")
    assert {"fixed_bytes", "marginal_bytes_per_token", "bits_per_value"} <= set(header)
