"""The portable path (compiler vector extensions, no intrinsics) against independent references:
every fp8 e4m3 code through each path's decoders against ml_dtypes, scores and contexts in the
reduction order of kvquant/_kernels/simd.h computed step by step in numpy float32 (bit for bit),
and the kernels' headers built on their own without intrinsics (-DKVQ_NO_SIMD), without vector
extensions (-DKVQ_NO_VECTOR_EXT) and for x86's baseline ISA, where the vector kernels must give the
bits of the families' scalar one-query kernels, the encoders' row kernels of every lane width the
same bits, and every build the same hashes of every output.
"""
import os
import platform
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from kvquant import get_codec
from kvquant._kernels import consumers

from conftest import gaussian_rows
from _simd import PATHS, as_bits
from _simd import simd_path  # noqa: F401 (fixture)

KERNELS = os.path.join(os.path.dirname(consumers.__file__))
CHECK_C = os.path.join(os.path.dirname(__file__), "portable_kernels_check.c")


def _e4m3_values(codes):
    """ml_dtypes' float8_e4m3fn values as float32, NaN codes (0x7F, 0xFF) read as +0 (the
    consumers' rule)."""
    v = np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.where(np.isnan(v), np.float32(0.0), v)


# every code, each at every lane position (rows are the 256 codes rotated by 16 t + t)
ALL_CODES = np.stack([np.roll(np.arange(256), 17 * t) for t in range(16)]).astype(np.uint8)
# the normal codes only (no subnormal, zero or NaN code): the decoders' fast modes
NORMAL = np.array([c for c in range(256) if c & 0x78 and c & 0x7F != 0x7F], np.uint8)
NORMAL_CODES = np.stack([np.roll(np.resize(NORMAL, 256), 5 * t) for t in range(16)])


@pytest.mark.parametrize("codes", [ALL_CODES, NORMAL_CODES], ids=["all", "normal"])
@pytest.mark.parametrize("factor", [1.0, 256.0], ids=["raw", "rebias"])
def test_every_fp8_code_reads_as_ml_dtypes_on_every_path(codes, factor, simd_path):
    # one-hot queries and weights pick single values: score[i, t] = factor * v(code[t, i]) and
    # context[t] = factor * v(code[t]); factors below 2^7 take the raw decode, others the rebias
    T, d = codes.shape
    want = _e4m3_values(codes) * np.float32(factor)
    scales = np.ones((T, 1), np.float32)
    eye_d = np.eye(d, dtype=np.float32) * np.float32(factor)
    eye_t = np.eye(T, dtype=np.float32) * np.float32(factor)
    for path in PATHS:
        simd_path(path)
        s = np.empty((d, T), np.float32)
        c = np.empty((T, d), np.float32)
        consumers.scores_kv8(codes, scales, d, eye_d, s, 1)
        consumers.context_kv8(codes, scales, d, eye_t, c, 1)
        # each read adds one value to zeros from +0 (so -0 reads as +0: equal values)
        assert np.array_equal(s.T, want), path
        assert np.array_equal(c, want), path


def _tree16(acc):
    """simd.h's fixed tree over the 16 lanes (last axis), float32."""
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def _kv8_scores_in_order(codes, scales, Q):
    """score_t = tree16(lane j: sum over i = j, j+16, ... of q_i v_ti, in that order) * s_t."""
    v = _e4m3_values(codes)
    T, n = v.shape
    out = np.empty((len(Q), T), np.float32)
    for j, q in enumerate(Q):
        prod = q[None, :] * v
        acc = np.zeros((T, 16), np.float32)
        for k in range(n // 16):
            acc = acc + prod[:, 16 * k:16 * k + 16]
        out[j] = _tree16(acc) * scales[:, 0]
    return out


def _kv8_context_in_order(codes, scales, W):
    """acc = acc + (w_t s_t) v_t over the rows in order (one context chunk), from +0."""
    v = _e4m3_values(codes)
    out = np.zeros((len(W), v.shape[1]), np.float32)
    for j, w in enumerate(W):
        for t in range(v.shape[0]):
            out[j] = out[j] + (w[t] * scales[t, 0]) * v[t]
    return out


def _ggml_blocks(codes, n, bits):
    """q8_0 / q4_0 rows as (fp16 scales (T, n/32) as float32, values (T, n) as float32), read
    from the block layout (llama.cpp's ggml-common.h: fp16 d, then 32 int8, or 16 bytes whose
    low nibbles are elements 0-15 and high nibbles 16-31, value nibble - 8)."""
    T, nb = codes.shape[0], n // 32
    blocks = codes.reshape(T, nb, -1)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    qs = blocks[:, :, 2:]
    if bits == 8:
        v = qs.view(np.int8).astype(np.float32)
    else:
        v = np.concatenate([(qs & 15).astype(np.float32) - 8, (qs >> 4).astype(np.float32) - 8],
                           axis=2)
    return d, v.reshape(T, n)


def _ggml_scores_in_order(codes, Q, bits):
    """acc = acc + P_b d_b per lane, P_b = (0 + q0 v0) + q1 v1 over the block's two steps."""
    T, n = codes.shape[0], Q.shape[1]
    d, v = _ggml_blocks(codes, n, bits)
    out = np.empty((len(Q), T), np.float32)
    for j, q in enumerate(Q):
        prod = q[None, :] * v
        acc = np.zeros((T, 16), np.float32)
        for b in range(n // 32):
            part = np.float32(0.0) + prod[:, 32 * b:32 * b + 16]
            part = part + prod[:, 32 * b + 16:32 * b + 32]
            acc = acc + part * d[:, b:b + 1]
        out[j] = _tree16(acc)
    return out


def _ggml_context_in_order(codes, W, n, bits):
    d, v = _ggml_blocks(codes, n, bits)
    out = np.zeros((len(W), n), np.float32)
    for j, w in enumerate(W):
        for t in range(v.shape[0]):
            out[j] = out[j] + np.repeat(w[t] * d[t], 32) * v[t]
    return out


@pytest.mark.parametrize("spec", ["kv8", "q4_0", "q8_0"])
@pytest.mark.parametrize("dim", [64, 512])
def test_reads_have_the_bits_of_the_reduction_order_in_numpy(spec, dim, rng, simd_path):
    T, m = 70, 3   # blocks of 16 rows and a tail; one context chunk
    codec = get_codec(spec, dim)
    X = gaussian_rows(rng, T, dim)
    X[5, : dim // 2] *= 1e-6   # fp8 subnormal codes
    enc = codec.encode(X)
    Q = gaussian_rows(rng, m, dim)
    W = rng.random((m, T)).astype(np.float32)
    if spec == "kv8":
        enc.codes[9, :3] = [0x7F, 0xFF, 0x80]   # NaN codes (read as 0) and -0
        want = (_kv8_scores_in_order(enc.codes, enc.side, Q),
                _kv8_context_in_order(enc.codes, enc.side, W))
    else:
        bits = 8 if spec == "q8_0" else 4
        want = (_ggml_scores_in_order(enc.codes, Q, bits),
                _ggml_context_in_order(enc.codes, W, dim, bits))
    for path in PATHS:
        simd_path(path)
        got = codec.scores(enc, Q), codec.context(enc, W)
        for a, b in zip(got, want):
            assert np.array_equal(as_bits(a), as_bits(b)), (spec, dim, path)


def _compiler():
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


# x86 builds compile the vector kernels only with SSSE3 (simd.h); any CPU with AVX2 has it
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
VECTOR_FLAGS = ["-mssse3"] if X86 else []
BUILDS = {
    "vector-extensions": (["-DKVQ_NO_SIMD", *VECTOR_FLAGS], 1),
    "plain-c": (["-DKVQ_NO_SIMD", "-DKVQ_NO_VECTOR_EXT", *VECTOR_FLAGS], 0),
    "baseline-isa": (["-DKVQ_NO_SIMD"], 0 if X86 else 1),
    # Clang has no variable byte shuffle builtin: its vector build takes simd.h's own lookup
    "clang-vector-extensions": (["-DKVQ_NO_SIMD", *VECTOR_FLAGS], 1),
}
CLANG = shutil.which("clang")


@pytest.fixture(scope="module")
def check_runs(tmp_path_factory):
    """``run(build)``: portable_kernels_check.c built as BUILDS[build] says and run with
    --digest, once per module; returns its stdout lines."""
    done = {}

    def run(build):
        if build not in done:
            cc = CLANG if build.startswith("clang-") else _compiler()
            if cc is None:
                pytest.skip("clang is not installed" if build.startswith("clang-")
                            else "no C compiler on PATH")
            exe = tmp_path_factory.mktemp(build) / "check"
            # -O0 keeps the compile short; the rounding is the same at any level
            # (-ffp-contract=off)
            made = subprocess.run([cc, "-O0", "-ffp-contract=off", "-fno-fast-math",
                                   *BUILDS[build][0], "-I", KERNELS, CHECK_C, "-o", str(exe),
                                   "-lm"], capture_output=True, text=True)
            assert made.returncode == 0, made.stderr[-3000:]
            ran = subprocess.run([str(exe), "--digest"], capture_output=True, text=True)
            assert ran.returncode == 0 and ran.stdout.split("\n")[-2] == "OK", ran.stdout[-3000:]
            done[build] = ran.stdout.splitlines()
        return done[build]

    return run


@pytest.mark.parametrize("build", list(BUILDS))
def test_the_portable_kernels_build_alone_and_match_the_scalar_kernels(build, check_runs):
    # each build compares its vector kernels with the scalar ones (and, on x86, the encoders'
    # 4-, 8- and 16-lane kernels with each other): it exits 0 and prints OK only when they agree
    if X86 and BUILDS[build][1] and consumers.cpu_simd() == "portable":
        pytest.skip("this x86 CPU may lack SSSE3 (no AVX2)")
    lines = check_runs(build)
    assert lines[0] == f"vectors={BUILDS[build][1]}", lines[0]
    assert lines[-1] == "OK"


def test_every_build_of_the_kernels_hashes_the_same_outputs(check_runs):
    # the plain-C build runs only scalar loops (consumers and encoders): the vector builds must
    # hash the same outputs case by case (tools/check_portability.py compares the same lines
    # across compilers and CPUs)
    if X86 and consumers.cpu_simd() == "portable":
        pytest.skip("this x86 CPU may lack SSSE3 (no AVX2)")
    builds = [b for b in BUILDS if CLANG or not b.startswith("clang-")]
    digests = {b: [ln for ln in check_runs(b) if ln.startswith("digest ")] for b in builds}
    plain = digests["plain-c"]
    assert len(plain) > 100 and len(set(ln.split()[1] for ln in plain)) == len(plain)
    for build, lines in digests.items():
        assert lines == plain, (build, [a for a, b in zip(lines, plain) if a != b][:5])
