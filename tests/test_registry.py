"""The codec registry: specs, canonical names, options."""
import pytest

from kvquant import get_codec, parse_spec

SPECS = ["f32", "kv8", "kv8-g32", "kv8-g4", "tq1", "tq4", "tq8", "tq4:compat=colibri",
         "tq3:codebook=gaussian", "tq2:side=unbiased", "tq4:seed=0x2a", "tq4:side_dtype=f16",
         "tq3:side=unbiased,side_dtype=f16", "polar4:side_dtype=f16",
         "polar5:alloc=level,side_dtype=f16"]


@pytest.mark.parametrize("spec", SPECS)
def test_canonical_spec_reparses_to_the_same_codec(spec):
    codec = get_codec(spec, 128)
    again = get_codec(codec.spec, 128)
    assert again.spec == codec.spec == spec
    assert again.bytes_per_row == codec.bytes_per_row


def test_keyword_options_merge_with_spec():
    assert get_codec("tq4", 64, side="unbiased").spec == "tq4:side=unbiased"
    with pytest.raises(ValueError, match="side"):
        get_codec("tq4:side=norm", 64, side="unbiased")


def test_parse_spec():
    assert parse_spec("tq4:seed=0x10,side=unbiased") == ("tq4", {"seed": 16, "side": "unbiased"})
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("tq4:seed")
    with pytest.raises(ValueError, match="integer"):
        parse_spec("tq4:seed=abc")


@pytest.mark.parametrize("spec", ["", "tq", "kv9", "foo", "kv8-gx"])
def test_unknown_specs(spec):
    with pytest.raises(ValueError):
        get_codec(spec, 64)


def test_unknown_option():
    with pytest.raises(ValueError, match="unknown option"):
        get_codec("kv8:colour=red", 64)


@pytest.mark.parametrize("group", [3, 0, 48])
def test_kv8_group_must_divide(group):
    with pytest.raises(ValueError, match="divisor"):
        get_codec(f"kv8-g{group}", 32)


def test_sizes():
    assert get_codec("f32", 512).bytes_per_row == 2048
    assert get_codec("kv8", 512).bytes_per_row == 516
    assert get_codec("kv8-g32", 512).bytes_per_row == 512 + 64
    assert get_codec("tq4", 512).compression_ratio == pytest.approx(2048 / 260)
    assert get_codec("tq4:side_dtype=f16", 512).bytes_per_row == 256 + 2


def test_split_spec_text():
    from kvquant.specs import split_spec_text
    assert split_spec_text("polar5@center,sinks=1/polar4:alloc=level,seed=3@sinks=1,q8_0") == [
        "polar5@center,sinks=1/polar4:alloc=level,seed=3@sinks=1", "q8_0"]
    assert split_spec_text("tq4@sinks=2,center,kv8") == ["tq4@sinks=2,center", "kv8"]
    assert split_spec_text("kv8,tq3:codebook=gaussian,side=unbiased,tq4") == [
        "kv8", "tq3:codebook=gaussian,side=unbiased", "tq4"]
    with pytest.raises(ValueError, match="follows no spec"):
        split_spec_text("side=unbiased,tq4")


@pytest.mark.parametrize("spec", ["f32", "kv8", "tq4", "polar4", "q4_0"])
def test_inert_rows_are_zero_for_every_codec(spec):
    import numpy as np
    X = np.ones((3, 64), np.float32)
    X[1, 3] = np.inf
    codec = get_codec(spec, 64, nonfinite="inert")
    out = codec.decode(codec.encode(X))
    assert np.all(out[1] == 0) and np.all(np.isfinite(out))
    with pytest.raises(ValueError, match="rows 1"):
        get_codec(spec, 64).encode(X)


def test_encoded_rows_index_like_numpy():
    import numpy as np
    codec = get_codec("tq4", 64)
    enc = codec.encode(np.random.default_rng(0).standard_normal((64, 64)))
    assert enc[-1].n_rows == 1 and np.array_equal(enc[-1].codes, enc.codes[63:64])
    assert np.array_equal(enc[5].codes, enc.codes[5:6]) and np.array_equal(enc[-64].side, enc.side[:1])
    for bad in (64, 100, -65):
        with pytest.raises(IndexError, match=f"row index {bad} is out of range for 64"):
            enc[bad]
    assert enc[60:100].n_rows == 4 and enc[::-2].n_rows == 32
    assert np.array_equal(enc[[3, -1]].codes, enc.codes[[3, 63]])
    mask = np.zeros(64, bool)
    mask[[1, 2]] = True
    assert enc[mask].n_rows == 2
    with pytest.raises(IndexError):
        enc[[64]]


def test_width_messages_state_the_real_rule():
    from kvquant.codecs import WIDTH_RULE
    with pytest.raises(ValueError, match=r"width.*got 48; use kv8 for width 48$"):
        get_codec("tq4", 48)
    with pytest.raises(ValueError, match=r"use kv8 for width 48$"):
        get_codec("polar4", 48)
    # 96 = 3 x 32 suits q8_0 / q4_0, not the rotated codecs
    with pytest.raises(ValueError, match=r"use kv8 \(or q8_0/q4_0\) for width 96"):
        get_codec("tq4", 96)
    get_codec("q8_0", 96)
    assert "q8_0/q4_0 a multiple of 32" in WIDTH_RULE and "power-of-two" in WIDTH_RULE


def test_distortion_all_states_the_width_rule(capsys):
    from kvquant.cli import main
    assert main(["distortion", "--codecs", "all", "--dim", "96", "--rows", "8"]) == 0
    err = capsys.readouterr().err
    assert "width 96 does not suit tq1" in err and "q8_0/q4_0 a multiple of 32" in err
    assert "q8_0," not in err.split("does not suit")[1].split("(")[0]   # q8_0 takes 96


def test_kv8_inert_message_states_the_engines_rule():
    import numpy as np
    X = np.ones((2, 64), np.float32)
    X[1, 3] = np.nan
    with pytest.raises(ValueError, match="a NaN element becomes 0 and the rest of its row stays live"):
        get_codec("kv8", 64).encode(X)
    out = get_codec("kv8", 64, nonfinite="inert").roundtrip(X)
    assert out[1, 3] == 0 and np.all(out[1, np.arange(64) != 3] == 1)   # the rest stays live


def test_bad_simd_environment_fails_the_import_by_name():
    import os
    import subprocess
    import sys
    env = dict(os.environ, KVQUANT_SIMD="sse9")
    res = subprocess.run([sys.executable, "-c", "import kvquant"], env=env, capture_output=True,
                         text=True)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert "KVQUANT_SIMD='sse9' is not valid" in last
    assert "auto, portable, avx2, avx512 or avx512vbmi" in last
