"""The codec contract as a check anyone can run on their codec: ``check_codec(codec)``.

What every kvquant codec promises, and what the cache, the file, the models and the experiments
rely on:

* sizes: ``encode`` gives uint8 codes of ``code_bytes`` per row and ``n_side`` side values of
  ``side_dtype`` per row; ``bytes_per_row`` counts exactly those (a ``simulated`` codec, which
  stores rows after a quantize-dequantize, counts the nominal bytes of its real format instead);
* rows are independent: encoding rows one by one gives the bytes of encoding them together (a
  cache appends rows a few at a time);
* determinism: the same rows give the same bytes, and decoding gives float32 rows of the width,
  finite for finite input; a zero row decodes to a zero row;
* thread counts change nothing: 1 and 2 threads give identical bytes and identical decodes;
* the consumers agree with decode: ``scores(enc, q)`` is ``decode(enc) @ q`` and
  ``context(enc, w)`` is ``w @ decode(enc)`` to float32 rounding, for one query and several;
* ``spec`` is a string, and ``get_codec(spec, dim)`` rebuilds a codec that gives the same bytes
  (so a spec in a result or a worker names this codec exactly).

The built-in codecs' tests run this same check (tests/test_codec_contract.py).
"""
import numpy as np

from kvquant._threads import MIN_ELEMENTS_PER_THREAD, resolve_n_threads

__all__ = ["check_codec"]


def _fail(codec, what):
    raise AssertionError(f"{codec!r}: {what}")


def _same_bytes(a, b):
    return (np.array_equal(np.asarray(a.codes), np.asarray(b.codes))
            and np.array_equal(np.asarray(a.side).view(np.uint8),
                               np.asarray(b.side).view(np.uint8)))


def check_codec(codec, n_rows=48, seed=0, rebuild=True):
    """Run the codec contract (module docstring) on ``codec``; AssertionError names the first
    broken promise.

    Parameters
    ----------
    codec : kvquant.codecs.Codec
    n_rows : int
        Gaussian rows (plus a zero row) to check with.
    seed : int
    rebuild : bool
        Also check that ``get_codec(codec.spec, codec.dim)`` gives the same bytes (a codec built
        by hand with options its spec does not carry may skip this).
    """
    from kvquant.codecs import Codec, get_codec
    if not isinstance(codec, Codec):
        raise AssertionError(f"{codec!r} is not a kvquant.codecs.Codec")
    dim = codec.dim
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_rows, dim)).astype(np.float32)
    X[n_rows // 2] = 0.0
    if not isinstance(codec.spec, str) or not codec.spec:
        _fail(codec, f"spec must be a non-empty string, got {codec.spec!r}")

    enc = codec.encode(X, n_threads=1)
    codes, side = np.asarray(enc.codes), np.asarray(enc.side)
    if codes.dtype != np.uint8 or codes.shape != (n_rows, codec.code_bytes):
        _fail(codec, f"codes are {codes.dtype} {codes.shape}; expected uint8 "
                     f"({n_rows}, code_bytes={codec.code_bytes})")
    if side.shape != (n_rows, codec.n_side):
        _fail(codec, f"side values have shape {side.shape}; expected ({n_rows}, "
                     f"n_side={codec.n_side})")
    if enc.nbytes != n_rows * codec.bytes_per_row and not codec.simulated:
        _fail(codec, f"{n_rows} encoded rows hold {enc.nbytes} bytes, but bytes_per_row says "
                     f"{codec.bytes_per_row} each")
    if not _same_bytes(enc, codec.encode(X, n_threads=1)):
        _fail(codec, "encoding the same rows twice gives different bytes")
    # enough rows that 3 threads really run (small work stays on one: kvquant._threads)
    big = rng.standard_normal((-(-3 * MIN_ELEMENTS_PER_THREAD // dim), dim)).astype(np.float32)
    assert resolve_n_threads(3, big.size) == 3
    big_enc = codec.encode(big, n_threads=1)
    big_dec = codec.decode(big_enc, n_threads=1)
    for n_threads in (2, 3):
        if not _same_bytes(big_enc, codec.encode(big, n_threads=n_threads)):
            _fail(codec, f"encode with {n_threads} threads differs from 1 thread")
        if not np.array_equal(big_dec, codec.decode(big_enc, n_threads=n_threads)):
            _fail(codec, f"decode with {n_threads} threads differs from 1 thread")
    one_by_one = [codec.encode(X[i:i + 1], n_threads=1) for i in range(0, n_rows, 7)]
    for i, part in zip(range(0, n_rows, 7), one_by_one):
        if not (np.array_equal(np.asarray(part.codes)[0], codes[i])
                and np.array_equal(np.asarray(part.side)[0].view(np.uint8),
                                   side[i].view(np.uint8))):
            _fail(codec, f"row {i} encoded alone differs from the same row encoded with others")

    Xh = codec.decode(enc, n_threads=1)
    if not isinstance(Xh, np.ndarray) or Xh.dtype != np.float32 or Xh.shape != (n_rows, dim):
        _fail(codec, f"decode gives {type(Xh).__name__} {getattr(Xh, 'dtype', '')} "
                     f"{getattr(Xh, 'shape', '')}; expected float32 ({n_rows}, {dim})")
    if not np.isfinite(Xh).all():
        _fail(codec, "decode of finite rows is not finite")
    if np.any(Xh[n_rows // 2] != 0):
        _fail(codec, "a zero row does not decode to zeros")

    scale = float(np.abs(Xh).max()) or 1.0
    for n_queries in (1, 4):
        Q = rng.standard_normal((n_queries, dim)).astype(np.float32)
        W = rng.random((n_queries, n_rows)).astype(np.float32)
        q, w = (Q[0], W[0]) if n_queries == 1 else (Q, W)
        want_s = (Xh.astype(np.float64) @ np.atleast_2d(q).T.astype(np.float64)).T
        got_s = np.atleast_2d(codec.scores(enc, q, n_threads=1))
        want_c = np.atleast_2d(w).astype(np.float64) @ Xh.astype(np.float64)
        got_c = np.atleast_2d(codec.context(enc, w, n_threads=1))
        tol_s = 1e-4 * scale * np.sqrt(dim) * np.abs(np.atleast_2d(q)).max()
        tol_c = 1e-4 * scale * n_rows
        if got_s.shape != want_s.shape or np.abs(got_s - want_s).max() > tol_s:
            _fail(codec, f"scores with {n_queries} quer(ies) disagree with decode(enc) @ q")
        if got_c.shape != want_c.shape or np.abs(got_c - want_c).max() > tol_c:
            _fail(codec, f"context with {n_queries} weight row(s) disagrees with w @ decode(enc)")
        # the consumers over the big rows: each thread takes a share of them
        Wb = rng.random((n_queries, big.shape[0])).astype(np.float32)
        wb = Wb[0] if n_queries == 1 else Wb
        s1, c1 = codec.scores(big_enc, q, n_threads=1), codec.context(big_enc, wb, n_threads=1)
        for n_threads in (2, 3):
            if not (np.array_equal(s1, codec.scores(big_enc, q, n_threads=n_threads))
                    and np.array_equal(c1, codec.context(big_enc, wb, n_threads=n_threads))):
                _fail(codec, f"consumers with {n_threads} threads differ from 1 thread")

    if rebuild:
        try:
            again = get_codec(codec.spec, dim)
        except ValueError as exc:
            _fail(codec, f"get_codec(spec={codec.spec!r}, {dim}) fails: {exc}")
        if not _same_bytes(enc, again.encode(X, n_threads=1)):
            _fail(codec, f"get_codec({codec.spec!r}, {dim}) builds a codec that encodes "
                         "differently")
