"""TLS for the event channel when it leaves the host (docs/security.md).

The router makes a fresh key and a self-signed certificate for its listener each time it
starts, and hands the certificate (not the key) to each worker in the Ray call that tells
the worker where to connect. The worker trusts that one certificate and nothing else: no
CA to run, no files to mount, and a certificate that dies with the router. Ray's own
control calls carry it, so an attacker on the network who can read the channel's TCP
traffic but not join the Ray cluster (token authentication) can neither read the tokens
in the batches nor pose as the router; the worker still proves itself with the listener's
secret token in its hello, now inside TLS.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The router's lifetime, with room: a cluster that serves for years restarts its router
# (and so gets a new certificate) far more often than this.
_VALID_FOR = datetime.timedelta(days=3650)
_CLOCK_SKEW = datetime.timedelta(hours=1)  # a worker's clock a little behind still accepts


@dataclass(frozen=True)
class ChannelIdentity:
    """The listener's certificate and key, PEM."""

    host: str  # the address the workers dial, named in the certificate
    cert_pem: bytes
    key_pem: bytes

    def server_context(self) -> ssl.SSLContext:
        """The listener's TLS context (TLS 1.3 only: both ends are ours)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        # load_cert_chain reads only files: the key goes through an anonymous in-memory
        # file (never on a disk), or a private 0600 temp file where there is no memfd.
        pem = self.key_pem + self.cert_pem
        if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            fd = os.memfd_create("baton-channel", os.MFD_CLOEXEC)
            try:
                os.write(fd, pem)
                context.load_cert_chain(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            return context
        fd, path = tempfile.mkstemp(prefix="baton-channel-", suffix=".pem")
        try:
            os.write(fd, pem)
            os.close(fd)
            context.load_cert_chain(path)
        finally:
            os.unlink(path)
        return context


def make_identity(host: str) -> ChannelIdentity:
    """A fresh P-256 key and a self-signed certificate naming ``host`` (an IP or a name)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "baton event channel")])
    try:
        subject_alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        subject_alt = x509.DNSName(host)
    now = datetime.datetime.now(datetime.timezone.utc)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.SubjectAlternativeName([subject_alt]), critical=False)
        # Its own trust anchor: OpenSSL's strict checks want a self-signed anchor to say so.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return ChannelIdentity(
        host=host,
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def client_context(cert_pem: bytes) -> ssl.SSLContext:
    """A worker's TLS context: it trusts the router's one certificate, and checks the name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = True
    context.load_verify_locations(cadata=cert_pem.decode("ascii"))
    return context
