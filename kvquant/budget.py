"""Memory budget of a quantized KV cache: bytes per row, pool bytes, the context that fits.

The engine sizes its pool as (REFERENCE.md §1.6)

    pool = slots x [(n_layers + extra_layers) x context x row_bytes + context x extra_f32 x 4]

where row_bytes sums the rows one token adds to one layer (every stream and KV head, side values
included) and extra_f32 counts float32 values per token outside the layers (e.g. indexer rows).
Byte sizes use decimal units (1 GB = 10^9 B) as the reference figures do; ``GiB`` is also accepted.
"""
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvquant.codecs import get_codec


@dataclass(frozen=True)
class Stream:
    """Rows of one kind per layer and token: ``count`` rows of width ``dim``.

    ``grouped_scales=False`` keeps one scale per row under ``kv8-g<N>`` (the engine groups the
    latent L only; the rope row R keeps its per-row scale).
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
             "REFERENCE.md): give extra_f32_per_token in a JSON shape to add them."),
    "smollm2": ModelShape(
        "smollm2", n_layers=30,
        streams=(Stream("k", 64, count=3), Stream("v", 64, count=3)),
        note="SmolLM2-135M: GQA, 3 KV heads of width 64, K and V rows per head and layer."),
    "tiny-mla": ModelShape(
        "tiny-mla", n_layers=5,
        streams=(Stream("L", 32), Stream("R", 8, grouped_scales=False)),
        note="the engine's glm_tiny oracle (REFERENCE.md §1.8)."),
}

DEFAULT_CODECS = ("f32", "kv8", "kv8-g32", "tq8", "tq6", "tq4", "tq3", "tq2",
                  "polar6", "polar5", "polar4", "polar3", "polar2", "q8_0", "q4_0")
DEFAULT_CONTEXTS = (32768, 131072, 262144)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text):
    """``"64GB"`` -> 64e9, ``"64GiB"`` -> 64 * 2^30, ``"1.5e9"`` -> 1.5e9 (returns an int)."""
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a size: use e.g. 64GB, 512MiB or 1e9")
        value, unit = float(m.group(1)), m.group(2).lower()
    if value < 0:
        raise ValueError(f"a size must not be negative, got {text!r}")
    return int(value * _UNITS[unit])


def parse_tokens(text):
    """``"256k"`` -> 262144, ``"1M"`` -> 1048576, ``"4096"`` -> 4096."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a token count: use e.g. 4096, 128k or 1M")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]


def format_bytes(n):
    """Decimal units, three significant digits: 47714402304 -> '47.7 GB'."""
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


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
        streams = tuple(Stream(s["name"], int(s["dim"]), int(s.get("count", 1)),
                               bool(s.get("grouped_scales", True))) for s in d["streams"])
        shape = ModelShape(d.get("name", "custom"), int(d["n_layers"]), streams,
                           int(d.get("extra_layers", 0)), int(d.get("extra_f32_per_token", 0)),
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
    """Stored bytes of one row (side values included), or None when the codec cannot take
    the width (e.g. a rotated codec on a width that is not a power of two)."""
    try:
        return get_codec(spec, dim).bytes_per_row
    except ValueError:
        return None


def _stream_spec(spec, stream):
    base, _, options = spec.partition(":")
    if not stream.grouped_scales and re.fullmatch(r"kv8-g\d+", base):
        return "kv8" + (":" + options if options else "")
    return spec


def layer_row_bytes(shape, spec):
    """Bytes one token adds to one layer (every stream and KV head), or None."""
    total = 0
    for s in load_shape(shape).streams:
        b = row_bytes(_stream_spec(spec, s), s.dim)
        if b is None:
            return None
        total += s.count * b
    return total


def token_bytes(shape, spec):
    """Bytes one token adds to the pool of one slot (all cached layers and extra rows)."""
    shape = load_shape(shape)
    per_layer = layer_row_bytes(shape, spec)
    if per_layer is None:
        return None
    return shape.cached_layers * per_layer + 4 * shape.extra_f32_per_token


def pool_bytes(shape, spec, context, slots=1):
    """slots x [(n_layers + extra_layers) x context x row_bytes + context x extra f32 rows]."""
    per_token = token_bytes(shape, spec)
    return None if per_token is None else int(slots) * int(context) * per_token


def max_context(shape, spec, ram_bytes, slots=1, reserve_bytes=0):
    """The longest context whose pool fits in ram_bytes - reserve_bytes (0 if none does)."""
    per_token = token_bytes(shape, spec)
    if per_token is None:
        return None
    room = parse_bytes(ram_bytes) - parse_bytes(reserve_bytes)
    return max(0, room // (int(slots) * per_token))


def available_codecs(specs, shape):
    """The specs whose codec exists (registered) and takes every width of the shape."""
    return [s for s in specs if token_bytes(shape, s) is not None]


def budget_table(shape, specs=DEFAULT_CODECS, ram_bytes="64GB", contexts=DEFAULT_CONTEXTS,
                 slots=1, reserve_bytes=0):
    """One dict per codec: bytes per layer row, per token, pool at each context, longest context."""
    shape = load_shape(shape)
    f32 = token_bytes(shape, "f32")
    rows = []
    for spec in available_codecs(specs, shape):
        per_token = token_bytes(shape, spec)
        rows.append({
            "codec": spec,
            "layer_row_bytes": layer_row_bytes(shape, spec),
            "token_bytes": per_token,
            "compression": f32 / per_token,
            "pool_bytes": {int(c): pool_bytes(shape, spec, c, slots) for c in contexts},
            "max_context": max_context(shape, spec, ram_bytes, slots, reserve_bytes),
        })
    return rows


def format_table(shape, rows, ram_bytes, slots, reserve_bytes=0):
    shape = load_shape(shape)
    contexts = list(rows[0]["pool_bytes"]) if rows else []
    streams = " + ".join(f"{s.count}x{s.name}[{s.dim}]" if s.count > 1 else f"{s.name}[{s.dim}]"
                         for s in shape.streams)
    lines = [f"model {shape.name}: {shape.n_layers} layers"
             + (f" (+{shape.extra_layers} in the pool)" if shape.extra_layers else "")
             + f", per layer and token {streams}"
             + (f", +{shape.extra_f32_per_token} f32 per token" if shape.extra_f32_per_token else ""),
             f"RAM {format_bytes(parse_bytes(ram_bytes))}"
             + (f" minus {format_bytes(parse_bytes(reserve_bytes))} reserved"
                if parse_bytes(reserve_bytes) else "") + f", {slots} slot(s)", ""]
    header = (f"| {'codec':<10} | {'B/layer-row':>11} | {'B/token':>10} | {'vs f32':>6} | "
              + " | ".join(f"{'pool @ ' + _tokens(c):>13}" for c in contexts)
              + f" | {'longest context':>15} |")
    lines += [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
    for r in rows:
        lines.append(
            f"| {r['codec']:<10} | {r['layer_row_bytes']:>11} | {r['token_bytes']:>10} | "
            f"{r['compression']:>5.2f}x | "
            + " | ".join(f"{format_bytes(r['pool_bytes'][c]):>13}" for c in contexts)
            + f" | {r['max_context']:>15,} |")
    if shape.note:
        lines += ["", shape.note]
    return "\n".join(lines)


def _tokens(n):
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


# -- command line ----------------------------------------------------------------------------

def cmd_budget(args):
    try:
        shape = load_shape(args.model)
        contexts = [parse_tokens(c) for c in args.contexts.split(",") if c.strip()]
        specs = [s.strip() for s in args.codecs.split(",") if s.strip()] if args.codecs \
            else list(DEFAULT_CODECS)
        parse_bytes(args.ram), parse_bytes(args.reserve)
    except ValueError as exc:
        raise SystemExit(f"kvquant budget: {exc}")
    if args.codecs:
        missing = [s for s in specs if token_bytes(shape, s) is None]
        if missing:
            raise SystemExit(f"kvquant budget: codec(s) {missing} unknown or unable to take the "
                             f"widths of {shape.name}")
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
    p.add_argument("--ram", default="64GB", help="RAM for the pool, e.g. 64GB or 48GiB")
    p.add_argument("--reserve", default="0", help="RAM kept for other things (weights), e.g. 20GB")
    p.add_argument("--contexts", default=",".join(str(c) for c in DEFAULT_CONTEXTS),
                   help="contexts at which to print the pool size, e.g. 32k,128k,256k")
    p.add_argument("--slots", type=int, default=1, help="concurrent sequences")
    p.add_argument("--codecs", default=None,
                   help="comma-separated codec specs (default: every available family)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_budget)
    return p
