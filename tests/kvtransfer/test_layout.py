"""KVLayout: geometry from the cache tensor, fingerprint, compatibility errors, messages."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from kvtransfer.errors import LayoutMismatchError
from kvtransfer.layout import check_compatible, kv_head_range
from kvtransfer.messages import (
    PROTOCOL_VERSION,
    CompletionNotice,
    HandshakeMetadata,
    KVHandle,
    PushRequest,
    decode,
    decode_as,
    encode,
)

from .helpers import layout_of


def test_geometry_matches_the_tensor():
    cache = torch.zeros(10, 3, 2, 2, 16, 64, dtype=torch.bfloat16)
    layout = layout_of(cache, num_kv_heads=8, tp_rank=3, tp_size=4)
    assert layout.dtype == "bfloat16" and layout.itemsize == 2
    assert layout.head_range == (6, 8) and layout.num_kv_heads_local == 2
    assert layout.head_bytes == 16 * 64 * 2
    assert layout.block_bytes == layout.block_stride == cache[0].numel() * 2
    assert layout.num_bytes == cache.numel() * 2
    assert layout.block_addr(7) == cache[7].data_ptr()
    # (layer 2, V, global head 7) is local head 1: check against the tensor itself
    offset = layout.region_offset(2, 1, 7)
    assert layout.block_addr(4) + offset == cache[4, 2, 1, 1].data_ptr()
    with pytest.raises(ValueError):
        layout.region_offset(0, 0, 5)  # head 5 lives on rank 2


def test_strided_blocks_and_bad_tensors():
    pool = torch.zeros(6, 2, 2, 4, 4, 8)
    strided = pool[::2]  # blocks 0, 2, 4: each contiguous, stride two blocks
    layout = layout_of(strided, num_kv_heads=4)
    assert layout.block_stride == 2 * layout.block_bytes
    assert layout.block_addr(1) == pool[2].data_ptr()
    with pytest.raises(ValueError, match="kv heads"):
        layout_of(torch.zeros(4, 2, 2, 3, 4, 8), num_kv_heads=4, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="expected"):
        layout_of(torch.zeros(4, 2, 3, 4, 4, 8), num_kv_heads=4)


def test_head_ranges_split_and_replicate():
    assert [kv_head_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 heads over 8 ranks: ranks 0-3 hold head 0, ranks 4-7 head 1
    assert [kv_head_range(2, r, 8)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError):
        kv_head_range(6, 0, 4)
    with pytest.raises(ValueError):
        kv_head_range(2, 0, 3)


def test_fingerprint_ignores_placement_and_check_compatible_names_fields():
    base = layout_of(torch.zeros(4, 2, 2, 4, 4, 8, dtype=torch.float16), num_kv_heads=4)
    moved = dataclasses.replace(base, base_addr=12345, num_blocks=99, tp_rank=1, tp_size=2)
    assert moved.fingerprint == base.fingerprint
    check_compatible(base, moved)
    other = dataclasses.replace(
        base, dtype="bfloat16", block_size=8, model_id="other", block_stride=4 * base.block_stride
    )
    assert other.fingerprint != base.fingerprint
    with pytest.raises(LayoutMismatchError) as info:
        check_compatible(base, other)
    text = str(info.value)
    assert "model_id" in text and "dtype" in text and "block_size" in text
    assert "'float16'" in text and "'bfloat16'" in text and "head_dim" not in text


def test_messages_round_trip_and_reject_garbage():
    layout = layout_of(torch.zeros(4, 2, 2, 4, 4, 8), num_kv_heads=4)
    msgs = [
        HandshakeMetadata("prefill-0", "123-abc", b"\x00nixl\xff", layout),
        KVHandle("p#1", "req-1", 7, (3, 1, 4), layout.fingerprint, 40, 17, 30.0, 1.5e9),
        CompletionNotice("p#1", 7, "req-1", "failed", "timeout", "slow"),
        PushRequest(7, "req-1", (0, 5, 9), 2.5),
    ]
    for msg in msgs:
        data = encode(msg)
        assert decode(data) == msg
        assert b"pickle" not in data and not data.startswith(b"\x80")  # msgpack, not pickle
    assert decode_as(encode(msgs[0]), HandshakeMetadata).agent_name == "prefill-0#123-abc"
    with pytest.raises(ValueError, match="expected PushRequest, got KVHandle"):
        decode_as(encode(msgs[1]), PushRequest)
    with pytest.raises(ValueError):
        decode(b"\x80\x04garbage")
    v = PROTOCOL_VERSION
    with pytest.raises(ValueError, match="malformed CompletionNotice"):
        decode(msgpack.packb(["notice", v, ["p", 7]]))  # missing fields
    with pytest.raises(ValueError, match="CompletionNotice: protocol version 99"):
        decode(msgpack.packb(["notice", 99, ["p", 7, "r", "done", "", ""]]))  # version
    with pytest.raises(ValueError, match="unknown notice status"):
        decode(msgpack.packb(["notice", v, ["p", 7, "r", "exploded", "", ""]]))  # status
    with pytest.raises(ValueError, match="malformed PushRequest"):
        decode(msgpack.packb(["push", v, [7, "r", [1, "x"], 1.0]]))  # block ids
    with pytest.raises(ValueError, match="malformed PushRequest"):
        decode(msgpack.packb(["push", v, ["seven", "r", [1], 1.0]]))  # field type
    with pytest.raises(ValueError, match="not a kvtransfer message"):
        decode(msgpack.packb(["shove", v, [7, "r", [1], 1.0]]))  # foreign kind


def test_message_scalars_are_type_checked():
    """A value of the wrong type, even one the old codec let through, is refused."""
    handle = KVHandle("p#1", "req-1", 7, (3, 1, 4), "f00d", 40, 17, 30.0, 1.5e9)
    fields = msgpack.unpackb(encode(handle))[2]
    for index, wrong in ((2, "7"), (2, True), (4, 5), (7, "30"), (9, 0.5)):
        bad = [*fields]
        bad[index] = wrong
        with pytest.raises(ValueError, match=r"malformed KVHandle: Expected `(int|str|float)`"):
            decode_as(msgpack.packb(["handle", PROTOCOL_VERSION, bad]), KVHandle)
    assert decode_as(msgpack.packb(["handle", PROTOCOL_VERSION, fields]), KVHandle) == handle
    # A stale peer's message (the version before msgspec: flat) is refused as such.
    with pytest.raises(ValueError, match=r"KVHandle: protocol version 1 != "):
        decode(msgpack.packb(["handle", 1, *fields]))
