"""``kvquant flips``: the command line of a flip table (its options and their checks before any
work, the store of finished units beside the results that lets the same command resume)."""
import os
import sys

from kvquant.cli import DefaultsHelpFormatter
from kvquant import flips
from kvquant.outputs import check_out_dir, dumps_strict
from kvquant_experiments.executor import UnitStore
from kvquant_experiments.flip_files import result_stem, write_results
from kvquant_experiments.flip_runs import DEFAULT_CHUNK_TOKENS, DEFAULT_POSITIONS, run_flips
from kvquant_experiments.flip_tables import format_markdown
from kvquant_experiments.study import progress_printer

__all__ = ["UNITS_FOLDER", "add_cli", "main"]

# the command keeps its finished units here, in the results' folder, until the run ends
UNITS_FOLDER = ".flips-units"


def _hf_model(args):
    """The ``--backend hf`` model: a local transformers checkpoint folder through
    :mod:`kvquant.hf` (one process: worker processes would load the numpy models)."""
    if args.model == "tiny-mla":
        raise ValueError("--backend hf needs --model DIR, a local transformers checkpoint folder")
    if (args.workers or 1) > 1 or args.scheduler not in (None, "serial"):
        raise ValueError("--backend hf runs in this process: drop --workers / --scheduler")
    if not os.path.isdir(args.model):
        raise ValueError(f"--backend hf: {args.model!r} is not a folder; give a local "
                         "transformers checkpoint folder (config.json and safetensors)")
    try:
        from kvquant.hf import load_hf_model
    except ImportError as exc:
        raise ImportError(f"--backend hf needs the hf extra ({exc}): pip install "
                          "torch==2.13.0, then pip install -e '.[hf]'") from None
    return load_hf_model(args.model)


def cmd_flips(args):
    from kvquant.specs import split_spec_text
    try:
        if not args.no_write:   # before any work: a run must not find out at its end
            check_out_dir(args.out if args.out is not None else ".")
        codecs = split_spec_text(args.codecs) if args.codecs is not None else None
        if codecs == []:
            raise ValueError(f"--codecs {args.codecs!r} names no codec; give specs such as "
                             "kv8,tq4, or leave --codecs out for the model's list")
        if args.plan:   # cache plans: configurations beside (or instead of) the pair specs
            from kvquant.models.plan import CachePlan
            for path in args.plan:
                CachePlan.load(path)   # a bad file fails here, naming it
            codecs = (codecs if codecs is not None else ["f32"]) + list(args.plan)
        model = None
        if args.backend == "hf":
            model = _hf_model(args)
        # finished units are kept beside the results (or in the working folder until the
        # run's own folder is known) so that the same command resumes after an interruption
        units = None if args.no_write else UnitStore(os.path.join(
            args.out if args.out is not None else ".", UNITS_FOLDER))
        result = run_flips(args.model, codecs=codecs, positions=args.positions,
                           chunk_tokens=args.chunk_tokens, n_prompts=args.prompts,
                           workers=args.workers, progress=progress_printer(args.quiet),
                           text=args.text,
                           scheduler=args.scheduler, score=args.score, model=model,
                           units=units)
    except (ValueError, ImportError, OSError) as exc:
        raise SystemExit(f"kvquant flips: {exc}")
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"{units.saved + units.loaded} finished unit(s) are saved in {units.folder}: rerun "
            "the same command to resume" if units else "nothing was saved (--no-write)") from None
    out = args.out if args.out is not None else result_stem(result)
    try:
        paths = () if args.no_write else write_results(result, out)
    except OSError as exc:      # a full disk after the run: its finished units stay for a rerun
        raise SystemExit(
            f"kvquant flips: cannot write the results in {out} ({exc.strerror or exc}); "
            f"the {units.saved + units.loaded} finished unit(s) are kept in {units.folder}: "
            "free space, then run the same command to resume") from None
    if units is not None:       # the results hold everything the units did
        units.discard()
    if args.json:
        print(dumps_strict(result))
    else:
        print(format_markdown(result))
        for p in paths:
            print(f"wrote {p}")
    return 0


def add_cli(sub):
    """Register ``kvquant flips``."""
    from kvquant_experiments.texts import TEXTS
    p = sub.add_parser(
        "flips", help="token-flip table of KV codecs on a model (tiny MLA, SmolLM2, a GGUF file)",
        description="Teacher-forced and greedy agreement with the f32 cache (the engine's "
                    "protocol), and on a model with a tokenizer same-top-p, KL divergence "
                    "(also by position in the chunk) and perplexity ratio over a text; Wilson "
                    "95% intervals.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-mla",
                   help="tiny-mla, smollm2, gemma3-270m, a GGUF file path, or with --backend "
                        "hf a local transformers checkpoint folder")
    p.add_argument("--backend", choices=("numpy", "hf"), default="numpy",
                   help="numpy: kvquant's own forward of the model; hf: the model in "
                        "transformers with kvquant's cache and attention (kvquant.hf)")
    p.add_argument("--codecs", default=None,
                   help="comma-separated specs (options may follow, as in "
                        "tq3:codebook=gaussian,side=unbiased); 'A/B' gives K/V (or L/R) "
                        "different codecs; 'ggml:q8_0/q8_0' (GGUF models) is llama.cpp's "
                        "cache types with its attention arithmetic, as it runs; default: the "
                        "model's list")
    p.add_argument("--plan", action="append", default=None, metavar="JSON",
                   help="a cache plan file (stream specs per layer and KV head, "
                        "kvquant.models.plan; e.g. from python -m kvquant_experiments.allocate) "
                        "measured as one more configuration; repeatable")
    p.add_argument("--positions", type=int, default=None,
                   help=f"real-text positions (default {DEFAULT_POSITIONS}; 0: none)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="tokens per text chunk (one prefill each), up to the model's context")
    p.add_argument("--text", default="pydoc",
                   help="a UTF-8 text file, or a built-in text: " + "; ".join(
                       f"{k}: {v[0]}" for k, v in TEXTS.items()))
    p.add_argument("--score", choices=flips.SCORES, default="all",
                   help="text positions in the statistics: all, or the second half of each "
                        "chunk as llama-perplexity scores")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts of the engine's protocol (default 8; 1 on tiny-mla)")
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: cores, at most 2; 1: this process)")
    p.add_argument("--scheduler", default=None,
                   help="Dask scheduler address (tcp://host:8786) to run the chunks on a "
                        "cluster, or 'serial'")
    p.add_argument("--out", default=None,
                   help="folder for the CSV/JSON results and figure (default: a folder named "
                        "for the run, e.g. ./flips-smollm2-p8-pydoc-N10240-c1024)")
    p.add_argument("--no-write", action="store_true", help="write no files")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_flips)
    return p


def main(argv=None):
    """``kvquant flips ...`` (also ``python -m kvquant_experiments.flip_command ...``)."""
    from kvquant.cli import parse_subcommand
    args = parse_subcommand(add_cli, "flips", argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
