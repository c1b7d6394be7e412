"""Memory budget: REFERENCE.md §1.6 reproduced exactly, and the `kvquant budget` command."""
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
    assert budget.max_context(shape, "kv8", "1GB", reserve_bytes="2GB") == 0


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
                                         ("1.5e9", 1_500_000_000), ("512", 512)])
def test_parse_bytes(text, value):
    assert budget.parse_bytes(text) == value


def test_parse_errors():
    with pytest.raises(ValueError, match="size"):
        budget.parse_bytes("lots")
    with pytest.raises(ValueError, match="token count"):
        budget.parse_tokens("12x")
    assert budget.parse_tokens("256k") == 262144
    with pytest.raises(ValueError, match="unknown model"):
        budget.load_shape("no-such-model")
    with pytest.raises(ValueError, match="bad model shape"):
        budget.load_shape('{"n_layers": 3}')


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
    with pytest.raises(SystemExit, match="unknown or unable"):
        main(["budget", "--model", str(shape), "--codecs", "tq9"])
