"""Bit packing (LSB first, element-major) against numpy's bit arrays."""
import numpy as np
import pytest

from kvquant import reference
from kvquant._kernels import bitpack


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
