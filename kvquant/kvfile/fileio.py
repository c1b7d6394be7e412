"""Low-level I/O of the cache file: whole writes and reads at an offset, fsync of a file and its
directory, the atomic replace of a file by a new one."""
import errno
import os


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


def temp_path(path):
    return f"{path}.kvq-tmp"


def write_new_file(path, chunks):
    """Write ``chunks`` to a temporary file beside ``path``, fsync it and rename it over
    ``path``: the old file stays whole until the new one is complete. Returns an fd (O_RDWR) of
    the new file."""
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        for chunk in chunks:
            pwrite_all(fd, chunk, offset)
            offset += len(chunk)
        os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path)
    return fd
