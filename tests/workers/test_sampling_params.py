import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.protocol.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        16,
        0,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert p.seed is None and p.logprobs is None
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == () and p.stop_token_ids == ()
    assert p.ignore_eos is False and p.skip_special_tokens is True
    assert not p.is_greedy and not p.has_penalties


def test_normalises_stop_ids_and_number_types():
    p = SamplingParams(stop="###", stop_token_ids=[3, np.int64(7)], temperature=1, seed=np.int32(5))
    assert p.stop == ("###",)
    assert p.stop_token_ids == (3, 7) and all(type(t) is int for t in p.stop_token_ids)
    assert type(p.temperature) is float and type(p.seed) is int
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    hash(p)  # tuples keep it hashable


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_is_greedy_and_has_penalties():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.1).has_penalties


def test_edge_values_are_valid():
    # Accepted and kept as given: neither refused nor clamped to a nearby value.
    p = SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0)
    assert (p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty) == (
        1.0,
        -1,
        1.0,
        2.0,
        -2.0,
    )
    p = SamplingParams(max_tokens=None, min_tokens=1000, logprobs=20, seed=-1)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (None, 1000, 20, -1)
    p = SamplingParams(max_tokens=5, min_tokens=5, logprobs=0, seed=2**64 - 1)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (5, 5, 0, 2**64 - 1)


BAD = [
    ({"temperature": -0.1}, "temperature", "-0.1"),
    ({"top_p": 0.0}, "top_p", "0.0"),
    ({"top_p": 1.5}, "top_p", "1.5"),
    ({"top_k": -2}, "top_k", "-2"),
    ({"top_k": 2.5}, "top_k", "2.5"),
    ({"min_p": -0.1}, "min_p", "-0.1"),
    ({"min_p": 1.1}, "min_p", "1.1"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
    ({"presence_penalty": -2.01}, "presence_penalty", "-2.01"),
    ({"frequency_penalty": 3.0}, "frequency_penalty", "3.0"),
    ({"frequency_penalty": -3.0}, "frequency_penalty", "-3.0"),
    ({"max_tokens": 0}, "max_tokens", "0"),
    ({"max_tokens": 1.5}, "max_tokens", "1.5"),
    ({"min_tokens": -1}, "min_tokens", "-1"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens", "17"),
    ({"logprobs": -1}, "logprobs", "-1"),
    ({"logprobs": 21}, "logprobs", "21"),
    ({"stop": ["ok", ""]}, "stop", "''"),
    ({"stop": [1]}, "stop", "1"),
    ({"stop": 5}, "stop", "5"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids", "-3"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids", "1.0"),
    ({"stop_token_ids": "12"}, "stop_token_ids", "12"),
    ({"seed": 1.5}, "seed", "1.5"),
    ({"seed": "42"}, "seed", "42"),
    ({"seed": True}, "seed", "True"),
    ({"seed": 2**64}, "seed", str(2**64)),
    ({"temperature": "1"}, "temperature", "'1'"),
    ({"temperature": None}, "temperature", "None"),
    ({"ignore_eos": 1}, "ignore_eos", "1"),
]


@pytest.mark.parametrize(("kwargs", "field", "value"), BAD, ids=[b[1] for b in BAD])
def test_bad_values_name_field_and_value(kwargs, field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value)
    assert value in str(err.value)


FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_rejected(field, value):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: value})
    assert repr(value) in str(err.value)


def test_validate_for_model():
    p = SamplingParams(stop_token_ids=[0, 99])
    p.validate_for_model(100)
    with pytest.raises(ValueError, match="stop_token_ids") as err:
        p.validate_for_model(99)
    assert "99" in str(err.value)


@given(
    temperature=st.floats(0, 10),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 1000),
    min_p=st.floats(0, 1),
    penalty=st.floats(-2, 2),
    repetition=st.floats(0.01, 10),
    max_tokens=st.integers(1, 10_000),
)
def test_valid_ranges_never_raise(
    temperature, top_p, top_k, min_p, penalty, repetition, max_tokens
):
    p = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        presence_penalty=penalty,
        frequency_penalty=-penalty,
        repetition_penalty=repetition,
        max_tokens=max_tokens,
        min_tokens=max_tokens,
    )
    assert p.is_greedy == (temperature < 1e-5)
