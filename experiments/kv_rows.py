"""A model's cache rows on a text, out to a file: ``kvquant dump-kv``. The file format, its
writer and its reader are the library's (:mod:`kvquant.kv_rows`); they are re-exported here."""
import sys

import numpy as np

from kvquant.cli import DefaultsHelpFormatter
from kvquant.kv_rows import (FORMAT, STREAM_NOTES, load_kv_rows, select_rows,  # noqa: F401
                             write_kv_rows)
from kvquant.outputs import check_out_dir, check_out_file

__all__ = ["FORMAT", "add_cli", "dump_kv", "load_kv_rows", "main", "select_rows", "write_kv_rows"]


def cache_rows(cache, layer, name, head):
    """Rows (positions, width) float32 of one layer, stream and KV head of an f32 cache."""
    return cache.stream(layer, name, head).decode()


def dump_kv(model, tokens):
    """Prefill ``tokens`` with an f32 cache; return ``{stream: (n_layers, n_kv_heads, n, width)}``.

    Parameters
    ----------
    model : a kvquant model (``new_cache``, ``forward``)
    tokens : sequence of int
    """
    cache = model.new_cache("f32")
    model.forward(np.asarray(tokens, dtype=np.int64), cache, last_only=True)
    return {name: np.stack([np.stack([cache_rows(cache, layer, name, head)
                                      for head in range(cache.n_kv_heads)])
                            for layer in range(cache.n_layers)]).astype(np.float32, copy=False)
            for name in cache.stream_names}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def cmd_dump_kv(args):
    from kvquant.models import load_model
    from kvquant_experiments.models import model_tag
    from kvquant_experiments.texts import text_tokens
    try:
        if args.positions < 1:
            raise ValueError(f"--positions must be >= 1, got {args.positions}")
        if args.start < 0:
            raise ValueError(f"--start must be >= 0, got {args.start}")
        if args.out:
            check_out_file(args.out)
        else:
            check_out_dir(".")
        model = load_model(args.model)
        tokens, text = text_tokens(model, args.text)
        context = getattr(model, "context_length", None)
        if context and args.positions > context:
            raise ValueError(f"{args.positions} positions exceed the trained context of "
                             f"{args.model} ({context})")
        if tokens.size < args.start + args.positions:
            raise ValueError(f"text {text.name!r} has {tokens.size} tokens; {args.positions} "
                             f"from {args.start} need {args.start + args.positions}")
        ids = tokens[args.start:args.start + args.positions]
        rows = dump_kv(model, ids)
    except (ValueError, ImportError, OSError) as exc:
        raise SystemExit(f"kvquant dump-kv: {exc}")
    out = args.out or f"kv-rows-{model_tag(args.model)}-{text.name}-N{args.positions}.npz"
    meta = {"model": model.describe(), "model_name": str(args.model), "text": text.describe(),
            "positions": int(args.positions), "start": int(args.start),
            "cache": "f32, one prefill of the positions from an empty cache"}
    try:
        write_kv_rows(out, rows, meta)
    except OSError as exc:
        raise SystemExit(f"kvquant dump-kv: writing {out} failed ({exc.strerror or exc}); "
                         "nothing was left behind")
    for name, x in rows.items():
        print(f"{name}: {x.shape} ({STREAM_NOTES.get(name, name)})")
    print(f"wrote {out}")
    return 0


def add_cli(sub):
    """Register ``kvquant dump-kv``."""
    from kvquant_experiments.texts import TEXTS
    p = sub.add_parser(
        "dump-kv", help="write a model's K (after RoPE) and V rows on a text to .npz",
        description="Prefill a text with an f32 cache and write its rows per layer and KV head "
                    "(K after RoPE and V on Llama-family models) with their metadata; "
                    "`kvquant distortion --data FILE.npz` measures codecs on them.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="smollm2, another name load_model knows, or a GGUF file path")
    p.add_argument("--text", default="pydoc",
                   help="a UTF-8 text file or a built-in text (" + ", ".join(TEXTS) + ")")
    p.add_argument("--positions", type=int, default=512, help="tokens to prefill")
    p.add_argument("--start", type=int, default=0, help="first token of the text to use")
    p.add_argument("--out", default=None,
                   help="output .npz (default ./kv-rows-<model>-<text>-N<positions>.npz)")
    p.set_defaults(func=cmd_dump_kv)
    return p


def main(argv=None):
    """``kvquant dump-kv ...``."""
    from kvquant.cli import parse_subcommand
    args = parse_subcommand(add_cli, "dump-kv", argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
