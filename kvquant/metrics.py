"""Error and agreement measures shared by the command line, the experiments and the tests."""
import math

import numpy as np


def relative_l2(X, X_hat):
    """Per-row |x - x^| / |x| (float64); rows of zero norm give 0 when x^ is zero too, else inf."""
    X = np.asarray(X, dtype=np.float64)
    X_hat = np.asarray(X_hat, dtype=np.float64)
    err = np.linalg.norm(X - X_hat, axis=1)
    norm = np.linalg.norm(X, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = err / norm
    return np.where(norm > 0, rel, np.where(err > 0, np.inf, 0.0))


def measure_distortion(codec, X, n_threads=None):
    """Encode and decode rows with ``codec``; return the row of a distortion table.

    Returns
    -------
    dict with codec, dim, bits_per_value, bytes_per_row, compression, rel_l2_mean, rel_l2_max,
    rel_mse (sum of squared errors over sum of squares).
    """
    X = np.asarray(X)
    X_hat = codec.roundtrip(X, n_threads=n_threads)
    rel = relative_l2(X, X_hat)
    X64 = X.astype(np.float64)
    rel_mse = float(((X64 - X_hat) ** 2).sum() / (X64**2).sum())
    return {
        "codec": codec.spec,
        "dim": codec.dim,
        "bits_per_value": codec.bits_per_value,
        "bytes_per_row": codec.bytes_per_row,
        "compression": codec.compression_ratio,
        "rel_l2_mean": float(rel.mean()),
        "rel_l2_max": float(rel.max()),
        "rel_mse": rel_mse,
    }


def measure_stream_distortion(stream_spec, X, n_threads=None):
    """:func:`measure_distortion` for a stream spec with options (``"tq4@center,sinks=1"``):
    the rows are appended to one :class:`~kvquant.streams.RowStream` in a single call (the first
    append is the whole of X, so its mean and spread set the offset and scales) and read back.
    Bytes per row include the stream's fixed bytes spread over the rows."""
    from kvquant.streams import RowStream, StreamSpec
    X = np.asarray(X)
    spec = StreamSpec.of(stream_spec)
    codec = spec.codec(X.shape[1] if X.ndim == 2 else -1)
    stream = RowStream(codec, capacity=X.shape[0], **spec.options.as_dict())
    stream.append(X, n_threads)
    X_hat = stream.decode(n_threads=n_threads)
    rel = relative_l2(X, X_hat)
    X64 = X.astype(np.float64)
    bytes_per_row = stream.nbytes / max(X.shape[0], 1)
    return {
        "codec": stream.spec,
        "dim": codec.dim,
        "bits_per_value": 8.0 * bytes_per_row / codec.dim,
        "bytes_per_row": round(bytes_per_row, 2),
        "compression": 4.0 * codec.dim / bytes_per_row,
        "rel_l2_mean": float(rel.mean()),
        "rel_l2_max": float(rel.max()),
        "rel_mse": float(((X64 - X_hat) ** 2).sum() / (X64**2).sum()),
    }


def wilson_interval(successes, n, z=1.959963984540054):
    """Wilson score interval of a proportion (95% by default), as (low, high) in [0, 1]."""
    if n <= 0:
        raise ValueError(f"a proportion needs n > 0 trials, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must lie in 0..n={n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
