"""``tokenizers`` tokenizers built from a GGUF file's vocabulary: byte-level BPE (``gpt2``) and
SentencePiece-style BPE (``llama``, with scores: Gemma 3).

Byte-level BPE. GGUF keeps a GPT-2 style byte-level BPE as ``tokenizer.ggml.tokens`` / ``merges`` /
``token_type``. llama.cpp's "smollm" pre-tokenizer splits every digit on its own, then applies
the GPT-2 regex: here ``Sequence([Digits(individual_digits=True), ByteLevel(...)])``; Llama 3's
("llama-bpe") and Qwen 2's ("qwen2", also Qwen 3's) split with their own regex first.
(transformers' own GGUF tokenizer conversion leaves the digit split out, so it tokenizes runs of
spaces before a digit differently: tools/compare_transformers_gguf.py records both.) Tokens of type
3 (control: ``<|endoftext|>``, ``<|im_start|>``, ...) are registered as special tokens so that
they are matched whole in text.

SentencePiece-style BPE (``tokenizer.ggml.model`` = ``"llama"``). The file holds the pieces with
their scores and types, no merges: spaces become "▁" (no prefix space when
``tokenizer.ggml.add_space_prefix`` is false, as for Gemma 3), then the adjacent pair whose
concatenation is the piece of highest score merges first (SentencePiece's BPE rule, written here
as BPE merges ranked by that score; ties: the lower ids of the left, then right piece), and
characters outside the vocabulary fall back to their UTF-8 bytes ``<0xXX>``. Control pieces are
special tokens and user-defined pieces (Gemma's newline runs, space runs, HTML tags) plain added
tokens, both matched whole, the longest first. Gemma's GGUF spells its pieces of several spaces
with real spaces: they are respelled with "▁" (transformers' GGUF conversion notes the same).
On the pydoc and code texts the ids equal those of transformers' tokenizer from the same file
except inside runs of more than 31 spaces, which transformers joins by BPE merges instead of
longest pieces first (tools/make_gguf_fixtures.py records the comparison). Only the pre-tokenizer
``default`` is implemented for this kind.
"""
from kvquant.models.gguf_config import gguf_field

__all__ = ["tokenizer_from_gguf"]

NORMAL_TOKEN_TYPE = 1
CONTROL_TOKEN_TYPE = 3
USER_DEFINED_TOKEN_TYPE = 4
SPACE_PIECE = "\u2581"
# llama.cpp pre-tokenizers: these split every digit on its own before the GPT-2 regex ...
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
# ... these split text with their own regex (llama.cpp's src/llama-vocab.cpp: Llama 3's groups
# runs of up to three digits, Qwen 2's splits every digit), then map bytes as GPT-2 does ...
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
QWEN2_SPLIT = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
REGEX_SPLIT_PRE = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
# ... and this one is the GPT-2 regex alone.
SUPPORTED_PRE = DIGIT_SPLIT_PRE + tuple(REGEX_SPLIT_PRE) + ("gpt2",)


# llama.cpp's token types (llama_token_type): undefined, normal, unknown, control, user-defined,
# unused, byte; any other value is a damaged file
TOKEN_TYPES = range(0, 7)


def _field(reader, key, required=True):
    return gguf_field(reader, key, required=required,
                      missing=": it does not carry a BPE tokenizer")


def _list_field(reader, key, kind, what):
    """A list-valued tokenizer key whose items are all of ``kind`` (a type flipped by damage
    would otherwise reach the tokenizers library as a TypeError or a panic)."""
    value = _field(reader, key)
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(x, kind) and not isinstance(x, bool) for x in value):
        raise ValueError(f"{key} is not a list of {what}")
    return list(value)


def _token_types(reader, n_tokens):
    """``tokenizer.ggml.token_type``: one of llama.cpp's token types per token."""
    types = _list_field(reader, "tokenizer.ggml.token_type", int, "integers")
    if len(types) != n_tokens:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n_tokens} "
                         "tokens")
    for i, t in enumerate(types):
        if t not in TOKEN_TYPES:
            raise ValueError(f"tokenizer.ggml.token_type[{i}] is {t}; token types are "
                             f"{TOKEN_TYPES.start}..{TOKEN_TYPES.stop - 1}")
    return types


def tokenizer_from_gguf(reader):
    """Build a ``tokenizers.Tokenizer`` from a :class:`~kvquant.models.gguf_file.GGUFFile`.

    Returns
    -------
    tokenizers.Tokenizer
        Encodes text to the model's ids (never adding BOS: the model does, when the file's
        ``tokenizer.ggml.add_bos_token`` asks for it) and decodes ids to text.
    """
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ImportError("the real model's tokenizer needs the 'tokenizers' package: "
                          "pip install -e '.[models]' in the kvquant source tree") from None
    kind = _field(reader, "tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_bpe(reader)
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {kind!r}; implemented: byte-level BPE ('gpt2') "
                         "and SentencePiece-style BPE with scores ('llama')")
    pre = _field(reader, "tokenizer.ggml.pre", required=False)
    if pre not in SUPPORTED_PRE:
        raise ValueError(
            f"pre-tokenizer {pre!r} is not supported (known: {', '.join(SUPPORTED_PRE)})")
    tokens = _list_field(reader, "tokenizer.ggml.tokens", str, "strings")
    types = _token_types(reader, len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary holds duplicate tokens")
    merges = []
    for i, m in enumerate(_list_field(reader, "tokenizer.ggml.merges", str, "strings")):
        # "left right", both tokens of the vocabulary, and their concatenation too (checked
        # here: the tokenizers library raises a bare Exception, or panics, on a bad one)
        pair = tuple(m.split(" ", 1)) if isinstance(m, str) else ()
        if len(pair) != 2 or not all(pair) or not all(p in vocab for p in pair) or (
                pair[0] + pair[1]) not in vocab:
            raise ValueError(f"tokenizer.ggml.merges[{i}] is {m!r}: a merge is two tokens of "
                             "the vocabulary separated by one space, whose concatenation is a "
                             "token too")
        merges.append(pair)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in REGEX_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(REGEX_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def _sentencepiece_merges(pieces, scores, types):
    """BPE merges (left, right) of a SentencePiece vocabulary, highest-scoring result first."""
    ids = {p: i for i, p in enumerate(pieces)}
    mergeable = {p for p, t in zip(pieces, types) if t == NORMAL_TOKEN_TYPE}
    ranked = []
    for piece, score, kind in zip(pieces, scores, types):
        if kind != NORMAL_TOKEN_TYPE or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(reader):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    pre = _field(reader, "tokenizer.ggml.pre", required=False)
    if pre not in (None, "default"):
        raise ValueError(f"pre-tokenizer {pre!r} is not supported for SentencePiece-style "
                         "vocabularies (known: 'default')")
    if _field(reader, "tokenizer.ggml.add_space_prefix", required=False) is not False:
        raise ValueError("tokenizer.ggml.add_space_prefix is not false: a SentencePiece prefix "
                         "space is not implemented")
    pieces = _list_field(reader, "tokenizer.ggml.tokens", str, "strings")
    scores = [float(x) for x in _list_field(reader, "tokenizer.ggml.scores", (int, float),
                                            "numbers")]
    if len(scores) != len(pieces):
        raise ValueError("tokenizer.ggml.tokens, scores and token_type differ in length")
    types = _token_types(reader, len(pieces))
    pieces = [SPACE_PIECE * len(p) if p and not p.strip(" ") else p for p in pieces]
    vocab = {}
    for i, p in enumerate(pieces):
        vocab.setdefault(p, i)
    if len(vocab) != len(pieces):
        raise ValueError("the GGUF vocabulary holds duplicate tokens")
    unk = _field(reader, "tokenizer.ggml.unknown_token_id", required=False)
    if unk is not None and (isinstance(unk, bool) or not isinstance(unk, int)
                            or not 0 <= unk < len(pieces)):
        raise ValueError(f"tokenizer.ggml.unknown_token_id is {unk!r}; the vocabulary's ids are "
                         f"0..{len(pieces) - 1}")
    model = models.BPE(vocab=vocab, merges=_sentencepiece_merges(pieces, scores, types),
                       byte_fallback=True, fuse_unk=True,
                       unk_token=None if unk is None else pieces[int(unk)])
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SPACE_PIECE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False)
                            for p, t in zip(pieces, types) if t == CONTROL_TOKEN_TYPE])
    # user-defined pieces match the normalized text (spaces as "▁"), longest first
    tok.add_tokens([AddedToken(p, special=False, normalized=True)
                    for p, t in zip(pieces, types) if t == USER_DEFINED_TOKEN_TYPE])
    return tok
