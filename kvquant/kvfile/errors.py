"""What opening or saving a cache file reports: the refusals, the save error, the load report."""
import errno
from dataclasses import dataclass, field


class CacheFileRefused(ValueError):
    """A cache file that will not be read (or written) under the running mode; nothing was
    loaded (or written).

    Attributes
    ----------
    reason : str
        Short machine-readable cause: ``"tier"``, ``"codec"``, ``"bits"``, ``"tag"``, ``"seed"``,
        ``"rotation"``, ``"codebook"``, ``"side"`` (side-value kind or dtype), ``"options"``
        (stream options), ``"model"`` (model identity), ``"context"``, ``"version"``,
        ``"not-a-cache"``, ``"not-a-file"`` (a directory, FIFO, device...) (mismatches),
        ``"header"``, ``"commit"``, ``"state"`` (the stream state of a kvq file) (corruption) or
        ``"in-use"`` (another writer).
    path : str
    file_tier : str or None
        ``"v1"``, ``"v2"``, ``"v3"``, ``"kvq"`` or None when unknown.
    """

    def __init__(self, message, reason, path=None, file_tier=None):
        super().__init__(message)
        self.reason = reason
        self.path = path
        self.file_tier = file_tier

    @property
    def message(self):
        return str(self)


class CacheFileMismatch(CacheFileRefused):
    """The file is intact but was written under another tier, codec, bit width, seed, codebook,
    side-value kind or dtype, or holds more tokens than allowed."""


class CacheFileCorrupt(CacheFileRefused):
    """The file carries our magic but its header or both commit slots fail their checksums: it is
    refused rather than overwritten, so that nothing is lost without the caller's consent."""


class CacheFileInUse(CacheFileRefused):
    """Another writer has the cache file open for writing (it holds the file's lock): this cache
    writes nothing to it. Raised by ``append``/``save``/``truncate`` of a cache opened while the
    other writer held the lock (even if it has closed since: what this cache read may be out of
    date). Records in memory are kept; close the other writer and reopen, or open with
    ``readonly=True`` to read.

    Attributes
    ----------
    holder_pid : int or None
        The pid of the writer holding the lock when this cache was opened, when known.
    """

    def __init__(self, message, path=None, file_tier=None, holder_pid=None):
        super().__init__(message, "in-use", path, file_tier)
        self.holder_pid = holder_pid


class CacheFileSaveError(OSError):
    """Writing to disk failed. The committed records on disk are unchanged (``committed``) and
    the records in memory are kept: the next ``save()`` or ``append()`` retries."""

    def __init__(self, err, committed, what="save"):
        code = getattr(err, "errno", None) or errno.EIO
        text = getattr(err, "strerror", None) or str(err)
        if what == "truncate":
            msg = (f"could not persist the shorter prefix: {text} "
                   "(the file will be rewritten at the next save)")
        else:
            msg = f"save failed: {text} (will retry on the next save)"
        super().__init__(code, msg, getattr(err, "filename", None))
        self.committed = committed


@dataclass(frozen=True)
class LoadEvent:
    """One thing the loader did.

    ``kind`` is one of: ``new``, ``loaded``, ``ignored``, ``refused``, ``upgraded``,
    ``truncated`` (file shorter than its count), ``uncommitted-tail`` (bytes past the count),
    ``corrupt-block`` (our tier: checksum failure, cut there), ``commit-slot`` (our tier: the
    newest commit slot is damaged, the older one is used), ``count`` (a negative count),
    ``bad-side``, ``bad-code``, ``bad-token``, ``model-id`` (a model identity given but not
    checked: the file records none, or its tier cannot).
    """

    kind: str
    message: str
    detail: dict = field(default_factory=dict)


@dataclass
class LoadReport:
    """What opening a cache file found and did.

    Attributes
    ----------
    path : str
    status : str
        ``new`` (no file or an empty one), ``loaded``, ``upgraded`` (v1 quantized in memory),
        ``ignored`` (another model or version) or ``started-over`` (refused, but the caller chose
        ``on_mismatch="start_over"``). Except after ``loaded``, the file on disk is untouched
        until the first save, which rewrites it atomically.
    file_tier : str or None
        The tier found on disk.
    tier : str
        The tier this cache writes.
    header_count : int or None
        The committed count the file claimed.
    loaded : int
        Records loaded into memory.
    events : list of LoadEvent
    """

    path: str
    status: str = "new"
    file_tier: str | None = None
    tier: str = ""
    header_count: int | None = None
    loaded: int = 0
    events: list = field(default_factory=list)

    def add(self, kind, message, **detail):
        self.events.append(LoadEvent(kind, message, detail))

    @property
    def messages(self):
        return [e.message for e in self.events]

    def kinds(self):
        return [e.kind for e in self.events]

    def as_dict(self):
        return {"path": self.path, "status": self.status, "file_tier": self.file_tier,
                "tier": self.tier, "header_count": self.header_count, "loaded": self.loaded,
                "events": [{"kind": e.kind, "message": e.message, "detail": e.detail}
                           for e in self.events]}

    def __str__(self):
        return "\n".join(f"[kvfile] {m}" for m in self.messages) or f"[kvfile] {self.status}"
