"""Shared by the cache-file tests: small shapes, encoded rows, and .coli_kv bytes built by hand
from docs/reference.md §1.7 with struct (independent of kvquant.kvfile's writer)."""
import signal
import struct
from contextlib import contextmanager

import numpy as np

from kvquant import get_codec
from kvquant.kvfile import KVFileShape

# The engine's tiny oracle widths (kv_lora 32, qk_rope 8), 3 layers, a 2-layer indexer of width 4.
SHAPE = KVFileShape(n_layers=3, kv_lora=32, qk_rope=8, index_hd=4, n_index_layers=2, vocab=256)
ENGINE_MODES = {"v1": "f32", "v2": "kv8", "v3": "tq4:compat=colibri"}
HAND_MAGIC = {"v1": b"COLIKV1\x00", "v2": b"COLIKV2\x00", "v3": b"COLIKV3\x00"}


def make_rows(rng, n, shape=SHAPE, mode="kv8", codec_factory=get_codec):
    """tokens (n,), L and R as lists of EncodedRows per layer, index floats (n, nic, hd)."""
    cl = codec_factory(mode, shape.kv_lora)
    cr = codec_factory(mode, shape.qk_rope)
    Lf = rng.standard_normal((n, shape.n_layers, shape.kv_lora)).astype(np.float32)
    Rf = rng.standard_normal((n, shape.n_layers, shape.qk_rope)).astype(np.float32)
    return {
        "tokens": rng.integers(0, shape.vocab or 1000, n).astype(np.int32),
        "L": [cl.encode(Lf[:, j], n_threads=1) for j in range(shape.n_layers)],
        "R": [cr.encode(Rf[:, j], n_threads=1) for j in range(shape.n_layers)],
        "index": rng.standard_normal((n, shape.n_index_layers, shape.index_hd)).astype(
            np.float32),
        "Lf": Lf, "Rf": Rf,
    }


def hand_engine_bytes(tier, shape, tag, rows, count=None):
    """The bytes of a .coli_kv file, laid out field by field from docs/reference.md §1.7."""
    tokens = rows["tokens"]
    n = len(tokens)
    out = bytearray(HAND_MAGIC[tier])
    out += struct.pack("<8i", shape.n_layers, shape.kv_lora, shape.qk_rope, shape.index_hd,
                       shape.n_index_layers, shape.vocab, n if count is None else count, tag)
    for t in range(n):
        out += struct.pack("<i", int(tokens[t]))
        for layer in range(shape.n_layers):
            L, R = rows["L"][layer], rows["R"][layer]
            if tier == "v1":
                out += struct.pack(f"<{shape.kv_lora}f", *rows["Lf"][t, layer].tolist())
                out += struct.pack(f"<{shape.qk_rope}f", *rows["Rf"][t, layer].tolist())
            else:
                out += bytes(L.codes[t]) + struct.pack("<f", float(L.side[t, 0]))
                out += bytes(R.codes[t]) + struct.pack("<f", float(R.side[t, 0]))
        for j in range(shape.n_index_layers):
            out += struct.pack(f"<{shape.index_hd}f", *rows["index"][t, j].tolist())
    return bytes(out)


def engine_record_bytes(tier, shape, mode="kv8"):
    if tier == "v1":
        per_layer = 4 * (shape.kv_lora + shape.qk_rope)
    else:
        per_layer = (get_codec(mode, shape.kv_lora).code_bytes
                     + get_codec(mode, shape.qk_rope).code_bytes + 8)
    return 4 + shape.n_layers * per_layer + 4 * shape.n_index_layers * shape.index_hd


def records_equal(a, b, n=None):
    """Two CacheRecords hold the same first n records, byte for byte."""
    n = len(a) if n is None else n
    if len(a) < n or len(b) < n:
        return False
    if not np.array_equal(a.tokens[:n], b.tokens[:n]):
        return False
    for name in a.stream_names:
        if not np.array_equal(a.codes(name)[:n], b.codes(name)[:n]):
            return False
        sa, sb = a.side(name)[:n], b.side(name)[:n]
        if sa.tobytes() != sb.tobytes():
            return False
    return True


@contextmanager
def deadline(seconds=10):
    """Fail a call that blocks or hangs (a FIFO opened for reading, a load in a loop) after
    ``seconds`` instead of hanging the test run."""
    def boom(*_):
        raise TimeoutError(f"the call blocked or hung for {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
