"""Randomized Hadamard rotation shared by the rotated codecs (docs/reference.md §1.2).

rotate(x) = H (D x) / sqrt(n) and unrotate(y) = D (H y) / sqrt(n), with H the unnormalized
Walsh-Hadamard matrix in natural (Sylvester) order and D = diag(signs). The seed, the sign hash and
the ordering are part of what a stored cache means, so a rotation has a stable ``identity``.
"""
import numpy as np

from kvquant._kernels import rotation as _rotation_kernels
from kvquant._threads import resolve_n_threads

ENGINE_SEED = 0x9E3779B9
SIGN_HASH = "murmur3-fmix32+golden"
ORDERING = "sylvester"


def _fmix32_golden(x):
    """The engine's sign hash on uint32 arrays: add the golden ratio, then murmur3's finalizer."""
    x = (x + np.uint32(0x9E3779B9)).astype(np.uint32)
    x ^= x >> np.uint32(16)
    x = (x * np.uint32(0x85EBCA6B)).astype(np.uint32)
    x ^= x >> np.uint32(13)
    x = (x * np.uint32(0xC2B2AE35)).astype(np.uint32)
    x ^= x >> np.uint32(16)
    return x


def sign_vector(n, seed=ENGINE_SEED):
    """Signs d_i = -1 where bit 0 of h(seed XOR i) is 1, else +1; float32 of shape (n,).

    The same vector serves every row and layer; a narrower row uses its first entries.
    """
    if not 0 <= int(seed) < 2**32:
        raise ValueError(f"rotation seed {seed!r} must fit in 32 bits (0 <= seed < 2**32)")
    with np.errstate(over="ignore"):
        i = np.arange(n, dtype=np.uint32)
        h = _fmix32_golden(i ^ np.uint32(seed))
    return np.where(h & np.uint32(1), np.float32(-1.0), np.float32(1.0)).astype(np.float32)


def is_power_of_two(n):
    return n >= 1 and (n & (n - 1)) == 0


class HadamardRotation:
    """The randomized Hadamard rotation of width ``dim`` (a power of two, >= 2).

    Parameters
    ----------
    dim : int
        Row width.
    seed : int, default ENGINE_SEED
        Seed of the sign vector (32 bits).
    """

    def __init__(self, dim, seed=ENGINE_SEED):
        if not isinstance(dim, (int, np.integer)) or dim < 2 or not is_power_of_two(int(dim)):
            raise ValueError(
                f"the Hadamard rotation needs a power-of-two width >= 2, got {dim!r}; "
                "for other widths use an unrotated codec such as kv8"
            )
        self.dim = int(dim)
        self.seed = int(seed)
        self.signs = sign_vector(self.dim, self.seed)
        self.signs.flags.writeable = False

    @property
    def identity(self):
        """Stable description of everything that fixes the rotation."""
        return f"hadamard:{ORDERING}:{SIGN_HASH}:seed={self.seed:#010x}:n={self.dim}"

    def _apply(self, kernel, X, n_threads):
        X = np.ascontiguousarray(X, dtype=np.float32)
        one_row = X.ndim == 1
        X2 = X.reshape(1, -1) if one_row else X
        if X2.ndim != 2 or X2.shape[1] != self.dim:
            raise ValueError(f"expected rows of width {self.dim}, got shape {X.shape}")
        out = np.empty_like(X2)
        kernel(X2, self.signs, out, resolve_n_threads(n_threads))
        return out[0] if one_row else out

    def rotate(self, X, n_threads=None):
        """H (D x) / sqrt(n) for each row of X, shape (n_rows, dim) or (dim,). Float32, safe from
        the butterflies' overflow (a row whose partial sums would pass FLT_MAX is computed on a
        copy scaled by 2^-64): finite wherever the exact result is."""
        return self._apply(_rotation_kernels.rotate_rows, X, n_threads)

    def unrotate(self, Y, n_threads=None):
        """D (H y) / sqrt(n), the inverse of rotate (overflow-safe as rotate)."""
        return self._apply(_rotation_kernels.unrotate_rows, Y, n_threads)
