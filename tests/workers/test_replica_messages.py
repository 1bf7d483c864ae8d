"""Rank 0 <-> rank messages: typed round trips, refusal of anything else, and the link's
inline and overflow paths over a real two-process gloo group."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import msgspec
import numpy as np
import pytest
import torch.multiprocessing as mp

from workers.engine.step_inputs import StepInputs
from workers.parallel.rank_link import COMMAND_INLINE_BYTES, REPLY_INLINE_BYTES
from workers.parallel.replica import free_port, join_replica, leave_replica
from workers.parallel.replica_messages import (
    REPLICA_WIRE_VERSION,
    Offered,
    OfferOp,
    RankCommand,
    RankReply,
    Received,
    ReceiveOp,
    decode_command,
    decode_reply,
    encode_command,
    encode_reply,
)


def _inputs(num_tokens: int = 5) -> StepInputs:
    return StepInputs(
        input_ids=np.arange(num_tokens, dtype=np.int64) + 7,
        positions=np.arange(num_tokens, dtype=np.int64),
        slot_mapping=np.arange(num_tokens, dtype=np.int64) + 32,
        block_tables=np.array([[4, 0], [5, 9]], dtype=np.int32),
        seq_lens=(9, num_tokens - 1),
        query_start_loc=(0, 1, num_tokens),
        num_decodes=1,
        sample_indices=(0, num_tokens - 1),
        block_copies=((3, 4),),
    )


def _same_inputs(a: StepInputs, b: StepInputs) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "block_tables"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    for name in ("seq_lens", "query_start_loc", "num_decodes", "sample_indices", "block_copies"):
        assert getattr(a, name) == getattr(b, name)


def test_a_command_round_trips_with_every_field():
    command = RankCommand(
        seq=41,
        step=_inputs(),
        offers=(OfferOp("a", (1, 2, 3), 40, 17),),
        receives=(ReceiveOp("b", (b"h0", b"h1"), (8, 9)),),
        aborts=("c",),
        declines=((b"h2",),),
    )
    got = decode_command(encode_command(command))
    _same_inputs(got.step, command.step)
    assert (got.seq, got.offers, got.receives, got.aborts, got.declines) == (
        41,
        command.offers,
        command.receives,
        ("c",),
        ((b"h2",),),
    )
    assert not got.stop
    assert decode_command(encode_command(RankCommand(seq=0, stop=True))).step is None


def test_a_reply_round_trips():
    reply = RankReply(
        rank=3,
        offered=(Offered("a", b"handle"), Offered("b", b"", "boom")),
        released=("c", "d"),
        received=(Received("e", "", 0.25, 4096), Received("f", "PeerLostError: gone")),
    )
    assert decode_reply(encode_reply(reply)) == reply


V = REPLICA_WIRE_VERSION


@pytest.mark.parametrize(
    "data, error",
    [
        (b"\xc1", "undecodable"),
        (msgpack.packb(["reply", V, [0, [], [], []]]), "not a cmd"),
        (msgpack.packb(["cmd", 99, [0, None, [], [], [], [], False]]), "version 99"),
        (msgpack.packb(["cmd", 2, 0, None, [], [], [], [], False]), "version 2"),  # stale
        (
            msgpack.packb(["cmd", V, [0, None, [["a", [1], 2]], [], [], [], False]]),
            "malformed",
        ),
    ],
)
def test_anything_but_a_command_is_refused(data, error):
    with pytest.raises(ValueError, match=error):
        decode_command(data)


def test_scalars_of_the_wrong_type_are_refused():
    """The typed decoding refuses what the old codec converted (int("7")) or let through."""
    fields = msgpack.unpackb(
        encode_command(RankCommand(seq=3, offers=(OfferOp("a", (1,), 4, 5),)))
    )[2]
    for path, wrong in (((0,), "3"), ((0,), 3.0), ((2, 0, 2), "4"), ((6,), 1)):
        bad = msgpack.unpackb(msgpack.packb(fields))
        *outer, last = path
        target = bad
        for i in outer:
            target = target[i]
        target[last] = wrong
        with pytest.raises(ValueError, match=r"RankCommand: malformed cmd message: Expected"):
            decode_command(msgpack.packb(["cmd", V, bad]))
    reply = msgpack.unpackb(encode_reply(RankReply(rank=1, received=(Received("e", "", 0.5, 9),))))
    reply[2][3][0][3] = "9"  # num_bytes
    with pytest.raises(ValueError, match=r"RankReply: malformed reply message: Expected `int`"):
        decode_reply(msgpack.packb(reply))


def test_step_inputs_whose_lengths_disagree_are_refused():
    msg = _inputs().to_msg()
    # query_start_loc no longer ends at num_tokens
    msg = msgspec.structs.replace(msg, query_start_loc=(0, 1, 3))
    with pytest.raises(ValueError, match="disagree"):
        StepInputs.from_msg(msg)
    data = encode_command(RankCommand(seq=1, step=_inputs()))
    fields = msgpack.unpackb(data)[2]
    fields[1][6] = [0, 1, 3]
    with pytest.raises(ValueError, match=r"RankCommand: malformed cmd message: .*disagree"):
        decode_command(msgpack.packb(["cmd", V, fields]))


# ---- the link, between two real processes ------------------------------------------------


def _answer(rank: int, size: int) -> bytes:
    return bytes([rank]) + bytes((i * rank + size) % 253 for i in range(size - 1))


ANSWER_SIZES = (1, REPLY_INLINE_BYTES - 8, REPLY_INLINE_BYTES * 3)  # short, full, overflow


def _link_main(rank: int, port: int, out_dir: str) -> None:
    _, link = join_replica(rank, 3, "127.0.0.1", port, "cpu")
    try:
        if rank == 0:
            link.start_replies(lambda: None)
        sizes = (0, 100, COMMAND_INLINE_BYTES - 8, COMMAND_INLINE_BYTES + 5, 300_000)
        got = []
        for size in sizes:
            data = bytes((i * 7 + size) % 251 for i in range(size))
            if rank == 0:
                link.send(data)
                received = data
            else:
                received = link.receive()
            got.append(received == data)
        result: dict = {"broadcast_ok": got}
        if rank == 0:
            link.settle()
            result["answers_ended"] = link.join_replies(60.0)
            answers = link.take_replies()
            # Each rank's answers arrive whole and in its order; the ranks interleave.
            result["answers_ok"] = [
                [a for a in answers if a in {_answer(r, n) for n in ANSWER_SIZES}]
                == [_answer(r, n) for n in ANSWER_SIZES]
                for r in (1, 2)
            ]
            result["num_answers"] = len(answers)
        else:
            for size in ANSWER_SIZES:
                link.reply(_answer(rank, size))
            link.reply_done()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        leave_replica()


def test_the_link_carries_short_and_long_messages_both_ways(tmp_path):
    mp.start_processes(
        _link_main,
        args=(free_port("127.0.0.1"), str(tmp_path)),
        nprocs=3,
        join=True,
        start_method="spawn",
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(r["broadcast_ok"] == [True] * 5 for r in ranks)
    assert ranks[0]["answers_ended"]  # every rank's last answer came: the reader stopped
    assert ranks[0]["answers_ok"] == [True, True] and ranks[0]["num_answers"] == 6
