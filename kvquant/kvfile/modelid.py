"""A model's identity, as a kvq header records it: a string given by the caller (a digest such
as ``"sha256:<hex>"``), and :func:`model_digest`, which computes one from a model file.

A cache file's rows are only meaningful for the exact weights that produced them: a fine-tune
of the same shape reads another model's cache without any error. The model shape in the header
cannot tell them apart; an identity can.
"""
import hashlib
import os
import re
import struct

# Printable ASCII without spaces, as a digest or a name-and-digest would be written.
_MODEL_ID = re.compile(r"[!-~]{1,256}\Z")
CHUNK_BYTES = 1 << 22

# GGUF metadata value types (the GGUF format of the ggml project, docs/gguf.md): fixed sizes,
# 8 = string (u64 length + bytes), 9 = array (u32 type, u64 count, values).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_DEFAULT_ALIGNMENT = 32


def is_model_id(value):
    return isinstance(value, str) and _MODEL_ID.match(value) is not None


def check_model_id(value):
    """``value`` if it is None or a valid model identity, else ValueError."""
    if value is None or is_model_id(value):
        return value
    raise ValueError(f"model_id must be a string of 1..256 printable ASCII characters without "
                     f"spaces (e.g. 'sha256:<hex>', see kvquant.kvfile.model_digest), got "
                     f"{value!r}")


class _Reader:
    """Sequential reads of a GGUF header with bounds checks (a bad file is a ValueError)."""

    def __init__(self, f, size, path):
        self.f, self.size, self.path = f, size, path

    def take(self, n):
        if n < 0 or self.f.tell() + n > self.size:
            raise ValueError(f"{self.path}: the GGUF header runs past the end of the file")
        return self.f.read(n)

    def unpack(self, fmt):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))

    def string(self):
        (n,) = self.unpack("Q")
        return self.take(n)

    def skip_value(self, vtype, depth=0):
        if vtype in _GGUF_SIZES:
            self.take(_GGUF_SIZES[vtype])
        elif vtype == _GGUF_STRING:
            self.string()
        elif vtype == _GGUF_ARRAY and depth < 4:
            etype, count = self.unpack("IQ")
            if etype in _GGUF_SIZES:
                self.take(_GGUF_SIZES[etype] * count)
            else:
                for _ in range(count):
                    self.skip_value(etype, depth + 1)
        else:
            raise ValueError(f"{self.path}: GGUF metadata value type {vtype} unknown")


def gguf_data_offset(path):
    """Byte offset of the tensor data region of a GGUF file (version 2 or 3): after the
    metadata and the tensor infos, aligned to ``general.alignment`` (default 32)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        r = _Reader(f, size, path)
        magic, version = r.unpack("4sI")
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version}; this reader knows 2 and 3")
        n_tensors, n_kv = r.unpack("QQ")
        alignment = _GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = r.string()
            (vtype,) = r.unpack("I")
            if key == b"general.alignment" and vtype == 4:
                (alignment,) = r.unpack("I")
            else:
                r.skip_value(vtype)
        for _ in range(n_tensors):
            r.string()
            (n_dims,) = r.unpack("I")
            r.take(8 * n_dims + 4 + 8)   # dims, type, offset
        if alignment == 0:
            raise ValueError(f"{path}: general.alignment is 0")
        pos = f.tell()
    return (pos + alignment - 1) // alignment * alignment


def model_digest(path, chunk_bytes=CHUNK_BYTES):
    """A model identity for the file at ``path``: ``"gguf-tensors-sha256:<hex>"``, the SHA-256
    of a GGUF file's tensor data region (from its data offset to the end of the file: the
    weights, not the metadata, so that editing a name or a chat template keeps the identity),
    or ``"sha256:<hex>"`` of the whole file for any other file. Read in chunks of
    ``chunk_bytes``.

    The GGUF digest is the one ``tail -c +$((offset + 1)) FILE | sha256sum`` gives, offset
    being the data offset.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    start = gguf_data_offset(path) if is_gguf else 0
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            chunk = f.read(chunk_bytes)
            if not chunk:
                break
            h.update(chunk)
    return ("gguf-tensors-sha256:" if is_gguf else "sha256:") + h.hexdigest()
