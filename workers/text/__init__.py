"""Text in and out: the tokenizer (Hugging Face `tokenizer.json`) and the incremental
detokenizer that turns streamed token ids into text.

May import: `tokenizers` and the standard library; nothing else of `workers/` and no torch
(the router tokenizes and detokenizes too).
"""
