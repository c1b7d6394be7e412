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

This module runs the parts and writes the folder; turning each part's results into its
section is :mod:`kvquant_experiments.report_sections`.
"""
import argparse
import datetime
import re
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path

from kvquant.cli import DefaultsHelpFormatter
from kvquant_experiments.common import environment, is_smoke, write_json
from kvquant_experiments.report_sections import (
    Section, cache_file_section, codebook_section, committed_frontier_section,
    committed_tasks_section, distortion_section, flip_section, inner_section, memory_section,
    require_plotting, speed_section)

__all__ = ["HEADLINE_FIGURES", "add_cli", "main", "run_report"]

# Figures the README shows (copied by --figures-to, e.g. data/figures).
HEADLINE_FIGURES = ("distortion_gaussian.png", "distortion_heavy.png", "inner_products.png",
                    "flips_tiny-mla_pareto.png", "flips_tiny-mla_positions.png",
                    "flips_smollm2_pareto.png", "speed_step.png")


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
               text=None, codecs=(), positions=None):
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
    positions : int, optional
        Text positions of the real-model table (default
        :data:`kvquant_experiments.flip_report.REAL_DEFAULTS`; with ``full``, that size's).

    Returns
    -------
    dict with ``report`` (path of REPORT.md), ``seconds``, ``sections`` {key: seconds},
    ``unavailable`` (lines "not available") and ``reused`` / ``computed`` cell counts.
    """
    from kvquant_experiments import distortion, flip_report, inner_products
    from kvquant_experiments.bench import report_cells
    from kvquant_experiments.executor import open_executor
    require_plotting()
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
            if positions is not None:
                sizes["positions"] = int(positions)
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
    spd = guarded("speed", report_cells.run_speed, data, resume=resume, progress=progress, smoke=smoke)
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
        section("distortion", lambda d: distortion_section(d, out, figures), dist),
        section("codebooks", codebook_section, dist),
        section("inner", lambda r: inner_section(r, out, figures), inner),
        section("tiny-mla", lambda r: flip_section("tiny-mla", *titles["tiny-mla"], r, out,
                                                    figures, note=tiny_note), flips["tiny-mla"]),
    ]
    if want_real:
        sections.append(section("smollm2", lambda r: flip_section(
            "smollm2", *titles["smollm2"], r, out, figures, note=real_note), flips["smollm2"]))
    else:
        sec = Section("smollm2", *titles["smollm2"])
        sec.not_available("the real-model table", real_reason)
        sections.append(sec)
    sections.append(section("frontier", committed_frontier_section))
    sections.append(section("tasks", committed_tasks_section))
    sections.append(section("speed", lambda r: speed_section(r, out, figures), spd))
    sections.append(section("memory", memory_section))
    sections.append(section("cache_files", lambda: cache_file_section(out)))
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
    from kvquant_experiments.flip_report import REAL_DEFAULTS
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
    p.add_argument("--positions", type=_positive_int, default=None,
                   help="text positions of the real-model table (default "
                        f"{REAL_DEFAULTS['positions']}; --full: that size's)")
    p.add_argument("--figures-to", default=None,
                   help="also copy the headline figures there (the README's: data/figures)")
    p.add_argument("--codecs", default="",
                   help="comma-separated codec specs measured beside the built-in grid in "
                        "every section (a plug-in codec, installed by entry point; or one the "
                        "grid leaves out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_report)
    return p


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


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
                         codecs=codecs, positions=args.positions)
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
