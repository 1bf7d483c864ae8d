"""The fallback of ``baton serve``'s shutdown when Ray's head dies under it
(cluster/serve.py): the drain and the stop of the workers watch the head and leave with
one line instead of blocking on a dead GCS. A fake cluster stands in for Ray (the real
group-signal case is tests/e2e/test_shutdown.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster import serve


class Left(Exception):
    pass


class FakeCluster:
    """``stop_workers`` blocks like a Ray call to a dead GCS until released."""

    def __init__(self, head_gone_after: int):
        self.polls = 0
        self.head_gone_after = head_gone_after
        self.started_ray = True
        self.release = threading.Event()

    def is_ray_head_gone(self) -> bool:
        self.polls += 1
        return self.polls > self.head_gone_after

    def stop_workers(self) -> None:
        self.release.wait(30)


def stop_ray_parts(cluster: FakeCluster, monkeypatch) -> list[str]:
    """Run ``_stop_ray_parts``; the lines it left with (``_leave`` frees the thread)."""
    lines: list[str] = []

    def leave(message: str) -> None:
        lines.append(message)
        cluster.release.set()  # asyncio.run waits for the executor's threads
        raise Left

    monkeypatch.setattr(serve, "_leave", leave)
    with pytest.raises(Left):
        asyncio.run(serve._stop_ray_parts(cluster))
    return lines


def test_a_head_lost_while_stopping_the_workers_leaves_with_one_line(monkeypatch):
    lines = stop_ray_parts(FakeCluster(head_gone_after=3), monkeypatch)
    assert lines == [serve._HEAD_GONE]


def test_workers_that_do_not_stop_in_time_leave_with_one_line(monkeypatch):
    monkeypatch.setattr(serve, "_RAY_STOP_S", 0.2)
    lines = stop_ray_parts(FakeCluster(head_gone_after=10**9), monkeypatch)
    assert lines == ["baton: the workers did not stop within 0 s; exiting"]


def test_the_drain_watch_sees_the_head_die_after_an_idle_drain():
    async def main() -> bool:
        drain = asyncio.get_running_loop().create_future()
        drain.set_result(0)  # an idle router's drain ends at once
        return await serve._head_lost_during(drain, FakeCluster(head_gone_after=2))

    assert asyncio.run(main()) is True


def test_the_drain_watch_is_false_while_the_head_lives():
    async def main() -> bool:
        drain = asyncio.ensure_future(asyncio.sleep(0.1, result=0))
        return await serve._head_lost_during(drain, FakeCluster(head_gone_after=10**9))

    assert asyncio.run(main()) is False
