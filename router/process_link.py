"""The link between the first router process and each of the others (``router.processes``).

One local socket per extra process (a socketpair the first process makes when it starts
it), carrying typed msgspec structs as msgpack (never pickle), each frame a 4-byte
big-endian length and the message. Both ends run a :class:`ProcessLink`: ``call`` sends
a message and waits for its :class:`Reply` (by call number), ``send`` does not wait, and
every other message goes to the handler. What crosses is per request, never per token:

- others -> first: :class:`Listening` (its event channel's address: the workers are asked
  to connect), :class:`Ready`, and the control calls the first process makes on Ray for
  it (:class:`Submit`, :class:`Abort`, :class:`Decline`), a client's abort to look for
  elsewhere (:class:`AbortById`);
- first -> others: :class:`Start`, :class:`AbortById`, a worker that joined or left
  (:class:`WorkerJoined`, :class:`WorkerLeft`), :class:`Drain` and :class:`Stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
from collections.abc import Awaitable, Callable

import msgspec

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 16 << 20  # a Start carries the config; a work item its prompt


class _Msg(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Every message on the link: tagged (its class name), encoded as an array."""


class Start(_Msg):
    """First -> other: who you are, what to serve, which workers there are."""

    index: int  # this process's number, 1..N-1 (0 is the first)
    config_json: str  # the cluster config (pydantic JSON): front ends, keys, TLS, tracing
    router_config: bytes  # router.config.RouterConfig as msgpack (the workers' resolved values)
    model_dir: str  # the tokenizer's and chat template's
    workers: list[tuple[str, str]]  # (name, role) of every live worker
    channel_host: str  # where the workers reach this process's event channel
    channel_tls: bool
    grpc_port: int  # the ports the first process bound with SO_REUSEPORT
    http_port: int  # 0 = no HTTP


class Listening(_Msg):
    call: int
    host: str
    port: int
    token: str
    cert_pem: bytes | None


class Ready(_Msg):
    address: str  # the gRPC address it serves


class Submit(_Msg):
    call: int
    worker: str
    item: bytes  # a workers.protocol.wire.WorkItem, encoded


class Abort(_Msg):
    worker: str
    request_id: str


class Decline(_Msg):
    worker: str
    handles: list[bytes]


class AbortById(_Msg):
    call: int
    request_id: str
    principal: str


class WorkerJoined(_Msg):
    call: int
    name: str
    role: str


class WorkerLeft(_Msg):
    name: str


class Drain(_Msg):
    call: int
    grace_s: float


class Stop(_Msg):
    pass


class Reply(_Msg):
    call: int
    error: str = ""
    found: bool = False  # AbortById
    num_aborted: int = 0  # Drain


Message = (
    Start | Listening | Ready | Submit | Abort | Decline | AbortById | WorkerJoined
    | WorkerLeft | Drain | Stop | Reply
)  # fmt: skip
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
Handler = Callable[["ProcessLink", Message], Awaitable[None]]


class ProcessLink:
    """One end of the link: writes are in order; each incoming message but a Reply runs
    as a task of its own (an abort must not wait behind a slow submit)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._calls = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.closed = asyncio.get_running_loop().create_future()  # result: why

    @classmethod
    async def open(cls, sock) -> ProcessLink:
        reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_MESSAGE_BYTES)
        return cls(reader, writer)

    def next_call(self) -> int:
        return next(self._calls)

    def send(self, message: Message) -> None:
        payload = _encoder.encode(message)
        if self.closed.done():
            raise ConnectionError(f"router process link closed: {self.closed.result()}")
        self._writer.write(_HEADER.pack(len(payload)) + payload)

    async def call(self, message: Message, timeout_s: float | None = None) -> Reply:
        """Send ``message`` (with ``call`` = ``next_call()``) and wait for its Reply."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[message.call] = future  # type: ignore[union-attr]
        try:
            self.send(message)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._waiting.pop(message.call, None)  # type: ignore[union-attr]

    async def serve(self, handler: Handler) -> None:
        """Read until the other end closes; then every waiting call fails."""
        why = "closed by the other process"
        try:
            while True:
                header = await self._reader.readexactly(_HEADER.size)
                (size,) = _HEADER.unpack(header)
                if size > MAX_MESSAGE_BYTES:
                    why = f"a {size}-byte message"
                    break
                message = _decoder.decode(await self._reader.readexactly(size))
                if isinstance(message, Reply):
                    future = self._waiting.get(message.call)
                    if future is not None and not future.done():
                        future.set_result(message)
                    continue
                task = asyncio.get_running_loop().create_task(self._handle(handler, message))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except msgspec.DecodeError as exc:
            why = f"a bad message: {exc}"
        finally:
            self.close(why)

    async def _handle(self, handler: Handler, message: Message) -> None:
        try:
            await handler(self, message)
        except Exception:
            logger.exception("router process link: handling %s failed", type(message).__name__)

    def close(self, why: str = "closed") -> None:
        if not self.closed.done():
            self.closed.set_result(why)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ConnectionError(f"router process link closed: {why}"))
        with contextlib.suppress(Exception):
            self._writer.close()
