"""A flip table as markdown: sizes with every byte, agreement with Wilson intervals and the text
metrics with llama.cpp's standard errors and bootstrap intervals (:func:`format_markdown`), and
llama.cpp's whole statistic set under its names (:func:`format_llama_tables`)."""
from kvquant_experiments.flip_storage import add_storage, storage_context

__all__ = ["format_llama_tables", "format_markdown", "intervals_note"]


def _frac(p):
    return f"{p['k']}/{p['n']} [{100 * p['lo']:.0f}, {100 * p['hi']:.0f}]"


def _pct(p):
    return f"{100 * p['p']:.2f} [{100 * p['lo']:.2f}, {100 * p['hi']:.2f}]"


def _streams(row):
    from kvquant.models.plan import CachePlan
    from kvquant.specs import parse_cache_spec
    if isinstance(parse_cache_spec(row["codec"]), CachePlan):   # specs by layer: its file
        return "plan " + row["codec"]
    (na, a), (nb, b) = row["streams"].items()
    return a if a == b else f"{na.upper()} {a} / {nb.upper()} {b}"


def _pm(r, key, se_key, fmt="{:.3e}", scale=1.0):
    v = r.get(key)
    if v is None:
        return "-"
    cell = fmt.format(scale * v)
    se = r.get(se_key) if se_key else None
    return cell + (" ± " + fmt.format(scale * se) if se is not None else "")


def _boot(r, key, fmt="{:.3e}"):
    b = (r.get("bootstrap") or {}).get(key)
    return f" [{fmt.format(b[0])}, {fmt.format(b[1])}]" if b else ""


def intervals_note(result):
    """What the brackets and ± of the tables are."""
    rows = result["rows"]
    boot = next((r["bootstrap"] for r in rows if r.get("bootstrap")), None)
    note = ("±: llama.cpp's standard error (positions taken as independent, so nominal: "
            "positions of a chunk share a context); ")
    if boot:
        note += (f"[lo, hi] after mean KLD and PPL ratio: {100 * boot['level']:.0f}% "
                 f"{boot['method']}; ")
    else:
        note += "no bootstrap interval (one chunk); "
    return note + "same top: Wilson 95% interval (percent)."


def format_markdown(result, llama=True):
    """The table as markdown: sizes with every byte (fixed bytes of stream options spread over
    the context), agreement with Wilson 95% intervals (percent), and with text the mean KLD and
    PPL ratio with llama.cpp's standard error and the bootstrap interval over chunks; with
    ``llama``, llama.cpp's whole statistic set in two more tables."""
    meta, rows = result["meta"], result["rows"]
    add_storage(rows, meta)
    has_text = "text" in meta
    lines = []
    proto = meta["protocol"]
    head = (f"Model {meta['model']['model']}; engine protocol: {proto['prompts']} prompt(s) of "
            f"{proto['prompt_tokens']} tokens + {proto['new_tokens']} greedy tokens")
    if has_text:
        t = meta["text"]
        scored = ("the second half of each chunk scored, as llama-perplexity"
                  if t.get("score") == "second-half" else "every position scored")
        head += (f"; real text: {t['positions']} positions of {t['source']} in chunks of "
                 f"{t['chunk_tokens']} tokens ({scored})")
    lines.append(head + f". Attention: {meta['model']['attention']}.")
    lines.append("")
    context = storage_context(meta)
    cols = ["codec", "B/token", "fixed B", "bits/value", "ratio", "TF agree", "greedy agree",
            "TF KLD"]
    if has_text:
        cols += ["same top % [95% CI]", "mean KLD ± SE [bootstrap]", "p99 KLD",
                 "PPL ratio ± SE [bootstrap]", "text s"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        cells = [_streams(r), f"{r['bytes_per_token']:.1f}", str(r["fixed_bytes"]),
                 f"{r['bits_per_value']:.2f}", f"{r['compression']:.2f}",
                 _frac(r["tf"]), _frac(r["greedy"]), f"{r['tf_kld_mean']:.2e}"]
        if has_text:
            cells += [_pct(r["same_top"]),
                      _pm(r, "kld_mean", "kld_mean_se") + _boot(r, "kld_mean"),
                      f"{r['kld_p99']:.2e}",
                      _pm(r, "ppl_ratio", "ppl_ratio_se", "{:.4f}") + _boot(r, "ppl_ratio",
                                                                             "{:.4f}"),
                      f"{r['text_s']:.1f}" if "text_s" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    decoded = [f"{r['codec']} ({', '.join(r['decoded_streams'])})" for r in rows
               if r.get("decoded_streams")]
    if decoded:
        lines.append("")
        lines.append("Read as decoded rows (the codec has no compressed-domain consumer: "
                     "attention decodes, then multiplies in float32): " + "; ".join(decoded)
                     + ".")
    lines.append("")
    lines.append(f"B/token: every stored byte per token of a {context}-token context: each token's "
                 "codes and side values, plus the fixed bytes of stream options (fixed B: f32 "
                 "sink rows, recent-window copies, offsets and scales, per cache) spread over "
                 f"the {context} tokens; bits/value and ratio (against f32) from it.")
    if has_text:
        lines.append("")
        lines.append(f"PPL(f32) = {rows[0]['ppl_f32']:.3f}. " + intervals_note(result)
                     + " text s: seconds of the codec's prefills and metrics, summed over "
                     "chunks (the f32 reference's prefill not included).")
        if llama and "ppl_se" in rows[0]:
            lines += ["", *format_llama_tables(result)]
    return "\n".join(lines)


def format_llama_tables(result):
    """llama.cpp's ``--kl-divergence`` statistics under its names (Δp in percent, as it prints
    them): one table of means and KLD percentiles, one of Δp percentiles."""
    from kvquant.metrics import DP_PERCENTILES, KLD_PERCENTILES
    rows = [r for r in result["rows"] if "ppl_se" in r]
    lines = ["llama.cpp's statistics (`llama-perplexity --kl-divergence`, same definitions; "
             "± its standard error):", ""]
    cols = ["codec", "Mean PPL(Q)", "Mean PPL(base)", "Cor(ln PPL(Q), ln PPL(base))",
            "Mean ln(PPL(Q)/PPL(base))", "Mean PPL(Q)/PPL(base)", "Mean KLD",
            "Maximum KLD"] + [f"{100 * f:g}% KLD" for _, f in KLD_PERCENTILES[:4]] + [
            "Median KLD"] + [f"{100 * f:g}% KLD" for _, f in KLD_PERCENTILES[4:]] + [
            "Minimum KLD", "Mean Δp", "RMS Δp", "Same top p"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cor = r.get("cor_ln_ppl")
        cells = [_streams(r), _pm(r, "ppl", "ppl_se", "{:.4f}"),
                 _pm(r, "ppl_f32", "ppl_f32_se", "{:.4f}"),
                 f"{100 * cor:.2f}%" if cor is not None else "-",
                 _pm(r, "mean_ln_ppl_ratio", "mean_ln_ppl_ratio_se", "{:.5f}"),
                 _pm(r, "ppl_ratio", "ppl_ratio_se", "{:.5f}"),
                 _pm(r, "kld_mean", "kld_mean_se"), f"{r['kld_max']:.3e}"]
        cells += [f"{r['kld_' + k]:.3e}" for k, _ in KLD_PERCENTILES[:4]]
        cells += [f"{r['kld_median']:.3e}"]
        cells += [f"{r['kld_' + k]:.3e}" for k, _ in KLD_PERCENTILES[4:]]
        cells += [f"{r['kld_min']:.3e}", _pm(r, "dp_mean", "dp_mean_se", "{:.3f}%", 100),
                  _pm(r, "dp_rms", "dp_rms_se", "{:.3f}%", 100),
                  _pm(r, "same_top_p", "same_top_se", "{:.3f}%", 100)]
        lines.append("| " + " | ".join(cells) + " |")
    cols = (["codec", "Maximum Δp"] + [f"{100 * f:g}% Δp" for _, f in DP_PERCENTILES[:5]]
            + ["Median Δp"] + [f"{100 * f:g}% Δp" for _, f in DP_PERCENTILES[5:]]
            + ["Minimum Δp"])
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [_streams(r), f"{100 * r['dp_max']:.3f}%"]
        cells += [f"{100 * r['dp_' + k]:.3f}%" for k, _ in DP_PERCENTILES[:5]]
        cells += [f"{100 * r['dp_median']:.3f}%"]
        cells += [f"{100 * r['dp_' + k]:.3f}%" for k, _ in DP_PERCENTILES[5:]]
        cells += [f"{100 * r['dp_min']:.3f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
