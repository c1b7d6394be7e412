"""Low-level I/O of the cache file: whole writes and reads at an offset, fsync of a file and its
directory, the atomic replace of a file by a new one (through a temporary file of its own writer),
the removal of temporary files left by dead writers, the opening of regular files only."""
import errno
import os
import re
import secrets
import stat

TEMP_INFIX = ".kvq-tmp."


def pwrite_all(fd, data, offset):
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]
        offset += n


def pread_exact(fd, size, offset):
    """Read up to ``size`` bytes (fewer at end of file)."""
    chunks = []
    while size > 0:
        b = os.pread(fd, min(size, 1 << 26), offset)
        if not b:
            break
        chunks.append(b)
        size -= len(b)
        offset += len(b)
    return b"".join(chunks)


def fsync_dir(path):
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is done
    finally:
        os.close(fd)


def file_kind(mode):
    """``"a directory"``, ``"a FIFO"``, ... for a file that is not a regular one."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path, flags):
    """``os.open`` that never blocks on a FIFO or a device and returns (fd, fstat) of a regular
    file, or (None, kind) for anything else (``kind`` as :func:`file_kind` names it)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None, file_kind(st.st_mode)
    return fd, st


def temp_path(target):
    """A temporary name beside ``target`` that no other writer can share: the writer's pid and
    a random suffix (the file is created with O_EXCL)."""
    return f"{target}{TEMP_INFIX}{os.getpid()}.{secrets.token_hex(4)}"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True   # exists, owned by someone else
    return True


def remove_stale_temps(target):
    """Remove the temporary files of ``target`` whose writer process is gone (names
    ``<target>.kvq-tmp.<pid>.<8 hex digits>``; nothing else is touched). Call it holding the
    writer lock. Returns the names removed."""
    folder, base = os.path.split(target)
    pattern = re.compile(re.escape(base + TEMP_INFIX) + r"([0-9]{1,10})\.[0-9a-f]{8}\Z")
    removed = []
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        if m is None or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def write_new_file(target, chunks):
    """Write ``chunks`` to a temporary file of this writer beside ``target``, fsync it and rename
    it over ``target``: the old file stays whole until the new one is complete. ``target`` is a
    real path (symlinks resolved), so a symlinked cache path keeps its link and the link's target
    gets the new content. Returns an fd (O_RDWR) of the new file."""
    tmp = temp_path(target)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        offset = 0
        for chunk in chunks:
            pwrite_all(fd, chunk, offset)
            offset += len(chunk)
        os.fsync(fd)
        os.replace(tmp, target)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(target)
    return fd
