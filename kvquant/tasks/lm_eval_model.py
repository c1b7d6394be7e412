"""kvquant as an lm-evaluation-harness model: every lm-eval log-likelihood task, any cache spec.

Importing this module (it needs the ``lmeval`` extra: ``lm-eval==0.4.13``) registers the model
name ``kvquant`` with lm-eval. The model is a kvquant model (``kvquant.models.load_model``:
``smollm2``, ``gemma3-270m``, a GGUF file) whose KV cache goes through the codec ``kv``; each
distinct context is run once and its cache reused for each continuation
(:class:`kvquant.tasks.scoring.ItemScorer`)::

    python -m kvquant.tasks.lm_eval_model --model kvquant \\
        --model_args pretrained=smollm2,kv=tq4 --tasks hellaswag --limit 200

(the module's ``main`` registers the model, then hands its arguments to lm-eval's own command
line), or from Python::

    import kvquant.tasks.lm_eval_model
    lm_eval.simple_evaluate(model="kvquant", model_args="pretrained=smollm2,kv=kv8", tasks=[...])

Only log-likelihood requests (multiple-choice and log-likelihood tasks) are served; rolling
log-likelihoods and generation are refused with a message (the numpy models have no sampler).
"""
import sys

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:
    raise ImportError(f"kvquant.tasks.lm_eval_model needs lm-eval ({exc}): pip install -e "
                      "'.[lmeval]' in the kvquant source tree") from None

from kvquant.tasks.scoring import ItemScorer

__all__ = ["KVQuantLM", "main"]


@register_model("kvquant")
class KVQuantLM(LM):
    """lm-eval's model interface over a kvquant model and cache spec.

    Parameters (lm-eval ``--model_args``)
    ----------
    pretrained : str
        ``smollm2``, ``gemma3-270m`` or the path of a GGUF file.
    kv : str
        The cache spec (``f32``, ``kv8``, ``tq4``, ``kv8/tq4``, ``ggml:q8_0/q8_0``, a plan
        file ...).
    """

    def __init__(self, pretrained="smollm2", kv="f32", batch_size=None, device=None, **kwargs):
        super().__init__()
        if device not in (None, "cpu"):
            raise ValueError(f"the kvquant model runs on the CPU; got device={device!r}")
        if kwargs:
            raise ValueError(f"unknown model_args for kvquant: {', '.join(sorted(kwargs))} "
                             "(known: pretrained, kv)")
        from kvquant.models import load_model
        self.model = pretrained if not isinstance(pretrained, str) else load_model(pretrained)
        self.kv = kv
        self._scorer = ItemScorer(self.model, kv)

    def loglikelihood(self, requests, disable_tqdm=False):
        pairs = [tuple(req.args) for req in requests]
        scored = self._scorer.loglikelihoods(pairs)
        return [(ll, greedy) for ll, greedy, _, _ in scored]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError("the kvquant lm-eval model serves log-likelihood requests "
                                  "(multiple-choice tasks); for perplexity use kvquant flips")

    def generate_until(self, requests, disable_tqdm=False):
        raise NotImplementedError("the kvquant lm-eval model serves log-likelihood requests "
                                  "only (no generation)")


def main(argv=None):
    """lm-eval's command line with the ``kvquant`` model registered."""
    from lm_eval.__main__ import cli_evaluate
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
