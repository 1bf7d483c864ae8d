"""The first router process's side of ``router.processes: N``: it starts, links and
supervises processes 1..N-1 (``cluster/router_process.py``) and makes their Ray calls.

Why the first process keeps Ray: it is the Ray driver (the workers are its actors) and
owns their lifecycle (restarts, live scaling, the planner), so the others need no Ray
connection of their own (a second driver costs a second or two and ~100 MB each); their
control calls, one per request, cross the local link (``router/process_link.py``) and go
out as Ray calls that name the process (``WorkerActor.submit(item, router)``), whose
requests' events the worker then sends on that process's event channel.

Supervision: a process that dies is started again after a back-off (1 s, doubling up to
30 s), with the same number; the workers drop its dead channel at their next send and
abort its requests (``workers/serving/sinks.py``); the other processes and their streams
do not notice. The first process dying ends the cluster, as it always has (it is Ray's
driver): the others see their link close and exit.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from msgspec.structs import replace

from router.process_link import (
    Abort,
    AbortById,
    Decline,
    Drain,
    Listening,
    Message,
    ProcessLink,
    Ready,
    Reply,
    Start,
    Stop,
    Submit,
    WorkerJoined,
    WorkerLeft,
)
from workers.protocol.wire import WorkItem, decode_as

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a process reads the tokenizer and binds its ports by then
_STOP_TIMEOUT_S = 5.0
_BACKOFF_S, _MAX_BACKOFF_S = 1.0, 30.0


class ExtraHandle(Protocol):
    """A started extra process (``asyncio.subprocess.Process`` is one)."""

    pid: int
    returncode: int | None

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


# Starts an extra router process on its end of the link (the launcher owns the socket).
Launcher = Callable[[socket.socket], Awaitable[ExtraHandle]]


async def launch_subprocess(theirs: socket.socket) -> ExtraHandle:
    """``python -m cluster.router_process FD``, with the link's end as FD."""
    with theirs:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cluster.router_process", str(theirs.fileno()),
            pass_fds=(theirs.fileno(),),
        )  # fmt: skip


@dataclass
class _Extra:
    """One of processes 1..N-1, in its current incarnation."""

    index: int
    process: ExtraHandle | None = None
    link: ProcessLink | None = None
    listening: Listening | None = None
    ready: asyncio.Future[str] | None = None  # its gRPC address, once it serves
    num_starts: int = 0


class RouterHub:
    """router.group.RouterGroup of the first process, and the others' supervisor.

    ``start`` is a :class:`Start` without ``index``, ``workers`` and the ports (filled in
    for each process when it starts)."""

    id_prefix = "r0:"

    def __init__(self, router, num_processes: int, start: Start, launch: Launcher | None = None):
        """``launch``: how a process starts (tests run them in-process); default: a
        ``python -m cluster.router_process`` subprocess."""
        self.router = router
        self._launch = launch or launch_subprocess
        self.template = start
        self._ports = (0, 0)
        self.is_stopping = False
        self._is_started = False  # every process served once: from now on, restarts
        self._extras = {i: _Extra(i) for i in range(1, num_processes)}
        self._tasks: set[asyncio.Task] = set()
        router.join_group(self)

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self, grpc_port: int, http_port: int) -> list[str]:
        """Start processes 1..N-1 on these ports; returns their gRPC addresses once all
        serve; raises if one does not within ``_START_TIMEOUT_S``."""
        self._ports = (grpc_port, http_port)
        for extra in self._extras.values():
            await self._spawn(extra)
        ready = [extra.ready for extra in self._extras.values() if extra.ready is not None]
        done, _ = await asyncio.wait(ready, timeout=_START_TIMEOUT_S)
        if len(done) < len(ready):
            raise TimeoutError(f"router processes did not start within {_START_TIMEOUT_S:g} s")
        addresses = [future.result() for future in ready]  # raises: one died starting
        self._is_started = True
        return addresses

    async def _spawn(self, extra: _Extra) -> None:
        extra.ready = asyncio.get_running_loop().create_future()  # this incarnation's
        ours, theirs = socket.socketpair()
        extra.process = await self._launch(theirs)
        link = await ProcessLink.open(ours)
        extra.link, extra.listening = link, None
        extra.num_starts += 1
        live = [v for v in [*self.router.prefill, *self.router.decode] if v.is_alive]
        workers = [(v.name, v.client.role) for v in live]
        grpc_port, http_port = self._ports
        link.send(replace(self.template, index=extra.index, workers=workers,
                          grpc_port=grpc_port, http_port=http_port))  # fmt: skip
        self._spawn_task(link.serve(lambda lk, msg: self._handle(extra, lk, msg)))
        self._spawn_task(self._supervise(extra, link))

    async def _supervise(self, extra: _Extra, link: ProcessLink) -> None:
        process = extra.process
        waits = [asyncio.ensure_future(process.wait()), link.closed]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if self.is_stopping:
            return
        link.close("the process ended")
        if process.returncode is None:  # its link broke: it is of no use any more
            process.kill()
        code = await process.wait()
        if not self._is_started:  # a broken set-up fails the start, not a restart loop
            if not extra.ready.done():
                why = f"router process {extra.index} exited ({code}) while starting"
                extra.ready.set_exception(RuntimeError(why))
            return
        backoff = min(_MAX_BACKOFF_S, _BACKOFF_S * 2 ** max(0, extra.num_starts - 1))
        logger.error(
            "router process %d exited (%s); starting it again in %g s", extra.index, code, backoff
        )
        await asyncio.sleep(backoff)
        if not self.is_stopping:
            await self._spawn(extra)

    async def drain(self, grace_s: float) -> int:
        """Every other process drains (as the first does); returns how many they aborted."""
        links = [e.link for e in self._extras.values() if e.link is not None]
        calls = [lk.call(Drain(lk.next_call(), grace_s), grace_s + 30.0) for lk in links]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        return sum(r.num_aborted for r in replies if isinstance(r, Reply))

    async def stop(self) -> None:
        self.is_stopping = True
        for extra in self._extras.values():
            if extra.link is not None and not extra.link.closed.done():
                extra.link.send(Stop())
        for extra in self._extras.values():
            process = extra.process
            if process is None:
                continue
            try:
                await asyncio.wait_for(process.wait(), _STOP_TIMEOUT_S)
            except TimeoutError:
                process.kill()
                await process.wait()
            if extra.link is not None:
                extra.link.close("stopped")
        for task in list(self._tasks):
            task.cancel()

    async def address(self, index: int) -> str:
        """Process ``index``'s gRPC address, once it serves (after a restart: again)."""
        ready = self._extras[index].ready
        if ready is None:
            raise RuntimeError(f"router process {index} was never started")
        return await asyncio.shield(ready)

    @property
    def pids(self) -> dict[int, int]:
        """The running processes' ids by number (tests, ``baton status``)."""
        return {i: e.process.pid for i, e in self._extras.items() if e.process is not None}

    # ---- router.group.RouterGroup ----------------------------------------------------
    async def abort_elsewhere(self, request_id: str, principal: str, but: int = 0) -> bool:
        links = [
            e.link for i, e in self._extras.items()
            if i != but and e.link is not None and e.ready is not None and e.ready.done()
        ]  # fmt: skip
        calls = [lk.call(AbortById(lk.next_call(), request_id, principal), 10.0) for lk in links]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        return any(isinstance(r, Reply) and r.found for r in replies)

    async def worker_joined(self, name: str, role: str) -> None:
        view = self.router.worker(name)
        for extra in self._extras.values():
            link, where = extra.link, extra.listening
            if link is None or where is None or link.closed.done():
                continue  # one starting now gets it in its Start
            try:
                await link.call(WorkerJoined(link.next_call(), name, role), 10.0)
                error = await view.client.open_channel(
                    where.host, where.port, where.token, where.cert_pem, extra.index
                )
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            if error:
                logger.error("worker %s: no channel to router process %d: %s",
                             name, extra.index, error)  # fmt: skip

    def worker_left(self, name: str) -> None:
        for extra in self._extras.values():
            if extra.link is not None and not extra.link.closed.done():
                extra.link.send(WorkerLeft(name))

    # ---- the others' messages --------------------------------------------------------
    async def _handle(self, extra: _Extra, link: ProcessLink, message: Message) -> None:
        router = self.router
        match message:
            case Listening(call, host, port, token, cert_pem):
                extra.listening = message
                live = [v for v in [*router.prefill, *router.decode] if v.is_alive]
                opened = [v.client.open_channel(host, port, token, cert_pem, extra.index)
                          for v in live]  # fmt: skip
                errors = await asyncio.gather(*opened, return_exceptions=True)
                why = "; ".join(f"{v.name}: {e}" for v, e in zip(live, errors, strict=True) if e)
                link.send(Reply(call, error=why))
            case Ready(address):
                logger.info("router process %d serves on %s", extra.index, address)
                extra.ready.set_result(address)
            case Submit(call, worker, item):
                view = router.worker(worker)
                try:
                    if view is None or not view.is_alive:
                        raise RuntimeError(f"worker {worker} is gone")
                    await view.client.submit(decode_as(item, WorkItem), extra.index)
                except Exception as exc:
                    link.send(Reply(call, error=f"{type(exc).__name__}: {exc}"))
                else:
                    link.send(Reply(call))
            case Abort(worker, request_id):
                if (view := router.worker(worker)) is not None:
                    await view.client.abort(request_id)
            case Decline(worker, handles):
                if (view := router.worker(worker)) is not None:
                    await view.client.decline(tuple(handles))
            case AbortById(call, request_id, principal):
                found = await router.abort_here(request_id, principal)
                found = found or await self.abort_elsewhere(request_id, principal, extra.index)
                link.send(Reply(call, found=found))
            case _:
                raise TypeError(f"unexpected {type(message).__name__}")

    def _spawn_task(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
