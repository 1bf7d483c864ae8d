import json
from pathlib import Path

import pytest

from cluster.tools.make_model import make_model
from workers.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch, "tiny") for arch in ("llama", "qwen2", "mistral")}


def test_llama_adds_bos_and_reads_eos_list(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["llama"])
    assert tok.bos_token_id == 0  # <|begin_of_text|>
    assert tok.eos_token_ids == frozenset({1, 2})  # generation_config: a list
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>Hello world"


def test_qwen_adds_no_bos(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["qwen2"])
    assert tok.bos_token_id is None  # tokenizer_config.json: "bos_token": null
    assert tok.eos_token_ids == frozenset({2, 0})  # <|im_end|>, <|endoftext|>
    assert tok.encode("Hello world") == tok.encode("Hello world", add_special_tokens=False)


def test_vocab_size_and_special_ids(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["mistral"])
    config = json.loads((model_dirs["mistral"] / "config.json").read_text())
    assert tok.vocab_size == config["vocab_size"]
    assert tok.all_special_ids == frozenset({0, 1, 2})  # <unk> <s> </s>
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})


def test_round_trip_multibyte(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["llama"])
    text = "Grüße aus München 😀 今天天气很好"
    assert tok.decode(tok.encode(text)) == text


def test_eos_fallbacks(model_dirs, tmp_path):
    src = model_dirs["mistral"]
    (tmp_path / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    # No configs at all: nothing known.
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == frozenset()
    assert tok.bos_token_id is None
    # tokenizer_config.json's eos_token string (an AddedToken dict works too).
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>"})
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id == 1
    # config.json wins over tokenizer_config.json, generation_config.json over both.
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == frozenset({0})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == frozenset({1, 2})


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
