"""Small GGUF files for the tests, written with the ``gguf`` package's writer as llama.cpp's
``convert_hf_to_gguf.py`` writes them (its tensor names, its Q/K row order for Llama, its
metadata keys), from a random Hugging Face model and a byte-level BPE tokenizer trained on
the spot. Independent of the code under test: the names and the permutation are spelled
out here again, from llama.cpp's converter.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from cluster.tools.make_model import build_tokenizer

ARCH_GGUF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
K_QUANT_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}  # per block of 256


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: halves -> interleaved pairs, per head."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def encode(weight: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The tensor's data for ``qtype``. K-quant blocks (which gguf-py only decodes) are
    random bytes with small half-precision block scales, so the tensor is those blocks'
    values rather than ``weight``'s (both loaders read the same blocks)."""
    if qtype == Q.F32:
        return weight.astype(np.float32)
    if qtype == Q.F16:
        return weight.astype(np.float16)
    if qtype in K_QUANT_BYTES:
        rows, cols = weight.shape
        blocks = rng.integers(0, 256, (rows, cols // 256, K_QUANT_BYTES[qtype]), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
        if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d
            blocks[..., -2:] = scale
        else:  # d, dmin first
            blocks[..., 0:2] = scale
            blocks[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(weight.astype(np.float32), qtype)


def write_gguf(
    path: Path,
    hf_model: torch.nn.Module,
    arch: str,
    qtype: Q,
    tokenizer_pre: str = "default",
    seed: int = 0,
) -> Path:
    """``hf_model`` (a transformers model) as a GGUF file whose 2-D weights are ``qtype``
    (norms and biases stay F32, as llama.cpp keeps them)."""
    config = hf_model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), ARCH_GGUF[arch])
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(1 if qtype == Q.F16 else 0 if qtype == Q.F32 else 3)
    add_tokenizer(writer, config.vocab_size, tokenizer_pre)
    state = hf_model.state_dict()
    tied = config.tie_word_embeddings
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue
        weight = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            weight = llama_cpp_permute(weight, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = llama_cpp_permute(weight, config.num_key_value_heads)
        kind = qtype if weight.ndim == 2 else Q.F32
        data = encode(weight, kind, rng)
        writer.add_tensor(gguf_name(name), data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tokenizer(
    writer: gguf.GGUFWriter, vocab_size: int, pre: str, lines: list[str] | None = None
) -> None:
    """A byte-level BPE (ChatML specials at ids 0-2) trained on ``lines`` (default: the
    make-model corpus), as llama.cpp writes a ``gpt2`` tokenizer's metadata."""
    tok = json.loads(build_tokenizer("qwen2", vocab_size, lines=lines).to_str())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {added["content"] for added in tok["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
