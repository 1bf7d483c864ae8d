"""The event channel over TLS (issue 35): the listener's own certificate, pinned by workers.

What must hold: batches arrive intact over TLS 1.3; a worker that speaks plain TCP is
refused even with the right token (nothing reaches the hello check); a worker handed
another certificate, or a certificate naming another host, refuses to connect (so an
impostor listener learns no token); the key never touches a disk.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import threading

import msgpack
import pytest

from tests.workers.test_channel import _batch, _Collector
from workers.protocol.wire import WIRE_VERSION
from workers.serving.channel import ChannelListener, ChannelSender
from workers.serving.channel_tls import client_context, make_identity


def test_batches_arrive_over_tls_13():
    async def main():
        listener = ChannelListener("127.0.0.1", tls=True)
        await listener.start()
        future = listener.expect("w")
        sender = await asyncio.to_thread(
            ChannelSender, listener.host, listener.port, "w", listener.token, listener.cert_pem
        )
        reader = await listener.accepted("w", future)
        seen = _Collector()
        reader.listen(seen.batches.append, seen.lost.append)
        sent = [_batch(i) for i in range(3)]
        for batch in sent:
            sender.send(batch)
        await seen.wait(lambda: len(seen.batches) == 3)
        version = reader._transport.get_extra_info("ssl_object").version()
        sender.close()
        await seen.wait(lambda: seen.lost)
        await listener.close()
        return sent, seen, version, sender

    sent, seen, version, sender = asyncio.run(main())
    assert seen.batches == sent
    assert version == "TLSv1.3"
    assert isinstance(sender._sock, ssl.SSLSocket)


def test_a_plain_worker_with_the_right_token_is_refused():
    async def main():
        listener = ChannelListener("127.0.0.1", tls=True)
        await listener.start()
        future = listener.expect("w")
        sock = socket.create_connection((listener.host, listener.port), timeout=5)
        hello = msgpack.packb(["hello", WIRE_VERSION, "w", listener.token])
        sock.sendall(struct.pack("!I", len(hello)) + hello)
        try:
            data = await asyncio.to_thread(sock.recv, 64)
        except ConnectionResetError:
            data = b""
        sock.close()
        with pytest.raises(ConnectionError, match="did not connect"):
            await listener.accepted("w", future, timeout_s=0.3)
        await listener.close()
        return data

    # The listener answered with a TLS alert record (type 21) or closed: never a frame.
    data = asyncio.run(main())
    assert data == b"" or data[:1] == b"\x15", data


def _impostor(identity) -> tuple[socket.socket, threading.Thread, list[bytes]]:
    """A TLS listener on loopback with ``identity``: records what a client sends it."""
    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve():
        conn, _ = server.accept()
        try:
            tls = identity.server_context().wrap_socket(conn, server_side=True)
            received.append(tls.recv(4096))
            tls.close()
        except (ssl.SSLError, OSError):
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread, received


@pytest.mark.parametrize("case", ["another certificate", "another host's name"])
def test_a_worker_refuses_a_listener_it_was_not_told_about(case):
    genuine = make_identity("127.0.0.1")
    impostor = make_identity("127.0.0.1" if case == "another certificate" else "10.9.8.7")
    pinned = genuine.cert_pem if case == "another certificate" else impostor.cert_pem
    server, thread, received = _impostor(impostor)
    port = server.getsockname()[1]
    with pytest.raises(ssl.SSLCertVerificationError) as refused:
        ChannelSender("127.0.0.1", port, "w", "secret-token", pinned)
    thread.join(5)
    server.close()
    assert received == []  # the token never left the worker
    expected = "mismatch" if case == "another host's name" else "certificate verify failed"
    assert expected in str(refused.value), refused.value


def test_the_contexts_insist_on_tls_13_and_a_verified_peer():
    identity = make_identity("127.0.0.1")
    client = client_context(identity.cert_pem)
    assert client.minimum_version == ssl.TLSVersion.TLSv1_3
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert identity.server_context().minimum_version == ssl.TLSVersion.TLSv1_3
    assert b"PRIVATE KEY" in identity.key_pem and b"PRIVATE KEY" not in identity.cert_pem
