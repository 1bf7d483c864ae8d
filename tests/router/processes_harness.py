"""Several router processes (``router.processes``) over the in-process cluster of
test_router_flow: real EngineServices, each worker with one real event channel per router
process; the first router's hub (cluster/router_hub.py) and the others linked over real
sockets (router/process_link.py). The other processes run either in this process (their
real code, ``ExtraProcess``, on this event loop: the tests can look inside them) or as
real ``python -m cluster.router_process`` subprocesses (the test that kills one)."""

from __future__ import annotations

import asyncio
import socket

import msgspec

from cluster.config import parse_config
from cluster.router_hub import RouterHub, launch_subprocess
from cluster.router_process import ExtraProcess
from router.process_link import ProcessLink, Start
from tests.router.test_router_flow import Cluster, InProcessClient
from workers.serving.channel import ChannelSender


class MultiClient(InProcessClient):
    """The first process's client of an in-process worker, with what the hub needs: a
    submit that names the router process, and channels to the other processes."""

    def __init__(self, service, listener):
        super().__init__(service, listener)
        self.senders: dict[int, ChannelSender] = {}

    async def submit(self, item, router: int = 0):
        self.service.submit(item, router)

    async def open_channel(self, host, port, token, cert_pem, router: int = 0) -> str:
        try:
            sender = await asyncio.to_thread(ChannelSender, host, port, self.name, token, cert_pem)
        except OSError as exc:
            return str(exc)
        self.service.attach(sender.send, router)
        self.senders[router] = sender
        return ""


class TaskHandle:
    """An in-process "process": ``ExtraProcess.serve`` as a task."""

    pid = 0

    def __init__(self, task: asyncio.Task):
        self.task = task

    @property
    def returncode(self) -> int | None:
        return (0 if not self.task.cancelled() and not self.task.exception() else 1) if (
            self.task.done()
        ) else None  # fmt: skip

    async def wait(self) -> int:
        await asyncio.wait([self.task])
        return self.returncode or 0

    def kill(self) -> None:
        self.task.cancel()


class MultiCluster(Cluster):
    """``num_processes`` router processes; ``in_process``: the others run here."""

    def __init__(self, model_dir, *args, num_processes=2, in_process=True, **kwargs):
        self.model_dir = model_dir
        self.num_processes = num_processes
        self.extras: list[ExtraProcess] = []
        super().__init__(model_dir, *args, **kwargs)
        self.hub = None
        if num_processes > 1:
            start = Start(
                index=0,
                config_json=parse_config({"router": {"http_port": 0, "port": 0}}).model_dump_json(),
                router_config=msgspec.msgpack.encode(self.router.config),
                model_dir=str(model_dir),
                workers=[],
                channel_host=self.listener.host,
                channel_tls=False,
                grpc_port=0,
                http_port=0,
            )
            launch = self._launch_here if in_process else launch_subprocess
            self.hub = RouterHub(self.router, num_processes, start, launch)

    def _client(self, service) -> MultiClient:
        return MultiClient(service, self.listener)

    async def _launch_here(self, theirs: socket.socket) -> TaskHandle:
        link = await ProcessLink.open(theirs)
        extra = ExtraProcess(link)
        self.extras.append(extra)
        return TaskHandle(asyncio.get_running_loop().create_task(extra.serve()))

    @property
    def routers(self) -> list:
        """Every router process's Router, the first first (in-process extras only)."""
        return [self.router, *(e.router for e in self.extras)]

    def close(self) -> None:
        super().close()
        for view in [*self.router.prefill, *self.router.decode]:
            for sender in view.client.senders.values():
                sender.close()


def run_multi(cluster: MultiCluster, body):
    """``body(cluster)`` with every router process started; stops them all after."""

    async def main():
        await cluster.router.start(ready_timeout_s=30)
        try:
            if cluster.hub is not None:
                cluster.addresses = await cluster.hub.start(0, 0)
            return await body(cluster)
        finally:
            if cluster.hub is not None:
                await cluster.hub.stop()
            await cluster.router.stop()
            cluster.close()
            await cluster.listener.close()

    return asyncio.run(main())
