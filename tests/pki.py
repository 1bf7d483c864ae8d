"""A test CA and the certificates it signs (TLS and mutual TLS tests): an EC P-256 CA,
a server certificate for 127.0.0.1 and localhost, and a client certificate, as PEM files
in a directory: ``ca.pem``, ``server.pem``/``server.key``, ``client.pem``/``client.key``."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

_LOOPBACK = ipaddress.ip_address("127.0.0.1")


def _cert(name: str, issuer_key=None, issuer_name=None, is_ca=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(_LOOPBACK)]),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def make_pki(root: Path) -> Path:
    """Write the CA and its server and client certificates into ``root``; returns it."""
    ca_key, ca = _cert("test CA", is_ca=True)
    files = {}
    for name in ("server", "client"):
        key, cert = _cert(name, ca_key, ca.subject)
        files[f"{name}.key"] = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        files[f"{name}.pem"] = cert.public_bytes(serialization.Encoding.PEM)
    files["ca.pem"] = ca.public_bytes(serialization.Encoding.PEM)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root
