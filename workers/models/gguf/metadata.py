"""A GGUF file's metadata as the ``config.json`` / ``generation_config.json`` Baton reads.

llama.cpp names a model's hyperparameters ``<arch>.<key>`` (``llama.block_count``,
``qwen2.attention.head_count_kv``, ...); the mapping below is llama.cpp's own
(``gguf-py``'s ``Keys``) onto the Hugging Face config keys ``workers/models/arch_config.py``
reads. Mistral files say ``llama`` (llama.cpp converts them as Llama; the sliding window of
Mistral 7B v0.1 is not in the file and llama.cpp does not apply it either).

What we cannot serve exactly is refused here, by name, rather than served wrong: an
architecture other than llama / qwen2 / qwen3, a partial rotary dimension, RoPE scaling
other than linear, and a Llama 3.1 ``rope_freqs`` tensor (its frequency factors).
"""

from __future__ import annotations

from typing import Any

# general.architecture -> the Hugging Face architecture it is served as.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field of a ``gguf.GGUFReader`` as a Python value (strings decoded,
    arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


# Tensor types (gguf's GGMLQuantizationType names) kept as they are, on the INT4 path.
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def hf_config(
    meta: dict[str, Any], tensor_names: set[str], tensor_types: dict[str, str] | None = None
) -> dict[str, Any]:
    """``config.json`` for the model in a GGUF file; ValueError naming what is unsupported.
    ``tensor_types`` (name -> type name): with Q4_0 / Q4_1 / Q4_K matrices in it, the config says
    ``quantization_config: {quant_method: gguf}``, so those load as int4, as stored
    (``workers/models/quant/formats.py``)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"GGUF rotary dimension {rope_dim} != head_dim {head_dim}: not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "GGUF file has rope_freqs (Llama 3.1 RoPE frequency factors): not supported yet"
        )
    vocab_size = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    if not vocab_size:
        raise ValueError(f"GGUF file has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        # llama.cpp writes no output.weight when the LM head is the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "dtype": _dtype_name(meta),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF RoPE scaling {scaling!r} is not supported (linear only)")
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(key("rope.scaling.factor")),
        }
    for name in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{name}" in meta:
            config[name] = int(meta[f"tokenizer.ggml.{name}"])
    if any(
        kind in Q4_TYPES for name, kind in (tensor_types or {}).items() if name.startswith("blk.")
    ):
        config["quantization_config"] = {"quant_method": "gguf", "bits": 4, "group_size": 32}
    return config


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json``: the ids a generation starts and stops at."""
    out: dict[str, Any] = {}
    for name in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{name}" in meta:
            out[name] = int(meta[f"tokenizer.ggml.{name}"])
    return out


# general.file_type (llama.cpp's LLAMA_FTYPE) of the unquantized files: the model dtype
# they were written in. Every quantized file is served in float32 (its blocks dequantized).
_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def _dtype_name(meta: dict[str, Any]) -> str:
    return _FILE_TYPES.get(int(meta.get("general.file_type", 0)), "float32")
