"""One writer per cache file: an advisory lock on a sidecar file.

A writer (``CacheFile.open`` without ``readonly=True``) takes ``fcntl.flock(LOCK_EX | LOCK_NB)``
on ``<target>.kvq-lock`` beside the file (``target``: the path with symlinks resolved) before it
reads the file, and holds it until ``close()``; it writes its pid into the lock file so that a
refused writer can name the holder. Readers take no lock: they rely on the commit protocol.

Why a sidecar and not the cache file itself: a whole-file rewrite replaces the file by renaming a
new one over it, so a lock held on the old inode would guard a file that is no longer at the
path, and the next writer would lock the new inode freely. The sidecar is never replaced (it is
removed by its holder on close, and a writer that locked a removed sidecar retries). Why
``flock`` and not ``lockf``/``fcntl`` record locks: record locks belong to the process, so a
second writer in the same process would not be refused, and closing any descriptor of the file
in the process drops them; ``flock`` locks belong to the open file description. The lock is
advisory: the engine itself does not take it, and a forked child shares its parent's lock.
"""
import errno
import fcntl
import os
import stat

LOCK_SUFFIX = ".kvq-lock"


def lock_path(target):
    return target + LOCK_SUFFIX


def read_holder(path):
    """The pid written in a lock file, or None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            text = f.read(32).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def try_lock(target):
    """Take the writer lock of ``target``.

    Returns
    -------
    (fd, None)
        The lock is held through ``fd`` (pass it to :func:`unlock`).
    (None, pid)
        Another writer holds it; ``pid`` is its pid, or None when unknown.

    Raises
    ------
    OSError
        The lock file cannot be created (e.g. a read-only directory), or something other than a
        regular file is at its path (a symbolic link is never followed: the lock file is
        truncated, so following one would truncate whatever it points to).
    """
    path = lock_path(target)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                         | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "it is a symbolic link, never followed by a writer: "
                              "remove it if no writer is running", path) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EEXIST, "it is not a regular file: remove it if no writer is "
                          "running", path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None, read_holder(path)
            raise
        # the previous holder may have removed the name after we opened it: lock what is there
        try:
            st = os.stat(path)
        except FileNotFoundError:
            os.close(fd)
            continue
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd, None


def unlock(fd, target):
    """Release the lock taken by :func:`try_lock` (removing the lock file while still holding
    it, so that nobody locks a name about to disappear without noticing)."""
    try:
        os.unlink(lock_path(target))
    except OSError:
        pass
    os.close(fd)
