"""Memory budget of a quantized KV cache: bytes per row, pool bytes, the context that fits.

The engine sizes its pool as (docs/reference.md §1.6)

    pool = slots x [(n_layers + extra_layers) x context x row_bytes + context x extra_f32 x 4]

where row_bytes sums the rows one token adds to one layer (every stream and KV head, side values
included) and extra_f32 counts float32 values per token outside the layers (e.g. indexer rows).
A stream spec (``tq4@recent=16``, ``polar4@center,sinks=4``; kvquant.streams.options) adds what
its stream holds besides the codes, as the cache's streams hold it: the first N rows in float32
instead of codes (``sinks``), float32 copies of the W last rows (``recent``), one float32 vector
for ``center`` and one for ``normalize``; ``"kv8/tq4"`` gives one spec per stream (K/V, L/R).
Specs are :class:`kvquant.specs.StreamListSpec` objects (a string is parsed by it, a pair
:class:`kvquant.specs.PairSpec` gives its streams); sizes are asked of the codecs.
Byte sizes use decimal units (1 GB = 10^9 B) as the reference figures do; ``GiB`` is also
accepted. A size given as a string needs its unit.
"""
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvquant.codecs import CodecWidthError, UnknownCodecError, codec_for_width
from kvquant.specs import StreamListSpec, split_spec_text
from kvquant.streams.spec import StreamSpec


@dataclass(frozen=True)
class Stream:
    """Rows of one kind per layer and token: ``count`` rows of width ``dim``.

    ``grouped_scales=False`` keeps one scale per row under ``kv8-g<N>`` (the engine groups the
    latent L only; the rope row R keeps its per-row scale):
    :meth:`kvquant.streams.spec.StreamSpec.with_row_scales`.
    """
    name: str
    dim: int
    count: int = 1
    grouped_scales: bool = True


@dataclass(frozen=True)
class ModelShape:
    """What a model stores per token. See the module docstring for the pool formula."""
    name: str
    n_layers: int
    streams: tuple
    extra_layers: int = 0
    extra_f32_per_token: int = 0
    note: str = ""

    @property
    def cached_layers(self):
        return self.n_layers + self.extra_layers

    def to_json(self):
        return {"name": self.name, "n_layers": self.n_layers, "extra_layers": self.extra_layers,
                "extra_f32_per_token": self.extra_f32_per_token,
                "streams": [{"name": s.name, "dim": s.dim, "count": s.count,
                             "grouped_scales": s.grouped_scales} for s in self.streams]}


MODELS = {
    "glm-5.2": ModelShape(
        "glm-5.2", n_layers=78, extra_layers=1,
        streams=(Stream("L", 512), Stream("R", 64, grouped_scales=False)),
        note="MLA: latent L (kv_lora 512) and rope R (64) per layer; the engine's pool counts "
             "n_layers + 1 layers. Indexer rows are not counted (their width is not in "
             "docs/reference.md): give extra_f32_per_token in a JSON shape to add them."),
    "smollm2": ModelShape(
        "smollm2", n_layers=30,
        streams=(Stream("k", 64, count=3), Stream("v", 64, count=3)),
        note="SmolLM2-135M: GQA, 3 KV heads of width 64, K and V rows per head and layer."),
    "tiny-mla": ModelShape(
        "tiny-mla", n_layers=5,
        streams=(Stream("L", 32), Stream("R", 8, grouped_scales=False)),
        note="the engine's glm_tiny oracle (docs/reference.md §1.8)."),
}

DEFAULT_CODECS = ("f32", "kv8", "kv8-g32", "tq8", "tq6", "tq4", "tq3", "tq2",
                  "polar6", "polar5", "polar4", "polar3", "polar2", "q8_0", "q4_0")
DEFAULT_CONTEXTS = (32768, 131072, 262144)

# the largest size parse_bytes returns, exclusive: a signed 64-bit byte count
MAX_BYTES = 2**63

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text, name="a size"):
    """``"64GB"`` -> 64e9, ``"64GiB"`` -> 64 * 2^30, ``"1.5e9B"`` -> 1.5e9 (returns an int).

    A string needs a unit (B, kB, MB, GB, TB or KiB, MiB, GiB, TiB): ``"64"`` is refused rather
    than read as 64 bytes; only ``"0"`` may go without one. An int or float is a byte count.
    ``name`` (e.g. ``"--ram"``) opens the error message.
    """
    if isinstance(text, bool):
        raise ValueError(f"{name}: cannot read {text!r} as a size")
    if isinstance(text, (int, float)):
        value, unit = float(text), "b"
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or (m.group(2) and m.group(2).lower() not in _UNITS):
            raise ValueError(f"{name}: cannot read {text!r} as a size; use e.g. 64GB, 512MiB or "
                             "1e9B")
        value, unit = float(m.group(1)), m.group(2).lower()
        if not unit:
            if value != 0:
                raise ValueError(f"{name} {text!r} has no unit: write e.g. {m.group(1)}GB "
                                 f"(10^9 bytes), {m.group(1)}GiB (2^30 bytes) or "
                                 f"{m.group(1)}B (bytes)")
            unit = "b"
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name}: a size must be a finite number >= 0, got {text!r}")
    size = value * _UNITS[unit]
    # 1e300GB is a finite number of GB but no finite count of bytes (int() would overflow), and
    # a size past 2^63 bytes fits no file offset or machine
    if not size < MAX_BYTES:
        raise ValueError(f"{name}: {text!r} is not below 2^63 bytes (about 9.2e18 B, 8 EiB); "
                         "give a real size such as 64GB")
    return int(size)


def parse_tokens(text):
    """``"256k"`` -> 262144, ``"1M"`` -> 1048576, ``"4096"`` -> 4096 (at least 1)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a token count: use e.g. 4096, 128k or 1M")
    n = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]
    if n < 1:
        raise ValueError(f"a context must be at least 1 token, got {text!r}")
    return n


def format_bytes(n):
    """Decimal units, three significant digits: 47714402304 -> '47.7 GB'."""
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _count(value, key, low=1):
    """A whole count from JSON: 1.5 or "8" is an error, not 1 or 8."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} is {value!r}, not an integer >= {low}")
    return value


def load_shape(model):
    """A ModelShape from a preset name, a JSON file path or a JSON string."""
    if isinstance(model, ModelShape):
        return model
    if model in MODELS:
        return MODELS[model]
    text = str(model)
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"unknown model {model!r}: use one of {sorted(MODELS)}, a JSON file "
                             "or a JSON string")
        text = path.read_text(encoding="utf-8")
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or not isinstance(d.get("streams"), list):
            raise ValueError("not an object with a list of streams")
        streams = tuple(Stream(s["name"], _count(s["dim"], "dim"),
                               _count(s.get("count", 1), "count"),
                               bool(s.get("grouped_scales", True))) for s in d["streams"])
        shape = ModelShape(d.get("name", "custom"), _count(d["n_layers"], "n_layers"), streams,
                           _count(d.get("extra_layers", 0), "extra_layers", 0),
                           _count(d.get("extra_f32_per_token", 0), "extra_f32_per_token", 0),
                           d.get("note", ""))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"bad model shape ({exc}); expected JSON like {{\"name\": \"m\", \"n_layers\": 32, "
            "\"streams\": [{\"name\": \"k\", \"dim\": 128, \"count\": 8}, ...], "
            "\"extra_layers\": 0, \"extra_f32_per_token\": 0}") from None
    if shape.n_layers < 1 or not streams or any(s.dim < 1 or s.count < 1 for s in streams):
        raise ValueError(f"bad model shape {shape}: layers, widths and counts must be positive")
    return shape


def row_bytes(spec, dim):
    """Stored bytes of one coded row of width ``dim`` (side values included) under the codec of
    ``spec``, a codec or stream spec (string or :class:`~kvquant.streams.spec.StreamSpec`;
    stream options do not change a coded row).

    Raises
    ------
    UnknownCodecError
        ``spec`` names no codec this process can build (an unknown name, or bits or options its
        family refuses): :class:`kvquant.codecs.UnknownCodecError`.
    CodecWidthError
        The codec refuses rows of width ``dim`` (e.g. a rotated codec on a width that is not a
        power of two): :class:`kvquant.codecs.CodecWidthError`.
    """
    return codec_for_width(StreamSpec.of(spec).codec_spec, dim).bytes_per_row


@dataclass(frozen=True)
class StreamCost:
    """What one stream of rows of width ``dim`` costs: ``row_bytes`` per coded row, plus the
    float32 rows and vectors its stream options keep (kvquant.streams.options): the first
    ``sinks`` rows in float32 instead of codes, float32 copies of the ``recent`` last rows
    (besides their codes), and ``vectors`` float32 vectors (the offset of ``center``, the scales
    of ``normalize``)."""
    row_bytes: int
    dim: int
    sinks: int = 0
    recent: int = 0
    vectors: int = 0

    def bytes_at(self, n_rows):
        """Bytes held at ``n_rows`` rows (the formula of the cache's streams)."""
        exact = min(n_rows, self.sinks)
        window = min(n_rows - exact, self.recent)
        vectors = self.vectors if n_rows else 0
        return (n_rows - exact) * self.row_bytes + 4 * self.dim * (exact + window + vectors)

    @property
    def fixed_bytes(self):
        """What the options add to ``n_rows * row_bytes`` once the sinks and window are full."""
        n = self.sinks + self.recent
        return self.bytes_at(max(n, 1)) - max(n, 1) * self.row_bytes


def stream_specs(shape, spec):
    """The :class:`~kvquant.streams.spec.StreamSpec` of each stream of ``shape``
    (:meth:`kvquant.specs.StreamListSpec.for_streams`): one spec for every stream, or one per
    stream separated by ``/`` (``"kv8/tq4"``: K (or L) in kv8, V (or R) in tq4), each with
    optional stream options after ``@`` (``"tq4@recent=16"``). ``spec`` is a string, a
    StreamListSpec or a pair :class:`~kvquant.specs.PairSpec`. A stream whose rows keep one
    scale each (``grouped_scales=False``) gets its spec with row scales (``kv8-g32`` ->
    ``kv8``)."""
    shape = load_shape(shape)
    specs = StreamListSpec.of(spec).for_streams([s.name for s in shape.streams], shape.name)
    return [s if stream.grouped_scales else s.with_row_scales()
            for stream, s in zip(shape.streams, specs)]


def checked_stream_costs(shape, spec):
    """One StreamCost per stream of ``shape``.

    Raises
    ------
    UnknownCodecError
        A stream's spec names no codec this process can build.
    CodecWidthError
        A stream's codec refuses the width of its rows (the message names the stream).
    ValueError
        Bad stream options (``@...``), a ``/`` list that does not match the streams, or another
        kind's spec (a plan, ``ggml:``).
    """
    shape = load_shape(shape)
    costs = []
    for stream, s in zip(shape.streams, stream_specs(shape, spec)):
        try:
            b = row_bytes(s, stream.dim)
        except CodecWidthError as exc:
            raise CodecWidthError(f"{shape.name}'s {stream.name} rows (width {stream.dim}): "
                                  f"{exc}") from None
        o = s.options
        costs.append(StreamCost(b, stream.dim, o.sinks, o.recent,
                                int(o.center) + int(o.normalize)))
    return costs


def stream_costs(shape, spec):
    """One StreamCost per stream of ``shape``, or None when a codec cannot take its width.

    Raises
    ------
    UnknownCodecError
        A stream's spec names no codec this process can build.
    ValueError
        Bad stream options (``@...``), a ``/`` list that does not match the streams, or another
        kind's spec (a plan, ``ggml:``).
    """
    try:
        return checked_stream_costs(shape, spec)
    except CodecWidthError:
        return None


def layer_row_bytes(shape, spec):
    """Bytes one token adds to one layer (every stream and KV head) once the sinks and windows
    are full, or None."""
    shape = load_shape(shape)
    costs = stream_costs(shape, spec)
    if costs is None:
        return None
    return sum(s.count * c.row_bytes for s, c in zip(shape.streams, costs))


def token_bytes(shape, spec):
    """Bytes one token adds to the pool of one slot (all cached layers and extra rows) once the
    sinks and recent windows are full."""
    shape = load_shape(shape)
    per_layer = layer_row_bytes(shape, spec)
    if per_layer is None:
        return None
    return shape.cached_layers * per_layer + 4 * shape.extra_f32_per_token


def fixed_bytes(shape, spec):
    """Bytes of one slot's pool that do not grow with the context, once its sinks and windows
    are full: float32 sinks in place of their codes, window copies, offsets and scales (0 for a
    plain codec)."""
    shape = load_shape(shape)
    costs = stream_costs(shape, spec)
    if costs is None:
        return None
    return shape.cached_layers * sum(s.count * c.fixed_bytes for s, c in zip(shape.streams, costs))


def pool_bytes(shape, spec, context, slots=1):
    """slots x [(n_layers + extra_layers) x (the streams' bytes at ``context`` rows) + context x
    extra f32 rows]; a plain codec's stream holds context x row_bytes."""
    shape = load_shape(shape)
    costs = stream_costs(shape, spec)
    if costs is None:
        return None
    return _pool_bytes(shape, costs, context, slots)


def _pool_bytes(shape, costs, context, slots):
    context = int(context)
    per_layer = sum(s.count * c.bytes_at(context) for s, c in zip(shape.streams, costs))
    return int(slots) * (shape.cached_layers * per_layer + 4 * context * shape.extra_f32_per_token)


def room_bytes(ram_bytes, reserve_bytes=0):
    """RAM left for the pool; a reserve above the RAM is an error."""
    ram, reserve = parse_bytes(ram_bytes, "--ram"), parse_bytes(reserve_bytes, "--reserve")
    if reserve > ram:
        raise ValueError(f"the reserve ({format_bytes(reserve)}) is larger than the RAM "
                         f"({format_bytes(ram)}): nothing is left for the pool; lower --reserve "
                         "or raise --ram")
    return ram - reserve


def max_context(shape, spec, ram_bytes, slots=1, reserve_bytes=0):
    """The longest context whose pool fits in ram_bytes - reserve_bytes (0 if not even one token
    fits; a reserve above the RAM raises ValueError)."""
    shape = load_shape(shape)
    spec = StreamListSpec.of(spec)
    per_token = token_bytes(shape, spec)
    if per_token is None:
        return None
    room = room_bytes(ram_bytes, reserve_bytes)
    slots = _check_slots(slots)
    costs = stream_costs(shape, spec)
    most_sinks = max(c.sinks for c in costs)
    lo, hi = 0, room // (slots * per_token) + most_sinks + 1   # pool(hi) > room
    while hi - lo > 1:   # the pool grows with the context: the last context that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _pool_bytes(shape, costs, mid, slots) <= room else (lo, mid)
    return lo


def _check_slots(slots):
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"--slots must be a positive integer, got {slots!r}")
    return slots


def available_codecs(specs, shape):
    """The specs whose codec exists (registered) and takes every width of the shape."""
    out = []
    for spec in specs:
        try:
            if token_bytes(shape, spec) is not None:
                out.append(spec)
        except UnknownCodecError:
            pass
    return out


def budget_table(shape, specs=DEFAULT_CODECS, ram_bytes="64GB", contexts=DEFAULT_CONTEXTS,
                 slots=1, reserve_bytes=0):
    """One dict per codec: bytes per layer row and per token (once sinks and windows are full),
    the fixed bytes of stream options per slot, the pool at each context, the longest context."""
    shape = load_shape(shape)
    f32 = token_bytes(shape, "f32")
    rows = []
    for spec in available_codecs([StreamListSpec.of(s) for s in specs], shape):
        per_token = token_bytes(shape, spec)
        rows.append({
            "codec": spec.text,
            "layer_row_bytes": layer_row_bytes(shape, spec),
            "token_bytes": per_token,
            "fixed_bytes": fixed_bytes(shape, spec),
            "compression": f32 / per_token,
            "pool_bytes": {int(c): pool_bytes(shape, spec, c, slots) for c in contexts},
            "max_context": max_context(shape, spec, ram_bytes, slots, reserve_bytes),
            "first_token_bytes": pool_bytes(shape, spec, 1, slots),
        })
    return rows


def format_table(shape, rows, ram_bytes, slots, reserve_bytes=0):
    shape = load_shape(shape)
    contexts = list(rows[0]["pool_bytes"]) if rows else []
    streams = " + ".join(f"{s.count}x{s.name}[{s.dim}]" if s.count > 1 else f"{s.name}[{s.dim}]"
                         for s in shape.streams)
    ram, reserve = parse_bytes(ram_bytes, "--ram"), parse_bytes(reserve_bytes, "--reserve")
    lines = [f"model {shape.name}: {shape.n_layers} layers"
             + (f" (+{shape.extra_layers} in the pool)" if shape.extra_layers else "")
             + f", per layer and token {streams}"
             + (f", +{shape.extra_f32_per_token} f32 per token" if shape.extra_f32_per_token else ""),
             f"RAM {format_bytes(ram)}"
             + (f" minus {format_bytes(reserve)} reserved" if reserve else "")
             + f", {slots} slot(s)", ""]
    width = max([10] + [len(r["codec"]) for r in rows])
    fixed = any(r["fixed_bytes"] for r in rows)
    header = (f"| {'codec':<{width}} | {'B/layer-row':>11} | {'B/token':>10} | "
              + (f"{'fixed B/slot':>12} | " if fixed else "") + f"{'vs f32':>6} | "
              + " | ".join(f"{'pool @ ' + _tokens(c):>13}" for c in contexts)
              + f" | {'longest context':>15} |")
    lines += [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
    short = []
    for r in rows:
        longest = f"{r['max_context']:,}" if r["max_context"] else "none fits"
        if not r["max_context"]:
            short.append(f"{r['codec']} needs {format_bytes(r['first_token_bytes'])} for its "
                         f"first token")
        lines.append(
            f"| {r['codec']:<{width}} | {r['layer_row_bytes']:>11} | {r['token_bytes']:>10} | "
            + (f"{r['fixed_bytes']:>12,} | " if fixed else "") + f"{r['compression']:>5.2f}x | "
            + " | ".join(f"{format_bytes(r['pool_bytes'][c]):>13}" for c in contexts)
            + f" | {longest:>15} |")
    if fixed:
        lines += ["", "B/layer-row and B/token are what each token adds once the sinks and the "
                      "recent windows are full; fixed B/slot is what the stream options keep "
                      "besides (float32 sinks in place of their codes, window copies, offsets "
                      "and scales), counted in the pool and the longest context."]
    if short:
        lines += ["", f"Not even one token fits in {format_bytes(ram - reserve)}: "
                      + "; ".join(short) + "."]
    if shape.note:
        lines += ["", shape.note]
    return "\n".join(lines)


def _tokens(n):
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


# -- command line ----------------------------------------------------------------------------

def _fail(message):
    """One line on stderr, exit status 2 (a usage error), no traceback."""
    print(f"kvquant budget: {message}", file=sys.stderr)
    raise SystemExit(2)


def cmd_budget(args):
    try:
        shape = load_shape(args.model)
        contexts = [parse_tokens(c) for c in args.contexts.split(",") if c.strip()]
        if not contexts:
            raise ValueError(f"--contexts {args.contexts!r} names no context; use e.g. 32k,128k")
        texts = split_spec_text(args.codecs) if args.codecs else list(DEFAULT_CODECS)
        if not texts:
            raise ValueError(f"--codecs {args.codecs!r} names no codec")
        _check_slots(args.slots)
        room_bytes(args.ram, args.reserve)
        specs, unknown, refused = [], [], []
        for text in texts:
            try:
                spec = StreamListSpec.of(text)
                checked_stream_costs(shape, spec)
            except UnknownCodecError as exc:
                unknown.append(f"{text} ({exc})")
            except CodecWidthError as exc:
                refused.append(f"{text} ({exc})")
            except ValueError as exc:   # a bad stream option or '/' list: its own message
                raise ValueError(f"--codecs {text!r}: {exc}") from None
            else:
                specs.append(spec)
    except ValueError as exc:
        _fail(exc)
    if unknown:
        _fail(f"unknown codec(s): {'; '.join(unknown)}; see `kvquant info` and docs/codecs.md")
    if args.codecs and refused:
        _fail(f"codec(s) unable to take the widths of {shape.name}: {'; '.join(refused)}; see "
              "docs/codecs.md")
    rows = budget_table(shape, specs, args.ram, contexts, args.slots, args.reserve)
    if args.json:
        print(json.dumps({"model": shape.to_json(), "ram_bytes": parse_bytes(args.ram),
                          "reserve_bytes": parse_bytes(args.reserve), "slots": args.slots,
                          "rows": rows}, indent=1))
    else:
        print(format_table(shape, rows, args.ram, args.slots, args.reserve))
    return 0


def add_cli(sub):
    p = sub.add_parser("budget", help="KV-cache bytes per token, pool size, longest context "
                                      "that fits in RAM, per codec")
    p.add_argument("--model", default="glm-5.2",
                   help=f"a preset ({', '.join(sorted(MODELS))}), a JSON file or a JSON string "
                        "with n_layers, streams [{name, dim, count}], extra_layers, "
                        "extra_f32_per_token")
    p.add_argument("--ram", default="64GB",
                   help="RAM for the pool, with a unit: e.g. 64GB (10^9 B) or 48GiB (2^30 B)")
    p.add_argument("--reserve", default="0",
                   help="RAM kept for other things (weights), with a unit, e.g. 20GB; at most "
                        "--ram")
    p.add_argument("--contexts", default=",".join(str(c) for c in DEFAULT_CONTEXTS),
                   help="contexts at which to print the pool size, e.g. 32k,128k,256k")
    p.add_argument("--slots", type=int, default=1, help="concurrent sequences")
    p.add_argument("--codecs", default=None,
                   help="comma-separated specs (default: every available family). A piece that "
                        "starts with an option (key=value, center, normalize) continues the spec "
                        "before it: 'tq3:codebook=gaussian,side=unbiased,kv8' is two specs. "
                        "Stream options after '@' (tq4@recent=16, polar4@center,sinks=4) are "
                        "counted; 'kv8/tq4' gives one spec per stream (K/V or L/R)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_budget)
    return p
