"""Token-flip tables (through :mod:`kvquant_experiments.flip_runs`), the KL-divergence Pareto
data and the per-position flip strip, as cells for the executor.

* Table cells: ``run_flips`` of one model over a group of codecs (the f32 reference is recomputed
  per group, so groups run in parallel and give the same rows as one run). Groups are merged into
  one table, written in the format of ``kvquant flips`` (``flips-<model>-...json/.csv``).
* Position cells: teacher-forced logits of each codec over one token window (the engine's protocol
  sequence on the tiny model, a window of the text on the real one); per position
  whether the argmax differs from f32 and the KL divergence from it. That is the heat strip.

A codec the model cannot take here (a codec family not yet in the build, a width it refuses) is
listed in ``unavailable`` with the reason, never dropped silently.
"""
import functools
from pathlib import Path

from kvquant_experiments.common import cell_stem, environment, is_smoke, read_json, write_json

__all__ = [
    "REPORT_CODECS",
    "available_codecs",
    "merge_tables",
    "pareto_points",
    "position_cell",
    "table_cell",
]

# The frontier's picks (data/results/frontier-choices.json, chosen on the tune text pydoc; a test
# checks that the two agree), in budget order 2.5, 3, 3.5, 4.5, 5.5, 8.5 bits per value.
PICKS = [
    "vq2:side=match,side_dtype=f16@center,normalize,sinks=1,recent=8"
    "/vq1.5:side=match,side_dtype=f16@center,sinks=1,recent=2",
    "vq2.5:side=match,side_dtype=f16@center,normalize,sinks=1,recent=8"
    "/vq2:side=match,side_dtype=f16@center,sinks=1,recent=2",
    "vq3:side=match,side_dtype=f16@center,normalize,sinks=1,recent=6"
    "/vq2.5:side=match,side_dtype=f16@center,sinks=1,recent=4",
    "vq4:side=match,side_dtype=f16@center,normalize,sinks=1,recent=6"
    "/vq3.5:side=match,side_dtype=f16@center,sinks=1,recent=4",
    "polar6:side_dtype=f16@center,normalize,sinks=1,recent=8"
    "/polar4:side_dtype=f16@center,sinks=1,recent=8",
    "tq8:side_dtype=f16@center,normalize,sinks=1"
    "/tq8:side_dtype=f16@center,sinks=1",
]
# The real model's text in the report: held out (the picks were chosen on pydoc).
REPORT_TEXT = "code"
TABLE_CELL_VERSION = 2   # cells of older versions (without llama.cpp's statistics) are not reused

# What the report runs on each model (the tiny table adds the polar and llama.cpp rows to the
# library's defaults; the real one is shorter than `kvquant flips` to fit the report's budget).
REPORT_CODECS = {
    "tiny-mla": None,  # None: flip_runs.DEFAULT_CODECS + TINY_EXTRAS
    "smollm2": ["f32", "kv8", "tq2", "tq3", "tq4", "tq4:compat=colibri", "tq4:side=unbiased",
                "polar4", "polar4:compat=colibri", "q8_0", "q8_0+rot", "q4_0", "q4_0+rot",
                "kv8/tq4", "tq8", "polar5/polar4",
                # the quality-per-byte frontier's best at 4.4 bits without a window: stream
                # options (keys centered and normalized, values centered, the first row in f32)
                # and fp16 side values; the same stream options on llama.cpp's rotated q4_0
                "polar5:side_dtype=f16@center,normalize,sinks=1/polar4:side_dtype=f16@center,sinks=1",
                "q4_0+rot@center,normalize,sinks=1/q4_0+rot@center,sinks=1",
                # the frontier's picks at 2.5, 3, 3.5, 4.5, 5.5 and 8.5 bits, chosen on pydoc
                # (data/results/frontier-choices.json): the report runs them on a held-out text
                *PICKS],
}
TINY_EXTRAS = ["polar3", "polar4", "polar6", "polar6:compat=colibri", "q8_0/kv8", "q4_0/kv8",
               "q4_0+rot/kv8"]
# 1,024 positions keep the report within 4 minutes on 2 cores (the text's KLD at 2,048 took
# two thirds of it); kvquant flips and the frontier measure the published figures at full size
REAL_DEFAULTS = {"positions": 1024, "chunk_tokens": 512, "prompts": 4}
SMOKE_REAL = {"positions": 64, "chunk_tokens": 64, "prompts": 1}
SMOKE_TINY = ["f32", "kv8", "tq2", "tq4", "polar4"]
SMOKE_REAL_CODECS = ["f32", "kv8", "tq4"]
POSITION_WINDOW = {"tiny-mla": None, "smollm2": 256}  # None: the protocol's 32-token sequence
SMOKE_WINDOW = 32


@functools.lru_cache(maxsize=2)
def _model(name):
    from kvquant.models import load_model
    return load_model(name)


def report_codecs(model_name, smoke=None):
    smoke = is_smoke() if smoke is None else smoke
    if model_name == "tiny-mla":
        if smoke:
            return list(SMOKE_TINY)
        from kvquant_experiments.flip_runs import DEFAULT_CODECS
        return list(DEFAULT_CODECS["tiny-mla"]) + [s for s in TINY_EXTRAS
                                                   if s not in DEFAULT_CODECS["tiny-mla"]]
    return list(SMOKE_REAL_CODECS if smoke else REPORT_CODECS[model_name])


def available_codecs(model_name, specs, model=None):
    """Split specs into those the model's cache accepts and ``{spec: reason}`` for the others."""
    model = model if model is not None else _model(model_name)
    ok, missing = [], {}
    for spec in specs:
        try:
            model.new_cache(spec)
        except (ValueError, TypeError, ImportError) as exc:
            missing[spec] = str(exc)
        else:
            ok.append(spec)
    return ok, missing


def table_cell(cell):
    """``flip_runs.run_flips`` for one group of codecs; a pure function of ``cell``."""
    from kvquant_experiments.flip_runs import run_flips
    kwargs = {}
    if cell["model"] != "tiny-mla":
        kwargs = {"positions": cell["positions"], "chunk_tokens": cell["chunk_tokens"],
                  "n_prompts": cell["prompts"], "text": cell.get("text", "pydoc")}
    result = run_flips(cell["model"], codecs=list(cell["codecs"]), model=_model(cell["model"]),
                       **kwargs)
    for row in result["rows"]:  # timings are not part of the numbers
        row.pop("protocol_s", None)
        row.pop("text_s", None)
    result["meta"].pop("elapsed_s", None)
    return {"available": True, **result}


def _text_params(text):
    """Cell parameters of a text: its name or path, and for a file the SHA-256 of its bytes (so
    that a stored cell of an edited file is not reused)."""
    from kvquant_experiments.texts import TEXTS, load_text
    if text in TEXTS:
        return {"text": text}
    t = load_text(text)
    return {"text": t.path, "text_name": t.name, "text_sha256": t.sha256}


def _text_tag(cell):
    return "" if cell.get("text", "pydoc") == "pydoc" else "_" + cell.get("text_name",
                                                                          cell["text"])


def table_cells(model_name, codecs, n_groups, positions=None, chunk_tokens=None, prompts=None,
                text="pydoc"):
    """Cells of a flip table: the codecs (f32 first) cut into ``n_groups`` groups."""
    from kvquant.specs import parse_cache_spec
    # the reference, however spelled, runs once in every group as "f32"
    codecs = [c for c in codecs if not parse_cache_spec(c).is_reference]
    n_groups = max(1, min(int(n_groups), len(codecs)))
    groups = [["f32"] + codecs[i::n_groups] for i in range(n_groups)]
    cells = []
    for gi, group in enumerate(groups):
        cell = {"sweep": "flips", "model": model_name, "group": f"{gi + 1}of{n_groups}",
                "codecs": group, "version": TABLE_CELL_VERSION}
        if model_name != "tiny-mla":
            cell.update(positions=int(positions), chunk_tokens=int(chunk_tokens),
                        prompts=int(prompts), **_text_params(text))
        cells.append(cell)
    return cells


def table_stem(cell):
    keys = ["model", "group"] + (["positions", "chunk_tokens", "prompts"]
                                 if cell["model"] != "tiny-mla" else [])
    return "table_" + cell_stem(cell, keys) + _text_tag(cell)


def merge_tables(results, order):
    """One table from group results: f32 once, then the codecs in ``order``.

    A row carries the name ``run_flips`` gives it, the spec's canonical text (``kv8/kv8`` runs
    as ``kv8``, any spelling of the reference as ``f32``), so ``order`` is read through the
    parser; a codec of ``order`` without a row is an error, never a row silently left out.
    """
    from kvquant.specs import parse_cache_spec
    rows = {}
    for res in results:
        for row in res["rows"]:
            rows.setdefault(row["codec"], row)

    def row_name(spec_text):
        if spec_text in rows:
            return spec_text
        spec = parse_cache_spec(spec_text)
        return "f32" if spec.is_reference else spec.text

    names = ["f32"] + [row_name(c) for c in order]
    missing = [c for c, name in zip(["f32"] + list(order), names) if name not in rows]
    if missing:
        raise ValueError(f"the flip cells returned no row for {missing}")
    meta = dict(results[0]["meta"])
    return {"meta": meta, "rows": [rows[n] for n in dict.fromkeys(names)]}


def position_cell(cell):
    """Per position, teacher-forced: argmax flipped vs f32, and KL(p_f32 || p_codec)."""
    from kvquant.flips import greedy, kl_rows
    from kvquant_experiments.texts import text_tokens
    model = _model(cell["model"])
    if cell["model"] == "tiny-mla":
        from kvquant.models.tiny_mla import ORACLE_NEW_TOKENS, ORACLE_PROMPT
        prompt = list(ORACLE_PROMPT)
        tokens = prompt + greedy(model, prompt, ORACLE_NEW_TOKENS, "f32")
        source = "the engine's protocol sequence (12 prompt + 20 greedy f32 tokens)"
    else:
        text_ids, text = text_tokens(model, cell.get("text", "pydoc"))
        start = int(cell["start"])
        tokens = text_ids[start:start + cell["window"]].tolist()
        source = f"{text.source} tokens {start}..{start + len(tokens) - 1}"
    ref = model.forward(tokens, model.new_cache("f32"))
    ref_top = ref.argmax(axis=1)
    flipped, kld = [], []
    for spec in cell["codecs"]:
        logits = model.forward(tokens, model.new_cache(spec))
        flipped.append((logits.argmax(axis=1) != ref_top).astype(int).tolist())
        kld.append(kl_rows(ref, logits).tolist())
    return {"available": True, "model": cell["model"], "codecs": list(cell["codecs"]),
            "source": source, "n_positions": len(tokens), "flipped": flipped, "kld": kld}


def position_cells(model_name, codecs, smoke=None, text="pydoc", n_groups=1):
    """Cells of the position strip: the codecs cut into ``n_groups`` groups (each cell runs
    its own f32 reference; :func:`merge_positions` joins them)."""
    smoke = is_smoke() if smoke is None else smoke
    codecs = list(codecs)
    n_groups = max(1, min(int(n_groups), len(codecs)))
    cells = []
    for gi in range(n_groups):
        cell = {"sweep": "flip_positions", "model": model_name, "codecs": codecs[gi::n_groups]}
        if n_groups > 1:
            cell["group"] = f"{gi + 1}of{n_groups}"
        if model_name != "tiny-mla":
            cell.update(window=SMOKE_WINDOW if smoke else POSITION_WINDOW[model_name], start=0,
                        **_text_params(text))
        cells.append(cell)
    return cells


def position_stem(cell):
    stem = f"positions_{cell['model']}_n{len(cell['codecs'])}"
    if "group" in cell:
        stem += f"_{cell['group']}"
    if "window" in cell:
        stem += f"_w{cell['window']}_s{cell['start']}"
    return stem + _text_tag(cell)


def merge_positions(results, order):
    """One position strip from the cells' results, codecs in ``order``."""
    first = results[0]
    for res in results[1:]:
        if (res["source"], res["n_positions"]) != (first["source"], first["n_positions"]):
            raise ValueError("position cells of one strip ran on different tokens: "
                             f"{first['source']} and {res['source']}")
    rows = {c: (f, k) for res in results for c, f, k in zip(res["codecs"], res["flipped"],
                                                             res["kld"])}
    codecs = [c for c in order if c in rows]
    return {**first, "codecs": codecs, "flipped": [rows[c][0] for c in codecs],
            "kld": [rows[c][1] for c in codecs]}


def pareto_points(table):
    """(codec, bits per value, KLD, kind of KLD) per row of a flip table; f32 excluded.

    Bits per value count every stored byte (:func:`kvquant_experiments.flip_storage.add_storage`):
    the codes and side values of each token, plus the fixed bytes of stream options (f32 sinks,
    recent-window copies, offsets, scales) spread over the context of one text chunk (or the
    protocol's sequence), as the tables' B/token. The KLD is the real-text mean when the table
    has text, else the teacher-forced mean.
    """
    from kvquant_experiments.flip_storage import add_storage
    rows = add_storage(table["rows"], table["meta"])
    key = "kld_mean" if "kld_mean" in rows[0] else "tf_kld_mean"
    return [{"codec": r["codec"], "bits_per_value": r["bits_per_value"], "kld": r[key],
             "kld_kind": key} for r in rows if r["codec"] != "f32"]


def pareto_front(points, key="kld"):
    """Indices of points not beaten on both bits and ``points[i][key]``, by increasing bits."""
    order = sorted(range(len(points)), key=lambda i: (points[i]["bits_per_value"],
                                                      points[i][key]))
    front, best = [], float("inf")
    for i in order:
        if points[i][key] < best:
            front.append(i)
            best = points[i][key]
    return front


def write_table(table, out_dir, unavailable):
    """Write the merged table as ``kvquant flips`` does, plus the unavailable codecs."""
    from kvquant_experiments.flip_files import write_results
    table = dict(table)
    table["meta"] = {**table["meta"], "unavailable": unavailable, "environment": environment()}
    return write_results(table, out_dir, figure=False)[:2]


def read_table(path):
    return read_json(Path(path))


def save_positions(result, path):
    write_json(path, result)
    return path


def submit_model(model_name, results_dir, executor=None, smoke=None, codecs=None, sizes=None,
                 n_groups=1, resume=True, text="pydoc", progress=False):
    """Submit the table and position cells of one model; returns a handle for :func:`finish`.

    ``sizes`` (real model): ``positions``, ``chunk_tokens``, ``prompts`` (default
    :data:`REAL_DEFAULTS`); ``text``: the real model's text (a built-in name or a UTF-8 file,
    :func:`kvquant_experiments.texts.load_text`). Codecs the model cannot take are kept with
    their reason.
    """
    from kvquant_experiments.executor import submit_cells
    smoke = is_smoke() if smoke is None else smoke
    codecs = report_codecs(model_name, smoke) if codecs is None else list(codecs)
    ok, missing = available_codecs(model_name, codecs)
    if model_name != "tiny-mla":
        sizes = {**(SMOKE_REAL if smoke else REAL_DEFAULTS), **(sizes or {}), "text": text}
    else:
        sizes = {}
    flips_dir = Path(results_dir) / "flips"
    tables = submit_cells(table_cell, table_cells(model_name, ok, n_groups, **sizes), flips_dir,
                          table_stem, executor, resume, progress, desc=f"{model_name} flip table")
    # the real model's strip in as many cells as tables: the cells then share the workers
    # evenly (one strip cell after one table cell held the report's wall time)
    position_groups = n_groups if model_name != "tiny-mla" else 1
    positions = submit_cells(position_cell, position_cells(model_name, ok, smoke,
                                                           sizes.get("text", "pydoc"),
                                                           position_groups), flips_dir,
                             position_stem, executor, resume, progress,
                             desc=f"{model_name} flip positions")
    return {"model": model_name, "codecs": ok, "unavailable": missing, "tables": tables,
            "positions": positions, "dir": flips_dir}


def finish(handle):
    """Wait for a :func:`submit_model` handle; write the merged table (``kvquant flips`` format)
    and the position strip data.

    Returns
    -------
    dict with ``table`` (merged), ``positions``, ``unavailable``, ``table_json``, ``table_csv``,
    ``positions_json``, ``reused`` (cells taken from stored files).
    """
    results = handle["tables"].wait()
    position_results = handle["positions"].wait()
    for res in results + position_results:
        if res.get("failed"):
            raise RuntimeError(f"{handle['model']}: a flip cell {res['reason']}\n"
                               f"{res.get('traceback', '')}")
    table = merge_tables(results, handle["codecs"])
    positions = merge_positions(position_results, handle["codecs"])
    table_json, table_csv = write_table(table, handle["dir"], handle["unavailable"])
    pos_json = save_positions(positions, handle["dir"] / f"positions_{handle['model']}.json")
    return {"model": handle["model"], "table": table, "positions": positions,
            "unavailable": handle["unavailable"], "table_json": table_json,
            "table_csv": table_csv, "positions_json": pos_json,
            "reused": handle["tables"].reused + handle["positions"].reused,
            "work_seconds": handle["tables"].work_seconds + handle["positions"].work_seconds,
            "computed": handle["tables"].computed + handle["positions"].computed}


def run_model(model_name, results_dir, executor=None, **kwargs):
    """:func:`submit_model` then :func:`finish` (blocking; serial when no executor is given)."""
    return finish(submit_model(model_name, results_dir, executor, **kwargs))


if __name__ == "__main__":
    import sys
    sys.exit("kvquant_experiments.flip_report is a section of the report, not a command: run "
             "kvquant report (kvquant report --help), or kvquant distortion for one table")
