"""A ``tokenizers`` BPE tokenizer built from a GGUF file's vocabulary (REFERENCE.md §4).

GGUF keeps a GPT-2 style byte-level BPE as ``tokenizer.ggml.tokens`` / ``merges`` /
``token_type``. llama.cpp's "smollm" pre-tokenizer splits every digit on its own, then applies
the GPT-2 regex: here ``Sequence([Digits(individual_digits=True), ByteLevel(...)])``.
(transformers' own GGUF tokenizer conversion leaves the digit split out, so it tokenizes runs of
spaces before a digit differently: tools/compare_transformers_gguf.py records both.) Tokens of type
3 (control: ``<|endoftext|>``, ``<|im_start|>``, ...) are registered as special tokens so that
they are matched whole in text.
"""
__all__ = ["tokenizer_from_gguf"]

CONTROL_TOKEN_TYPE = 3
# llama.cpp pre-tokenizers: these split every digit on its own before the GPT-2 regex ...
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
# ... and this one is the GPT-2 regex alone.
SUPPORTED_PRE = DIGIT_SPLIT_PRE + ("gpt2",)


def _field(reader, key, required=True):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ValueError(f"the GGUF file has no {key!r}: it does not carry a BPE tokenizer")
        return None
    return field.contents()


def tokenizer_from_gguf(reader):
    """Build a ``tokenizers.Tokenizer`` from an open ``gguf.GGUFReader``.

    Returns
    -------
    tokenizers.Tokenizer
        Encodes text to the model's ids (no BOS added, as ``tokenizer.ggml.add_bos_token`` is
        false for SmolLM2) and decodes ids to text.
    """
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ImportError("the real model's tokenizer needs the 'tokenizers' package: "
                          "pip install 'kvquant-lab[model]'") from None
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
    pre = _field(reader, "tokenizer.ggml.pre", required=False)
    if pre not in SUPPORTED_PRE:
        raise ValueError(
            f"pre-tokenizer {pre!r} is not supported (known: {', '.join(SUPPORTED_PRE)})")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary holds duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre in DIGIT_SPLIT_PRE else byte_level)
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok
