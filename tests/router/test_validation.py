"""Validation of a protobuf request (converted as the gRPC servicer does): each bad field
is refused with a message naming its proto path."""

from __future__ import annotations

import math

import pytest

from proto.baton.v1 import inference_pb2 as pb
from router.server import generate_request
from router.validation import InvalidRequest, ValidRequest, check_length, validate

MODEL = "tiny"


def validate_pb(req: pb.GenerateRequest, served_model: str, request_id: str) -> ValidRequest:
    return validate(generate_request(req), served_model, request_id)


def request(**fields) -> pb.GenerateRequest:
    fields.setdefault("text", "hello")
    return pb.GenerateRequest(**fields)


def test_a_good_request_maps_every_field():
    req = request(
        sampling=pb.SamplingParams(
            temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=3, speculative=False
        ),
        stopping=pb.StoppingCriteria(max_tokens=12, min_tokens=2, stop=["\n"], ignore_eos=True),
        output=pb.OutputOptions(logprobs=3, return_text=False, return_timing=True),
        disaggregation=pb.DISAGGREGATION_ALWAYS,
    )
    valid = validate_pb(req, MODEL, "r1")
    p = valid.params
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.5, pytest.approx(0.9), 40, 3)
    assert (p.max_tokens, p.min_tokens, p.stop, p.ignore_eos) == (12, 2, ("\n",), True)
    assert p.logprobs == 3 and not valid.return_text and valid.return_timing
    assert p.speculative is False  # the per-request opt-out
    assert valid.disaggregation == "always" and valid.prompt == "hello"


def test_unset_fields_take_defaults():
    valid = validate_pb(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), MODEL, "r2")
    assert valid.prompt == [5, 6] and valid.return_text and valid.disaggregation is None
    assert valid.params.max_tokens is None and valid.params.temperature == 1.0
    assert valid.params.speculative is True  # unset: the decode pool's setting applies


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"sampling": pb.SamplingParams(temperature=-1)}, "sampling.temperature"),
        ({"sampling": pb.SamplingParams(temperature=math.nan)}, "sampling.temperature"),
        ({"sampling": pb.SamplingParams(top_p=0)}, "sampling.top_p"),
        ({"sampling": pb.SamplingParams(top_p=1.5)}, "sampling.top_p"),
        ({"sampling": pb.SamplingParams(top_k=-2)}, "sampling.top_k"),
        ({"sampling": pb.SamplingParams(min_p=1.5)}, "sampling.min_p"),
        ({"sampling": pb.SamplingParams(repetition_penalty=0)}, "sampling.repetition_penalty"),
        ({"sampling": pb.SamplingParams(presence_penalty=2.5)}, "sampling.presence_penalty"),
        ({"sampling": pb.SamplingParams(frequency_penalty=-2.5)}, "sampling.frequency_penalty"),
        ({"stopping": pb.StoppingCriteria(max_tokens=0)}, "stopping.max_tokens"),
        ({"stopping": pb.StoppingCriteria(max_tokens=2, min_tokens=5)}, "stopping.min_tokens"),
        ({"stopping": pb.StoppingCriteria(stop=[""])}, "stopping.stop"),
        ({"stopping": pb.StoppingCriteria(stop=["x"] * 17)}, "stopping.stop"),
        ({"output": pb.OutputOptions(logprobs=21)}, "output.logprobs"),
        ({"text": ""}, "text: the prompt is empty"),
        ({"model": "other"}, "model: unknown model 'other'"),
    ],
)
def test_each_bad_field_is_named(fields, path):
    with pytest.raises(InvalidRequest, match=f"^{path}"):
        validate_pb(request(**fields), MODEL, "r")


def test_missing_prompt_and_empty_token_ids():
    with pytest.raises(InvalidRequest, match=r"^prompt: set either"):
        validate_pb(pb.GenerateRequest(), MODEL, "r")
    with pytest.raises(InvalidRequest, match=r"^token_ids: the prompt is empty"):
        validate_pb(pb.GenerateRequest(token_ids=pb.TokenIds()), MODEL, "r")


def test_length_checks_after_tokenization():
    params = validate_pb(request(stopping=pb.StoppingCriteria(max_tokens=10)), MODEL, "r").params
    check_length(90, params, 100)
    with pytest.raises(InvalidRequest, match=r"^stopping\.max_tokens: prompt \(91 tokens\)"):
        check_length(91, params, 100)
    with pytest.raises(InvalidRequest, match=r"^prompt: 100 tokens leave no room"):
        check_length(100, validate_pb(request(), MODEL, "r").params, 100)


class _Tokenizer:
    """Encodes every character to its code point: ids past a small vocabulary."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize(
    ("prompt", "named"),
    [({"text": "hé"}, "text"), ({"token_ids": pb.TokenIds(ids=[3, 500])}, "token_ids")],
)
def test_prompt_ids_outside_the_vocabulary_name_the_prompt_field(prompt, named):
    from router.validation import prompt_token_ids

    valid = validate_pb(pb.GenerateRequest(**prompt), "m", "r1")
    with pytest.raises(InvalidRequest, match=rf"^{named}: ids out of vocabulary \[0, 200\)"):
        prompt_token_ids(valid, _Tokenizer(), vocab_size=200, max_model_len=64)
    ok = validate_pb(pb.GenerateRequest(text="hi"), "m", "r2")
    assert prompt_token_ids(ok, _Tokenizer(), vocab_size=200, max_model_len=64) == [104, 105]


# ---- found by the fuzzers (tests/router/test_fuzz_*.py) -----------------------------------
# The typed request directly: HTTP's JSON can carry what protobuf cannot (negative ids,
# lone surrogates).


def test_negative_token_ids_are_out_of_vocabulary():
    from router.requests import GenerateRequest
    from router.validation import prompt_token_ids

    valid = validate(GenerateRequest(prompt=(3, -1)), "m", "r")
    with pytest.raises(InvalidRequest, match=r"^token_ids: ids out of vocabulary .*\[-1\]"):
        prompt_token_ids(valid, _Tokenizer(), vocab_size=200, max_model_len=64)


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"prompt": "a\ud800b"}, "text"),
        ({"stopping": {"stop": ("ok", "\udfff")}}, "stopping.stop"),
    ],
)
def test_lone_surrogates_are_not_valid_unicode(fields, path):
    from router.requests import GenerateRequest, StoppingOptions

    if "stopping" in fields:
        fields = {"prompt": "hi", "stopping": StoppingOptions(**fields["stopping"])}
    with pytest.raises(InvalidRequest, match=rf"^{path}: not valid Unicode"):
        validate(GenerateRequest(**fields), MODEL, "r")


def test_a_long_request_id_is_refused_and_a_long_model_is_quoted_short():
    with pytest.raises(InvalidRequest, match=r"^request_id: at most 256 characters"):
        validate_pb(request(), MODEL, "x" * 257)
    with pytest.raises(InvalidRequest, match=r"^model: ") as refused:
        validate_pb(request(model="m" * 2**20), MODEL, "r")
    assert len(str(refused.value)) < 200 and f"({2**20} characters)" in str(refused.value)


def test_integers_past_what_the_wire_carries_are_refused():
    # JSON integers are unbounded; msgpack (router -> workers) stops at 64 bits.
    from router.requests import GenerateRequest, SamplingOptions, StoppingOptions

    big = GenerateRequest(prompt="hi", sampling=SamplingOptions(top_k=2**70))
    with pytest.raises(InvalidRequest, match=r"^sampling\.top_k: at most 2147483647"):
        validate(big, MODEL, "r")
    params = validate(
        GenerateRequest(prompt="hi", stopping=StoppingOptions(min_tokens=2**70)), MODEL, "r"
    ).params
    with pytest.raises(InvalidRequest, match=r"^stopping\.min_tokens: \d+ exceeds max_model_len"):
        check_length(5, params, 100)
