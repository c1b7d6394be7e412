"""A GGUF file read defensively: metadata and tensor directory parsed with every count, length,
offset and type checked against the file's size before anything is allocated.

The format (GGUF v2/v3, as ggml's ``docs/gguf.md`` specifies it; little-endian only):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x       (key: string, value type: u32, value)
    n_tensors x  (name: string, n_dims: u32, dims: n_dims x u64, ggml type: u32, offset: u64)
    padding to ``general.alignment`` (default 32), then the tensor data; each tensor's offset is
    relative to that point and aligned.

    string = length u64 + UTF-8 bytes; array = item type u32 + count u64 + items.

Why not ``gguf.GGUFReader``: it builds a numpy view per metadata element (seconds for a 262k-word
vocabulary) and trusts the counts it reads (an array claiming 2^40 elements loops past the end of
the file; tensor offsets are not checked, so a shifted tensor loads silently). Here a damaged file
is a ``GGUFFileError`` naming the file and the field, raised before any allocation beyond the
file's own size. Tensors stay memory-mapped; the gguf package's quantizers dequantize them.
"""
import functools
import os
import struct

import numpy as np

__all__ = ["GGUFFile", "GGUFFileError", "GGUFTensor"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                        # GGML_MAX_DIMS

# value type -> struct format of a scalar (GGUF value types 0..12; 8 string, 9 array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class GGUFFileError(ValueError):
    """A GGUF file this reader refuses: the message names the file and what is wrong."""


class GGUFTensor:
    """One tensor of a :class:`GGUFFile`.

    Attributes
    ----------
    name : str
    tensor_type : gguf.GGMLQuantizationType
    shape : tuple of int
        As ggml lists it (fastest-varying first): a matrix of ``rows`` rows of ``cols`` values
        is ``(cols, rows)``.
    n_elements : int
    offset : int
        Of its first byte in the file.
    data : ndarray (a read-only view of the mapped file)
        float32 or float16 values in numpy order for F32/F16; for block-quantized types the
        bytes, shape ``(..., rows, bytes per row)``: what ``gguf.quants.dequantize`` takes.
    """

    __slots__ = ("name", "tensor_type", "shape", "n_elements", "offset", "data")

    def __init__(self, name, tensor_type, shape, n_elements, offset, data):
        self.name, self.tensor_type, self.shape = name, tensor_type, shape
        self.n_elements, self.offset, self.data = n_elements, offset, data


class _Cursor:
    """Bounds-checked little-endian reads from the mapped bytes."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path
        self.where = "the header"

    def fail(self, what):
        raise GGUFFileError(f"{self.path}: {what} (in {self.where}, at byte {self.pos}); the "
                            "file is damaged or not a GGUF file this reader knows")

    def need(self, n, what):
        if n > self.size - self.pos:
            self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain before the "
                      f"end of the file ({self.size} bytes)")

    def scalar(self, fmt, what):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what):
        n = self.scalar("<Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes claimed)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")


class GGUFFile:
    """The metadata and tensors of a GGUF file.

    Parameters
    ----------
    path : str

    Attributes
    ----------
    version : int
    metadata : dict
        Key -> value: Python scalars (int, float, bool, str) or lists of them.
    tensors : dict
        Name -> :class:`GGUFTensor`, in file order.
    data_offset : int
        Where the tensor data begins.

    Raises
    ------
    GGUFFileError
        Anything malformed: a count or length past the end of the file, an unknown value or
        tensor type, a duplicate key or tensor, a tensor outside the data section, misaligned
        or overlapping another, a block-quantized row of a width its blocks do not divide.
    """

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        if size < 24:
            raise GGUFFileError(f"{path}: {size} bytes is too short for a GGUF header (24 bytes); "
                                "not a GGUF file")
        self._map = np.memmap(path, mode="r", dtype=np.uint8)
        cur = _Cursor(memoryview(self._map), path)
        magic = bytes(self._map[:4])
        if magic != MAGIC:
            raise GGUFFileError(f"{path}: starts with {magic!r}, not b'GGUF': not a GGUF file")
        cur.pos = 4
        self.version = cur.scalar("<I", "the version")
        if self.version not in VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            if swapped in VERSIONS:
                raise GGUFFileError(f"{path}: a big-endian GGUF file; only little-endian files "
                                    "are read (convert it with gguf's tools)")
            raise GGUFFileError(f"{path}: GGUF version {self.version}; versions "
                                f"{', '.join(map(str, VERSIONS))} are read")
        n_tensors = cur.scalar("<Q", "the tensor count")
        n_kv = cur.scalar("<Q", "the metadata count")
        # each key-value takes >= 13 bytes (key length, type, a 1-byte value) and each tensor
        # entry >= 32: counts beyond what the file can hold are refused before any loop
        if n_kv * 13 > size - cur.pos:
            cur.fail(f"the header claims {n_kv} metadata entries, more than the file can hold")
        if n_tensors * 32 > size - cur.pos:
            cur.fail(f"the header claims {n_tensors} tensors, more than the file can hold")
        self.metadata = {}
        for i in range(n_kv):
            cur.where = f"metadata entry {i}"
            key = cur.string("a metadata key")
            cur.where = f"metadata {key!r}"
            if key in self.metadata:
                cur.fail(f"metadata key {key!r} appears twice")
            self.metadata[key] = self._value(cur, cur.scalar("<I", "a value type"))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
                or alignment & (alignment - 1)):
            raise GGUFFileError(f"{path}: general.alignment is {alignment!r}; it must be a "
                                "power of two")
        entries = []
        for i in range(n_tensors):
            cur.where = f"tensor entry {i}"
            name = cur.string("a tensor name")
            cur.where = f"tensor {name!r}"
            n_dims = cur.scalar("<I", "the number of dimensions")
            if not 1 <= n_dims <= MAX_DIMS:
                cur.fail(f"{n_dims} dimensions (1 to {MAX_DIMS} are possible)")
            dims = tuple(cur.scalar("<Q", "a dimension") for _ in range(n_dims))
            entries.append((name, dims, cur.scalar("<I", "the tensor type"),
                            cur.scalar("<Q", "the data offset")))
        self.data_offset = -(-cur.pos // alignment) * alignment
        self.tensors = {}
        spans = []
        for name, dims, type_id, rel in entries:
            t = self._tensor(name, dims, type_id, rel, alignment, size)
            if name in self.tensors:
                raise GGUFFileError(f"{path}: tensor {name!r} appears twice")
            self.tensors[name] = t
            spans.append((t.offset, t.offset + t.data.nbytes, name))
        spans.sort()
        for (a0, a1, a), (b0, _, b) in zip(spans, spans[1:]):
            if b0 < a1:
                raise GGUFFileError(f"{path}: tensors {a!r} and {b!r} overlap in the file "
                                    f"(bytes {a0}-{a1} and from {b0}); the file is damaged")

    def _value(self, cur, vtype, in_array=False):
        if vtype in _SCALARS:
            return cur.scalar(_SCALARS[vtype], "a value")
        if vtype == STRING:
            return cur.string("a string value")
        if vtype == ARRAY and not in_array:
            item = cur.scalar("<I", "an array's item type")
            count = cur.scalar("<Q", "an array's length")
            if item in _NUMPY:
                width = np.dtype(_NUMPY[item]).itemsize
                cur.need(count * width, f"an array of {count} items")
                values = np.frombuffer(cur.buf, _NUMPY[item], count, cur.pos)
                cur.pos += count * width
                return values.astype(bool).tolist() if item == 7 else values.tolist()
            if item == STRING:
                cur.need(count * 8, f"an array of {count} strings")
                return [cur.string("a string in an array") for _ in range(count)]
            if item == ARRAY:
                cur.fail("an array of arrays (not used by any model this reader loads)")
            cur.fail(f"unknown array item type {item}")
        cur.fail(f"unknown value type {vtype}")

    def _tensor(self, name, dims, type_id, rel, alignment, size):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        where = f"{self.path}: tensor {name!r}"
        try:
            ttype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise GGUFFileError(f"{where} has unknown ggml type {type_id}") from None
        if ttype not in _readable_types():
            raise GGUFFileError(f"{where} is of type {ttype.name}, which no weight reader here "
                                "dequantizes")
        if min(dims) < 1:
            raise GGUFFileError(f"{where} has shape {dims} with an empty dimension")
        if dims[0] % block:
            raise GGUFFileError(f"{where}: rows of {dims[0]} values are not whole {ttype.name} "
                                f"blocks of {block}")
        n_elements = 1
        for d in dims:
            n_elements *= d
        nbytes = n_elements // block * type_size
        if rel % alignment:
            raise GGUFFileError(f"{where}: data offset {rel} is not a multiple of the alignment "
                                f"{alignment}")
        start = self.data_offset + rel
        if start + nbytes > size:
            raise GGUFFileError(f"{where}: its {nbytes} bytes from byte {start} run past the end "
                                f"of the file ({size} bytes); the file is truncated or damaged")
        raw = self._map[start:start + nbytes]
        np_shape = tuple(reversed(dims))
        if ttype == GGMLQuantizationType.F32:
            data = raw.view("<f4").reshape(np_shape)
        elif ttype == GGMLQuantizationType.F16:
            data = raw.view("<f2").reshape(np_shape)
        else:
            data = raw.reshape(np_shape[:-1] + (dims[0] // block * type_size,))
        return GGUFTensor(name, ttype, dims, n_elements, start, data)


@functools.lru_cache(maxsize=1)
def _readable_types():
    """The ggml types ``gguf.quants.dequantize`` turns into float32 (found by asking it once)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    ok = set()
    for ttype, (_, type_size) in GGML_QUANT_SIZES.items():
        if ttype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            ok.add(ttype)
            continue
        if ttype.name.startswith(("I8", "I16", "I32", "I64", "F64")):
            continue                # integer/f64 tensors are no weights of these models
        try:
            dequantize(np.zeros((1, type_size), np.uint8), ttype)
        except (NotImplementedError, ValueError, TypeError, AssertionError):
            continue
        ok.add(ttype)
    return frozenset(ok)
