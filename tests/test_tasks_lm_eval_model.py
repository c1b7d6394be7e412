"""The lm-eval model ``kvquant``: registered under its name, built from lm-eval's model_args
string, answering lm-eval's log-likelihood requests with the scorer's numbers."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from kvquant.models.random_gguf import write_random_gguf  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("lmeval") / "llama.gguf"
    write_random_gguf(path, "llama", seed=11)
    return str(path)


def _instances(pairs):
    from lm_eval.api.instance import Instance
    return [Instance("loglikelihood", doc={}, arguments=pair, idx=i,
                     metadata=("t", 0, 1)) for i, pair in enumerate(pairs)]


def test_registered_model_answers_as_the_scorer(gguf_path):
    import kvquant.tasks.lm_eval_model  # noqa: F401  (registers "kvquant")
    from lm_eval.api.registry import get_model

    from kvquant.models import load_model
    from kvquant.tasks import ItemScorer

    cls = get_model("kvquant")
    lm = cls.create_from_arg_string(f"pretrained={gguf_path},kv=tq4")
    pairs = [("the cat sat", " on mat"), ("the cat sat", " in a hat"), ("one two ", "three"),
             ("a b", " c d e")]
    got = lm.loglikelihood(_instances(pairs))
    want = ItemScorer(load_model(gguf_path), "tq4").loglikelihoods(pairs)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == [w[1] for w in want]
    f32 = cls.create_from_arg_string(f"pretrained={gguf_path},kv=f32").loglikelihood(
        _instances(pairs))
    assert not np.allclose([g[0] for g in got], [g[0] for g in f32], rtol=0, atol=1e-9)


def test_bad_model_args_and_other_requests_are_refused(gguf_path):
    from kvquant.tasks.lm_eval_model import KVQuantLM
    with pytest.raises(ValueError, match="unknown model_args for kvquant: dtype"):
        KVQuantLM(pretrained=gguf_path, kv="f32", dtype="float16")
    with pytest.raises(ValueError, match="runs on the CPU"):
        KVQuantLM(pretrained=gguf_path, device="cuda")
    with pytest.raises(ValueError, match="not-a-codec"):
        KVQuantLM(pretrained=gguf_path, kv="not-a-codec")
    lm = KVQuantLM(pretrained=gguf_path)
    with pytest.raises(NotImplementedError, match="log-likelihood requests"):
        lm.generate_until([])
