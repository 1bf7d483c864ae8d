"""The tokenizer Baton builds from a GGUF file's metadata against transformers' GGUF
tokenizer of the same file (and the tokenizer.json it was written from), on a text
corpus: byte-level BPE with each pre-tokenizer we know, and SentencePiece BPE with merges
recovered from the scores; special tokens kept whole; unknown kinds refused by name."""

from __future__ import annotations

import json

import gguf
import pytest
import tokenizers
import transformers

from cluster.tools.corpus import corpus_lines
from cluster.tools.make_model import build_tokenizer
from tests.workers.gguf.files import add_tokenizer
from workers.models.gguf.tokenizer import build_tokenizer as build_gguf_tokenizer

TRICKY = [
    "Numbers 12345 and 3.14159, years 1999-2024, 007.",
    "  leading spaces,\ttabs,\n\nnewlines \r\n and trailing  ",
    "Ünïcödé façade — naïve café; Ελληνικά, кириллица, 日本語のテキスト, 한국어",
    "emoji 🎉🚀 and mixed 'quotes' it's we're they'll I'd",
    "def f(x):\n    return x ** 2  # comment\n",
]
CORPUS = [line for i, line in enumerate(corpus_lines()) if i % 7 == 0][:300] + TRICKY


def write_tokenizer_file(path, writer_fn):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer_fn(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def ours(path) -> tokenizers.Tokenizer:
    reader = gguf.GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    return build_gguf_tokenizer(meta)


def theirs(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("pre", ["default", "qwen2", "llama-bpe"])
def test_byte_level_equals_transformers_gguf_tokenizer(pre, tmp_path):
    path = write_tokenizer_file(tmp_path / "t.gguf", lambda w: add_tokenizer(w, 512, pre))
    mine, reference = ours(path), theirs(path)
    for text in CORPUS:
        assert mine.encode(text).ids == reference.encode(text, add_special_tokens=True), text
        ids = mine.encode(text).ids
        assert mine.decode(ids) == reference.decode(ids)
    # Control tokens stay whole, as one id each.
    chat = "<|im_start|>user\nhi<|im_end|>\n"
    assert mine.encode(chat).ids == reference.encode(chat)
    assert mine.encode(chat).ids[0] == mine.token_to_id("<|im_start|>")


def test_byte_level_default_equals_the_tokenizer_it_was_written_from(tmp_path):
    path = write_tokenizer_file(tmp_path / "t.gguf", lambda w: add_tokenizer(w, 512, "default"))
    original = build_tokenizer("qwen2", 512)
    mine = ours(path)
    for text in CORPUS:
        assert mine.encode(text).ids == original.encode(text).ids, text


def test_smollm_splits_digits_one_by_one(tmp_path):
    """llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer) never joins digits,
    even where the merges could: trained on many numbers, the vocabulary has digit pairs,
    which the "default" split uses and "smollm" does not."""
    lines = [*corpus_lines(), *["12 34 56 78 90 1234 5678 2024 " * 20] * 50]
    text = "In 2024, 1234 people"
    pieces = {}
    for pre in ("default", "smollm"):
        path = write_tokenizer_file(
            tmp_path / f"{pre}.gguf", lambda w, pre=pre: add_tokenizer(w, 400, pre, lines)
        )
        mine = ours(path)
        pieces[pre] = [mine.decode([i]) for i in mine.encode(text).ids]
        assert "".join(pieces[pre]) == text
    digit_pieces = [p.strip() for p in pieces["smollm"] if any(c.isdigit() for c in p)]
    assert all(len(p) == 1 for p in digit_pieces) and len(digit_pieces) == 8
    assert any(len(p.strip()) > 1 and p.strip().isdigit() for p in pieces["default"])


def spm_metadata(writer):
    """A SentencePiece-style vocabulary (Llama 2's layout: <unk>, <s>, </s>, 256 byte
    tokens, then pieces spelled with U+2581, scored by merge order), trained here."""
    trainer = tokenizers.SentencePieceBPETokenizer()
    trainer.train_from_iterator(list(corpus_lines()), vocab_size=700, show_progress=False)
    trained = json.loads(trainer.to_str())["model"]["vocab"]
    pieces = [t for t, _ in sorted(trained.items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [p for p in pieces if p not in tokens]
    types = [2, 3, 3, *([6] * 256), *([1] * (len(tokens) - 259))]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def test_sentencepiece_equals_transformers_gguf_tokenizer(tmp_path):
    path = write_tokenizer_file(tmp_path / "spm.gguf", spm_metadata)
    mine, reference = ours(path), theirs(path)
    for text in CORPUS:
        if text[:1].isspace():
            continue  # below: transformers' Metaspace differs from llama.cpp there
        assert mine.encode(text).ids == reference.encode(text), text
        ids = mine.encode(text).ids
        assert ids[0] == 1  # BOS: llama.cpp's default for SentencePiece vocabularies
        assert mine.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )


def test_sentencepiece_prefixes_a_space_as_llama_cpp_does(tmp_path):
    """llama.cpp (like SentencePiece with Llama's settings) prefixes one space to the text
    whatever it starts with: two leading spaces become three U+2581. transformers'
    Metaspace skips the prefix when the text starts with a space."""
    mine = ours(write_tokenizer_file(tmp_path / "spm.gguf", spm_metadata))
    pieces = mine.encode("  leading").tokens[1:]  # after BOS
    assert "".join(pieces) == "\u2581\u2581\u2581leading"


def test_unknown_kinds_are_refused_by_name(tmp_path):
    def bad_pre(writer):
        add_tokenizer(writer, 300, "some-new-pre")

    with pytest.raises(ValueError, match="pre-tokenizer 'some-new-pre' is not supported"):
        ours(write_tokenizer_file(tmp_path / "a.gguf", bad_pre))

    def bad_model(writer):
        writer.add_tokenizer_model("rwkv")
        writer.add_token_list(["a", "b"])

    with pytest.raises(ValueError, match="tokenizer model 'rwkv' is not supported"):
        ours(write_tokenizer_file(tmp_path / "b.gguf", bad_model))
