"""Every figure, drawn from result files only (the sweeps write them; nothing here computes).

Matplotlib's object API (``matplotlib.figure.Figure``), no pyplot state, no usetex: the figures
render the same headless, in CI, in a notebook. Each function takes the results folder (or a
result file) and the PNG path to write, and returns that path.
"""
import math
import os
import textwrap
from pathlib import Path

from kvquant.outputs import atomic_write
from kvquant_experiments.common import read_json

__all__ = [
    "FAMILY_STYLE",
    "numbered_key",
    "plot_distortion",
    "plot_flip_pareto",
    "plot_flip_strip",
    "plot_inner_products",
    "plot_kld_by_position",
    "plot_speed_encode",
    "plot_speed_step",
    "plot_frontier",
    "plot_task_accuracy",
    "spec_label",
]

# One colour and marker per codec family; llama.cpp baselines are points (no line).
FAMILY_STYLE = {
    "tq": {"color": "#1f77b4", "marker": "o", "label": "tq (Lloyd-Max, Beta codebook at d)"},
    "tq gaussian": {"color": "#17becf", "marker": "v", "label": "tq (Gaussian codebook)"},
    "tq unbiased": {"color": "#9467bd", "marker": "^", "label": "tq (unbiased side value)"},
    "tq colibri": {"color": "#000000", "marker": "*", "label": "tq4 engine (colibri)",
                   "line": False},
    "polar": {"color": "#2ca02c", "marker": "s", "label": "polar (Lloyd angles)"},
    "polar colibri": {"color": "#98df8a", "marker": "D", "label": "polar engine (colibri)"},
    "kv8": {"color": "#d62728", "marker": "P", "label": "kv8 fp8 (row / group scales)"},
    "q8_0": {"color": "#ff7f0e", "marker": "X", "label": "llama.cpp q8_0", "line": False},
    "q4_0": {"color": "#8c564b", "marker": "X", "label": "llama.cpp q4_0", "line": False},
    "q8_0+rot": {"color": "#ff7f0e", "marker": "h", "label": "q8_0 + Hadamard", "line": False},
    "q4_0+rot": {"color": "#8c564b", "marker": "h", "label": "q4_0 + Hadamard", "line": False},
}
_RC = {"text.usetex": False, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
       "savefig.dpi": 110}

KIND_TITLES = {"gaussian": "Gaussian rows", "heavy": "heavy-tailed rows with outlier channels",
               "smollm2-k": "SmolLM2 K rows (after RoPE)", "smollm2-v": "SmolLM2 V rows"}


def spec_label(spec, streams=("K", "V")):
    """A cache spec in words for a legend (:meth:`kvquant.specs.CacheSpec.describe`): ``"K polar5
    (f16 side, centered, ...) / V polar4 (...)"`` (``streams``: the two streams' names, L and R
    on the MLA model); a cache plan is named by its file."""
    from kvquant.specs import parse_cache_spec
    return parse_cache_spec(spec).describe(streams)


def _series(codec_spec):
    """The figure series a codec spec declares (:attr:`kvquant.codecs.Codec.series`)."""
    from kvquant.codecs import describe_codec
    return describe_codec(codec_spec)[0]


def _stream_names(row_or_model):
    """("L", "R") for the MLA model (a model name or a table row with ``streams``), else K/V."""
    if isinstance(row_or_model, dict):
        names = [n.upper() for n in row_or_model.get("streams", {})]
        return tuple(names) if len(names) == 2 else ("K", "V")
    return ("L", "R") if row_or_model == "tiny-mla" else ("K", "V")


def numbered_key(fig, entries, title=None, loc="outside right upper", fontsize=6.5):
    """A legend of numbered entries (the numbers drawn beside the points): ``entries`` is a list
    of (number, text, colour)."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], ls="none", marker=f"${n}$", ms=7 if n < 10 else 9, color=c)
               for n, _, c in entries]
    return fig.legend(handles, [t for _, t, _ in entries], loc=loc, fontsize=fontsize,
                      title=title, title_fontsize=fontsize + 0.5, frameon=False,
                      handletextpad=0.6)


def _figure(ncols=1, nrows=1, width=5.0, height=3.8):
    import matplotlib
    from matplotlib.figure import Figure
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _save(fig, out):
    import matplotlib
    out = Path(out)
    with matplotlib.rc_context(_RC):
        atomic_write(out, lambda f: fig.savefig(f, format=out.suffix[1:] or "png"), binary=True)
    return out


def _style(family):
    return FAMILY_STYLE.get(family, {"color": "#7f7f7f", "marker": ".", "label": family})


def _rows(source, name):
    path = Path(source)
    if path.is_dir():
        path = path / name
    return read_json(path)


def plot_distortion(results, out, kind="gaussian"):
    """Relative L2 (RMS over rows, log scale) against bits per value stored, one panel per d.

    Lines per codec family, the Lloyd-Max theory (Beta at d; the stored codebooks) and the 4^-b
    bound (as relative L2, 2^-b) at b code bits + one f32 side value; llama.cpp formats as points.
    """
    from kvquant_experiments.distortion import theory_curves
    data = _rows(results, "distortion.json")
    rows = [r for r in data["rows"] if r["kind"] == kind and r.get("available")]
    dims = sorted({r["dim"] for r in rows})
    if not dims:
        raise ValueError(f"no available distortion results for kind {kind!r}")
    fig, axes = _figure(ncols=len(dims))
    for ax, dim in zip(axes[0], dims):
        th = theory_curves(dim)
        ax.plot(th["x"], th["lloyd_beta"], color="0.4", ls="--", lw=1,
                label="Lloyd-Max theory (Beta d)")
        ax.plot(th["x"], th["bound"], color="0.6", ls=":", lw=1.2, label="4^-b bound")
        fams = {}
        for r in rows:
            if r["dim"] == dim:
                fams.setdefault(r["family"], []).append(r)
        for fam in sorted(fams, key=lambda f: list(FAMILY_STYLE).index(f)
                          if f in FAMILY_STYLE else 99):
            pts = sorted(fams[fam], key=lambda r: r["bits_per_value"])
            st = _style(fam)
            x = [p["bits_per_value"] for p in pts]
            y = [p["rel_l2_rms"] for p in pts]
            ls = "-" if st.get("line", True) and len(pts) > 1 else "none"
            ax.plot(x, y, ls=ls, marker=st["marker"], color=st["color"], label=st["label"],
                    ms=5 if st["marker"] != "*" else 9, lw=1.2)
        ax.set_yscale("log")
        ax.set_xlabel("bits per value stored (side values included)")
        ax.set_ylabel("relative L2 error (RMS over rows)")
        ax.set_title(f"{KIND_TITLES.get(kind, kind)}, d = {dim}")
    _shared_legend(fig, axes)
    return _save(fig, out)


def _shared_legend(fig, axes):
    """One legend under the panels with every label that appears in any of them."""
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    # columns that fit the figure's width (~2 inches per entry), so no entry is cut off
    per_row = max(1, int(fig.get_figwidth() // 2.0))
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncol=min(per_row, len(handles)), fontsize=7, frameon=False)


def plot_inner_products(results, out, kind="gaussian", dim=None):
    """Left: slope of q.x^ on q.x (1 = unbiased) with the 1 - D theory; right: relative RMS error
    of q.x^, against bits per value."""
    data = _rows(results, "inner_products.json")
    rows = [r for r in data["rows"] if r["kind"] == kind and r.get("available")]
    if dim is None:
        dim = max({r["dim"] for r in rows}) if rows else None
    rows = [r for r in rows if r["dim"] == dim]
    if not rows:
        raise ValueError(f"no available inner-product results for kind {kind!r}")
    fig, axes = _figure(ncols=2)
    ax_s, ax_e = axes[0]
    fams = {}
    for r in rows:
        fams.setdefault(r["family"], []).append(r)
    for fam, pts in fams.items():
        pts = sorted(pts, key=lambda r: r["bits_per_value"])
        st = _style(fam)
        ls = "-" if st.get("line", True) and len(pts) > 1 else "none"
        x = [p["bits_per_value"] for p in pts]
        ax_s.plot(x, [p["slope"] for p in pts], ls=ls, marker=st["marker"], color=st["color"],
                  label=st["label"], lw=1.2)
        ax_e.plot(x, [p["rel_rmse"] for p in pts], ls=ls, marker=st["marker"], color=st["color"],
                  label=st["label"], lw=1.2)
    th = sorted((r["bits_per_value"], r["theory_slope"]) for r in rows
                if r["family"] == "tq" and r.get("theory_slope") is not None)
    if th:
        ax_s.plot([t[0] for t in th], [t[1] for t in th], color="0.4", ls="--", lw=1,
                  label="1 - D (Lloyd-Max theory)")
    ax_s.axhline(1.0, color="0.6", lw=0.8)
    ax_s.set_xlabel("bits per value stored")
    ax_s.set_ylabel("slope of q.x^ on q.x")
    ax_s.set_title(f"inner-product bias, {KIND_TITLES.get(kind, kind)}, d = {dim}")
    ax_e.set_yscale("log")
    ax_e.set_xlabel("bits per value stored")
    ax_e.set_ylabel("relative RMS error of q.x^")
    ax_e.set_title("inner-product error")
    ax_s.legend(fontsize=7, loc="lower right")
    return _save(fig, out)


def plot_flip_pareto(table_json, out):
    """KL divergence from the f32 cache (log) against bits per value stored (every byte: the
    fixed bytes of stream options spread over the context), Pareto front drawn; points are
    numbered and a key beside the axes names each configuration in words."""
    from kvquant.specs import PairSpec, parse_cache_spec
    from kvquant_experiments.flip_report import pareto_front, pareto_points
    table = read_json(table_json)
    pts = pareto_points(table)
    if not pts:
        raise ValueError(f"{table_json}: no quantized rows to plot")
    # the key holds one line per point: the figure grows with it, the axes keep their width
    fig, axes = _figure(width=12.0, height=max(4.8, 1.3 + 0.14 * len(pts)))
    ax = axes[0][0]
    floor = min((p["kld"] for p in pts if p["kld"] > 0), default=1e-12)
    order = sorted(range(len(pts)), key=lambda i: (pts[i]["bits_per_value"], -pts[i]["kld"]))
    entries, placed = [], []
    # labels closer than this (a share of the axis, as a label's width is) move aside
    xs = [p["bits_per_value"] for p in pts]
    x_near = max(0.25, 0.04 * (max(xs) - min(xs)))
    for n, i in enumerate(order, 1):
        p = pts[i]
        spec = parse_cache_spec(p["codec"])
        # a pair of one codec is drawn in its codec's style, anything else plainly
        st = _style(_series(spec.k.codec_spec) if isinstance(spec, PairSpec) and spec.k == spec.v
                    else "")
        y = max(p["kld"], floor * 0.5)
        ax.plot(p["bits_per_value"], y, marker=st["marker"], color=st["color"], ls="none", ms=6)
        near = sum(1 for x0, ly0 in placed
                   if abs(x0 - p["bits_per_value"]) < x_near and abs(ly0 - math.log10(y)) < 0.08)
        placed.append((p["bits_per_value"], math.log10(y)))
        ax.annotate(str(n), (p["bits_per_value"], y), fontsize=7, color=st["color"],
                    xytext=(5 + 12 * near, -2), textcoords="offset points", va="center")
        names = _stream_names(next(r for r in table["rows"] if r["codec"] == p["codec"]))
        entries.append((n, f"{spec_label(p['codec'], names)}: {p['bits_per_value']:.2f} bits, "
                           f"{p['kld']:.2e}", st["color"]))
    front = pareto_front(pts)
    ax.plot([pts[i]["bits_per_value"] for i in front],
            [max(pts[i]["kld"], floor * 0.5) for i in front], color="0.3", lw=1, ls="--",
            label="Pareto front")
    ax.set_yscale("log")
    ax.set_xlabel("bits per value stored (K and V or L and R)\nside values and the fixed bytes "
                  "of stream options included")
    kind = "real-text mean KLD" if pts[0]["kld_kind"] == "kld_mean" else "teacher-forced mean KLD"
    ax.set_ylabel(f"{kind} vs f32 (nats)")
    meta = table["meta"]
    where = (f", text {meta['text'].get('name', meta['text']['source'])}" if "text" in meta
             else ", the engine's protocol")
    ax.set_title(f"{meta['model']['model']}: KL divergence against storage{where}", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    numbered_key(fig, entries, title="point: configuration, bits/value, mean KLD")
    return _save(fig, out)


def plot_flip_strip(positions_json, out):
    """Per position (columns) and codec (rows): KL divergence from f32 as colour, flipped argmax
    marked with a dot."""
    import numpy as np
    from matplotlib.colors import LogNorm
    data = read_json(positions_json)
    kld = np.asarray(data["kld"], dtype=float)
    flipped = np.asarray(data["flipped"], dtype=bool)
    codecs = data["codecs"]
    n_pos = kld.shape[1]
    fig, axes = _figure(width=min(14.0, 2.0 + 0.05 * n_pos + (0.2 * n_pos if n_pos <= 64 else 0)),
                        height=0.9 + 0.22 * len(codecs))
    ax = axes[0][0]
    positive = kld[kld > 0]
    lo = positive.min() if positive.size else 1e-9
    hi = max(kld.max(), lo * 10)
    im = ax.imshow(np.maximum(kld, lo), aspect="auto", interpolation="nearest", cmap="magma_r",
                   norm=LogNorm(vmin=lo, vmax=hi))
    ys, xs = np.nonzero(flipped)
    ax.plot(xs, ys, ls="none", marker="o", ms=2.5, mfc="#00bfff", mec="none",
            label="argmax differs from f32")
    names = _stream_names(data["model"])
    ax.set_yticks(range(len(codecs)), [spec_label(c, names) for c in codecs], fontsize=6.5)
    ax.set_xlabel("position")
    import textwrap
    title = f"{data['model']}: where next-token predictions move ({data['source']})"
    ax.set_title("\n".join(textwrap.wrap(title, width=int(8 * fig.get_figwidth()))),
                 fontsize=8)
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="KL(f32 || codec), nats", shrink=0.9)
    if xs.size:
        ax.legend(fontsize=7, loc="upper right", framealpha=0.8)
    return _save(fig, out)


def plot_speed_step(results, out, threads=None):
    """Decode-step time against T (log-log), one panel per d: numpy f32 and each codec's
    compressed-domain consumer, at one thread count (default the smallest measured)."""
    data = _rows(results, "speed.json")
    rows = data["step"]
    if not rows:
        raise ValueError("no decode-step results")
    if threads is None:  # one thread: the least disturbed by other processes
        threads = min(int(k.split("_")[-1][:-1]) for k in rows[0] if k.startswith("numpy_s_"))
    dims = sorted({r["dim"] for r in rows}, reverse=True)
    fig, axes = _figure(ncols=len(dims), width=5.0, height=4.0)
    for ax, dim in zip(axes[0], dims):
        sub = [r for r in rows if r["dim"] == dim]
        # numpy's time per T: the median over the cells that timed it (one per codec)
        by_T = {}
        for r in sub:
            by_T.setdefault(r["T"], []).append(r[f"numpy_s_{threads}t"])
        Ts = sorted(by_T)
        ax.plot(Ts, [1e6 * sorted(by_T[t])[len(by_T[t]) // 2] for t in Ts], color="k", lw=2.2,
                marker="o", label="numpy f32")
        codecs = list(dict.fromkeys(r["codec"] for r in sub))
        for ci, codec in enumerate(codecs):
            pts = sorted((r for r in sub if r["codec"] == codec), key=lambda r: r["T"])
            st = _style(_series(codec))
            # one colour per codec (families share markers): tq2/tq4/tq8 must stay apart
            ax.plot([p["T"] for p in pts], [1e6 * p[f"codec_s_{threads}t"] for p in pts],
                    marker=st["marker"], color=f"C{ci % 10}" if codec != "f32" else "0.5",
                    ls="-" if ci % 2 == 0 else "--", lw=1.2, ms=4,
                    label=f"{codec} consumer" if codec != "f32" else "f32 consumer")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cached rows T")
        ax.set_ylabel("one decode step, microseconds")
        ax.set_title(f"one decode step, d = {dim}, {threads} thread{'s' if threads > 1 else ''}")
    _shared_legend(fig, axes)
    return _save(fig, out)


def plot_speed_encode(results, out):
    """Encode and decode throughput (input MB/s of float32 rows) per codec and d."""
    data = _rows(results, "speed.json")
    rows = [r for r in data["encode"] if r.get("available")]
    if not rows:
        raise ValueError("no available encode results")
    dims = sorted({r["dim"] for r in rows})
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    fig, axes = _figure(width=max(5.0, 0.45 * len(codecs) * len(dims)), height=3.8)
    ax = axes[0][0]
    width = 0.8 / (2 * len(dims))
    for di, dim in enumerate(dims):
        by = {r["codec"]: r for r in rows if r["dim"] == dim}
        for k, (key, hatch) in enumerate((("encode_mb_per_s", ""), ("decode_mb_per_s", "//"))):
            xs = [i + (2 * di + k) * width - 0.4 + width / 2 for i in range(len(codecs))]
            ys = [by[c][key] if c in by else math.nan for c in codecs]
            ax.bar(xs, ys, width=width, hatch=hatch, color=f"C{di}", alpha=0.85 if k == 0 else 0.5,
                   label=f"{'encode' if k == 0 else 'decode'}, d = {dim}")
    ax.set_xticks(range(len(codecs)), codecs, rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("MB/s of float32 rows (one thread)")
    ax.set_title("codec throughput")
    ax.legend(fontsize=7)
    return _save(fig, out)


def plot_codebook(dim, bits, out):
    """The density of one rotated, scaled coordinate at width ``dim`` (Beta) against N(0, 1),
    with the levels of the stored Beta codebook and the engine's Gaussian levels."""
    import numpy as np
    from kvquant.codebooks import beta_density, gaussian_density, load_codebook
    beta, gauss = beta_density(dim), gaussian_density()
    x = np.linspace(-4, 4, 801)
    fig, axes = _figure(width=6.0, height=3.6)
    ax = axes[0][0]
    ax.plot(x, beta.pdf(x), color="C0", label=f"coordinate density at d = {dim} (Beta)")
    ax.plot(x, gauss.pdf(x), color="0.5", ls="--", label="N(0, 1)")
    cb = load_codebook("beta", dim, bits)
    cg = load_codebook("gaussian", None, bits)
    top = float(beta.pdf(np.zeros(1))[0])
    ax.vlines(cb.levels, 0, 0.12 * top, color="C0", lw=1.5, label=f"{bits}-bit Beta levels")
    ax.vlines(cg.levels, 0.12 * top, 0.22 * top, color="C3", lw=1.5,
              label=f"{bits}-bit Gaussian levels")
    ax.set_xlabel("y = coordinate x sqrt(d) / |x|")
    ax.set_title(f"codebooks: MSE {cb.mse:.5f} (Beta, d = {dim}) vs {cg.mse:.5f} (Gaussian)")
    ax.legend(fontsize=7)
    return _save(fig, out)


def plot_rotation(x, rotated, out, title="a row before and after the rotation"):
    """Coordinates of one row before and after the randomized Hadamard rotation."""
    import numpy as np
    fig, axes = _figure(ncols=2, width=4.5, height=3.2)
    a, b = axes[0]
    a.bar(np.arange(x.size), x, width=1.0, color="C3")
    a.set_title("row x (outlier channels)")
    a.set_xlabel("channel")
    b.bar(np.arange(rotated.size), rotated, width=1.0, color="C0")
    b.set_title("rotate(x): the outliers are spread")
    b.set_xlabel("coordinate")
    fig.suptitle(title)
    return _save(fig, out)


def plot_kld_by_position(result, out):
    """Mean KL divergence from the f32 cache (log scale) against the position in the chunk, one
    line per codec: where in the context a codec hurts. ``result``: a flip-table result (as
    ``kvquant flips`` writes it) or its JSON path; its rows' ``by_position`` bins are drawn at
    their centres (f32 itself, KL 0, is left out)."""
    import matplotlib
    if not isinstance(result, dict):
        result = read_json(result)
    rows = [r for r in result["rows"] if r.get("by_position") and r["codec"] != "f32"]
    if not rows:
        raise ValueError("the result has no per-position bins (a run without text positions)")
    t = result["meta"]["text"]
    with matplotlib.rc_context(_RC):
        from matplotlib.figure import Figure
        fig = Figure(figsize=(8.0, 4.2 + 0.22 * len(rows)), layout="constrained")
        ax = fig.subplots()
        cmap = matplotlib.colormaps["tab10" if len(rows) <= 10 else "tab20"]
        for i, r in enumerate(rows):
            b = r["by_position"]
            e = b["edges"]
            x = [(e[j] + e[j + 1] - 1) / 2 for j in range(len(b["n"]))]
            y = [v if v and v > 0 else math.nan for v in b["kld_mean"]]
            ax.plot(x, y, marker="o", ms=3, lw=1.3, color=cmap(i % cmap.N),
                    label=f"{spec_label(r['codec'], _stream_names(r))}  "
                          f"(mean {r['kld_mean']:.2e})")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlim(0, t["chunk_tokens"])
        ax.set_xlabel(f"position in the chunk (mean over bins of {e[1] - e[0]} positions)")
        ax.set_ylabel("mean KL(p_f32 || p_codec) (nats)")
        model = result["meta"]["model"]["model"]
        n_chunks = len(t.get("chunk_starts", [])) or "?"
        ax.set_title(f"{model}: KL divergence from the f32 cache by position\n"
                     f"text '{t.get('name', t['source'])}': {t['positions']} positions in "
                     f"{n_chunks} chunk(s) of {t['chunk_tokens']} tokens", fontsize=9)
        fig.legend(loc="outside lower center", ncols=1, fontsize=7.5, frameon=False)
    return _save(fig, out)


TASK_DODGE = 0.04   # relative bits between two points of a task panel (room for their numbers)


def free_slot(x, placed, gap=TASK_DODGE):
    """The position nearest ``x`` on a log axis (``x`` times a whole power of ``1 + gap``) that
    is at least ``gap`` (relative) from every position in ``placed``."""
    return next(y for y in (x * (1 + gap) ** k for k in _outward())
                if all(abs(math.log(y / b)) >= math.log1p(gap) * 0.999 for b in placed))


def _outward():
    """0, 1, -1, 2, -2, ...: slots around a point, nearest first."""
    yield 0
    k = 1
    while True:
        yield k
        yield -k
        k += 1


def plot_task_accuracy(summaries, out):
    """Task accuracy (the primary metric) with Wilson 95% intervals against bits per cached
    value, one panel per summary (``kvquant tasks``' ``summary-n<N>.json`` files: one per model or
    task), the f32 interval drawn as a band so that the reviewer's rule reads off the figure;
    codecs numbered, named in one key below."""
    import textwrap
    summaries = [read_json(s) if not isinstance(s, dict) else s for s in summaries]
    specs = []
    for s in summaries:
        for r in s["rows"]:
            if r["spec"] not in specs:
                specs.append(r["spec"])
    # wide enough for the key's wrapped spec names below the panels, and tall enough that the
    # key (up to two lines a spec) leaves the panels their height
    fig, axes = _figure(ncols=len(summaries), width=max(4.6, 8.0 / len(summaries)),
                        height=2.8 + 0.3 * len(specs))
    import matplotlib
    cmap = matplotlib.colormaps["tab10" if len(specs) <= 10 else "tab20"]
    colour = {spec: cmap(i % cmap.N) for i, spec in enumerate(specs)}
    for ax, s in zip(axes[0], summaries):
        metric, meta = s["primary_metric"], s["meta"]
        ref = next((r for r in s["rows"] if r["spec"] == s["reference"]), None)
        if ref is not None:
            a = ref[metric]
            ax.axhspan(100 * a["low"], 100 * a["high"], color="#999999", alpha=0.25, lw=0,
                       label=f"{s['reference']} Wilson 95%")
        placed = []
        for r in s["rows"]:
            a = r[metric]
            bits = r.get("bits_per_value_at_mean", r.get("bits_per_value", float("nan")))
            # specs at (nearly) the same bits (kv8 and q8_0 at 8.5) side by side, not on top of
            # each other: each takes the nearest free slot, right or left, of its own bits
            bits = free_slot(bits, placed)
            placed.append(bits)
            n = specs.index(r["spec"]) + 1
            ax.errorbar([bits], [100 * a["acc"]],
                        yerr=[[100 * (a["acc"] - a["low"])], [100 * (a["high"] - a["acc"])]],
                        fmt="o", ms=4, capsize=3, color=colour[r["spec"]])
            # the number above the interval's cap: beside the point it would sit on a
            # neighbour's error bar
            ax.annotate(str(n), (bits, 100 * a["high"]), textcoords="offset points",
                        xytext=(0, 2), ha="center", va="bottom", fontsize=7,
                        color=colour[r["spec"]])
        ax.margins(y=0.12)          # room for the numbers above the top caps
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bits per cached value on these sequences (log scale)")
        ax.set_ylabel(f"{metric} (%)")
        ax.set_title(f"{meta['model_tag']}: {meta['task']} {meta['num_fewshot']}-shot, "
                     f"n={meta['limit']}", fontsize=8.5)
        ax.legend(loc="lower right", fontsize=7, frameon=False)
    numbered_key(fig, [(i + 1, textwrap.fill(spec_label(spec), 110, subsequent_indent="    "),
                        colour[spec]) for i, spec in enumerate(specs)],
                 loc="outside lower center")
    return _save(fig, out)


# --------------------------------------------------------------------------------------------
# The frontier (kvquant_experiments.frontier's results)
# --------------------------------------------------------------------------------------------
FRONTIER_LABEL_GAP = 0.075  # decades between stacked labels
FRONTIER_LABEL_COLUMN = 0.05  # bits: points closer than this stack their labels in one column
FRONTIER_KEY_WIDTH = 80       # characters a line of the numbered key
GOAL_COLORS = ("#ff7f0e", "#9467bd", "#2ca02c", "#17becf")   # the held-out goals, by budget
FRONTIER_STYLE = {
    "tq": ("#1f77b4", "o", "tq (Lloyd-Max, Beta codebook)"),
    "tq gaussian": ("#17becf", "v", "tq (Gaussian codebook)"),
    "tq unbiased": ("#9467bd", "^", "tq (unbiased side value)"),
    "tq colibri": ("#000000", "*", "tq engine (colibri)"),
    "polar": ("#2ca02c", "s", "polar"),
    "polar colibri": ("#98df8a", "D", "polar engine (colibri)"),
    "kv8": ("#d62728", "P", "kv8 fp8 (row / group-32 scales)"),
    "K/V split": ("#e377c2", "d", "K/V split (K codec / V codec)"),
    "stream options": ("#e41a1c", "*", "stream options (@center, @normalize, @sinks=1)"),
    "recent window": ("#ff1493", "p", "+ a recent window of f32 rows (recent=N)"),
    "simulation": ("#bcbd22", "8", "simulated (KIVI, pre-RoPE keys): quantize-dequantize"),
    "cache plan": ("#6a3d9a", "8", "bits allocated per layer (a cache plan)"),
    "plug-in codec": ("#b15928", "o", "plug-in codecs (vq, ds, tokmean, qjl, chsplit: docs/field-codecs.md)"),
    "q8_0": ("#ff7f0e", "X", "llama.cpp q8_0"),
    "q8_0+rot": ("#ff7f0e", "h", "llama.cpp q8_0 + Hadamard"),
    "q4_0": ("#8c564b", "X", "llama.cpp q4_0"),
    "q4_0+rot": ("#8c564b", "h", "llama.cpp q4_0 + Hadamard"),
}


def _spread(ys, gap):
    """Label positions for decreasing ``ys``: as close to them as possible, ``gap`` apart
    (overlapping runs are merged and centred on their mean)."""
    clusters = []  # [sum of ys, count]
    for y in ys:
        clusters.append([y, 1])
        while len(clusters) > 1:
            (s1, n1), (s2, n2) = clusters[-2], clusters[-1]
            bottom1 = s1 / n1 - (n1 - 1) * gap / 2
            top2 = s2 / n2 + (n2 - 1) * gap / 2
            if bottom1 - top2 >= gap:
                break
            clusters[-2:] = [[s1 + s2, n1 + n2]]
    out = []
    for total, n in clusters:
        top = total / n + (n - 1) * gap / 2
        out += [top - i * gap for i in range(n)]
    return out


def plot_frontier(result, out):
    """Mean KLD (log) against bits per value; baselines highlighted, the lower-left Pareto front
    drawn, the two budgets and goals marked. ``result``: a frontier result or its JSON path."""
    from matplotlib.figure import Figure

    from kvquant_experiments.frontier import (BASELINES, BUDGET_HIGH, BUDGET_LOW, KLD_GOAL_LOW,
                                              frontier_rows, pareto_front, picks_of)
    from kvquant_experiments.frontier_picks import HELD_OUT_GOALS
    if isinstance(result, (str, os.PathLike)):
        result = read_json(result)
    rows = [x for x in frontier_rows(result) if x["codec"] != "f32"]
    fig = Figure(figsize=(15.0, 7.0), layout="constrained")
    ax = fig.subplots()
    seen = set()
    for x in rows:
        color, marker, label = FRONTIER_STYLE.get(x["family"], ("#7f7f7f", ".", x["family"]))
        base = x["family"] in BASELINES
        ax.plot(x["bits_per_value"], x["kld_mean"], ls="none", marker=marker, color=color,
                ms=11 if base else 6, mec="black" if base else color, mew=1.2 if base else 0.5,
                zorder=4 if base else 3, label=None if x["family"] in seen else label)
        seen.add(x["family"])
    # Numbers beside the front's points and the baselines (a key beside the axes names them
    # in words; the table names every point). Points at the same bits get a column of numbers,
    # FRONTIER_LABEL_GAP decades apart around their points (leader lines).
    front_codecs = {rows[i]["codec"] for i in pareto_front(rows)}
    picks = picks_of(result)
    named = sorted((x for x in rows if x["codec"] in front_codecs or x["family"] in BASELINES
                    or x["codec"] in picks),
                   key=lambda x: (x["bits_per_value"], -x["kld_mean"]))
    number = {x["codec"]: n for n, x in enumerate(named, 1)}
    columns = {}   # points within FRONTIER_LABEL_COLUMN bits of the column's first share its labels
    for x in named:
        near = [b for b in columns if abs(x["bits_per_value"] - b) < FRONTIER_LABEL_COLUMN]
        columns.setdefault(near[0] if near else x["bits_per_value"], []).append(x)
    for bits, col in columns.items():
        col.sort(key=lambda x: -x["kld_mean"])
        right = not any(0 < b - bits < 0.4 for b in columns)
        ys = _spread([math.log10(max(x["kld_mean"], 1e-12)) for x in col], FRONTIER_LABEL_GAP)
        for x, ly in zip(col, ys):
            color = FRONTIER_STYLE.get(x["family"], ("#7f7f7f",))[0]
            ax.annotate(str(number[x["codec"]]), (x["bits_per_value"], x["kld_mean"]),
                        xytext=(bits + (0.12 if right else -0.12), 10 ** ly),
                        textcoords="data", fontsize=7, va="center", color=color,
                        ha="left" if right else "right",
                        fontweight="bold" if x["family"] in BASELINES else "normal",
                        # a white ground keeps a number legible where a goal line crosses it
                        bbox={"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none",
                              "alpha": 0.85},
                        arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5,
                                    "shrinkA": 0, "shrinkB": 4})
    # wrapped, so that long K/V specs do not squeeze the axes (and clip the title)
    entries = [(number[x["codec"]],
                textwrap.fill(f"{spec_label(x['codec'])}: {x['bits_per_value']:.2f} bits, "
                              f"{x['kld_mean']:.2e}"
                              + (f" (pick {picks[x['codec']]} bits)" if x["codec"] in picks
                                 else ""), FRONTIER_KEY_WIDTH, subsequent_indent="    "),
                FRONTIER_STYLE.get(x["family"], ("#7f7f7f",))[0]) for x in named]
    front = [rows[i] for i in pareto_front(rows)]
    fx, fy = [], []
    for i, x in enumerate(front):  # staircase: a front point holds until the next one
        if i:
            fx.append(x["bits_per_value"])
            fy.append(front[i - 1]["kld_mean"])
        fx.append(x["bits_per_value"])
        fy.append(x["kld_mean"])
    ax.plot(fx, fy, color="0.25", lw=1.2, ls="--", zorder=2, label="Pareto front (lower left)")
    if picks:
        # a run of the picks on held-out text: the held-out goals
        for (budget, goal), color in zip(HELD_OUT_GOALS.items(), GOAL_COLORS):
            ax.axvline(float(budget), color="0.6", lw=0.8, ls=":")
            ax.hlines(goal, 0, float(budget), color=color, lw=1.0, ls="-.",
                      label=f"held-out goal: KLD <= {goal:g} at <= {budget} bits")
        bar = next((x for x in rows if x["codec"] == "q8_0+rot"), None)
        bar_label = "held-out goal: KLD under q8_0+rot at <= 8.5 bits"
    else:
        ax.axvline(BUDGET_LOW, color="0.6", lw=0.8, ls=":")
        ax.hlines(KLD_GOAL_LOW, 0, BUDGET_LOW, color="#2ca02c", lw=1.0, ls="-.",
                  label=f"goal: KLD <= {KLD_GOAL_LOW} at <= {BUDGET_LOW} bits")
        bar = next((x for x in rows if x["codec"] == "q8_0"), None)
        bar_label = f"goal: KLD <= q8_0 at <= {BUDGET_HIGH} bits"
    ax.axvline(BUDGET_HIGH, color="0.6", lw=0.8, ls=":")
    if bar:
        ax.hlines(bar["kld_mean"], 0, BUDGET_HIGH, color="#ff7f0e", lw=1.0, ls="-.",
                  label=bar_label)
    ax.set_xlim(min(x["bits_per_value"] for x in rows) - 0.3,
                max(x["bits_per_value"] for x in rows) + 1.0)
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3, which="both")
    ax.set_xlabel("bits per value (K and V averaged, side values included; head_dim "
                  f"{result['meta']['model']['head_dim']})")
    ax.set_ylabel("mean KL(p_f32 || p_codec) on real text (nats)")
    t = result["meta"]["text"]
    text = {"code": "Python source", "pydoc": "pydoc prose"}.get(t.get("name"), t.get("name"))
    ax.set_title(f"{result['meta']['model']['model']} KV cache: quality per byte\n({text}, "
                 f"{t['positions']} positions, chunks of {t['chunk_tokens']})", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7, frameon=False)
    numbered_key(fig, entries, title="numbered: the Pareto front, llama.cpp's formats"
                                     + (" and the picks" if picks else "")
                                     + "\n(configuration: bits/value, mean KLD)")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    return out
