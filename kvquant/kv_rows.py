"""The file of a model's cache rows that ``kvquant dump-kv`` writes and ``kvquant distortion
--data`` and the notebooks read.

The file is a ``.npz`` archive (numpy, no pickle):

* one array per cache stream, named as the stream (``k`` and ``v`` on the Llama-family models:
  keys after RoPE, values; ``L`` and ``R`` on the tiny MLA model), of shape
  (n_layers, n_kv_heads, positions, width), float32, read from an f32 cache after one prefill;
* ``meta``: a JSON string (model description, text, positions, start, layout of the arrays).
"""
import json
import os
import zipfile

import numpy as np

from kvquant.outputs import atomic_write

__all__ = ["FORMAT", "load_kv_rows", "select_rows", "write_kv_rows"]

FORMAT = "kvquant-kv-rows/1"
STREAM_NOTES = {"k": "keys after RoPE", "v": "values", "L": "MLA latent rows (after its norm)",
                "R": "MLA rope rows (after RoPE)"}


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
    except MemoryError:
        raise ValueError(f"{name!r} holds more rows than this machine's memory") from None
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
        if x.dtype.kind != "f" or x.ndim != 4 or 0 in x.shape:
            raise ValueError(f"{name!r}: stream {key!r} holds {x.dtype} of shape {x.shape}; "
                             "rows are float arrays (layer, kv_head, position, width), none "
                             "of them empty")
    return arrays, meta


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}


# Deflate's largest ratio (a run of one byte: 258 bytes per 2-bit code, about 1032:1), so a
# deflated member of n bytes decompresses to at most this many times n
MAX_DEFLATE_RATIO = 1032


def _check_member_sizes(path):
    """Each array's header against its stored size, before numpy allocates what a header
    claims (a damaged header claiming 2^33 rows would allocate them first). The sizes in the
    archive's directory are numbers of the file as well: a member's compressed bytes must lie
    inside the file, and what they can decompress to must hold the array."""
    archive_size = os.path.getsize(path)
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise ValueError(f"member {info.filename!r} is compressed by method "
                                 f"{info.compress_type}; numpy writes stored or deflated "
                                 "members only")
            if info.header_offset + info.compress_size > archive_size:
                raise ValueError(f"member {info.filename!r} claims {info.compress_size} bytes "
                                 f"from byte {info.header_offset}, past the end of the "
                                 f"{archive_size}-byte file")
            most = info.compress_size * (MAX_DEFLATE_RATIO if info.compress_type
                                         == zipfile.ZIP_DEFLATED else 1)
            if info.file_size > most + 64:      # + the smallest entries' fixed overhead
                raise ValueError(f"member {info.filename!r} claims {info.file_size} bytes, but "
                                 f"its {info.compress_size} stored bytes hold at most {most}")
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
