"""The cache file under crashes, full disks and corrupted bytes.

* 200 SIGKILLs of a forked child that appends (and sometimes truncates) in a loop: every reopen
  yields exactly a prefix of what was written, at least what was committed.
* RLIMIT_FSIZE (a full disk) during append and during header creation: committed data stays
  readable, the retry completes.
* hypothesis: truncation, byte flips, extreme header words, lying counts, on valid files of
  every tier: a clean refusal (naming the file and a cause) or a valid prefix, never another
  exception, a hang or a huge allocation; ``kvquant inspect`` passes (exit 0) no file the loader
  refuses or loads only in part.
"""
import glob
import os
import random
import resource
import select
import signal
import struct
import time
import tracemalloc
import traceback
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _kvfile_data import deadline, records_equal
from kvquant.kvfile import (
    CacheFile, CacheFileRefused, CacheFileSaveError, KVFileShape, inspect_file)
from kvquant.kvfile.inspect import format_inspection
from kvquant.kvfile.schema import SIDE_MAX

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

CSHAPE = KVFileShape(n_layers=2, kv_lora=32, qk_rope=8, index_hd=4, n_index_layers=1,
                     vocab=1000)
CASES = {
    "v1": {"mode": "f32"},
    "v2": {"mode": "kv8"},
    "v3": {"mode": "tq4:compat=colibri"},
    "kvq": {"mode": {"L": "kv8", "R": "tq4:compat=colibri"}, "block_records": 4},
}


# -- deterministic record contents, no kernels (safe in a forked child) ----------------------------
def record_content(i, owner, codecs, streams):
    """Token and (codes, side) per stream of record ``i`` as written by run ``owner``."""
    g = np.random.default_rng([i, owner])
    token = int(g.integers(0, CSHAPE.vocab))
    out = {}
    for s in streams:
        c = codecs[s.name]
        if c.spec == "f32":
            codes = g.standard_normal((s.rows, s.dim)).astype("<f4").view(np.uint8)
        elif c.family == "kv8":  # no 0x7F/0xFF: the loader would zero them
            codes = (g.integers(0, 0x7F, (s.rows, c.code_bytes))
                     | (g.integers(0, 2, (s.rows, c.code_bytes)) << 7)).astype(np.uint8)
        else:
            codes = g.integers(0, 256, (s.rows, c.code_bytes)).astype(np.uint8)
        side = g.uniform(0.01, 10.0, (s.rows, c.n_side)).astype(np.float32)
        out[s.name] = (codes, side)
    return token, out


def batch(start, stop, owner, cf):
    tokens, per = [], {s.name: ([], []) for s in cf.streams}
    for i in range(start, stop):
        t, content = record_content(i, owner, cf.codecs, cf.streams)
        tokens.append(t)
        for name, (codes, side) in content.items():
            per[name][0].append(codes)
            per[name][1].append(side)
    streams = {}
    for s in cf.streams:
        c = cf.codecs[s.name]
        codes, side = np.stack(per[s.name][0]), np.stack(per[s.name][1])
        streams[s.name] = [c.encoded_rows(np.ascontiguousarray(codes[:, j]),
                                          np.ascontiguousarray(side[:, j]))
                           for j in range(s.rows)]
    return np.array(tokens, np.int32), streams


def flat(records, n):
    """Records as an (n, bytes) uint8 matrix (None when n == 0)."""
    if n == 0:
        return None
    parts = [np.ascontiguousarray(records.tokens[:n]).view(np.uint8).reshape(n, 4)]
    for name in records.stream_names:
        parts.append(np.ascontiguousarray(records.codes(name)[:n]).reshape(n, -1))
        parts.append(np.ascontiguousarray(records.side(name)[:n]).view(np.uint8).reshape(n, -1))
    return np.concatenate(parts, axis=1)


def flat_expected(owners, cf, cache):
    rows = []
    for i, owner in enumerate(owners):
        key = (i, owner)
        if key not in cache:
            t, content = record_content(i, owner, cf.codecs, cf.streams)
            parts = [np.array([t], "<i4").view(np.uint8)]
            for s in cf.streams:
                codes, side = content[s.name]
                parts += [codes.reshape(-1), side.view(np.uint8).reshape(-1)]
            cache[key] = np.concatenate(parts)
        rows.append(cache[key])
    return np.stack(rows) if rows else None


# -- 200 kills ------------------------------------------------------------------------------------
def _child(path, case, owner, wfd):
    def say(text):
        os.write(wfd, (text + "\n").encode())

    cf = CacheFile.open(path, CSHAPE, **case)
    n = len(cf)
    say(f"O {n}")
    pick = random.Random(owner)
    if n and pick.random() < 0.25:
        t = pick.randrange(n)
        say(f"T {t}")
        cf.truncate(t)
        say(f"t {t}")
        n = t
    for _ in range(100000):
        k = pick.randint(1, 6)
        tokens, streams = batch(n, n + k, owner, cf)
        say(f"A {n + k}")
        cf.append(tokens, streams=streams)
        say(f"C {n + k}")
        n += k


def _run_killed_child(path, case, owner, delay_s):
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        os.close(rfd)
        code = 0
        try:
            _child(path, case, owner, wfd)
        except BaseException:
            os.write(wfd, ("E " + traceback.format_exc().replace("\n", " | ") + "\n").encode())
            code = 3
        os._exit(code)
    os.close(wfd)
    buf = b""
    deadline = time.monotonic() + 20
    while b"\n" not in buf and time.monotonic() < deadline:  # wait for "O n" (or an error)
        ready, _, _ = select.select([rfd], [], [], 1.0)
        if ready:
            chunk = os.read(rfd, 4096)
            if not chunk:
                break
            buf += chunk
    time.sleep(delay_s)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    while True:
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        buf += chunk
    os.close(rfd)
    lines = buf.decode().splitlines()
    errors = [ln for ln in lines if ln.startswith("E ")]
    assert not errors, errors[0]
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    return [(ln[0], int(ln[2:])) for ln in lines]


def test_sigkill_during_appends_200_times(tmp_path):
    """200 kills (50 per tier) at random points of appends and truncates, one file per tier
    carried across its 50 runs: each reopen holds exactly the expected prefix."""
    rng = random.Random(1151)
    stats = {"kills": 0, "mid_append": 0, "truncates": 0, "records_checked": 0,
             "beyond_last_ack": 0}
    for tier, case in CASES.items():
        path = str(tmp_path / f"crash-{tier}")
        owners, cache = [], {}
        for run in range(50):
            owner = 1000 * (list(CASES).index(tier) + 1) + run
            msgs = _run_killed_child(path, case, owner, rng.uniform(0.0, 0.012))
            stats["kills"] += 1
            opened = [v for k, v in msgs if k == "O"]
            if opened:
                assert opened[0] == len(owners)
            base = owners
            trunc = [v for k, v in msgs if k == "T"]
            if trunc and any(k == "t" for k, _ in msgs):
                base = owners[:trunc[0]]
                stats["truncates"] += 1
            attempted = [v for k, v in msgs if k == "A"]
            acked = [v for k, v in msgs if k == "C"]
            cf = CacheFile.open(path, CSHAPE, readonly=True, **case)
            n = len(cf)
            assert cf.report.status in ("loaded", "new"), cf.report.messages
            assert cf.report.file_tier in (tier, None)
            if attempted:
                lo = acked[-1] if acked else len(base)
                hi = attempted[-1]
                assert lo <= n <= hi, (tier, run, lo, n, hi, msgs)
                stats["mid_append"] += len(attempted) != len(acked)
                stats["beyond_last_ack"] += n > lo
                new_owners = base + [owner] * (n - len(base))
            else:  # killed before or during the truncate: old count or the truncated one
                assert n == len(owners) or (trunc and n == trunc[0]), (n, msgs)
                new_owners = owners[:n]
            expected = flat_expected(new_owners, cf, cache)
            if n:
                assert np.array_equal(flat(cf.records, n), expected), (tier, run)
            stats["records_checked"] += n
            owners = new_owners
    print(f"\n[crash] {stats}")
    assert stats["kills"] == 200
    assert stats["mid_append"] >= 40, stats  # most kills land inside an append
    assert stats["truncates"] >= 10, stats


# -- full disk (RLIMIT_FSIZE) ---------------------------------------------------------------------
def _in_child(fn):
    """Run fn in a forked child with SIGXFSZ ignored (writes past the limit fail with EFBIG)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        code = 0
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            fn()
        except BaseException:
            os.write(wfd, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(wfd)
    out = b""
    while True:
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        out += chunk
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out.decode()


def _limit(nbytes):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    return hard


def _lift(hard):
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def _write_owned(path, case, n, owner, **kw):
    cf = CacheFile.open(path, CSHAPE, **case, **kw)
    tokens, streams = batch(len(cf), len(cf) + n, owner, cf)
    cf.append(tokens, streams=streams)
    cf.close()   # one writer at a time: the caller keeps the records, the next writer the file
    return cf


@pytest.mark.parametrize("tier", list(CASES))
def test_disk_full_during_append(tmp_path, tier):
    case = CASES[tier]
    path = str(tmp_path / "c")
    ref = _write_owned(path, case, 5, owner=1)
    size = os.path.getsize(path)

    def fail_then_maybe_retry(retry):
        def run():
            cf = CacheFile.open(path, CSHAPE, **case)
            tokens, streams = batch(5, 9, 2, cf)
            hard = _limit(size + 60)  # past the committed data, inside the first new record
            with pytest.raises(CacheFileSaveError) as exc:
                cf.append(tokens, streams=streams)
            assert exc.value.errno == 27 and "will retry" in str(exc.value)  # EFBIG
            assert cf.committed == 5 and cf.pending == 4
            assert os.path.getsize(path) > size  # part of a record did land on disk
            with pytest.raises(CacheFileSaveError):
                cf.save()  # still full
            if retry:
                _lift(hard)
                assert cf.save() == 9
        return run

    _in_child(fail_then_maybe_retry(retry=False))
    back = CacheFile.open(path, CSHAPE, **case, readonly=True)
    assert len(back) == 5 and records_equal(back.records, ref.records)
    assert "uncommitted-tail" in back.report.kinds()
    _in_child(fail_then_maybe_retry(retry=True))
    back = CacheFile.open(path, CSHAPE, **case)
    assert len(back) == 9 and back.report.kinds() == ["loaded"]
    assert records_equal(back.records, ref.records, 5)
    assert np.array_equal(back.records.tokens[5:], batch(5, 9, 2, back)[0])


@pytest.mark.parametrize("tier", list(CASES))
@pytest.mark.parametrize("limit", [0, 20, 41, 200])
def test_disk_full_during_header_creation_of_a_new_file(tmp_path, tier, limit):
    case = CASES[tier]
    path = str(tmp_path / "c")

    def run():
        cf = CacheFile.open(path, CSHAPE, **case)
        tokens, streams = batch(0, 3, 7, cf)
        hard = _limit(limit)
        with pytest.raises(CacheFileSaveError):
            cf.append(tokens, streams=streams)
        assert not os.path.exists(path) and not glob.glob(path + ".kvq-tmp*")
        _lift(hard)
        assert cf.save() == 3

    _in_child(run)
    back = CacheFile.open(path, CSHAPE, **case)
    assert len(back) == 3 and back.report.file_tier == tier


REWRITES = [  # (written under, opened under, how the old file is replaced)
    ("f32", "kv8", "upgraded"),
    ("f32", {"L": "kv8", "R": "tq4:compat=colibri"}, "upgraded"),
    ("kv8", "f32", "started-over"),
    ({"L": "kv8", "R": "tq4:compat=colibri"}, "tq4:compat=colibri", "started-over"),
]


@pytest.mark.parametrize("written, opened, status", REWRITES,
                         ids=["v1-upgrade-to-v2", "v1-upgrade-to-kvq", "v2-refused-start-over",
                              "kvq-refused-start-over"])
@pytest.mark.parametrize("limit", [0, 30, 39, 100])
def test_disk_full_during_rewrite_keeps_old_file(tmp_path, written, opened, status, limit):
    """The first save after an upgrade or a start-over writes a whole new file; the disk is full
    inside its header: the old file stays whole and readable, the retry completes."""
    path = str(tmp_path / "c")
    ref = _write_owned(path, {"mode": written}, 6, owner=3)
    old = open(path, "rb").read()

    def run(retry):
        def go():
            cf = CacheFile.open(path, CSHAPE, mode=opened, on_mismatch="start_over",
                                n_threads=1)
            assert cf.report.status == status
            tokens, streams = batch(len(cf), len(cf) + 2, 4, cf)
            hard = _limit(limit)
            with pytest.raises(CacheFileSaveError):
                cf.append(tokens, streams=streams)
            assert open(path, "rb").read() == old
            assert not glob.glob(path + ".kvq-tmp*")
            _lift(hard)
            if retry:
                cf.save()
        return go

    _in_child(run(retry=False))
    assert open(path, "rb").read() == old
    back = CacheFile.open(path, CSHAPE, mode=written, readonly=True)
    assert records_equal(back.records, ref.records) and len(back) == 6
    _in_child(run(retry=True))
    back = CacheFile.open(path, CSHAPE, mode=opened)
    assert back.report.status == "loaded"
    assert len(back) == (8 if status == "upgraded" else 2)


# -- fuzzing ------------------------------------------------------------------------------------
FUZZ_CASES = {
    "v1": {"mode": "f32"},
    "v2": {"mode": "kv8"},
    "v3": {"mode": "tq4:compat=colibri"},
    "kvq": {"mode": "tq3", "block_records": 3},
    # version 2: a stream-state area (offsets, scales, two float32 sink rows) before the data
    "kvq-options": {"mode": "tq3@center,normalize,sinks=2", "block_records": 3},
    # and two window slots (float32 copies of the last 3 rows)
    "kvq-window": {"mode": "tq3@center,sinks=1,recent=3", "block_records": 3},
}
FUZZ_RECORDS = 8
EXTREMES = st.one_of(
    st.sampled_from([0, 1, -1, 2, 7, 256, 2**16, 2**31 - 1, -2**31, 2**30 + 1]),
    st.integers(-2**31, 2**31 - 1))
MUTATION = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
    st.tuples(st.just("word"), st.integers(0, 7), EXTREMES),
    st.tuples(st.just("count"), st.integers(0, 2**31 - 1)),
)


_FUZZ_FILES = {}


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _valid_file(fuzz_dir, tier):
    """A valid file of the tier with 8 records in two appends (kvq: slots at counts 5 and 8)."""
    if tier not in _FUZZ_FILES:
        path = str(fuzz_dir / f"valid-{tier}")
        if tier.startswith("kvq-"):   # float rows: the stream options transform them
            g = np.random.default_rng(11)
            cf = CacheFile.open(path, CSHAPE, **FUZZ_CASES[tier])
            for a, b in ((0, 1), (1, 5), (5, FUZZ_RECORDS)):
                n = b - a
                cf.append(g.integers(0, CSHAPE.vocab, n),
                          L=g.standard_normal((n, CSHAPE.n_layers, CSHAPE.kv_lora)) + 2.0,
                          R=g.standard_normal((n, CSHAPE.n_layers, CSHAPE.qk_rope)),
                          index=g.standard_normal((n, 1, CSHAPE.index_hd)))
        else:
            cf = CacheFile.open(path, CSHAPE, **FUZZ_CASES[tier])
            for a, b in ((0, 5), (5, FUZZ_RECORDS)):
                tokens, streams = batch(a, b, 11, cf)
                cf.append(tokens, streams=streams)
        assert cf.tier == _file_tier(tier) and cf.committed == FUZZ_RECORDS
        _FUZZ_FILES[tier] = (open(path, "rb").read(), cf.records, cf._layout,
                             str(fuzz_dir / f"fuzz-{tier}"))
    return _FUZZ_FILES[tier]


def _file_tier(case):
    return "kvq" if case.startswith("kvq") else case


def _mutate(data, tier, layout, mutations):
    """Apply mutations; return the bytes and the byte positions that were changed."""
    b = bytearray(data)
    touched = set()
    for m in mutations:
        if m[0] == "cut":
            del b[int(m[1] * len(b)):]
        elif m[0] == "flip" and b:
            pos = int(m[1] * len(b))
            b[pos] ^= m[2]
            touched.add(pos)
        elif m[0] == "word":
            i, value = m[1], m[2]
            if tier == "kvq":  # prefix fields raw (i < 4) or forged with a valid CRC (i >= 4)
                off = 8 + 4 * (i % 4)
                if off + 4 <= len(b):
                    struct.pack_into("<I", b, off, value & 0xFFFFFFFF)
                    if i >= 4 and len(b) >= 24:
                        struct.pack_into("<I", b, 20, zlib.crc32(bytes(b[:20])))
                    touched.update(range(off, off + 4))
            elif 8 + 4 * i + 4 <= len(b):
                struct.pack_into("<i", b, 8 + 4 * i, value)
                touched.update(range(8 + 4 * i, 12 + 4 * i))
        elif m[0] == "count":
            if tier == "kvq":  # forge a valid newest commit slot that lies about the count
                if len(b) >= 72:
                    struct.pack_into("<QQII", b, 24, m[1], 2**40, 0, 0)
                    body = bytes(b[24:44])
                    struct.pack_into("<I", b, 44, zlib.crc32(body, layout.header_crc))
                    touched.update(range(24, 48))
            elif len(b) >= 40:
                struct.pack_into("<i", b, 32, m[1])
                touched.update(range(32, 36))
    return bytes(b), touched


FUZZ_STATS = {}


@pytest.mark.parametrize("tier", list(FUZZ_CASES))
@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
def test_fuzz_corruption(fuzz_dir, tier, mutations):
    data, original, layout, path = _valid_file(fuzz_dir, tier)
    mutated, touched = _mutate(data, _file_tier(tier), layout, mutations)
    with open(path, "wb") as f:
        f.write(mutated)
    case = FUZZ_CASES[tier]
    stats = FUZZ_STATS.setdefault(tier, {"examples": 0, "refused": 0, "prefix": 0,
                                         "full": 0, "ignored": 0, "other": 0})
    stats["examples"] += 1
    tracemalloc.start()
    try:
        with deadline(10):
            info = inspect_file(path)  # never raises on a readable file, whatever its bytes
            format_inspection(info)
            inspect_ok = info["supported"] and not info.get("problem")   # its exit status 0
            try:
                cf = CacheFile.open(path, CSHAPE, readonly=True, **case)
            except CacheFileRefused as exc:   # a named error: it names the file and a cause
                assert path in str(exc) and exc.path == path and exc.reason, exc
                assert not inspect_ok, ("inspect passes a file the loader refuses", exc)
                stats["refused"] += 1
                return
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated for a {len(mutated)}-byte file"
    n = len(cf)
    status = cf.report.status
    assert status in ("loaded", "ignored", "new", "upgraded"), status
    if status in ("ignored", "new"):
        stats["ignored"] += 1
        assert n == 0
        return
    if status == "upgraded":  # a flipped magic byte turned v2/v3 into v1 (no checksum there)
        assert _file_tier(tier) != "kvq" and any(p < 8 for p in touched)
        stats["other"] += 1
        return
    assert cf.report.file_tier == _file_tier(tier) and n <= FUZZ_RECORDS
    if _file_tier(tier) == "kvq":
        # Checksums: never a garbled record, only an exact prefix.
        assert records_equal(cf.records, original, n)
        for name in cf.records.stream_names:   # and the stream state of that prefix
            got, want = cf.records, original
            assert np.array_equal(got.sink_rows(name), want.sink_rows(name)[:n])
            for read in (lambda r: r.offset(name), lambda r: r.channel_scale(name)):
                assert (read(got) is None if n == 0 or read(want) is None
                        else np.array_equal(read(got), read(want)))
            if n == FUZZ_RECORDS:   # the window too
                assert np.array_equal(got.decode(name), want.decode(name))
    else:
        rec, start = layout.record_bytes, 40
        bad = {(p - start) // rec for p in touched if p >= start}
        good = [i for i in range(n) if i not in bad]
        if n:
            got, want = flat(cf.records, n), flat(original, FUZZ_RECORDS)
            assert np.array_equal(got[good], want[good])
        for name in cf.records.stream_names:  # whatever was flipped, no side value out of range
            side = cf.records.side(name)
            assert np.all(np.isfinite(side)) and np.all(side >= 0) and np.all(side < SIDE_MAX)
        assert np.all(cf.records.tokens >= 0) and np.all(cf.records.tokens < CSHAPE.vocab)
    if status == "loaded" and inspect_ok:   # inspect passes only what loads whole
        assert n == cf.report.header_count, (n, cf.report.messages)
    stats["full" if n == FUZZ_RECORDS else "prefix"] += 1


def test_fuzz_summary():
    """Prints what the fuzzing saw (run with -s); checks that refusals and prefixes occurred."""
    if not FUZZ_STATS:
        pytest.skip("fuzz tests did not run in this session")
    print(f"\n[fuzz] {FUZZ_STATS}")
    for tier, s in FUZZ_STATS.items():
        assert s["refused"] + s["ignored"] > 0 and s["prefix"] > 0, (tier, s)
