"""A flip table's files, each written atomically and named by :func:`result_stem`:
``<stem>.json``, ``<stem>.csv``, ``<stem>-positions.csv`` and the KL-divergence-by-position
figure."""
import csv
import os

from kvquant_experiments.common import safe_stem, write_json
from kvquant.outputs import atomic_write
from kvquant_experiments.flip_storage import add_storage
from kvquant_experiments.models import model_tag

__all__ = [
    "CSV_COLUMNS",
    "POSITION_CSV_COLUMNS",
    "position_rows",
    "result_stem",
    "write_results",
]


def result_stem(result):
    """``flips-<model>-p<prompts>[-<text>-N<positions>-c<chunk tokens>]``."""
    meta = result["meta"]
    stem = f"flips-{model_tag(meta.get('model_name', meta['model']['model']))}"
    stem += f"-p{meta['protocol']['prompts']}"
    if "text" in meta:
        t = meta["text"]
        stem += f"-{t.get('name', 'pydoc')}-N{t['positions']}-c{t['chunk_tokens']}"
        if t.get("score") == "second-half":
            stem += "-half"
    return safe_stem(stem)


def _llama_keys():
    from kvquant.metrics import LLAMA_STATISTICS
    keys = []
    for _, value, se in LLAMA_STATISTICS:
        keys += [value] + ([se] if se else [])
    return keys


CSV_COLUMNS = (["codec", "streams", "bytes_per_token", "fixed_bytes", "marginal_bytes_per_token",
                "context_tokens", "bits_per_value", "compression", "tf_k", "tf_n",
                "tf_lo", "tf_hi", "greedy_k", "greedy_n", "greedy_lo", "greedy_hi",
                "tf_kld_mean", "same_top_k", "same_top_n", "same_top_lo", "same_top_hi"]
               + [k for k in _llama_keys() if k not in ("same_top_p",)]
               + ["n_scored", "kld_mean_boot_lo", "kld_mean_boot_hi", "ppl_ratio_boot_lo",
                  "ppl_ratio_boot_hi", "boot_chunks", "text_s"])
POSITION_CSV_COLUMNS = ["codec", "pos_lo", "pos_hi", "n", "kld_mean", "same_top"]


def position_rows(result):
    """Flat rows of the per-position bins: one per (codec, bin)."""
    out = []
    for r in result["rows"]:
        bins = r.get("by_position")
        if not bins:
            continue
        e = bins["edges"]
        for i, n in enumerate(bins["n"]):
            out.append({"codec": r["codec"], "pos_lo": e[i], "pos_hi": e[i + 1], "n": n,
                        "kld_mean": bins["kld_mean"][i], "same_top": bins["same_top"][i]})
    return out


def write_results(result, out_dir, figure=True):
    """Write ``<stem>.json``, ``<stem>.csv`` and, with text metrics, ``<stem>-positions.csv``
    and the KL-divergence-by-position figure ``<stem>-kld-by-position.png`` (when matplotlib
    is installed and ``figure``) in ``out_dir``; returns the paths written."""
    add_storage(result["rows"], result["meta"])
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(result))
    # each file atomically: a kill or a full disk leaves the previous file, never half a new one
    write_json(stem + ".json", result)
    paths = [stem + ".json", stem + ".csv"]
    atomic_write(stem + ".csv", lambda f: _write_rows_csv(f, result["rows"]))
    pos = position_rows(result)
    if pos:
        def write_positions(f):
            w = csv.DictWriter(f, fieldnames=POSITION_CSV_COLUMNS)
            w.writeheader()
            w.writerows(pos)
        atomic_write(stem + "-positions.csv", write_positions)
        paths.append(stem + "-positions.csv")
        if figure:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                pass
            else:
                from kvquant_experiments.plots import plot_kld_by_position
                paths.append(str(plot_kld_by_position(result, stem + "-kld-by-position.png")))
    return paths


def _write_rows_csv(f, rows):
    w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        flat = dict(r)
        flat["streams"] = " ".join(f"{k}={v}" for k, v in r["streams"].items())
        for key in ("tf", "greedy", "same_top"):
            if key in r:
                for part in ("k", "n", "lo", "hi"):
                    flat[f"{key}_{part}"] = r[key][part]
        for key, (lo, hi) in ((k, v) for k, v in (r.get("bootstrap") or {}).items()
                              if k in ("kld_mean", "ppl_ratio")):
            flat[f"{key}_boot_lo"], flat[f"{key}_boot_hi"] = lo, hi
        if r.get("bootstrap"):
            flat["boot_chunks"] = r["bootstrap"]["n_chunks"]
        w.writerow(flat)
