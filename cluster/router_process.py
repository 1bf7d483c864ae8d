"""One of the extra router processes of ``router.processes: N`` (numbers 1..N-1).

``python -m cluster.router_process FD``: started by the first process
(``cluster/router_hub.py``) with its end of a socketpair as ``FD``. It never touches Ray:
it serves gRPC and HTTP on the first process's ports (SO_REUSEPORT), runs a whole
:class:`~router.router.Router` over every worker, reads each worker's event channel to
its own listener (its requests' events, every report), and has the first process make its
control calls (submit, abort, decline: one per request) on Ray. It ignores SIGINT and
SIGTERM: the first process drains and stops it (a Ctrl-C reaches the whole process group);
it exits when the first process goes away.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import msgspec

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
from workers.protocol.wire import WorkItem, encode
from workers.serving.channel import BatchHandler, ChannelListener, LostHandler

logger = logging.getLogger(__name__)

_REPLACE_WAIT_S = 20.0  # a restarted worker's old channel closes (or goes silent) by then


class LinkedWorkerClient:
    """A worker as an extra router process sees it (router.workers.WorkerClient): events
    over the event channel the worker opened to this process's listener, control calls
    through the first process (which makes them on Ray, naming this process)."""

    def __init__(self, name: str, role: str, link: ProcessLink, listener: ChannelListener):
        self.name, self.role = name, role
        self._link, self._listener = link, listener
        self._future = listener.expect(name)  # before the first process asks it to connect
        self._channel = None

    async def start(self) -> None:
        self._channel = await self._listener.accepted(self.name, self._future, 60.0)

    async def submit(self, item: WorkItem) -> None:
        link = self._link
        reply = await link.call(Submit(link.next_call(), self.name, encode(item)))
        if reply.error:
            raise RuntimeError(f"worker {self.name} refused {item.request_id}: {reply.error}")

    async def abort(self, request_id: str) -> None:
        self._link.send(Abort(self.name, request_id))

    async def decline(self, handles: tuple[bytes, ...]) -> None:
        self._link.send(Decline(self.name, list(handles)))

    def listen(self, on_batch: BatchHandler, on_lost: LostHandler) -> None:
        if self._channel is None:
            raise RuntimeError(f"worker {self.name}: start() first")
        self._channel.listen(on_batch, on_lost)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


class FirstProcess:
    """router.group.RouterGroup for an extra process: the first one answers for all."""

    def __init__(self, link: ProcessLink, index: int):
        self.link = link
        self.id_prefix = f"r{index}:"

    async def abort_elsewhere(self, request_id: str, principal: str) -> bool:
        link = self.link
        try:
            reply = await link.call(AbortById(link.next_call(), request_id, principal), 10.0)
        except (ConnectionError, TimeoutError):
            return False
        return reply.found

    async def worker_joined(self, name: str, role: str) -> None: ...  # the first one's news

    def worker_left(self, name: str) -> None: ...


class ExtraProcess:
    """The extra process's life: start from ``Start``, serve, drain and stop when told."""

    def __init__(self, link: ProcessLink):
        self.link = link
        self.router = None
        self.server = self.http = self.listener = None
        self.started: asyncio.Future[Start] = asyncio.get_running_loop().create_future()
        self.stop = asyncio.Event()

    async def handle(self, link: ProcessLink, message: Message) -> None:
        match message:
            case Start():
                self.started.set_result(message)
            case AbortById(call, request_id, principal):
                found = self.router is not None and await self.router.abort_here(
                    request_id, principal
                )
                link.send(Reply(call, found=bool(found)))
            case WorkerJoined(call, name, role):
                client = LinkedWorkerClient(name, role, link, self.listener)
                link.send(Reply(call))  # now the first process asks the worker to connect
                await self._joined(client)
            case WorkerLeft(name):
                view = self.router.worker(name)
                if view is not None:
                    self.router.migrate_away(view, "retired")
                    self.router.remove_worker(view)
            case Drain(call, grace_s):
                aborted = await self.server.drain(grace_s) if self.server is not None else 0
                link.send(Reply(call, num_aborted=aborted))
            case Stop():
                self.stop.set()
            case _:
                raise TypeError(f"unexpected {type(message).__name__}")

    async def _joined(self, client: LinkedWorkerClient) -> None:
        router = self.router
        view = router.worker(client.name)
        if view is None:
            await router.add_worker(client)
            return
        # A restarted worker: its old channel here closes as the old one dies, which
        # migrates this process's requests off it; only then is it replaced.
        for _ in range(int(_REPLACE_WAIT_S / 0.05)):
            if not view.is_alive:
                break
            await asyncio.sleep(0.05)
        else:
            logger.warning("worker %s restarted but its old channel is open", client.name)
            client.close()
            return
        await router.replace_worker(client.name, client)

    async def serve(self) -> int:
        from cluster.config import ClusterConfig
        from cluster.serve import _http_server, admin_key, api_keys
        from router.config import RouterConfig
        from router.router import Router
        from router.server import Server
        from workers.text.tokenizer import Tokenizer

        link = self.link
        reading = asyncio.ensure_future(link.serve(self.handle))
        start = await self.started
        config = ClusterConfig.model_validate_json(start.config_json)
        router_config = msgspec.msgpack.decode(start.router_config, type=RouterConfig)
        self.listener = listener = ChannelListener(start.channel_host, tls=start.channel_tls)
        await listener.start()
        clients = {"prefill": [], "decode": []}
        for name, role in start.workers:
            clients[role].append(LinkedWorkerClient(name, role, link, listener))
        reply = await link.call(
            Listening(link.next_call(), listener.host, listener.port, listener.token,
                      listener.cert_pem)
        )  # fmt: skip
        if reply.error:
            raise RuntimeError(f"the workers cannot reach router process {start.index}: "
                               f"{reply.error}")  # fmt: skip
        self.router = router = Router(
            router_config,
            Tokenizer.from_dir(start.model_dir),
            clients["prefill"],
            clients["decode"],
            tracing=_tracing(config),
        )
        router.join_group(FirstProcess(link, start.index))
        await router.start()
        tp_pp = {
            "prefill": (config.prefill.tensor_parallel, config.prefill.pipeline_parallel),
            "decode": (config.decode.tensor_parallel, config.decode.pipeline_parallel),
        }
        keys, tls, host = api_keys(config, quiet=True), config.router.tls(), config.router.host
        self.server = Server(router, host, start.grpc_port, tp_pp, keys, tls, reuse_port=True)
        await self.server.start()
        if start.http_port:
            http_config = config.model_copy(
                update={"router": config.router.model_copy(update={"http_port": start.http_port})}
            )
            self.http = _http_server(http_config, router, keys, admin_key(config, quiet=True),
                                     reuse_port=True)  # fmt: skip
            await self.http.start()
        link.send(Ready(self.server.address))
        await asyncio.wait(
            [asyncio.ensure_future(self.stop.wait()), link.closed], return_when="FIRST_COMPLETED"
        )
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(0.5)
        await router.stop()
        await listener.close()
        link.close("stopped")
        reading.cancel()
        return 0


def _tracing(config):
    """As cluster/bringup.py's (which imports Ray: not here)."""
    settings = config.tracing.resolved()
    if settings is None:
        return None
    from router.tracing import Tracing

    return Tracing(settings)


async def _main(fd: int) -> int:
    link = await ProcessLink.open(socket.socket(fileno=fd))
    return await ExtraProcess(link).serve()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the first process drains and stops us
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    fd = int(args[0])
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_main(fd))
    return uvloop.run(_main(fd))


if __name__ == "__main__":
    sys.exit(main())
