"""The tokenizer files of a ``baton make-model`` directory: a byte-level BPE trained on the
spot on ``cluster.tools.corpus`` (deterministic) with exactly the model's vocabulary, its
tokenizer_config.json (the family's chat template and special tokens) and the
generation_config.json that names its end-of-sequence ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from cluster.tools.corpus import corpus_lines
from cluster.tools.families import FAMILIES, Family


def build_tokenizer(arch: str, vocab_size: int, lines: Iterable[str] | None = None) -> Tokenizer:
    """Train the byte-level BPE tokenizer of ``arch`` with exactly ``vocab_size`` ids on
    ``lines`` (default: ``cluster.tools.corpus``).

    Special tokens take ids 0..; llama and mistral add BOS in the post-processor, qwen
    adds nothing (as their real tokenizers do).
    """
    family = FAMILIES[arch]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines() if lines is None else lines, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the corpus yields {tokenizer.get_vocab_size()} tokens, fewer than {vocab_size}"
        )
    byte_level = processors.ByteLevel(trim_offsets=False)
    if family.tokenizer_bos is None:
        tokenizer.post_processor = byte_level
    else:
        bos = family.tokenizer_bos
        bos_id = family.special_tokens.index(bos)
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, family: Family, config: Mapping[str, Any]) -> dict:
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    chat = {"chat_template": family.chat_template} if family.chat_template else {}
    return {
        **chat,
        "added_tokens_decoder": added,
        "bos_token": family.tokenizer_bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": family.tokenizer_eos,
        "model_max_length": config["max_position_embeddings"],
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def generation_config(config: Mapping[str, Any], family: Family) -> dict[str, Any]:
    eos_ids = [family.special_tokens.index(token) for token in family.eos]
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
    }
