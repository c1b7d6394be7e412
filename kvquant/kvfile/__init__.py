"""The cache file: the engine's ``.coli_kv`` tiers and a self-describing tier of our own.

A cache written under one mode is never read as another.

Tiers
-----
``v1`` / ``v2`` / ``v3``
    The engine's ``.coli_kv`` (docs/reference.md §1.7), byte for byte: f32, fp8 (``kv8``), rotated
    codecs (a codec whose ``engine_tag`` is set: ``tq4:compat=colibri`` = 0x104, polar b bits
    = b). MLA models only (streams L, R and f32 indexer rows). No checksums: see
    :mod:`kvquant.kvfile.engine`.
``kvq``
    Ours (:mod:`kvquant.kvfile.kvq`): any streams and codecs, a checksummed JSON header that
    records what the engine's header forgets (codec spec, rotation seed, sign hash and
    ordering, codebook identity and checksum, side-value kind, row widths), CRC32 per block of
    records, two checksummed commit slots. Stream specs with stream options
    (``Stream("K", 64, rows, "polar5@center,sinks=1")``) store their offset, scales and float32
    sink rows too; read such a stream with ``records.decode`` or ``records.row_stream``.

Opening under a mode
--------------------
* no file, or an empty one: start empty; the first save creates it.
* a file of another model shape (or another engine version, or a torn engine header): ignored
  with a message; start empty.
* another tier, codec, bit width, seed, codebook, side kind or stream options: refused,
  :class:`CacheFileMismatch` with ``.reason`` (or, with ``on_mismatch="start_over"``, start
  empty with the reason in the report). A kvq file whose header fails its checksum:
  :class:`CacheFileCorrupt`, likewise.
* a kvq file recording another model identity (``model_id=``), or one when the cache gives
  none: refused, :class:`CacheFileMismatch` (reason ``"model"``). The engine's tiers record the
  model's shape only, never its identity: there ``model_id`` is neither recorded nor checked.
* a path that is not a regular file (a FIFO, a directory, a device): refused at once, without
  blocking, whatever ``on_mismatch`` says (reason ``"not-a-file"``).
* a v1 file under a quantized mode: quantized in memory, rewritten at the first save.
* a file shorter than its count: cut to its last complete record (kvq: last intact block);
  a kvq block failing its CRC: cut before it; bad side values: the row made inert; token ids
  outside the vocabulary: cut before them. All reported in ``CacheFile.report``.

In every case but a plain load, the old file is not touched before the first save, which writes
a temporary file of its own (pid and a random suffix in its name) and renames it over the old
one; a symlinked path keeps its link and the link's target is replaced. Appends commit by count:
the records are written and fsynced, then the count (kvq: a commit slot), then fsync.

One writer per file: a writer holds an advisory lock (:mod:`kvquant.kvfile.lock`) from ``open``
to ``close()``; another writer is refused at its first write with :class:`CacheFileInUse`
(naming the holder's pid). Readers (``readonly=True``, ``kvquant inspect``) take no lock.

Examples
--------
>>> shape = KVFileShape(n_layers=5, kv_lora=32, qk_rope=8, vocab=256)   # doctest: +SKIP
>>> cf = CacheFile.open("chat.coli_kv", shape, mode="kv8")              # doctest: +SKIP
>>> cf.append([3, 14], L=Lrows, R=Rrows)  # doctest: +SKIP
>>> cf.records.L[0]  # doctest: +SKIP
"""
from kvquant.kvfile.errors import (
    CacheFileCorrupt, CacheFileInUse, CacheFileMismatch, CacheFileRefused, CacheFileSaveError,
    LoadEvent, LoadReport)
from kvquant.kvfile.identity import codec_identity
from kvquant.kvfile.modelid import model_digest
from kvquant.kvfile.records import CacheRecords
from kvquant.kvfile.schema import KVFileShape, Stream
from kvquant.kvfile.cachefile import ON_MISMATCH, TIERS, CacheFile
from kvquant.kvfile.engine import describe_tier, spec_of_tag, tier_of_tag
from kvquant.kvfile.inspect import add_cli, format_inspection, inspect_file

__all__ = [
    "CacheFile", "CacheFileCorrupt", "CacheFileInUse", "CacheFileMismatch", "CacheFileRefused",
    "CacheFileSaveError", "CacheRecords", "KVFileShape", "LoadEvent", "LoadReport", "Stream",
    "ON_MISMATCH", "TIERS", "add_cli", "codec_identity", "describe_tier", "format_inspection",
    "inspect_file", "model_digest", "spec_of_tag", "tier_of_tag",
]
