"""Bytes per token and the context a RAM budget holds, from :mod:`kvquant.budget`.

The GLM-5.2 rows of the engine (latent L 512 wide + roped key R 64 wide per layer and token) are
checked against the engine's numbers of docs/reference.md §1.6; SmolLM2 and the tiny model follow.
"""
from kvquant_experiments.common import codec_status

__all__ = ["REFERENCE_LAYER_ROW_BYTES", "SPECS", "budget_section_data"]

# docs/reference.md §1.6: bytes per layer-row per token at GLM-5.2 shapes (L 512 + R 64).
REFERENCE_LAYER_ROW_BYTES = {"f32": 2304, "kv8": 584, "tq4": 296, "tq4:compat=colibri": 296,
                             "polar2": 116, "polar3": 188, "polar4": 260, "polar5": 332,
                             "polar6": 404}
SPECS = ["f32", "kv8", "kv8-g32", "tq8", "tq4", "tq4:compat=colibri", "tq3", "tq2", "polar6",
         "polar5", "polar4", "polar3", "polar2", "q8_0", "q4_0"]
MODELS = ("glm-5.2", "smollm2")
RAM = "64GB"
CONTEXTS = (32768, 131072, 262144)


def budget_section_data(specs=SPECS, models=MODELS, ram=RAM, contexts=CONTEXTS):
    """Per model: the budget table and its markdown, codecs left out with the reason, and the
    GLM-5.2 check against the engine.

    Returns
    -------
    (data, None), or (None, reason) when :mod:`kvquant.budget` is not in the build.
    """
    try:
        from kvquant import budget
    except ImportError as exc:
        return None, f"kvquant.budget is not in this build ({exc})"
    if not all(callable(getattr(budget, n, None)) for n in ("budget_table", "format_table",
                                                           "load_shape")):
        return None, "kvquant.budget lacks budget_table / format_table / load_shape"
    out = {"models": {}, "ram": ram}
    for name in models:
        shape = budget.load_shape(name)
        rows = budget.budget_table(shape, specs, ram_bytes=ram, contexts=contexts)
        done = {r["codec"] for r in rows}
        missing = {}
        for spec in specs:
            if spec in done:
                continue
            reasons = [codec_status(spec, s.dim)[1] for s in shape.streams]
            missing[spec] = next((r for r in reasons if r), "the budget table left it out")
        out["models"][name] = {"rows": rows, "unavailable": missing,
                               "markdown": budget.format_table(shape, rows, ram, 1)}
    checks = []
    for r in out["models"].get("glm-5.2", {}).get("rows", []):
        ref = REFERENCE_LAYER_ROW_BYTES.get(r["codec"])
        if ref is not None:
            checks.append({"codec": r["codec"], "bytes": r["layer_row_bytes"], "engine": ref,
                           "match": r["layer_row_bytes"] == ref})
    out["glm_checks"] = checks
    return out, None


if __name__ == "__main__":
    import sys
    sys.exit("kvquant_experiments.memory is a section of the report, not a command: run "
             "kvquant report (kvquant report --help), or kvquant distortion for one table")
