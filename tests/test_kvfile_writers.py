"""One writer per cache file: the writer lock, per-writer temporary names, stale temporaries,
symlinked paths.

* In one process and across real processes (fork): a second writer is refused with
  CacheFileInUse naming the holder's pid; readers keep reading; 100 two-process trials lose no
  committed record (half of them creating the file, the old shared-temp-name race).
* Two processes replacing one file at once never share a temporary file.
* Only temporaries of this file whose writer is gone are removed.
* A symlinked path keeps its link: the target gets the new content.
"""
import glob
import multiprocessing
import os
import signal
import traceback

import numpy as np
import pytest

from kvquant.codecs import EncodedRows
from kvquant.kvfile import CacheFile, CacheFileInUse, CacheFileRefused, KVFileShape, Stream
from kvquant.kvfile import fileio

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

DIM, SLOTS = 8, 2
STREAMS = [Stream("K", DIM, SLOTS, "f32")]
SHAPE = KVFileShape(n_layers=2, kv_lora=32, qk_rope=8, vocab=1000)


def f32_rows(tokens):
    """Rows of an f32 stream as EncodedRows per slot, derived from the token ids (no kernel
    runs: safe in a forked child)."""
    tokens = np.asarray(tokens)
    X = (tokens[:, None, None] * 0.5 + np.arange(SLOTS * DIM).reshape(1, SLOTS, DIM)).astype(
        "<f4")
    return [EncodedRows(np.ascontiguousarray(X[:, j]).view(np.uint8),
                        np.zeros((len(tokens), 0), np.float32), "f32", DIM)
            for j in range(SLOTS)]


def append(cf, tokens):
    return cf.append(np.asarray(tokens), streams={"K": f32_rows(tokens)})


def tokens_on_disk(path):
    back = CacheFile.open(path, streams=STREAMS, vocab=1000, readonly=True)
    assert back.report.status in ("loaded", "new"), back.report.messages
    if len(back):
        want = np.stack([np.ascontiguousarray(e.codes) for e in f32_rows(back.records.tokens)],
                        axis=1)
        assert np.array_equal(back.records.codes("K"), want)   # rows belong to their tokens
    return back.records.tokens.tolist()


def leftovers(path):
    return sorted(glob.glob(f"{path}.kvq-*"))


# -- one process ----------------------------------------------------------------------------------
def test_a_second_writer_in_the_same_process_is_refused(tmp_path):
    path = str(tmp_path / "c.kvq")
    a = CacheFile.open(path, streams=STREAMS, vocab=1000)
    append(a, [1, 2, 3])
    before = open(path, "rb").read()
    b = CacheFile.open(path, streams=STREAMS, vocab=1000)
    assert len(b) == 3                      # it reads what a committed
    with pytest.raises(CacheFileInUse) as exc:
        append(b, [7, 8])
    assert exc.value.reason == "in-use" and exc.value.holder_pid == os.getpid()
    assert isinstance(exc.value, CacheFileRefused)
    assert "in use" in str(exc.value) and f"pid {os.getpid()}" in str(exc.value)
    assert "readonly=True" in str(exc.value)
    assert len(b) == 3 and open(path, "rb").read() == before     # nothing appended or written
    for write in (lambda: b.save(), lambda: b.truncate(1)):
        with pytest.raises(CacheFileInUse):
            write()
    # readers read while a writer holds the file
    assert tokens_on_disk(path) == [1, 2, 3]
    append(a, [4])
    assert tokens_on_disk(path) == [1, 2, 3, 4]
    # a has written since b read the file: even once a is closed, b is out of date
    a.close()
    with pytest.raises(CacheFileInUse) as exc:
        append(b, [7, 8])
    assert "after this cache read it" in str(exc.value)
    assert tokens_on_disk(path) == [1, 2, 3, 4]
    assert leftovers(path) == []            # the lock file went with its writer


def test_a_writer_opened_beside_an_idle_one_writes_once_it_is_gone(tmp_path):
    """``cf = CacheFile.open(p)`` twice in a row (the first still referenced while the second
    opens): the first wrote nothing after the second read the file, so the second may write."""
    path = str(tmp_path / "c.kvq")
    cf = CacheFile.open(path, streams=STREAMS, vocab=1000)
    append(cf, [1, 2])
    cf = CacheFile.open(path, streams=STREAMS, vocab=1000)   # the old one goes on rebinding
    append(cf, [3])
    assert tokens_on_disk(path) == [1, 2, 3]
    cf.close()
    with pytest.raises(ValueError, match="closed"):
        append(cf, [4])
    assert cf.records.tokens.tolist() == [1, 2, 3]            # still readable


def test_engine_tiers_take_the_lock_too(tmp_path):
    path = str(tmp_path / "c.coli_kv")
    g = np.random.default_rng(0)

    def rows(n):
        return {"L": g.standard_normal((n, 2, 32)), "R": g.standard_normal((n, 2, 8))}
    a = CacheFile.open(path, SHAPE, mode="f32")
    a.append([1, 2], **rows(2))
    b = CacheFile.open(path, SHAPE, mode="f32")
    with pytest.raises(CacheFileInUse):
        b.append([3], **rows(1))
    assert a.tier == b.tier == "v1"


def test_a_killed_writer_leaves_the_file_to_the_next(tmp_path):
    path = str(tmp_path / "c.kvq")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            cf = CacheFile.open(path, streams=STREAMS, vocab=1000)
            append(cf, [5, 6])
            os.write(w, b"x")
            signal.pause()
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 1) == b"x"     # (EOF, not a hang, if the child failed)
    later = CacheFile.open(path, streams=STREAMS, vocab=1000)
    with pytest.raises(CacheFileInUse) as exc:
        append(later, [7])
    assert exc.value.holder_pid == pid
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    cf = CacheFile.open(path, streams=STREAMS, vocab=1000)   # the kernel released the lock
    append(cf, [7])
    assert tokens_on_disk(path) == [5, 6, 7]


# -- two processes, 100 trials -----------------------------------------------------------------
def _writer(path, owner, tokens, barrier, opened, conn):
    try:
        barrier.wait(10)
        cf = CacheFile.open(path, streams=STREAMS, vocab=1000)
        if opened is not None:
            opened.wait(10)          # both have read the file before either writes
        told = []
        try:
            for k in range(0, len(tokens), 2):
                told.append(append(cf, tokens[k:k + 2]))
        except CacheFileInUse as exc:
            conn.send((owner, "refused", told, exc.holder_pid))
            return
        cf.close()
        conn.send((owner, "ok", told, None))
    except BaseException:
        conn.send((owner, "error", traceback.format_exc(), None))


def test_two_processes_on_one_file_lose_nothing_in_100_trials(tmp_path):
    ctx = multiprocessing.get_context("fork")
    stats = {"refused": 0, "both_ok": 0, "created": 0}
    for trial in range(100):
        path = str(tmp_path / f"t{trial}.kvq")
        initial = []
        if trial % 2 == 0:             # odd trials: both create the file (the temp-name race)
            initial = [1, 2, 3]
            cf = CacheFile.open(path, streams=STREAMS, vocab=1000)
            append(cf, initial)
            cf.close()
        mine = {1: [100 + i for i in range(6)], 2: [200 + i for i in range(6)]}
        barrier = ctx.Barrier(2)
        opened = ctx.Barrier(2) if trial % 4 < 2 else None
        pipes = {o: ctx.Pipe(duplex=False) for o in (1, 2)}
        procs = [ctx.Process(target=_writer, args=(path, o, mine[o], barrier, opened,
                                                   pipes[o][1])) for o in (1, 2)]
        for p in procs:
            p.start()
        got = {}
        for o in (1, 2):
            assert pipes[o][0].poll(60), f"writer {o} of trial {trial} did not answer"
            owner, status, told, holder = pipes[o][0].recv()
            assert status != "error", told
            got[owner] = (status, told, holder)
        for p in procs:
            p.join(60)
        on_disk = tokens_on_disk(path)
        winners = [o for o in (1, 2) if got[o][0] == "ok"]
        assert winners, got
        # every record a writer was told is committed is on disk, after what was there before
        orders = [initial + mine[winners[0]]] if len(winners) == 1 else [
            initial + mine[1] + mine[2], initial + mine[2] + mine[1]]
        assert on_disk in orders, (trial, got, on_disk)
        for o in (1, 2):
            status, told, holder = got[o]
            if status == "refused":
                assert told == []    # refused at its first write: it was told nothing
                assert holder in (procs[0].pid, procs[1].pid, None)
                stats["refused"] += 1
            else:
                assert told == [len(on_disk) - len(mine[o]) + k for k in (2, 4, 6)] or \
                    told == [len(initial) + k for k in (2, 4, 6)]
        if opened is not None:       # both read the file first: exactly one may write
            assert len(winners) == 1, got
        stats["both_ok"] += len(winners) == 2
        stats["created"] += not initial
        assert leftovers(path) == [], leftovers(path)
    print(f"\n[writers] {stats}")
    assert stats["refused"] >= 50     # the 50 trials with both files open refuse one each


# -- temporary names ------------------------------------------------------------------------------
def test_temp_names_are_per_writer_and_exclusive(tmp_path, monkeypatch):
    target = str(tmp_path / "c.kvq")
    names = {fileio.temp_path(target) for _ in range(50)}
    assert len(names) == 50 and all(f".kvq-tmp.{os.getpid()}." in n for n in names)
    # a name already taken is never written into (O_EXCL), whoever holds it
    monkeypatch.setattr(fileio.secrets, "token_hex", lambda n: "0badf00d")
    taken = fileio.temp_path(target)
    with open(taken, "wb") as f:
        f.write(b"another writer's temporary file")
    with pytest.raises(FileExistsError):
        fileio.write_new_file(target, [b"mine"])
    assert open(taken, "rb").read() == b"another writer's temporary file"
    assert not os.path.exists(target)


def test_two_processes_replacing_one_file_never_share_a_temp(tmp_path):
    """Without any lock, two processes each replace the file 30 times with their own content:
    the file is always exactly one of them, never a mix or a short file."""
    target = str(tmp_path / "c.kvq")
    contents = {o: bytes([o]) * (200_000 + o) for o in (1, 2)}
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)

    def run(o):
        barrier.wait(10)
        for _ in range(30):
            os.close(fileio.write_new_file(target, [contents[o][:100_000],
                                                    contents[o][100_000:]]))
        os._exit(0)
    procs = [ctx.Process(target=run, args=(o,)) for o in (1, 2)]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):   # a reader sees one whole content or none yet
        try:
            data = open(target, "rb").read()
        except FileNotFoundError:
            continue
        assert data in (contents[1], contents[2])
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert open(target, "rb").read() in (contents[1], contents[2])
    assert glob.glob(target + ".kvq-tmp*") == []


def test_only_temps_of_dead_writers_are_removed(tmp_path):
    path = str(tmp_path / "c.kvq")
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)             # a pid whose process is gone
    names = {
        "dead": f"c.kvq.kvq-tmp.{pid}.deadbeef",
        "mine": f"c.kvq.kvq-tmp.{os.getpid()}.0123abcd",
        "parent": f"c.kvq.kvq-tmp.{os.getppid()}.0123abcd",     # alive
        "legacy": "c.kvq.kvq-tmp",
        "not-hex": f"c.kvq.kvq-tmp.{pid}.notahexx",
        "other-file": f"d.kvq.kvq-tmp.{pid}.deadbeef",
        "cache": "c.kvq.bak",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    CacheFile.open(path, streams=STREAMS, vocab=1000, readonly=True)   # readers touch nothing
    assert all((tmp_path / n).exists() for n in names.values())
    cf = CacheFile.open(path, streams=STREAMS, vocab=1000)
    assert not (tmp_path / names["dead"]).exists()
    assert all((tmp_path / n).exists() for k, n in names.items() if k != "dead")
    cf.close()


# -- symlinks ------------------------------------------------------------------------------------
def test_a_symlinked_path_writes_through_to_its_target(tmp_path):
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "real.kvq"
    link = tmp_path / "chat.kvq"
    link.symlink_to(target)        # dangling: the first save creates the target
    cf = CacheFile.open(link, streams=STREAMS, vocab=1000)
    append(cf, [1, 2])             # a new file: a whole-file rewrite
    assert link.is_symlink() and os.readlink(link) == str(target) and target.is_file()
    assert tokens_on_disk(target) == [1, 2]
    cf.close()
    # a rewrite of an existing file through the link (a mismatch started over)
    other = [Stream("K", DIM, SLOTS, "kv8")]
    cf = CacheFile.open(link, streams=other, vocab=1000, on_mismatch="start_over")
    assert cf.report.status == "started-over"
    cf.append([9], streams={"K": np.ones((1, SLOTS, DIM), np.float32)})
    assert link.is_symlink() and os.readlink(link) == str(target)
    back = CacheFile.open(target, streams=other, vocab=1000, readonly=True)
    assert back.records.tokens.tolist() == [9]
    assert sorted(os.listdir(tmp_path)) == ["chat.kvq", "store"]
    cf.close()
    assert os.listdir(tmp_path / "store") == ["real.kvq"]
    # the link and its target are one file: one writer between them
    a = CacheFile.open(link, streams=other, vocab=1000)
    b = CacheFile.open(target, streams=other, vocab=1000)
    with pytest.raises(CacheFileInUse):
        b.append([3], streams={"K": np.ones((1, SLOTS, DIM), np.float32)})
    a.close()


def test_an_engine_upgrade_through_a_symlink_keeps_the_link(tmp_path):
    target = tmp_path / "real.coli_kv"
    link = tmp_path / "link.coli_kv"
    g = np.random.default_rng(1)
    cf = CacheFile.open(target, SHAPE, mode="f32")
    cf.append([1, 2, 3], L=g.standard_normal((3, 2, 32)), R=g.standard_normal((3, 2, 8)))
    cf.close()
    link.symlink_to(target)
    up = CacheFile.open(link, SHAPE, mode="kv8")     # v1 under kv8: rewritten at the first save
    assert up.report.status == "upgraded"
    up.save()
    up.close()
    assert link.is_symlink() and open(target, "rb").read(8) == b"COLIKV2\0"
    assert len(CacheFile.open(target, SHAPE, mode="kv8", readonly=True)) == 3


def test_a_symlink_planted_at_the_lock_path_is_never_followed(tmp_path):
    # the lock file is truncated and written by its holder: through a planted link that would
    # overwrite the link's target
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    path = str(tmp_path / "c.kvq")
    os.symlink(victim, path + ".kvq-lock")
    cf = CacheFile.open(path, streams=STREAMS, vocab=1000)
    with pytest.raises(OSError) as exc:
        append(cf, [1, 2])
    assert "symbolic link" in str(exc.value) and ".kvq-lock" in str(exc.value)
    assert victim.read_bytes() == b"precious\n"
    assert os.path.islink(path + ".kvq-lock")
    assert not os.path.exists(path)          # nothing written without the lock


def test_a_fifo_at_the_lock_path_is_refused_without_blocking(tmp_path):
    path = str(tmp_path / "c.kvq")
    os.mkfifo(path + ".kvq-lock")
    cf = CacheFile.open(path, streams=STREAMS, vocab=1000)
    with pytest.raises(OSError) as exc:
        append(cf, [1, 2])
    assert "not a regular file" in str(exc.value)
