"""kvquant: what a KV-cache codec costs in bytes, error, speed and next-token flips."""
import argparse
import os
import sys

import numpy as np

from kvquant.outputs import dumps_strict


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument error is one line naming it (argparse prints the usage first), exit status 2;
    ``kvquant <command> --help`` shows the usage."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" only where the help does not already say its default, and
    not for None or False (an option that is off or computed says so in its own words)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def parse_subcommand(add_cli, command, argv=None):
    """Parse ``argv`` (default: the process's) as ``kvquant <command> ...`` for the research
    package's command modules, whose ``add_cli(subparsers)`` registers ``command``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineErrorParser(prog="kvquant")
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args([command, *argv])


def _parse_codecs(text):
    from kvquant.specs import split_spec_text
    try:
        specs = split_spec_text(text)
    except ValueError as exc:
        raise SystemExit(f"kvquant: {exc}")
    if not specs:
        raise SystemExit(f"kvquant: --codecs {text!r} names no codec; give specs such as "
                         "kv8,tq4 or 'all'")
    return specs


# Gaussian rows of distortion are drawn in memory: rows x dim float32 beyond this is refused
MAX_DRAWN_BYTES = 2 << 30


# `--codecs all`: every codec at its natural bit widths, llama.cpp's cache types included so that
# each of ours always has the baseline people already run at the same bits per value.
ALL_CODECS = ("f32", "kv8", "kv8-g32", *(f"tq{b}" for b in range(1, 9)), "tq4:compat=colibri",
              *(f"polar{b}" for b in range(2, 7)),
              *(f"polar{b}:compat=colibri" for b in range(2, 7)),
              *(k + r for k in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
                for r in ("", "+rot")))


def _distortion_data(args):
    """[(label, rows (n, dim))] of ``--data``: a .npy array, or a ``kvquant dump-kv`` .npz
    (:mod:`kvquant.kv_rows`) cut by --stream / --layer / --head."""
    if str(args.data).endswith(".npz"):
        from kvquant.kv_rows import load_kv_rows, select_rows
        try:
            rows, _ = load_kv_rows(args.data)
            return list(select_rows(rows, args.stream, args.layer, args.head).items())
        except ValueError as exc:
            raise SystemExit(f"kvquant distortion: {exc}")
    if args.stream or args.layer is not None or args.head is not None:
        raise SystemExit("kvquant distortion: --stream, --layer and --head select rows of a "
                         "`kvquant dump-kv` .npz file")
    if not os.path.isfile(args.data):
        raise SystemExit(f"kvquant distortion: --data {args.data!r} is not a file")
    try:
        # mapped first: numpy checks the header's shape against the file's size before
        # anything is allocated (a header claiming 2^33 rows would allocate them)
        X = np.load(args.data, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        raise SystemExit(f"kvquant distortion: cannot read {args.data!r} as a .npy array: {exc}")
    if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise SystemExit(f"kvquant distortion: {args.data!r} holds shape {X.shape}; "
                         "expected a 2-D array (n_rows, dim) with at least one row and column")
    if X.dtype.kind != "f":
        raise SystemExit(f"kvquant distortion: {args.data!r} holds {X.dtype} values; expected "
                         "float32 or float64 rows (convert with X.astype(np.float32))")
    return [(args.data, np.array(X))]


def cmd_distortion(args):
    from kvquant.codecs import WIDTH_RULE, get_codec
    from kvquant.metrics import measure_distortion, measure_stream_distortion
    from kvquant.streams.spec import StreamSpec

    if args.rows < 1:
        raise SystemExit(f"kvquant distortion: --rows must be >= 1, got {args.rows}")
    if not args.data and (not args.dim or min(args.dim) < 1):
        raise SystemExit(f"kvquant distortion: --dim needs widths >= 1, got {args.dim}")
    if args.seed < 0:
        raise SystemExit(f"kvquant distortion: --seed must be >= 0, got {args.seed}")
    if not args.data and args.rows * max(args.dim) * 4 > MAX_DRAWN_BYTES:
        raise SystemExit(f"kvquant distortion: {args.rows} rows of width {max(args.dim)} are "
                         f"{args.rows * max(args.dim) * 4 / 2**30:.1f} GiB of float32, above "
                         f"the {MAX_DRAWN_BYTES >> 30} GiB drawn at most: lower --rows or --dim")
    every = args.codecs.strip().lower() == "all"    # every codec that can take each width
    codec_list = ALL_CODECS if every else _parse_codecs(args.codecs)
    if args.data:
        datasets = _distortion_data(args)
    else:
        datasets = [(None, None)] * len(args.dim)
    results = []
    for (label, X), dim in zip(datasets, [x.shape[1] for _, x in datasets] if args.data
                               else args.dim):
        if not args.data:
            X = np.random.default_rng(args.seed).standard_normal((args.rows, dim)).astype(np.float32)
        skipped = []
        for spec in codec_list:
            if not StreamSpec.parse(spec).plain:   # the codec inside a RowStream with options
                try:
                    row = measure_stream_distortion(spec, X, n_threads=args.threads)
                except ValueError as exc:
                    raise SystemExit(f"kvquant distortion: {exc}")
            else:
                try:
                    codec = get_codec(spec, dim)
                except ValueError as exc:
                    if every:   # "all" is every codec that can take this width
                        skipped.append(spec)
                        continue
                    raise SystemExit(f"kvquant distortion: {exc}")
                try:
                    row = measure_distortion(codec, X, n_threads=args.threads)
                except ValueError as exc:   # rows the codec refuses (NaN/inf, out of range)
                    raise SystemExit(f"kvquant distortion: {spec}: {exc}")
            if label is not None:
                row["data"], row["rows"] = label, int(X.shape[0])
            results.append(row)
        if skipped:
            print(f"kvquant distortion: width {dim} does not suit {', '.join(skipped)} "
                  f"({WIDTH_RULE}); skipped", file=sys.stderr)
    if args.json:
        print(dumps_strict({"rows": int(X.shape[0]), "seed": args.seed,
                            "data": args.data or "gaussian", "results": results}))
        return 0
    labelled = any("data" in r for r in results)
    print(("{:<22} ".format("data") if labelled else "") +
          f"{'codec':<28} {'dim':>5} {'bits/val':>8} {'B/row':>6} {'ratio':>6} "
          f"{'relL2 mean':>10} {'relL2 max':>10}")
    for r in results:
        print(("{:<22} ".format(str(r.get("data", ""))[-22:]) if labelled else "") +
              f"{r['codec']:<28} {r['dim']:>5} {r['bits_per_value']:>8.3f} {r['bytes_per_row']:>6} "
              f"{r['compression']:>6.2f} {r['rel_l2_mean']:>10.5f} {r['rel_l2_max']:>10.5f}")
    return 0


def cmd_info(args):
    import kvquant
    from kvquant._kernels import _build_info
    print(f"kvquant {kvquant.__version__}")
    print(f"openmp: {'on' if _build_info.openmp_enabled() else 'off'} "
          f"(default threads {_build_info.openmp_max_threads()})")
    print(f"kernels compiled by {_build_info.compiler()}")
    return 0


COMMAND_GROUP = "kvquant.commands"


def _installed_commands():
    """``{name: entry point}`` of the commands installed in the group ``kvquant.commands``
    (the research package's report, flips, tasks, dump-kv, bench; any package may add one). Each
    names a ``main(argv)`` that parses its own options; it is imported only when run."""
    from importlib.metadata import entry_points
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def cmd_installed(args):
    ep = _installed_commands()[args.command]
    try:
        main = ep.load()
    except ImportError as exc:   # a broken plug-in must not break the other commands
        raise SystemExit(f"kvquant {args.command}: {ep.value} is not importable ({exc}); "
                         "reinstall the package that provides it (for kvquant's own: "
                         "pip install -e '.[report]' from its source tree)")
    return main(args.command_args)


def _int_list(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def build_parser():
    parser = OneLineErrorParser(prog="kvquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("distortion", help="relative L2 error and bytes per row of codecs")
    p.add_argument("--codecs", default="kv8,tq2,tq3,tq4",
                   help="comma-separated codec specs (e.g. kv8,kv8-g32,tq4,tq4:compat=colibri,"
                        "polar4,q4_0+rot), or 'all': every codec at its natural bit widths; "
                        "a stream spec (tq4@center,normalize,sinks=1) runs the codec inside a "
                        "cache stream with its options")
    p.add_argument("--dim", type=_int_list, default=[512], help="row width(s), comma-separated")
    p.add_argument("--rows", type=int, default=4096, help="Gaussian rows to draw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="rows to use instead: a .npy file of shape (n_rows, dim), "
                                  "or a `kvquant dump-kv` .npz (each stream on its own)")
    p.add_argument("--stream", default=None,
                   help="with a dump-kv .npz: one stream (k, v; L, R on tiny-mla) or 'all'")
    p.add_argument("--layer", type=int, default=None,
                   help="with a dump-kv .npz: one layer (default: all, pooled)")
    p.add_argument("--head", type=int, default=None,
                   help="with a dump-kv .npz: one KV head (default: all, pooled)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_distortion)

    p = sub.add_parser("info", help="build facts (OpenMP, threads)")
    p.set_defaults(func=cmd_info)

    for name, ep in sorted(_installed_commands().items()):
        # its options are parsed by its own main (prefix_chars: passed through as they are)
        p = sub.add_parser(name, add_help=False, prefix_chars="\x00",
                           help=f"{ep.module} (kvquant {name} --help)")
        p.add_argument("command_args", nargs="*")
        p.set_defaults(func=cmd_installed)

    # each module that owns a command registers it (imported here: scipy etc. load lazily)
    from kvquant import budget, codebooks, kvfile
    for module in (codebooks, budget, kvfile):
        module.add_cli(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is so that it unwinds as from Ctrl-C."""


def _terminate_as_interrupt():
    import signal
    import threading

    def handler(signum, frame):
        raise Terminated("terminated (SIGTERM)")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def main(argv=None):
    """Run a command. A bad input is one line on stderr and exit status 2, never a traceback:
    the commands raise ``SystemExit("kvquant <command>: <problem>")``. Output into a closed
    pipe (``kvquant ... | head``) ends the command quietly. SIGTERM (``kill``, a job
    scheduler's stop) is handled as Ctrl-C is: the run stops where it is, keeping what it
    finished, and its worker processes stop with it."""
    _terminate_as_interrupt()
    try:
        args = build_parser().parse_args(argv)
        status = args.func(args)
        sys.stdout.flush()      # inside the try: a closed pipe fails here, not at exit
        return status
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt as exc:
        # one line, not the traceback of wherever the run was; 130 = 128 + SIGINT, as shells do
        print("kvquant: interrupted" + (f"; {exc}" if exc.args else ""), file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130   # 128 + the signal, as shells do
    except BrokenPipeError:
        # the reader went away: stop writing, and keep Python's exit flush from failing again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
