"""``HFModel``: a transformers causal LM behind kvquant's model contract.

kvquant's metrics take a model with ``encode(text)``, ``vocab_size``, ``new_cache(pair_spec)``
and ``forward(tokens, cache)`` (float32 logits, the tokens appended to the cache; see
:mod:`kvquant.models`). :class:`HFModel` gives a transformers model that contract, its cache a
:class:`~kvquant.hf.cache.KVQuantCache` read by the ``"kvquant"`` attention, so that
``kvquant.flips.text_metrics(HFModel.from_pretrained(path), specs, chunks)`` measures any local
Hugging Face checkpoint (a folder of safetensors, or a GGUF file) as it measures the numpy models.
"""
import inspect
import os

import numpy as np
import torch

from kvquant.hf.cache import ATTN_IMPLEMENTATION, KVQuantCache


def cache_keyword(model):
    """The keyword a transformers model's forward (and ``generate``) takes its cache by:
    ``"cache"``, or ``"past_key_values"`` on a transformers from before 5.x renamed it (the old
    name still runs on later ones, with a FutureWarning)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFModel:
    """A transformers causal LM (on CPU, batch size 1) with kvquant's model contract.

    Parameters
    ----------
    model : PreTrainedModel
        A causal LM; it is put in eval mode and switched to the ``"kvquant"`` attention.
    tokenizer : optional
        A transformers tokenizer (for :meth:`encode` / :meth:`decode`).
    name : str, optional
        The model's name in results.
    key_channels : {"model", "interleaved"}, default "model"
        The caches' key channel order (:class:`KVQuantCache`); ``"interleaved"`` stores keys
        as a GGUF Llama and kvquant's numpy models do.
    """

    def __init__(self, model, tokenizer=None, name=None, key_channels="model"):
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.key_channels = key_channels
        text = model.config.get_text_config(decoder=True)
        self.vocab_size = int(text.vocab_size)
        self.context_length = getattr(text, "max_position_embeddings", None)
        self.name = name or os.path.basename(str(getattr(model.config, "_name_or_path", "")
                                                 ).rstrip("/")) or type(model).__name__
        self.bos_token_id = None
        if tokenizer is not None and getattr(tokenizer, "add_bos_token", False):
            self.bos_token_id = tokenizer.bos_token_id
        self.n_layers = int(text.num_hidden_layers)
        self.n_kv_heads = int(getattr(text, "num_key_value_heads", None)
                              or text.num_attention_heads)
        self.head_dim = int(getattr(text, "head_dim", None)
                            or text.hidden_size // text.num_attention_heads)
        # Gemma 2 caps its logits (tanh); transformers applies it in the causal LM's forward.
        self._softcap = getattr(text, "final_logit_softcapping", None)
        self._cache_kw = cache_keyword(model)
        self._decoder_cache_kw = cache_keyword(model.get_decoder())

    @classmethod
    def from_pretrained(cls, path, gguf_file=None, dtype=torch.float32, name=None,
                        key_channels="model", **kwargs):
        """Load a local checkpoint folder (safetensors) or a GGUF file in it (``gguf_file``),
        its weights as ``dtype``, with the ``"kvquant"`` attention; ``kwargs`` go to
        ``AutoModelForCausalLM.from_pretrained``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        if gguf_file is not None:
            # kvquant's own reader first: a damaged file is a GGUFFileError naming the file and
            # its field, where the gguf package's reader under transformers fails with a
            # struct.error or its own wording, or reads a count past the file's end
            from kvquant.models.gguf_file import GGUFFile
            GGUFFile(os.path.join(path, gguf_file))
        extra = {} if gguf_file is None else {"gguf_file": gguf_file}
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, **extra, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
        default = os.path.splitext(gguf_file)[0] if gguf_file else None
        return cls(model, tokenizer, name=name or default, key_channels=key_channels)

    def describe(self):
        """What results record of the model."""
        return {"model": self.name, "backend": "transformers",
                "architecture": type(self.model).__name__,
                "n_layers": self.n_layers, "n_kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim,
                "dtype": str(self.model.dtype).replace("torch.", ""),
                "key_channels": self.key_channels,
                "attention": "decode: codec consumers; prefill: decoded block + BLAS "
                             "(banded consumers under a sliding window or softcapping)"}

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this HFModel has no tokenizer: pass one (HFModel(model, tokenizer))")
        return self.tokenizer

    def encode(self, text):
        """Text -> token ids (int64 array), without special tokens added."""
        ids = self._need_tokenizer()(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids):
        return self._need_tokenizer().decode([int(i) for i in ids])

    def new_cache(self, pair_spec="f32"):
        """A :class:`KVQuantCache` of this model under ``pair_spec`` (``"tq4"``, ``"kv8/tq4"``,
        or a list of one per layer)."""
        return KVQuantCache(self.model.config, pair_spec, key_channels=self.key_channels)

    def _check_tokens(self, tokens):
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.vocab_size - 1}")
        return ids

    def forward_hidden(self, tokens, cache):
        """Run ``tokens`` after those already in ``cache`` (appending them to it) through the
        decoder: its final hidden states after the output norm, float32 (n_tokens, hidden), for
        :meth:`logits` to turn into logits a block of rows at a time."""
        ids = self._check_tokens(tokens)
        with torch.inference_mode():
            out = self.model.get_decoder()(input_ids=torch.from_numpy(ids)[None], use_cache=True,
                                           **{self._decoder_cache_kw: cache})
        return out.last_hidden_state[0].to(torch.float32).numpy()

    def logits(self, hidden_rows):
        """Logits (float32, (m, vocab_size)) of rows of :meth:`forward_hidden`: the model's
        output head, and its final softcapping where the config has one."""
        with torch.inference_mode():
            h = torch.from_numpy(np.ascontiguousarray(hidden_rows, dtype=np.float32))
            logits = self.model.get_output_embeddings()(h.to(self.model.dtype))
            if self._softcap:
                logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.to(torch.float32).numpy()

    def forward(self, tokens, cache, last_only=False):
        """Run ``tokens`` after those already in ``cache`` (appending them to it).

        Returns
        -------
        logits : ndarray of shape (n_tokens, vocab_size), or (1, vocab_size) with
            ``last_only``, float32
        """
        ids = self._check_tokens(tokens)
        with torch.inference_mode():
            out = self.model(input_ids=torch.from_numpy(ids)[None], use_cache=True,
                             logits_to_keep=1 if last_only else 0, **{self._cache_kw: cache})
        return out.logits[0].to(torch.float32).numpy()


def load_hf_model(path, gguf_file=None, **kwargs):
    """:meth:`HFModel.from_pretrained`: a local checkpoint under kvquant's model contract."""
    return HFModel.from_pretrained(path, gguf_file=gguf_file, **kwargs)
