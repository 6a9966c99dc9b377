"""TLS material of the data plane: standard PEM certificates, the same tooling as Flower's own TLS.

Certificate names are **party names** (design, privacy principle 7): the host serves with a
certificate and key (``dataplane-certfile`` / ``dataplane-keyfile`` in its node config) whose
subjectAltName includes ``DNS:host`` — a guest checks that name, not the address it dials
(``grpc.ssl_target_name_override``), so only a holder of a certificate the CA issued *to the host*
can serve its data plane; each guest trusts the CA that signed it (``dataplane-ca``). The host also
requires client certificates by default (mutual TLS; ``dataplane-client-ca``, or else its
``dataplane-ca``) and checks that a guest's certificate names the party its HELLO claims
(``guest-2``: CN or subjectAltName); each guest presents ``dataplane-certfile`` / ``dataplane-keyfile``.
The per-party key handshake of :mod:`fl_split.dataplane.frames` runs on top of TLS.

Generating a CA, the host's and a guest's certificates with the ``openssl`` CLI (``fl-split certs``
does the same with the ``cryptography`` package)::

    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \\
        -keyout ca.key -out ca.crt -subj "/CN=fl-split data-plane CA"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout host.key -out host.csr \\
        -subj "/CN=host"
    openssl x509 -req -in host.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -out host.crt \\
        -extfile <(printf "subjectAltName=DNS:host")
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout guest-1.key -out guest-1.csr \\
        -subj "/CN=guest-1"
    openssl x509 -req -in guest-1.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -out guest-1.crt \\
        -extfile <(printf "subjectAltName=DNS:guest-1\\nextendedKeyUsage=clientAuth")
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fl_split.dataplane.errors import DataPlaneError

#: the name the host's data-plane certificate must carry (a party name, like a guest's ``guest-<g>``)
HOST_NAME = "host"


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

    @staticmethod
    def channel_options() -> list[tuple[str, str]]:
        """The name a guest requires of the server's certificate: the party ``host`` (whatever
        address it dials)."""
        return [("grpc.ssl_target_name_override", HOST_NAME)]
