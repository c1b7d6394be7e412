"""The tiny MLA model: its f32 forward against transformers' MLA class (fixture made by
tools/make_oracle.py), the cache discipline (quantized before read, consumers), the flip protocol
and the ``kvquant flips`` command."""
import json
import os

import numpy as np
import pytest

from _experiments_env import ensure_importable

ensure_importable()

from kvquant import flips  # noqa: E402
from kvquant_experiments import flip_runs, flip_tables, texts  # noqa: E402
from kvquant.cache import QuantizedKVCache
from kvquant.codecs.base import Codec
from kvquant.metrics import wilson_interval
from kvquant.models import load_model
from kvquant.specs import parse_cache_spec
from kvquant.models.tiny_mla import ORACLE_PROMPT, TinyMLA, TinyMLAConfig, rope_interleaved

FIXTURE = os.path.join(os.path.dirname(__file__), os.pardir, "data", "oracle",
                       "tiny_mla_oracle.json")


@pytest.fixture(scope="module")
def oracle():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def model():
    return TinyMLA()


def rel_err(a, b):
    return np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max()


# -- the f32 forward against transformers -------------------------------------------------------
def test_fixture_says_who_made_it(oracle):
    made = oracle["made_by"]
    assert made["model_class"] in ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")
    major, minor = (int(x) for x in made["transformers"].split(".")[:2])
    assert (major, minor) >= (5, 11), "interleaved RoPE needs transformers >= 5.11"
    assert oracle["prompt_ids"] == list(ORACLE_PROMPT)
    assert len(oracle["full_ids"]) == 32
    assert os.path.getsize(FIXTURE) < 1_000_000


def test_weights_are_the_fixtures(model, oracle):
    # A change of numpy's normal stream would show here first, not as a forward mismatch.
    assert model.checksum == oracle["weights_sha256"]


def test_f32_teacher_forced_logits_match_transformers(model, oracle):
    logits = model.forward(oracle["full_ids"], model.new_cache("f32"))
    ref = np.array(oracle["tf_logits"])
    assert logits.shape == ref.shape == (32, 256)
    assert rel_err(logits, ref) < 1e-4
    assert logits.argmax(axis=1).tolist() == oracle["tf_pred"]


def test_f32_decode_steps_match_transformers_generate(model, oracle):
    # One token at a time: the absorbed path reads a cache that grows row by row.
    cache = model.new_cache("f32")
    steps = [model.forward(oracle["prompt_ids"], cache)[-1]]
    for tok in oracle["full_ids"][len(oracle["prompt_ids"]):-1]:
        steps.append(model.forward([tok], cache)[0])
    assert rel_err(np.array(steps), np.array(oracle["gen_logits"])) < 1e-4
    assert flips.greedy(model, oracle["prompt_ids"], 20, "f32") == \
        oracle["full_ids"][len(oracle["prompt_ids"]):]


def test_interleaved_rope_pairs_and_layout():
    # Pair (x0, x1) turns by pos * theta^0 and lands at (out[0], out[d/2]).
    d = 8
    x = np.zeros((1, d), np.float32)
    x[0, 0], x[0, 1] = 1.0, 2.0
    out = rope_interleaved(x, np.array([3]), 1e4)
    c, s = np.cos(3.0), np.sin(3.0)
    np.testing.assert_allclose(out[0, [0, d // 2]], [c - 2 * s, 2 * c + s], rtol=1e-6)
    assert np.count_nonzero(out) == 2
    # Scores depend on the offset only.
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, d)).astype(np.float32)
    a = rope_interleaved(q, np.array([7]), 1e4) @ rope_interleaved(k, np.array([2]), 1e4).T
    b = rope_interleaved(q, np.array([15]), 1e4) @ rope_interleaved(k, np.array([10]), 1e4).T
    np.testing.assert_allclose(a, b, rtol=1e-5)


# -- the cache discipline ------------------------------------------------------------------------
def test_cache_streams_and_pair_specs(model):
    cache = model.new_cache("kv8-g8")
    assert isinstance(cache, QuantizedKVCache)
    # As the engine's KV8 mode: grouped scales on L, one scale per row on R.
    assert {n: cache.codec(0, n).spec for n in ("L", "R")} == {"L": "kv8-g8", "R": "kv8"}
    # the group as a codec option is the same grouped codec: R keeps its row scale, other
    # options kept on both streams
    cache = model.new_cache("kv8:group=8,nonfinite=inert@sinks=1")
    assert {n: cache.codec(0, n).spec for n in ("L", "R")} == {"L": "kv8-g8", "R": "kv8"}
    assert cache.codec(0, "R").nonfinite == "inert"
    toks = list(ORACLE_PROMPT)
    np.testing.assert_array_equal(model.forward(toks, model.new_cache("kv8:group=8")),
                                  model.forward(toks, model.new_cache("kv8-g8")))
    cache = model.new_cache("tq4/kv8")
    assert (cache.codec(0, "L").spec, cache.codec(0, "R").spec) == ("tq4", "kv8")
    assert [str(s) for s in parse_cache_spec("tq3").streams] == ["tq3", "tq3"]
    with pytest.raises(ValueError, match="R \\(rope\\) rows \\(width 8\\)"):
        model.new_cache("q4_0")            # blocks of 32 do not fit an 8-wide R row
    with pytest.raises(ValueError, match="two separated by '/'"):
        model.new_cache("kv8/tq4/tq3")


def test_prefill_reads_quantized_rows(model):
    # Position 0 attends to its own row only: with rows quantized before attention reads them,
    # its output already differs from f32; and a prefill equals token-by-token decoding.
    toks = list(ORACLE_PROMPT)
    f32 = model.forward(toks, model.new_cache("f32"))
    pre = model.forward(toks, model.new_cache("tq3"))
    assert np.abs(pre[0] - f32[0]).max() > 1e-3
    cache = model.new_cache("tq3")
    steps = np.stack([model.forward([t], cache)[0] for t in toks])
    np.testing.assert_allclose(pre, steps, rtol=0, atol=2e-5 * np.abs(steps).max())
    assert len(cache) == len(toks)


def test_a_recent_window_prefill_equals_decoding(model):
    # each query of a prefill reads its own window of float32 rows, as a decode step does
    toks = list(ORACLE_PROMPT) * 2
    spec = "tq2@recent=3/kv8@recent=5"
    pre = model.forward(toks, model.new_cache(spec))
    cache = model.new_cache(spec)
    steps = np.stack([model.forward([t], cache)[0] for t in toks])
    np.testing.assert_allclose(pre, steps, rtol=0, atol=2e-5 * np.abs(steps).max())
    plain = model.forward(toks, model.new_cache("tq2/kv8"))
    assert np.abs(plain - pre).max() > 1e-3


class CountingCodec(Codec):
    """f32 rows whose decode is forbidden: attention must go through scores/context."""

    family = "counting"

    def __init__(self, dim):
        super().__init__(dim)
        self.spec, self.code_bytes, self.n_side = "counting", 4 * dim, 0
        self.calls = {"scores": 0, "context": 0}

    def _encode(self, X, n_threads):
        return X.view(np.uint8).copy(), np.zeros((X.shape[0], 0), np.float32), None

    def _decode(self, codes, side, n_threads):
        raise AssertionError("the model decoded the cache instead of using the consumers")

    def _scores(self, codes, side, Q, out, n_threads):
        self.calls["scores"] += 1
        np.matmul(Q, codes.view(np.float32).T, out=out)

    def _context(self, codes, side, W, out, n_threads):
        self.calls["context"] += 1
        np.matmul(W, codes.view(np.float32), out=out)


def test_attention_goes_through_the_consumers(model):
    cfg = model.config
    L, R = CountingCodec(cfg.kv_lora_rank), CountingCodec(cfg.qk_rope_head_dim)
    cache = QuantizedKVCache(cfg.n_layers, {"L": (L, cfg.kv_lora_rank),
                                            "R": (R, cfg.qk_rope_head_dim)})
    logits = model.forward(list(ORACLE_PROMPT), cache)
    model.forward([7], cache)
    ref = model.forward(list(ORACLE_PROMPT), model.new_cache("f32"))
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-5)   # f32 kernel vs BLAS rounding
    # Two forwards x five layers: scores over L and R, context over L.
    assert L.calls == {"scores": 10, "context": 10} and R.calls == {"scores": 10, "context": 0}


def test_bad_tokens_are_refused(model):
    with pytest.raises(ValueError, match="0..255"):
        model.forward([256], model.new_cache())
    with pytest.raises(ValueError, match="at least one token"):
        model.forward([], model.new_cache())


def test_other_seed_other_weights():
    a = TinyMLA(TinyMLAConfig(seed=1))
    b = TinyMLA()
    assert a.checksum != b.checksum
    assert load_model("tiny-mla").checksum == b.checksum


# -- the flip protocol and the command -----------------------------------------------------------
def test_flip_protocol_table(model, oracle):
    result = flip_runs.run_flips("tiny-mla", codecs=["f32", "kv8", "tq2", "tq4/f32"], model=model)
    rows = {r["codec"]: r for r in result["rows"]}
    ref = result["meta"]["protocol"]["references"][0]
    assert ref["full_ids"] == oracle["full_ids"] and ref["tf_pred"] == oracle["tf_pred"]
    assert rows["f32"]["tf"]["k"] == 32 and rows["f32"]["greedy"]["k"] == 20
    assert rows["f32"]["tf_kld_mean"] == 0.0
    assert rows["tq2"]["tf"]["k"] < 32          # 2 bits perturb a near-tied random model
    assert rows["tq2"]["tf_kld_mean"] > rows["kv8"]["tf_kld_mean"] > 0
    assert rows["tq4/f32"]["streams"] == {"L": "tq4", "R": "f32"}
    assert rows["f32"]["bytes_per_token"] == 5 * 4 * (32 + 8)
    assert rows["kv8"]["bytes_per_token"] == 5 * (32 + 4 + 8 + 4)
    lo, hi = wilson_interval(rows["kv8"]["tf"]["k"], 32)
    assert (rows["kv8"]["tf"]["lo"], rows["kv8"]["tf"]["hi"]) == (lo, hi)
    text = flip_tables.format_markdown(result)
    assert "| L tq4 / R f32 |" in text and "32/32 [89, 100]" in text


def test_flips_command_writes_csv_and_json(tmp_path, capsys):
    from kvquant.cli import main
    assert main(["flips", "--model", "tiny-mla", "--codecs", "kv8,tq3:codebook=gaussian",
                 "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "| kv8 |" in out and "tq3:codebook=gaussian" in out
    stem = tmp_path / "flips-tiny-mla-p1"
    data = json.loads((stem.with_suffix(".json")).read_text())
    assert [r["codec"] for r in data["rows"]] == ["f32", "kv8", "tq3:codebook=gaussian"]
    csv_lines = stem.with_suffix(".csv").read_text().splitlines()
    assert csv_lines[0].startswith("codec,streams,bytes_per_token") and len(csv_lines) == 4


def test_flips_command_refuses_bad_input(capsys):
    from kvquant.cli import main
    # a bad input: one line on stderr, exit status 2
    assert main(["flips", "--model", "tiny-mla", "--codecs", "kv9", "--no-write", "--quiet"]) == 2
    assert "unknown codec spec" in capsys.readouterr().err
    assert main(["flips", "--model", "tiny-mla", "--positions", "100", "--no-write",
                 "--quiet"]) == 2
    assert "real model" in capsys.readouterr().err


# -- metric helpers ------------------------------------------------------------------------------
def test_kl_and_nll_rows():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 50)).astype(np.float32)
    b = a + 0.3 * rng.standard_normal((5, 50)).astype(np.float32)
    assert np.all(flips.kl_rows(a, a) == 0)
    kl = flips.kl_rows(a, b)
    pa = np.exp(a - a.max(1, keepdims=True))
    pa /= pa.sum(1, keepdims=True)
    pb = np.exp(b - b.max(1, keepdims=True))
    pb /= pb.sum(1, keepdims=True)
    np.testing.assert_allclose(kl, (pa * np.log(pa / pb)).sum(1), rtol=1e-5)
    t = rng.integers(0, 50, 5)
    np.testing.assert_allclose(flips.nll_rows(a, t), -np.log(pa[np.arange(5), t]), rtol=1e-5)


def test_text_chunks_cover_the_positions():
    tokens = np.arange(10_000)
    chunks = flips.text_chunks(tokens, 2500, 1000)
    assert [len(ids) for _, ids in chunks] == [1001, 1001, 501]
    assert [s for s, _ in chunks] == [0, 3333, 6666]
    with pytest.raises(ValueError, match="the text has 10000"):
        flips.text_chunks(tokens, 20_000, 1000)


def test_pydoc_text_is_there():
    text = texts.pydoc_text()
    assert len(text) > 400_000 and "assert" in text


def test_chunk_stats_agree_with_the_plain_formulas(model, monkeypatch):
    ids = np.random.default_rng(4).integers(0, 256, 41)
    # several row blocks, the last one partial
    st = flips.chunk_stats(model, ["f32", "tq3"], ids, block_rows=16)
    ref = model.forward(ids[:-1], model.new_cache("f32"))
    q = model.forward(ids[:-1], model.new_cache("tq3"))
    assert st["n"] == 40
    # chunk_stats forwards row blocks, whose logits round as the whole matrix's or not by
    # OpenBLAS's kernel for the CPU (its Haswell kernel: 9e-7 of a KLD of 0.009)
    np.testing.assert_allclose(st["specs"]["tq3"]["kld"], flips.kl_rows(ref, q), rtol=1e-5)
    np.testing.assert_allclose(st["specs"]["tq3"]["nll"], flips.nll_rows(q, ids[1:]).sum())
    np.testing.assert_allclose(st["nll_f32"], flips.nll_rows(ref, ids[1:]).sum())
    assert st["specs"]["f32"]["same"] == 40 and not st["specs"]["f32"]["kld"].any()
    assert st["specs"]["tq3"]["same"] == (q.argmax(1) == ref.argmax(1)).sum()
    row = flips.combine_chunks(["f32", "tq3"], [st, st])[1]
    assert row["same_top"]["n"] == 80
    np.testing.assert_allclose(row["ppl_ratio"],
                               np.exp((st["specs"]["tq3"]["nll"] - st["nll_f32"]) / 40))
