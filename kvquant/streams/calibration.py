"""Calibrated stream statistics: offsets and channel scales measured once, for every stream.

``center`` and ``normalize`` (:func:`kvquant.streams.options.parse_stream_spec`) take a
stream's offset and channel scales from its first append: a prompt's prefill gives good ones, a
stream started empty and fed one token at a time gets the statistics of a single row (its
offset is that row, its scales all ones). ``center=calib`` / ``normalize=calib`` read them from
a :class:`StreamStatistics` instead: per layer, stream and KV head, the mean and the half-way
normalization scales (:func:`~kvquant.streams.options.finite_mean`,
:func:`~kvquant.streams.options.channel_scale`, the same definitions as the first append's)
over the rows of a calibration text, stored in a small ``.npz`` file with what they were
measured on.

A cache file records the :meth:`StreamStatistics.digest` of the statistics its streams were
written with and refuses to resume under others (the codes hold rows after those offsets and
scales).
"""
import hashlib
import json
import os

import numpy as np

from kvquant.outputs import atomic_write
from kvquant.streams.options import channel_scale, finite_mean

__all__ = ["StreamStatistics", "statistics_digest"]

FORMAT = "kvquant-stream-statistics"
VERSION = 1


def statistics_digest(offsets, scales):
    """``"sha256:<hex>"`` of one stream's statistics: the float32 little-endian bytes of its
    offsets then its scales (each (slots, dim), or absent), with their shapes."""
    h = hashlib.sha256()
    for name, vec in (("offsets", offsets), ("scales", scales)):
        if vec is None:
            h.update(f"{name}:none;".encode())
            continue
        vec = np.ascontiguousarray(vec, "<f4")
        h.update(f"{name}:{vec.shape};".encode())
        h.update(vec.tobytes())
    return "sha256:" + h.hexdigest()


class StreamStatistics:
    """Offsets and channel scales per layer, stream and KV head.

    Parameters
    ----------
    offsets, scales : dict of str -> ndarray of shape (n_layers, n_kv_heads, dim), float32
        Per stream name (``"k"``, ``"v"``); a stream may have either or both.
    meta : dict, optional
        What they were measured on (model, text, tokens): kept in the file.
    """

    def __init__(self, offsets, scales, meta=None):
        self.offsets = {k: np.array(v, np.float32) for k, v in offsets.items()}
        self.scales = {k: np.array(v, np.float32) for k, v in scales.items()}
        self.meta = dict(meta or {})
        shapes = {v.shape for v in (*self.offsets.values(), *self.scales.values())}
        if not shapes:
            raise ValueError("statistics need at least one stream's offsets or scales")
        for name, vec in (*self.offsets.items(), *self.scales.items()):
            if vec.ndim != 3:
                raise ValueError(f"stream {name!r}: statistics must be (n_layers, n_kv_heads, "
                                 f"dim) arrays, got shape {vec.shape}")
            if not np.isfinite(vec).all():
                raise ValueError(f"stream {name!r}: statistics hold NaN or inf")
        for name, vec in self.scales.items():
            if not (vec > 0).all():
                raise ValueError(f"stream {name!r}: a channel scale <= 0")
        self.n_layers = next(iter(shapes))[0]
        if any(s[0] != self.n_layers for s in shapes):
            raise ValueError(f"statistics of different layer counts: {sorted(shapes)}")

    @property
    def streams(self):
        return sorted(set(self.offsets) | set(self.scales))

    def __repr__(self):
        return (f"<StreamStatistics streams={self.streams} layers={self.n_layers} "
                f"{self.meta.get('model', '')}>")

    # -- reading -----------------------------------------------------------------------------
    def vectors(self, layer, name):
        """``(offsets, scales)`` of one layer's stream, each (n_kv_heads, dim) float32 or None.

        A KeyError names the streams held when ``name`` has neither."""
        if name not in self.offsets and name not in self.scales:
            raise KeyError(f"no calibrated statistics for stream {name!r}; the calibration "
                           f"holds {self.streams}")
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is outside the calibration's 0..{self.n_layers - 1}")
        o, s = self.offsets.get(name), self.scales.get(name)
        return (None if o is None else o[layer]), (None if s is None else s[layer])

    def check(self, n_layers, n_kv_heads, dim, where="calibration"):
        """These statistics, checked against a model's shape."""
        for name, vec in (*self.offsets.items(), *self.scales.items()):
            if vec.shape != (n_layers, n_kv_heads, dim):
                raise ValueError(f"{where}: stream {name!r} statistics of shape {vec.shape}; the "
                                 f"model needs ({n_layers}, {n_kv_heads}, {dim}) (made for "
                                 f"another model?)")
        return self

    def digest(self):
        """``"sha256:<hex>"`` of every stream's statistics (names in order)."""
        h = hashlib.sha256()
        for name in self.streams:
            h.update(name.encode() + b"=")
            o, s = self.offsets.get(name), self.scales.get(name)
            h.update(statistics_digest(o, s).encode() + b";")
        return "sha256:" + h.hexdigest()

    # -- measuring ---------------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows, center=("k", "v"), normalize=("k", "v"), meta=None):
        """Statistics of rows: ``rows[name]`` is (n_layers, n_rows, n_kv_heads, dim) (or a list
        of n_layers arrays (n_rows, n_kv_heads, dim)); offsets for the streams in ``center``,
        scales for those in ``normalize``, per layer and KV head, with the first append's
        definitions over all the rows."""
        offsets, scales = {}, {}
        for name, per_layer in rows.items():
            stack = [np.asarray(X, np.float32) for X in per_layer]
            if name in center:
                offsets[name] = np.stack([[finite_mean(X[:, h]) for h in range(X.shape[1])]
                                          for X in stack])
            if name in normalize:
                scales[name] = np.stack([[channel_scale(X[:, h]) for h in range(X.shape[1])]
                                         for X in stack])
        return cls(offsets, scales, meta)

    # -- files -------------------------------------------------------------------------------
    def save(self, path):
        """Write a ``.npz``: ``<stream>.offsets`` / ``<stream>.scales`` arrays and a JSON
        ``meta`` (format, version, digest, what they were measured on), atomically: a reader
        never finds half a file."""
        meta = {"format": FORMAT, "version": VERSION, "digest": self.digest(), **self.meta}
        arrays = {f"{k}.offsets": v for k, v in self.offsets.items()}
        arrays.update({f"{k}.scales": v for k, v in self.scales.items()})
        atomic_write(path, lambda f: np.savez(f, meta=np.array(json.dumps(meta, sort_keys=True)),
                                              **arrays), binary=True)
        return path

    @classmethod
    def load(cls, path):
        """Read a file :meth:`save` wrote (ValueError naming the file and the problem; its
        recorded digest must match its arrays)."""
        path = os.fspath(path)
        if not os.path.isfile(path):       # a FIFO or a device would block the read
            raise ValueError(f"{path}: not a stream statistics file (no such regular file)")
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                offsets, scales = {}, {}
                for key in z.files:
                    if key == "meta":
                        continue
                    name, _, kind = key.rpartition(".")
                    if kind not in ("offsets", "scales") or not name:
                        raise ValueError(f"unknown array {key!r}")
                    (offsets if kind == "offsets" else scales)[name] = z[key]
        except (OSError, KeyError, ValueError, EOFError) as exc:
            raise ValueError(f"{path}: not a stream statistics file ({exc})") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: not a stream statistics file (its meta is not an object)")
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path}: not a stream statistics file of version {VERSION} "
                             f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
        digest = meta.pop("digest", None)
        for key in ("format", "version"):
            meta.pop(key)
        try:
            self = cls(offsets, scales, meta)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        if digest != self.digest():
            raise ValueError(f"{path}: its arrays do not match the digest it records (damaged "
                             "or edited): measure the calibration again")
        self.source = path
        return self
