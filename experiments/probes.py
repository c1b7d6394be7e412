"""Four ideas measured on the SmolLM2 quality-per-byte frontier by simulation (issue 8).

Each idea is measured as :mod:`experiments.frontier` measures codecs: mean KL divergence of the
next-token distribution from the f32 cache, same top-1, perplexity ratio, over 2048 positions of
a real text in 512-token prefill chunks, against bits per value stored (K and V averaged, side
values included), with real codecs as reference rows in the same run.

1. **fp8 e5m2 against e4m3** (``fp8-e4m3``, ``fp8-e5m2``, ``-g32``): one f32 scale per row (or
   per 32 values) mapping the largest magnitude to the format's maximum (448 for e4m3fn, 57344
   for e5m2), rounding by ``ml_dtypes`` casts. The simulated e4m3 is the real ``kv8`` codec bit
   for bit (same f32 arithmetic: x * (448 / amax), scale amax / 448), which validates the layer.
2. **QJL residual** (TurboQuant_prod, arXiv 2504.19874): the real ``tq<b-1>`` codec (fp16 side
   value) plus a 1-bit QJL sketch of the residual r = x - x_mse and its norm in fp16
   (``tq<b-1>h+qjl``). The row is rebuilt as x_mse + |r| c S^T sign(S r), so that q . x^ is the
   paper's inner-product estimator: scores and contexts read from those rows are exactly what a
   decoder of the sketch would compute. S is sqrt(d) times a random orthogonal matrix (default)
   or Gaussian (``-gauss``), one fixed seed. c = sqrt(pi/2) / d for a Gaussian S (the paper); for
   an orthogonal S, whose rows are uniform on a sphere rather than Gaussian, the unbiased constant
   is 1 / (d sqrt(d) E|o_1|) (:func:`qjl_scale`), 0.39% below the Gaussian one at d = 64.
   At d = 64 this costs (b-1) x 64 + 16 + 64 + 16 bits per row: exactly tq<b>'s 64 b + 32.
3. **Outlier channels at b+1 bits** (fractional budgets, TurboQuant paper):
   ``split32:tq4h+tq3h`` quantizes the 32 channels of largest mean square (taken from the
   stream's first append) with tq4 on 32 dims and the other 32 with tq3, each with its own
   rotation and fp16 norm: 3.5 code bits + two fp16 norms = 4.0 bits per value, as tq4/tq3 (K
   tq4, V tq3, f32 norms). The channel assignment is a fixed per-stream cost (one bit per
   channel, spread over the context as the stream options' offset). ``split16`` puts 16 channels
   at b+1 bits; 48 is not a power of two (no Hadamard rotation), so the rest is coded as 32 + 16
   channels with a third norm. ``split32low`` is a control: the 32 channels of *smallest* mean
   square get the extra bit.
4. **Most recent window in f32** (``recent=W``): the last W rows are read exactly and older ones
   through the codec: the query at position t reads rows t-W+1..t from f32 and earlier rows
   quantized (the cache's ``recent=W`` stream option). Bits at context C:
   ((C - W) bits_codec + 32 W) / C (fixed costs of the codec's stream included); the
   long-context limit is bits_codec.

What is simulated: the codecs of ideas 1-3 store float32 rows after a numpy quantize-dequantize
(:class:`SimulatedCodec`; scores and contexts through the f32 codec's kernels) and count nominal
bytes per row; idea 4 keeps an f32 copy of every row beside the codec's. What is real: the
reference rows, the tq codecs inside ideas 2 and 3 (their own encode/decode), the stream options
(kvquant's RowStream) and the model. The engine's greedy protocol is not run (text metrics only).

Run::

    python -m kvquant_experiments.probes             # pydoc prose, ~8 min on 2 cores
    python -m kvquant_experiments.probes --text code
    python -m kvquant_experiments.probes --list      # configurations and their bits only
    # the window at a longer context, with the reference rows (~4 min)
    python -m kvquant_experiments.probes --ideas reference,window --positions 4096 \
        --chunk-tokens 2048

Each probe runs as the cache spec ``probe:<name>`` (the ``codec`` field of a result row; files
written before probes were a spec kind say the bare name).

Writes ``probes-smollm2-<text>-N<positions>-c<chunk>[-<ideas>].{json,csv,md}`` (the ideas are
named when a run covers only some of them) into ``--out``, by default a folder of that name under
the current directory. ``--text`` takes a UTF-8 file too; ``--scheduler`` a Dask cluster.
"""
import functools
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from kvquant.cache import QuantizedKVCache, RowStream
from kvquant.codecs import Codec, get_codec, is_simulated_codec
from kvquant.outputs import atomic_write
from kvquant.specs import CacheSpec, SpecKind
from kvquant.streams.options import parse_stream_spec
from kvquant.streams.spec import StreamSpec

from .codecs.simulated import QJL_SEED, SimulatedCodec
from .common import environment, write_csv, write_json
from .study import Output, add_executor_arguments, add_quiet_argument, study_main

__all__ = [
    "OutlierSplitCodec",
    "PROBES",
    "PROBE_PREFIX",
    "Probe",
    "ProbeSpec",
    "format_markdown",
    "main",
    "make_codec",
    "new_probe_cache",
    "parse_probe",
    "probe_spec",
    "probe_bits",
    "run_probes",
    "write_probes",
]

MODEL = "smollm2"
DEFAULTS = {"positions": 2048, "chunk_tokens": 512}


# --------------------------------------------------------------------------------------------
# The per-stream outlier split (stateful: a stream factory, not a registered codec)
# --------------------------------------------------------------------------------------------
def _pow2_parts(n):
    """``n`` as a sum of powers of two, largest first (48 -> [32, 16])."""
    return [1 << k for k in range(n.bit_length() - 1, -1, -1) if n >> k & 1]


class OutlierSplitCodec(SimulatedCodec):
    """Channels split by mean square, each set under its own codec (outliers at more bits).

    The first encode chooses the channels (per stream: one object per stream, not shareable):
    sorted by mean square over that call's rows, largest first (``select="smallest"``: smallest
    first), the first ``parts[0][0]`` go to the first codec, the next to the second, ...

    Parameters
    ----------
    dim : int
    parts : sequence of (width, codec spec)
        Widths add up to ``dim``; each codec is built for its width.
    select : {"largest", "smallest"}
    spec : str, optional
        The codec's name (default: its parts and selection, spelled out).

    Notes
    -----
    Bytes per row: the parts' bytes (codes and side values). Fixed bytes: the channel
    assignment, ceil(log2(n_parts)) bits per channel.
    """

    def __init__(self, dim, parts, select="largest", spec=None):
        widths = [int(w) for w, _ in parts]
        if sum(widths) != dim or min(widths) < 1:
            raise ValueError(f"part widths {widths} must be positive and add up to {dim}")
        if select not in ("largest", "smallest"):
            raise ValueError(f"select={select!r} is not 'largest' or 'smallest'")
        codecs = [spec if isinstance(spec, Codec) else get_codec(spec, w) for w, spec in parts]
        if [c.dim for c in codecs] != widths:
            raise ValueError(f"codec widths {[c.dim for c in codecs]} != part widths {widths}")
        label_bits = math.ceil(math.log2(len(parts))) if len(parts) > 1 else 0
        super().__init__(dim, sum(c.bytes_per_row for c in codecs),
                         fixed_bytes=(dim * label_bits + 7) // 8)
        self.widths, self.codecs, self.select = widths, codecs, select
        self.channels = None      # list of index arrays, one per part, after the first encode
        self.spec = spec or ("split:" + "+".join(f"{w}@{c.spec}" for w, c in zip(widths, codecs))
                     + ("" if select == "largest" else ":smallest"))

    def choose_channels(self, X):
        """Channel index arrays per part from rows X (n, dim): by mean square."""
        ms = np.einsum("ij,ij->j", X, X, dtype=np.float64) / max(X.shape[0], 1)
        order = np.argsort(-ms if self.select == "largest" else ms, kind="stable")
        edges = np.cumsum([0] + self.widths)
        return [np.sort(order[a:b]) for a, b in zip(edges[:-1], edges[1:])]

    def quantize(self, X):
        if X.shape[0] == 0:
            return X.copy()
        channels = self.channels if self.channels is not None else self.choose_channels(X)
        out = np.empty_like(X)
        for idx, codec in zip(channels, self.codecs):
            out[:, idx] = codec.decode(codec.encode(X[:, idx]))
        self.channels = channels
        return out

    def encode(self, X, n_threads=None):
        before = self.channels
        try:
            return super().encode(X, n_threads)
        except ValueError:
            self.channels = before       # a refused append chooses nothing
            raise


_SPLIT_SPEC = re.compile(r"split(\d+)(low)?:tq(\d)h\+tq(\d)h")


def is_simulated(codec_spec):
    """True when ``codec_spec`` is the outlier split or a simulated codec
    (:attr:`kvquant.codecs.Codec.simulated`, e.g. :mod:`kvquant_experiments.codecs.simulated`)."""
    return bool(_SPLIT_SPEC.fullmatch(codec_spec)) or is_simulated_codec(codec_spec)


def make_codec(codec_spec, dim):
    """The codec of a spec: the outlier split, else any codec :func:`get_codec` builds (the
    simulated fp8 and QJL codecs are registered ones, :mod:`kvquant_experiments.codecs.simulated`).

    ``split<n>:tq<hi>h+tq<lo>h``: :class:`OutlierSplitCodec`, the n channels of largest mean
    square under tq<hi> and the rest under tq<lo> (fp16 norms; widths that are no power of two
    are cut into powers of two, each with its own codec); ``split<n>low:...`` gives the extra bits
    to the n channels of smallest mean square. A new object per call (per-stream state).
    """
    m = _SPLIT_SPEC.fullmatch(codec_spec)
    if m:
        n_out, low, hi, lo = int(m.group(1)), bool(m.group(2)), m.group(3), m.group(4)
        if not 0 < n_out < dim:
            raise ValueError(f"{codec_spec!r}: {n_out} outlier channels out of {dim}")
        parts = ([(w, f"tq{hi}:side_dtype=f16") for w in _pow2_parts(n_out)]
                 + [(w, f"tq{lo}:side_dtype=f16") for w in _pow2_parts(dim - n_out)])
        return OutlierSplitCodec(dim, parts, select="smallest" if low else "largest",
                                 spec=codec_spec)
    return get_codec(codec_spec, dim)


# --------------------------------------------------------------------------------------------
# Streams and caches
# --------------------------------------------------------------------------------------------
def _make_stream(codec_spec, options, dim, capacity):
    return RowStream(make_codec(codec_spec, dim), capacity, **options)


def with_recent(stream_spec, window):
    """The :class:`~kvquant.streams.spec.StreamSpec` of ``stream_spec`` (a string or one) with
    the stream option ``recent=window`` (unchanged for 0)."""
    spec = StreamSpec.of(stream_spec)
    return spec.with_options(recent=int(window)) if window else spec


def stream_entry(stream_spec, dim):
    """What a QuantizedKVCache takes for one stream: the StreamSpec itself for a codec objects
    may be shared for, else (the outlier split) a stream factory building it per layer and
    head."""
    spec = StreamSpec.of(stream_spec)
    if not _SPLIT_SPEC.fullmatch(spec.codec_spec):
        return spec
    make_codec(spec.codec_spec, dim)          # a bad spec fails here, not in a worker
    return functools.partial(_make_stream, spec.codec_spec, spec.options.as_dict(), dim)


# --------------------------------------------------------------------------------------------
# The probes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Probe:
    """One row of the table: K and V stream specs (real or simulated codecs, with stream
    options; their text, parsed once into :attr:`streams`), a recent window, the idea it
    measures and the row it is compared with."""

    idea: str
    k: str
    v: str
    window: int = 0
    counterpart: str = ""
    # (K StreamSpec, V StreamSpec): what the module reads; k and v are the text rows record
    streams: tuple = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "streams", (StreamSpec.parse(self.k), StreamSpec.parse(self.v)))

    @property
    def name(self):
        pair = self.k if self.k == self.v else f"{self.k}/{self.v}"
        return pair + (f" recent={self.window}" if self.window else "")

    @property
    def simulated(self):
        return any(is_simulated(s.codec_spec) for s in self.streams)

    @property
    def is_reference(self):
        """True for the f32 cache itself (both streams f32, no options, no window)."""
        return not self.window and all(s.is_reference for s in self.streams)


_H = ":side_dtype=f16"
_K = "@center,normalize,sinks=1"      # the frontier's best key options
_V = "@center,sinks=1"                # and value options


def _probe(idea, k, v=None, window=0, counterpart=""):
    return Probe(idea, k, k if v is None else v, window, counterpart)


def _default_probes():
    best = _probe("reference", f"polar5{_H}{_K}", f"polar4{_H}{_V}")
    probes = [_probe("reference", s) for s in
              ("f32", "kv8", "kv8-g32", "tq2", "tq3", "tq4", "tq5", "q4_0+rot", "q8_0")]
    probes.append(best)
    # Real codecs at exactly the bits of a probe (d = 64: tq<b> is b + 0.5 bits per value).
    probes += [_probe("counterpart", "tq4", "tq3"), _probe("counterpart", "tq3", "tq2"),
               _probe("counterpart", f"tq4{_K}", f"tq3{_V}"),
               _probe("counterpart", f"tq3{_K}", f"tq2{_V}")]
    probes += [_probe("counterpart", f"tq{b}{_K}", f"tq{b}{_V}") for b in (3, 4, 5)]
    probes.append(_probe("counterpart", "tq4:side=unbiased"))
    # 1. fp8 formats (the simulated e4m3 must match kv8)
    probes += [_probe("fp8", "fp8-e4m3", counterpart="kv8"),
               _probe("fp8", "fp8-e4m3-g32", counterpart="kv8-g32"),
               _probe("fp8", "fp8-e5m2", counterpart="kv8"),
               _probe("fp8", "fp8-e5m2-g32", counterpart="kv8-g32")]
    # 2. QJL residual at b bits against tq<b> (plain) or tq<b> with the stream options
    for b in (3, 4, 5):
        prod = f"tq{b - 1}h+qjl"
        opts = _probe("counterpart", f"tq{b}{_K}", f"tq{b}{_V}").name
        probes += [_probe("qjl", prod, counterpart=f"tq{b}"),
                   _probe("qjl", prod + "-gauss", counterpart=f"tq{b}"),
                   _probe("qjl", prod, f"tq{b}", counterpart=f"tq{b}"),
                   _probe("qjl", prod + _K, prod + _V, counterpart=opts),
                   _probe("qjl", prod + _K, f"tq{b}{_V}", counterpart=opts)]
    # 3. outlier channels at b+1 bits
    probes += [
        _probe("outliers", "split32:tq3h+tq2h", counterpart="tq3/tq2"),
        _probe("outliers", "split32:tq4h+tq3h", counterpart="tq4/tq3"),
        _probe("outliers", "split32:tq3h+tq2h" + _K, "split32:tq3h+tq2h" + _V,
               counterpart=f"tq3{_K}/tq2{_V}"),
        _probe("outliers", "split32:tq4h+tq3h" + _K, "split32:tq4h+tq3h" + _V,
               counterpart=f"tq4{_K}/tq3{_V}"),
        _probe("outliers", "split16:tq4h+tq3h", counterpart="split32:tq4h+tq3h"),
        _probe("outliers", "split32low:tq4h+tq3h", counterpart="split32:tq4h+tq3h"),
    ]
    # 4. the most recent rows in f32
    probes += [_probe("window", "tq4", window=16, counterpart="tq4"),
               _probe("window", "tq4", window=64, counterpart="tq4"),
               _probe("window", "tq3", window=64, counterpart="tq3"),
               _probe("window", best.k, best.v, window=16, counterpart=best.name),
               _probe("window", best.k, best.v, window=64, counterpart=best.name)]
    return probes


PROBES = _default_probes()
PROBES_BY_NAME = {p.name: p for p in PROBES}
assert len(PROBES_BY_NAME) == len(PROBES), "probe names must be unique"


def new_probe_cache(cfg, probe, capacity=256):
    """The cache of one probe for a K/V model's shape ``cfg`` (``n_layers``, ``n_kv_heads``,
    ``head_dim``: a :class:`kvquant.specs.KVLayout` or a Llama config)."""
    d = cfg.head_dim
    streams = {name: (stream_entry(with_recent(spec, probe.window), d), d)
               for name, spec in zip(("k", "v"), probe.streams)}
    return QuantizedKVCache(cfg.n_layers, streams, n_kv_heads=cfg.n_kv_heads, capacity=capacity)


def probe_bits(probe, head_dim=64, tokens=None):
    """Bits per value (K and V averaged) that a probe's cache holds.

    With ``tokens`` (the context C): every stored byte over C rows: the codec's rows, the stream
    options' f32 vectors and sink rows, a simulated codec's fixed bytes (channel assignment), and
    for a recent window of W rows, C - W rows under the codec plus W float32 rows. Without: the
    bytes each further token adds in a long context (the codecs' bytes per row).
    """
    nbytes = 0.0
    for spec in probe.streams:
        codec = make_codec(spec.codec_spec, head_dim)
        if tokens is None:
            nbytes += codec.bytes_per_row
            continue
        coded = max(tokens - probe.window, 0)
        stream = RowStream(codec, **spec.options.as_dict())
        fixed = getattr(codec, "fixed_bytes", 0) if coded > stream.sinks else 0
        nbytes += (stream.bytes_for(coded) + fixed
                   + 4 * head_dim * min(probe.window, tokens)) / tokens
    return 8.0 * nbytes / (2 * head_dim)


# --------------------------------------------------------------------------------------------
# The probe spec kind: ``probe:<probe name>`` is a cache spec every model and worker parses
# --------------------------------------------------------------------------------------------
PROBE_PREFIX = "probe:"


def parse_probe(name):
    """The :class:`Probe` named ``name``: a default probe (with its idea and counterpart) or
    ``"<k>[/<v>][ recent=<W>]"`` of any real or simulated stream specs (idea ``custom``)."""
    name = name.strip()
    if name in PROBES_BY_NAME:
        return PROBES_BY_NAME[name]
    pair, _, window = name.partition(" recent=")
    try:
        window = int(window) if window else 0
    except ValueError:
        window = -1
    if window < 0:
        raise ValueError(f"probe {name!r}: the window after ' recent=' must be an integer >= 0")
    sides = pair.split("/")
    if len(sides) > 2 or not all(s.strip() for s in sides):
        raise ValueError(f"probe {name!r}: expected '<K spec>[/<V spec>][ recent=<W>]'")
    for side in sides:
        parse_stream_spec(side.strip())       # the stream grammar checked here, widths at build
    probe = _probe("custom", sides[0].strip(), sides[-1].strip(), window)
    # another spelling of a default probe ("tq4/tq4", "tq4 recent=0") is that probe
    return PROBES_BY_NAME.get(probe.name, probe)


@dataclass(frozen=True)
class ProbeSpec(CacheSpec):
    """``probe:<name>``: the cache of one :class:`Probe`, the ``probe`` kind of
    :class:`kvquant.specs.CacheSpec`, installed through the entry-point group
    ``kvquant.cache_specs`` so that every model and worker process builds it from its text."""

    probe: Probe
    kind = "probe"

    @property
    def text(self):
        return PROBE_PREFIX + self.probe.name

    @property
    def label(self):
        return self.probe.name

    @classmethod
    def parse(cls, text):
        return cls(parse_probe(text.strip()[len(PROBE_PREFIX):]))

    @property
    def family(self):
        return "simulation" if self.probe.simulated else "probe"

    @property
    def is_reference(self):
        return self.probe.is_reference

    def bits_per_value(self, head_dim, tokens=None):
        return probe_bits(self.probe, head_dim, tokens)

    def new_kv_cache(self, layout):
        return new_probe_cache(layout, self.probe, capacity=layout.capacity)


# what kvquant.specs loads from the entry point "probe" (setup.cfg)
SPEC_KIND = SpecKind("probe", lambda text: text.startswith(PROBE_PREFIX), ProbeSpec.parse)


def probe_spec(probe):
    """The cache spec text of a probe as models take it (the f32 reference stays ``f32``)."""
    return "f32" if probe.is_reference else PROBE_PREFIX + probe.name


# --------------------------------------------------------------------------------------------
# Run: kvquant.flips' chunk statistics over the probes' cache specs
# --------------------------------------------------------------------------------------------
def run_probes(probes=None, positions=DEFAULTS["positions"],
               chunk_tokens=DEFAULTS["chunk_tokens"], workers=None, progress=None,
               text="pydoc", scheduler=None):
    """Text metrics of every probe against the f32 cache on SmolLM2 (no greedy protocol).

    Each chunk's probes run in two groups, tasks of the experiments' executor
    (:func:`kvquant_experiments.flip_runs.run_chunks`: ``workers`` local processes, each with the
    model and one BLAS thread, or a Dask cluster at ``scheduler``; ``text``: a built-in name or
    a UTF-8 file); results as :func:`kvquant.flips.combine_chunks`, plus bits per value
    at the chunk's context and in the long-context limit, and the comparison with the probe's
    counterpart.

    Returns
    -------
    dict with ``meta`` and ``rows`` (one per probe, in the order given).
    """
    from kvquant.flips import combine_chunks, text_chunks
    from kvquant.models import load_model
    from kvquant_experiments.executor import open_executor
    from kvquant_experiments.flip_runs import run_chunks
    from kvquant_experiments.texts import text_tokens
    t0 = time.perf_counter()
    probes = list(probes or PROBES)
    if not probes[0].is_reference:
        probes = ([p for p in PROBES if p.is_reference]
                  + [p for p in probes if not p.is_reference])
    for p in probes:
        if p.name not in PROBES_BY_NAME:
            raise ValueError(f"unknown probe {p.name!r}")
    names = [probe_spec(p) for p in probes]
    model = load_model(MODEL)
    cfg = model.config
    d = cfg.head_dim
    rows_per_token = 2 * cfg.n_layers * cfg.n_kv_heads
    per_token = {}
    for p, name in zip(probes, names):    # a bad probe fails before the long run
        cache = model.new_cache(name)
        per_token[p.name] = cache.bytes_per_token
        from_codecs = probe_bits(p, d)
        from_cache = 8.0 * cache.bytes_per_token / (rows_per_token * d)
        if abs(from_codecs - from_cache) > 1e-9:
            raise AssertionError(f"{p.name}: {from_codecs} bits from the codecs, {from_cache} "
                                 "from the cache")
    tokens, resolved = text_tokens(model, text)
    chunks = text_chunks(tokens, positions, chunk_tokens, bos=model.bos_token_id)
    described = model.describe()
    workers = min(2, os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if scheduler is None and workers == 1:
        scheduler = "serial"
    with open_executor(scheduler, workers) as ex:
        task_model = model if ex.kind == "serial" else MODEL
        stats = run_chunks(ex, task_model, names, chunks,
                           1 if ex.kind == "serial" else 2, progress)
        executor_description = ex.description
    del model
    rows = combine_chunks(names, stats)
    by_name = {}
    for p, row in zip(probes, rows):
        row.update({
            "probe": p.name, "idea": p.idea, "k": p.k, "v": p.v, "window": p.window,
            "simulated": p.simulated, "counterpart": p.counterpart,
            "bits_per_value": probe_bits(p, d, tokens=chunk_tokens),
            "bits_limit": probe_bits(p, d), "bytes_per_token": per_token[p.name],
        })
        by_name[p.name] = row
    for row in rows:
        cp = by_name.get(row["counterpart"])
        row["counterpart_kld"] = cp["kld_mean"] if cp else None
        row["counterpart_bits"] = cp["bits_per_value"] if cp else None
        row["kld_ratio"] = row["kld_mean"] / cp["kld_mean"] if cp and cp["kld_mean"] else None
    import kvquant
    meta = {
        "model": described,
        "text": {**resolved.describe(), "text_tokens": int(tokens.size),
                 "positions": positions, "chunk_tokens": chunk_tokens,
                 "chunk_starts": [int(s) for s, _ in chunks]},
        "ideas": sorted({p.idea for p in probes if not p.is_reference} or {"reference"}),
        "protocol": "text metrics only (the engine's greedy protocol is not run)",
        "bits_per_value": ("(K + V bytes) * 8 / (2 * head_dim * C) at the context C = "
                           "chunk_tokens: side values, stream-option vectors and sinks, "
                           "channel assignments, window rows in f32 included; bits_limit: "
                           "bytes per further token"),
        "qjl": {"residual_norm": "fp16 (16 bits per row)", "sketch_seed": QJL_SEED,
                "mse_side": "fp16 (tq<b-1>:side_dtype=f16)"},
        "kvquant": kvquant.__version__,
        "workers": workers,
        "executor": executor_description,
        "wall_s": time.perf_counter() - t0,
    }
    return {"meta": meta, "rows": rows}


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------
def result_stem(result):
    """``probes-smollm2-<text>-N<positions>-c<chunk>[-<ideas>]``: the ideas are named when
    the run covered only some of them."""
    t = result["meta"]["text"]
    name = t.get("name", "pydoc")
    ideas = sorted(result["meta"].get("ideas", IDEA_TITLES))
    subset = "" if set(ideas) >= set(IDEA_TITLES) else "-" + "-".join(ideas)
    return (f"probes-smollm2-{name}-N{t['positions']}"
            f"-c{t['chunk_tokens']}{subset}")


CSV_COLUMNS = ["probe", "idea", "k", "v", "window", "simulated", "bits_per_value", "bits_limit",
               "bytes_per_token", "kld_mean", "kld_p99", "kld_max", "same_top_k", "same_top_n",
               "same_top", "same_top_lo", "same_top_hi", "ppl", "ppl_f32", "ppl_ratio",
               "counterpart", "counterpart_bits", "counterpart_kld", "kld_ratio", "text_s"]


def _flat(row):
    flat = dict(row)
    for part in ("k", "n", "p", "lo", "hi"):
        flat["same_top" if part == "p" else f"same_top_{part}"] = row["same_top"][part]
    return flat


IDEA_TITLES = {
    "reference": "Reference rows (real codecs)",
    "counterpart": "Real codecs at the bits of a probe",
    "fp8": "1. fp8 e4m3 vs e5m2 (simulated)",
    "qjl": "2. QJL residual, TurboQuant_prod (simulated)",
    "outliers": "3. Outlier channels at b+1 bits (simulated)",
    "window": "4. Most recent rows in f32 (the recent=W stream option)",
}


def _bits(row):
    at_c, limit = row["bits_per_value"], row["bits_limit"]
    return f"{at_c:.2f}" if abs(at_c - limit) < 0.005 else f"{at_c:.2f} ({limit:.2f})"


def format_markdown(result):
    """One table, grouped by idea; the last column compares each probe with its counterpart."""
    meta = result["meta"]
    t = meta["text"]
    rows = result["rows"]
    lines = [
        f"SmolLM2-135M, {t['positions']} positions of {t['source']} in chunks of "
        f"{t['chunk_tokens']} tokens; against the f32 cache, PPL(f32) = {rows[0]['ppl_f32']:.3f}. "
        f"Bits/value: K and V averaged, side values included, every fixed cost (stream options' "
        f"f32 vectors and sink, channel assignment, f32 window rows) spread over the context "
        f"C = {t['chunk_tokens']}; in brackets the long-context limit where it differs. "
        "Spec names: `h` = fp16 side values; `@center,normalize,sinks=1` / `@center,sinks=1` = "
        "the frontier's stream options on K / V; `tq<b>h+qjl` = tq<b> plus a 1-bit QJL sketch "
        "of the residual and its fp16 norm (orthogonal sketch; `-gauss`: Gaussian); "
        "`split32:tq4h+tq3h` = the 32 channels of largest mean square at tq4, the rest at tq3 "
        "(`split16`: 16 outliers, the other 48 as 32 + 16; `split32low`: the 32 smallest at "
        "tq4); `recent=W` = the last W rows read in f32. Last column: mean KLD of the row over "
        "that of its counterpart (the counterpart's bits in brackets).",
        "",
        "| idea | K / V | sim | bits/value | mean KLD | same top-1 % | PPL ratio | "
        "KLD vs counterpart |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for idea, title in IDEA_TITLES.items():
        for r in (r for r in rows if r["idea"] == idea):
            vs = ""
            if r["kld_ratio"] is not None:
                vs = f"x{r['kld_ratio']:.2f} vs `{r['counterpart']}` ({r['counterpart_bits']:.2f})"
            lines.append(
                f"| {title.split(' (')[0]} | `{r['probe']}` | {'sim' if r['simulated'] else ''} | "
                f"{_bits(r)} | {r['kld_mean']:.3g} | {100 * r['same_top']['p']:.2f} | "
                f"{r['ppl_ratio']:.4f} | {vs} |")
    return "\n".join(lines)


def write_probes(result, out_dir):
    """``<stem>.json`` (the result and the environment), ``<stem>.csv``, ``<stem>.md``."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(result))
    result.setdefault("environment", environment())
    write_json(stem + ".json", result)
    write_csv(stem + ".csv", [_flat(r) for r in result["rows"]], CSV_COLUMNS)
    text = format_markdown(result) + "\n"
    atomic_write(stem + ".md", lambda f: f.write(text))
    return [stem + ".json", stem + ".csv", stem + ".md"]


# --------------------------------------------------------------------------------------------
# Command line (kvquant_experiments.study)
# --------------------------------------------------------------------------------------------
RESUMES = False         # the chunks run without a unit store: the same command starts over
ERRORS = (ImportError,)  # distributed for --scheduler, ml_dtypes for the fp8 probes


def add_arguments(p):
    p.add_argument("--text", default="pydoc",
                   help="a UTF-8 text file or a built-in text (pydoc, code, docstrings)")
    p.add_argument("--positions", type=int, default=DEFAULTS["positions"])
    p.add_argument("--chunk-tokens", type=int, default=DEFAULTS["chunk_tokens"])
    p.add_argument("--ideas", default=None,
                   help="comma-separated ideas to run (reference, counterpart, fp8, qjl, "
                        "outliers, window); default all; f32 always runs")
    add_executor_arguments(p)
    p.add_argument("--out", default=None,
                   help="output folder (default: ./probes-smollm2-<text>-N..-c..)")
    p.add_argument("--list", action="store_true", help="print the probes and bits, run nothing")
    add_quiet_argument(p)


def outputs(args):
    # without --out the run's own folder goes in the current one
    return [] if args.list else [Output(args.out if args.out is not None else ".")]


def run(args, progress):
    probes = PROBES
    if args.ideas:
        ideas = {s.strip() for s in args.ideas.split(",") if s.strip()}
        unknown = ideas - set(IDEA_TITLES)
        if unknown:
            raise ValueError(f"--ideas: unknown ideas {sorted(unknown)}; known: "
                             f"{', '.join(IDEA_TITLES)}")
        probes = [x for x in PROBES if x.idea in ideas or x.is_reference]
    if args.list:
        for x in probes:
            print(f"{probe_bits(x, tokens=args.chunk_tokens):6.3f} {probe_bits(x):6.3f}  "
                  f"{x.idea:11s} {x.name}")
        return 0
    result = run_probes(probes, positions=args.positions, chunk_tokens=args.chunk_tokens,
                        workers=args.workers, progress=progress, text=args.text,
                        scheduler=args.scheduler)
    paths = write_probes(result, args.out or result_stem(result))
    print(format_markdown(result))
    print(f"wall time {result['meta']['wall_s']:.0f} s")
    for path in paths:
        print(f"wrote {path}")
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
