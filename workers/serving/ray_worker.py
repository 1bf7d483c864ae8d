"""The prefill / decode worker as a Ray actor, and the router's async handle on it.

:class:`WorkerActor` is a thin adapter: it builds the engine and the KV connector from a
:class:`~workers.serving.worker_spec.WorkerSpec` and forwards calls to
:class:`~workers.serving.service.EngineService`. Every
argument and result is bytes, str, int or float, so Ray carries them as msgpack (Ray
pickles only objects msgpack cannot represent); messages are our own msgpack
(``workers/protocol/wire.py``, ``kvtransfer/messages.py``). Methods return errors as values rather
than raising, because Ray ships exceptions pickled.

Ray carries the control calls only; token events and reports come back over the worker's
event channel (``workers/serving/channel.py``), which the router asks it to open at start.
The engine runs on the service's own thread.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from workers.protocol.wire import WorkerInfo, WorkItem, decode_as, encode
from workers.serving.channel import (
    BatchHandler,
    ChannelListener,
    ChannelReader,
    ChannelSender,
    LostHandler,
)
from workers.serving.worker_spec import WorkerSpec, build_engine, connector_factory

if TYPE_CHECKING:
    from kvtransfer import KVConnector

logger = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 8


def _worker_metrics(spec: WorkerSpec):
    """This worker's series, recorded into its node's metrics directory; None when the
    cluster serves no metrics."""
    if not spec.metrics_dir:
        return None
    import ray

    from workers.serving.metrics import WorkerMetrics
    from workers.serving.metrics_node import node_directory, record_into

    node_id = ray.get_runtime_context().get_node_id()
    record_into(node_directory(spec.metrics_dir, node_id))
    return WorkerMetrics(spec.role, spec.model_id, spec.name)


class WorkerActor:
    """Rank 0 of a worker replica inside a Ray actor: the engine loop, the router's work and
    the KV hand-off; with several ranks (TP x PP) it drives the others (``ray_rank.py``).

    Built in two calls: the constructor only keeps the spec, so that bring-up can ask
    this rank where the replica meets (``rendezvous``) before every rank ``start``s.
    """

    def __init__(self, spec_bytes: bytes):
        self.spec = WorkerSpec.from_bytes(spec_bytes)
        self.service = None
        self._senders: dict[int, ChannelSender] = {}  # router process -> its event channel

    def rendezvous(self) -> list:
        """[address, port] where the replica's ranks join rank 0's process group."""
        import ray

        from workers.parallel.replica import free_port

        host = ray.util.get_node_ip_address()
        return [host, free_port(host)]

    def start(self, address: str = "", port: int = 0) -> str:
        """Load the model and start the engine loop; "" or the error."""
        try:
            self._start(address, port)
        except Exception as exc:
            logger.exception("worker %s failed to start", self.spec.name)
            return f"{type(exc).__name__}: {exc}"
        return ""

    def _start(self, address: str, port: int) -> None:
        from workers.parallel.replica import agree_min, join_replica
        from workers.parallel.replica_kv import ReplicaKV
        from workers.serving.service import EngineService

        spec = self.spec
        if spec.data_parallel > 1:  # one rank of a data-parallel group: its own worker
            self._start_dp_rank(address, port)
            return
        parallel = link = agree = None
        if spec.num_ranks > 1:
            device_type = "cuda" if spec.engine.device.startswith("cuda") else "cpu"
            parallel, link = join_replica(
                0, spec.num_ranks, address, port, device_type, spec.pipeline_parallel
            )
            agree = agree_min(link)
        replica = ReplicaKV(link, spec.dst_tensor_parallel, spec.dst_pipeline_parallel)
        engine = build_engine(
            spec, parallel, replica.before_forward if link is not None else None, agree
        )
        self.service = EngineService(
            engine,
            spec.name,
            spec.role,
            connector_factory(spec, 0),
            on_failure=spec.kv_transfer.on_failure,
            replica=replica,
            metrics=_worker_metrics(spec),
        )
        logger.info(
            "worker %s (%s, %d ranks) ready in pid %d",
            spec.name,
            spec.role,
            spec.num_ranks,
            os.getpid(),
        )

    def _start_dp_rank(self, address: str, port: int) -> None:
        from workers.parallel.replica_kv import ReplicaKV
        from workers.serving.service import EngineService
        from workers.serving.worker_spec import build_dp_engine

        spec = self.spec
        dp = build_dp_engine(spec, address, port)
        self.service = EngineService(
            dp.engine,
            spec.name,
            spec.role,
            connector_factory(spec, 0),  # its own agent: it pulls its own requests' blocks
            on_failure=spec.kv_transfer.on_failure,
            replica=ReplicaKV(),
            metrics=_worker_metrics(spec),
            dp=dp,
        )
        logger.info(
            "worker %s (%s, data-parallel rank %d of %d) ready in pid %d",
            spec.name,
            spec.role,
            spec.dp_rank,
            spec.data_parallel,
            os.getpid(),
        )

    def describe(self) -> bytes:
        """A :class:`~workers.protocol.wire.WorkerInfo`: what this worker resolved at start-up."""
        engine = self.service.engine
        return encode(
            WorkerInfo(
                name=self.spec.name,
                architecture=engine.arch.architecture,
                dtype=str(engine.dtype).removeprefix("torch."),
                max_model_len=engine.max_model_len,
                vocab_size=engine.vocab_size,
                block_size=engine.config.block_size,
                kv_blocks_total=engine.block_manager.num_blocks,
                device=str(engine.device),
            )
        )

    def _connector(self) -> KVConnector:
        # An explicit check, not an assert: asserts vanish under ``python -O``, and an
        # AssertionError reaches bring-up through Ray without saying what was wrong.
        if self.service is None or self.service.connector is None:
            raise RuntimeError(
                f"worker {self.spec.name} has no KV connector: it has not started "
                "(start() was not called or failed)"
            )
        return self.service.connector

    def kv_metadata(self) -> bytes:
        """This rank's KV layout and agent metadata, for its peers' ``add_peer``; raises
        RuntimeError before a successful ``start``."""
        return self._connector().metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Returns "" on success, else the error (a layout mismatch names what differs);
        raises RuntimeError before a successful ``start``."""
        connector = self._connector()
        try:
            connector.add_peer(metadata)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def submit(self, item: bytes, router: int = 0) -> str:
        """Queue a work item; its events go to router process ``router``'s channel."""
        try:
            self.service.submit(decode_as(item, WorkItem), router)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def abort(self, request_id: str) -> str:
        try:
            self.service.abort(request_id)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def decline(self, handles: list[bytes]) -> str:
        try:
            self.service.decline(handles)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def open_channel(
        self, host: str, port: int, token: str, cert_pem: bytes | None = None, router: int = 0
    ) -> str:
        """Connect to router process ``router``'s event channel and push its batches there
        from now on (over TLS, trusting only ``cert_pem``, when the router gives one)."""
        try:
            sender = ChannelSender(host, port, self.spec.name, token, cert_pem)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            self.service.attach(sender.send, router)
        except Exception as exc:  # the engine loop has failed
            sender.close()
            return f"{type(exc).__name__}: {exc}"
        old = self._senders.pop(router, None)
        if old is not None:
            old.close()
        self._senders[router] = sender
        return ""

    def stop(self) -> str:
        from workers.parallel.replica import leave_replica

        if self.service is not None:
            self.service.stop()  # the other ranks get their stop command from its loop
        for sender in self._senders.values():
            sender.close()
        leave_replica()
        return ""


class RayWorkerClient:
    """The router's async view of one worker actor (implements router.workers.WorkerClient)."""

    def __init__(self, name: str, role: str, actor, listener: ChannelListener):
        self.name = name
        self.role = role
        self._actor = actor
        self._listener = listener
        self._channel: ChannelReader | None = None

    async def start(self) -> None:
        listener = self._listener
        await listener.start()
        future = listener.expect(self.name)
        error = await self.open_channel(
            listener.host, listener.port, listener.token, listener.cert_pem
        )
        if error:
            raise ConnectionError(f"worker {self.name} cannot open its event channel: {error}")
        self._channel = await listener.accepted(self.name, future)

    async def open_channel(
        self, host: str, port: int, token: str, cert_pem: bytes | None, router: int = 0
    ) -> str:
        """Have the worker connect to router process ``router``'s listener; "" or why not."""
        return await self._actor.open_channel.remote(host, port, token, cert_pem, router)

    async def submit(self, item: WorkItem, router: int = 0) -> None:
        """``router``: the router process that gets its events (router.processes)."""
        error = await self._actor.submit.remote(encode(item), router)
        if error:
            raise RuntimeError(f"worker {self.name} refused {item.request_id}: {error}")

    async def abort(self, request_id: str) -> None:
        await self._actor.abort.remote(request_id)

    async def decline(self, handles: tuple[bytes, ...]) -> None:
        await self._actor.decline.remote(list(handles))

    def listen(self, on_batch: BatchHandler, on_lost: LostHandler) -> None:
        if self._channel is None:
            raise RuntimeError(f"worker {self.name}: start() first")
        self._channel.listen(on_batch, on_lost)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
