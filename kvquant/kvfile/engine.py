"""The engine's ``.coli_kv`` tiers v1 (f32), v2 (fp8) and v3 (rotated codecs), byte for byte
(docs/reference.md §1.7, docs/engine-arithmetic.md §6).

    offset 0   8-byte magic  COLIKV1\\0 | COLIKV2\\0 | COLIKV3\\0
    offset 8   int32 x 8     n_layers, kv_lora, qk_rope, index_hd, n_index_layers, vocab,
                             committed record count (offset 32), format tag
    offset 40  records       int32 token; per layer: v1  L f32[kv_lora], R f32[qk_rope]
                                                    v2/v3 L bytes, L side f32, R bytes, R side f32
                             then f32[index_hd] per indexer layer

The format tag is 0 (f32), 1 (fp8) or codec << 8 | bits (rotated codecs: the 4-bit Lloyd codec
is 0x104, polar b bits is b). These tiers carry no checksum: a flipped byte in a record is read
as data unless it lands in a side value and puts it out of range (or in an fp8 code as 0x7F/0xFF,
or in a token id outside the vocabulary); our self-describing tier (``kvq``) detects it.
"""
import struct

import numpy as np

MAGICS = {"v1": b"COLIKV1\0", "v2": b"COLIKV2\0", "v3": b"COLIKV3\0"}
TIER_OF_MAGIC = {m: t for t, m in MAGICS.items()}
MAGIC_PREFIX = b"COLIKV"
HEADER = struct.Struct("<8s8i")
HEADER_BYTES = HEADER.size  # 40
COUNT_OFFSET = 32
TAG_F32, TAG_FP8 = 0, 1
WORD_NAMES = ("n_layers", "kv_lora", "qk_rope", "index_hd", "n_index_layers", "vocab", "count",
              "tag")


def tier_of_tag(tag):
    """The engine tier that holds a codec with this tag."""
    return "v1" if tag == TAG_F32 else "v2" if tag == TAG_FP8 else "v3"


def spec_of_tag(tag):
    """Our codec spec for an engine tag, or None when no codec of ours has it."""
    if tag == TAG_F32:
        return "f32"
    if tag == TAG_FP8:
        return "kv8"
    codec, bits = tag >> 8, tag & 0xFF
    if tag < 0 or bits == 0 or tag > 0xFFFF:
        return None
    if codec == 1:
        return f"tq{bits}:compat=colibri"
    if codec == 0:
        return f"polar{bits}:compat=colibri"
    return None


def describe_tag(tag):
    """``"codec 1, 4-bit"`` as the engine prints a v3 tag."""
    return f"codec {tag >> 8}, {tag & 0xFF}-bit"


def describe_tier(tier, tag=None):
    """``"v2 (fp8)"``, ``"v3 (rotated, tag 0x104 = codec 1, 4-bit: tq4:compat=colibri)"``."""
    if tier == "v1":
        return "v1 (f32)"
    if tier == "v2":
        return "v2 (fp8)"
    if tier == "v3":
        if tag is None:
            return "v3 (rotated)"
        spec = spec_of_tag(tag)
        return f"v3 (rotated, tag {tag:#x} = {describe_tag(tag)}" + (f": {spec})" if spec else ")")
    return "kvq (self-describing)"


def header_bytes(tier, words6, count, tag):
    return HEADER.pack(MAGICS[tier], *words6, int(count), int(tag))


def parse_header(head):
    """(tier, words) from the first 40 bytes, or (None, None) when they are not an engine
    header."""
    if len(head) < HEADER_BYTES:
        return None, None
    magic, *words = HEADER.unpack_from(head)
    tier = TIER_OF_MAGIC.get(magic)
    return tier, (tuple(words) if tier else None)


class EngineLayout:
    """The record layout of one engine tier for one model shape and codec pair.

    Streams: ``L`` and ``R`` (one row per layer), ``index`` (f32, one row per indexer layer).
    In memory an f32 stream's codes are its raw float32 bytes, as the f32 codec stores them.
    """

    def __init__(self, tier, shape, codecs):
        self.tier = tier
        self.shape = shape
        cl, cr = codecs["L"], codecs["R"]
        if tier == "v1":
            layer = [("L", "<f4", (shape.kv_lora,)), ("R", "<f4", (shape.qk_rope,))]
            self.tag = TAG_F32
        else:
            if cl.n_side != 1 or cr.n_side != 1:
                raise ValueError("engine tiers v2/v3 store one side value per row")
            if cl.side_dtype != "f32" or cr.side_dtype != "f32":
                raise ValueError("engine tiers v2/v3 store f32 side values")
            layer = [("L", "u1", (cl.code_bytes,)), ("Ls", "<f4"),
                     ("R", "u1", (cr.code_bytes,)), ("Rs", "<f4")]
            self.tag = int(cl.engine_tag)
        fields = [("token", "<i4"), ("layers", np.dtype(layer), (shape.n_layers,))]
        if shape.has_index:
            fields.append(("index", "<f4", (shape.n_index_layers, shape.index_hd)))
        self.dtype = np.dtype(fields)
        self.record_bytes = self.dtype.itemsize

    def header(self, count):
        return header_bytes(self.tier, self.shape.engine_words, count, self.tag)

    def to_bytes(self, tokens, codes, side):
        arr = np.zeros(len(tokens), self.dtype)
        arr["token"] = tokens
        layers = arr["layers"]
        if self.tier == "v1":
            layers["L"] = np.ascontiguousarray(codes["L"]).view("<f4")
            layers["R"] = np.ascontiguousarray(codes["R"]).view("<f4")
        else:
            layers["L"] = codes["L"]
            layers["Ls"] = side["L"][..., 0]
            layers["R"] = codes["R"]
            layers["Rs"] = side["R"][..., 0]
        if self.shape.has_index:
            arr["index"] = np.ascontiguousarray(codes["index"]).view("<f4")
        return arr.tobytes()

    def from_bytes(self, buf, n):
        """(tokens, codes, side) of the first ``n`` records of ``buf`` (fresh arrays)."""
        arr = np.frombuffer(buf, self.dtype, count=n)
        tokens = arr["token"].astype(np.int32)
        layers = arr["layers"]
        codes, side = {}, {}
        if self.tier == "v1":
            for name in ("L", "R"):
                codes[name] = np.array(layers[name], dtype="<f4", order="C").view(np.uint8)
                side[name] = np.zeros((n, self.shape.n_layers, 0), np.float32)
        else:
            for name in ("L", "R"):
                codes[name] = np.array(layers[name], dtype=np.uint8, order="C")
                side[name] = np.array(layers[name + "s"], dtype=np.float32, order="C")[..., None]
        if self.shape.has_index:
            codes["index"] = np.array(arr["index"], dtype="<f4", order="C").view(np.uint8)
            side["index"] = np.zeros((n, self.shape.n_index_layers, 0), np.float32)
        return tokens, codes, side
