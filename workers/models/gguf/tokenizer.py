"""A GGUF file's tokenizer metadata as a ``tokenizers`` tokenizer and its config.

GGUF stores no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``),
each token's type (normal, control, user-defined, byte), the BPE merges or, for
SentencePiece vocabularies, a score per token, the special ids and the chat template.
Two models cover the files we serve:

- ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen2/3). How text is split into words before
  the merges is not in the vocabulary: llama.cpp names it (``tokenizer.ggml.pre``) and keeps
  one regex list per name (``llama-vocab.cpp``); the ones we know are below, an unknown
  name is refused (a wrong split would silently change every prompt's tokens). ``smollm``
  splits digits one by one as llama.cpp does and as SmolLM2's own tokenizer does
  (transformers' GGUF loader uses the plain GPT-2 split there, so the two differ on
  numbers of two digits or more).
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral): the merges are
  recovered from the scores (a merge's rank is the score of the token it makes, as
  SentencePiece's own BPE ranks it), spaces become U+2581, a space is prepended unless
  ``tokenizer.ggml.add_space_prefix`` says not.

Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain
added tokens, so ``<|im_start|>`` is never cut into pieces. BOS is added by the
post-processor where ``tokenizer.ggml.add_bos_token`` (default: on for SentencePiece, off
for byte-level) says so, as llama.cpp does.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by tokenizer.ggml.pre.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
}


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes; ValueError naming what is unsupported."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    if kind == "gpt2":
        tokenizer = _byte_level(meta, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece(meta, tokens)
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
            "llama (SentencePiece BPE)"
        )
    _add_special_tokens(tokenizer, meta, tokens, byte_level=kind == "gpt2")
    if add_bos_token(meta):
        bos = tokens[int(meta["tokenizer.ggml.bos_token_id"])]
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def add_bos_token(meta: dict[str, Any]) -> bool:
    """Whether encoding a prompt starts it with BOS (llama.cpp's default per model)."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    flag = meta.get("tokenizer.ggml.add_bos_token", default)
    return bool(flag) and "tokenizer.ggml.bos_token_id" in meta


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: the special tokens by text and the chat template."""
    tokens = meta.get("tokenizer.ggml.tokens") or ()
    config: dict[str, Any] = {"add_bos_token": add_bos_token(meta)}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):  # fmt: skip
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[int(token_id)] if token_id is not None else None
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _byte_level(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _SPLITS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_SPLITS))}"
        )
    # Byte-level vocabularies spell every byte as a printable character (GPT-2's table);
    # a few files store some tokens unspelled: spell those as the table does.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode())): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    splits = _SPLITS[pre]
    if splits == [_GPT2_SPLIT]:  # ByteLevel's own regex is GPT-2's
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        steps: list[Any] = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF SentencePiece tokenizer without tokenizer.ggml.scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    pairs = (
        [tuple(m.split(" ", 1)) for m in merges] if merges else _merges_from_scores(tokens, scores)
    )
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a vocabulary token into two vocabulary tokens, ranked
    by the joined token's score, best first, which is the order SentencePiece's BPE
    applies them in; among equal scores longer left parts first, then longer right parts,
    then vocabulary order (as transformers ranks them, so the two agree)."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[float, str, str]] = []
    for tok, score in zip(tokens, scores, strict=True):
        splits = [(tok[:cut], tok[cut:]) for cut in range(1, len(tok))]
        splits = [(a, b) for a, b in splits if a in ids and b in ids]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked.extend((score, a, b) for a, b in splits)
    ranked.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))  # stable: ties keep order
    return [(a, b) for _, a, b in ranked]


def _add_special_tokens(
    tokenizer: Tokenizer, meta: dict[str, Any], tokens: list[str], byte_level: bool
) -> None:
    types = meta.get("tokenizer.ggml.token_type") or ()
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control, user = [], []
    for tok, kind in zip(tokens, types, strict=False):
        if kind == _CONTROL and (alphabet is None or set(tok) <= alphabet):
            control.append(AddedToken(tok, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            user.append(AddedToken(tok, special=False, normalized=False))
    # Already in the vocabulary: added tokens keep their ids, and are matched whole.
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte as a printable character (printable Latin-1 bytes as
    themselves, the others from U+0100 up, in byte order)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
