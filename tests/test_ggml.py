"""llama.cpp's q8_0 / q4_0 (+rot): byte identity with the gguf package, layout, bad input."""
import json
import platform
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from kvquant import EncodedRows, get_codec, reference
from kvquant._kernels import ggml as ggml_kernels
from kvquant.metrics import relative_l2
from kvquant.rotation import HadamardRotation

from conftest import gaussian_rows

GGML_TYPE = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
KINDS = ("q8_0", "q4_0")


def gguf_quantize(X, kind):
    with np.errstate(all="ignore"):
        return quants.quantize(np.asarray(X, np.float32), GGML_TYPE[kind])


def gguf_dequantize(codes, kind):
    with np.errstate(all="ignore"):
        return quants.dequantize(np.asarray(codes, np.uint8), GGML_TYPE[kind])


def adversarial_rows(rng, d=64):
    """Rows that probe rounding ties, signs, zero and subnormal blocks, fp16 scale edges."""
    rows = []
    zero = np.zeros(d, np.float32)
    rows.append(zero)
    rows.append(-zero)                                     # -0.0 everywhere
    rows.append(np.where(np.arange(d) % 2, 0.0, -0.0).astype(np.float32))
    ramp = np.arange(d, dtype=np.float32) - d / 2
    rows.append(ramp)                                      # exact small integers
    rows.append(ramp + np.float32(0.5))                    # x/d lands on .5 ties for q8_0
    rows.append(np.tile(np.float32([127, -2.5, 3.5, -0.5, 0.5, 1.5, -126.5, 64.5]), d // 8))
    rows.append(np.tile(np.float32([-8, 8, 0.5, -0.5, 4, -4, 7.5, -7.5]), d // 8))   # q4 peaks
    rows.append(np.tile(np.float32([8, -8, 1, 2, 3, 4, 5, 6]), d // 8))              # +max first
    rows.append(np.full(d, 3.25, np.float32))              # constant blocks
    one = zero.copy()
    one[[0, 33 % d]] = [1e-3, -7.0]
    rows.append(one)                                       # single values per block
    rows.append(ramp * np.float32(1e-30))                  # scale far below fp16 (-> 0)
    rows.append(ramp * np.float32(3e-6))                   # fp16 subnormal scales
    rows.append(ramp * np.float32(2e-38))                  # float32 subnormal d and 1/d
    rows.append(np.full(d, 1e-40, np.float32))             # float32 subnormal elements
    rows.append(ramp * np.float32(8.3e6 / (d / 2)))        # q8_0 scale just under fp16 max
    rows.append(ramp * np.float32(5.2e5 / (d / 2)))        # q4_0 scale just under fp16 max
    rows.append(np.float32(2.0) ** rng.integers(-20, 20, d).astype(np.float32)
                * rng.choice(np.float32([-1, 1]), d))      # powers of two
    heavy = gaussian_rows(rng, 1, d)[0]
    heavy[rng.integers(0, d, 3)] *= 1000                   # outliers
    rows.append(heavy)
    return np.stack(rows).astype(np.float32)


def scale_overflows(X, kind):
    B = np.abs(X.astype(np.float64)).reshape(X.shape[0], -1, 32).max(axis=2)
    limit = 65520 * (127 if kind == "q8_0" else 8)
    return (B >= limit * (1 - 1e-6)).any(axis=1)


# -- identity with gguf --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [32, 128, 4096])
def test_random_rows_are_byte_identical_to_gguf(rng, kind, d):
    n = 64 if d == 4096 else 300
    X = gaussian_rows(rng, n, d) * (10.0 ** rng.uniform(-6, 4, (n, 1))).astype(np.float32)
    codec = get_codec(kind, d)
    enc = codec.encode(X)
    expected = gguf_quantize(X, kind)
    assert enc.codes.shape == expected.shape == (n, codec.bytes_per_row)
    assert np.array_equal(enc.codes, expected)
    assert np.array_equal(codec.decode(enc), gguf_dequantize(expected, kind))
    assert np.array_equal(enc.codes, getattr(reference, f"{kind}_encode_rows")(X))


@pytest.mark.parametrize("kind", KINDS)
def test_adversarial_rows_are_byte_identical_to_gguf(rng, kind):
    X = adversarial_rows(rng)
    keep = ~scale_overflows(X, kind)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # a float32-subnormal scale makes 1/d infinite: numpy's inf->int cast is
        # platform-defined (0 on x86), ours always gives 0
        block_max = np.abs(X).reshape(X.shape[0], -1, 32).max(axis=2)
        keep &= ~((block_max > 0) & (block_max < 4e-37)).any(axis=1)
    X = X[keep]
    codec = get_codec(kind, X.shape[1])
    enc = codec.encode(X)
    expected = gguf_quantize(X, kind)
    bad = np.flatnonzero((enc.codes != expected).any(axis=1))
    assert bad.size == 0, (bad, enc.codes[bad[:1]], expected[bad[:1]])
    assert np.array_equal(codec.decode(enc), gguf_dequantize(expected, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_arbitrary_bytes_matches_gguf(rng, kind):
    """Any ggml row decodes as gguf decodes it, infinite and NaN scales included."""
    d = 256
    codec = get_codec(kind, d)
    codes = rng.integers(0, 256, (200, codec.code_bytes), dtype=np.uint8)
    ours = codec.decode(EncodedRows(codes, np.zeros((200, 0), np.float32), codec.spec, d))
    assert np.array_equal(ours, gguf_dequantize(codes, kind), equal_nan=True)


def test_fp16_conversion_is_exhaustively_numpy():
    h = np.arange(2**16, dtype=np.uint16)
    values = np.empty(h.size, np.float32)
    ggml_kernels.fp16_values(h, values)
    assert np.array_equal(values, h.view(np.float16).astype(np.float32), equal_nan=True)
    # rounding float32 -> fp16: every fp16 value, the midpoints between neighbours and around them
    finite = values[np.isfinite(values)].astype(np.float64)
    grid = np.unique(finite)
    mids = (grid[:-1] + grid[1:]) / 2
    probes = np.concatenate([grid, mids, np.nextafter(mids.astype(np.float32), np.inf),
                             np.nextafter(mids.astype(np.float32), -np.inf),
                             [65519.99, 65520.0, 65536.0, 1e30, np.inf, -np.inf, 1e-8, 3e-8,
                              2.98e-8, 1e-45]]).astype(np.float32)
    bits = np.empty(probes.size, np.uint16)
    ggml_kernels.fp16_bits(probes, bits)
    with np.errstate(over="ignore"):
        assert np.array_equal(bits, probes.astype(np.float16).view(np.uint16))


# -- layout --------------------------------------------------------------------------------------

def test_q4_0_byte_layout():
    q = np.arange(32) % 16
    q[0] = 0                                  # element 0 is -8: the peak, so d = -8 / -8 = 1
    x = (q - 8).astype(np.float32)[None, :]
    codes = get_codec("q4_0", 32).encode(x).codes[0]
    assert codes[:2].tolist() == [0x00, 0x3C]     # fp16 1.0, little endian
    for j in range(16):
        assert codes[2 + j] == q[j] | (q[j + 16] << 4)


def test_q8_0_byte_layout():
    x = np.zeros((1, 64), np.float32)
    x[0, 0], x[0, 1], x[0, 40] = 127.0, -5.0, 2.0
    codes = get_codec("q8_0", 64).encode(x).codes[0]
    assert codes[:2].tolist() == [0x00, 0x3C]     # d = 127 / 127 = 1
    assert codes[2:5].view(np.int8).tolist() == [127, -5, 0]
    assert codes[34:36].tolist() == list(np.float16(np.float32(2) / np.float32(127)).tobytes())
    assert codes[36 + 8].view(np.int8) == 127


@pytest.mark.parametrize("kind, block_bytes", [("q8_0", 34), ("q4_0", 18)])
@pytest.mark.parametrize("d", [32, 64, 96, 512])
def test_bytes_per_row(rng, kind, block_bytes, d):
    codec = get_codec(kind, d)
    assert codec.bytes_per_row == codec.code_bytes == block_bytes * d // 32
    assert codec.n_side == 0
    enc = codec.encode(gaussian_rows(rng, 3, d))
    assert enc.side.shape == (3, 0) and enc.codes.shape == (3, codec.bytes_per_row)
    assert codec.bits_per_value == {"q8_0": 8.5, "q4_0": 4.5}[kind]


# -- rotated variants ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [None, 0x1234])
def test_rotated_is_gguf_after_the_rotation(rng, kind, seed):
    d = 128
    X = gaussian_rows(rng, 200, d)
    spec = f"{kind}+rot" + (f":seed={seed:#x}" if seed else "")
    codec = get_codec(spec, d)
    rot = HadamardRotation(d) if seed is None else HadamardRotation(d, seed)
    enc = codec.encode(X)
    expected = gguf_quantize(rot.rotate(X), kind)
    assert np.array_equal(enc.codes, expected)
    decoded = codec.decode(enc)
    assert np.allclose(decoded, rot.unrotate(gguf_dequantize(expected, kind)), rtol=0, atol=1e-6)
    assert codec.spec == spec
    assert get_codec(codec.spec, d).spec == spec


def test_rotation_tames_outlier_channels(rng):
    """llama.cpp's reason to rotate: an outlier channel spoils every block it sits in."""
    d = 128
    X = gaussian_rows(rng, 500, d)
    X[:, [3, 70]] *= 30
    plain = relative_l2(X, get_codec("q4_0", d).roundtrip(X)).mean()
    rotated = relative_l2(X, get_codec("q4_0+rot", d).roundtrip(X)).mean()
    assert rotated < 0.7 * plain


# -- threads, bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_nonfinite_and_overflowing_rows(rng, kind):
    X = gaussian_rows(rng, 5, 64)
    X[1, 3] = np.nan
    X[2, 40] = -np.inf
    X[4, 10] = 1e7 if kind == "q4_0" else 1e9      # the block scale overflows fp16
    with pytest.raises(ValueError, match=r"NaN or inf.*float16.*rows 1, 2, 4"):
        get_codec(kind, 64).encode(X)
    inert = get_codec(kind, 64, nonfinite="inert")
    enc = inert.encode(X)
    zero_row = gguf_quantize(np.zeros((1, 64), np.float32), kind)[0]
    for r in (1, 2, 4):
        assert np.array_equal(enc.codes[r], zero_row)
        assert not inert.decode(enc)[r].any()
    assert np.array_equal(enc.codes[[0, 3]], gguf_quantize(X[[0, 3]], kind))


@pytest.mark.parametrize("kind", KINDS)
def test_bad_widths(kind):
    with pytest.raises(ValueError, match=r"multiple of 32.*48"):
        get_codec(kind, 48)
    with pytest.raises(ValueError, match=rf"power-of-two.*96.*unrotated {kind}"):
        get_codec(f"{kind}+rot", 96)
    with pytest.raises(ValueError, match=r"seed.*\+rot"):
        get_codec(f"{kind}:seed=3", 64)
    assert get_codec(kind, 96).code_bytes == 3 * (34 if kind == "q8_0" else 18)


def test_cli_all_codecs():
    res = subprocess.run([sys.executable, "-m", "kvquant.cli", "distortion", "--codecs", "all",
                          "--dim", "64", "--rows", "64", "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    specs = [r["codec"] for r in json.loads(res.stdout)["results"]]
    for spec in ("f32", "kv8", "tq4", "tq4:compat=colibri", "polar2", "polar6",
                 "polar4:compat=colibri", "q8_0", "q8_0+rot", "q4_0", "q4_0+rot"):
        assert spec in specs
    res = subprocess.run([sys.executable, "-m", "kvquant.cli", "distortion", "--codecs", "all",
                          "--dim", "96", "--rows", "16"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "q4_0 " in res.stdout and "polar4" not in res.stdout and "skipped" in res.stderr
