"""``chsplit``: a chosen set of channels through one codec, the others through another.

TurboQuant (Zandieh et al., arXiv 2504.19874, section 4.3) reaches fractional budgets such as
2.5 and 3.5 bits by splitting a key's channels into an outlier set and the rest and quantizing
each with its own instance at its own bit width. Here the set is a bit mask over the row's
channels (bit i set: channel i is in the ``hi`` part), and each part is any codec that takes its
width (``tq``, ``polar`` and ``vq`` need a power of two: a half split of a power-of-two row).
Which channels are outliers is a property of a model's layer and KV head, not of a row: a cache
plan (kvquant.models.plan) gives each layer and head its own mask, and ``python -m
kvquant_experiments.codecs.channel_split plan`` writes one from calibrated channel spreads
(kvquant.streams.calibration: the channels with the largest spread go to ``hi``).

Spec: ``chsplit:hi=tq3,lo=tq2,mask=0xffff0000ffff0000`` (``side_dtype=f16``: both parts' side
values fp16). Bytes: both parts' codes and side values (two side values a row where one codec
has one: at head_dim 64 with fp16 sides, 0.25 bits per value more than one codec).
Consumers: each part's own, on its channels of the query (scores add, contexts interleave).
"""
import json
import os
import sys

import numpy as np

from kvquant.codecs import Codec, get_codec
from kvquant.codecs.base import ROW_NONFINITE, SIDE_DTYPES
from kvquant_experiments.study import NEW_FILE, Output, add_subcommand, study_main


class ChannelSplit(Codec):
    """Channels in ``mask`` through ``hi``, the others through ``lo``.

    Parameters
    ----------
    dim : int
    hi, lo : str
        Bare codec specs of the two parts.
    mask : str or int
        Bit i set: channel i goes to ``hi`` (a hex string in specs, ``0x...``); at least one
        channel in each part, no bit at or above ``dim``.
    side_dtype : {"f32", "f16"}
    nonfinite : {"raise", "inert"}
    """

    family = "chsplit"

    def __init__(self, dim, hi="tq3", lo="tq2", mask=None, side_dtype="f32",
                 nonfinite="raise"):
        super().__init__(dim, nonfinite)
        if mask is None:
            raise ValueError("chsplit needs mask=0x... (bit i: channel i at the hi codec); "
                             "`python -m kvquant_experiments.codecs.channel_split plan` writes "
                             "a cache plan with calibrated masks")
        try:
            bits = int(mask, 0) if isinstance(mask, str) else int(mask)
        except ValueError:
            raise ValueError(f"chsplit mask={mask!r} is not an integer (write it as 0x...)") \
                from None
        if bits < 0 or bits >> self.dim:
            raise ValueError(f"chsplit mask={mask!r} names channels outside 0..{self.dim - 1}")
        chosen = np.array([(bits >> i) & 1 for i in range(self.dim)], dtype=bool)
        if chosen.all() or not chosen.any():
            raise ValueError(f"chsplit mask={mask!r} leaves one part empty; use one codec")
        for name, spec in (("hi", hi), ("lo", lo)):
            if not isinstance(spec, str) or any(c in spec for c in ":@/,="):
                raise ValueError(f"{name}={spec!r}: a bare codec spec (tq3, polar3, vq3, kv8 ...)")
        if side_dtype not in SIDE_DTYPES:
            raise ValueError(f"side_dtype={side_dtype!r} is not one of {tuple(SIDE_DTYPES)}")
        extra = {"side_dtype": side_dtype} if side_dtype != "f32" else {}
        self.hi_channels = np.flatnonzero(chosen)
        self.lo_channels = np.flatnonzero(~chosen)
        try:
            self.hi = get_codec(hi, len(self.hi_channels), nonfinite=nonfinite, **extra)
            self.lo = get_codec(lo, len(self.lo_channels), nonfinite=nonfinite, **extra)
        except ValueError as exc:
            raise ValueError(f"chsplit splits {self.dim} channels into {len(self.hi_channels)} "
                             f"(hi={hi}) and {len(self.lo_channels)} (lo={lo}): {exc}") from None
        self.side_dtype = side_dtype
        self.mask = bits
        self.code_bytes = self.hi.code_bytes + self.lo.code_bytes
        self.n_side = self.hi.n_side + self.lo.n_side
        opts = [f"hi={hi.lower()}", f"lo={lo.lower()}", f"mask={bits:#x}"]
        opts += [] if side_dtype == "f32" else [f"side_dtype={side_dtype}"]
        self.spec = "chsplit:" + ",".join(opts)

    @property
    def series(self):
        return f"chsplit {self.hi.series}/{self.lo.series}"

    def _parts(self, codes, side):
        cb, sb = self.hi.code_bytes, self.hi.n_side
        return ((np.ascontiguousarray(codes[:, :cb]), np.ascontiguousarray(side[:, :sb])),
                (np.ascontiguousarray(codes[:, cb:]), np.ascontiguousarray(side[:, sb:])))

    def _encode(self, X, n_threads):
        status = np.zeros(X.shape[0], np.uint8)
        bad = ~np.isfinite(X).all(axis=1)
        if bad.any():
            status[bad] = ROW_NONFINITE
            X = np.where(bad[:, None], 0.0, X).astype(np.float32)
        hi = self.hi.encode(X[:, self.hi_channels], n_threads)
        lo = self.lo.encode(X[:, self.lo_channels], n_threads)
        codes = np.concatenate([hi.codes, lo.codes], axis=1)
        side = np.concatenate([hi.side, lo.side], axis=1).astype(np.float32)
        codes[bad] = 0
        side[bad] = 0.0
        return codes, side, status

    def _decode(self, codes, side, n_threads):
        (hc, hs), (lc, ls) = self._parts(codes, side)
        out = np.empty((codes.shape[0], self.dim), np.float32)
        out[:, self.hi_channels] = self.hi.decode(self.hi.encoded_rows(hc, hs), n_threads)
        out[:, self.lo_channels] = self.lo.decode(self.lo.encoded_rows(lc, ls), n_threads)
        return out

    def _scores(self, codes, side, Q, out, n_threads):
        (hc, hs), (lc, ls) = self._parts(codes, side)
        hi = self.hi.scores_checked(hc, hs, Q[:, self.hi_channels], n_threads)
        lo = self.lo.scores_checked(lc, ls, Q[:, self.lo_channels], n_threads)
        np.add(hi, lo, out=out)

    def _context(self, codes, side, W, out, n_threads):
        (hc, hs), (lc, ls) = self._parts(codes, side)
        out[:, self.hi_channels] = self.hi.context_checked(hc, hs, W, n_threads)
        out[:, self.lo_channels] = self.lo.context_checked(lc, ls, W, n_threads)


def factory(dim, **options):
    return ChannelSplit(dim, **options)


# ---------------------------------------------------------------------------------------------
# A cache plan with calibrated masks
# ---------------------------------------------------------------------------------------------
def outlier_mask(scales, count):
    """The mask of the ``count`` channels of largest calibrated scale (ties: lower channel)."""
    order = np.argsort(-np.asarray(scales, np.float64), kind="stable")[:count]
    return sum(1 << int(i) for i in order)


def channel_split_plan(statistics, streams, calibration_name=None):
    """A cache plan (kvquant.models.plan's JSON layout) with one chsplit mask per layer, stream
    and KV head.

    Parameters
    ----------
    statistics : kvquant.streams.calibration.StreamStatistics
        Channel scales (the spread the stream's ``normalize`` divides by) of the streams split.
    streams : dict
        ``{"k": (template, count), "v": ...}``: a stream spec with ``{mask}`` where the mask
        goes (``"chsplit:hi=polar3,lo=polar2,mask={mask},side_dtype=f16@center,normalize"``)
        and how many channels go to ``hi``; or ``{"v": "polar3@center"}``: that spec on every
        layer unchanged.
    """
    layers = []
    n_heads = None
    for layer in range(statistics.n_layers):
        entry = {}
        for name in ("k", "v"):
            given = streams[name]
            if isinstance(given, str):
                entry[name] = given
                continue
            template, count = given
            scales = statistics.scales.get(name)
            if scales is None:
                raise ValueError(f"the calibration holds no channel scales of stream {name!r} "
                                 f"(measured with normalize on {statistics.streams})")
            n_heads = scales.shape[1]
            specs = [template.format(mask=f"{outlier_mask(scales[layer, h], count):#x}")
                     for h in range(n_heads)]
            entry[name] = specs[0] if len(set(specs)) == 1 else specs
        layers.append(entry)
    if n_heads is None:
        raise ValueError("no stream is split: give a (template, count) for k or v")
    plan = {"kind": "kvquant-cache-plan", "version": 1, "n_layers": statistics.n_layers,
            "n_kv_heads": n_heads, "layers": layers,
            "channel_split": {"streams": {k: list(v) if not isinstance(v, str) else v
                                          for k, v in streams.items()},
                              "statistics": dict(statistics.meta)}}
    if calibration_name:
        plan["calibration"] = calibration_name
    return plan


# --------------------------------------------------------------------------------------------
# Command line (kvquant_experiments.study)
# --------------------------------------------------------------------------------------------
RESUMES = False         # seconds of work: the same command writes the plan again


def add_arguments(p):
    sub = p.add_subparsers(dest="command", required=True)
    q = add_subcommand(sub, "plan", "write a cache plan whose K (and V) streams split each "
                                    "layer's and head's channels by calibrated spread (chsplit)")
    q.add_argument("--calibration", required=True,
                   help=".npz of kvquant_experiments.calibrate measure (on the tune text)")
    q.add_argument("--k", required=True,
                   help="K stream spec with {mask}, e.g. "
                        "'chsplit:hi=polar3,lo=polar2,mask={mask},side_dtype=f16@center,normalize'")
    q.add_argument("--k-count", type=int, default=None,
                   help="channels of K's hi part (default: half the width)")
    q.add_argument("--v", required=True, help="V stream spec, with {mask} to split it too")
    q.add_argument("--v-count", type=int, default=None)
    q.add_argument("--out", required=True, help="the plan's .json path (not overwritten)")


def outputs(args):
    return [Output(args.out, NEW_FILE)]


def run(args, progress):
    from kvquant.outputs import atomic_write
    from kvquant.streams.calibration import StreamStatistics
    stats = StreamStatistics.load(args.calibration)
    streams = {}
    for name, spec, count in (("k", args.k, args.k_count), ("v", args.v, args.v_count)):
        if "{mask}" not in spec:
            streams[name] = spec
            continue
        dim = next(iter(stats.scales.values())).shape[2]
        streams[name] = (spec, count if count is not None else dim // 2)
    plan = channel_split_plan(stats, streams,
                              os.path.relpath(args.calibration, os.path.dirname(args.out) or "."))
    plan["channel_split"]["command"] = " ".join(
        ["python -m kvquant_experiments.codecs.channel_split"] + list(args.argv))
    text = json.dumps(plan, indent=1) + "\n"
    atomic_write(args.out, lambda f: f.write(text))
    print(f"wrote {args.out}")
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
