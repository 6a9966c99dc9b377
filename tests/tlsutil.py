"""Certificates for the data-plane TLS tests, made here with the ``cryptography`` package (a
dependency of Flower): a CA, a host certificate for ``localhost`` / ``127.0.0.1`` signed by it, a
guest client certificate, and an unrelated CA (a guest that trusts it must refuse the host)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _ca(cn: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, cn: str, server: bool):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        usage = ExtendedKeyUsageOID.SERVER_AUTH
    else:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_certificates(directory: Path) -> dict[str, Path]:
    """Write ``ca.crt``, ``host.crt`` / ``host.key`` (for 127.0.0.1 and localhost),
    ``guest.crt`` / ``guest.key`` (a client certificate) and ``other-ca.crt``; returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = _ca("fl-split test data-plane CA")
    host_key, host = _leaf(ca_key, ca, "localhost", server=True)
    guest_key, guest = _leaf(ca_key, ca, "guest-1", server=False)
    _, other = _ca("some other CA")
    files = {"ca": (directory / "ca.crt", _pem_cert(ca)), "host_cert": (directory / "host.crt", _pem_cert(host)),
             "host_key": (directory / "host.key", _pem_key(host_key)),
             "guest_cert": (directory / "guest.crt", _pem_cert(guest)),
             "guest_key": (directory / "guest.key", _pem_key(guest_key)),
             "other_ca": (directory / "other-ca.crt", _pem_cert(other))}
    for path, data in files.values():
        path.write_bytes(data)
    return {k: p for k, (p, _) in files.items()}
