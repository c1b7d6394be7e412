"""Bit packing (LSB first, element-major) against numpy's bit arrays."""
import numpy as np
import pytest

from kvquant import reference
from kvquant._kernels import bitpack, lloyd


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 64, 129])
def test_pack_unpack_match_reference(rng, bits, n):
    codes = rng.integers(0, 2**bits, (33, n), dtype=np.uint8)
    packed = np.empty((33, (n * bits + 7) // 8), np.uint8)
    bitpack.pack_rows(codes, bits, packed, 2)
    assert np.array_equal(packed, reference.pack_bits(codes, bits))
    back = np.empty_like(codes)
    bitpack.unpack_rows(packed, bits, back, 2)
    assert np.array_equal(back, codes)


def test_four_bit_nibble_order():
    codes = np.array([[0x1, 0x2, 0x3, 0x4]], np.uint8)
    packed = np.empty((1, 2), np.uint8)
    bitpack.pack_rows(codes, 4, packed, 1)
    assert packed.tolist() == [[0x21, 0x43]]   # even element in the low nibble


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 16, 24, 40, 64, 72, 128, 512, 4096])
def test_tq_packers_match_reference_and_stay_in_the_row(rng, bits, n):
    """The tq encoder's packer and decoder's unpacker (groups of 8 codes moved as one word):
    LSB-first bytes as numpy's, and not one byte written past the row (a sentinel tail), nor
    read past it (the packed row handed over is exactly its bytes)."""
    code = rng.integers(0, 2**bits, n, dtype=np.uint8)
    n_bytes = (n * bits + 7) // 8
    out = np.full(n_bytes + 16, 0xA5, np.uint8)
    lloyd.pack_codes(code, bits, out)
    assert np.array_equal(out[:n_bytes], reference.pack_bits(code[None], bits)[0])
    assert np.all(out[n_bytes:] == 0xA5)
    back = np.empty(n, np.uint8)
    lloyd.unpack_codes(np.ascontiguousarray(out[:n_bytes]), bits, back)
    assert np.array_equal(back, code)
