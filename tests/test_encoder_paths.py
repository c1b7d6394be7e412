"""The encoders' vector paths (rowops.h: AVX-512, AVX2 and the baseline's 4 lanes, chosen like the
consumers' by ``consumers.set_simd`` or ``KVQUANT_SIMD``): every path this CPU runs gives the
same bytes, at every thread count, and each is checked against searchsorted and a numpy
Walsh-Hadamard transform."""
import os
import subprocess
import sys

import numpy as np
import pytest

from kvquant import get_codec
from kvquant._kernels import lloyd as lloyd_kernels
from kvquant._kernels import polar as polar_kernels

from conftest import gaussian_rows
from _simd import PATHS, simd_path  # noqa: F401 (a fixture)

ENCODER_PATH = {"portable": "portable", "avx2": "avx2", "avx512": "avx512",
                "avx512vbmi": "avx512"}


def _rows(rng, n, d):
    """Gaussian rows over 12 decades of scale, plus a zero row, a NaN row (inert), rows of
    small integers (values on boundaries, ties) and a row large enough that the rotation's
    partial sums overflow float32 (the prescaled path)."""
    X = gaussian_rows(rng, n, d) * rng.uniform(1e-6, 1e6, (n, 1)).astype(np.float32)
    X[0] = 0
    X[1, 3] = np.nan
    X[2:12] = rng.integers(-2, 3, (10, d))
    X[12] = np.float32(3e38) / np.float32(np.sqrt(d)) * np.sign(rng.standard_normal(d) + 0.1)
    return X


def _hadamard(d):
    H = np.ones((1, 1))
    while H.shape[0] < d:
        H = np.block([[H, H], [H, -H]])
    return H


def test_every_path_this_cpu_runs_is_selectable(simd_path):
    for mode in PATHS:
        simd_path(mode)
        assert lloyd_kernels.encoder_simd() == ENCODER_PATH[mode]
    simd_path("auto")
    assert lloyd_kernels.encoder_simd() == ENCODER_PATH[PATHS[-1]]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("d", [16, 64, 128, 512])
def test_tq_encoders_give_the_same_bytes_on_every_path(rng, simd_path, bits, d):
    X = _rows(rng, 160, d)
    codec = get_codec(f"tq{bits}", d, nonfinite="inert")
    simd_path(PATHS[0])
    ref = codec.encode(X, n_threads=1)
    for mode in PATHS:
        simd_path(mode)
        for threads in (1, 2):
            enc = codec.encode(X, n_threads=threads)
            assert np.array_equal(enc.codes, ref.codes), (mode, threads)
            assert np.array_equal(enc.side.view(np.uint32), ref.side.view(np.uint32)), mode
        assert np.array_equal(codec.decode(enc).view(np.uint32),
                              codec.decode(ref).view(np.uint32)), mode


@pytest.mark.parametrize("d", [2, 8, 16, 32, 64, 256, 1024, 4096])
def test_the_transform_on_every_path_is_the_hadamard_matrix(rng, simd_path, d):
    """The butterflies on every path against the matrix product in float64; small integers
    make every float32 partial sum exact."""
    H = _hadamard(d)
    for mode in PATHS:
        simd_path(mode)
        for _ in range(3):
            x = rng.integers(-8, 9, d).astype(np.float32)
            y = x.copy()
            lloyd_kernels.fwht(y)
            assert np.array_equal(y, (H @ x.astype(np.float64)).astype(np.float32)), mode


def test_nearest_codes_on_every_path_are_searchsorted(rng, simd_path):
    """Counted compares (up to 31 boundaries) and the bucket table (above) on each path, with
    values on and next to the boundaries and NaN, against searchsorted: the codecs' boundaries
    and 31 or 40 boundaries with repeats and a dense cluster (bucket windows above 1)."""
    sets = [get_codec(f"tq{bits}", 128).boundaries for bits in range(1, 9)]
    for size in (31, 40):
        sets.append(np.sort(np.concatenate([np.linspace(-1, 1, size - 11), [0.0, 0.0, 0.5, 0.5],
                                            rng.uniform(0, 1e-3, 7)])))
    for bnd in sets:
        bnd = np.ascontiguousarray(bnd, np.float32)
        near = np.concatenate([bnd, np.nextafter(bnd, np.inf), np.nextafter(bnd, -np.inf)])
        y = np.concatenate([near, rng.standard_normal(997).astype(np.float32) * 2,
                            np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)])
        y = np.ascontiguousarray(y, np.float32)
        expect = np.searchsorted(bnd, y, side="left").astype(np.uint8)
        expect[np.isnan(y)] = 0
        table = lloyd_kernels.code_table(bnd)
        for mode in PATHS:
            simd_path(mode)
            for tree in (True, False):
                out = np.empty(y.size, np.uint8)
                lloyd_kernels.nearest_codes(y, bnd, table, out, tree)
                assert np.array_equal(out, expect), (bnd.size, mode, tree)


@pytest.mark.parametrize("spec", ["polar4", "polar4:alloc=level", "polar3", "polar6",
                                  "polar4:compat=colibri"])
@pytest.mark.parametrize("d", [32, 128, 512])
def test_polar_encoders_give_the_same_bytes_on_every_path(rng, simd_path, spec, d):
    X = _rows(rng, 120, d)
    X[13:20, ::2] = 0                     # pairs libm decides
    codec = get_codec(spec, d, nonfinite="inert")
    simd_path(PATHS[0])
    ref = codec.encode(X, n_threads=1)
    ref_dec = codec.decode(ref, n_threads=1)
    for mode in PATHS:
        simd_path(mode)
        # portable: the AVX-512 helpers stand aside; near off: the radius allocation always
        # searches instead of trying its guess at the mean weight first
        for portable, near in ((False, True), (False, False), (True, True)):
            polar_kernels.set_portable(portable)
            polar_kernels.set_near_guess(near)
            try:
                enc = codec.encode(X, n_threads=2)
                dec = codec.decode(enc, n_threads=2)
            finally:
                polar_kernels.set_portable(False)
                polar_kernels.set_near_guess(True)
            assert np.array_equal(enc.codes, ref.codes), (mode, portable, near)
            assert np.array_equal(enc.side.view(np.uint32), ref.side.view(np.uint32)), mode
            assert np.array_equal(dec.view(np.uint32), ref_dec.view(np.uint32)), (mode, near)


@pytest.mark.skipif(len(PATHS) < 2, reason="this CPU runs only the portable path")
def test_the_environment_chooses_the_path_of_every_encoder():
    """KVQUANT_SIMD reaches the modules that do not follow set_simd (the ggml formats' rotation)
    as well: q4_0+rot and tq5 bytes in fresh processes, one per path."""
    code = ("import sys, numpy as np; from kvquant import get_codec; "
            "from kvquant._kernels import lloyd; print(lloyd.encoder_simd()); "
            "X = np.random.default_rng(5).standard_normal((300, 128)).astype(np.float32); "
            "[sys.stdout.write(get_codec(s, 128).encode(X).codes.tobytes().hex()[:4096] + '\\n')"
            " for s in ('q4_0+rot', 'tq5')]")
    outs = {}
    for mode in PATHS:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, KVQUANT_SIMD=mode))
        assert res.returncode == 0, res.stderr
        lines = res.stdout.split("\n")
        assert lines[0] == ENCODER_PATH[mode]
        outs[mode] = lines[1:]
    for mode in PATHS[1:]:
        assert outs[mode] == outs[PATHS[0]], mode


@pytest.mark.parametrize("spec", ["polar4", "polar4:alloc=level"])
def test_polar_rows_in_any_grouping_give_the_same_bytes(rng, spec):
    """The encoder sums the norms of a few rows side by side: every row count and thread split
    (blocks cut short at a thread's or the array's end) gives each row's own bytes, and its
    radius is the engine's (float) sqrt of the squares added in index order in double."""
    d = 64
    X = _rows(rng, 40, d)[13:]                            # finite rows of many scales
    codec = get_codec(spec, d)
    one = [codec.encode(X[i:i + 1], n_threads=1) for i in range(X.shape[0])]
    for n in (1, 2, 3, 5, 6, 7, 9, 27):
        for threads in (1, 2, 3):
            enc = codec.encode(X[:n], n_threads=threads)
            for i in range(n):
                assert np.array_equal(enc.codes[i], one[i].codes[0]), (n, threads, i)
                assert enc.side[i, 0].view(np.uint32) == one[i].side[0, 0].view(np.uint32)
    norm2 = np.cumsum(X.astype(np.float64) ** 2, axis=1)[:, -1]
    radius = np.sqrt(norm2).astype(np.float32)
    assert np.array_equal(codec.encode(X, n_threads=2).side[:, 0].view(np.uint32),
                          radius.view(np.uint32))
