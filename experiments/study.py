"""The command line every study shares: ``python -m kvquant_experiments.<study>``.

A study module keeps its science and hands its command line to :func:`study_main`::

    def add_arguments(parser):      # its options, on a parser made here for every study
        ...

    def outputs(args):              # optional: what the run writes, checked before any work
        return [Output(args.out)]

    def run(args, progress):        # the work; returns the exit status (None: 0)
        ...                         # (args.argv: the arguments as given, to record)

    ERRORS = (ImportError,)         # optional: its own errors that are the user's to fix
    RESUMES = True                  # optional: the same command after Ctrl-C continues

    main = study_main(__name__)

It writes its files through :func:`kvquant.outputs.atomic_write` (or
:func:`kvquant_experiments.common.write_json` / ``write_csv``, which use it), so that a result is
never seen half-written. What every study then does the same way:

* the parser: ``prog`` ``python -m kvquant_experiments.<study>``, the module docstring's summary
  as description, :class:`kvquant.cli.OneLineErrorParser` (an argument error is one line, exit
  status 2) and :class:`kvquant.cli.DefaultsHelpFormatter` (subcommands through
  :func:`add_subcommand` get both too);
* the outputs (:class:`Output`) are checked before the run starts (:mod:`kvquant.outputs`: a
  folder is created and probed for writing, a file's folder too), so a long run never learns at
  its end that it cannot write;
* ``progress(msg)`` prints ``[HH:MM:SS] msg`` on stderr unless ``--quiet``
  (:func:`add_quiet_argument`);
* ``ValueError``, ``OSError`` and the study's ``ERRORS`` are one line ``<study>: <message>`` on
  stderr, exit status 2; Ctrl-C is one line saying whether the same command resumes, exit status
  130 (SIGTERM: 143, handled as Ctrl-C is); output into a closed pipe ends quietly. Never a
  traceback for any of these.
"""
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

from kvquant.cli import DefaultsHelpFormatter, OneLineErrorParser, Terminated
from kvquant.outputs import check_out_dir, check_out_file

__all__ = ["FILE", "FOLDER", "NEW_FILE", "Output", "add_executor_arguments",
           "add_quiet_argument", "add_subcommand", "build_parser", "check_outputs",
           "progress_printer", "run_study", "study_main"]

PACKAGE = "kvquant_experiments"

# what the interruption line says after "interrupted; "
RESUMES_NOTE = "rerun the same command to resume"
STARTS_OVER_NOTE = "this study does not resume: the same command starts over"

FOLDER, FILE, NEW_FILE = "folder", "file", "new file"


@dataclass(frozen=True)
class Output:
    """A path the run will write, checked before the run starts.

    Parameters
    ----------
    path : str or os.PathLike
    kind : {"folder", "file", "new file"}
        A folder (created if missing), a file (an existing one is replaced atomically at the
        end) or a file that must not exist yet (never overwritten).
    option : str
        The option that names it (in the error message).
    """
    path: object
    kind: str = FOLDER
    option: str = "--out"


def check_outputs(outputs):
    """Check every :class:`Output` (:func:`kvquant.outputs.check_out_dir` /
    :func:`~kvquant.outputs.check_out_file`); ValueError naming the option and the path."""
    for out in outputs:
        if out.kind == FOLDER:
            check_out_dir(out.path, out.option)
        elif out.kind in (FILE, NEW_FILE):
            # a folder there is said as check_out_file says it
            if (out.kind == NEW_FILE and os.path.lexists(out.path)
                    and not os.path.isdir(out.path)):
                raise ValueError(f"{out.option} {out.path} exists and is not overwritten; give "
                                 f"another {out.option}")
            check_out_file(out.path, out.option)
        else:
            raise ValueError(f"unknown output kind {out.kind!r}")


def progress_printer(quiet):
    """``progress(msg)``: ``[HH:MM:SS] msg`` on stderr, nothing when ``quiet``."""
    def progress(msg):
        if not quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return progress


def add_quiet_argument(parser):
    """``--quiet``: no progress lines (for studies that report progress)."""
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def add_executor_arguments(parser, workers_default="cores, at most 2"):
    """``--workers`` and ``--scheduler``, as every study that runs on the experiments' executor
    (:mod:`kvquant_experiments.executor`) takes them."""
    parser.add_argument("--workers", type=int, default=None,
                        help=f"local worker processes (default: {workers_default})")
    parser.add_argument("--scheduler", default=None,
                        help="Dask scheduler address (tcp://host:8786), or 'serial'")


def add_subcommand(subparsers, name, help):
    """A subcommand parser made as the study's own (its errors one line, the same help
    formatter), ``help`` also its description."""
    return subparsers.add_parser(name, help=help, description=help,
                                 formatter_class=DefaultsHelpFormatter)


def study_name(module):
    """``passkey`` for ``kvquant_experiments.passkey``, ``channel_split`` for
    ``kvquant_experiments.codecs.channel_split``: the name errors are said under."""
    return _dotted(module).rsplit(".", 1)[-1]


def _dotted(module):
    # under ``python -m`` the module is __main__; its spec keeps the name it was found by
    spec = getattr(module, "__spec__", None)
    name = spec.name if spec is not None else module.__name__
    # the same module reached as experiments.<study> (PYTHONPATH=.) is named as installed
    head, _, rest = name.partition(".")
    return f"{PACKAGE}.{rest}" if rest and head in (PACKAGE, "experiments") else name


def _summary(doc):
    """The docstring's first paragraph as one line (a summary may wrap over lines)."""
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(first.split())


def build_parser(module):
    """The study's parser: made here, its options from ``module.add_arguments``."""
    parser = OneLineErrorParser(prog=f"python -m {_dotted(module)}",
                                description=_summary(module.__doc__),
                                formatter_class=DefaultsHelpFormatter)
    module.add_arguments(parser)
    return parser


def _one_line(text):
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()


class _SigtermAsInterrupt:
    """SIGTERM (``kill``, a job scheduler's stop) raised as :class:`kvquant.cli.Terminated`
    where the run is, so that it unwinds as from Ctrl-C; the previous handler is restored."""

    def __enter__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            def handler(signum, frame):
                raise Terminated()
            self.previous = signal.signal(signal.SIGTERM, handler)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        return False


def run_study(module, argv=None):
    """Parse ``argv`` (default: the process's) for ``module``, check its outputs, run it.

    Returns
    -------
    int
        The exit status: the run's (0 when it returns None), 2 for a bad argument or an error
        the user can fix, 130 after Ctrl-C, 143 after SIGTERM.
    """
    name = study_name(module)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(module).parse_args(argv)
    except SystemExit as exc:       # --help (0) or an argument error, already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    args.argv = argv                # the command as given, for a result that records it
    errors = (ValueError, OSError, *getattr(module, "ERRORS", ()))
    outputs = getattr(module, "outputs", None)
    with _SigtermAsInterrupt():
        try:
            check_outputs(outputs(args) if outputs is not None else ())
            status = module.run(args, progress_printer(getattr(args, "quiet", False)))
            sys.stdout.flush()      # inside the try: a closed pipe fails here, not at exit
            return 0 if status is None else int(status)
        except BrokenPipeError:     # before OSError: the reader went away, nothing is wrong
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0
        except errors as exc:
            print(f"{name}: {_one_line(exc)}", file=sys.stderr)
            return 2
        except SystemExit as exc:
            if isinstance(exc.code, str):   # a message from code that says its own errors
                print(_one_line(exc.code), file=sys.stderr)
                return 2
            raise
        except KeyboardInterrupt as exc:
            # a run that knows more (how many units it kept, where) says it in the exception
            note = _one_line(" ".join(map(str, exc.args))) if exc.args else (
                RESUMES_NOTE if getattr(module, "RESUMES", False) else STARTS_OVER_NOTE)
            stopped = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
            print(f"{name}: {stopped}; {note}", file=sys.stderr)
            return 143 if isinstance(exc, Terminated) else 130   # 128 + the signal


def study_main(module_name):
    """``main(argv=None) -> exit status`` of the study module ``module_name`` (its
    ``__name__``). The module's hooks are looked up when ``main`` runs, not when it is made."""
    def main(argv=None):
        return run_study(sys.modules[module_name], argv)
    main.__doc__ = (f"Run the study {module_name} from the command line "
                    "(:func:`kvquant_experiments.study.run_study`); returns the exit status.")
    return main
