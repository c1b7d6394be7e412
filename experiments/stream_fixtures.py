"""Recipes of the committed stream fixtures (data/streams/): cache files of every tier and the
outputs of a quantized cache, written from seeded rows through appends and truncations.

``tools/make_stream_fixtures.py`` wrote data/streams/ (of the source tree) with these recipes;
tests/test_stream_fixtures.py writes them again and compares: a file's bytes exactly, a cache's
outputs bit for bit. The
fixtures pin the stream state machine (sinks, center/normalize, recent window, truncation) of
the cache and of the file against any change of layout.
"""
import os
import shutil

import numpy as np

from kvquant.cache import QuantizedKVCache
from kvquant.kvfile import CacheFile, KVFileShape, Stream
from kvquant.streams.calibration import StreamStatistics

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "streams")

SHAPE = KVFileShape(n_layers=2, kv_lora=32, qk_rope=8, index_hd=4, n_index_layers=1, vocab=256)

# name -> (mode or streams, steps); a step is ("append", n), ("truncate", n) or ("save",)
FILE_RECIPES = {
    "v1_f32.coli_kv": ({"mode": "f32"}, [("append", 5), ("append", 3), ("truncate", 6),
                                         ("append", 2)]),
    "v2_kv8.coli_kv": ({"mode": "kv8"}, [("append", 4), ("append", 4), ("truncate", 5),
                                         ("append", 3)]),
    "v3_tq4.coli_kv": ({"mode": "tq4:compat=colibri"}, [("append", 6), ("truncate", 4),
                                                        ("append", 3)]),
    "v3_polar4.coli_kv": ({"mode": "polar4:compat=colibri"}, [("append", 3), ("append", 5),
                                                              ("truncate", 7)]),
    "mla_options.kvq": ({"mode": "polar5@center,sinks=1"}, [("append", 4), ("append", 3),
                                                            ("truncate", 5), ("append", 2)]),
    "plain.kvq": ({"streams": [Stream("K", 16, 3, "tq4"), Stream("V", 16, 3, "kv8")]},
                  [("append", 5), ("append", 3), ("truncate", 6), ("append", 4)]),
    "options.kvq": ({"streams": [
        Stream("K", 16, 2, "tq4:side_dtype=f16@center,normalize,sinks=2"),
        Stream("V", 16, 2, "polar4:side_dtype=f16@sinks=1,recent=4"),
        Stream("X", 32, 1, "q8_0@center,recent=3")]},
        [("append", 1), ("append", 6), ("append", 2), ("truncate", 5), ("append", 3)]),
    "window.kvq": ({"streams": [Stream("K", 16, 2, "kv8@center,normalize,sinks=1,recent=5"),
                                Stream("V", 16, 2, "tq3:side=unbiased@recent=2")]},
                   [("append", 7), ("append", 1), ("append", 1), ("truncate", 8),
                    ("append", 4), ("truncate", 2), ("append", 3)]),
}

# calibrated statistics (center=calib, normalize=calib): given at the start, kept through a
# truncation to nothing; the header records their digest
_CALIB_K = (np.linspace(-1.0, 1.0, 2 * 16, dtype=np.float32).reshape(2, 16),
            np.linspace(0.5, 2.0, 2 * 16, dtype=np.float32).reshape(2, 16))
FILE_RECIPES["calibrated.kvq"] = (
    {"streams": [Stream("K", 16, 2, "polar4@center=calib,normalize=calib,sinks=1"),
                 Stream("V", 16, 2, "tq3@center=calib")],
     "statistics": {"K": _CALIB_K, "V": (_CALIB_K[0][::-1].copy(), None)}},
    [("append", 1), ("append", 1), ("append", 4), ("truncate", 0), ("append", 3)])

# v1 files opened under a quantized mode: upgraded in memory, rewritten at the first save
UPGRADE_RECIPES = {
    "v1_to_v2.coli_kv": ("v1_f32.coli_kv", {"mode": "kv8"}),
    "v1_to_kvq.kvq": ("v1_f32.coli_kv", {"mode": "tq4@center,normalize,sinks=1,recent=2",
                                         "tier": "kvq"}),
}


def _rows(rng, streams, n):
    return {s.name: rng.standard_normal((n, s.rows, s.dim)).astype(np.float32) * (
        1.0 + np.arange(s.dim, dtype=np.float32) / s.dim) + 0.5 for s in streams}


def write_file(name, path):
    """Write the cache file of recipe ``name`` at ``path`` (which must not exist)."""
    if name in UPGRADE_RECIPES:
        source, kwargs = UPGRADE_RECIPES[name]
        shutil.copyfile(os.path.join(FIXTURES, source), path)
        cf = CacheFile.open(path, SHAPE, **kwargs)
        cf.save()
        cf.close()
        return
    setup, steps = FILE_RECIPES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    if "mode" in setup:
        cf = CacheFile.open(path, SHAPE, mode=setup["mode"], block_records=4)
    else:
        cf = CacheFile.open(path, streams=setup["streams"], vocab=256, block_records=4,
                            statistics=setup.get("statistics"))
    for step in steps:
        if step[0] == "append":
            n = step[1]
            rows = _rows(rng, cf.streams, n)
            cf.append(rng.integers(0, 256, n), streams=rows)
        else:
            cf.truncate(step[1])
    cf.close()


CACHE_SPECS = {
    "plain": {"k": "tq4", "v": "kv8"},
    "options": {"k": "polar5@center,normalize,sinks=1", "v": "polar4@sinks=1"},
    "window": {"k": "tq4:side_dtype=f16@center,sinks=1,recent=4", "v": "polar3@recent=4"},
    "mixed": {"k": "kv8-g8@normalize,recent=3", "v": "tq3:side=unbiased@center,sinks=2"},
}
# per layer and KV head (2 x 2 x 16): the calibrated statistics of CACHE_SPECS["calibrated"]
CACHE_STATISTICS = StreamStatistics(
    {"k": np.linspace(-0.5, 0.5, 64, dtype=np.float32).reshape(2, 2, 16)},
    {"k": np.linspace(0.6, 1.6, 64, dtype=np.float32).reshape(2, 2, 16)})
CACHE_SPECS["calibrated"] = {"k": "tq4@center=calib,normalize=calib,sinks=1", "v": "polar4"}
CACHE_FIXTURE = "cache_outputs.npz"


def cache_outputs():
    """Outputs of a 2-layer, 2-KV-head cache under each of CACHE_SPECS after a prefill, decode
    steps and a truncation: attend, attend_prefill, scores, context and decode, by key."""
    out = {}
    dim, n_heads, n_kv = 16, 4, 2
    for label, specs in CACHE_SPECS.items():
        rng = np.random.default_rng(sum(map(ord, label)))
        cache = QuantizedKVCache(2, {n: (s, dim) for n, s in specs.items()}, n_kv_heads=n_kv,
                                 statistics=CACHE_STATISTICS if "calib" in label else None)

        def rows(n):
            X = rng.standard_normal((n, n_kv, dim)).astype(np.float32)
            return X * (1.0 + np.arange(dim, dtype=np.float32) / dim) + 0.25

        def record(tag, layer, n_new):
            Q = rng.standard_normal((n_new, n_heads, dim)).astype(np.float32)
            out[f"{label}/{tag}/prefill{layer}"] = cache.attend_prefill(layer, Q, n_threads=1,
                                                                        block=3)
            out[f"{label}/{tag}/attend{layer}"] = cache.attend(layer, Q[-1], n_threads=1)
            if tag not in ("prefill", "chunk", "after"):
                return
            for name in specs:
                for h in range(n_kv):
                    st = cache.stream(layer, name, h)
                    key = f"{label}/{tag}/{name}{layer}.{h}"
                    out[key + "/decode"] = st.decode(n_threads=1)
                    out[key + "/scores"] = cache.scores(layer, name, Q[-1, :2], head=h,
                                                        n_threads=1)
                    w = rng.random(len(st)).astype(np.float32)
                    out[key + "/context"] = cache.context(layer, name, w, head=h, n_threads=1)

        for tag, action in (("prefill", 9), ("step1", 1), ("step2", 1), ("chunk", 3),
                            ("trunc", -8), ("after", 2)):
            if action < 0:
                cache.truncate(-action)
                continue
            for layer in range(2):
                cache.append(layer, n_threads=1, **{n: rows(action) for n in specs})
                record(tag, layer, action)
        out[f"{label}/nbytes"] = np.array([cache.nbytes, cache.fixed_bytes,
                                           cache.bytes_per_token, cache.recent])
    return out
