"""The multi-turn workload: chat sessions that re-send their whole history every turn.

Every session starts with the same system prompt. Turn ``t`` of a session sends

    system prompt + user_0 + reply_0 + user_1 + reply_1 + ... + user_t

where ``reply_i`` are the token ids the model actually returned for turn ``i`` (so the
prompt of a turn is the previous turn's prompt and reply plus one new user message: what
a prefix cache can reuse). Between a reply and the next turn the user "thinks" for a
while (exponentially distributed, mean ``think_time_s``). What a session will say is fixed
up front from the seed (:func:`multi_turn_workload`); the replies, and so the exact
prompts after the first turn, come from the server (:func:`history`).

Token ids are drawn as in :mod:`cluster.loadgen.datasets`. Session ``i``'s messages, output
lengths and think times depend only on ``(seed, i)``, not on how many sessions there are.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.loadgen.datasets import random_ids, random_length


@dataclass(frozen=True)
class Session:
    """What one simulated user sends: a message per turn, the reply length asked for it,
    and the pause before each turn after the first (``len(think_s) == turns - 1``)."""

    user_messages: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    think_s: tuple[float, ...]

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)


@dataclass(frozen=True)
class MultiTurnWorkload:
    system_prompt: tuple[int, ...]
    sessions: tuple[Session, ...]

    @property
    def num_requests(self) -> int:
        return sum(s.num_turns for s in self.sessions)

    def longest_request(self) -> int:
        """The most tokens any turn can need (its prompt with full-length earlier replies,
        plus its own reply): what ``max_model_len`` must hold."""
        longest = 0
        for s in self.sessions:
            tokens = len(self.system_prompt)
            for message, max_tokens in zip(s.user_messages, s.max_tokens, strict=True):
                tokens += len(message)
                longest = max(longest, tokens + max_tokens)
                tokens += max_tokens
        return longest

    def working_set_tokens(self) -> int:
        """Distinct prompt tokens of the whole run when every reply is full length: the
        shared system prompt once, plus each session's final history (its last prompt
        holds every earlier prompt as a prefix)."""
        own = 0
        for s in self.sessions:
            own += sum(len(m) for m in s.user_messages) + sum(s.max_tokens[:-1])
        return len(self.system_prompt) + own


def multi_turn_workload(
    num_sessions: int,
    num_turns: int,
    system_prompt_len: int,
    user_len: int,
    output_len: int,
    range_ratio: float,
    think_time_s: float,
    vocab_size: int,
    seed: int,
) -> MultiTurnWorkload:
    """``num_sessions`` sessions of ``num_turns`` turns. User messages and output lengths
    are uniform in ``len × [1 - range_ratio, 1 + range_ratio]``; think times exponential
    with mean ``think_time_s`` (0: the next turn goes as soon as the reply ends)."""
    for name, value, least in (
        ("--num-sessions", num_sessions, 1),
        ("--num-turns", num_turns, 1),
        ("--system-prompt-len", system_prompt_len, 0),
        ("--input-len", user_len, 1),
        ("--output-len", output_len, 1),
    ):
        if value < least:
            raise ValueError(f"{name}: must be >= {least}, got {value}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio: must be in [0, 1), got {range_ratio}")
    if not think_time_s >= 0:
        raise ValueError(f"--think-time: must be >= 0 s, got {think_time_s}")
    system = random_ids(random.Random(f"{seed}/system"), system_prompt_len, vocab_size)
    sessions = []
    for i in range(num_sessions):
        rng = random.Random(f"{seed}/session/{i}")
        messages, lengths = [], []
        for _ in range(num_turns):
            messages.append(random_ids(rng, random_length(rng, user_len, range_ratio), vocab_size))
            lengths.append(random_length(rng, output_len, range_ratio))
        think = tuple(
            rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0
            for _ in range(num_turns - 1)
        )
        sessions.append(Session(tuple(messages), tuple(lengths), think))
    return MultiTurnWorkload(system, tuple(sessions))


def history(
    workload: MultiTurnWorkload, session: int, replies: Sequence[Sequence[int]]
) -> tuple[int, ...]:
    """The prompt of turn ``len(replies)`` of ``session``, given the replies to the turns
    before it: the system prompt, then each earlier message and its reply, then this
    turn's message."""
    s = workload.sessions[session]
    turn = len(replies)
    if turn >= s.num_turns:
        raise ValueError(f"session {session} has {s.num_turns} turns, not {turn + 1}")
    prompt = list(workload.system_prompt)
    for message, reply in zip(s.user_messages, replies, strict=False):
        prompt += message
        prompt += reply
    prompt += s.user_messages[turn]
    return tuple(prompt)
