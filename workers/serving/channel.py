"""The event channel: a worker pushes its output batches to the router over one socket.

Why not a Ray call per batch: a Ray actor call (the router's long poll) cost about 2 ms per
streamed chunk on the development VM, more than the whole latency budget of a token.
Here the worker's engine loop writes each step's :class:`~workers.protocol.wire.OutputBatch`
straight into a TCP connection it opened to the router, and the router's event loop reads
it: no thread hand-off on either side. Ray still carries the control calls (submit,
abort, decline), which are one per request, not one per token.

Frames are a 4-byte big-endian length and a msgpack message (``workers/protocol/wire.py``), never
pickle. The worker's first frame is a hello with its name and the listener's secret token;
the router drops a connection whose hello is wrong. A closed connection, or no frame for
``silence_s`` (workers send a report at least every ``HEARTBEAT_S``), means the worker is
gone. When the channel leaves the host it runs over TLS 1.3 with a certificate the router
makes for itself and the workers pin (``workers/serving/channel_tls.py``).

With ``router.processes: N`` a worker opens one channel to each router process (each has
its own listener, token and certificate): a request's events go to the process that
submitted it, every report to all (``workers/serving/sinks.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import struct
import time
from collections.abc import Callable

import msgpack

from workers.protocol.wire import WIRE_VERSION, OutputBatch, decode_as, encode
from workers.serving.channel_tls import ChannelIdentity, client_context, make_identity

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # a worker with nothing to say still sends its report this often
SILENCE_S = 15.0  # no frame for this long: the worker is hung (a crash closes the socket)
MAX_FRAME_BYTES = 64 << 20
_HEADER = struct.Struct("!I")
_HELLO_TIMEOUT_S = 10.0
_MAX_HELLO_BYTES = 4096
_WATCHDOG_EVERY_S = 1.0
_SEND_TIMEOUT_S = 10.0  # a router that reads nothing for this long is treated as gone


def _frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


class ChannelSender:
    """The worker's end: a blocking socket, written from the engine loop thread only."""

    def __init__(self, host: str, port: int, name: str, token: str, cert_pem: bytes | None = None):
        """``cert_pem``: the listener's certificate when the channel is TLS (the only one
        this worker trusts for it); None for a plain channel on the host."""
        sock = socket.create_connection((host, port), timeout=_SEND_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if cert_pem is not None:
            try:
                sock = client_context(cert_pem).wrap_socket(sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
        self._sock = sock
        hello = msgpack.packb(["hello", WIRE_VERSION, name, token], use_bin_type=True)
        self._sock.sendall(_frame(hello))

    def send(self, batch: OutputBatch) -> None:
        # One buffer, one syscall: with TCP_NODELAY a separate header would be its own packet.
        self._sock.sendall(_frame(encode(batch)))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


BatchHandler = Callable[[OutputBatch], None]
LostHandler = Callable[[str], None]


class ChannelReader(asyncio.Protocol):
    """The router's end of one worker's connection.

    A protocol rather than a stream reader: the frames are decoded in ``data_received``
    and handed to ``on_batch`` right there, so a token reaches the request's coroutine
    with one wake-up of the event loop, not three (stream reader, listening task, request).
    """

    def __init__(self, listener: ChannelListener):
        self.name = ""
        self._listener = listener
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._early: list[OutputBatch] = []  # frames before ``listen``
        self._on_batch: BatchHandler | None = None
        self._on_lost: LostHandler | None = None
        self._why_lost = ""
        self._last_frame = 0.0
        self._silence_s = SILENCE_S
        self._watchdog: asyncio.TimerHandle | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    def listen(
        self, on_batch: BatchHandler, on_lost: LostHandler, silence_s: float = SILENCE_S
    ) -> None:
        """Call ``on_batch`` with every batch (earlier ones first), and ``on_lost`` once with
        the reason when the worker closes the connection, sends garbage or goes silent."""
        self._on_batch, self._on_lost, self._silence_s = on_batch, on_lost, silence_s
        early, self._early = self._early, []
        for batch in early:
            on_batch(batch)
        if self._why_lost:
            on_lost(self._why_lost)
            return
        self._last_frame = time.monotonic()
        self._arm_watchdog()

    def close(self) -> None:
        self._why_lost = self._why_lost or "closed by the router"
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._transport is not None:
            self._transport.close()

    # ---- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._hello_timer = asyncio.get_running_loop().call_later(
            _HELLO_TIMEOUT_S, self._refuse, "no hello in time"
        )

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        # The frames are read at an offset and the buffer trimmed once: trimming per frame
        # moved the rest of the buffer each time (quadratic in frames per read, which
        # showed under load: 20% of the event loop with two router processes).
        offset, num_bytes, header = 0, len(buffer), _HEADER.size
        try:
            while num_bytes - offset >= header:
                (size,) = _HEADER.unpack_from(buffer, offset)
                limit = MAX_FRAME_BYTES if self.name else _MAX_HELLO_BYTES
                if size > limit:
                    self._lose(f"worker {self.name or '?'} sent a {size}-byte frame")
                    return
                end = offset + header + size
                if num_bytes < end:
                    return
                payload = bytes(buffer[offset + header : end])
                offset = end
                if not self.name:
                    if not self._hello(payload):
                        return
                    continue
                try:
                    batch = decode_as(payload, OutputBatch)
                except ValueError as exc:
                    self._lose(f"worker {self.name} sent a bad frame: {exc}")
                    return
                self._last_frame = time.monotonic()
                if self._on_batch is None:
                    self._early.append(batch)
                else:
                    self._on_batch(batch)
        finally:
            del buffer[:offset]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self.name:
            self._lose(f"worker {self.name} closed its event channel")

    # ---- internals ---------------------------------------------------------------------
    def _hello(self, payload: bytes) -> bool:
        try:
            name = self._listener.admit(msgpack.unpackb(payload, raw=False), self)
        except Exception as exc:  # whoever it is, it does not get in
            self._refuse(str(exc))
            return False
        self.name = name
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        return True

    def _refuse(self, why: str) -> None:
        if self.name or self._transport is None:
            return
        peer = self._transport.get_extra_info("peername")
        logger.warning("refused an event-channel connection from %s: %s", peer, why)
        self._transport.abort()

    def _lose(self, why: str) -> None:
        if self._why_lost:
            return
        self._why_lost = why
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._transport is not None:
            self._transport.abort()
        if self._on_lost is not None:
            self._on_lost(why)

    def _arm_watchdog(self) -> None:
        self._watchdog = asyncio.get_running_loop().call_later(
            _WATCHDOG_EVERY_S, self._check_silence
        )

    def _check_silence(self) -> None:
        if self._why_lost:
            return
        if time.monotonic() - self._last_frame > self._silence_s:
            self._lose(f"worker {self.name} sent nothing for {self._silence_s:g} s")
        else:
            self._arm_watchdog()


class ChannelListener:
    """The router's listening socket: workers connect and say who they are."""

    def __init__(self, host: str = "127.0.0.1", tls: bool = False):
        """``tls``: serve TLS with a certificate made now for ``host`` (its ``cert_pem``
        goes to the workers, who trust only it)."""
        self.host = host
        self.port = 0
        self.token = secrets.token_hex(16)
        self._identity: ChannelIdentity | None = make_identity(host) if tls else None
        self._server: asyncio.AbstractServer | None = None
        self._waiting: dict[str, asyncio.Future[ChannelReader]] = {}

    @property
    def cert_pem(self) -> bytes | None:
        """The certificate a worker must pin to connect, or None for a plain channel."""
        return None if self._identity is None else self._identity.cert_pem

    async def start(self) -> None:
        if self._server is None:
            loop = asyncio.get_running_loop()
            tls = None if self._identity is None else self._identity.server_context()
            self._server = await loop.create_server(
                lambda: ChannelReader(self),
                self.host,
                0,
                ssl=tls,
                ssl_handshake_timeout=_HELLO_TIMEOUT_S if tls else None,
            )
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

    def admit(self, hello: object, reader: ChannelReader) -> str:
        """Check a hello frame; returns the worker's name or raises with why not."""
        if not (isinstance(hello, list) and len(hello) == 4 and hello[0] == "hello"):
            raise ValueError("not a hello")
        _, version, name, token = hello
        if version != WIRE_VERSION:
            raise ValueError(f"wire version {version}, expected {WIRE_VERSION}")
        if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
            raise ValueError("wrong token")
        future = self._waiting.pop(name, None) if isinstance(name, str) else None
        if future is None or future.done():
            raise ValueError(f"no worker named {name!r} is expected")
        future.set_result(reader)
        return name
