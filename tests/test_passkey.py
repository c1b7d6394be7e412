"""Passkey retrieval (kvquant_experiments.passkey): the prompt builder puts the number where it
says with the token counts it says, the answer reader, and a run on a small random-weight GGUF
model whose greedy continuation is checked against a full forward from an empty cache."""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _experiments_env import ensure_importable  # noqa: E402

ensure_importable()

gguf = pytest.importorskip("gguf", reason="the models extra (gguf) is not installed")
pytest.importorskip("tokenizers", reason="the models extra (tokenizers) is not installed")

from kvquant.models.random_gguf import write_random_gguf  # noqa: E402

from kvquant.models import load_model  # noqa: E402
from kvquant_experiments import passkey  # noqa: E402

# Few tokens: the random models have a 64-token context.
SHORT = passkey.Template(intro="Find:", needle=" n={key}.", question=" n=",
                         filler=(" a cat.", " the world.", " is."))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("passkey") / "random-qwen3.gguf")
    write_random_gguf(path, "qwen3", seed=3)
    return path


@pytest.fixture(scope="module")
def model(model_path):
    return load_model(model_path)


def _encode(model):
    return lambda text: model.encode(text).tolist()


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_the_number_is_where_the_prompt_says(model, depth):
    encode = _encode(model)
    p = passkey.build_prompt(encode, 600, depth, "48213", bos=7)
    ids = list(p.ids)
    assert ids[0] == 7
    # the needle's tokens are the needle's text, at the place recorded
    needle = model.decode(ids[p.needle_start:p.needle_start + p.needle_tokens])
    assert needle == passkey.TEMPLATE.needle.format(key="48213")
    head = 1 + len(encode(passkey.TEMPLATE.intro))
    assert p.needle_start == head + p.filler_before
    assert model.decode(ids[1:head]) == passkey.TEMPLATE.intro
    tail = encode(passkey.TEMPLATE.question)
    assert ids[-len(tail):] == tail
    # counts: the parts add up; within one filler sentence of the length asked
    assert p.n_tokens == head + p.filler_before + p.needle_tokens + p.filler_after + len(tail)
    longest = max(len(encode(s)) for s in passkey.TEMPLATE.filler)
    assert 600 - longest < p.n_tokens <= 600
    # the needle sits at the sentence end nearest the depth asked
    filler = p.filler_before + p.filler_after
    assert abs(p.filler_before - depth * filler) <= longest / 2 + 1
    text = model.decode(ids[1:])
    assert text.count("48213") == 2
    assert "48213" not in model.decode(ids[1:p.needle_start])
    if depth == 0.0:
        assert p.filler_before == 0
    if depth == 1.0:
        assert p.filler_after == 0


def test_the_filler_is_whole_sentences(model):
    encode = _encode(model)
    p = passkey.build_prompt(encode, 300, 0.5, "11111")
    head = len(encode(passkey.TEMPLATE.intro))
    before = model.decode(list(p.ids[head:p.needle_start]))
    sentences = passkey.TEMPLATE.filler
    # cycled sentences, cut after a whole one
    expected = "".join(sentences[i % len(sentences)] for i in range(len(sentences) * 20))
    assert expected.startswith(before) and before.endswith(".")


def test_prompt_errors_name_the_problem(model):
    encode = _encode(model)
    with pytest.raises(ValueError, match="no room for filler"):
        passkey.build_prompt(encode, 30, 0.5, "12345")
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 1\]"):
        passkey.build_prompt(encode, 600, 1.5, "12345")
    with pytest.raises(ValueError, match="must be digits"):
        passkey.build_prompt(encode, 600, 0.5, "12a45")
    with pytest.raises(ValueError, match="no \\{key\\}"):
        passkey.build_prompt(encode, 600, 0.5, "12345",
                             template=passkey.Template("a", "b", "c", ("d",)))


def test_passkeys_are_fixed_by_their_parameters():
    keys = {(n, d): passkey.passkey_of(0, n, d) for n in (4096, 8192)
            for d in passkey.DEFAULT_DEPTHS}
    assert all(len(k) == passkey.KEY_DIGITS and k.isdigit() and k[0] != "0"
               for k in keys.values())
    assert keys == {(n, d): passkey.passkey_of(0, n, d) for n, d in keys}
    assert len(set(keys.values())) == len(keys)       # ten draws of 90000 numbers
    assert passkey.passkey_of(1, 4096, 0.5) != passkey.passkey_of(0, 4096, 0.5)


@pytest.mark.parametrize("text, answer", [(" 48213.", "48213"), ("48213", "48213"),
                                          (" the 4821", "4821"), (" none.", None),
                                          (" 12 34", "12")])
def test_read_answer(text, answer):
    assert passkey.read_answer(text) == answer


def _reference_greedy(model, ids, n_new):
    """Greedy tokens by a full forward of prompt + tokens so far, from an empty f32 cache."""
    seq, out = list(ids), []
    for _ in range(n_new):
        t = int(model.forward(np.asarray(seq), model.new_cache("f32"), last_only=True)[0].argmax())
        out.append(t)
        seq.append(t)
    return out


def test_retrieval_decodes_through_the_cache_as_a_full_forward(model):
    prompts = [passkey.build_prompt(_encode(model), 48, d, passkey.passkey_of(0, 48, d),
                                    template=SHORT) for d in (0.0, 0.5, 1.0)]
    outs = passkey.retrieve(model, prompts, "f32", n_new=4)
    assert len({len(o) for o in outs}) == 1 and 1 <= len(outs[0]) <= 4
    for p, out in zip(prompts, outs):
        assert out == _reference_greedy(model, p.ids, len(out))


def test_run_writes_and_resumes(model, model_path, tmp_path, capsys, monkeypatch):
    choices = tmp_path / "choices.json"
    pick = "tq4:side_dtype=f16@center,normalize,sinks=1/tq4:side_dtype=f16@center,sinks=1"
    choices.write_text(json.dumps({"4.5": {"pair": pick, "bits": 4.4, "tune_text": "pydoc"}}))
    argv = ["--model", model_path, "--lengths", "40,64", "--depths", "0,1", "--configs",
            "f32,tq4", "--choices", str(choices), "--out", str(tmp_path), "--quiet"]
    assert passkey.main(argv + ["--list"]) == 0
    assert capsys.readouterr().out.split() == ["f32", "tq4", pick]
    # the random model has a short context, so the short template stands in for the default
    monkeypatch.setattr(passkey, "TEMPLATE", SHORT)
    assert passkey.main(argv) == 0
    stem = tmp_path / "passkey-random-qwen3-L40-64-d0-100-s0"
    result = json.loads(stem.with_suffix(".json").read_text())
    rows = result["rows"]
    assert [(r["codec"], r["n_tokens_asked"], r["depth"]) for r in rows] == [
        (c, n, d) for n in (40, 64) for d in (0.0, 1.0) for c in ("f32", "tq4", pick)]
    for r in rows:
        # the answer fits the length asked too (64: the random model's whole context)
        assert r["n_tokens"] + len(r["continuation_ids"]) <= r["n_tokens_asked"]
        assert r["n_tokens"] > r["n_tokens_asked"] - passkey.NEW_TOKENS - 8
        assert r["retrieved"] == (passkey.read_answer(r["continuation"]) == r["key"])
        assert r["key"] == passkey.passkey_of(0, r["n_tokens_asked"], r["depth"])
    f32_rows = [r for r in rows if r["codec"] == "f32"]
    for r in f32_rows:
        p = passkey.build_prompt(_encode(model), r["n_tokens_asked"] - passkey.NEW_TOKENS,
                                 r["depth"], r["key"], template=SHORT)
        assert r["continuation_ids"] == _reference_greedy(model, p.ids,
                                                          len(r["continuation_ids"]))
    md = stem.with_suffix(".md").read_text()
    assert "(pick <= 4.5)" in md
    # a second run measures nothing again
    before = stem.with_suffix(".json").read_text()

    def no_retrieval(*args, **kwargs):
        raise AssertionError("a resumed run measured a prompt again")
    monkeypatch.setattr(passkey, "retrieve", no_retrieval)
    assert passkey.main(argv) == 0
    again = json.loads(stem.with_suffix(".json").read_text())
    assert again["rows"] == json.loads(before)["rows"]


def test_markdown_compares_with_f32():
    def row(codec, n, depth, ok):
        return {"codec": codec, "n_tokens_asked": n, "depth": depth, "retrieved": ok}
    rows = ([row("f32", 8192, d, d != 0.5) for d in (0.0, 0.5, 1.0)]
            + [row("tq4", 8192, d, d != 1.0) for d in (0.0, 0.5, 1.0)]
            + [row("q4_0+rot", 8192, d, True) for d in (0.0, 0.5)])
    result = {"meta": {"model": {"model": "m", "head_dim": 64}, "lengths": [8192],
                       "depths": [0.0, 0.5, 1.0], "seed": 0,
                       "choices": {"4.5": {"pair": "q4_0+rot"}}}, "rows": rows}
    lines = passkey.format_markdown(result).splitlines()
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in lines if line.startswith("| `")}
    # bits per value: f32 32, tq4 4 + 32 bits of norm per 64 values, q4_0 4.5
    assert table["`f32`"] == ["32.00", "2/3 [50%]", "yes"]
    assert table["`tq4`"] == ["4.50", "2/3 [100%]", "no"]        # misses what f32 retrieves
    # not run at 100%: compared on what it ran
    assert table["`q4_0+rot` (pick <= 4.5)"] == ["4.50", "2/2 (not run: 100%)", "yes"]


@pytest.mark.slow
def test_smollm2_retrieves_at_1k_through_the_45_bit_pick():
    """SmolLM2 finds the number in f32 at a 1024-token context, and through the frontier's
    4.5-bit pick as well (the committed 8k runs: data/results/passkey-smollm2-*)."""
    from _experiments_env import ROOT
    try:
        model = load_model("smollm2")
    except ImportError as exc:
        pytest.fail(f"the slow tests need the real model: {exc}")
    pick = json.loads((ROOT / "data" / "results" / "frontier-choices.json").read_text())["4.5"]
    result = passkey.run_passkey("smollm2", ["f32", pick["pair"]], lengths=[1024],
                                 depths=[0.5], model=model)
    assert [(r["codec"], r["retrieved"]) for r in result["rows"]] == [
        ("f32", True), (pick["pair"], True)], [r["continuation"] for r in result["rows"]]
