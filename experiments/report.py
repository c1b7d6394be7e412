"""``kvquant report``: run the sweeps and tables on embedded defaults and write a report folder.

Output (``report/`` or ``--out DIR``)::

    REPORT.md            tables and figures, every missing piece named with its reason
    figures/*.png        the figures
    data/                the result files: one JSON per cell (sweep folders), the collected
                         CSV/JSON of each sweep, the flip tables, inputs/ (captured real rows)

Sections: distortion (codecs x bits x d x input kind, with the Lloyd-Max theory and the 4^-b
bound), codebooks (theory MSE beside the measured), inner products, token flips on the tiny model
and on the real model (when installed), speed, memory, cache files, environment. A section whose
code is not in the build says "not available: <why>" in REPORT.md.

Cells already in ``data/`` are reused (the report says how many); ``--fresh`` recomputes them.
``KVQUANT_SMOKE=1`` (or ``--smoke``) shrinks every grid to seconds.
"""
import datetime
import os
import re
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path

from kvquant.cli import DefaultsHelpFormatter
from kvquant_experiments.common import environment, is_smoke, write_json

__all__ = ["HEADLINE_FIGURES", "add_cli", "main", "run_report"]

# Figures the README shows (copied by --figures-to, e.g. data/figures).
HEADLINE_FIGURES = ("distortion_gaussian.png", "distortion_heavy.png", "inner_products.png",
                    "flips_tiny-mla_pareto.png", "flips_tiny-mla_positions.png",
                    "flips_smollm2_pareto.png", "speed_step.png")


class Section:
    """One part of REPORT.md: markdown lines, figures, and the seconds it took."""

    def __init__(self, key, title, short=None):
        self.key, self.title = key, title
        self.short = short or title.split(":")[0]
        self.lines = []
        self.seconds = 0.0

    def add(self, *lines):
        self.lines.extend(lines)

    def para(self, text):
        self.lines += [text, ""]

    def not_available(self, what, why):
        if str(why).startswith("failed: "):
            self.failed(what, str(why)[len("failed: "):])
        else:
            self.lines.append(f"- **not available**: {what} — {why}")

    def failed(self, what, why):
        self.lines.append(f"- **failed**: {what} — {_clip(why, 400)}")

    def figure(self, rel_path, caption):
        self.lines += [f"![{caption}]({rel_path})", "", f"*{caption}*", ""]

    def table(self, columns, rows):
        self.lines.append("| " + " | ".join(columns) + " |")
        self.lines.append("|" + "|".join("---" for _ in columns) + "|")
        for row in rows:
            self.lines.append("| " + " | ".join(str(c) for c in row) + " |")
        self.lines.append("")

    def markdown(self):
        return "\n".join([f"## {self.title}", ""] + self.lines).rstrip() + "\n"


def _fmt(x, digits=4):
    if x is None:
        return "–"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) < 1e-3 or abs(x) >= 1e5:
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}"
    return str(x)


def _clip(text, n):
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= n else text[:n - 1] + "…"


def _group_unavailable(items):
    """{spec: reason} -> [(specs, reason)], one entry per distinct reason (spec names masked)."""
    groups = {}
    for spec, reason in items.items():
        key = (reason or "").replace(f"'{spec}'", "'<spec>'").replace(spec, "<spec>")
        groups.setdefault(key, []).append(spec)
    out = []
    for key, specs in groups.items():
        reason = key.replace("<spec>", specs[0]) if len(specs) == 1 else key
        out.append((specs, reason))
    return out


def _note_unavailable(section, items, what="codec"):
    for specs, reason in _group_unavailable(items):
        names = ", ".join(f"`{s}`" for s in specs)
        section.not_available(f"{what}{'s' if len(specs) > 1 else ''} {names}", reason)
    if items:
        section.add("")


def _require_plotting():
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("kvquant report draws figures with matplotlib: "
                         "pip install -e '.[report]' in the kvquant source tree")


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
def _distortion_section(res, out, figures):
    from kvquant_experiments import plots
    sec = Section("distortion", "Distortion: relative L2 error against bits per value")
    rows = res["rows"]
    grid = res["grid"]
    sec.para(
        f"Every codec encodes and decodes {grid['rows']} rows per cell (seed {grid['seed']}); "
        "the error is the RMS over rows of |x − x̂| / |x|, which the Lloyd-Max theory predicts "
        "(√MSE). Bits per value count the side values (one f32 norm or scale per row, q8_0/q4_0 "
        "block scales). Dashed: Lloyd-Max theory of the Beta codebook at d; dotted: the 4^−b "
        "lower bound of any b-bit quantizer, both at b code bits + one f32 norm per row.")
    kinds = [k for k in grid["kinds"] if any(r["kind"] == k and r.get("available") for r in rows)]
    for kind in kinds:
        name = f"distortion_{kind}.png"
        plots.plot_distortion(res["json"], figures / name, kind=kind)
        sec.figure(f"figures/{name}", f"Distortion, {plots.KIND_TITLES.get(kind, kind)}")
    for kind, reason in res["skipped_kinds"].items():
        sec.not_available(f"input kind `{kind}`", reason)
    # One table: rows = codecs, columns = (kind, d) cells.
    avail = [r for r in rows if r.get("available")]
    cols = sorted({(r["kind"], r["dim"]) for r in avail},
                  key=lambda kd: (grid["kinds"].index(kd[0]), kd[1]))
    value = {(r["codec"], r["kind"], r["dim"]): r for r in avail}
    ref_dim = 128 if any(d == 128 for _, d in cols) else cols[0][1] if cols else None
    table = []
    for spec in grid["codecs"]:
        cells = [value.get((spec, k, d)) for k, d in cols]
        if not any(cells):
            continue
        bpv = next((value[(spec, k, d)]["bits_per_value"] for k, d in cols
                    if (spec, k, d) in value and d == ref_dim), None)
        table.append([f"`{spec}`", _fmt(bpv, 3)] + [_fmt(c["rel_l2_rms"]) if c else "–"
                                                   for c in cells])
    if table:
        sec.para(f"Relative L2 error (RMS over rows); bits per value at d = {ref_dim}.")
        sec.table(["codec", f"bits/value (d={ref_dim})"] + [f"{k} d={d}" for k, d in cols], table)
    missing = {}
    for r in rows:
        if not r.get("available"):
            missing.setdefault(r["codec"], r.get("reason"))
    _note_unavailable(sec, missing)
    return sec


def _codebook_section(res):
    from kvquant.codebooks import load_codebook

    from kvquant_experiments.distortion import LLOYD_MAX_GAUSSIAN_MSE
    sec = Section("codebooks", "Codebooks: theoretical MSE beside the measured")
    sec.para(
        "The `tq<b>` codecs ship Lloyd-Max codebooks fitted to the exact coordinate density of a "
        "rotated unit vector at each d (Beta, `kvquant/data/codebooks/`). Theory: the stored "
        "codebook's MSE per coordinate (= expected relative squared error of a row). Measured: "
        "mean squared relative error of Gaussian rows (distortion sweep). Regenerate with "
        "`kvquant codebooks fit --dist beta --dim 64,128 --bits 1-8` (or `--all`).")
    measured = {(r["dim"], r["bits"]): r for r in res["rows"]
                if r.get("available") and r["kind"] == "gaussian" and r["family"] == "tq"}
    dims = sorted({d for d, _ in measured})
    if not dims:
        sec.not_available("measured codebook MSE", "the sweep ran no `tq<b>` cell on Gaussian rows")
        return sec
    rows = []
    for b in range(1, 9):
        if not any((d, b) in measured for d in dims):
            continue
        cells = [f"{b}", _fmt(LLOYD_MAX_GAUSSIAN_MSE.get(b)), _fmt(4.0 ** -b)]
        for d in dims:
            theory = load_codebook("beta", d, b).mse
            m = measured.get((d, b))
            got = m["rel_l2_rms"] ** 2 if m else None
            cells += [_fmt(theory), _fmt(got), _fmt(got / theory, 3) if got else "–"]
        rows.append(cells)
    cols = ["bits", "Gaussian Lloyd-Max (Max 1960)", "4^-b bound"]
    for d in dims:
        cols += [f"theory d={d}", f"measured d={d}", "ratio"]
    sec.table(cols, rows)
    return sec


def _inner_section(res, out, figures):
    from kvquant_experiments import plots
    sec = Section("inner_products", "Inner products: the shrink of MSE codecs and the unbiased "
                                    "side value")
    sec.para(
        "q·x̂ regressed on q·x for Gaussian queries: an MSE-optimal codec with the norm as side "
        "value has slope 1 − D (docs/reference.md §2: 0.883, 0.966, 0.990 at 2, 3, 4 bits); "
        "`side=unbiased` stores |x|²/⟨x, x̂⟩ instead, same bytes, slope 1. Relative RMS error "
        "of q·x̂ includes the bias; 'debiased' removes the fitted slope.")
    avail = [r for r in res["rows"] if r.get("available")]
    if avail:
        kinds = list(dict.fromkeys(r["kind"] for r in avail))
        plots.plot_inner_products(Path(out) / "data" / "inner_products.json",
                                  figures / "inner_products.png", kind=kinds[0])
        sec.figure("figures/inner_products.png", f"Inner products, {kinds[0]} rows")
        rows = []
        for r in avail:
            rows.append([r["kind"], r["dim"], f"`{r['codec']}`", _fmt(r["bits_per_value"], 3),
                         _fmt(r["slope"], 4), _fmt(r.get("theory_slope"), 4),
                         _fmt(r["rel_rmse"], 3), _fmt(r["rel_rmse_debiased"], 3)])
        sec.table(["rows", "d", "codec", "bits/value", "slope", "theory", "rel RMS error",
                   "debiased"], rows)
    missing = {r["codec"]: r.get("reason") for r in res["rows"] if not r.get("available")}
    _note_unavailable(sec, missing)
    return sec


def _flip_section(model, title, short, res, out, figures, note=None):
    """``res``: :func:`kvquant_experiments.flip_report.finish` of the model."""
    from kvquant_experiments.flip_tables import format_markdown

    from kvquant_experiments import plots
    sec = Section(model, title, short)
    if note:
        sec.para(note)
    table = res["table"]
    sec.add(format_markdown(table), "")
    sec.para(
        "TF agree: teacher-forced positions whose argmax equals the f32 cache's; greedy agree: "
        "the run's own greedy tokens equal to the f32 run's; Wilson 95% intervals in brackets "
        f"(percent). Data: `{Path(res['table_csv']).relative_to(out)}`.")
    _note_unavailable(sec, res["unavailable"])
    if len(table["rows"]) > 1:
        name = f"flips_{model}_pareto.png"
        plots.plot_flip_pareto(res["table_json"], figures / name)
        sec.figure(f"figures/{name}", f"{model}: KL divergence from the f32 cache against "
                                      "bits per value (Pareto front dashed)")
    if "text" in table["meta"] and len(table["rows"]) > 1:
        name = f"flips_{model}_kld_by_position.png"
        plots.plot_kld_by_position(table, figures / name)
        sec.figure(f"figures/{name}", f"{model}: mean KL divergence from the f32 cache by "
                                      "position in the text chunks")
    name = f"flips_{model}_positions.png"
    plots.plot_flip_strip(res["positions_json"], figures / name)
    sec.figure(f"figures/{name}", f"{model}: per position, KL divergence from f32 (colour) "
                                  "and flipped argmax (dots)")
    return sec


def _speed_section(res, out, figures):
    from kvquant_experiments import plots
    sec = Section("speed", "Speed: consumers against numpy f32, encode throughput")
    grid = res["grid"]
    if res.get("reused_steps"):
        sec.para(f"**Reused timings**: {res['reused_steps']} decode-step cell(s) come from an "
                 "earlier run in `data/speed/` (not re-timed now); `kvquant report --fresh` "
                 "re-times them.")
    if res["step"]:
        threads = min(grid["threads"])
        plots.plot_speed_step(Path(out) / "data" / "speed.json", figures / "speed_step.png",
                              threads=threads)
        sec.para(
            "One decode step (scores, softmax, context) over T cached rows, one query, through "
            "each codec's compressed-domain consumers, against numpy on float32 rows; "
            "`kvquant_experiments.bench.attention_step.time_cell` (what `kvquant bench` times): "
            "each method warmed and timed in its own block of "
            f"{grid['repeats']} calls, {grid['rounds']} rounds in rotated order, medians; "
            "byte limit = the bytes the step reads (every row twice) over the read bandwidth "
            "measured in the same cell, of limit = byte limit / time. "
            + (f"Highest load average seen at the end of a timing cell: "
               f"{', '.join(f'{x:.1f}' for x in res['load_average'])} (1, 5, 15 min) on "
               f"{os.cpu_count()} cores: other processes slow the 2-thread runs most."
               if res.get("load_average") else ""))
        sec.figure("figures/speed_step.png",
                   f"Decode-step time against T (log-log), {threads} thread(s)")
        rows = []
        for r in res["step"]:
            if r["T"] != max(grid["T"]):
                continue
            cells = [r["dim"], r["T"], f"`{r['codec']}`", r["bytes_per_row"]]
            for nt in grid["threads"]:
                cells += [_fmt(1e3 * r[f"numpy_s_{nt}t"], 3), _fmt(1e3 * r[f"codec_s_{nt}t"], 3),
                          f"{r[f'speedup_{nt}t']:.2f}x", f"{r[f'fraction_{nt}t']:.2f}"]
            rows.append(cells + [r["flags"]])
        cols = ["d", "T", "codec", "B/row"]
        for nt in grid["threads"]:
            cols += [f"numpy ms ({nt}t)", f"codec ms ({nt}t)", f"speedup ({nt}t)",
                     f"of limit ({nt}t)"]
        sec.table(cols + ["flags"], rows)
        from kvquant_experiments.bench.attention_step import POLAR_NOTE
        sec.para(POLAR_NOTE)
        try:
            from kvquant_experiments.bench import attention_targets as bench_attention
        except ImportError as exc:
            sec.not_available("the attention benchmark's targets", f"{exc}")
        else:
            if callable(getattr(bench_attention, "verdict", None)):
                sec.para("Targets of the attention benchmark "
                         "(`python -m kvquant_experiments.bench.attention_targets`; "
                         "its own grid goes to T = 131072), checked on this grid at "
                         f"{max(grid['threads'])} thread(s):")
                sec.add(bench_attention.verdict({"threads": grid["threads"],
                                                 "rows": res["step"]}), "")
            else:
                sec.not_available("the attention benchmark's targets",
                                  "kvquant_experiments.bench.attention_targets has no "
                                  "verdict()")
    else:
        sec.not_available("decode-step timing", res["unavailable"].get("*", "no codec could be "
                                                                          "timed"))
    enc = [r for r in res["encode"] if r.get("available")]
    if enc:
        plots.plot_speed_encode(Path(out) / "data" / "speed.json", figures / "speed_encode.png")
        sec.figure("figures/speed_encode.png", "Encode / decode throughput, one thread")
        sec.table(["codec", "d", "rows", "encode MB/s", "decode MB/s", "encode rows/s"],
                  [[f"`{r['codec']}`", r["dim"], r["rows"], _fmt(r["encode_mb_per_s"], 4),
                    _fmt(r["decode_mb_per_s"], 4), _fmt(r["encode_rows_per_s"], 4)]
                   for r in enc])
    missing = {k: v for k, v in res["unavailable"].items() if k != "*"}
    _note_unavailable(sec, missing)
    return sec


def _committed_frontier_section():
    """The frontier's picks (chosen on the tune text) and their held-out runs, as committed in
    the source tree's data/results (not recomputed by the report: a grid run takes ~12 min)."""
    import json

    sec = Section("frontier", "Quality per byte: the frontier's picks on held-out texts")
    results = Path(__file__).resolve().parent.parent / "data" / "results"
    choices_path = results / "frontier-choices.json"
    if not choices_path.is_file():
        sec.not_available("the committed frontier results",
                          f"{choices_path} is not there (an installed copy without the source "
                          "tree)")
        return sec
    choices = json.loads(choices_path.read_text())
    sec.para("From committed runs, not recomputed here. The picks (`data/results/"
             "frontier-choices.json`, from `python -m kvquant_experiments.frontier "
             "--choose-from <runs on the tune text>`): per budget, the lowest mean KLD of "
             "the frontier's grid and its further runs (data/results/tune-windows/, "
             "data/results/tune-field-codecs/) on the tune "
             "text. `python -m kvquant_experiments.frontier "
             "--choices data/results/frontier-choices.json --text T` runs exactly them on any "
             "text.")
    sec.table(["budget (bits/value)", "pick (K / V)", "bits/value", "tune text",
               "mean KLD on it"],
              [[b, f"`{c['pair']}`", f"{c['bits']:.2f}", c["tune_text"],
                _fmt(c.get("tune_kld_mean"), 3)] for b, c in choices.items()])
    runs = [json.loads(p.read_text()) for p in sorted(results.glob("frontier-choices-*.json"))]
    if runs:
        from kvquant_experiments.frontier_picks import goals_table
        sec.para("The goals on held-out text, cell by cell (`python -m kvquant_experiments."
                 "frontier --goals data/results/frontier-choices-*.json --choices "
                 "data/results/frontier-choices.json`; a column per run of the picks, its "
                 "command below the table; bits as stored at that run's chunk length; cells "
                 "of picks since replaced left out):")
        sec.add(goals_table(runs, choices), "")
    for path in sorted(results.glob("frontier-choices-*.md")):
        sec.add(f"**{path.name}** (held out unless it says so):", "", path.read_text().strip(),
                "")
    passkeys = sorted(results.glob("passkey-*.md"))
    if passkeys:
        sec.para("Passkey retrieval at long context (`python -m kvquant_experiments.passkey`: a "
                 "number hidden in filler at several depths, greedy decoding through the cache "
                 "of each configuration):")
        for path in passkeys:
            sec.add(f"**{path.name}**:", "", path.read_text().strip(), "")
    return sec


def _committed_tasks_section():
    """Task accuracy per cache spec with the paired verdicts, as committed in the source tree's
    data/results/tasks (not recomputed here: `kvquant tasks`; n=200 of HellaSwag takes ~2 min a
    spec on two cores)."""
    sec = Section("tasks", "Task accuracy: the decision datapoint")
    root = Path(__file__).resolve().parent.parent / "data" / "results" / "tasks"
    summaries = sorted(root.glob("*/summary-n*.md")) if root.is_dir() else []
    if not summaries:
        sec.not_available("the committed task-accuracy results",
                          f"no {root}/*/summary-n*.md (an installed copy without the source "
                          "tree)")
        return sec
    sec.para("From committed runs, not recomputed here (`kvquant tasks --model M --task T "
             "--limit N --codecs ...`; the commands are in data/results/tasks/README.md). Each "
             "table: accuracy with Wilson 95% intervals per cache spec, the paired comparison "
             "with the f32 cache on the same items and the engine reviewer's verdict "
             "(docs/tasks.md).")
    for path in summaries:
        sec.add(f"**{path.parent.name}/{path.name}**:", "", path.read_text().strip(), "")
    return sec


def _memory_section():
    from kvquant_experiments.memory import budget_section_data
    sec = Section("memory", "Memory: bytes per token and the context a RAM budget holds")
    data, reason = budget_section_data()
    if data is None:
        sec.not_available("the memory budget", reason)
        return sec
    for name, m in data["models"].items():
        sec.add(f"**{name}**", "", "```", m["markdown"], "```", "")
        _note_unavailable(sec, m["unavailable"])
    checks = data["glm_checks"]
    if checks:
        ok = all(c["match"] for c in checks)
        sec.para("GLM-5.2 bytes per layer-row against the engine (docs/reference.md §1.6): "
                 + ", ".join(f"`{c['codec']}` {c['bytes']} B"
                             + ("" if c["match"] else f" (engine {c['engine']} B: MISMATCH)")
                             for c in checks)
                 + (" — all match." if ok else ""))
    return sec


def _cache_file_section(out):
    from kvquant_experiments.cache_files import cache_file_rows
    sec = Section("cache_files", "Cache files: tiers on disk")
    rows, reason = cache_file_rows(Path(out) / "data" / "cache_files")
    if rows is None:
        sec.not_available("the cache-file round trip", reason)
        return sec
    sec.para("The tiny model's L and R rows of 36 tokens written with `kvquant.kvfile.CacheFile` "
             "under each mode, reopened (records compared), then opened under another mode "
             "(must be refused). Bytes per token include the header.")
    sec.table(["mode", "tier", "file bytes", "B/token", "reload identical", "other mode"],
              [[f"`{r['mode']}`", r["tier"], r["bytes"], _fmt(r["bytes_per_token"], 4),
                "yes" if r["reload_identical"] else "**NO**", _clip(r["refusal"], 160)]
               for r in rows if r.get("available")])
    _note_unavailable(sec, {r["mode"]: r["reason"] for r in rows if not r.get("available")},
                      what="mode")
    return sec


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
def _real_wanted(real, smoke):
    """(run it?, reason when not)."""
    from kvquant_experiments.inputs import real_model_status
    if real == "no":
        return False, "skipped on request (--real no)"
    ok, info = real_model_status()
    if not ok:
        return False, info
    if smoke and real != "yes":
        return False, "skipped in smoke mode (KVQUANT_SMOKE / --smoke); run without it"
    return True, None


def run_report(out="report", smoke=None, scheduler=None, workers=None, real="auto", full=False,
               fresh=False, progress=True, figures_to=None, command=None, log=None,
               text=None, codecs=()):
    """Run every section and write ``out/REPORT.md``, ``out/figures``, ``out/data``.

    Parameters
    ----------
    out : path
    smoke : bool, optional
        Small grids (default: ``KVQUANT_SMOKE``).
    scheduler : None, "serial", Dask address or distributed.Client
        Where the sweep cells run (see :func:`kvquant_experiments.executor.open_executor`).
    workers : int, optional
        Local pool size (default: the cores).
    real : {"auto", "yes", "no"}
        The real-model table: when installed (auto), forced (yes: also in smoke mode) or not.
    full : bool
        The real-model table at ``kvquant flips`` defaults (10240 text positions, 8 prompts, its
        codec list) instead of the report's shorter one.
    fresh : bool
        Recompute cells whose result files exist.
    figures_to : path, optional
        Also copy the headline figures there (e.g. ``data/figures`` for the README).
    text : str, optional
        The real model's text: a built-in name or a UTF-8 file
        (:func:`kvquant_experiments.texts.load_text`); default
        :data:`kvquant_experiments.flip_report.REPORT_TEXT` (held out: the frontier's picks
        were chosen on pydoc).
    codecs : sequence of str
        Codec specs measured beside the built-in grid in every section (the sweeps, the
        flip tables): a registered plug-in codec, or a built-in one the grid leaves out.

    Returns
    -------
    dict with ``report`` (path of REPORT.md), ``seconds``, ``sections`` {key: seconds},
    ``unavailable`` (lines "not available") and ``reused`` / ``computed`` cell counts.
    """
    from kvquant_experiments import distortion, flip_report, inner_products
    from kvquant_experiments.bench import report_cells as speed
    from kvquant_experiments.executor import open_executor
    _require_plotting()
    t_start = time.perf_counter()
    text = flip_report.REPORT_TEXT if text is None else text
    smoke = is_smoke() if smoke is None else bool(smoke)
    out = Path(out)
    data, figures = out / "data", out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    log = log or (lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
                                    flush=True))
    resume = not fresh
    timings, counts, failures = {}, {"reused": 0, "computed": 0}, []

    def guarded(step, fn, *args, **kwargs):
        """fn(...) or, when a piece raises, a _Failure recorded for the report (and exit 1)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - one broken piece must not hide the others
            failures.append({"step": step, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()})
            log(f"{step} FAILED: {type(exc).__name__}: {exc}")
            return _Failure(f"{type(exc).__name__}: {exc}")

    def timed(key, fn, *args, **kwargs):
        """fn(...) with ``tally``: the section's own work is the sum of its computed cells'
        seconds (where they ran), apart from the wall time, which other jobs sharing the
        workers lengthen."""
        t0 = time.perf_counter()
        tally = {}
        result = guarded(key, fn, *args, tally=tally, **kwargs)
        wall = time.perf_counter() - t0
        timings[f"{key}: own work ({tally.get('computed', 0)} cells computed, "
                f"{tally.get('reused', 0)} reused)"] = tally.get("work_seconds", 0.0)
        timings[f"{key}: wall"] = wall
        counts["reused"] += tally.get("reused", 0)
        counts["computed"] += tally.get("computed", 0)
        log(f"{key}: {wall:.0f} s wall, {tally.get('work_seconds', 0.0):.0f} s of its own cells"
            + (f"; reused {tally['reused']} cells" if tally.get("reused") else ""))
        return result

    want_real, real_reason = _real_wanted(real, smoke)
    with open_executor(scheduler, workers) as ex:
        log(f"executor: {ex.description}")
        n_workers = getattr(ex, "_max_workers", None) or 2
        handles = {}
        log("distortion sweep")
        codecs = list(codecs)
        extra = (lambda grid: grid + [c for c in codecs if c not in grid]) if codecs else None
        dist = timed("distortion", distortion.run_sweep, data, executor=ex, resume=resume,
                     progress=progress, smoke=smoke,
                     codecs=extra(distortion.default_grid(smoke)["codecs"]) if extra else None)
        log("inner-product sweep")
        inner = timed("inner products", inner_products.run_sweep, data, executor=ex,
                      resume=resume, progress=progress, smoke=smoke,
                      codecs=extra(inner_products.default_grid(smoke)["codecs"]) if extra
                      else None)
        # The sweeps first, then the model jobs: each has the workers to itself, so that its
        # bar and its times are its own (the long model jobs queued first would hold both
        # workers while the sweeps' bars stood still).
        if want_real:
            if full:
                from kvquant_experiments.flip_runs import (DEFAULT_CHUNK_TOKENS, DEFAULT_CODECS,
                                                           DEFAULT_POSITIONS)
                real_codecs = list(DEFAULT_CODECS["real"])
                sizes = {"positions": DEFAULT_POSITIONS, "chunk_tokens": DEFAULT_CHUNK_TOKENS,
                         "prompts": 8}
            else:
                real_codecs = flip_report.report_codecs("smollm2", smoke)
                sizes = dict(flip_report.SMOKE_REAL if smoke else flip_report.REAL_DEFAULTS)
            handles["smollm2"] = guarded("real-model flips", flip_report.submit_model,
                                         "smollm2", data, ex, smoke=smoke,
                                         codecs=extra(real_codecs) if extra else real_codecs,
                                         sizes=sizes, n_groups=n_workers, resume=resume,
                                         text=text, progress=progress)
            log(f"real model: {sizes['positions']} text positions, {sizes['prompts']} prompts")
        tiny_codecs = flip_report.report_codecs("tiny-mla", smoke)
        handles["tiny-mla"] = guarded("tiny-model flips", flip_report.submit_model, "tiny-mla",
                                      data, ex, smoke=smoke, resume=resume, progress=progress,
                                      codecs=extra(tiny_codecs) if extra else tiny_codecs)
        log("waiting for the flip tables (one bar per model job)")
        flips = {}
        for name, handle in handles.items():
            t0 = time.perf_counter()
            flips[name] = handle if isinstance(handle, _Failure) else guarded(
                f"{name} flips", flip_report.finish, handle)
            if not isinstance(flips[name], _Failure):
                f = flips[name]
                counts["reused"] += f["reused"]
                counts["computed"] += f["computed"]
                timings[f"{name} flips: own work ({f['computed']} cells computed, "
                        f"{f['reused']} reused)"] = f["work_seconds"]
                timings[f"{name} flips: wait after the sweeps"] = time.perf_counter() - t0
                log(f"{name} flips: {f['work_seconds']:.0f} s of its own cells"
                    + (f"; reused {f['reused']} cells from {handle['dir']}"
                       if f["reused"] else ""))
    executor_description = ex.description

    log("speed (serial, this process)")
    t0 = time.perf_counter()
    spd = guarded("speed", speed.run_speed, data, resume=resume, progress=progress, smoke=smoke)
    timings["speed (serial, this process)"] = time.perf_counter() - t0

    log("figures and tables")
    t0 = time.perf_counter()
    titles = {
        "distortion": ("Distortion: relative L2 error against bits per value", "Distortion"),
        "codebooks": ("Codebooks: theoretical MSE beside the measured", "Codebooks"),
        "inner": ("Inner products: the shrink of MSE codecs and the unbiased side value",
                  "Inner products"),
        "tiny-mla": ("Token flips: the tiny MLA model (the engine's protocol)", "Flips (tiny-mla)"),
        "smollm2": ("Token flips: the real model (SmolLM2-135M)", "Flips (smollm2)"),
        "frontier": ("Quality per byte: the frontier's picks on held-out texts", "Frontier"),
        "tasks": ("Task accuracy: the decision datapoint", "Tasks"),
        "speed": ("Speed: consumers against numpy f32, encode throughput", "Speed"),
        "memory": ("Memory: bytes per token and the context a RAM budget holds", "Memory"),
        "cache_files": ("Cache files: tiers on disk", "Cache files"),
    }

    def section(key, build, *inputs):
        bad = next((x for x in inputs if isinstance(x, _Failure)), None)
        result = bad if bad is not None else guarded(f"section {key}", build, *inputs)
        if isinstance(result, _Failure):
            sec = Section(key, *titles[key])
            sec.failed("this section", f"{result.error} (traceback in `data/errors.txt`)")
            return sec
        return result

    tiny_note = ("Random weights (seeded numpy, not the engine's torch draw): near-tied logits, "
                 "so this measures perturbation, not quality; the engine's own seed table "
                 "(docs/reference.md §1.8: KV8 30/32 & 14/20, polar 6 bits 30/32 & 17/20, 4-bit codec "
                 "23/32 & 10/20) comes from other weights and is not expected to match row for "
                 "row.")
    real_note = ("K (after RoPE) and V rows of every layer and KV head go through the codec "
                 "before attention reads them. Run at the report's size; `kvquant report "
                 "--full` or `kvquant flips --model smollm2` for the full table. The last rows "
                 "carry stream options (`@center`, `@normalize`, `@sinks=1`, `recent=16`; fp16 "
                 "side values): the quality-per-byte frontier's picks at 3.5, 4.5, 5.5 and 8.5 "
                 "bits per value (`python -m kvquant_experiments.frontier`, "
                 "`data/results/frontier-choices.json`), chosen on the tune text pydoc; this "
                 f"table's text ({text}) "
                 + ("is the tune text itself: not held out." if text == "pydoc" else
                    "was not used for picking them (held out).")
                 + " Beside them: the frontier's best 4.4-bit pair without a window and the same "
                 "options on llama.cpp's rotated q4_0.")
    sections = [
        section("distortion", lambda d: _distortion_section(d, out, figures), dist),
        section("codebooks", _codebook_section, dist),
        section("inner", lambda r: _inner_section(r, out, figures), inner),
        section("tiny-mla", lambda r: _flip_section("tiny-mla", *titles["tiny-mla"], r, out,
                                                    figures, note=tiny_note), flips["tiny-mla"]),
    ]
    if want_real:
        sections.append(section("smollm2", lambda r: _flip_section(
            "smollm2", *titles["smollm2"], r, out, figures, note=real_note), flips["smollm2"]))
    else:
        sec = Section("smollm2", *titles["smollm2"])
        sec.not_available("the real-model table", real_reason)
        sections.append(sec)
    sections.append(section("frontier", _committed_frontier_section))
    sections.append(section("tasks", _committed_tasks_section))
    sections.append(section("speed", lambda r: _speed_section(r, out, figures), spd))
    sections.append(section("memory", _memory_section))
    sections.append(section("cache_files", lambda: _cache_file_section(out)))
    timings["figures, tables, memory, cache files"] = time.perf_counter() - t0

    total = time.perf_counter() - t_start
    env = environment()
    unavailable = [line for s in sections for line in s.lines if "**not available**" in line]
    failed = [line for s in sections for line in s.lines if "**failed**" in line]
    md = _render(sections, env, executor_description, timings, total, counts, smoke, command)
    report_path = out / "REPORT.md"
    report_path.write_text(md, encoding="utf-8")
    errors_path = data / "errors.txt"
    if failures:
        errors_path.write_text("\n\n".join(f"== {f['step']}: {f['error']}\n{f['traceback']}"
                                            for f in failures), encoding="utf-8")
    elif errors_path.exists():
        errors_path.unlink()
    write_json(data / "report.json", {"environment": env, "executor": executor_description,
                                      "seconds": total, "timings": timings, "cells": counts,
                                      "smoke": smoke, "unavailable": unavailable,
                                      "failed": failed})
    if figures_to:
        dest = Path(figures_to)
        dest.mkdir(parents=True, exist_ok=True)
        for name in HEADLINE_FIGURES:
            if (figures / name).is_file():
                shutil.copyfile(figures / name, dest / name)
    log(f"wrote {report_path} in {total:.0f} s"
        + (f"; {len(failed)} FAILED item(s), see {errors_path}" if failed else ""))
    return {"report": report_path, "seconds": total, "sections": timings,
            "unavailable": unavailable, "failed": failed, **counts}


class _Failure:
    def __init__(self, error):
        self.error = error


def _render(sections, env, executor, timings, total, counts, smoke, command):
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = ["# kvquant report", ""]
    lines.append(f"Generated {now} by `{command or 'kvquant report'}` in {total:.0f} s"
                 + (" (**smoke size**: small grids, not for conclusions)" if smoke else "")
                 + f" on {env['cpu']} ({env['cpu_affinity'] or env['cpu_count']} cores usable), "
                 f"kvquant {env['versions']['kvquant']}, numpy {env['versions']['numpy']}; "
                 f"cells on a {executor}.")
    lines.append("")
    if counts["reused"]:
        lines += [f"{counts['reused']} model-table cell(s) were reused from result files of an "
                  "earlier run (the sweeps report their own in the data); `kvquant report "
                  "--fresh` recomputes everything.", ""]
    lines += ["Contents: " + " · ".join(
        f"[{s.short}](#{_anchor(s.title)})" for s in sections), ""]
    n_missing = sum(1 for s in sections for line in s.lines if "**not available**" in line)
    n_failed = sum(1 for s in sections for line in s.lines if "**failed**" in line)
    if n_missing:
        lines += [f"{n_missing} item(s) are marked **not available** below, each with its "
                  "reason.", ""]
    if n_failed:
        lines += [f"{n_failed} item(s) **failed** (a piece raised): see below and "
                  "`data/errors.txt`.", ""]
    for s in sections:
        lines.append(s.markdown())
    lines += ["## Environment and timings", ""]
    lines.append("| | |")
    lines.append("|---|---|")
    for key in ("python", "platform", "cpu", "cpu_count", "cpu_affinity", "openmp",
                "openmp_max_threads", "omp_num_threads"):
        lines.append(f"| {key} | {env.get(key)} |")
    for key, value in env["versions"].items():
        lines.append(f"| {key} | {value} |")
    for key, value in timings.items():
        lines.append(f"| time: {key} | {value:.1f} s |")
    lines.append(f"| time: total | {total:.1f} s |")
    lines += ["", "Data: `data/*.csv` and `data/*.json` (collected tables), one JSON per cell "
              "under `data/<sweep>/` named by its parameters, `data/flips/` (flip tables as "
              "`kvquant flips` writes them).", ""]
    return "\n".join(lines)


def _anchor(title):
    a = re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")
    return a


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def add_cli(subparsers):
    """Register ``report`` on an argparse subparsers object (``args.func(args)`` runs it)."""
    p = subparsers.add_parser(
        "report", help="run the sweeps and tables, write report/REPORT.md with figures and data",
        description="Run the distortion and inner-product sweeps, the token-flip tables (tiny "
                    "model; real model when installed), the speed, memory and cache-file "
                    "sections on embedded defaults, and write REPORT.md, PNG figures and "
                    "CSV/JSON data. Set KVQUANT_SMOKE=1 (or --smoke) for a seconds-long run.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", default="report", help="output folder")
    p.add_argument("--scheduler", default=None,
                   help="Dask scheduler address (tcp://host:8786) to run the sweep cells on a "
                        "cluster, or 'serial'; default a local process pool")
    p.add_argument("--workers", type=int, default=None,
                   help="local pool size (default: the cores)")
    p.add_argument("--real", choices=("auto", "yes", "no"), default="auto",
                   help="the real-model table: when installed, forced, or skipped")
    p.add_argument("--full", action="store_true",
                   help="real-model table at `kvquant flips` size (long)")
    p.add_argument("--smoke", action="store_true", help="small grids (as KVQUANT_SMOKE=1)")
    p.add_argument("--fresh", action="store_true",
                   help="recompute cells whose result files already exist")
    p.add_argument("--text", default="code",
                   help="the real model's text: a UTF-8 file or a built-in text (pydoc, code, "
                        "docstrings); default code, held out from the frontier's picks "
                        "(chosen on pydoc)")
    p.add_argument("--figures-to", default=None,
                   help="also copy the headline figures there (the README's: data/figures)")
    p.add_argument("--codecs", default="",
                   help="comma-separated codec specs measured beside the built-in grid in "
                        "every section (a plug-in codec, installed by entry point; or one the "
                        "grid leaves out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_report)
    return p


def cmd_report(args):
    command = "kvquant report" + "".join(
        f" {shlex.quote(a)}" for a in getattr(args, "_argv", []) or [])
    try:
        from kvquant.codecs import describe_codec
        from kvquant.specs import split_spec_text
        from kvquant_experiments.texts import load_text
        load_text(args.text)   # a bad --text fails here, before any sweep
        codecs = split_spec_text(args.codecs)
        for spec in codecs:    # an unknown codec fails here too
            describe_codec(spec)
        res = run_report(out=args.out, smoke=True if args.smoke else None,
                         scheduler=args.scheduler, workers=args.workers, real=args.real,
                         full=args.full, fresh=args.fresh, progress=not args.no_progress,
                         figures_to=args.figures_to, command=command, text=args.text,
                         codecs=codecs)
    except (ValueError, ImportError, OSError) as exc:
        raise SystemExit(f"kvquant report: {exc}")
    print(f"{res['report']}  ({res['seconds']:.0f} s, {len(res['unavailable'])} item(s) "
          f"not available, {len(res['failed'])} failed)")
    return 1 if res["failed"] else 0


def main(argv=None):
    """``kvquant report ...`` (also ``python -m kvquant_experiments.report ...``)."""
    from kvquant.cli import parse_subcommand
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_subcommand(add_cli, "report", argv)
    args._argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
