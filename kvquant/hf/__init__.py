"""kvquant inside Hugging Face transformers: a quantized cache and attention that reads its codes.

Importing this package (it needs the ``hf`` extra: ``torch`` and ``transformers`` 5.x) registers
the attention implementation ``"kvquant"`` with transformers. Then::

    import kvquant.hf
    from kvquant.hf import KVQuantCache

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvquant")
    out = model.generate(ids, cache=KVQuantCache(model.config, "polar5/polar4@center"))

The cache goes to ``generate()`` or the model's forward as ``cache=``: transformers 5.x renamed
``past_key_values`` to it (5.25 and later warn on the old keyword, and 5.40 removes it from the
models' forward). On a 5.x release from before the rename, whose models take no ``cache``,
pass ``past_key_values=``. :class:`HFModel` passes the cache by the model's own keyword.

* :class:`KVQuantCache` (:mod:`kvquant.hf.cache`): a transformers ``Cache`` whose layers keep K
  and V in kvquant stream stores (one :class:`kvquant.cache.QuantizedKVCache` per layer, the KV
  heads as slots), under any stream spec, per layer and per stream.
* the ``"kvquant"`` attention (:mod:`kvquant.hf.attention`): decode and prefill attention from
  the compressed rows through the cache's consumers (GQA, causal and sliding-window masks, the
  model's scaling and softcapping), CPU only; anything it does not implement is refused.
* :class:`HFModel` (:mod:`kvquant.hf.model`): a transformers causal LM behind kvquant's model
  contract (``encode``, ``new_cache``, ``forward``), so that :func:`kvquant.flips.text_metrics`
  runs on it.

``import kvquant`` alone never imports torch; only this package does.
"""
try:
    import torch  # noqa: F401
    import transformers
except ImportError as exc:   # the optional extra is missing
    raise ImportError(
        f"kvquant.hf needs torch and transformers ({exc}); install the extra: "
        "pip install torch==2.13.0 && pip install -e '.[hf]' in the kvquant source tree") from None

if not transformers.__version__.split(".")[0] == "5":
    raise ImportError(f"kvquant.hf follows the cache API of transformers 5.x; found "
                      f"transformers {transformers.__version__} (pip install 'transformers>=5,<6')")

from kvquant.hf.attention import (  # noqa: E402
    ATTN_IMPLEMENTATION, CausalBands, kvquant_attention_forward, kvquant_mask, register)
from kvquant.hf.cache import KVQuantCache, KVQuantLayer  # noqa: E402
from kvquant.hf.model import HFModel, cache_keyword, load_hf_model  # noqa: E402

register()

__all__ = ["ATTN_IMPLEMENTATION", "CausalBands", "HFModel", "KVQuantCache", "KVQuantLayer",
           "cache_keyword", "kvquant_attention_forward", "kvquant_mask", "load_hf_model", "register"]
