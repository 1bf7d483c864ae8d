"""Tokenizer of a Hugging Face model directory, over the `tokenizers` library.

Reads ``tokenizer.json`` (the fast-tokenizer file every current model ships) and the
special-token ids from ``generation_config.json`` / ``config.json`` /
``tokenizer_config.json``. The router tokenizes at the edge and detokenizes the
stream (see ``workers.text.detokenizer``); workers only see token ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers


class Tokenizer:
    """Encode/decode text for one model, plus its BOS/EOS/special token ids.

    ``backend`` is the underlying ``tokenizers.Tokenizer`` (the detokenizer decodes
    windows of ids with it directly).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(
            token_id for token_id, token in added.items() if token.special
        )
        # decode([id]) per skip_special_tokens, filled as ids are seen (at most the vocab).
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``model_dir/tokenizer.json`` and the special-token ids beside it.

        EOS ids come from the first of: ``generation_config.json`` ``eos_token_id``
        (int or list), ``config.json`` ``eos_token_id``, ``tokenizer_config.json``
        ``eos_token`` (a token string, mapped to its id). BOS comes from
        ``tokenizer_config.json`` ``bos_token`` when that key is present (``null``
        there means the tokenizer has none, as for Qwen), else from the configs.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"no tokenizer.json in {model_dir} (Baton needs a fast-tokenizer file; "
                "convert the model's tokenizer with transformers' save_pretrained)"
            )
        backend = tokenizers.Tokenizer.from_file(str(path))
        generation_config = _read_json(model_dir / "generation_config.json")
        config = _read_json(model_dir / "config.json")
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")

        eos_ids = _id_set(generation_config.get("eos_token_id"))
        if not eos_ids:
            eos_ids = _id_set(config.get("eos_token_id"))
        if not eos_ids:
            eos_ids = _id_set(_token_id(backend, tokenizer_config.get("eos_token")))

        if "bos_token" in tokenizer_config:
            bos_id = _token_id(backend, tokenizer_config["bos_token"])
        else:
            bos_id = generation_config.get("bos_token_id", config.get("bos_token_id"))
        return cls(backend, bos_id, frozenset(eos_ids))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; the post-processor adds BOS where the tokenizer says so."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (invalid or incomplete UTF-8 shows as U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, cached: the router's detokenizer needs one token's text
        on its own at nearly every step, and a lookup costs a fraction of a decode call."""
        cache = self._token_texts[skip_special_tokens]
        text = cache.get(token_id)
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=skip_special_tokens)
            cache[token_id] = text
        return text

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _token_id(backend: tokenizers.Tokenizer, token: str | dict[str, Any] | None) -> int | None:
    """Id of a special token as tokenizer_config.json names it (a string or an AddedToken dict)."""
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    return backend.token_to_id(token)


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int], vocab_size: int) -> list[int]:
    """A prompt (text, or token ids) as token ids; ValueError naming what is wrong."""
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        token_ids = list(prompt)
    else:
        raise ValueError("prompt must be a string or a list of int token ids")
    if not token_ids:
        raise ValueError("prompt is empty")
    # Also for text: a tokenizer with ids past the model's embedding would otherwise
    # fail inside a step, for every request in the batch.
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of vocabulary [0, {vocab_size}): {bad[:5]}")
    return token_ids
