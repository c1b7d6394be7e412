"""Where commands write: the output path checked before any work, files written atomically.

A long run must not learn at its end that ``--out`` names a file, a read-only folder or a path
it cannot create, and a result file must never be seen half-written: each file goes to a temp
file in its own folder and is renamed over the target (the rename is atomic on POSIX), so a kill
or a full disk leaves the previous file or none, never a truncated one.
"""
import json
import math
import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "check_out_dir", "check_out_file", "dumps_strict"]


def _probe_writable(folder, arg):
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvquant-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{arg} {folder}: cannot write there ({exc.strerror or exc}); give "
                         "a writable folder") from None


def check_out_dir(path, arg="--out"):
    """The output folder ``path``, created if missing and probed for writing.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ValueError
        ``path`` exists and is not a folder, cannot be created or is not writable (the message
        names ``arg`` and the path).
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{arg} {out} exists and is not a folder; give a folder (new or "
                         "existing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{arg} {out}: cannot create the folder ({exc.strerror or exc})") \
            from None
    _probe_writable(out, arg)
    return out


def check_out_file(path, arg="--out"):
    """The output file ``path``: its folder created if missing and probed for writing; an
    existing regular file is replaced at the end (atomically), anything else is refused."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{arg} {out} is a folder; give a file name")
    if out.exists() and not out.is_file():
        raise ValueError(f"{arg} {out} exists and is not a regular file")
    check_out_dir(out.parent, arg)
    return out


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, write, binary=False):
    """Call ``write(f)`` on a temp file beside ``path``, then rename it to ``path``.

    The temp file is removed when ``write`` or the rename fails (the error propagates), so a
    failed write leaves what was at ``path`` before.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        text = {} if binary else {"newline": "", "encoding": "utf-8"}
        with os.fdopen(fd, "wb" if binary else "w", **text) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file private (0600); a result gets the mode open() would give it
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _finite_or_none(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def dumps_strict(obj):
    """JSON that any parser reads: NaN and infinities (which ``json.dumps`` writes as the
    non-standard ``NaN``/``Infinity``) become null."""
    return json.dumps(_finite_or_none(obj), indent=1, allow_nan=False)
