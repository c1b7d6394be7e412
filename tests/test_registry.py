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


def test_split_spec_list():
    from kvquant.codecs import split_spec_list
    assert split_spec_list("polar5@center,sinks=1/polar4:alloc=level,seed=3@sinks=1,q8_0") == [
        "polar5@center,sinks=1/polar4:alloc=level,seed=3@sinks=1", "q8_0"]
    assert split_spec_list("tq4@sinks=2,center,kv8") == ["tq4@sinks=2,center", "kv8"]
    assert split_spec_list("kv8,tq3:codebook=gaussian,side=unbiased,tq4") == [
        "kv8", "tq3:codebook=gaussian,side=unbiased", "tq4"]
    with pytest.raises(ValueError, match="follows no spec"):
        split_spec_list("side=unbiased,tq4")


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
