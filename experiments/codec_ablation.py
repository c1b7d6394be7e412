"""What each 3-bit technique adds alone, and stacked: pairs of frontier rows on the tune text
that differ by one technique (docs/field-codecs.md).

Each comparison names a base configuration and the same configuration with one technique
added (a 2-D codebook for the scalar one, a side value, exact outliers, a channel split ...),
both measured in the same protocol (SmolLM2-135M, pydoc, 2048 positions in 512-token chunks):
the table gives both rows' bits and mean KLD and the change. The rows come from the tune runs
given (their union, first row of a configuration kept)::

    python -m kvquant_experiments.codec_ablation data/results/frontier-smollm2-N2048-c512-p4.json \\
        data/results/tune-windows/*.json data/results/tune-field-codecs/*.json

A comparison whose rows are missing from the runs is listed as missing, never guessed.
"""
import sys

from kvquant.streams.spec import StreamSpec

from .frontier import read_result
from .frontier_picks import merge_tune_runs
from .study import study_main

K_WINDOW = "@center,normalize,sinks=1,recent=12"
V_WINDOW = "@center,sinks=1,recent=4"
K_PLAIN = "@center,normalize,sinks=1"
V_PLAIN = "@center,sinks=1"


def _f16(stream_spec):
    """The stream spec with fp16 side values (the codec option ``side_dtype=f16``)."""
    return str(StreamSpec.parse(stream_spec).with_codec_options(side_dtype="f16"))


def pair(k, v, window=True):
    """The frontier's pair text of K codec ``k`` and V codec ``v`` with fp16 side values and
    the picks' stream options (``window``: recent windows of 12 K and 4 V rows)."""
    if k.endswith(".json"):   # a plan file's name (the file is not read here, at import)
        return k
    kw, vw = (K_WINDOW, V_WINDOW) if window else (K_PLAIN, V_PLAIN)
    return f"{_f16(k + kw)}/{_f16(v + vw)}"


def plan(name):
    return f"data/plans/chsplit-smollm2-{name}.json"


# (technique, base label, base config, with label, with config)
W, N = True, False
COMPARISONS = [
    ("2-D codebook (vq) for scalar Lloyd-Max (tq)", "tq2/tq2 W", pair("tq2", "tq2"), "vq2/vq2 W", pair("vq2", "vq2")),
    ("2-D codebook (vq) for scalar Lloyd-Max (tq)", "tq3/tq2 W", pair("tq3", "tq2"), "vq3/vq2 W", pair("vq3", "vq2")),
    ("2-D codebook (vq) for scalar Lloyd-Max (tq)", "tq3/tq3 W", pair("tq3", "tq3"), "vq3/vq3 W", pair("vq3", "vq3")),
    ("2-D codebook (vq) for scalar Lloyd-Max (tq)", "tq2/tq2", pair("tq2", "tq2", N), "vq2/vq2", pair("vq2", "vq2", N)),
    ("2-D codebook (vq) for scalar Lloyd-Max (tq)", "tq3/tq3", pair("tq3", "tq3", N), "vq3/vq3", pair("vq3", "vq3", N)),
    ("token scale kept (side=match)", "vq2/vq2 W", pair("vq2", "vq2"), "match", pair("vq2:side=match", "vq2:side=match")),
    ("token scale kept (side=match)", "vq3/vq3 W", pair("vq3", "vq3"), "match", pair("vq3:side=match", "vq3:side=match")),
    ("token scale kept (side=match)", "vq2/vq2", pair("vq2", "vq2", N), "match", pair("vq2:side=match", "vq2:side=match", N)),
    ("token scale kept (side=match)", "vq3/vq3", pair("vq3", "vq3", N), "match", pair("vq3:side=match", "vq3:side=match", N)),
    ("2-D codebook with the token's norm (vq2.5:side=match) for polar3: same bits", "polar3/polar3 W", pair("polar3", "polar3"), "vq2.5:match both W", pair("vq2.5:side=match", "vq2.5:side=match")),
    ("2-D codebook with the token's norm (vq2.5:side=match) for polar3: same bits", "polar3/polar3", pair("polar3", "polar3", N), "vq2.5:match both", pair("vq2.5:side=match", "vq2.5:side=match", N)),
    ("unbiased side value (EDEN scale)", "vq2/vq2 W", pair("vq2", "vq2"), "unbiased", pair("vq2:side=unbiased", "vq2:side=unbiased")),
    ("unbiased side value (EDEN scale)", "vq3/vq3 W", pair("vq3", "vq3"), "unbiased", pair("vq3:side=unbiased", "vq3:side=unbiased")),
    ("unbiased side value (EDEN scale)", "vq3/vq3", pair("vq3", "vq3", N), "unbiased", pair("vq3:side=unbiased", "vq3:side=unbiased", N)),
    ("dense-and-sparse, 1 outlier per K row (ds)", "tq2/tq2 W", pair("tq2", "tq2"), "ds K", pair("ds:inner=tq2,k=1", "tq2")),
    ("dense-and-sparse, 1 outlier per K row (ds)", "polar2/polar2 W", pair("polar2", "polar2"), "ds K", pair("ds:inner=polar2,k=1", "polar2")),
    ("dense-and-sparse, 1 outlier per K row (ds)", "polar3/polar2 W", pair("polar3", "polar2"), "ds K", pair("ds:inner=polar3,k=1", "polar2")),
    ("dense-and-sparse, 1 outlier per K row (ds)", "polar3/polar3 W", pair("polar3", "polar3"), "ds K", pair("ds:inner=polar3,k=1", "polar3")),
    ("dense-and-sparse, 1 outlier per K row (ds)", "vq3/vq2 W", pair("vq3", "vq2"), "ds K", pair("ds:inner=vq3,k=1", "vq2")),
    ("dense-and-sparse, 1 outlier per K row (ds)", "vq3/vq3", pair("vq3", "vq3", N), "ds K", pair("ds:inner=vq3,k=1", "vq3", N)),
    ("dense-and-sparse, 1 outlier per K row (ds)", "vq2/vq2 W", pair("vq2", "vq2"), "ds K and V", pair("ds:inner=vq2,k=1", "ds:inner=vq2,k=1")),
    ("per-token centring (tokmean)", "tq2/tq2 W", pair("tq2", "tq2"), "on K", pair("tokmean:inner=tq2", "tq2")),
    ("per-token centring (tokmean)", "tq2/tq2 W", pair("tq2", "tq2"), "on V", pair("tq2", "tokmean:inner=tq2")),
    ("per-token centring (tokmean)", "vq2/vq2 W", pair("vq2", "vq2"), "on K", pair("tokmean:inner=vq2", "vq2")),
    ("per-token centring (tokmean)", "polar3/polar3 W", pair("polar3", "polar3"), "on K", pair("tokmean:inner=polar3", "polar3")),
    ("per-token centring (tokmean)", "vq3/vq3", pair("vq3", "vq3", N), "on K", pair("tokmean:inner=vq3", "vq3", N)),
    ("residual sign sketch (qjl) for K's last bit", "tq3/tq2 W", pair("tq3", "tq2"), "qjl tq2 K", pair("qjl:inner=tq2", "tq2")),
    ("residual sign sketch (qjl) for K's last bit", "vq3/vq2 W", pair("vq3", "vq2"), "qjl vq2 K", pair("qjl:inner=vq2", "vq2")),
    ("residual sign sketch (qjl) for K's last bit", "vq3/vq2", pair("vq3", "vq2", N), "qjl vq2 K", pair("qjl:inner=vq2", "vq2", N)),
    ("calibrated channel split: half of K one bit up (chsplit)", "tq2/tq2 W", pair("tq2", "tq2"), "K tq3|tq2", plan("tq3.2-tq2-w12.4")),
    ("calibrated channel split: half of K one bit up (chsplit)", "vq2/vq2 W", pair("vq2", "vq2"), "K vq3|vq2", plan("vq3.2-vq2-w12.4")),
    ("calibrated channel split: half of K one bit up (chsplit)", "polar2/polar2 W", pair("polar2", "polar2"), "K polar3|polar2", plan("polar3.2-polar2-w12.4")),
    ("calibrated channel split: half of K one bit up (chsplit)", "vq3/vq3", pair("vq3", "vq3", N), "K vq4|vq3", plan("vq4.3-vq3")),
    ("all of K one bit up (the split's alternative)", "tq2/tq2 W", pair("tq2", "tq2"), "tq3/tq2 W", pair("tq3", "tq2")),
    ("all of K one bit up (the split's alternative)", "vq2/vq2 W", pair("vq2", "vq2"), "vq3/vq2 W", pair("vq3", "vq2")),
    ("all of K one bit up (the split's alternative)", "polar2/polar2 W", pair("polar2", "polar2"), "polar3/polar2 W", pair("polar3", "polar2")),
    ("recent windows (12 K, 4 V f32 rows)", "polar3/polar3", pair("polar3", "polar3", N), "W", pair("polar3", "polar3")),
    ("recent windows (12 K, 4 V f32 rows)", "vq3:match both", pair("vq3:side=match", "vq3:side=match", N), "W", pair("vq3:side=match", "vq3:side=match")),
    ("stacked: 2-D codebook + token scale + windows", "tq3/tq3", pair("tq3", "tq3", N), "vq3:match both W", pair("vq3:side=match", "vq3:side=match")),
    ("stacked: polar + ds K + windows", "polar3/polar3 W", pair("polar3", "polar3"), "ds polar3 K, K window 9", "ds:inner=polar3,k=1,side_dtype=f16@center,normalize,sinks=1,recent=9/polar3:side_dtype=f16@center,sinks=1,recent=4"),
    ("stacked: vq3 + token scale on K (window 8), polar3 on V (window 2): the earlier 3.5-bit pick", "polar3/polar3 W", pair("polar3", "polar3"), "the pick", "vq3:side=match,side_dtype=f16@center,normalize,sinks=1,recent=8/polar3:side_dtype=f16@center,sinks=1,recent=2"),
    ("stacked: vq4 on K (window 6), vq3.5 on V (window 4), token scales kept: the 4.5-bit pick", "polar4/polar4 W", pair("polar4", "polar4"), "the pick", "vq4:side=match,side_dtype=f16@center,normalize,sinks=1,recent=6/vq3.5:side=match,side_dtype=f16@center,sinks=1,recent=4"),
    ("stacked: vq3 on K (window 6), vq2.5 on V (window 4), token scales kept: the 3.5-bit pick", "polar3/polar3 W", pair("polar3", "polar3"), "the pick", "vq3:side=match,side_dtype=f16@center,normalize,sinks=1,recent=6/vq2.5:side=match,side_dtype=f16@center,sinks=1,recent=4"),
    ("stacked: vq2.5 on K (window 8), vq2 on V (window 2), token scales kept: the 3-bit pick", "polar3/polar2 W", pair("polar3", "polar2"), "the pick", "vq2.5:side=match,side_dtype=f16@center,normalize,sinks=1,recent=8/vq2:side=match,side_dtype=f16@center,sinks=1,recent=2"),
    ("stacked: vq2 on K (window 8), vq1.5 on V (window 2), token scales kept: the 2.5-bit pick", "polar2/polar2 W", pair("polar2", "polar2"), "the pick", "vq2:side=match,side_dtype=f16@center,normalize,sinks=1,recent=8/vq1.5:side=match,side_dtype=f16@center,sinks=1,recent=2"),
    ("stacked: polar + tokmean K + windows", "polar3/polar3 W", pair("polar3", "polar3"), "tokmean polar3 K, K window 11", "tokmean:inner=polar3,side_dtype=f16@center,normalize,sinks=1,recent=11/polar3:side_dtype=f16@center,sinks=1,recent=4"),
]


def ablation_rows(rows):
    """The comparisons with their rows: dicts of technique, labels, bits, KLD and the change
    (None where a configuration is missing from ``rows``, a dict codec -> frontier row)."""
    out = []
    for technique, base_label, base, with_label, config in COMPARISONS:
        a, b = rows.get(base), rows.get(config)
        entry = {"technique": technique, "base": base_label, "with": with_label,
                 "base_config": base, "config": config}
        if a is None or b is None:
            entry["missing"] = [c for c, r in ((base, a), (config, b)) if r is None]
        else:
            entry.update(base_bits=a["bits_per_value"], base_kld=a["kld_mean"],
                         bits=b["bits_per_value"], kld=b["kld_mean"],
                         change=b["kld_mean"] / a["kld_mean"] - 1.0)
        out.append(entry)
    return out


def _cell(text):
    return text.replace("|", "\\|")    # a label's "|" (a channel split's hi|lo) is not a column


def markdown(entries):
    lines = ["| technique | base (K/V; W: windows) | bits | mean KLD | with it | bits | mean KLD "
             "| KLD change |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        if "missing" in e:
            lines.append(f"| {_cell(e['technique'])} | {_cell(e['base'])} | | | {_cell(e['with'])} | | | missing: "
                         + ", ".join(f"`{c}`" for c in e["missing"]) + " |")
            continue
        lines.append(f"| {_cell(e['technique'])} | {_cell(e['base'])} | {e['base_bits']:.2f} | "
                     f"{e['base_kld']:.4f} | {_cell(e['with'])} | {e['bits']:.2f} | {e['kld']:.4f} | "
                     f"{100 * e['change']:+.0f}% |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line (kvquant_experiments.study)
# --------------------------------------------------------------------------------------------
RESUMES = False         # reads result files, writes nothing


def add_arguments(p):
    p.add_argument("runs", nargs="+", help="frontier result JSONs of one tune protocol")


def run(args, progress):
    merged = merge_tune_runs([read_result(path) for path in args.runs], args.runs)
    entries = ablation_rows({r["codec"]: r for r in merged["rows"]})
    print(markdown(entries))
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
