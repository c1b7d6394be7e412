"""The one cache-spec parser (kvquant.specs): every kind parsed once into an object that says what
it is, pickles, and builds its cache; plug-in kinds registered like codecs."""
import pickle
from dataclasses import dataclass
from importlib.metadata import entry_points

import numpy as np
import pytest

from kvquant.cache import QuantizedKVCache
from kvquant.ggml_attention import GGMLAttentionCache, GGMLPair
from kvquant.models.plan import CachePlan
from kvquant.specs import (CacheSpec, KVLayout, PairSpec, SpecKind, StreamListSpec,
                           parse_cache_spec, parse_cache_specs, register_spec_kind,
                           unregister_spec_kind)
from kvquant.streams.spec import StreamSpec

LAYOUT = KVLayout(n_layers=2, n_kv_heads=3, head_dim=64)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "p.json"
    CachePlan.uniform("polar4@center/tq3", 2, 3).with_unit(1, "k", "kv8").save(str(path))
    return str(path)


@pytest.mark.parametrize("text, cls, canonical", [
    ("tq4", PairSpec, "tq4"),
    (" tq4/tq4 ", PairSpec, "tq4"),
    ("kv8/tq4@sinks=1", PairSpec, "kv8/tq4@sinks=1"),
    ("polar5@sinks=1,center/polar4", PairSpec, "polar5@center,sinks=1/polar4"),
    ("ggml:q8_0", GGMLPair, "ggml:q8_0/q8_0"),
    ("ggml-norot:q4_0/q8_0", GGMLPair, "ggml-norot:q4_0/q8_0"),
])
def test_each_kind_parses_to_an_object_whose_text_parses_back(text, cls, canonical):
    spec = parse_cache_spec(text)
    assert type(spec) is cls and spec.text == str(spec) == canonical
    assert parse_cache_spec(spec.text) == spec and parse_cache_spec(spec) is spec
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_a_plan_file_is_the_plan_kind(plan_file):
    spec = parse_cache_spec(plan_file)
    assert isinstance(spec, CachePlan) and spec.text == plan_file and spec.family == "cache plan"
    assert pickle.loads(pickle.dumps(spec)) == spec
    cache = spec.new_kv_cache(LAYOUT)
    assert cache.codec(1, "k").spec == "kv8" and cache.codec(0, "k").spec == "polar4"


@pytest.mark.parametrize("text, family", [
    ("tq4", "tq"), ("tq3:codebook=gaussian", "tq gaussian"), ("tq4:compat=colibri", "tq colibri"),
    ("tq4:side=unbiased", "tq unbiased"), ("polar4", "polar"), ("kv8-g32", "kv8"),
    ("q4_0+rot", "q4_0+rot"), ("tq4/tq3", "K/V split"), ("polar5@center/polar4", "stream options"),
    ("tq4@recent=16", "recent window"), ("ggml:q8_0", "llama.cpp as run"),
])
def test_families_come_from_what_the_codecs_declare(text, family):
    assert parse_cache_spec(text).family == family


def test_a_pair_builds_the_cache_of_its_streams_and_counts_its_bytes(rng):
    spec = parse_cache_spec("polar5@center,sinks=1/kv8")
    cache = spec.new_kv_cache(LAYOUT)
    assert isinstance(cache, QuantizedKVCache)
    assert cache.stream(0, "k", 0).spec == "polar5@center,sinks=1"
    assert cache.codec(1, "v").spec == "kv8"
    K = rng.standard_normal((10, 3, 64)).astype(np.float32)
    for layer in range(2):
        cache.append(layer, k=K, v=K)
    # bits per value at 10 tokens: every byte the cache holds, spread over its rows
    assert spec.bits_per_value(64, tokens=10) == pytest.approx(
        8.0 * cache.nbytes / (10 * 2 * 64 * 2 * 3), rel=1e-12)
    # per further row: polar5 at d = 64 is 32 angles x 5 bits + 31 x 4 bits + a 4-byte radius
    # (docs/codecs.md), kv8 64 bytes + a 4-byte scale
    polar5 = -(-(32 * 5 + 31 * 4) // 8) + 4
    assert spec.bits_per_value(64) == pytest.approx(8 * (polar5 + 64 + 4) / 128)


def test_llama_cpps_attention_follows_the_models_architecture():
    spec = parse_cache_spec("ggml:q8_0/q4_0")
    cache = spec.new_kv_cache(KVLayout(2, 1, 64, architecture="gemma3"))
    assert isinstance(cache, GGMLAttentionCache) and cache.prescale_query
    assert not spec.new_kv_cache(LAYOUT).prescale_query
    assert spec.bits_per_value(64) == pytest.approx(8 * (68 + 36) / 128)


@pytest.mark.parametrize("bad, match", [
    ("", "non-empty string"), (None, "non-empty string"), ("kv8/tq4/tq3", "two separated by '/'"),
    ("tq4@sinks=x", "sinks must be"), ("nosuchcodec", "unknown codec spec"),
    ("ggml:q5_1/q8_0", "not a llama.cpp cache type"), ("missing.json", "cannot read the cache plan"),
])
def test_bad_specs_are_named_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        spec = parse_cache_spec(bad)
        spec.new_kv_cache(LAYOUT)   # a codec name is checked when its codec is built


def test_lists_split_where_a_spec_ends():
    specs = parse_cache_specs("kv8,tq3:codebook=gaussian,side=unbiased,polar5@center,sinks=1/polar4")
    assert [s.text for s in specs] == ["kv8", "tq3:codebook=gaussian,side=unbiased",
                                      "polar5@center,sinks=1/polar4"]


def test_describe_puts_a_spec_in_words():
    assert parse_cache_spec("polar5:side_dtype=f16@center,normalize,sinks=1/polar4@recent=8"
                            ).describe() == ("K polar5 (f16 side, centered, normalized, 1 f32 "
                                             "sink) / V polar4 (last 8 rows f32)")
    assert parse_cache_spec("tq4/kv8").describe(("L", "R")) == "L tq4 / R kv8"
    assert parse_cache_spec("ggml-norot:q8_0").describe() == (
        "llama.cpp as run (no rotation): K q8_0 / V q8_0")


# -- a kind of one's own ---------------------------------------------------------------------------
@dataclass(frozen=True)
class UniformSpec(CacheSpec):
    """``uniform:<codec>``: the same codec for K and V, as a toy kind."""

    codec_spec: str
    kind = "uniform"

    @property
    def text(self):
        return "uniform:" + self.codec_spec

    def bits_per_value(self, head_dim, tokens=None):
        return PairSpec.parse(self.codec_spec).bits_per_value(head_dim, tokens)

    def new_kv_cache(self, layout):
        return PairSpec.parse(self.codec_spec).new_kv_cache(layout)


def test_a_registered_kind_runs_where_a_built_in_one_does():
    from kvquant.models.tiny_mla import TinyMLA
    kind = SpecKind("uniform", lambda t: t.startswith("uniform:"),
                    lambda t: UniformSpec(t.partition(":")[2]))
    register_spec_kind(kind)
    try:
        with pytest.raises(ValueError, match="registered already"):
            register_spec_kind(SpecKind("uniform", kind.claims, str))
        spec = parse_cache_spec("uniform:tq4")
        assert spec == UniformSpec("tq4") and spec.bits_per_value(64) == 4.5
        assert spec.new_kv_cache(LAYOUT).codec(0, "v").spec == "tq4"
        # a model that cannot take it says which kind it refuses
        with pytest.raises(ValueError, match="takes a pair spec.*not a uniform spec"):
            TinyMLA().new_cache("uniform:tq4")
    finally:
        unregister_spec_kind("uniform")
    # gone: the text is a pair spec again, whose codec name no codec has
    with pytest.raises(ValueError, match="K rows .*'uniform:tq4'"):
        parse_cache_spec("uniform:tq4").new_kv_cache(LAYOUT)


def test_the_simulations_are_an_installed_kind():
    """The experiments' sim: kind is installed as any package's would be (an entry point of
    kvquant.cache_specs), so spawned workers parse it."""
    names = {ep.name: ep.value for ep in entry_points(group="kvquant.cache_specs")}
    assert names.get("sim") == "kvquant_experiments.simulated_caches:SPEC_KIND"
    spec = parse_cache_spec("sim:kivi4")
    assert spec.kind == "sim" and spec.family == "simulation"
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert spec.bits_per_value(64) == pytest.approx((4 + 1 + 4 + 1) / 2)
    cache = spec.new_kv_cache(LAYOUT)
    assert cache.n_layers == 2 and cache.head_dim == 64


def test_stream_specs_inside_a_pair_are_the_stream_layers_objects():
    spec = parse_cache_spec("tq4:side_dtype=f16@center/kv8")
    assert spec.k == StreamSpec.parse("tq4:side_dtype=f16@center")
    assert spec.k.codec(64).side_dtype == "f16"


def test_a_stream_list_gives_one_spec_per_stream_of_any_model():
    spec = StreamListSpec.parse(" kv8 / tq4@recent=16,sinks=1 / f32 ")
    assert spec.text == "kv8/tq4@sinks=1,recent=16/f32"
    assert StreamListSpec.parse(spec.text) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    k, v, x = spec.for_streams(("k", "v", "x"))
    assert (k.codec_spec, v.options.recent, v.options.sinks, x.codec_spec) == ("kv8", 16, 1, "f32")
    # one spec serves every stream
    assert StreamListSpec.parse("tq4").for_streams("abcd") == (StreamSpec.parse("tq4"),) * 4
    # the grammar of a pair: a pair gives its streams, one when they are equal
    assert StreamListSpec.of(parse_cache_spec("kv8/tq4@sinks=1")) == \
        StreamListSpec.parse("kv8/tq4@sinks=1")
    assert StreamListSpec.of(parse_cache_spec("tq4/tq4")).text == "tq4"
    assert StreamListSpec.of(StreamSpec.parse("polar4@center")).text == "polar4@center"
    assert StreamListSpec.of(spec) is spec


@pytest.mark.parametrize("bad, match", [
    ("kv8/tq4", r"'kv8/tq4' gives 2 stream specs separated by '/', but m has 3 streams \(a, b, c\)"),
    ("kv8//tq4", "an empty stream spec"),
    ("", "non-empty string"),
    ("ggml:q8_0/q4_0", "'ggml:q8_0/q4_0' is a ggml spec, not a list of stream specs"),
    ("plan.json", "is a plan spec"),
    ("tq4@bogus", "unknown stream option 'bogus'"),
])
def test_a_bad_stream_list_is_a_named_error(bad, match):
    with pytest.raises(ValueError, match=match):
        StreamListSpec.parse(bad).for_streams(("a", "b", "c"), "m")


def test_another_kinds_object_is_no_stream_list():
    with pytest.raises(ValueError, match="is a ggml spec"):
        StreamListSpec.of(parse_cache_spec("ggml:q8_0"))
    with pytest.raises(TypeError, match="non-empty tuple of StreamSpecs"):
        StreamListSpec(("tq4",))


def test_row_scales_are_asked_of_the_codec_family():
    from kvquant.codecs import row_scaled_spec
    assert row_scaled_spec("kv8-g32") == "kv8"
    assert row_scaled_spec("kv8-g32:nonfinite=inert") == "kv8:nonfinite=inert"
    assert row_scaled_spec("tq4:seed=7") == "tq4:seed=7" and row_scaled_spec("kv8") == "kv8"
    # the group as a codec option is a grouped codec too (the MLA model's R, a budget's R)
    assert row_scaled_spec("kv8:group=32") == "kv8"
    assert row_scaled_spec("kv8:nonfinite=inert,group=16") == "kv8:nonfinite=inert"
    s = StreamSpec.parse("kv8-g32@center,sinks=1")
    assert str(s.with_row_scales()) == "kv8@center,sinks=1"
    assert str(StreamSpec.parse("kv8:group=8@sinks=1").with_row_scales()) == "kv8@sinks=1"
    t = StreamSpec.parse("tq4@sinks=1")
    assert t.with_row_scales() is t


@pytest.mark.parametrize("text, reference", [
    ("f32", True), (" f32/f32 ", True), ("F32", True), ("f32/F32", True),
    ("f32/tq4", False), ("tq4", False), ("f32@center", False), ("f32@sinks=1", False),
    ("f32:nonfinite=inert", False), ("ggml:f16", False),
])
def test_the_f32_reference_is_asked_of_the_spec_whatever_its_spelling(text, reference):
    spec = parse_cache_spec(text)
    assert spec.is_reference is reference
    if isinstance(spec, PairSpec):
        assert StreamListSpec.of(spec).is_reference is reference


def test_a_plan_is_not_the_reference_even_of_f32_streams():
    assert not CachePlan.uniform("f32", 2, 3).is_reference


def test_a_codec_whose_name_carries_its_bits_changes_them_through_the_spec():
    from kvquant.codecs import bit_ladder, spec_with_bits
    s = StreamSpec.parse("polar4:side_dtype=f16@center,sinks=1")
    assert (s.bits, s.bit_widths) == (4, range(2, 7))
    assert str(s.with_bits(3)) == "polar3:side_dtype=f16@center,sinks=1"
    assert StreamSpec.parse("tq3:seed=0x7").with_bits(8).codec_spec == "tq8:seed=0x7"
    assert (StreamSpec.parse("tq4").bits, StreamSpec.parse("tq4").bit_widths) == (4, range(1, 9))
    for other in ("kv8", "kv8-g32", "q4_0+rot", "f32"):
        assert StreamSpec.parse(other).bits is None and bit_ladder(other) is None
        with pytest.raises(ValueError, match="carries no bit width"):
            StreamSpec.parse(other).with_bits(4)
    for bits in (1, 7, True, 3.0):
        with pytest.raises(ValueError, match="polar takes 2..6 bits"):
            s.with_bits(bits)
    assert spec_with_bits("TQ4", 2) == "tq2"


def test_codec_and_stream_options_are_added_through_the_spec():
    s = StreamSpec.parse("ds:inner=tq2,k=1@center,sinks=1")
    f16 = s.with_codec_options(side_dtype="f16")
    assert str(f16) == "ds:inner=tq2,k=1,side_dtype=f16@center,sinks=1"
    assert f16.with_codec_options(side_dtype="f16") == f16          # given already: kept once
    assert str(StreamSpec.parse("tq3:seed=0x7").with_codec_options(seed=7)) == "tq3:seed=0x7"
    with pytest.raises(ValueError, match="gives side_dtype='f16' already"):
        f16.with_codec_options(side_dtype="f32")
    with pytest.raises(ValueError, match="non-empty text without ','"):
        s.with_codec_options(inner="tq2,k=2")
    assert str(s.with_options(recent=16)) == "ds:inner=tq2,k=1@center,sinks=1,recent=16"
    assert s.with_options(center=False).options.center is False
    with pytest.raises(ValueError, match="unknown stream option.*bogus"):
        s.with_options(bogus=1)
    with pytest.raises(ValueError, match="sinks must be an integer"):
        s.with_options(sinks=-1)


def test_a_list_of_specs_separated_by_semicolons_keeps_each_whole():
    from kvquant.specs import split_spec_text
    assert split_spec_text("tq4; polar4:alloc=level,side_dtype=f16;;kv8@center,sinks=1",
                           separator=";") == ["tq4", "polar4:alloc=level,side_dtype=f16",
                                              "kv8@center,sinks=1"]


@pytest.mark.parametrize("spec, dim, error, match", [
    ("nope", 64, "UnknownCodecError", "unknown codec spec 'nope'"),
    ("tq9", 64, "UnknownCodecError", "tq bits must be an integer in 1..8"),
    ("tq4:bogus=1", 64, "UnknownCodecError", "unknown option"),
    ("tq4", 96, "CodecWidthError", "power-of-two row width"),
    ("polar4", 48, "CodecWidthError", "power-of-two row width"),
    ("q4_0", 48, "CodecWidthError", "multiple of 32"),
    ("q4_0+rot", 96, "CodecWidthError", "power-of-two"),
    ("kv8-g48", 64, "CodecWidthError", "group size 48"),
    ("vq3", 96, "CodecWidthError", "power-of-two"),     # a plug-in's plain ValueError
])
def test_a_codec_refusal_says_whether_the_codec_or_the_width_is_wrong(spec, dim, error, match):
    import kvquant.codecs as codecs
    with pytest.raises(getattr(codecs, error), match=match):
        codecs.codec_for_width(spec, dim)
    other = {"UnknownCodecError": codecs.CodecWidthError,
             "CodecWidthError": codecs.UnknownCodecError}[error]
    try:
        codecs.codec_for_width(spec, dim)
    except other:
        pytest.fail(f"{spec} at {dim} raised both errors")
    except ValueError:
        pass
