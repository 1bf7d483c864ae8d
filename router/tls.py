"""TLS for the front ends: one certificate and key for gRPC and HTTP, client certificates
optional (docs/security.md).

Files are read once at start-up; a missing or unreadable one is refused then, naming it,
rather than at the first handshake.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the HTTP front end uses this module too, and loads no gRPC
    import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str  # PEM: the server's certificate (chain)
    key_file: str  # PEM: its private key
    client_ca_file: str | None = None  # PEM: CAs whose client certificates are required

    def _read(self, path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The gRPC server's credentials: TLS, and mutual TLS with ``client_ca_file``."""
        import grpc

        cert = self._read(self.cert_file, "router.tls_cert_file")
        key = self._read(self.key_file, "router.tls_key_file")
        ca = (
            self._read(self.client_ca_file, "router.tls_client_ca_file")
            if self.client_ca_file
            else None
        )
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def uvicorn_options(self) -> dict:
        """uvicorn.Config's TLS options (it builds the SSL context at ``Config.load``)."""
        for path, what in (
            (self.cert_file, "router.tls_cert_file"),
            (self.key_file, "router.tls_key_file"),
        ):
            self._read(path, what)
        options = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.client_ca_file:
            self._read(self.client_ca_file, "router.tls_client_ca_file")
            options |= {"ssl_ca_certs": self.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return options
