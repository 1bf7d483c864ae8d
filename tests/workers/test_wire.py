"""The router <-> worker wire (workers/protocol/wire.py): typed round trips of every
message, and refusal, naming the class, of foreign, stale and malformed ones."""

from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest

from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.wire import (
    WIRE_VERSION,
    KVEvents,
    OutputBatch,
    TierStatus,
    TokenEvent,
    WorkerInfo,
    WorkerReport,
    WorkItem,
    decode_as,
    encode,
)

V = WIRE_VERSION
PARAMS = SamplingParams(max_tokens=8, temperature=0.5, stop=("x",), seed=3, logprobs=2)
ITEM = WorkItem("r1", (1, 2, 3), PARAMS, "decode", (b"h0", b"h1"), first_token_id=9)
EVENT = TokenEvent(
    "r1",
    (4, 5),
    True,
    "stop",
    stop_token_id=5,
    num_prompt_tokens=3,
    logprobs=(TokenLogprobs(4, -0.5, 1, (4, 6), (-0.5, -1.25)),) * 2,
    kv_transfer_seconds=0.25,
    kv_transfer_bytes=4096,
)
TIER = TierStatus("host", 3, 192, 16, 1024, 5, 2, 0, 320, 0.01, 640, 0.02, 1, 0)
REPORT = WorkerReport(
    "decode-0", "decode", True, 1, 2, 64, 8, 5, 0, kv_events_seq=4,
    kv_events=(KVEvents("pool", (11, 2**63 + 5)), KVEvents("host", (1, 2), (3,))),
    kv_tiers=(TIER,),
)  # fmt: skip
INFO = WorkerInfo("decode-0", "LlamaForCausalLM", "bfloat16", 256, 512, 16, 64, "cpu")


@pytest.mark.parametrize("msg", [ITEM, EVENT, REPORT, INFO, OutputBatch((EVENT,) * 3, REPORT)])
def test_every_message_round_trips(msg):
    data = encode(msg)
    got = decode_as(data, type(msg))
    assert got == msg and type(got) is type(msg)
    kind, version, fields = msgpack.unpackb(data)  # [kind, version, [fields...]]
    assert (kind, version, len(fields)) == (msg.kind, V, len(msgspec.structs.fields(msg)))


def test_a_migrated_item_and_numpy_scalars_round_trip():
    item = WorkItem("r2", (np.int64(1), 2), SamplingParams(), "full", output_token_ids=(7,))
    assert decode_as(encode(item), WorkItem) == WorkItem(
        "r2", (1, 2), SamplingParams(), "full", (), None, (7,)
    )
    event = TokenEvent("r", (1,), False, kv_transfer_seconds=np.float64(0.5))
    assert decode_as(encode(event), TokenEvent).kv_transfer_seconds == 0.5


def test_foreign_stale_and_malformed_messages_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^not a WorkItem message$"):
        decode_as(encode(EVENT), WorkItem)
    with pytest.raises(ValueError, match=r"^not a OutputBatch message$"):
        decode_as(msgpack.packb({"kind": "batch"}), OutputBatch)
    with pytest.raises(ValueError, match="malformed WorkerInfo"):
        decode_as(b"\xc1", WorkerInfo)
    with pytest.raises(ValueError, match=f"WorkerInfo: wire version 5, expected {V}"):
        decode_as(msgpack.packb(["info", 5, *msgpack.unpackb(encode(INFO))[2]]), WorkerInfo)
    fields = msgpack.unpackb(encode(INFO))[2]
    with pytest.raises(ValueError, match="malformed WorkerInfo: Expected `array` of at least"):
        decode_as(msgpack.packb(["info", V, fields[:-1]]), WorkerInfo)
    with pytest.raises(ValueError, match="malformed WorkerInfo: Expected `array` of at most"):
        decode_as(msgpack.packb(["info", V, [*fields, 1]]), WorkerInfo)
    with pytest.raises(TypeError, match="not a wire message"):
        decode_as(encode(INFO), SamplingParams)


def _with(msg, path: tuple, value) -> bytes:
    """``msg`` encoded, then the field at ``path`` (indices into its fields) set to value."""
    raw = msgpack.unpackb(encode(msg))
    target = raw[2]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return msgpack.packb(raw)


@pytest.mark.parametrize(
    ("msg", "path", "value", "error"),
    [
        (ITEM, (5,), "9", "Expected `int | null`, got `str`"),  # first_token_id
        (ITEM, (1, 0), "1", "Expected `int`, got `str`"),  # a prompt token
        (ITEM, (1, 0), True, "Expected `int`, got `bool`"),
        (ITEM, (2, "max_tokens"), "8", "Expected `int | null`, got `str`"),  # SamplingParams
        (ITEM, (2, "stop"), [3], "Expected `str`, got `int`"),
        (INFO, (3,), 256.0, "Expected `int`, got `float`"),  # max_model_len
        (INFO, (0,), 1, "Expected `str`, got `int`"),
        (EVENT, (2,), 1, "Expected `bool`, got `int`"),  # finished
        (EVENT, (7, 0, 1), "x", "Expected `float`, got `str`"),  # a logprob
        (OutputBatch((EVENT,), REPORT), (0, 0, 0), 5, "Expected `str`, got `int`"),
        (OutputBatch((EVENT,), REPORT), (1, 3), "1", "Expected `int`, got `str`"),
        (OutputBatch((EVENT,), REPORT), (1, 16, 0, 1), 1.5, "Expected `int`, got `float`"),
    ],
)
def test_scalars_of_the_wrong_type_are_refused(msg, path, value, error):
    name = type(msg).__name__
    with pytest.raises(ValueError, match=rf"^malformed {name}: {error}"):
        decode_as(_with(msg, path, value), type(msg))


def test_the_post_init_checks_run_on_decode():
    with pytest.raises(ValueError, match="malformed WorkItem: decode work needs kv_handles"):
        decode_as(_with(ITEM, (4,), []), WorkItem)
    with pytest.raises(ValueError, match="malformed WorkItem: top_p must be in"):
        decode_as(_with(ITEM, (2, "top_p"), 2.0), WorkItem)
    # Structs: frozen, changed with msgspec.structs.replace (which runs the checks too)
    with pytest.raises(AttributeError):
        ITEM.mode = "full"  # type: ignore[misc]
    with pytest.raises(ValueError, match="mode must be one of"):
        msgspec.structs.replace(ITEM, mode="both")


def test_the_layer_wise_hand_off_s_fields_round_trip_and_are_checked():
    reserve = WorkItem("r3", (1, 2), PARAMS, "decode", kv_stream_from="prefill-0")
    first = msgspec.structs.replace(reserve, first_token_id=7)
    work = WorkItem("r3", (1, 2), PARAMS, "prefill", kv_reservations=(b"res",))
    reserved = TokenEvent("r3", (), False, kv_reservations=(b"res",))
    streamed = TokenEvent("r3", (7,), True, kv_streamed=True)
    report = msgspec.structs.replace(REPORT, layerwise_min_tokens=512)
    for msg in (reserve, first, work, reserved, streamed, report):
        assert decode_as(encode(msg), type(msg)) == msg
    with pytest.raises(ValueError, match="kv_stream_from"):
        WorkItem("r", (1,), PARAMS, "full", kv_stream_from="prefill-0")
    with pytest.raises(ValueError, match="kv_stream_from"):
        WorkItem("r", (1,), PARAMS, "decode", (b"h",), 3, kv_stream_from="prefill-0")
    with pytest.raises(ValueError, match="kv_reservations"):
        WorkItem("r", (1,), PARAMS, "full", kv_reservations=(b"res",))
    with pytest.raises(ValueError, match="kv_handles"):
        WorkItem("r", (1,), PARAMS, "decode")  # neither handles nor a stream
