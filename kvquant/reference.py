"""Plain-numpy references of every kernel, written for clarity rather than speed.

Tests compare the compiled kernels against these; they share no code with the kernels (different
algorithms where possible: fp8 rounding by nearest-value search, the Hadamard transform as a
matrix product, bit packing through numpy's bit arrays).
"""
import numpy as np
import scipy.linalg

# -- fp8 e4m3fn ------------------------------------------------------------------------------

# The engine's inert threshold: a row whose norm (fp8: a group's amax) is above the float literal
# 3.4e38f (= 3.39999995e38, a little below FLT_MAX) is stored inert (docs/engine-arithmetic.md §8).
ROW_LIMIT = np.float32(3.4e38)


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
    """Per-group scale = amax/448 (NaN ignored); inert group (amax not > 1e-35 or infinite):
    zero bytes and scale 1; NaN elements of a live group encode to 0x00."""
    X = np.asarray(X, dtype=np.float32)
    n, d = X.shape
    group = d if group is None else group
    G = X.reshape(n, d // group, group)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # NaN elements never raise amax (they encode to 0x00 later); an inf makes the group inert
        absG = np.abs(G)
        amax = np.where(np.isnan(absG), np.float32(0), absG).max(axis=2)
        live = (amax > np.float32(1e-35)) & (amax <= ROW_LIMIT)
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
    live = (radius > np.float32(1e-35)) & (radius <= ROW_LIMIT)
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


# -- the engine's 4-bit codec, float32 step by step (docs/reference.md §1.3) ----------------------

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
    live = (norm > np.float32(1e-35)) & (norm <= ROW_LIMIT)
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


# -- compressed-domain consumers (kvquant._kernels.consumers) ----------------------------------
# Written as the engine states them (docs/reference.md §1.5), in float64: the scale factored out of
# each sum, the query rotated once, the context summed in the rotated basis and unrotated once.
# Tests hold the kernels to these and to decode-then-dot, within the engine's tolerances.

def softmax(scores, out=None):
    """numpy's float32 softmax over the last axis (max subtracted; -inf entries get weight 0):
    the reference of the compiled one (kvquant/_kernels/softmax.h) and what the numpy baselines
    of the benchmarks run. ``out`` (it may be ``scores`` itself) takes the weights."""
    m = scores.max(axis=-1, keepdims=True)
    e = np.subtract(scores, m, out=out)
    np.exp(e, out=e)
    e /= e.sum(axis=-1, keepdims=True)
    return e


def matvec_lanes(W, x):
    """W (m, n) x (n,) in float32, in kvquant/_kernels/matvec.h's order: 16 lane sums (lane l
    adds w[j] x[j] for j = l, l + 16, ... in order, the last block padded with zeros), then the
    pairwise tree of kvq_tree16. Bit for bit the compiled kernel's result."""
    W = np.asarray(W, np.float32)
    x = np.asarray(x, np.float32)
    m, n = W.shape
    pad = (-n) % 16
    Wp = np.concatenate([W, np.zeros((m, pad), np.float32)], axis=1)
    xp = np.concatenate([x, np.zeros(pad, np.float32)])
    acc = np.zeros((m, 16), np.float32)
    for j in range(0, n + pad, 16):
        acc = acc + Wp[:, j:j + 16] * xp[j:j + 16]
    s8 = acc[:, :8] + acc[:, 8:]
    s4 = s8[:, :4] + s8[:, 4:]
    s2 = s4[:, :2] + s4[:, 2:]
    return s2[:, 0] + s2[:, 1]


def f32_scores(X, Q):
    """Q (m, d) . X (T, d)^T."""
    return np.asarray(Q, np.float64) @ np.asarray(X, np.float64).T


def f32_context(X, W):
    """W (m, T) X (T, d)."""
    return np.asarray(W, np.float64) @ np.asarray(X, np.float64)


def kv8_scores(codes, scales, Q, group=None):
    """sum_g scale_tg * sum_{i in g} q_i lut[code_ti]."""
    vals = np.nan_to_num(e4m3_values(), nan=0.0)
    codes = np.asarray(codes)
    n, d = codes.shape
    group = d if group is None else group
    V = vals[codes].reshape(n, d // group, group)                     # (T, G, g)
    Qg = np.asarray(Q, np.float64).reshape(-1, d // group, group)     # (m, G, g)
    partial = np.einsum("mgi,tgi->mtg", Qg, V)
    return (partial * np.asarray(scales, np.float64)[None]).sum(axis=2)


def kv8_context(codes, scales, W, group=None):
    """sum_t (w_t scale_tg) lut[code_t], the scale folded into the weight."""
    vals = np.nan_to_num(e4m3_values(), nan=0.0)
    codes = np.asarray(codes)
    n, d = codes.shape
    group = d if group is None else group
    V = vals[codes].reshape(n, d // group, group)
    C = np.asarray(W, np.float64)[:, :, None] * np.asarray(scales, np.float64)[None]  # (m, T, G)
    return np.einsum("mtg,tgi->mgi", C, V).reshape(-1, d)


def _tq_steps(side, n):
    r = np.asarray(side, np.float64).reshape(-1)
    live = (r > 0) & (r <= ROW_LIMIT)
    return np.where(live, r, 0.0) / np.sqrt(n)


def tq_scores(packed, side, levels, bits, Q, seed=0x9E3779B9):
    """(radius_t / sqrt(n)) * sum_i rotate(q)_i levels[code_ti]."""
    Q = np.atleast_2d(np.asarray(Q, np.float64))
    n = Q.shape[1]
    L = np.asarray(levels, np.float64)[unpack_bits(packed, n, bits)]  # (T, n), rotated basis
    return (rotate(Q, seed) @ L.T) * _tq_steps(side, n)[None, :]


def tq_context(packed, side, levels, bits, W, n, seed=0x9E3779B9):
    """unrotate(sum_t (w_t radius_t / sqrt(n)) levels[code_t])."""
    L = np.asarray(levels, np.float64)[unpack_bits(packed, n, bits)]
    C = np.asarray(W, np.float64) * _tq_steps(side, n)[None, :]
    return unrotate(C @ L, seed)



# -- table lookups over grouped codes (kvquant._kernels.tablelookup) ---------------------------
# Written as dense gathers: every row's codes unpacked, the table indexed by (group, code).

def table_scores(packed, bits, table, row_scale):
    """scores[i, t] = row_scale[t] * sum_g table[i, g, code(t, g)], float64 (m, T)."""
    table = np.asarray(table, np.float64)
    n_groups = table.shape[1]
    codes = unpack_bits(packed, n_groups, bits).astype(np.int64)           # (T, G)
    picked = table[:, np.arange(n_groups)[None, :], codes]                  # (m, T, G)
    return picked.sum(axis=2) * np.asarray(row_scale, np.float64)[None, :]


def table_weights(packed, bits, weights, n_groups, n_centroids):
    """cells[i, g, k] = sum of weights[i, t] over rows whose group g has code k."""
    weights = np.asarray(weights, np.float64)
    codes = unpack_bits(packed, n_groups, bits).astype(np.int64)           # (T, G)
    one_hot = codes[:, :, None] == np.arange(n_centroids)[None, None, :]   # (T, G, K)
    return np.einsum("mt,tgk->mgk", weights, one_hot.astype(np.float64))

# -- PolarQuant (docs/reference.md §1.4) ------------------------------------------------------------
# Written apart from kvquant/_kernels/polar.pyx: the transform on strided numpy views, nearest
# centroid by distance (argmin) instead of boundaries, the radius allocation by a full sort
# instead of a radix select, variable-width packing through numpy bit arrays.

def _polar_forward(Y):
    """Recursive pairwise polar transform: a list of angle arrays (level 1 first)."""
    angles, r = [], Y
    while r.shape[1] > 1:
        a, c = r[:, 0::2], r[:, 1::2]
        angles.append(np.arctan2(c, a))
        r = np.hypot(a, c)
    return angles


def _pack_variable(codes, widths, n_bytes):
    """codes/widths of shape (n_rows, n_codes), each code LSB first, in order; zero padding."""
    n_rows = codes.shape[0]
    k = np.arange(8)
    planes = ((codes[:, :, None].astype(np.int64) >> k) & 1).astype(np.uint8)
    chosen = planes[k[None, None, :] < widths[:, :, None]].reshape(n_rows, -1)
    bits = np.zeros((n_rows, 8 * n_bytes), np.uint8)
    bits[:, :chosen.shape[1]] = chosen
    return np.packbits(bits, axis=1, bitorder="little")


def _read_variable(bits, start, widths):
    """Codes of the given widths (n_rows, cnt) stored one after another from bit `start`."""
    n_rows, cnt = widths.shape
    offsets = start + np.concatenate([np.zeros((n_rows, 1), np.int64),
                                      np.cumsum(widths, axis=1)[:, :-1]], axis=1)
    k = np.arange(8)
    idx = np.minimum(offsets[:, :, None] + k, bits.shape[1] - 1)
    got = bits[np.arange(n_rows)[:, None, None], idx].astype(np.int64)
    return ((got * (k < widths[:, :, None])) << k).sum(axis=2)


def polar_row_bytes(n, bits):
    return ((n // 2) * bits + (n // 2 - 1) * max(bits - 1, 1) + 7) // 8


def _engine_polar_grid(level, bits):
    """The engine's grid as float32 scalars: (kind, a, b) used by encode and decode below."""
    f32 = np.float32
    pi = f32(np.pi)
    if level == 1:
        return pi, f32(0.5) / pi
    s = f32(2 ** (level - 1))
    w = min(f32(1.5) / np.sqrt(s), f32(0.25) * pi)
    return f32(0.25) * pi - w, f32(2) * w


def polar_engine_encode_rows(X, bits, seed=0x9E3779B9):
    """The engine's polar encoder in float32 numpy: norm in double; signs, butterflies, x 1/sqrtf(n);
    atan2/hypot per pair; floor-then-clamp on the uniform grids (level 1 on `bits` bits over
    [-pi, pi), deeper levels on max(bits-1, 1) bits around pi/4). numpy's float32 atan2/hypot may
    differ from libm's in the last place, so a code on a grid edge may differ."""
    f32 = np.float32
    X = np.asarray(X, dtype=np.float32)
    n_rows, n = X.shape
    norm = np.sqrt((X.astype(np.float64) ** 2).sum(axis=1)).astype(np.float32)
    live = (norm > f32(1e-35)) & (norm <= ROW_LIMIT)
    Y = fwht_f32(np.where(live[:, None], X, 0) * sign_vector(n, seed).astype(np.float32))
    Y = (Y * (f32(1.0) / np.sqrt(f32(n)))).astype(np.float32)
    codes, widths = [], []
    for level, ang in enumerate(_polar_forward(Y), start=1):
        b = bits if level == 1 else max(bits - 1, 1)
        scale = f32(2**b)
        if level == 1:
            pi, inv_two_pi = _engine_polar_grid(1, b)
            u = (ang + pi) * inv_two_pi
        else:
            lo, two_w = _engine_polar_grid(level, b)
            u = (ang - lo) / two_w
        q = np.clip(np.floor(u * scale), 0, 2**b - 1).astype(np.int64)
        codes.append(q)
        widths.append(np.full(q.shape, b))
    codes, widths = np.concatenate(codes, axis=1), np.concatenate(widths, axis=1)
    codes[~live] = 0
    packed = _pack_variable(codes, widths, polar_row_bytes(n, bits))
    return packed, np.where(live, norm, 0).astype(np.float32)


def polar_engine_decode_rows(packed, radius, bits, n, seed=0x9E3779B9):
    """Bin centres (float32 as the engine), top-down rebuild with cos/sin, unrotate."""
    f32 = np.float32
    radius = np.asarray(radius, dtype=np.float32)
    n_rows = radius.shape[0]
    flat = np.unpackbits(np.asarray(packed, np.uint8), axis=1, bitorder="little")
    n_levels = n.bit_length() - 1
    thetas, start = [], 0
    for level in range(1, n_levels + 1):
        cnt, b = n >> level, (bits if level == 1 else max(bits - 1, 1))
        q = _read_variable(flat, start, np.full((n_rows, cnt), b)).astype(np.float32)
        start += cnt * b
        if level == 1:
            pi, _ = _engine_polar_grid(1, b)
            thetas.append(-pi + ((q + f32(0.5)) * (f32(2) * pi)) / f32(2**b))
        else:
            lo, two_w = _engine_polar_grid(level, b)
            thetas.append(lo + ((q + f32(0.5)) * two_w) / f32(2**b))
    live = (radius > 0) & (radius <= ROW_LIMIT)
    cur = np.where(live, radius, 0).astype(np.float32)[:, None]
    for theta in reversed(thetas):
        nxt = np.empty((n_rows, 2 * cur.shape[1]), np.float32)
        nxt[:, 0::2] = cur * np.cos(theta)
        nxt[:, 1::2] = cur * np.sin(theta)
        cur = nxt
    out = fwht_f32(cur) * (f32(1.0) / np.sqrt(f32(n)))
    return (out * sign_vector(n, seed).astype(np.float32)).astype(np.float32)


def polar_allocate(weight, gains, total):
    """Bits per angle: the `total` largest keys weight[j] + gains[k] (angle j's (k+1)-th bit),
    ties to the lower j then k, found by sorting every key. weight (n_rows, cnt) int."""
    n_rows, cnt = weight.shape
    n_bits = len(gains)
    if total >= n_bits * cnt or total <= 0:
        return np.full((n_rows, cnt), n_bits if total > 0 else 0, np.int64)
    keys = weight[:, :, None].astype(np.int64) + np.asarray(gains, np.int64)[None, None, :]
    order = np.arange(cnt * n_bits).reshape(cnt, n_bits)
    composite = keys * (1 << 24) - order[None]
    threshold = -np.sort(-composite.reshape(n_rows, -1), axis=1)[:, total - 1]
    return (composite >= threshold[:, None, None]).sum(axis=2)


def _polar_centroid_table(centroids, level):
    """centroids[level][bits] (ragged lists or padded arrays) as a padded (bits, 256) table."""
    table = np.zeros((len(centroids[level]), 256))
    for bits, c in enumerate(centroids[level]):
        c = np.asarray(c, np.float64)[:2**bits]
        table[bits, :c.size] = c
    return table


def polar_lloyd_encode_rows(X, centroids, log2_cos2, log2_sin2, gains, level_totals, alloc,
                            seed=0x9E3779B9):
    """The Lloyd polar encoder in float64. centroids[level][bits][:2**bits] (ragged or padded),
    log2 tables (level, bits, code), gains (level, k); level_totals[level] are
    the bits of each level; alloc "level" gives every angle level_totals / count bits."""
    X = np.asarray(X, dtype=np.float64)
    n_rows, n = X.shape
    n_levels = n.bit_length() - 1
    norm = np.sqrt((X * X).sum(axis=1))
    radius = norm.astype(np.float32)
    live = (radius > np.float32(1e-35)) & (radius <= ROW_LIMIT)
    Y = rotate(np.where(live[:, None], X, 0.0), seed)
    angles = _polar_forward(Y)
    codes, widths = [None] * n_levels, [None] * n_levels
    weight = np.zeros((n_rows, 1), np.int64)
    for level in range(n_levels, 0, -1):
        cnt = n >> level
        if alloc == "radius":
            w = polar_allocate(weight, gains[level], level_totals[level])
        else:
            w = np.full((n_rows, cnt), level_totals[level] // cnt)
        q = np.zeros((n_rows, cnt), np.int64)
        for b in np.unique(w):
            sel = w == b
            cents = _polar_centroid_table(centroids, level)[b, :2**b]
            dist = np.abs(angles[level - 1][sel][:, None] - cents[None, :])
            q[sel] = np.argmin(dist, axis=1)                            # first of equals: lower
        codes[level - 1], widths[level - 1] = q, w
        if level > 1:
            child = np.empty((n_rows, 2 * cnt), np.int64)
            child[:, 0::2] = weight + np.asarray(log2_cos2)[level][w, q]
            child[:, 1::2] = weight + np.asarray(log2_sin2)[level][w, q]
            weight = child
    codes, widths = np.concatenate(codes, axis=1), np.concatenate(widths, axis=1)
    codes[~live] = 0
    n_bytes = (int(sum(level_totals)) + 7) // 8
    return _pack_variable(codes, widths, n_bytes), np.where(live, norm, 0).astype(np.float32)


def polar_lloyd_decode_rows(packed, radius, centroids, log2_cos2, log2_sin2, gains, level_totals,
                            alloc, n, seed=0x9E3779B9):
    radius = np.asarray(radius, dtype=np.float64)
    n_rows = radius.shape[0]
    n_levels = n.bit_length() - 1
    flat = np.unpackbits(np.asarray(packed, np.uint8), axis=1, bitorder="little")
    starts = np.concatenate([[0], np.cumsum(level_totals[1:n_levels + 1])])
    live = (radius > 0) & (radius <= ROW_LIMIT)
    cur = np.where(live, radius, 0.0)[:, None]
    weight = np.zeros((n_rows, 1), np.int64)
    for level in range(n_levels, 0, -1):
        cnt = n >> level
        if alloc == "radius":
            w = polar_allocate(weight, gains[level], level_totals[level])
        else:
            w = np.full((n_rows, cnt), level_totals[level] // cnt)
        q = _read_variable(flat, starts[level - 1], w)
        theta = _polar_centroid_table(centroids, level)[w, q]
        if level > 1:
            child = np.empty((n_rows, 2 * cnt), np.int64)
            child[:, 0::2] = weight + np.asarray(log2_cos2)[level][w, q]
            child[:, 1::2] = weight + np.asarray(log2_sin2)[level][w, q]
            weight = child
        nxt = np.empty((n_rows, 2 * cnt))
        nxt[:, 0::2] = cur * np.cos(theta)
        nxt[:, 1::2] = cur * np.sin(theta)
        cur = nxt
    return unrotate(cur, seed)


# -- llama.cpp Q8_0 / Q4_0 (docs/reference.md §3) ---------------------------------------------------
# From the format's definition (ggml-quants.c, quantize_row_q8_0_ref / q4_0_ref), in float32 where
# ggml computes in float32; rounding half away from zero as floor(|v| + 1/2) in float64.

def _round_half_away(v):
    v64 = np.asarray(v, np.float64)
    return np.sign(v64) * np.floor(np.abs(v64) + 0.5)


def q8_0_encode_rows(X):
    X = np.asarray(X, dtype=np.float32)
    n_rows, d = X.shape
    B = X.reshape(n_rows, d // 32, 32)
    amax = np.abs(B).max(axis=2)
    scale = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        v = (B * inv[:, :, None]).astype(np.float32)
    q = np.where(np.isfinite(v), _round_half_away(np.where(np.isfinite(v), v, 0)), 0)
    blocks = np.concatenate([scale.astype("<f2").view(np.uint8).reshape(n_rows, -1, 2),
                             q.astype(np.int8).view(np.uint8)], axis=2)
    return blocks.reshape(n_rows, -1)


def q8_0_decode_rows(codes, d):
    codes = np.asarray(codes, np.uint8)
    n_rows = codes.shape[0]
    blocks = codes.reshape(n_rows, d // 32, 34)
    scale = blocks[:, :, :2].copy().view("<f2").astype(np.float32)
    q = blocks[:, :, 2:].view(np.int8).astype(np.float32)
    return (q * scale).reshape(n_rows, d)


def q4_0_encode_rows(X):
    X = np.asarray(X, dtype=np.float32)
    n_rows, d = X.shape
    B = X.reshape(n_rows, d // 32, 32)
    first_peak = np.argmax(np.abs(B), axis=2)          # the first element of largest magnitude
    peak = np.take_along_axis(B, first_peak[:, :, None], axis=2)[:, :, 0]
    scale = (peak / np.float32(-8)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        v = ((B * inv[:, :, None]).astype(np.float32) + np.float32(8.5)).astype(np.float32)
    q = np.where(np.isfinite(v), np.minimum(15, np.floor(np.where(np.isfinite(v), v, 0))), 0)
    q = q.astype(np.uint8)
    packed = q[:, :, :16] | (q[:, :, 16:] << 4)
    blocks = np.concatenate([scale.astype("<f2").view(np.uint8).reshape(n_rows, -1, 2), packed],
                            axis=2)
    return blocks.reshape(n_rows, -1)


def q4_0_decode_rows(codes, d):
    codes = np.asarray(codes, np.uint8)
    n_rows = codes.shape[0]
    blocks = codes.reshape(n_rows, d // 32, 18)
    scale = blocks[:, :, :2].copy().view("<f2").astype(np.float32)
    nib = blocks[:, :, 2:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=2).astype(np.float32) - np.float32(8)
    return (scale * q).reshape(n_rows, d)


def _ggml_blocks(codes, dim, bits):
    """Block scales (T, n_blocks) and integer values (T, n_blocks, 32) of q8_0 / q4_0 rows."""
    codes = np.asarray(codes, np.uint8)
    bb = 34 if bits == 8 else 18
    B = codes.reshape(codes.shape[0], dim // 32, bb)
    d = B[:, :, :2].copy().view("<f2")[:, :, 0].astype(np.float64)
    if bits == 8:
        v = B[:, :, 2:].view(np.int8).astype(np.float64)
    else:
        nib = B[:, :, 2:]
        v = np.concatenate([nib & 0x0F, nib >> 4], axis=2).astype(np.float64) - 8.0
    return d, v


def ggml_scores(codes, Q, bits, rotated=False, seed=0x9E3779B9):
    """sum_b d_tb * sum_{i in b} q_i v_ti, with q rotated first for +rot."""
    Q = np.atleast_2d(np.asarray(Q, np.float64))
    dim = Q.shape[1]
    Q = rotate(Q, seed) if rotated else Q
    d, v = _ggml_blocks(codes, dim, bits)
    partial = np.einsum("mbi,tbi->mtb", Q.reshape(Q.shape[0], dim // 32, 32), v)
    return (partial * d[None]).sum(axis=2)


def ggml_context(codes, W, dim, bits, rotated=False, seed=0x9E3779B9):
    """sum_t (w_t d_tb) v_t, unrotated once for +rot."""
    d, v = _ggml_blocks(codes, dim, bits)
    C = np.asarray(W, np.float64)[:, :, None] * d[None]            # (m, T, n_blocks)
    ctx = np.einsum("mtb,tbi->mbi", C, v).reshape(-1, dim)
    return unrotate(ctx, seed) if rotated else ctx


# -- llama.cpp Q4_1 / Q5_0 / Q5_1 / IQ4_NL (docs/reference.md §3) -----------------------------------
# From the formats' definitions (ggml-quants.c, quantize_row_<type>_ref), in float32 where ggml
# computes in float32. The float -> code step is numpy's x86 cast, as the gguf package's quantizers
# run it: truncate to int32 (INT32_MIN when out of range), keep the low byte, clip.
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         np.float32)
GGML_MORE_BLOCK_BYTES = {"q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}


def _x86_codes(v, top):
    v = np.asarray(v, np.float64)
    ok = np.isfinite(v) & (v >= -2.0 ** 31) & (v < 2.0 ** 31)
    t = np.where(ok, np.trunc(np.where(ok, v, 0)), -2.0 ** 31).astype(np.int64)
    return np.minimum(t & 0xFF, top).astype(np.uint8)


def _fp16_bytes(v):
    with np.errstate(over="ignore"):
        return np.asarray(v, np.float32).astype("<f2").view(np.uint8).reshape(*np.shape(v), 2)


def _pack_nibbles(q):
    return (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)


def _pack_high_bits(q):
    """bit j of a little-endian uint32 = bit 4 of q[j]: (..., 32) -> (..., 4) bytes."""
    bits = ((q.astype(np.uint64) >> 4) & 1) << np.arange(32, dtype=np.uint64)
    return bits.sum(axis=-1).astype("<u4").view(np.uint8).reshape(*q.shape[:-1], 4)


def _blocks(X):
    X = np.asarray(X, dtype=np.float32)
    return X.reshape(X.shape[0], X.shape[1] // 32, 32)


def q5_0_encode_rows(X):
    B = _blocks(X)
    peak = np.take_along_axis(B, np.argmax(np.abs(B), axis=2)[:, :, None], axis=2)[:, :, 0]
    scale = (peak / np.float32(-16)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        q = _x86_codes((B * inv[:, :, None]).astype(np.float32) + np.float32(16.5), 31)
    blocks = np.concatenate([_fp16_bytes(scale), _pack_high_bits(q), _pack_nibbles(q)], axis=2)
    return blocks.reshape(B.shape[0], -1)


def _offset_encode_rows(X, top):
    B = _blocks(X)
    lo, hi = B.min(axis=2), B.max(axis=2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = ((hi - lo) / np.float32(top)).astype(np.float32)
        inv = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        v = ((B - lo[:, :, None]).astype(np.float32) * inv[:, :, None]).astype(np.float32)
        q = _x86_codes(v + np.float32(0.5), top)
    parts = [_fp16_bytes(scale), _fp16_bytes(lo)]
    if top == 31:
        parts.append(_pack_high_bits(q))
    blocks = np.concatenate(parts + [_pack_nibbles(q)], axis=2)
    return blocks.reshape(B.shape[0], -1)


def q4_1_encode_rows(X):
    return _offset_encode_rows(X, 15)


def q5_1_encode_rows(X):
    return _offset_encode_rows(X, 31)


def iq4_nl_encode_rows(X):
    """ggml's quantize_row_iq4_nl_ref: nearest level at x / d0 (d0 = peak / -127, ties to the
    upper level unless strictly nearer the lower), then the x^2-weighted least-squares scale,
    summed in element order in float32."""
    B = _blocks(X)
    K = IQ4_NL_LEVELS
    amax = np.abs(B).max(axis=2)
    peak = np.take_along_axis(B, np.argmax(np.abs(B), axis=2)[:, :, None], axis=2)[:, :, 0]
    live = amax >= np.float32(1e-15)
    d0 = np.where(live, peak, np.float32(1)) / np.float32(-127)
    a = (np.float32(1) / d0.astype(np.float32))[:, :, None] * B                   # float32
    upper = np.clip(np.searchsorted(K, a, side="right"), 1, 15)
    lower_nearer = (a - K[upper - 1]) < (K[upper] - a)                            # float32
    idx = np.where(a <= K[0], 0, np.where(a >= K[15], 15, upper - lower_nearer))
    k = K[idx]
    sumqx = np.zeros(amax.shape, np.float32)
    sumq2 = np.zeros(amax.shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(32):
            w = B[:, :, j] * B[:, :, j]
            sumqx = (sumqx + (w * k[:, :, j]) * B[:, :, j]).astype(np.float32)
            sumq2 = (sumq2 + (w * k[:, :, j]) * k[:, :, j]).astype(np.float32)
        scale = np.where(live, sumqx / sumq2, np.float32(0)).astype(np.float32)
    q = np.where(live[:, :, None], idx, 0).astype(np.uint8)
    blocks = np.concatenate([_fp16_bytes(scale), _pack_nibbles(q)], axis=2)
    return blocks.reshape(B.shape[0], -1)


def _ggml_more_blocks(codes, dim, kind):
    """Per block: scale d, minimum m (0 where the format has none), values v (T, n_blocks, 32),
    all float64, with x = d v + m."""
    codes = np.asarray(codes, np.uint8)
    B = codes.reshape(codes.shape[0], dim // 32, GGML_MORE_BLOCK_BYTES[kind])
    f16 = lambda a: a.copy().view("<f2")[:, :, 0].astype(np.float64)   # noqa: E731
    d = f16(B[:, :, 0:2])
    m = f16(B[:, :, 2:4]) if kind in ("q4_1", "q5_1") else np.zeros_like(d)
    qs_at = {"q4_1": 4, "q5_0": 6, "q5_1": 8, "iq4_nl": 2}[kind]
    nib = B[:, :, qs_at:qs_at + 16]
    code = np.concatenate([nib & 0x0F, nib >> 4], axis=2).astype(np.int64)
    if kind in ("q5_0", "q5_1"):
        qh_at = 2 if kind == "q5_0" else 4
        qh = B[:, :, qh_at:qh_at + 4].copy().view("<u4")[:, :, 0].astype(np.int64)
        code |= ((qh[:, :, None] >> np.arange(32)) & 1) << 4
    if kind == "iq4_nl":
        v = IQ4_NL_LEVELS.astype(np.float64)[code]
    else:
        v = code.astype(np.float64) - (16.0 if kind == "q5_0" else 0.0)
    return d, m, v


def ggml_more_decode_rows(codes, dim, kind):
    d, m, v = _ggml_more_blocks(codes, dim, kind)
    with np.errstate(invalid="ignore"):            # inf or NaN scales of arbitrary bytes
        return (d[:, :, None] * v + m[:, :, None]).reshape(-1, dim)


def ggml_more_scores(codes, Q, kind, rotated=False, seed=0x9E3779B9):
    """sum_b (d_tb sum_{i in b} q_i v_ti + m_tb sum_{i in b} q_i), q rotated first for +rot."""
    Q = np.atleast_2d(np.asarray(Q, np.float64))
    dim = Q.shape[1]
    Q = rotate(Q, seed) if rotated else Q
    d, m, v = _ggml_more_blocks(codes, dim, kind)
    Qb = Q.reshape(Q.shape[0], dim // 32, 32)
    partial = np.einsum("mbi,tbi->mtb", Qb, v)
    return (partial * d[None]).sum(axis=2) + np.einsum("mb,tb->mt", Qb.sum(axis=2), m)


def ggml_more_context(codes, W, dim, kind, rotated=False, seed=0x9E3779B9):
    """sum_t w_t (d_tb v_t + m_tb), unrotated once for +rot."""
    d, m, v = _ggml_more_blocks(codes, dim, kind)
    W = np.asarray(W, np.float64)
    ctx = np.einsum("mtb,tbi->mbi", W[:, :, None] * d[None], v) + (W @ m.reshape(len(m), -1))[:, :, None]
    ctx = ctx.reshape(-1, dim)
    return unrotate(ctx, seed) if rotated else ctx
