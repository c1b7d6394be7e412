"""Error and agreement measures shared by the command line, the experiments and the tests."""
import math

import numpy as np


def relative_l2(X, X_hat):
    """Per-row |x - x^| / |x| (float64); rows of zero norm give 0 when x^ is zero too, else inf."""
    X = np.asarray(X, dtype=np.float64)
    X_hat = np.asarray(X_hat, dtype=np.float64)
    err = np.linalg.norm(X - X_hat, axis=1)
    norm = np.linalg.norm(X, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = err / norm
    return np.where(norm > 0, rel, np.where(err > 0, np.inf, 0.0))


def measure_distortion(codec, X, n_threads=None):
    """Encode and decode rows with ``codec``; return the row of a distortion table.

    Returns
    -------
    dict with codec, dim, bits_per_value, bytes_per_row, compression, rel_l2_mean, rel_l2_max,
    rel_mse (sum of squared errors over sum of squares).
    """
    X = np.asarray(X)
    X_hat = codec.roundtrip(X, n_threads=n_threads)
    rel = relative_l2(X, X_hat)
    X64 = X.astype(np.float64)
    rel_mse = float(((X64 - X_hat) ** 2).sum() / (X64**2).sum())
    return {
        "codec": codec.spec,
        "dim": codec.dim,
        "bits_per_value": codec.bits_per_value,
        "bytes_per_row": codec.bytes_per_row,
        "compression": codec.compression_ratio,
        "rel_l2_mean": float(rel.mean()),
        "rel_l2_max": float(rel.max()),
        "rel_mse": rel_mse,
    }


def measure_stream_distortion(stream_spec, X, n_threads=None):
    """:func:`measure_distortion` for a stream spec with options (``"tq4@center,sinks=1"``):
    the rows are appended to one :class:`~kvquant.streams.RowStream` in a single call (the first
    append is the whole of X, so its mean and spread set the offset and scales) and read back.
    Bytes per row include the stream's fixed bytes spread over the rows."""
    from kvquant.streams import RowStream, StreamSpec
    X = np.asarray(X)
    spec = StreamSpec.of(stream_spec)
    codec = spec.codec(X.shape[1] if X.ndim == 2 else -1)
    stream = RowStream(codec, capacity=X.shape[0], **spec.options.as_dict())
    stream.append(X, n_threads)
    X_hat = stream.decode(n_threads=n_threads)
    rel = relative_l2(X, X_hat)
    X64 = X.astype(np.float64)
    bytes_per_row = stream.nbytes / max(X.shape[0], 1)
    return {
        "codec": stream.spec,
        "dim": codec.dim,
        "bits_per_value": 8.0 * bytes_per_row / codec.dim,
        "bytes_per_row": round(bytes_per_row, 2),
        "compression": 4.0 * codec.dim / bytes_per_row,
        "rel_l2_mean": float(rel.mean()),
        "rel_l2_max": float(rel.max()),
        "rel_mse": float(((X64 - X_hat) ** 2).sum() / (X64**2).sum()),
    }


def wilson_interval(successes, n, z=1.959963984540054):
    """Wilson score interval of a proportion (95% by default), as (low, high) in [0, 1]."""
    if n <= 0:
        raise ValueError(f"a proportion needs n > 0 trials, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must lie in 0..n={n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


# --------------------------------------------------------------------------------------------
# llama.cpp's KL-divergence statistics (docs/reference.md §3)
# --------------------------------------------------------------------------------------------
# Percentiles llama-perplexity prints, as (key suffix, fraction); the median is its own key.
KLD_PERCENTILES = (("p99_9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90),
                   ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p0_1", 0.001))
DP_PERCENTILES = (("p99_9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90),
                  ("p75", 0.75), ("p25", 0.25), ("p10", 0.10), ("p5", 0.05), ("p1", 0.01),
                  ("p0_1", 0.001))

# Display names (llama-perplexity's) of the statistics: (name, value key, standard-error key).
LLAMA_STATISTICS = [
    ("Mean PPL(Q)", "ppl", "ppl_se"),
    ("Mean PPL(base)", "ppl_f32", "ppl_f32_se"),
    ("Cor(ln PPL(Q), ln PPL(base))", "cor_ln_ppl", None),
    ("Mean ln(PPL(Q)/PPL(base))", "mean_ln_ppl_ratio", "mean_ln_ppl_ratio_se"),
    ("Mean PPL(Q)/PPL(base)", "ppl_ratio", "ppl_ratio_se"),
    ("Mean PPL(Q)-PPL(base)", "ppl_diff", "ppl_diff_se"),
    ("Mean KLD", "kld_mean", "kld_mean_se"),
    ("Maximum KLD", "kld_max", None),
    *[(f"{100 * f:g}% KLD", f"kld_{k}", None) for k, f in KLD_PERCENTILES[:4]],
    ("Median KLD", "kld_median", None),
    *[(f"{100 * f:g}% KLD", f"kld_{k}", None) for k, f in KLD_PERCENTILES[4:]],
    ("Minimum KLD", "kld_min", None),
    ("Mean Δp", "dp_mean", "dp_mean_se"),
    ("Maximum Δp", "dp_max", None),
    *[(f"{100 * f:g}% Δp", f"dp_{k}", None) for k, f in DP_PERCENTILES[:5]],
    ("Median Δp", "dp_median", None),
    *[(f"{100 * f:g}% Δp", f"dp_{k}", None) for k, f in DP_PERCENTILES[5:]],
    ("Minimum Δp", "dp_min", None),
    ("RMS Δp", "dp_rms", "dp_rms_se"),
    ("Same top p", "same_top_p", "same_top_se"),
]


def mean_se(x):
    """(mean, standard error) as llama-perplexity forms them: SE = sqrt(var / (n - 1)) with
    var = mean(x^2) - mean(x)^2; 0 when that variance is not positive or n <= 10."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n < 1:
        return 0.0, 0.0
    m = float(x.mean())
    var = float((x * x).mean()) - m * m
    return m, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def _cov_of_means(a, b):
    """Covariance of the two means, (mean(ab) - mean(a) mean(b)) / (n - 1); 0 under 10 values."""
    n = a.size
    if n < 10:
        return 0.0
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (n - 1)


def llama_statistics(nll, nll_base, kld, same_top):
    """llama.cpp's ``llama-perplexity --kl-divergence`` statistic set over scored positions.

    Parameters
    ----------
    nll, nll_base : ndarray, shape (n,)
        -ln p(target) under the quantized run (Q) and the base (f32) run.
    kld : ndarray, shape (n,)
        KL(p_base || p_Q) per position.
    same_top : ndarray of bool, shape (n,)
        Whether the two argmaxes agree.

    Returns
    -------
    dict with the keys of :data:`LLAMA_STATISTICS` (values and standard errors; Δp and its
    percentiles as fractions, not percent). The standard errors treat positions as independent,
    as llama.cpp does (positions of one chunk share a context: they are nominal).
    """
    nll = np.asarray(nll, dtype=np.float64)
    nll_base = np.asarray(nll_base, dtype=np.float64)
    kld = np.asarray(kld, dtype=np.float64)
    same_top = np.asarray(same_top, dtype=bool)
    n = nll.size
    if not (nll_base.size == kld.size == same_top.size == n) or n < 1:
        raise ValueError(f"statistics need equal non-empty per-position arrays, got sizes "
                         f"{nll.size}, {nll_base.size}, {kld.size}, {same_top.size}")
    out = {"n_scored": int(n)}
    lq, lq_se = mean_se(nll)
    lb, lb_se = mean_se(nll_base)
    cov = _cov_of_means(nll, nll_base)
    out["ppl"], out["ppl_se"] = math.exp(lq), math.exp(lq) * lq_se
    out["ppl_f32"], out["ppl_f32_se"] = math.exp(lb), math.exp(lb) * lb_se
    out["cor_ln_ppl"] = cov / (lq_se * lb_se) if lq_se > 0 and lb_se > 0 else None
    ln_ratio = lq - lb
    ln_ratio_se = math.sqrt(max(lq_se ** 2 + lb_se ** 2 - 2.0 * cov, 0.0))
    out["mean_ln_ppl_ratio"], out["mean_ln_ppl_ratio_se"] = ln_ratio, ln_ratio_se
    out["ppl_ratio"] = math.exp(ln_ratio)
    out["ppl_ratio_se"] = out["ppl_ratio"] * ln_ratio_se
    out["ppl_diff"] = out["ppl"] - out["ppl_f32"]
    out["ppl_diff_se"] = math.sqrt(max(out["ppl_se"] ** 2 + out["ppl_f32_se"] ** 2
                                       - 2.0 * out["ppl"] * out["ppl_f32"] * cov, 0.0))
    out["kld_mean"], out["kld_mean_se"] = mean_se(kld)
    out["kld_max"], out["kld_min"] = float(kld.max()), float(kld.min())
    out["kld_median"] = float(np.median(kld))
    for key, f in KLD_PERCENTILES:   # linear between order statistics, at f x (n - 1)
        out[f"kld_{key}"] = float(np.quantile(kld, f))
    dp = np.exp(-nll) - np.exp(-nll_base)
    out["dp_mean"], out["dp_mean_se"] = mean_se(dp)
    out["dp_max"], out["dp_min"] = float(dp.max()), float(dp.min())
    out["dp_median"] = float(np.median(dp))
    for key, f in DP_PERCENTILES:
        out[f"dp_{key}"] = float(np.quantile(dp, f))
    msq, msq_se = mean_se(dp * dp)
    out["dp_rms"] = math.sqrt(msq)
    out["dp_rms_se"] = 0.5 / out["dp_rms"] * msq_se if out["dp_rms"] > 0 else 0.0
    p = float(same_top.mean())
    out["same_top_p"] = p
    out["same_top_se"] = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0
    return out


BOOTSTRAP_RESAMPLES = 9999
BOOTSTRAP_SEED = 20240


def chunk_bootstrap(kld_sums, dnll_sums, counts, n_resamples=BOOTSTRAP_RESAMPLES,
                    seed=BOOTSTRAP_SEED, level=0.95):
    """Paired bootstrap intervals over chunks for the mean KLD and the PPL ratio.

    Positions of one chunk share a context, so the chunk is the unit that is resampled: a
    resample draws chunks with replacement, each bringing its KLD sum, its sum of
    nll(Q) - nll(base) (Q and base paired within the chunk) and its count; the statistics are
    sum(KLD) / sum(count) and exp(sum(dnll) / sum(count)). ``scipy.stats.bootstrap``, percentile
    method (steadier than BCa with few chunks), seeded; both intervals use the same resamples.

    Returns
    -------
    dict ``{"kld_mean": (lo, hi), "ppl_ratio": (lo, hi), "n_chunks", "method"}``, or None
    with fewer than 2 chunks.
    """
    import warnings

    from scipy import stats
    kld_sums, dnll_sums, counts = (np.asarray(a, dtype=np.float64)
                                   for a in (kld_sums, dnll_sums, counts))
    k = counts.size
    if k < 2:
        return None

    def kld_stat(ks, ds, ns, axis=-1):
        return ks.sum(axis=axis) / ns.sum(axis=axis)

    def ratio_stat(ks, ds, ns, axis=-1):
        return np.exp(ds.sum(axis=axis) / ns.sum(axis=axis))

    out = {"n_chunks": int(k), "method": f"paired bootstrap over {k} chunks (percentile, "
                                         f"{n_resamples} resamples, seed {seed})",
           "level": level}
    for key, stat in (("kld_mean", kld_stat), ("ppl_ratio", ratio_stat)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # identical chunks: a degenerate, exact interval
            res = stats.bootstrap((kld_sums, dnll_sums, counts), stat, paired=True,
                                  vectorized=True, n_resamples=n_resamples,
                                  confidence_level=level, method="percentile",
                                  random_state=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        point = float(stat(kld_sums, dnll_sums, counts))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo = hi = point
        out[key] = (lo, hi)
    return out
