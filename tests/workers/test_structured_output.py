"""Structured outputs: the constraint's checks (router side), its wire, and the engine's
constrained generation on a real tiny model with the real grammar library (llguidance).

Random weights do not want to write JSON: every token of their output is the grammar's
doing, so these tests see the mask at work at every position (and a bounded schema, one
with maxLength and integer bounds, is what makes them finish).
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import numpy as np
import pytest
import torch

from cluster.tools.make_model import make_model
from tests.workers import test_engine_roles as roles
from workers.engine.grammar import apply_grammar_masks
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StreamDelta
from workers.engine.request import FinishReason
from workers.engine.sampler import SamplingRow
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.structured_output import (
    MAX_SPEC_CHARS,
    StructuredOutput,
    check_structured_output,
)
from workers.protocol.wire import WorkItem, decode_as, encode

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
JSON = StructuredOutput.json_schema(SCHEMA)
REGEX = StructuredOutput("regex", r"[a-z]{3,6}-[0-9]{2}")
CHOICE = StructuredOutput("choice", choices=("apple", "banana split", "cherry"))
PROMPT = [5, 6, 7, 8, 9]


# ---- the constraint, router side ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "yaml"}, "structured.kind must be one of"),
        ({"kind": "regex"}, "structured.spec must not be empty for regex"),
        ({"kind": "json_object", "spec": "{}"}, "structured.spec must be empty for json_object"),
        ({"kind": "json_schema", "spec": "{'a'"}, r"structured.spec \(json_schema\) is not JSON"),
        ({"kind": "json_schema", "spec": "[1]"}, "must be a JSON object, got list"),
        ({"kind": "choice"}, "structured.choices must hold at least one string for choice"),
        ({"kind": "choice", "choices": ("a", "")}, "structured.choices must hold non-empty"),
        ({"kind": "choice", "choices": "ab"}, "structured.choices must be a sequence"),
        ({"kind": "regex", "spec": "a", "choices": ("a",)}, "choices must be empty for regex"),
        ({"kind": "regex", "spec": "a", "strict": False}, "structured.strict must be true for"),
        ({"kind": "choice", "choices": ("x" * 1025,)}, "strings of at most 1024 characters"),
        ({"kind": "regex", "spec": "a" * (MAX_SPEC_CHARS + 1)}, "at most 65536 characters"),
        ({"kind": "choice", "choices": ("x",) * 257}, "at most 256"),
    ],
)
def test_a_bad_constraint_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**kwargs)
    with pytest.raises(ValueError, match="structured must be a StructuredOutput"):
        SamplingParams(structured={"kind": "regex", "spec": "a"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("schema", "where", "what"),
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "/properties/a", "strin"),
        (
            {"properties": {"p": {"properties": {"q": {"items": {"pattern": "(?=x)y"}}}}}},
            "/properties/p/properties/q/items",
            "look-around",
        ),
        (
            {"properties": {"x": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/nope"}]}}},
            "/properties/x/anyOf/1",
            "/\\$defs/nope",
        ),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "/", "minimum"),
        ({"type": "string", "format": "no-such-format"}, "/", "no-such-format"),
    ],
)
def test_a_schema_that_cannot_compile_is_named_by_its_part(schema, where, what):
    with pytest.raises(
        ValueError, match=rf"(?s)structured output \(json_schema\) at {where}: .*{what}"
    ):
        check_structured_output(StructuredOutput.json_schema(schema))


def test_what_compiles_passes_the_check_and_non_strict_ignores_unknown_keywords():
    for ok in (JSON, REGEX, CHOICE, StructuredOutput("json_object")):
        check_structured_output(ok)
    check_structured_output(StructuredOutput("grammar", 'root ::= "(" [0-9]+ ")"'))  # GBNF
    check_structured_output(StructuredOutput("grammar", 'start: "x" NUM\nNUM: /[0-9]+/'))  # Lark
    unknown = {"type": "string", "format": "no-such-format"}
    check_structured_output(StructuredOutput.json_schema(unknown, strict=False))
    with pytest.raises(ValueError, match=r"(?s)structured output \(regex\): .*unclosed"):
        check_structured_output(StructuredOutput("regex", "[a-z"))
    with pytest.raises(ValueError, match=r"(?s)structured output \(grammar\): .*unknown name"):
        check_structured_output(StructuredOutput("grammar", "start: foo"))


def test_the_wire_round_trips_the_constraint():
    for structured in (JSON, REGEX, CHOICE, StructuredOutput.json_schema({}, strict=False)):
        params = SamplingParams(max_tokens=5, seed=1, structured=structured)
        item = WorkItem("r", (1, 2), params, "decode", (b"h",), first_token_id=3)
        got = decode_as(encode(item), WorkItem)
        assert got == item and got.params.structured == structured
        assert isinstance(got.params.structured.choices, tuple)


# ---- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured")
    make_model(path, "qwen2", "tiny", overwrite=True)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return roles.make_engine(model_dir, max_model_len=512, num_kv_blocks=256)


def generate(engine: LLMEngine, prompts, params) -> list[list[StreamDelta]]:
    return roles.aggregated(engine, prompts, params)


def text_of(engine: LLMEngine, deltas: list[StreamDelta]) -> str:
    return engine.tokenizer.decode(roles.tokens(deltas))


def test_json_schema_output_parses_and_validates_for_several_seeds(engine):
    params = [
        SamplingParams(max_tokens=400, temperature=1.0, seed=seed, structured=JSON)
        for seed in range(4)
    ]
    params.append(SamplingParams(max_tokens=400, temperature=0.0, structured=JSON))
    outs = generate(engine, [PROMPT] * len(params), params)
    texts = set()
    for deltas in outs:
        assert deltas[-1].finish_reason is FinishReason.STOP
        value = json.loads(text_of(engine, deltas))
        jsonschema.validate(value, SCHEMA)
        texts.add(text_of(engine, deltas))
    assert len(texts) > 1  # the seeds did sample
    roles.assert_no_blocks_in_use(engine)
    assert engine.grammars.num_cached >= 1


def test_regex_and_choice_outputs_match_whole(engine):
    params = [
        SamplingParams(max_tokens=60, temperature=0.8, seed=s, structured=REGEX) for s in range(3)
    ]
    params += [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured=CHOICE) for s in range(3)
    ]
    params.append(SamplingParams(max_tokens=60, temperature=0.0, structured=CHOICE))
    outs = generate(engine, [PROMPT] * len(params), params)
    for p, deltas in zip(params, outs, strict=True):
        text = text_of(engine, deltas)
        assert deltas[-1].finish_reason is FinishReason.STOP
        if p.structured is REGEX:
            assert re.fullmatch(REGEX.spec, text), text
        else:
            assert text in CHOICE.choices


def test_grammar_output_matches_and_json_object_starts_an_object(engine):
    # Bounded: a random model may write digits forever where the grammar lets it.
    gbnf = StructuredOutput(
        "grammar", 'root ::= "(" num ("+" num)? ("+" num)? ")"\nnum ::= [0-9] [0-9]? [0-9]?'
    )
    params = [
        SamplingParams(max_tokens=60, temperature=0.0, structured=gbnf),
        SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutput("json_object")),
    ]
    grammar, json_object = generate(engine, [PROMPT] * 2, params)
    assert grammar[-1].finish_reason is FinishReason.STOP
    assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3}){0,2}\)", text_of(engine, grammar))
    # A random model never closes a free-form object; what it wrote is an object's start.
    assert json_object[-1].finish_reason is FinishReason.LENGTH
    assert text_of(engine, json_object).lstrip().startswith("{")


def test_an_unconstrained_neighbour_is_unchanged(engine):
    plain = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True),
    ]
    alone = [roles.tokens(d) for d in generate(engine, [PROMPT, PROMPT[:3]], plain)]
    constrained = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=JSON) for s in (1, 2)
    ]
    mixed = generate(engine, [PROMPT, PROMPT[:3], PROMPT, PROMPT], plain + constrained)
    assert [roles.tokens(d) for d in mixed[:2]] == alone
    # ... and the constrained ones were constrained.
    assert all(text_of(engine, d).startswith("{") for d in mixed[2:])


def test_prefill_and_decode_roles_give_the_aggregated_tokens(model_dir, engine):
    p, d = (
        roles.make_engine(model_dir, max_model_len=512),
        roles.make_engine(model_dir, max_model_len=512),
    )
    params = [
        SamplingParams(max_tokens=300, temperature=1.0, seed=3, structured=JSON),
        SamplingParams(max_tokens=300, temperature=0.0, structured=JSON),
        SamplingParams(max_tokens=40, temperature=0.9, seed=5, top_p=0.9, structured=REGEX),
    ]
    prompts = [PROMPT, PROMPT * 3, PROMPT[:4]]
    want = [roles.tokens(deltas) for deltas in generate(engine, prompts, params)]
    held = roles.prefill(p, prompts, params)
    out = roles.decode(p, d, prompts, params, held)
    for h, w in zip(held, want, strict=True):
        assert [*h.token_ids, *roles.tokens(out[h.request_id])] == w
        assert out[h.request_id][-1].finish_reason is FinishReason.STOP
    roles.assert_no_blocks_in_use(p, d)


def test_a_migrated_request_rebuilds_its_grammar_from_its_tokens(engine):
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=11, structured=JSON)
    (full,) = generate(engine, [PROMPT], [params])
    want = roles.tokens(full)
    for cut in (1, 5, len(want) // 2):
        rid = engine.add_request(PROMPT, params, prior_output_token_ids=want[:cut])
        rest = roles.tokens(roles.run(engine)[rid])
        assert want[:cut] + rest == want


def test_tokens_outside_the_grammar_are_refused_on_resume(engine):
    outside = engine.tokenizer.encode("zz", add_special_tokens=False)
    with pytest.raises(ValueError, match=r"remote_first_token: token .* not allowed by the"):
        engine.add_request(PROMPT, SamplingParams(structured=JSON), remote_first_token=outside[0])
    with pytest.raises(ValueError, match=r"prior_output_token_ids: token .* not allowed"):
        engine.add_request(
            PROMPT, SamplingParams(structured=CHOICE), prior_output_token_ids=outside
        )
    whole = engine.tokenizer.encode("cherry", add_special_tokens=False)
    with pytest.raises(ValueError, match="already ends the request"):
        engine.add_request(PROMPT, SamplingParams(structured=CHOICE), prior_output_token_ids=whole)
    assert not engine.has_unfinished_requests()


def test_the_engine_refuses_a_schema_it_cannot_compile(engine):
    bad = StructuredOutput.json_schema({"properties": {"a": {"type": "strin"}}})
    with pytest.raises(ValueError, match=r"structured output \(json_schema\): .*strin"):
        engine.add_request(PROMPT, SamplingParams(structured=bad))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_speculation_checks_proposals_against_the_grammar(model_dir, engine, method):
    spec = {"speculative_method": "ngram", "speculative_ngram_min": 1}
    if method == "draft-self":
        spec = {"speculative_method": "draft", "speculative_draft_model": model_dir}
    spec_engine = roles.make_engine(model_dir, max_model_len=512, num_kv_blocks=256, **spec)
    spec_engine.spec.adaptive = False  # speculate at every step it may
    # Repetitive output, so that the n-gram lookup finds proposals.
    loop = StructuredOutput("regex", r"(ab|cd|[0-9]){60}")
    params = [
        SamplingParams(max_tokens=80, temperature=0.0, structured=loop),
        SamplingParams(max_tokens=300, temperature=0.0, structured=JSON),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    ]
    prompts = [PROMPT, PROMPT * 2, PROMPT[:3]]
    want = [roles.tokens(d) for d in generate(engine, prompts, params)]
    got = [roles.tokens(d) for d in generate(spec_engine, prompts, params)]
    assert got == want
    assert re.fullmatch(loop.spec, spec_engine.tokenizer.decode(got[0]))
    stats = spec_engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    roles.assert_no_blocks_in_use(spec_engine)


# ---- the mask, row by row --------------------------------------------------------------------


def _allowed(x: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in x]


def test_a_verify_row_is_masked_after_its_pending_proposals(engine):
    tokenizer = engine.tokenizer
    ids = tokenizer.encode("banana", add_special_tokens=False)
    ahead = engine.grammars.matcher(CHOICE)
    behind = engine.grammars.matcher(CHOICE)
    for token_id in ids[:-1]:
        ahead.accept(token_id)
    vocab = engine.vocab_size
    logits = torch.randn(3, vocab)
    rows = [
        SamplingRow(SamplingParams(), PROMPT, ids[:-1], None, frozenset(), behind),  # pending
        SamplingRow(SamplingParams(), PROMPT, ids[:-1], None, frozenset(), ahead),  # consumed
        SamplingRow(SamplingParams(), PROMPT, [], None, frozenset()),  # unconstrained
    ]
    x = apply_grammar_masks(logits, logits, rows)
    pending, consumed, free = _allowed(x)
    assert pending == consumed and ids[-1] in pending and len(pending) < vocab
    assert free == set(range(vocab)) and torch.equal(x[2], logits[2])
    assert behind.num_tokens == 0 and behind.num_valid(ids) == len(ids)  # rolled back
    assert torch.isfinite(logits).all()  # the input is not modified


def test_a_row_whose_grammar_tokens_are_all_suppressed_keeps_the_grammar(engine):
    # "x" is a stop token id under min_tokens: suppressed, yet the only token allowed.
    (only,) = engine.tokenizer.encode("x", add_special_tokens=False)
    params = SamplingParams(min_tokens=2, stop_token_ids=(only,))
    matcher = engine.grammars.matcher(StructuredOutput("choice", choices=("x",)))
    rows = [
        SamplingRow(params, PROMPT, [], None, frozenset(), matcher),
        SamplingRow(params, PROMPT, [], None, frozenset()),  # unconstrained: suppressed
    ]
    raw = torch.randn(2, engine.vocab_size)
    _, x = engine.sampler.process(raw, rows)
    assert _allowed(x[:1]) == [{only}] and x[0, only] == raw[0, only]
    assert x[1, only] == -math.inf and torch.isfinite(x[1]).sum() == engine.vocab_size - 1


def test_unconstrained_rows_are_returned_as_is():
    x = torch.randn(2, 16)
    rows = [SamplingRow(SamplingParams(), [1], [], None, frozenset())] * 2
    assert apply_grammar_masks(x, x, rows) is x


def test_the_compiled_grammar_is_cached_per_constraint(engine):
    before = engine.grammars.num_cached
    engine.grammars.matcher(StructuredOutput("regex", "cached-[0-9]"))
    engine.grammars.matcher(StructuredOutput("regex", "cached-[0-9]"))
    assert engine.grammars.num_cached == before + 1
    # Each request its own matcher: one advancing leaves the other at the start.
    first, second = engine.grammars.matcher(REGEX), engine.grammars.matcher(REGEX)
    (token_id,) = engine.tokenizer.encode("a", add_special_tokens=False)
    assert first.accept(token_id) and first.num_tokens == 1
    words = np.empty((2, first.mask_words), dtype=np.int32)
    first.fill_mask(words[0])
    second.fill_mask(words[1])
    assert not np.array_equal(words[0], words[1])
