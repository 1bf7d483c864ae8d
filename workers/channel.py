"""The event channel: a worker pushes its output batches to the router over one socket.

Why not a Ray call per batch: a Ray actor call (the router's long poll) cost about 2 ms per
streamed chunk on the development VM, more than the whole latency budget of a token.
Here the worker's engine loop writes each step's :class:`~workers.wire.OutputBatch`
straight into a TCP connection it opened to the router, and the router's event loop reads
it: no thread hand-off on either side. Ray still carries the control calls (submit,
abort, decline), which are one per request, not one per token.

Frames are a 4-byte big-endian length and a msgpack message (``workers/wire.py``), never
pickle. The worker's first frame is a hello with its name and the listener's secret token;
the router drops a connection whose hello is wrong. A closed connection, or no frame for
``silence_s`` (workers send a report at least every ``HEARTBEAT_S``), means the worker is
gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import struct

import msgpack

from workers.wire import WIRE_VERSION, OutputBatch, decode_as, encode

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # a worker with nothing to say still sends its report this often
SILENCE_S = 15.0  # no frame for this long: the worker is hung (a crash closes the socket)
MAX_FRAME_BYTES = 64 << 20
_HEADER = struct.Struct("!I")
_HELLO_TIMEOUT_S = 10.0
_SEND_TIMEOUT_S = 10.0  # a router that reads nothing for this long is treated as gone


def _frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


class ChannelSender:
    """The worker's end: a blocking socket, written from the engine loop thread only."""

    def __init__(self, host: str, port: int, name: str, token: str):
        self._sock = socket.create_connection((host, port), timeout=_SEND_TIMEOUT_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = msgpack.packb(["hello", WIRE_VERSION, name, token], use_bin_type=True)
        self._sock.sendall(_frame(hello))

    def send(self, batch: OutputBatch) -> None:
        # One buffer, one syscall: with TCP_NODELAY a separate header would be its own packet.
        self._sock.sendall(_frame(encode(batch)))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class ChannelReader:
    """The router's end of one worker's connection."""

    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.name = name
        self._reader = reader
        self._writer = writer

    async def next_batch(self, silence_s: float = SILENCE_S) -> OutputBatch:
        """The next batch; ConnectionError when the worker closed or went silent."""
        try:
            data = await asyncio.wait_for(self._read_frame(), silence_s)
        except asyncio.IncompleteReadError:
            raise ConnectionError(f"worker {self.name} closed its event channel") from None
        except asyncio.TimeoutError:
            raise ConnectionError(f"worker {self.name} sent nothing for {silence_s:g} s") from None
        return decode_as(data, OutputBatch)

    async def _read_frame(self) -> bytes:
        (size,) = _HEADER.unpack(await self._reader.readexactly(_HEADER.size))
        if size > MAX_FRAME_BYTES:
            raise ConnectionError(f"worker {self.name} sent a {size}-byte frame")
        return await self._reader.readexactly(size)

    def close(self) -> None:
        self._writer.close()


class ChannelListener:
    """The router's listening socket: workers connect and say who they are."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port = 0
        self.token = secrets.token_hex(16)
        self._server: asyncio.AbstractServer | None = None
        self._waiting: dict[str, asyncio.Future[ChannelReader]] = {}

    async def start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._on_connect, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]

    def expect(self, name: str) -> asyncio.Future[ChannelReader]:
        """Let worker ``name`` connect once; the future resolves when it has said hello."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[name] = future
        return future

    async def accepted(
        self, name: str, future: asyncio.Future[ChannelReader], timeout_s: float = _HELLO_TIMEOUT_S
    ) -> ChannelReader:
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise ConnectionError(
                f"worker {name} did not connect to the router at {self.host}:{self.port} "
                f"within {timeout_s:g} s"
            ) from None
        finally:
            self._waiting.pop(name, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        peer = writer.get_extra_info("peername")
        try:
            hello = await asyncio.wait_for(_read_hello(reader), _HELLO_TIMEOUT_S)
            if not (isinstance(hello, list) and len(hello) == 4 and hello[0] == "hello"):
                raise ValueError("not a hello")
            _, version, name, token = hello
            if version != WIRE_VERSION:
                raise ValueError(f"wire version {version}, expected {WIRE_VERSION}")
            if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
                raise ValueError("wrong token")
            future = self._waiting.pop(name, None)
            if future is None or future.done():
                raise ValueError(f"no worker named {name!r} is expected")
        except Exception as exc:  # whoever it is, it does not get in
            logger.warning("refused an event-channel connection from %s: %s", peer, exc)
            writer.close()
            return
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        future.set_result(ChannelReader(name, reader, writer))


async def _read_hello(reader: asyncio.StreamReader):
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > 4096:
        raise ValueError(f"a {size}-byte hello")
    return msgpack.unpackb(await reader.readexactly(size), raw=False)
