"""The prefill / decode worker as a Ray actor, and the router's async handle on it.

:class:`WorkerActor` is a thin adapter: it builds the engine and the KV connector from a
:class:`WorkerSpec` and forwards calls to :class:`~workers.service.EngineService`. Every
argument and result is bytes, str, int or float, so Ray carries them as msgpack (Ray
pickles only objects msgpack cannot represent); messages are our own msgpack
(``workers/wire.py``, ``kvtransfer/messages.py``). Methods return errors as values rather
than raising, because Ray ships exceptions pickled.

Ray carries the control calls only; token events and reports come back over the worker's
event channel (``workers/channel.py``), which the router asks it to open at start.
The engine runs on the service's own thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import msgpack

from workers.channel import BatchHandler, ChannelListener, ChannelReader, ChannelSender, LostHandler
from workers.wire import WorkerInfo, WorkItem, decode_as, encode

logger = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 8


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start (built by cluster/ from the cluster config)."""

    name: str
    role: str  # prefill | decode
    model: str  # Hugging Face directory
    model_id: str  # served name: part of the KV layout fingerprint
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 2.0
    gpu_memory_fraction: float = 0.90
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_backend: str = "nixl"
    kv_direction: str = "auto"
    lease_seconds: float = 30.0
    transfer_timeout_s: float = 10.0
    on_failure: str = "recompute"
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default

    def to_bytes(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> WorkerSpec:
        return cls(**msgpack.unpackb(data, raw=False))


class WorkerActor:
    """Runs one worker replica (tensor/pipeline parallel size 1) inside a Ray actor."""

    def __init__(self, spec_bytes: bytes):
        spec = WorkerSpec.from_bytes(spec_bytes)
        import torch

        from kvtransfer import KVLayout, KVTransferConfig, create_connector
        from workers.config import EngineConfig
        from workers.engine import LLMEngine
        from workers.service import EngineService

        if spec.num_threads > 0:
            torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self._sender: ChannelSender | None = None
        engine = LLMEngine(
            EngineConfig(
                model=spec.model,
                dtype=spec.dtype,
                device=spec.device,
                max_model_len=spec.max_model_len,
                block_size=spec.block_size,
                num_kv_blocks=spec.num_kv_blocks,
                kv_cache_memory_gib=spec.kv_cache_memory_gib,
                gpu_memory_fraction=spec.gpu_memory_fraction,
                max_num_seqs=spec.max_num_seqs,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                enable_prefix_caching=spec.enable_prefix_caching,
                detokenize=False,  # the router detokenizes at the edge
            )
        )
        if engine.device.type == "cpu":
            # The cache comes zeroed but unmapped (calloc): touch every page now, so the
            # first requests' KV transfers do not pay the page faults (they measured ~8x
            # slower on this machine's first run).
            engine.kv_cache.zero_()
        transfer = KVTransferConfig(
            backend=spec.kv_backend,
            direction=spec.kv_direction,
            lease_seconds=spec.lease_seconds,
            transfer_timeout_s=spec.transfer_timeout_s,
        )

        def make_connector(eng, on_release):
            layout = KVLayout.from_tensor(
                eng.kv_cache, model_id=spec.model_id, num_kv_heads=eng.arch.num_key_value_heads
            )
            return create_connector(transfer, layout, eng.kv_cache, spec.name, on_release)

        self.service = EngineService(
            engine, spec.name, spec.role, make_connector, on_failure=spec.on_failure
        )
        logger.info("worker %s (%s) ready in pid %d", spec.name, spec.role, os.getpid())

    def describe(self) -> bytes:
        """A :class:`~workers.wire.WorkerInfo`: what this worker resolved at start-up."""
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

    def kv_metadata(self) -> bytes:
        assert self.service.connector is not None
        return self.service.connector.metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Returns "" on success, else the error (a layout mismatch names what differs)."""
        assert self.service.connector is not None
        try:
            self.service.connector.add_peer(metadata)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def submit(self, item: bytes) -> str:
        try:
            self.service.submit(decode_as(item, WorkItem))
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

    def open_channel(self, host: str, port: int, token: str) -> str:
        """Connect to the router's event channel and push every batch there from now on."""
        try:
            sender = ChannelSender(host, port, self.spec.name, token)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            self.service.attach(sender.send)
        except Exception as exc:  # the engine loop has failed
            sender.close()
            return f"{type(exc).__name__}: {exc}"
        if self._sender is not None:
            self._sender.close()
        self._sender = sender
        return ""

    def stop(self) -> str:
        self.service.stop()
        if self._sender is not None:
            self._sender.close()
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
        error = await self._actor.open_channel.remote(listener.host, listener.port, listener.token)
        if error:
            raise ConnectionError(f"worker {self.name} cannot open its event channel: {error}")
        self._channel = await listener.accepted(self.name, future)

    async def submit(self, item: WorkItem) -> None:
        error = await self._actor.submit.remote(encode(item))
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
