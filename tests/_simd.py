"""The consumers' SIMD paths in tests: which this CPU runs, switching between them, and the
check that they all give the same bits (a portable path, AVX2 and AVX-512 ones, one result)."""
import numpy as np
import pytest

from kvquant._kernels import consumers

# every path this CPU can run; they must all give the same bits
PATHS = {"portable": ["portable"], "avx2": ["portable", "avx2"],
         "avx512": ["portable", "avx2", "avx512"],
         "avx512vbmi": ["portable", "avx2", "avx512", "avx512vbmi"]}[consumers.cpu_simd()]


@pytest.fixture
def simd_path():
    """Run a block on a chosen path; always restores the automatic choice."""
    yield consumers.set_simd
    consumers.set_simd("auto")


def as_bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def reads_on_every_path(set_path, codec, enc, Q, W):
    """``{path: (codec.scores(enc, Q), codec.context(enc, W))}``, asserting that every path gives
    the portable path's bits."""
    out = {}
    for mode in PATHS:
        set_path(mode)
        out[mode] = (codec.scores(enc, Q), codec.context(enc, W))
    for mode in PATHS[1:]:
        for a, b in zip(out["portable"], out[mode]):
            assert np.array_equal(as_bits(a), as_bits(b)), (codec.spec, mode)
    return out


def benchmark_shape_paths_agree(set_path, codec, enc, q, w):
    """One query and one weight row over many rows, thread counts crossed between the paths."""
    set_path("portable")
    ref = codec.scores(enc, q), codec.context(enc, w, n_threads=2)
    for mode in PATHS[1:]:
        set_path(mode)
        got = codec.scores(enc, q, n_threads=2), codec.context(enc, w, n_threads=1)
        assert all(np.array_equal(as_bits(a), as_bits(b)) for a, b in zip(ref, got)), mode
