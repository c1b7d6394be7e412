"""Plain-numpy references of every kernel, written for clarity rather than speed.

Tests compare the compiled kernels against these; they share no code with the kernels (different
algorithms where possible: fp8 rounding by nearest-value search, the Hadamard transform as a
matrix product, bit packing through numpy's bit arrays).
"""
import numpy as np
import scipy.linalg

# -- fp8 e4m3fn ------------------------------------------------------------------------------

def e4m3_values():
    """Decode value of each of the 256 codes by the format's definition (NaN codes -> nan)."""
    vals = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 7
        if e == 0xF and m == 7:
            vals[code] = np.nan
        elif e == 0:
            vals[code] = sign * m * 2.0**-9
        else:
            vals[code] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return vals


def e4m3_encode(x):
    """Round each value to the nearest e4m3fn code: ties to the even code, |x| > 448 and inf
    saturate to +-448, NaN -> 0x00, the sign of zero is kept."""
    x = np.asarray(x, dtype=np.float64)
    vals = e4m3_values()
    pos_codes = np.arange(0x7F)              # 0x00..0x7E, the finite non-negative codes
    pos_vals = vals[pos_codes]
    a = np.abs(x)
    out = np.zeros(x.shape, dtype=np.uint8)
    flat_a, flat_out = a.reshape(-1), out.reshape(-1)
    for k, v in enumerate(flat_a):
        if np.isnan(v):
            flat_out[k] = 0
            continue
        if v >= 448.0:
            flat_out[k] = 0x7E
            continue
        hi = np.searchsorted(pos_vals, v)        # first value >= v
        if pos_vals[hi] == v:
            flat_out[k] = hi
            continue
        lo = hi - 1
        dlo, dhi = v - pos_vals[lo], pos_vals[hi] - v
        if dlo < dhi or (dlo == dhi and lo % 2 == 0):
            flat_out[k] = lo
        else:
            flat_out[k] = hi
    sign = np.signbit(x) & ~np.isnan(x)
    return (out | (sign.astype(np.uint8) << 7)).astype(np.uint8)


def fp8_encode_rows(X, group=None):
    """Per-group scale = amax/448; inert group (amax not > 1e-35 or not finite): zeros, scale 1."""
    X = np.asarray(X, dtype=np.float32)
    n, d = X.shape
    group = d if group is None else group
    G = X.reshape(n, d // group, group)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.abs(G).max(axis=2)
        finite = np.isfinite(G).all(axis=2)
        live = finite & (amax > np.float32(1e-35))
        scale = np.where(live, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
        inv = np.where(live, np.float32(448.0) / amax, np.float32(0.0)).astype(np.float32)
        scaled = (G * inv[:, :, None]).astype(np.float32)
    codes = e4m3_encode(np.where(live[:, :, None], scaled, 0.0)).reshape(n, d)
    return codes, scale


def fp8_decode_rows(codes, scales, group=None):
    vals = np.nan_to_num(e4m3_values(), nan=0.0).astype(np.float32)
    n, d = codes.shape
    group = d if group is None else group
    return (vals[codes] * np.repeat(scales, group, axis=1)).astype(np.float32)


# -- rotation --------------------------------------------------------------------------------

def sign_vector(n, seed=0x9E3779B9):
    """Pure-Python integers: d_i = -1 when bit 0 of h(seed ^ i) is 1."""
    def h(x):
        m = 0xFFFFFFFF
        x = (x + 0x9E3779B9) & m
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & m
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & m
        x ^= x >> 16
        return x
    return np.array([-1.0 if h(seed ^ i) & 1 else 1.0 for i in range(n)], dtype=np.float64)


def hadamard_matrix(n):
    """Unnormalized Walsh-Hadamard matrix in Sylvester (natural) order."""
    return scipy.linalg.hadamard(n).astype(np.float64)


def rotate(X, seed=0x9E3779B9):
    X = np.asarray(X, dtype=np.float64)
    n = X.shape[-1]
    return (X * sign_vector(n, seed)) @ hadamard_matrix(n).T / np.sqrt(n)


def unrotate(Y, seed=0x9E3779B9):
    Y = np.asarray(Y, dtype=np.float64)
    n = Y.shape[-1]
    return (Y @ hadamard_matrix(n).T / np.sqrt(n)) * sign_vector(n, seed)


# -- bit packing -----------------------------------------------------------------------------

def pack_bits(codes, bits):
    """Element i occupies bits [i*bits, (i+1)*bits), least significant bit first."""
    codes = np.asarray(codes, dtype=np.uint8)
    n_rows, n = codes.shape
    bit_planes = ((codes[:, :, None] >> np.arange(bits)) & 1).astype(np.uint8)
    flat = bit_planes.reshape(n_rows, n * bits)
    pad = (-flat.shape[1]) % 8
    flat = np.pad(flat, ((0, 0), (0, pad)))
    return np.packbits(flat, axis=1, bitorder="little")


def unpack_bits(packed, n, bits):
    flat = np.unpackbits(np.asarray(packed, dtype=np.uint8), axis=1, bitorder="little")
    planes = flat[:, : n * bits].reshape(packed.shape[0], n, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=2).astype(np.uint8)


# -- rotated Lloyd-Max codec -----------------------------------------------------------------

def tq_encode_rows(X, levels, bits, seed=0x9E3779B9, unbiased=False):
    """Reference of the tq encoder: nearest level by distance, ties to the lower level."""
    X = np.asarray(X, dtype=np.float64)
    n = X.shape[1]
    levels = np.asarray(levels, dtype=np.float64)
    norm = np.sqrt((X * X).sum(axis=1))
    radius = norm.astype(np.float32)
    live = np.isfinite(radius) & (radius > np.float32(1e-35))
    safe = np.where(live, norm, 1.0)
    Y = rotate(np.where(live[:, None], X, 0.0), seed) * np.sqrt(n) / safe[:, None]
    dist = np.abs(Y[:, :, None] - levels[None, None, :])
    codes = np.argmin(dist, axis=2).astype(np.uint8)   # argmin keeps the first (lower) on ties
    codes[~live] = 0
    side = np.where(live, norm, 0.0)
    if unbiased:
        dot = (Y * levels[codes]).sum(axis=1)
        side = np.where(live & (dot > 0), n * norm / np.where(dot > 0, dot, 1.0), side)
    return pack_bits(codes, bits), side.astype(np.float32)


def tq_decode_rows(packed, side, levels, bits, n, seed=0x9E3779B9):
    codes = unpack_bits(packed, n, bits)
    Y = np.asarray(levels, dtype=np.float64)[codes] * (np.asarray(side, np.float64)[:, None]
                                                        / np.sqrt(n))
    return unrotate(Y, seed)


# -- the engine's 4-bit codec, float32 step by step (REFERENCE.md §1.3) ----------------------

def fwht_f32(X):
    """Butterflies in the engine's order (h = 1, 2, 4, ...), every add in float32."""
    X = np.array(X, dtype=np.float32, copy=True)
    n_rows, n = X.shape
    h = 1
    while h < n:
        blocks = X.reshape(n_rows, n // (2 * h), 2, h)
        a, b = blocks[:, :, 0, :].copy(), blocks[:, :, 1, :].copy()
        blocks[:, :, 0, :] = a + b
        blocks[:, :, 1, :] = a - b
        h *= 2
    return X


def engine_tq4_encode_rows(X, levels):
    """The engine's encoder: double-accumulated norm rounded to float; rotation as signs,
    butterflies, x (1/sqrtf(n)); then x (sqrtf(n)/norm); nearest level by float distance with
    ties to the lower code; even elements in the low nibble."""
    X = np.asarray(X, dtype=np.float32)
    n_rows, n = X.shape
    lev = np.asarray(levels, dtype=np.float32)
    norm = np.sqrt((X.astype(np.float64) ** 2).sum(axis=1)).astype(np.float32)
    live = (norm > np.float32(1e-35)) & (norm <= np.finfo(np.float32).max)
    signs = sign_vector(n).astype(np.float32)
    Y = fwht_f32(np.where(live[:, None], X, 0) * signs)
    sqrtf_n = np.sqrt(np.float32(n))
    Y = Y * (np.float32(1.0) / sqrtf_n)
    with np.errstate(divide="ignore", over="ignore"):
        invstd = np.where(live, sqrtf_n / np.where(live, norm, 1), 0).astype(np.float32)
    V = (Y * invstd[:, None]).astype(np.float32)
    dist = np.abs(V[:, :, None] - lev[None, None, :])
    codes = np.argmin(dist, axis=2).astype(np.uint8)
    codes[~live] = 0
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, np.where(live, norm, 0).astype(np.float32)
