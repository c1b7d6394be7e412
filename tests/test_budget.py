"""Memory budget: docs/reference.md §1.6 reproduced exactly, and the `kvquant budget` command."""
import json

import pytest

from kvquant import budget
from kvquant.cli import main


@pytest.mark.parametrize("spec, per_layer_row", [
    ("f32", 2304), ("kv8", 584), ("tq4", 296), ("tq4:compat=colibri", 296),
])
def test_glm_layer_rows(spec, per_layer_row):
    """f32 2304 B; KV8 584 B (3.95x); 4-bit codec 296 B (7.8x)."""
    assert budget.layer_row_bytes("glm-5.2", spec) == per_layer_row


def test_glm_compression_ratios():
    f32 = budget.layer_row_bytes("glm-5.2", "f32")
    assert round(f32 / budget.layer_row_bytes("glm-5.2", "kv8"), 2) == 3.95
    assert round(f32 / budget.layer_row_bytes("glm-5.2", "tq4"), 1) == 7.8


@pytest.mark.parametrize("bits, per_layer_row", [(2, 116), (3, 188), (4, 260), (5, 332),
                                                 (6, 404)])
def test_glm_polar_rows(bits, per_layer_row):
    assert budget.layer_row_bytes("glm-5.2", f"polar{bits}") == per_layer_row


def test_glm_f32_pool_at_256k():
    """79 x 262144 x 2304 B = 47.7 GB."""
    pool = budget.pool_bytes("glm-5.2", "f32", 262144)
    assert pool == 79 * 262144 * 2304 == 47_714_402_304
    assert budget.format_bytes(pool) == "47.7 GB"


def test_pool_formula_with_slots_and_extra_rows():
    shape = budget.load_shape(json.dumps({
        "name": "m", "n_layers": 4, "extra_layers": 1, "extra_f32_per_token": 10,
        "streams": [{"name": "k", "dim": 64, "count": 2}, {"name": "v", "dim": 64, "count": 2}]}))
    per_token = 5 * (2 * 68 + 2 * 68) + 40                 # kv8 rows of 64: 64 + 4 B
    assert budget.token_bytes(shape, "kv8") == per_token
    assert budget.pool_bytes(shape, "kv8", 1000, slots=3) == 3 * 1000 * per_token
    assert budget.max_context(shape, "kv8", 3 * 1000 * per_token, slots=3) == 1000
    assert budget.max_context(shape, "kv8", 3 * 1000 * per_token - 1, slots=3) == 999
    assert budget.max_context(shape, "kv8", "1GB", reserve_bytes="1GB") == 0
    with pytest.raises(ValueError, match=r"reserve \(2 GB\) is larger than the RAM \(1 GB\)"):
        budget.max_context(shape, "kv8", "1GB", reserve_bytes="2GB")


def test_grouped_scales_apply_to_the_latent_only():
    # L: 512 + 16 scales x 4 B; R keeps one scale: 64 + 4
    assert budget.layer_row_bytes("glm-5.2", "kv8-g32") == (512 + 64) + (64 + 4)


def test_smollm2_and_widths_a_codec_cannot_take():
    assert budget.layer_row_bytes("smollm2", "f32") == 6 * 256
    assert budget.layer_row_bytes("smollm2", "tq4") == 6 * 36
    odd = budget.load_shape('{"name": "odd", "n_layers": 2, "streams": [{"name": "x", "dim": 96}]}')
    assert budget.token_bytes(odd, "tq4") is None          # 96 is not a power of two
    assert budget.available_codecs(["kv8", "tq4"], odd) == ["kv8"]


@pytest.mark.parametrize("text, value", [("64GB", 64 * 10**9), ("48GiB", 48 * 2**30),
                                         ("1.5e9B", 1_500_000_000), ("512B", 512), ("0", 0),
                                         (512, 512), ("0.5 kB", 500)])
def test_parse_bytes(text, value):
    assert budget.parse_bytes(text) == value


def test_parse_errors():
    with pytest.raises(ValueError, match="size"):
        budget.parse_bytes("lots")
    with pytest.raises(ValueError, match=r"--ram '64' has no unit: write e.g. 64GB"):
        budget.parse_bytes("64", "--ram")
    with pytest.raises(ValueError, match="size"):
        budget.parse_bytes("-5GB")
    for huge in ("1e300GB", 1e300, 2**63, "9.3e18B"):
        with pytest.raises(ValueError, match=r"--ram: .* is not below 2\^63 bytes"):
            budget.parse_bytes(huge, "--ram")
    assert budget.parse_bytes("9e18B") == 9 * 10**18
    with pytest.raises(ValueError, match="token count"):
        budget.parse_tokens("12x")
    assert budget.parse_tokens("256k") == 262144
    with pytest.raises(ValueError, match="unknown model"):
        budget.load_shape("no-such-model")
    with pytest.raises(ValueError, match="bad model shape"):
        budget.load_shape('{"n_layers": 3}')
    # counts are whole numbers: 1.5 heads is a damaged file, not one head
    for bad, match in (('"count": 1.5', "count is 1.5"), ('"count": "8"', "count is '8'"),
                       ('"count": true', "count is True"), ('"dim": 0', "dim is 0")):
        with pytest.raises(ValueError, match=match):
            budget.load_shape('{"n_layers": 2, "streams": [{"name": "k", "dim": 64, '
                              + bad + '}]}'.replace('"dim": 64, "dim"', '"dim"'))
    with pytest.raises(ValueError, match="not an object"):
        budget.load_shape('[1, 2]'.replace("[", "{\"x\": [", 1) + "}")


def test_cli_table(capsys):
    assert main(["budget", "--model", "glm-5.2", "--ram", "64GB", "--contexts", "256k",
                 "--codecs", "f32,kv8,tq4"]) == 0
    out = capsys.readouterr().out
    assert "47.7 GB" in out and "| kv8" in out and "2304" in out
    # 64e9 / (79 * 2304) tokens
    assert f"{64 * 10**9 // (79 * 2304):,}" in out


def test_cli_json_and_custom_shape(capsys, tmp_path):
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({"name": "m", "n_layers": 2, "streams": [{"name": "k", "dim": 64}]}))
    assert main(["budget", "--model", str(shape), "--ram", "1MB", "--codecs", "kv8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"][0]["token_bytes"] == 2 * 68
    assert data["rows"][0]["max_context"] == 10**6 // 136
    with pytest.raises(SystemExit) as exc:
        main(["budget", "--model", str(shape), "--codecs", "tq9"])
    assert exc.value.code == 2 and "unknown codec(s): tq9" in capsys.readouterr().err


def test_codecs_split_outside_spec_options(capsys):
    """A comma inside a spec's options does not start a new spec."""
    assert main(["budget", "--codecs", "tq3:codebook=gaussian,side=unbiased,kv8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["codec"] for r in rows] == ["tq3:codebook=gaussian,side=unbiased", "kv8"]
    # tq3 at 512 and 64: 192 + 4 and 24 + 4 bytes
    assert rows[0]["layer_row_bytes"] == (192 + 4) + (24 + 4)


def test_stream_options_are_counted():
    """recent=W keeps float32 copies of the last W rows besides their codes, sinks=N the first
    N rows in float32 instead of codes, center/normalize one float32 vector each: counted
    per layer, stream and KV head, as the cache's streams hold them."""
    shape = budget.load_shape(json.dumps({
        "name": "m", "n_layers": 2, "extra_layers": 1,
        "streams": [{"name": "k", "dim": 64, "count": 2}, {"name": "v", "dim": 64, "count": 2}]}))
    tq4 = 32 + 4                                              # tq4 row of 64: codes + radius
    per_token = 3 * 4 * tq4
    for spec, per_stream_fixed in [("tq4", 0), ("tq4@recent=16", 16 * 256),
                                   ("tq4@sinks=4", 4 * (256 - tq4)),
                                   ("tq4@center,normalize", 2 * 256),
                                   ("tq4@center,sinks=2,recent=8", 256 + 2 * (256 - tq4) + 8 * 256)]:
        assert budget.token_bytes(shape, spec) == per_token, spec
        fixed = 3 * 4 * per_stream_fixed                      # 3 cached layers x 4 rows
        assert budget.fixed_bytes(shape, spec) == fixed, spec
        assert budget.pool_bytes(shape, spec, 1000, slots=2) == 2 * (1000 * per_token + fixed)
        room = 2 * (1000 * per_token + fixed)
        assert budget.max_context(shape, spec, room, slots=2) == 1000, spec
        assert budget.max_context(shape, spec, room - 1, slots=2) == 999, spec
    # before the window is full the stream holds fewer copies: 3 rows, recent=16
    assert budget.pool_bytes(shape, "tq4@recent=16", 3) == 3 * 4 * 3 * (tq4 + 256)
    # one spec per stream: k in kv8, v in tq4 with a window
    assert budget.token_bytes(shape, "kv8/tq4@recent=4") == 3 * (2 * 68 + 2 * tq4)
    assert budget.fixed_bytes(shape, "kv8/tq4@recent=4") == 3 * 2 * 4 * 256


def test_no_quiet_zero_context(capsys):
    assert main(["budget", "--ram", "1kB", "--codecs", "kv8"]) == 0
    out = capsys.readouterr().out
    assert "none fits" in out and "Not even one token fits in 1 kB: kv8 needs 46.1 kB" in out


@pytest.mark.parametrize("argv, message", [
    (["--ram", "64"], "--ram '64' has no unit"),
    (["--ram", "lots"], "cannot read 'lots' as a size"),
    # a finite number of GB that is no finite count of bytes (was an OverflowError traceback)
    (["--ram", "1e300GB"], "--ram: '1e300GB' is not below 2^63 bytes"),
    (["--reserve", "1e19B"], "--reserve: '1e19B' is not below 2^63 bytes"),
    (["--reserve", "20"], "--reserve '20' has no unit"),
    (["--ram", "64GB", "--reserve", "80GB"], "reserve (80 GB) is larger than the RAM (64 GB)"),
    (["--slots", "0"], "--slots must be a positive integer, got 0"),
    (["--slots", "-3"], "--slots must be a positive integer, got -3"),
    (["--contexts", "0"], "a context must be at least 1 token"),
    (["--contexts", ","], "names no context"),
    (["--contexts", "12x"], "cannot read '12x' as a token count"),
    (["--codecs", "tq9"], "unknown codec(s): tq9 (tq bits must be an integer in 1..8, got 9)"),
    (["--codecs", "nope"], "unknown codec(s): nope (unknown codec spec 'nope'"),
    (["--model", "smollm2", "--codecs", "kv8-g48"],
     "codec(s) unable to take the widths of smollm2: kv8-g48 (smollm2's k rows (width 64): kv8 "
     "group size 48 must be a positive divisor of the width 64)"),
    (["--codecs", "ggml:q8_0/q4_0"], "'ggml:q8_0/q4_0' is a ggml spec, not a list of stream specs"),
    (["--codecs", "kv8/"], "an empty stream spec"),
    (["--codecs", "side=unbiased,tq4"], "follows no spec"),
    (["--codecs", "tq4@bogus=1"], "unknown stream option 'bogus'"),
    (["--codecs", "tq4@recent=-1"], "recent"),
    (["--codecs", "kv8/tq4/f32"], "gives 3 stream specs"),
    (["--model", "no-such-model"], "unknown model"),
    (["--model", '{"n_layers": 3}'], "bad model shape"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["budget"] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvquant budget: ") and message in err, err


def test_unknown_codecs_and_refused_widths_are_distinct_errors():
    """row_bytes names its refusal: a spec that is no codec, or a codec that refuses the width;
    the totals keep None for a refused width and raise for an unknown codec."""
    with pytest.raises(budget.UnknownCodecError, match="unknown codec spec 'nope'"):
        budget.row_bytes("nope", 64)
    with pytest.raises(budget.UnknownCodecError, match="tq bits must be an integer in 1..8"):
        budget.row_bytes("tq9", 64)
    with pytest.raises(budget.CodecWidthError, match="power-of-two row width"):
        budget.row_bytes("tq4", 96)
    with pytest.raises(budget.CodecWidthError, match="group size 48"):
        budget.row_bytes("kv8-g48", 64)
    assert not issubclass(budget.UnknownCodecError, budget.CodecWidthError)
    assert not issubclass(budget.CodecWidthError, budget.UnknownCodecError)
    assert budget.token_bytes("smollm2", "kv8-g48") is None
    with pytest.raises(budget.UnknownCodecError):
        budget.token_bytes("smollm2", "nope")
    with pytest.raises(budget.CodecWidthError, match=r"smollm2's k rows \(width 64\)"):
        budget.checked_stream_costs("smollm2", "kv8-g48")
    assert budget.available_codecs(["nope", "kv8-g48", "kv8"], "smollm2") == ["kv8"]


def test_row_scales_for_a_stream_that_keeps_them_at_any_width():
    """The tiny MLA model's rope row R (width 8) keeps one scale per row: kv8-g32 counts it as
    kv8, though a group of 32 would not divide 8."""
    assert budget.layer_row_bytes("tiny-mla", "kv8-g32") == (32 + 4) + (8 + 4)
    assert budget.layer_row_bytes("tiny-mla", "kv8-g32@sinks=1/kv8-g32") == (32 + 4) + (8 + 4)
    # 5 layers; a sink row: float32 in place of its codes and scale
    assert budget.fixed_bytes("tiny-mla", "kv8-g32@sinks=1") == 5 * (4 * 32 - 36 + 4 * 8 - 12)


def test_specs_are_objects_and_any_number_of_streams():
    from kvquant.specs import StreamListSpec, parse_cache_spec
    shape = budget.load_shape(json.dumps({
        "name": "three", "n_layers": 2,
        "streams": [{"name": "a", "dim": 64}, {"name": "b", "dim": 64}, {"name": "c", "dim": 32}]}))
    assert budget.layer_row_bytes(shape, "kv8/tq4/f32") == 68 + 36 + 128
    assert budget.layer_row_bytes(shape, StreamListSpec.parse("kv8/tq4/f32")) == 68 + 36 + 128
    assert budget.layer_row_bytes("glm-5.2", parse_cache_spec("kv8/tq4")) == \
        budget.layer_row_bytes("glm-5.2", "kv8/tq4") == (512 + 4) + (32 + 4)
    rows = budget.budget_table("smollm2", [parse_cache_spec("tq4"), "kv8/kv8"], contexts=(1024,))
    assert [r["codec"] for r in rows] == ["tq4", "kv8/kv8"]
    with pytest.raises(ValueError, match="gives 2 stream specs separated by '/', but three has 3"):
        budget.token_bytes(shape, "kv8/tq4")
    with pytest.raises(ValueError, match="is a ggml spec"):
        budget.token_bytes("smollm2", parse_cache_spec("ggml:q8_0/q4_0"))
