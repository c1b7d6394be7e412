"""The defensive GGUF reader: the same metadata and tensors as the gguf package's own reader on a
good file, and on a damaged one a GGUFFileError naming the file, never a traceback, a hang or an
allocation beyond the file's size."""
import struct
import time
import tracemalloc

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvquant.models.gguf_file import GGUFFile, GGUFFileError  # noqa: E402

TOKENS = ["<s>", "</s>", "a", "b", "ab", "héllo"]


def write_small(path, extra=None):
    """A small file with every kind of value and three tensors (f32 vector, f16 and q8_0
    matrices)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 1, 1, 1, 1])
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("blk.0.attn_k.weight", rng.standard_normal((8, 64)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_v.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small(tmp_path):
    return write_small(tmp_path / "small.gguf")


def test_reads_what_the_gguf_package_reads(small):
    ours, ref = GGUFFile(str(small)), gguf.GGUFReader(str(small))
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # its header
    assert set(ours.metadata) == set(fields)
    for key, field in fields.items():
        want = field.contents()
        if isinstance(want, float) or (isinstance(want, list) and want
                                       and isinstance(want[0], float)):
            assert np.allclose(ours.metadata[key], want), key
        else:
            assert ours.metadata[key] == want, key
    assert ours.metadata["tokenizer.ggml.tokens"] == TOKENS
    assert ours.data_offset == ref.data_offset
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(t.shape.tolist())
        assert mine.n_elements == t.n_elements and mine.offset == t.data_offset
        assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data)


def _at(blob, needle):
    i = bytes(blob).index(needle.encode())
    return i + len(needle)


def _damaged(src, dst, change):
    blob = bytearray(src.read_bytes())
    change(blob)
    dst.write_bytes(bytes(blob))
    return str(dst)


def _refused(path, match):
    with pytest.raises(GGUFFileError, match=match) as exc:
        GGUFFile(path)
    assert path in str(exc.value)


def test_an_array_claiming_2_40_items_is_refused_at_once(small, tmp_path):
    def claim(blob):
        at = _at(blob, "tokenizer.ggml.token_type") + 8     # past value type and item type
        blob[at:at + 8] = struct.pack("<Q", 1 << 40)
    t0 = time.perf_counter()
    _refused(_damaged(small, tmp_path / "d.gguf", claim), "array of 1099511627776 items")
    assert time.perf_counter() - t0 < 5


def _tensor_offset_at(blob, name):
    at = _at(blob, name)
    n_dims = struct.unpack_from("<I", blob, at)[0]
    return at + 4 + 8 * n_dims + 4


@pytest.mark.parametrize("shift, match", [(4, "not a multiple of the alignment"),
                                          (32, "overlap|past the end"),
                                          (2 ** 64 - 1 - 0, "not a multiple|past the end")])
def test_a_moved_tensor_is_refused(small, tmp_path, shift, match):
    def move(blob):
        at = _tensor_offset_at(blob, "blk.0.attn_norm.weight")
        rel = struct.unpack_from("<Q", blob, at)[0]
        blob[at:at + 8] = struct.pack("<Q", (rel + shift) % 2 ** 64)
    _refused(_damaged(small, tmp_path / "d.gguf", move), match)


def test_named_errors_for_structural_damage(small, tmp_path):
    two = write_small(tmp_path / "two.gguf", extra={"test.aa": "x", "test.bb": "y"})

    def dup_key(blob):
        at = bytes(blob).index(b"test.bb")
        blob[at:at + 7] = b"test.aa"
    _refused(_damaged(two, tmp_path / "a.gguf", dup_key), "'test.aa' appears twice")

    def bad_type(blob):
        at = _tensor_offset_at(blob, "blk.0.attn_v.weight") - 4
        blob[at:at + 4] = struct.pack("<I", 999)
    _refused(_damaged(small, tmp_path / "b.gguf", bad_type), "unknown ggml type 999")

    def int_tensor(blob):
        at = _tensor_offset_at(blob, "blk.0.attn_norm.weight") - 4
        blob[at:at + 4] = struct.pack("<I", int(gguf.GGMLQuantizationType.I32))
    _refused(_damaged(small, tmp_path / "c.gguf", int_tensor), "type I32")

    def five_dims(blob):
        at = _at(blob, "blk.0.attn_norm.weight")
        blob[at:at + 4] = struct.pack("<I", 5)
    _refused(_damaged(small, tmp_path / "d.gguf", five_dims), "5 dimensions")

    def big_endian(blob):
        blob[4:8] = struct.pack(">I", 3)
    _refused(_damaged(small, tmp_path / "e.gguf", big_endian), "big-endian")

    def not_gguf(blob):
        blob[0:4] = b"GGML"
    _refused(_damaged(small, tmp_path / "f.gguf", not_gguf), "not a GGUF file")

    def bad_utf8(blob):
        at = bytes(blob).index("héllo".encode())
        blob[at + 1] = 0xFF
    _refused(_damaged(small, tmp_path / "g.gguf", bad_utf8), "not valid UTF-8")


def test_every_truncation_is_a_named_error(small, tmp_path):
    blob = small.read_bytes()
    # the padding after the last tensor may go: everything before its end may not
    end = max(t.offset + t.data.nbytes for t in GGUFFile(str(small)).tensors.values())
    dst = tmp_path / "t.gguf"
    for n in list(range(0, 200, 7)) + list(range(200, end, 97)) + [end - 1]:
        dst.write_bytes(blob[:n])
        with pytest.raises(GGUFFileError):
            GGUFFile(str(dst))


COUNT_VALUES = [0, 1, 2, 2 ** 31, 2 ** 32 - 1, 2 ** 63, 2 ** 64 - 1]


def test_seeded_mutations_give_a_named_error_or_a_load_never_more(small, tmp_path):
    """Byte flips and 8-byte count/length fields set to extreme values, 400 variants: each loads
    or raises GGUFFileError, within a second and within a few times the file's size in memory."""
    blob = small.read_bytes()
    rng = np.random.default_rng(34)
    dst = tmp_path / "m.gguf"
    header_end = GGUFFile(str(small)).data_offset     # damage where the structure lives
    outcomes = {"loaded": 0, "refused": 0}
    tracemalloc.start()
    try:
        for trial in range(400):
            b = bytearray(blob)
            if trial % 2:
                for _ in range(int(rng.integers(1, 4))):
                    b[int(rng.integers(0, header_end))] ^= 1 << int(rng.integers(0, 8))
            else:
                at = int(rng.integers(4, header_end - 8))
                b[at:at + 8] = struct.pack("<Q", COUNT_VALUES[trial // 2 % len(COUNT_VALUES)])
            dst.write_bytes(bytes(b))
            tracemalloc.reset_peak()
            t0 = time.perf_counter()
            try:
                GGUFFile(str(dst))
                outcomes["loaded"] += 1
            except GGUFFileError as exc:
                assert str(dst) in str(exc)
                outcomes["refused"] += 1
            assert time.perf_counter() - t0 < 1.0, trial
            assert tracemalloc.get_traced_memory()[1] < 20 * len(blob) + (1 << 20), trial
    finally:
        tracemalloc.stop()
    assert outcomes["refused"] > 100          # the mutations reach the structure
