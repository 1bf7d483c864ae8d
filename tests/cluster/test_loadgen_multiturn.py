"""The multi-turn workload without a cluster: what each session sends (seeded), how its
history grows with the replies it gets, its think times, the session driver's schedule
(with a stand-in for the gRPC call), and the first/later-turn figures."""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import pytest

from cluster.loadgen.datasets import BenchRequest
from cluster.loadgen.metrics import turn_summary
from cluster.loadgen.multiturn import history, multi_turn_workload
from cluster.loadgen.runner import RequestRecord
from cluster.loadgen.sessions import SESSION_ENDED, drive_sessions, reply_digest

VOCAB = 1000


def workload(num_sessions=3, num_turns=4, think=1.0, seed=0, range_ratio=0.0):
    return multi_turn_workload(num_sessions, num_turns, 24, 6, 5, range_ratio, think, VOCAB, seed)


def fake_reply(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """A reply that depends on the whole prompt (as a model's does)."""
    return [10 + (sum(prompt) + i) % (VOCAB - 10) for i in range(max_tokens)]


def test_history_grows_by_the_reply_and_the_next_message_exactly():
    w = workload()
    assert len(w.system_prompt) == 24 and all(10 <= t < VOCAB for t in w.system_prompt)
    for i, s in enumerate(w.sessions):
        replies: list[list[int]] = []
        previous: tuple[int, ...] = ()
        for t in range(s.num_turns):
            prompt = history(w, i, replies)
            if t == 0:
                assert prompt == w.system_prompt + s.user_messages[0]
            else:
                # The previous prompt, the model's reply to it, this turn's message.
                assert prompt == previous + tuple(replies[-1]) + s.user_messages[t]
            assert len(prompt) == 24 + 6 * (t + 1) + 5 * t
            replies.append(fake_reply(prompt, s.max_tokens[t]))
            previous = prompt
        with pytest.raises(ValueError, match="has 4 turns, not 5"):
            history(w, i, replies)
    # Sessions share the system prompt and nothing after it.
    assert len({s.user_messages[0] for s in w.sessions}) == 3
    # A short reply (EOS before max_tokens) is what the next turn carries.
    s = w.sessions[0]
    assert (
        history(w, 0, [[77]]) == w.system_prompt + s.user_messages[0] + (77,) + s.user_messages[1]
    )


def test_the_seed_fixes_every_session_and_sessions_do_not_depend_on_their_number():
    assert workload(seed=4) == workload(seed=4)
    assert workload(seed=4) != workload(seed=5)
    assert workload(seed=4).system_prompt != workload(seed=5).system_prompt
    assert workload(num_sessions=5, seed=4).sessions[:3] == workload(seed=4).sessions
    varied = workload(num_sessions=50, range_ratio=0.5)
    lengths = {len(m) for s in varied.sessions for m in s.user_messages}
    outputs = {n for s in varied.sessions for n in s.max_tokens}
    assert lengths <= set(range(3, 10)) and len(lengths) > 3
    assert outputs <= set(range(2, 9)) and len(outputs) > 3


def test_think_times_are_exponential_with_the_asked_mean():
    w = workload(num_sessions=3000, num_turns=3, think=2.0)
    think = np.array([t for s in w.sessions for t in s.think_s])
    assert all(len(s.think_s) == 2 for s in w.sessions)
    assert think.min() >= 0 and abs(think.mean() - 2.0) < 0.1
    assert abs(think.std() / think.mean() - 1.0) < 0.05  # exponential: CV = 1
    assert all(s.think_s == (0.0, 0.0, 0.0) for s in workload(think=0.0).sessions)


def test_sizes_for_max_model_len_and_the_working_set():
    w = workload()  # 24 system, 4 turns of 6-token messages and 5-token replies
    assert w.num_requests == 12
    assert w.longest_request() == 24 + 4 * 6 + 3 * 5 + 5
    assert w.working_set_tokens() == 24 + 3 * (4 * 6 + 3 * 5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4, 24, 6, 5, 0.0, 1.0), "--num-sessions: must be >= 1"),
        ((3, 0, 24, 6, 5, 0.0, 1.0), "--num-turns: must be >= 1"),
        ((3, 4, -1, 6, 5, 0.0, 1.0), "--system-prompt-len: must be >= 0"),
        ((3, 4, 24, 6, 5, 1.0, 1.0), r"--range-ratio: must be in \[0, 1\)"),
        ((3, 4, 24, 6, 5, 0.0, -1.0), "--think-time: must be >= 0"),
    ],
)
def test_bad_workload_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        multi_turn_workload(*args, VOCAB, 0)


class FakeServer:
    """Stands in for the gRPC call: answers after ``delay_s`` with :func:`fake_reply`,
    records what it was sent and how many sessions were in progress."""

    def __init__(self, delay_s: float, fail: tuple[int, int] | None = None):
        self.delay_s, self.fail = delay_s, fail
        self.prompts: dict[tuple[int, int], tuple[int, ...]] = {}
        self.active: set[int] = set()
        self.most_active = 0

    async def send(self, req: BenchRequest, record: RequestRecord, start: float, reply) -> None:
        self.prompts[(record.session, record.turn)] = req.prompt_ids
        self.active.add(record.session)
        self.most_active = max(self.most_active, len(self.active))
        sent = time.perf_counter()
        record.send_s = sent - start
        await asyncio.sleep(self.delay_s)
        if (record.session, record.turn) == self.fail:
            record.error = "UNAVAILABLE"
            return
        reply.extend(fake_reply(req.prompt_ids, req.max_tokens))
        record.ttft_s = record.e2e_s = time.perf_counter() - sent
        record.output_len = req.max_tokens
        if record.turn == 2:  # this test's sessions have 3 turns
            self.active.discard(record.session)


def test_sessions_send_their_histories_after_their_think_times():
    w = workload(num_sessions=4, num_turns=3, think=0.05, seed=2)
    server = FakeServer(delay_s=0.01)
    records, duration = asyncio.run(drive_sessions(w, [0.0, 0.0, 0.1, 0.1], server.send))
    assert [(r.session, r.turn) for r in records] == [(i, t) for i in range(4) for t in range(3)]
    assert all(r.ok for r in records)
    for i, s in enumerate(w.sessions):
        replies = []
        for t in range(3):
            prompt = server.prompts[(i, t)]
            assert prompt == history(w, i, replies)  # built from the replies it got
            assert records[3 * i + t].prompt_len == len(prompt)
            replies.append(fake_reply(prompt, s.max_tokens[t]))
            assert records[3 * i + t].output_digest == reply_digest(replies[-1])
        own = records[3 * i : 3 * i + 3]
        assert own[0].send_s >= (0.1 if i >= 2 else 0.0)
        for t in (1, 2):  # the next turn waits for the reply, then thinks
            earliest = own[t - 1].send_s + own[t - 1].e2e_s + s.think_s[t - 1]
            assert own[t].send_s >= earliest - 1e-3
    assert duration >= max(r.send_s + r.e2e_s for r in records) - 1e-3
    assert len({r.output_digest for r in records}) == 12  # every reply differs here
    assert reply_digest([1, 2]) != reply_digest([2, 1]) != reply_digest([258])


def test_max_sessions_caps_the_sessions_in_progress():
    w = workload(num_sessions=5, num_turns=3, think=0.01)
    server = FakeServer(delay_s=0.005)
    records, _ = asyncio.run(drive_sessions(w, [0.0] * 5, server.send, max_sessions=2))
    assert all(r.ok for r in records)
    assert server.most_active == 2
    uncapped = FakeServer(delay_s=0.005)
    asyncio.run(drive_sessions(w, [0.0] * 5, uncapped.send))
    assert uncapped.most_active == 5  # every first turn goes at once


def test_a_failed_turn_ends_its_session_only():
    w = workload(num_sessions=2, num_turns=3, think=0.0)
    server = FakeServer(delay_s=0.0, fail=(1, 1))
    done: list[int] = []
    records, _ = asyncio.run(
        drive_sessions(w, [0.0, 0.0], server.send, on_done=lambda r: done.append(r.index))
    )
    assert [r.error for r in records] == ["", "", "", "", "UNAVAILABLE", SESSION_ENDED]
    assert (1, 2) not in server.prompts  # never sent: it needs the missing reply
    assert sorted(done) == list(range(6))
    with pytest.raises(ValueError, match="one arrival offset per session"):
        asyncio.run(drive_sessions(w, [0.0], server.send))


def test_turn_summary_splits_first_and_later_turns():
    def record(i, session, turn, ttft, prompt, cached, worker, error=""):
        return RequestRecord(
            i, prompt, 4, ttft_s=ttft, e2e_s=ttft + 0.1, output_len=4,
            cached_prompt_tokens=cached, decode_worker=worker, error=error,
            session=session, turn=turn,
        )  # fmt: skip

    records = [
        record(0, 0, 0, 0.50, 100, 0, "decode-0"),
        record(1, 0, 1, 0.10, 200, 96, "decode-0"),
        record(2, 0, 2, 0.20, 300, 192, "decode-1"),
        record(3, 1, 0, 0.30, 100, 64, "decode-1"),
        record(4, 1, 1, 0.40, 200, 0, "decode-1"),
        record(5, 1, 2, 9.99, 300, 0, "", error="UNAVAILABLE"),
    ]
    m = turn_summary(records)
    first, later = m["first_turn"], m["later_turns"]
    assert first["completed"] == 2 and later["completed"] == 3
    assert first["prompt_tokens"] == 200 and first["cached_prompt_tokens"] == 64
    assert later["prompt_tokens"] == 700 and later["cached_prompt_tokens"] == 288
    assert later["cached_share"] == pytest.approx(288 / 700)
    assert first["ttft_ms"]["median"] == pytest.approx(400.0)
    assert later["ttft_ms"]["median"] == pytest.approx(200.0)
    assert later["ttft_ms"]["p90"] == pytest.approx(np.percentile([100, 200, 400], 90))
    assert later["ttft_ms"]["mean"] == pytest.approx(statistics.mean([100, 200, 400]))
    assert m["requests_per_worker"] == {"decode-0": 2, "decode-1": 3}
    assert m["sessions_moved"] == 1  # session 0 ran on both workers
