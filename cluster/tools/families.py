"""The tokenizer families of the architectures `baton make-model` writes: special tokens,
BOS/EOS and chat template, as the real checkpoints of each architecture have them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """Special tokens of an architecture's tokenizer, as its real checkpoints have them."""

    special_tokens: tuple[str, ...]  # ids 0.. in this order
    bos: str
    eos: tuple[str, ...]  # generation_config eos_token_id (the first is config.json's)
    tokenizer_bos: str | None  # tokenizer_config bos_token; None: the tokenizer adds no BOS
    tokenizer_eos: str
    chat_template: str | None = None  # tokenizer_config chat_template, the real model's


# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# ChatML, as Qwen2/Qwen3 use it (without their tool-calling branches).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


_LLAMA3 = Family(
    special_tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
    ),
    bos="<|begin_of_text|>",
    eos=("<|end_of_text|>", "<|eot_id|>"),
    tokenizer_bos="<|begin_of_text|>",
    tokenizer_eos="<|end_of_text|>",
    chat_template=LLAMA3_CHAT_TEMPLATE,
)
_QWEN = Family(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos="<|endoftext|>",
    eos=("<|im_end|>", "<|endoftext|>"),
    tokenizer_bos=None,
    tokenizer_eos="<|im_end|>",
    chat_template=CHATML_TEMPLATE,
)
_MISTRAL = Family(
    special_tokens=("<unk>", "<s>", "</s>"),
    bos="<s>",
    eos=("</s>",),
    tokenizer_bos="<s>",
    tokenizer_eos="</s>",
)
# DeepSeek-V3's special tokens (full-width bars, U+2581 for spaces) and a short chat
# template in its format (the real one also renders tools and reasoning).
_DEEPSEEK = Family(
    special_tokens=(
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "<\uff5cUser\uff5c>",
        "<\uff5cAssistant\uff5c>",
    ),
    bos="<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    eos=("<\uff5cend\u2581of\u2581sentence\uff5c>",),
    tokenizer_bos="<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    tokenizer_eos="<\uff5cend\u2581of\u2581sentence\uff5c>",
    chat_template=(
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'user' %}{{ '<\uff5cUser\uff5c>' + message['content'] }}"
        "{% elif message['role'] == 'assistant' %}{{ '<\uff5cAssistant\uff5c>' + "
        "message['content'] + '<\uff5cend\u2581of\u2581sentence\uff5c>' }}"
        "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<\uff5cAssistant\uff5c>' }}{% endif %}"
    ),
)


FAMILIES = {
    "llama": _LLAMA3,
    "qwen2": _QWEN,
    "qwen3": _QWEN,
    "mistral": _MISTRAL,
    "mixtral": _MISTRAL,
    "qwen2-moe": _QWEN,
    "qwen3-moe": _QWEN,
    "deepseek-v3": _DEEPSEEK,
}
