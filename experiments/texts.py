"""Texts to measure on: named texts that ship with every Python, or any UTF-8 file.

A *text* argument (``kvquant flips --text``, ``python -m experiments.frontier --text``,
``kvquant report --text``, ``run_flips(text=...)``) is one of the names of :data:`TEXTS` or the
path of a UTF-8 text file. :func:`load_text` resolves it; :func:`text_tokens` encodes it with a
model's tokenizer. The contents of the named texts depend on the Python version, which the
results record.
"""
import hashlib
import importlib.util
import os
from dataclasses import dataclass

__all__ = [
    "CODE_MODULES",
    "DOCSTRING_MODULES",
    "TEXTS",
    "Text",
    "docstrings_text",
    "load_text",
    "pydoc_text",
    "stdlib_code_text",
    "text_tokens",
]


def pydoc_text():
    """The text of ``pydoc_data.topics``, topics in sorted order, separated by blank lines."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


# Pure-Python standard-library modules: source code, a second kind of real text beside the
# reference prose of pydoc topics (so that a result is not tuned to one text).
CODE_MODULES = ("argparse", "difflib", "textwrap", "fractions", "statistics", "calendar",
                "shlex", "pprint", "dataclasses", "heapq", "string", "bisect", "enum")


def stdlib_code_text():
    """Source files of :data:`CODE_MODULES`, in that order, separated by blank lines."""
    parts = []
    for name in CODE_MODULES:
        with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
            parts.append(f.read().strip())
    return "\n\n".join(parts)


# Modules whose docstrings make a third kind of text: API prose written beside the code (short
# paragraphs, parameter lists, doctest examples), neither the reference manual nor source.
DOCSTRING_MODULES = ("collections", "itertools", "functools", "pathlib", "json", "re",
                     "subprocess", "threading", "logging", "unittest", "email", "http.client",
                     "urllib.parse", "decimal", "datetime", "inspect", "ast", "zipfile")


def docstrings_text():
    """Docstrings of :data:`DOCSTRING_MODULES` (the module's, then its public classes and
    functions' in name order, methods after their class), separated by blank lines."""
    import importlib
    import inspect
    parts = []
    for name in DOCSTRING_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                parts.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for m_name, member in sorted(vars(obj).items()):
                    if not m_name.startswith("_") and inspect.isfunction(member):
                        parts.append(inspect.getdoc(member) or "")
    return "\n\n".join(p.strip() for p in parts if p and p.strip())


# name -> (description for results, loader)
TEXTS = {
    "pydoc": ("pydoc_data.topics (the Python reference manual's topics, prose)", pydoc_text),
    "code": ("Python standard-library source (" + ", ".join(CODE_MODULES) + ")",
             stdlib_code_text),
    "docstrings": ("docstrings of Python standard-library modules ("
                   + ", ".join(DOCSTRING_MODULES) + ")", docstrings_text),
}
MIN_CHARS = 1
# A text is tokenized whole (the chunks are spread over all of it), which costs ~170 bytes of
# memory and ~2 s per MB of text with these tokenizers: a file beyond this is refused up front
# (a 100 MB file ended in the tokenizer's out-of-memory abort).
MAX_TEXT_BYTES = 8 << 20


@dataclass(frozen=True)
class Text:
    """A resolved text: ``name`` (for file names: the built-in name or the file's stem),
    ``source`` (a description for results), ``path`` (None for built-in texts), the ``text``
    itself and the SHA-256 of its UTF-8 bytes."""
    name: str
    source: str
    path: str
    text: str
    sha256: str

    def describe(self):
        """Fields for a result's metadata (everything but the text)."""
        return {"name": self.name, "source": self.source, "path": self.path,
                "sha256": self.sha256, "chars": len(self.text)}


def _file_name(path):
    stem = os.path.splitext(os.path.basename(path))[0] or "text"
    return "".join(c if c.isalnum() or c in "._+-" else "_" for c in stem)


def load_text(text):
    """Resolve a text argument: a name of :data:`TEXTS` or the path of a UTF-8 file.

    Parameters
    ----------
    text : str or os.PathLike

    Returns
    -------
    Text

    Raises
    ------
    ValueError
        Neither a built-in name nor an existing file; a file that is not UTF-8 (the message
        gives the byte offset) or holds no text.
    """
    if isinstance(text, str) and text in TEXTS:
        source, load = TEXTS[text]
        body = load()
        return Text(text, source, None, body, hashlib.sha256(body.encode("utf-8")).hexdigest())
    path = os.fspath(text)
    if not os.path.isfile(path):
        raise ValueError(f"text {path!r} is neither a built-in text ({', '.join(TEXTS)}) nor a "
                         "file; give one of those names or the path of a UTF-8 text file")
    size = os.path.getsize(path)
    if size > MAX_TEXT_BYTES:
        raise ValueError(f"text file {path!r} is {size / 2**20:.1f} MiB; texts are tokenized "
                         f"whole, up to {MAX_TEXT_BYTES >> 20} MiB: cut it first (e.g. head -c "
                         f"{MAX_TEXT_BYTES >> 20}M {path} > shorter.txt)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        body = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"text file {path!r} is not UTF-8 (byte {exc.start}: {exc.reason}); "
                         "convert it first, e.g. iconv -t UTF-8") from None
    body = body.removeprefix("\ufeff")
    if len(body.strip()) < MIN_CHARS:
        raise ValueError(f"text file {path!r} holds no text")
    return Text(_file_name(path), f"file {os.path.basename(path)}", os.path.abspath(path),
                body, hashlib.sha256(raw).hexdigest())


def text_tokens(model, text="pydoc"):
    """Token ids of a text (see :func:`load_text`) with ``model``'s tokenizer.

    Returns
    -------
    (ndarray of int64, Text)
    """
    resolved = text if isinstance(text, Text) else load_text(text)
    if not hasattr(model, "encode"):
        raise ValueError(f"model {getattr(model, 'name', model)!r} has no tokenizer, so it "
                         "cannot read a text")
    return model.encode(resolved.text), resolved
