"""What a cache file holds per token: the MLA model shape of the engine's tiers and the streams
of ours."""
import re
from dataclasses import dataclass

import numpy as np

INT32_MAX = 2**31 - 1
# The engine's "< 3.4e38f" bound on side values (a float32 literal, just below FLT_MAX).
SIDE_MAX = np.float32(3.4e38)
STREAM_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,31}\Z")


def _check_int(value, name, low, high=INT32_MAX):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
            low <= value <= high):
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class KVFileShape:
    """The model shape an MLA cache file belongs to (the engine's header words h0..h5).

    Parameters
    ----------
    n_layers : int
        Layers with a cache row (L and R) per token.
    kv_lora : int
        Width of the latent row L.
    qk_rope : int
        Width of the rope row R.
    index_hd : int, default 0
        Width of an indexer row (f32); 0 when the model has no indexer.
    n_index_layers : int, default 0
        Layers owning an indexer row.
    vocab : int, default 0
        Vocabulary size; token ids must lie in [0, vocab) when it is > 0.
    """

    n_layers: int
    kv_lora: int
    qk_rope: int
    index_hd: int = 0
    n_index_layers: int = 0
    vocab: int = 0

    def __post_init__(self):
        _check_int(self.n_layers, "n_layers", 1)
        _check_int(self.kv_lora, "kv_lora", 1)
        _check_int(self.qk_rope, "qk_rope", 1)
        _check_int(self.index_hd, "index_hd", 0)
        _check_int(self.n_index_layers, "n_index_layers", 0)
        _check_int(self.vocab, "vocab", 0)

    @property
    def engine_words(self):
        """Header words h0..h5 as the engine writes them."""
        return (self.n_layers, self.kv_lora, self.qk_rope, self.index_hd, self.n_index_layers,
                self.vocab)

    @property
    def has_index(self):
        return self.index_hd > 0 and self.n_index_layers > 0

    def as_dict(self):
        return {"kind": "mla", "n_layers": self.n_layers, "kv_lora": self.kv_lora,
                "qk_rope": self.qk_rope, "index_hd": self.index_hd,
                "n_index_layers": self.n_index_layers, "vocab": self.vocab}

    def streams(self, mode):
        """The streams L, R (and ``index``, always f32) for ``mode``: one spec for L and R, or a
        mapping ``{"L": spec, "R": spec, "index": spec}``."""
        if isinstance(mode, str):
            specs = {"L": mode, "R": mode, "index": "f32"}
        elif isinstance(mode, dict):
            unknown = set(mode) - {"L", "R", "index"}
            if unknown or not {"L", "R"} <= set(mode):
                raise ValueError(
                    f"an MLA mode mapping needs keys 'L' and 'R' (and optionally 'index'), "
                    f"got {sorted(mode)}")
            specs = {"index": "f32", **mode}
        else:
            raise TypeError(f"mode must be a codec spec string or a mapping, got {mode!r}")
        out = [Stream("L", self.kv_lora, self.n_layers, specs["L"]),
               Stream("R", self.qk_rope, self.n_layers, specs["R"])]
        if self.has_index:
            out.append(Stream("index", self.index_hd, self.n_index_layers, specs["index"]))
        return out


@dataclass(frozen=True)
class Stream:
    """Rows of one kind stored per token: ``rows`` rows of width ``dim``, encoded by ``spec``.

    Examples: the latent rows of an MLA model, ``Stream("L", 512, rows=n_layers, spec="kv8")``;
    the keys of a GQA model, ``Stream("K", 64, rows=n_layers * n_kv_heads, spec="tq4")``.
    Row ``j`` of a token is layer ``j // n_kv_heads``, head ``j % n_kv_heads`` by convention.
    """

    name: str
    dim: int
    rows: int = 1
    spec: str = "f32"

    def __post_init__(self):
        if not isinstance(self.name, str) or not STREAM_NAME.match(self.name):
            raise ValueError(f"stream name {self.name!r} must be 1..32 characters of "
                             "[A-Za-z0-9_.-] starting with a letter")
        _check_int(self.dim, f"stream {self.name!r} dim", 1, 1 << 24)
        _check_int(self.rows, f"stream {self.name!r} rows", 1, 1 << 24)
