"""The gRPC servicer's conversions between protobuf and the router's types: every field
crosses, unset options stay unset, and the stop reason and timing land where they did."""

from __future__ import annotations

import dataclasses

import pytest

from proto.baton.v1 import inference_pb2 as pb
from router import server, status
from router.errors import ErrorCode, RouterError
from router.events import Delta, Finish, GenerateEvent, Timing, Usage
from router.requests import GenerateRequest, OutputOptions, SamplingOptions, StoppingOptions
from workers.protocol.logprobs import TokenLogprobs


def test_every_request_field_crosses():
    req = pb.GenerateRequest(
        request_id="r1",
        model="tiny",
        token_ids=pb.TokenIds(ids=[5, 6]),
        sampling=pb.SamplingParams(
            temperature=0.5,
            top_p=0.75,
            top_k=40,
            min_p=0.25,
            seed=2**64 - 1,
            repetition_penalty=1.5,
            presence_penalty=-1.0,
            frequency_penalty=0.5,
            speculative=False,
        ),
        stopping=pb.StoppingCriteria(
            max_tokens=12, min_tokens=2, stop=["\n", "END"], stop_token_ids=[7], ignore_eos=True
        ),
        output=pb.OutputOptions(logprobs=3, return_text=False, return_timing=True),
        disaggregation=pb.DISAGGREGATION_NEVER,
    )
    assert server.generate_request(req) == GenerateRequest(
        prompt=(5, 6),
        request_id="r1",
        model="tiny",
        sampling=SamplingOptions(0.5, 0.75, 40, 0.25, 2**64 - 1, 1.5, -1.0, 0.5, False),
        stopping=StoppingOptions(12, 2, ("\n", "END"), (7,), True),
        output=OutputOptions(logprobs=3, return_text=False, return_timing=True),
        disaggregation="never",
    )


def test_unset_options_stay_unset():
    assert server.generate_request(pb.GenerateRequest(text="hi")) == GenerateRequest("hi")
    # Set to zero is not unset (proto3 `optional`).
    zero = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=0.0))
    assert server.generate_request(zero).sampling.temperature == 0.0
    # Unset speculative: the decode pool's setting applies; set, it crosses either way.
    assert server.generate_request(pb.GenerateRequest(text="hi")).sampling.speculative is None
    on = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(speculative=True))
    assert server.generate_request(on).sampling.speculative is True
    # An explicitly empty text is a prompt (refused later as empty); none at all is None.
    assert server.generate_request(pb.GenerateRequest(text="")).prompt == ""
    assert server.generate_request(pb.GenerateRequest()).prompt is None
    modes = [pb.DISAGGREGATION_UNSPECIFIED, pb.DISAGGREGATION_ALWAYS, pb.DISAGGREGATION_AUTO]
    converted = [server.generate_request(pb.GenerateRequest(disaggregation=m)) for m in modes]
    assert [r.disaggregation for r in converted] == [None, "always", "auto"]


def test_an_unknown_disaggregation_value_is_invalid_argument():
    with pytest.raises(RouterError) as info:
        server.generate_request(pb.GenerateRequest(text="hi", disaggregation=9))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.message == "disaggregation: unknown value 9"


def test_a_delta_event():
    lp = TokenLogprobs(7, -0.25, 2, (3, 7), (-0.125, -0.25))
    event = GenerateEvent("r1", Delta((7,), "hé", (lp,)))
    assert server.generate_response(event) == pb.GenerateResponse(
        request_id="r1",
        delta=pb.Delta(
            token_ids=[7],
            text="hé",
            logprobs=[
                pb.TokenLogprob(
                    token_id=7,
                    logprob=-0.25,
                    rank=2,
                    top=[
                        pb.TopLogprob(token_id=3, logprob=-0.125),
                        pb.TopLogprob(token_id=7, logprob=-0.25),
                    ],
                )
            ],
        ),
    )


def test_final_events():
    usage = Usage(4, 2, 1)
    timing = Timing(0.5, 1.0, 0.25, 4096, 1.5, 2.0, "prefill-0", "decode-0")
    stop = server.generate_response(
        GenerateEvent("r1", Delta((9,), "x"), Finish("stop", usage, stop_string="END"))
    )
    assert stop == pb.GenerateResponse(
        request_id="r1",
        final=pb.Final(
            finish_reason=pb.FINISH_REASON_STOP,
            stop_string="END",
            usage=pb.Usage(prompt_tokens=4, completion_tokens=2, cached_prompt_tokens=1),
            delta=pb.Delta(token_ids=[9], text="x"),
        ),
    )
    assert not stop.final.HasField("timing")
    token = server.generate_response(
        GenerateEvent("r2", Delta(), Finish("stop", usage, stop_token_id=0, timing=timing))
    ).final
    assert token.WhichOneof("stop_reason") == "stop_token_id" and token.stop_token_id == 0
    assert token.timing == pb.Timing(
        queue_seconds=0.5,
        prefill_seconds=1.0,
        kv_transfer_seconds=0.25,
        kv_transfer_bytes=4096,
        ttft_seconds=1.5,
        e2e_seconds=2.0,
        prefill_worker="prefill-0",
        decode_worker="decode-0",
    )
    for reason, value in [("length", pb.FINISH_REASON_LENGTH), ("abort", pb.FINISH_REASON_ABORT)]:
        final = server.generate_response(GenerateEvent("r", Delta(), Finish(reason, usage))).final
        assert final.finish_reason == value and final.WhichOneof("stop_reason") is None


def test_every_error_code_is_the_grpc_status_of_its_name():
    assert {code: server.GRPC_STATUS[code].name for code in ErrorCode} == {
        code: code.value for code in ErrorCode
    }


@pytest.mark.parametrize(
    ("snapshot", "message"),
    [
        (status.ModelInfo, pb.ModelInfo),
        (status.ClusterStatus, pb.ClusterStatus),
        (status.PoolStatus, pb.PoolStatus),
        (status.WorkerStatus, pb.WorkerStatus),
        (status.TierUsage, pb.KVTierStatus),
    ],
)
def test_status_snapshots_mirror_their_messages(snapshot, message):
    # The servicer converts them field for field (dataclasses.asdict).
    fields = {f.name for f in dataclasses.fields(snapshot)}
    assert fields == set(message.DESCRIPTOR.fields_by_name)


def test_cluster_status_converts():
    worker = status.WorkerStatus(
        "decode-0", "decode", True, "serving", 1, 2, 1, 3, 4, 2, 64, 8, 5, 10, 40, 25
    )
    pool = status.PoolStatus("decode", 1, 1, (worker,))
    snapshot = status.ClusterStatus(
        "tiny", (pool,), "nixl", "kv_aware", "auto", True, "ngram, 4 tokens"
    )
    message = server.cluster_status_message(snapshot)
    assert message.speculative == "ngram, 4 tokens"
    sent = message.pools[0].workers[0]
    assert sent.spec_num_steps == 10 and sent.spec_num_draft_tokens == 40
    assert sent.spec_num_accepted_tokens == 25
    assert message.draining and message.pools[0].workers[0].state == "serving"
    assert message.pools[0].workers[0].kv_blocks_total == 64
    assert message.pools[0].workers[0].restarts == 1
    assert message.pools[0].workers[0].num_incoming == 2
    tiers = (
        status.TierUsage("host", 3, 3072, 8, 8192, 5, 1),
        status.TierUsage("disk", 0, 0, 9, 9, 0, 0),
    )
    tiered = server.cluster_status_message(
        dataclasses.replace(
            snapshot,
            pools=(
                dataclasses.replace(pool, workers=(dataclasses.replace(worker, kv_tiers=tiers),)),
            ),
        )
    )
    sent_tiers = tiered.pools[0].workers[0].kv_tiers
    assert [(t.name, t.blocks, t.capacity_bytes, t.hits, t.misses) for t in sent_tiers] == [
        ("host", 3, 8192, 5, 1),
        ("disk", 0, 9, 0, 0),
    ]
    info = server.model_info_message(
        status.ModelInfo("tiny", "LlamaForCausalLM", "bf16", 256, 512, (2,))
    )
    assert list(info.eos_token_ids) == [2] and info.vocab_size == 512
