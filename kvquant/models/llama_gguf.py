"""The names earlier code imports for the GGUF Llama model (SmolLM2): the forward is now
:mod:`kvquant.models.gguf_decoder` (llama, qwen2, qwen3, gemma3) and the packaged models are
found by :mod:`kvquant.models.packaged`."""
from kvquant.models.gguf_decoder import (GGUFDecoder, PREFILL_MODES, new_kv_cache,  # noqa: F401
                                         rope_adjacent)
from kvquant.models.packaged import load_smollm2, smollm2_path  # noqa: F401

__all__ = ["LlamaGGUF", "PREFILL_MODES", "load_smollm2", "new_llama_cache", "rope_adjacent",
           "smollm2_path"]

LlamaGGUF = GGUFDecoder
new_llama_cache = new_kv_cache
