"""Cache files on disk (:mod:`kvquant.kvfile`): bytes per token of each tier, a reload that gives
the same records, and a refusal under another mode.

Rows are those of the tiny MLA model (5 layers, L 32 wide, R 8 wide) over the engine's protocol
sequence, so the files are what ``kvquant`` would save for that model.
"""
import os
from pathlib import Path

import numpy as np

__all__ = ["MODES", "cache_file_rows"]

MODES = ["f32", "kv8", "tq4:compat=colibri", "polar4:compat=colibri", "tq4", "tq3:side=unbiased"]


def _tiny_rows():
    from kvquant.models import load_model
    from kvquant.models.tiny_mla import ORACLE_PROMPT
    model = load_model("tiny-mla")
    tokens = list(ORACLE_PROMPT) * 3
    cache = model.new_cache("f32")
    model.forward(tokens, cache)

    def floats(name):  # (n_tokens, n_layers, width), float32
        return np.stack([cache.stream(layer, name).decode() for layer in range(cache.n_layers)],
                        axis=1)

    return np.asarray(tokens, np.int32), floats("L"), floats("R"), model.config


def cache_file_rows(out_dir, modes=MODES):
    """Write, reopen and inspect one file per mode.

    Returns
    -------
    (rows, None), or (None, reason) when :mod:`kvquant.kvfile` lacks what this needs. Each row:
    mode, tier, file bytes, bytes per token, whether the reload equals what was written, and the
    refusal message when the file is opened under another mode; or ``available`` False with the
    reason (a codec not in this build).
    """
    try:
        from kvquant.kvfile import CacheFile, CacheFileRefused, KVFileShape, inspect_file
    except ImportError as exc:
        return None, f"kvquant.kvfile is not complete in this build ({exc})"
    from kvquant_experiments.common import codec_status
    tokens, Lf, Rf, cfg = _tiny_rows()
    shape = KVFileShape(n_layers=cfg.n_layers, kv_lora=cfg.kv_lora_rank,
                        qk_rope=cfg.qk_rope_head_dim, vocab=cfg.vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in modes:
        reason = codec_status(mode, shape.kv_lora)[1] or codec_status(mode, shape.qk_rope)[1]
        if reason:
            rows.append({"mode": mode, "available": False, "reason": reason})
            continue
        path = out_dir / f"tiny-mla_{mode.replace(':', '-').replace('=', '-')}.kvcache"
        if path.exists():
            os.unlink(path)
        with CacheFile.open(path, shape, mode=mode) as cf:
            cf.append(tokens, L=Lf, R=Rf)
            tier = cf.tier
            written = {s: [np.array(cf.records.codes(s)), np.array(cf.records.side(s))]
                       for s in ("L", "R")}
        with CacheFile.open(path, shape, mode=mode, readonly=True) as back:
            same = (back.report.status == "loaded" and len(back.records) == len(tokens)
                    and np.array_equal(back.records.tokens, tokens)
                    and all(np.array_equal(back.records.codes(s), written[s][0])
                            and np.array_equal(back.records.side(s), written[s][1])
                            for s in ("L", "R")))
        other = "tq4" if mode != "tq4" else "kv8"
        try:
            with CacheFile.open(path, shape, mode=other, readonly=True) as cf:
                refusal = f"{cf.report.status} under {other}"
                if cf.report.messages:
                    refusal += ": " + cf.report.messages[0]
        except CacheFileRefused as exc:
            refusal = f"refused under {other}: {exc}"
        refusal = refusal.replace(str(path), path.name)
        info = inspect_file(path)
        size = path.stat().st_size
        rows.append({"mode": mode, "available": True, "tier": tier, "bytes": size,
                     "tokens": len(tokens), "bytes_per_token": size / len(tokens),
                     "reload_identical": bool(same), "refusal": refusal,
                     "inspect_tier": info.get("tier")})
    return rows, None


if __name__ == "__main__":
    import sys
    sys.exit("kvquant_experiments.cache_files is a section of the report, not a command: run "
             "kvquant report (kvquant report --help), or kvquant distortion for one table")
