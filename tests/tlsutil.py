"""Certificates for the data-plane TLS tests, made by :mod:`fl_split.certs` (the code behind
``fl-split certs``): a CA, a host certificate for ``localhost`` / ``127.0.0.1`` signed by it, a
guest client certificate, and an unrelated CA (a guest that trusts it must refuse the host)."""

from __future__ import annotations

from pathlib import Path

from fl_split.certs import make_ca, make_leaf, pem_cert, pem_key


def make_certificates(directory: Path) -> dict[str, Path]:
    """Write ``ca.crt``, ``host.crt`` / ``host.key`` (for 127.0.0.1 and localhost),
    ``guest.crt`` / ``guest.key`` (a client certificate) and ``other-ca.crt``; returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = make_ca("fl-split test data-plane CA", days=2)
    host_key, host = make_leaf(ca_key, ca, "localhost", server=True, days=2)
    guest_key, guest = make_leaf(ca_key, ca, "guest-1", server=False, days=2)
    _, other = make_ca("some other CA", days=2)
    files = {"ca": (directory / "ca.crt", pem_cert(ca)), "host_cert": (directory / "host.crt", pem_cert(host)),
             "host_key": (directory / "host.key", pem_key(host_key)),
             "guest_cert": (directory / "guest.crt", pem_cert(guest)),
             "guest_key": (directory / "guest.key", pem_key(guest_key)),
             "other_ca": (directory / "other-ca.crt", pem_cert(other))}
    for path, data in files.values():
        path.write_bytes(data)
    return {k: p for k, (p, _) in files.items()}
