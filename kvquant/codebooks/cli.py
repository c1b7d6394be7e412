"""``kvquant codebooks fit ...``: fit codebooks and write them where the user says."""
import time

from kvquant.outputs import check_out_dir

from . import store
from .lloyd_max import ConvergenceError
from .store import BITS_RANGE, DISTS, STORED_BETA_DIMS

__all__ = ["add_cli"]

# The widest Beta density fitted: from 65536 on, the fit of 8-bit levels runs for minutes or
# ends in a ConvergenceError (the density is then within a hair of the Gaussian, --dist gaussian)
MAX_FIT_DIM = 16384


def _parse_int_list(text, name, allow_ranges, check):
    """The integers of ``text`` ("2,4" or, with ``allow_ranges``, "1-8"), each passed to
    ``check`` (which raises ValueError naming a bad one) before any range is built: 1-100000000
    would fill the memory before its values were checked."""
    spans = []
    for part in text.split(","):
        part = part.strip()
        try:
            if allow_ranges and "-" in part:
                first, last = (int(s) for s in part.split("-", 1))
                if first > last:
                    raise ValueError
            else:
                first = last = int(part)
        except ValueError:
            form = "a comma-separated list of integers and ranges like 1-8" if allow_ranges \
                else "a comma-separated list of integers"
            raise ValueError(f"{name} takes {form}, got {text!r}") from None
        spans.append((first, last))
    for first, last in spans:
        check(first)
        check(last)
    return list(dict.fromkeys(v for first, last in spans for v in range(first, last + 1)))


def _check_bits(bits):
    lo, hi = BITS_RANGE
    if not lo <= bits <= hi:
        raise ValueError(f"--bits {bits} is out of range: bit widths are {lo}..{hi}")


def _check_dim(dim):
    if not 2 <= dim <= MAX_FIT_DIM:
        raise ValueError(f"--dim {dim} is out of range: dimensions are integers from 2 to "
                         f"{MAX_FIT_DIM} (wider rows are near the Gaussian: --dist gaussian)")


def _run_fit(args, parser):
    try:
        dists = [s.strip() for s in args.dist.split(",")] if args.dist else None
        # every value is checked before what is missing, so the message names the bad one
        bits_list = _parse_int_list(args.bits, "--bits", True, _check_bits)
        dims = _parse_int_list(args.dim, "--dim", False, _check_dim) if args.dim else None
        for dist in dists or ():
            if dist not in DISTS:
                raise ValueError(f"--dist {dist!r} is not one of {', '.join(DISTS)}")
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
    except ValueError as exc:
        parser.error(str(exc))
    start = time.perf_counter()
    try:
        written = store.regenerate(dists, dims or [], bits_list, args.out, log=print)
    except ValueError as exc:
        parser.error(str(exc))
    except (ConvergenceError, OSError) as exc:  # a full disk, or a fit that does not settle
        cause = exc.strerror or exc if isinstance(exc, OSError) else exc
        raise SystemExit(f"kvquant codebooks fit: {cause}; the files written before it are "
                         f"in {args.out}") from None
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
