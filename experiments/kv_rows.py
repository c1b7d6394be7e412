"""A model's cache rows on a text, out to a file: ``kvquant dump-kv``, and the reader that
``kvquant distortion --data`` and the notebooks use.

The file is a ``.npz`` archive (numpy, no pickle):

* one array per cache stream, named as the stream (``k`` and ``v`` on the Llama-family models:
  keys after RoPE, values; ``L`` and ``R`` on the tiny MLA model), of shape
  (n_layers, n_kv_heads, positions, width), float32, read from an f32 cache after one prefill;
* ``meta``: a JSON string (model description, text, positions, start, layout of the arrays).
"""
import json
import os
import sys
import zipfile

import numpy as np

from kvquant.cli import DefaultsHelpFormatter
from kvquant.outputs import atomic_write, check_out_dir, check_out_file

__all__ = ["FORMAT", "add_cli", "dump_kv", "load_kv_rows", "main", "select_rows", "write_kv_rows"]

FORMAT = "kvquant-kv-rows/1"
STREAM_NOTES = {"k": "keys after RoPE", "v": "values", "L": "MLA latent rows (after its norm)",
                "R": "MLA rope rows (after RoPE)"}


def cache_rows(cache, layer, name, head):
    """Rows (positions, width) float32 of one layer, stream and KV head of an f32 cache."""
    return cache.stream(layer, name, head).decode()


def dump_kv(model, tokens):
    """Prefill ``tokens`` with an f32 cache; return ``{stream: (n_layers, n_kv_heads, n, width)}``.

    Parameters
    ----------
    model : a kvquant model (``new_cache``, ``forward``)
    tokens : sequence of int
    """
    cache = model.new_cache("f32")
    model.forward(np.asarray(tokens, dtype=np.int64), cache, last_only=True)
    return {name: np.stack([np.stack([cache_rows(cache, layer, name, head)
                                      for head in range(cache.n_kv_heads)])
                            for layer in range(cache.n_layers)]).astype(np.float32, copy=False)
            for name in cache.stream_names}


def write_kv_rows(path, rows, meta):
    """Write ``rows`` (from :func:`dump_kv`) and ``meta`` (JSON-compatible) to ``path``."""
    path = os.fspath(path)
    if "meta" in rows:
        raise ValueError("a stream may not be named 'meta'")
    layout = {name: {"shape": list(x.shape), "axes": ["layer", "kv_head", "position", "width"],
                     "rows": STREAM_NOTES.get(name, name)} for name, x in rows.items()}
    meta = {"format": FORMAT, **meta, "layout": layout}
    atomic_write(path, lambda f: np.savez(f, meta=np.array(json.dumps(meta)), **rows),
                 binary=True)
    return path


def load_kv_rows(path):
    """Read a file of :func:`write_kv_rows`: ``(rows, meta)``.

    Raises
    ------
    ValueError
        Not such a file (the message says what it holds).
    """
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise ValueError(f"{name!r} is not a file")
    try:
        _check_member_sizes(name)
        with np.load(name, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"cannot read {name!r} as a .npz archive: {exc}") from None
    if "meta" not in arrays:
        raise ValueError(f"{name!r} holds {sorted(arrays)}, not the rows of "
                         "`kvquant dump-kv` (no 'meta')")
    raw = arrays.pop("meta")
    try:
        if raw.ndim != 0 or raw.dtype.kind != "U":
            raise ValueError("not a JSON string")
        meta = json.loads(str(raw))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise ValueError(f"{name!r}: its 'meta' entry is {exc}: not a file of `kvquant dump-kv`") \
            from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{name!r} is format {meta.get('format')!r}, not {FORMAT!r}")
    for key, x in arrays.items():
        if x.dtype.kind != "f" or x.ndim != 4:
            raise ValueError(f"{name!r}: stream {key!r} holds {x.dtype} of shape {x.shape}; "
                             "rows are float arrays (layer, kv_head, position, width)")
    return arrays, meta


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}


def _check_member_sizes(path):
    """Each array's header against its stored size, before numpy allocates what a header
    claims (a damaged header claiming 2^33 rows would allocate them first)."""
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version not in _HEADER_READERS:
                    raise ValueError(f"member {info.filename!r}: .npy format {version}")
                shape, _, dtype = _HEADER_READERS[version](f)
                header = f.tell() if f.seekable() else None
                need = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if header is not None and need > info.file_size - header:
                    raise ValueError(f"member {info.filename!r} claims shape {shape} of {dtype} "
                                     f"({need} bytes) but holds {info.file_size - header}")


def select_rows(rows, stream=None, layer=None, head=None):
    """Rows of a dump as 2-D arrays to study: ``{label: (n, width)}``.

    Parameters
    ----------
    rows : dict from :func:`load_kv_rows`
    stream : str, optional
        One stream (``k``, ``v``, ...); default every stream, each on its own.
    layer, head : int, optional
        One layer / KV head; default all of them, rows ordered by layer, head, position.

    Raises
    ------
    ValueError
        A stream, layer or head the file does not have.
    """
    names = list(rows) if stream in (None, "all") else [stream]
    out = {}
    for name in names:
        if name not in rows:
            raise ValueError(f"no stream {name!r}; the file has {sorted(rows)}")
        x = rows[name]
        n_layers, n_heads = x.shape[:2]
        if layer is not None and not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} is outside 0..{n_layers - 1}")
        if head is not None and not 0 <= head < n_heads:
            raise ValueError(f"KV head {head} is outside 0..{n_heads - 1}")
        x = x[slice(None) if layer is None else slice(layer, layer + 1),
              slice(None) if head is None else slice(head, head + 1)]
        label = name + ("" if layer is None else f" layer {layer}") + \
            ("" if head is None else f" head {head}")
        out[label] = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
    return out


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def cmd_dump_kv(args):
    from kvquant.models import load_model
    from kvquant_experiments.flip_runs import model_tag
    from kvquant_experiments.texts import text_tokens
    try:
        if args.positions < 1:
            raise ValueError(f"--positions must be >= 1, got {args.positions}")
        if args.start < 0:
            raise ValueError(f"--start must be >= 0, got {args.start}")
        if args.out:
            check_out_file(args.out)
        else:
            check_out_dir(".")
        model = load_model(args.model)
        tokens, text = text_tokens(model, args.text)
        context = getattr(model, "context_length", None)
        if context and args.positions > context:
            raise ValueError(f"{args.positions} positions exceed the trained context of "
                             f"{args.model} ({context})")
        if tokens.size < args.start + args.positions:
            raise ValueError(f"text {text.name!r} has {tokens.size} tokens; {args.positions} "
                             f"from {args.start} need {args.start + args.positions}")
        ids = tokens[args.start:args.start + args.positions]
        rows = dump_kv(model, ids)
    except (ValueError, ImportError, OSError) as exc:
        raise SystemExit(f"kvquant dump-kv: {exc}")
    out = args.out or f"kv-rows-{model_tag(args.model)}-{text.name}-N{args.positions}.npz"
    meta = {"model": model.describe(), "model_name": str(args.model), "text": text.describe(),
            "positions": int(args.positions), "start": int(args.start),
            "cache": "f32, one prefill of the positions from an empty cache"}
    try:
        write_kv_rows(out, rows, meta)
    except OSError as exc:
        raise SystemExit(f"kvquant dump-kv: writing {out} failed ({exc.strerror or exc}); "
                         "nothing was left behind")
    for name, x in rows.items():
        print(f"{name}: {x.shape} ({STREAM_NOTES.get(name, name)})")
    print(f"wrote {out}")
    return 0


def add_cli(sub):
    """Register ``kvquant dump-kv``."""
    from kvquant_experiments.texts import TEXTS
    p = sub.add_parser(
        "dump-kv", help="write a model's K (after RoPE) and V rows on a text to .npz",
        description="Prefill a text with an f32 cache and write its rows per layer and KV head "
                    "(K after RoPE and V on Llama-family models) with their metadata; "
                    "`kvquant distortion --data FILE.npz` measures codecs on them.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="smollm2, another name load_model knows, or a GGUF file path")
    p.add_argument("--text", default="pydoc",
                   help="a UTF-8 text file or a built-in text (" + ", ".join(TEXTS) + ")")
    p.add_argument("--positions", type=int, default=512, help="tokens to prefill")
    p.add_argument("--start", type=int, default=0, help="first token of the text to use")
    p.add_argument("--out", default=None,
                   help="output .npz (default ./kv-rows-<model>-<text>-N<positions>.npz)")
    p.set_defaults(func=cmd_dump_kv)
    return p


def main(argv=None):
    """``kvquant dump-kv ...``."""
    from kvquant.cli import parse_subcommand
    args = parse_subcommand(add_cli, "dump-kv", argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
