"""Developer tools outside the serving path: `baton make-model` (Hugging Face–format models
with random weights and a real byte-level BPE tokenizer) and the corpus it trains that
tokenizer on.

May import: torch, safetensors, tokenizers; nothing of the serving path.
"""
