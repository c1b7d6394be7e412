"""The model contract every model of kvquant.models keeps (tiny-mla here; the GGUF decoders in
tests/test_gguf_models.py): forward == logits(forward_hidden), shapes, the context limit."""
import numpy as np
import pytest

from kvquant.models import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-mla")


def test_tiny_mla_forward_is_logits_of_hidden_rows(tiny):
    tokens = np.random.default_rng(0).integers(0, tiny.vocab_size, 20)
    logits = tiny.forward(tokens, tiny.new_cache("kv8"))
    hidden = tiny.forward_hidden(tokens, tiny.new_cache("kv8"))
    assert hidden.shape == (20, tiny.config.hidden_size) and hidden.dtype == np.float32
    # row blocks may round as the whole matrix does or not, by OpenBLAS's kernel for the CPU
    # (its Haswell kernel: 1e-6 on logits of size 1-3): float32 rounding, not bits
    np.testing.assert_allclose(np.vstack([tiny.logits(hidden[:7]), tiny.logits(hidden[7:])]),
                               logits, rtol=0, atol=1e-5 * np.abs(logits).max())
    np.testing.assert_allclose(tiny.forward(tokens, tiny.new_cache("kv8"), last_only=True),
                               logits[-1:], rtol=0, atol=1e-5 * np.abs(logits).max())
    assert (tiny.n_layers, tiny.n_kv_heads, tiny.head_dim) == (5, 1, 32)
    with pytest.raises(ValueError, match="hidden rows must have shape"):
        tiny.logits(hidden[:, :5])


def test_tiny_mla_refuses_chunks_past_its_context(monkeypatch):
    model = load_model("tiny-mla")
    assert model.context_length == 4096
    monkeypatch.setattr(model, "context_length", 12)   # the same check, on a short context
    cache = model.new_cache("f32")
    model.forward(np.zeros(10, np.int64), cache)
    with pytest.raises(ValueError, match="10 cached \\+ 3 new tokens exceed"):
        model.forward(np.zeros(3, np.int64), cache)
