"""The sections of ``kvquant report``'s REPORT.md: each turns its part's results (or the
committed result files) into markdown lines and figures. Running the parts and writing the
report is :mod:`kvquant_experiments.report`'s job."""
import os
from pathlib import Path

__all__ = ["Section", "cache_file_section", "clip", "codebook_section",
           "committed_frontier_section", "committed_tasks_section", "distortion_section",
           "flip_section", "fmt_number", "inner_section", "memory_section", "note_unavailable",
           "require_plotting", "speed_section"]


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
        self.lines.append(f"- **failed**: {what} — {clip(why, 400)}")

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


def fmt_number(x, digits=4):
    if x is None:
        return "–"
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) < 1e-3 or abs(x) >= 1e5:
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}"
    return str(x)


def clip(text, n):
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


def note_unavailable(section, items, what="codec"):
    for specs, reason in _group_unavailable(items):
        names = ", ".join(f"`{s}`" for s in specs)
        section.not_available(f"{what}{'s' if len(specs) > 1 else ''} {names}", reason)
    if items:
        section.add("")


def require_plotting():
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("kvquant report draws figures with matplotlib: "
                         "pip install -e '.[report]' in the kvquant source tree")


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
def distortion_section(res, out, figures):
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
        table.append([f"`{spec}`", fmt_number(bpv, 3)] + [fmt_number(c["rel_l2_rms"]) if c else "–"
                                                   for c in cells])
    if table:
        sec.para(f"Relative L2 error (RMS over rows); bits per value at d = {ref_dim}.")
        sec.table(["codec", f"bits/value (d={ref_dim})"] + [f"{k} d={d}" for k, d in cols], table)
    missing = {}
    for r in rows:
        if not r.get("available"):
            missing.setdefault(r["codec"], r.get("reason"))
    note_unavailable(sec, missing)
    return sec


def codebook_section(res):
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
        cells = [f"{b}", fmt_number(LLOYD_MAX_GAUSSIAN_MSE.get(b)), fmt_number(4.0 ** -b)]
        for d in dims:
            theory = load_codebook("beta", d, b).mse
            m = measured.get((d, b))
            got = m["rel_l2_rms"] ** 2 if m else None
            cells += [fmt_number(theory), fmt_number(got), fmt_number(got / theory, 3) if got else "–"]
        rows.append(cells)
    cols = ["bits", "Gaussian Lloyd-Max (Max 1960)", "4^-b bound"]
    for d in dims:
        cols += [f"theory d={d}", f"measured d={d}", "ratio"]
    sec.table(cols, rows)
    return sec


def inner_section(res, out, figures):
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
            rows.append([r["kind"], r["dim"], f"`{r['codec']}`", fmt_number(r["bits_per_value"], 3),
                         fmt_number(r["slope"], 4), fmt_number(r.get("theory_slope"), 4),
                         fmt_number(r["rel_rmse"], 3), fmt_number(r["rel_rmse_debiased"], 3)])
        sec.table(["rows", "d", "codec", "bits/value", "slope", "theory", "rel RMS error",
                   "debiased"], rows)
    missing = {r["codec"]: r.get("reason") for r in res["rows"] if not r.get("available")}
    note_unavailable(sec, missing)
    return sec


def flip_section(model, title, short, res, out, figures, note=None):
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
    note_unavailable(sec, res["unavailable"])
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


def speed_section(res, out, figures):
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
                cells += [fmt_number(1e3 * r[f"numpy_s_{nt}t"], 3), fmt_number(1e3 * r[f"codec_s_{nt}t"], 3),
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
            from kvquant_experiments.bench import attention_targets
        except ImportError as exc:
            sec.not_available("the attention benchmark's targets", f"{exc}")
        else:
            if callable(getattr(attention_targets, "verdict", None)):
                sec.para("Targets of the attention benchmark "
                         "(`python -m kvquant_experiments.bench.attention_targets`; "
                         "its own grid goes to T = 131072), checked on this grid at "
                         f"{max(grid['threads'])} thread(s):")
                sec.add(attention_targets.verdict({"threads": grid["threads"],
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
                  [[f"`{r['codec']}`", r["dim"], r["rows"], fmt_number(r["encode_mb_per_s"], 4),
                    fmt_number(r["decode_mb_per_s"], 4), fmt_number(r["encode_rows_per_s"], 4)]
                   for r in enc])
    missing = {k: v for k, v in res["unavailable"].items() if k != "*"}
    note_unavailable(sec, missing)
    return sec


def committed_frontier_section():
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
                fmt_number(c.get("tune_kld_mean"), 3)] for b, c in choices.items()])
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


def committed_tasks_section():
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


def memory_section():
    from kvquant_experiments.memory import budget_section_data
    sec = Section("memory", "Memory: bytes per token and the context a RAM budget holds")
    data, reason = budget_section_data()
    if data is None:
        sec.not_available("the memory budget", reason)
        return sec
    for name, m in data["models"].items():
        sec.add(f"**{name}**", "", "```", m["markdown"], "```", "")
        note_unavailable(sec, m["unavailable"])
    checks = data["glm_checks"]
    if checks:
        ok = all(c["match"] for c in checks)
        sec.para("GLM-5.2 bytes per layer-row against the engine (docs/reference.md §1.6): "
                 + ", ".join(f"`{c['codec']}` {c['bytes']} B"
                             + ("" if c["match"] else f" (engine {c['engine']} B: MISMATCH)")
                             for c in checks)
                 + (" — all match." if ok else ""))
    return sec


def cache_file_section(out):
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
              [[f"`{r['mode']}`", r["tier"], r["bytes"], fmt_number(r["bytes_per_token"], 4),
                "yes" if r["reload_identical"] else "**NO**", clip(r["refusal"], 160)]
               for r in rows if r.get("available")])
    note_unavailable(sec, {r["mode"]: r["reason"] for r in rows if not r.get("available")},
                      what="mode")
    return sec


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------
