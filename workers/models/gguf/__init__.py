"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package.

A GGUF file holds what a Hugging Face directory spreads over several files: the
architecture (metadata keys such as ``llama.block_count``), the tokenizer (vocabulary,
merges, special ids, chat template) and the weights, most of them quantized in blocks
(Q4_1, Q8_0, Q4_K, ...). Baton serves one by deriving, once per file, a small Hugging Face
*view* of it in the cache directory (``derive.py``): ``config.json``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json`` written from the metadata, and
``model.gguf``, a link to the file itself, whose tensors the loader reads
(``tensors.py``: llama.cpp names to Hugging Face names, dequantized to float32 one tensor
at a time). Everything that reads a model directory (the router's tokenizer, the chat
template, the architecture, the KV fingerprint) then works unchanged.

- ``metadata.py``: the metadata keys -> ``config.json`` and ``generation_config.json``.
- ``tokenizer.py``: the tokenizer keys -> a ``tokenizers`` tokenizer and its config.
- ``tensors.py``: the tensors, under Hugging Face names, read lazily.
- ``derive.py``: the derived directory, written once under a file lock.
"""

from workers.models.gguf.derive import derive_model_dir, is_gguf_file

__all__ = ["derive_model_dir", "is_gguf_file"]
