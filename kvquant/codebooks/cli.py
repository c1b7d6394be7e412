"""``kvquant codebooks fit ...``: fit codebooks and write them where the user says."""
import time

from kvquant.outputs import check_out_dir

from . import store
from .store import BITS_RANGE, DISTS, STORED_BETA_DIMS

__all__ = ["add_cli"]


def _parse_int_list(text, name, allow_ranges):
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            if allow_ranges and "-" in part:
                first, last = (int(s) for s in part.split("-", 1))
                if first > last:
                    raise ValueError
                values.extend(range(first, last + 1))
            else:
                values.append(int(part))
        except ValueError:
            form = "a comma-separated list of integers and ranges like 1-8" if allow_ranges \
                else "a comma-separated list of integers"
            raise ValueError(f"{name} takes {form}, got {text!r}") from None
    return list(dict.fromkeys(values))


def _run_fit(args, parser):
    try:
        dists = [s.strip() for s in args.dist.split(",")] if args.dist else None
        bits_list = _parse_int_list(args.bits, "--bits", allow_ranges=True)
        dims = _parse_int_list(args.dim, "--dim", allow_ranges=False) if args.dim else None
        # every value is checked before what is missing, so the message names the bad one
        lo, hi = BITS_RANGE
        for bits in bits_list:
            if not lo <= bits <= hi:
                raise ValueError(f"--bits {bits} is out of range: bit widths are {lo}..{hi}")
        for dist in dists or ():
            if dist not in DISTS:
                raise ValueError(f"--dist {dist!r} is not one of {', '.join(DISTS)}")
        for dim in dims or ():
            if dim < 2:
                raise ValueError(f"--dim {dim} is out of range: dimensions are integers >= 2")
        if args.all:
            if dims is not None:
                raise ValueError("--all fits the stored dims; do not combine it with --dim")
            dists = dists or list(DISTS)
            dims = list(STORED_BETA_DIMS)
        if not dists:
            raise ValueError("give --dist (gaussian, beta or both) or --all")
        if "beta" in dists and not dims:
            raise ValueError("--dist beta needs --dim (e.g. --dim 64,128) or --all")
        check_out_dir(args.out)     # before the fits, not after them
        start = time.perf_counter()
        written = store.regenerate(dists, dims or [], bits_list, args.out, log=print)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {len(written)} codebook file(s) in {time.perf_counter() - start:.1f} s")
    return 0


def add_cli(subparsers):
    """Register ``codebooks fit`` on an argparse subparsers object.

    ``kvquant codebooks fit [--dist gaussian,beta] [--dim 64,128] [--bits 1-8] [--all]
    [--out DIR]`` (default ``./codebooks``: never the installed package). The ``fit`` parser sets ``func``: call ``args.func(args)``, which returns an
    exit code (0) or exits through ``parser.error`` on bad arguments.

    Parameters
    ----------
    subparsers : argparse._SubParsersAction
        From ``ArgumentParser.add_subparsers()``.

    Returns
    -------
    argparse.ArgumentParser
        The ``codebooks`` parser.
    """
    from kvquant.cli import DefaultsHelpFormatter
    parser = subparsers.add_parser(
        "codebooks", help="Lloyd-Max codebooks (fit and store)",
        description="Lloyd-Max codebooks for the rotated codecs, in N(0,1) units.")
    actions = parser.add_subparsers(dest="codebooks_action", metavar="ACTION")
    actions.required = True
    fit = actions.add_parser(
        "fit", help="fit codebooks and write them as JSON",
        description="Fit Lloyd-Max codebooks and write one JSON file per (dist, dim, bits).",
        formatter_class=DefaultsHelpFormatter)
    fit.add_argument("--dist", default=None,
                     help="gaussian, beta or gaussian,beta (default with --all: both)")
    fit.add_argument("--dim", default=None, help="beta dimensions, comma-separated (e.g. 64,128)")
    fit.add_argument("--bits", default="1-8", help="bit widths, e.g. 4 or 1-8 or 2,4")
    fit.add_argument("--all", action="store_true",
                     help="every stored dimension: " + ",".join(map(str, STORED_BETA_DIMS)))
    fit.add_argument("--out", default="codebooks",
                     help="output folder (the stored codebooks the codecs load live in "
                          "kvquant/data/codebooks of the source tree: write there with --out "
                          "to replace them, then reinstall)")
    fit.set_defaults(func=lambda args: _run_fit(args, fit))
    return parser
