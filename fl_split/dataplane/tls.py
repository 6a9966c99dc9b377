"""TLS material of the data plane: standard PEM certificates, the same tooling as Flower's own TLS.

The host serves with a certificate and key (``dataplane-certfile`` / ``dataplane-keyfile`` in its
node config; the certificate must name the host as the guests reach it — a DNS name or IP address
in its subjectAltName); each guest trusts the CA that signed it (``dataplane-ca``). Optionally the
host also requires client certificates (``dataplane-client-ca``; each guest then presents
``dataplane-certfile`` / ``dataplane-keyfile``). The per-run credential is checked on top of TLS
(:mod:`fl_split.dataplane.frames`).

Generating a CA and a host certificate with the ``openssl`` CLI (``tests/test_dataplane.py`` does the
same with the ``cryptography`` package)::

    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \\
        -keyout ca.key -out ca.crt -subj "/CN=fl-split data-plane CA"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout host.key -out host.csr \\
        -subj "/CN=host.example.org"
    openssl x509 -req -in host.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -out host.crt \\
        -extfile <(printf "subjectAltName=DNS:host.example.org")
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fl_split.dataplane.errors import DataPlaneError


def _read(path: str, what: str) -> bytes:
    full = os.path.abspath(os.path.expanduser(path))
    try:
        with open(full, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise DataPlaneError(f"{what}: cannot read {full!r} ({exc.strerror or exc})") from None
    if b"-----BEGIN" not in data:
        raise DataPlaneError(f"{what}: {full!r} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """The host's certificate chain and key, and optionally the CA its guests' certificates need."""

    certificate: bytes
    key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, certfile: str, keyfile: str, client_ca: str = "") -> "ServerTLS":
        return cls(_read(certfile, "dataplane-certfile"), _read(keyfile, "dataplane-keyfile"),
                   _read(client_ca, "dataplane-client-ca") if client_ca else None)

    def credentials(self):
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.certificate)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    """What a guest trusts (the CA of the host's certificate) and, optionally, its own certificate."""

    root_ca: bytes
    certificate: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_files(cls, ca: str, certfile: str = "", keyfile: str = "") -> "ClientTLS":
        if bool(certfile) != bool(keyfile):
            raise DataPlaneError("dataplane-certfile and dataplane-keyfile go together (a guest's client "
                                 "certificate and its key)")
        return cls(_read(ca, "dataplane-ca"), _read(certfile, "dataplane-certfile") if certfile else None,
                   _read(keyfile, "dataplane-keyfile") if keyfile else None)

    def credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.root_ca, private_key=self.key,
                                            certificate_chain=self.certificate)
