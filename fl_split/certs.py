"""Certificates and keys for a deployment (``fl-split certs``), made with the ``cryptography``
package (a dependency of Flower).

One private CA signs

* ``superlink.crt`` / ``superlink.key``: the SuperLink's TLS certificate (SuperNodes and ``flwr``
  verify it with ``ca.crt``);
* ``dataplane-host.crt`` / ``dataplane-host.key``: the host party's data-plane server certificate,
  named ``host`` (guests verify it with ``ca.crt``, node-config ``dataplane-ca``, and require that
  name);
* a client certificate per guest, ``<name>.crt`` / ``<name>.key``, named after the party
  (``--clients guest-1 guest-2``; the host requires them: mutual TLS, name = party).

SuperNode authentication (flwr 1.41): one ECDSA P-384 key pair per SuperNode, the private key in
OpenSSH format (``flower-supernode --auth-supernode-private-key``), the public key in OpenSSH format
(``flwr supernode register KEY.pub``); ``auth-<party>.key`` / ``auth-<party>.pub``.

The SuperLink's certificate names the given ``hosts`` (DNS names and IP addresses) and the loopback
names (:func:`superlink_hosts`: the SuperExec that Flower launches beside the SuperLink dials
127.0.0.1) as subject alternative names; the data-plane certificates name parties (``host``, ``guest-<g>``), which the
parties check whatever address they dial (``fl_split.dataplane.tls``). In a real deployment each organisation makes its own keys and only public halves travel:
see ``docs/deploy.md``. Private keys are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path
from typing import Iterable

__all__ = ["DEFAULT_HOSTS", "LOOPBACK_HOSTS", "make_ca", "superlink_hosts", "make_leaf", "make_node_auth_key", "write_deployment_certificates",
           "pem_cert", "pem_key"]

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
#: names every SuperLink certificate holds besides its public address: Flower's own SuperExec, which
#: the SuperLink launches on its machine, dials the bind address with 0.0.0.0 mapped to 127.0.0.1
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def superlink_hosts(*public: str) -> tuple[str, ...]:
    """The SANs of a SuperLink certificate: its public IP addresses or DNS names, then
    :data:`LOOPBACK_HOSTS` (the SuperLink's own SuperExec dials 127.0.0.1), each once."""
    return tuple(dict.fromkeys([h for h in public if h] + list(LOOPBACK_HOSTS)))


def _key(curve: str = "p256"):
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP384R1() if curve == "p384" else ec.SECP256R1())


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(cn: str, days: int = 365):
    """``(key, certificate)`` of a self-signed CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _san(hosts: Iterable[str]):
    from cryptography import x509

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_leaf(ca_key, ca_cert, cn: str, server: bool, hosts: Iterable[str] = DEFAULT_HOSTS, days: int = 365):
    """``(key, certificate)`` signed by the CA: a server certificate for ``hosts`` (SANs), or a
    client certificate (``server=False``) naming ``cn`` (CN and SAN: a party name)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(_san(hosts), critical=False)
        usage = ExtendedKeyUsageOID.SERVER_AUTH
    else:
        builder = builder.add_extension(_san([cn]), critical=False)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_node_auth_key(comment: str = "") -> tuple[bytes, bytes]:
    """``(private key, public key)`` of a SuperNode: ECDSA P-384 in OpenSSH format (what
    ``ssh-keygen -t ecdsa -b 384`` makes; flwr 1.41 accepts NIST curves only)."""
    from cryptography.hazmat.primitives import serialization

    key = _key("p384")
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public + (f" {comment}".encode() if comment else b"") + b"\n"


def _write(path: Path, data: bytes, secret: bool) -> Path:
    if secret:  # created 0600 before the key is written into it (fl_split.secure_files)
        from fl_split.secure_files import write_private

        return write_private(path, data)
    path.write_bytes(data)
    return path


def write_deployment_certificates(out: str | os.PathLike, hosts: Iterable[str] = DEFAULT_HOSTS,
                                  node_keys: Iterable[str] = (), clients: Iterable[str] = (),
                                  days: int = 365) -> dict[str, Path]:
    """Write a CA, the SuperLink and data-plane host certificates for ``hosts``, a SuperNode
    authentication key pair per name in ``node_keys`` and a client certificate per name in
    ``clients`` into ``out``; returns ``{name: path}``."""
    from fl_split.secure_files import private_dir

    out = private_dir(out)  # 0700: it holds the CA's and every party's private keys
    hosts = tuple(hosts) or DEFAULT_HOSTS
    ca_key, ca = make_ca("fl-split deployment CA", days)
    files = {"ca": _write(out / "ca.crt", pem_cert(ca), False), "ca_key": _write(out / "ca.key", pem_key(ca_key), True)}
    from fl_split.dataplane.tls import HOST_NAME

    # the data plane's server certificate names the party (guests require ``host``), the SuperLink's its hosts
    for name, cn, names in (("superlink", hosts[0], superlink_hosts(*hosts)), ("dataplane-host", HOST_NAME, (HOST_NAME,) + hosts)):
        key, cert = make_leaf(ca_key, ca, cn, server=True, hosts=names, days=days)
        files[f"{name}_cert"] = _write(out / f"{name}.crt", pem_cert(cert), False)
        files[f"{name}_key"] = _write(out / f"{name}.key", pem_key(key), True)
    for name in clients:
        key, cert = make_leaf(ca_key, ca, name, server=False, days=days)
        files[f"{name}_cert"] = _write(out / f"{name}.crt", pem_cert(cert), False)
        files[f"{name}_key"] = _write(out / f"{name}.key", pem_key(key), True)
    for name in node_keys:
        private, public = make_node_auth_key(f"fl-split-{name}")
        files[f"auth-{name}_key"] = _write(out / f"auth-{name}.key", private, True)
        files[f"auth-{name}_pub"] = _write(out / f"auth-{name}.pub", public, False)
    return files
