"""Certificates for the data-plane TLS tests, made by :mod:`fl_split.certs` (the code behind
``fl-split certs``): a CA, a host certificate named ``host`` signed by it, client certificates named
``guest-1``, ``guest-2`` and ``guest-3``, a server certificate of the same CA that does not name ``host``, and an
unrelated CA (a guest that trusts it must refuse the host)."""

from __future__ import annotations

from pathlib import Path

from fl_split.certs import make_ca, make_leaf, pem_cert, pem_key


def make_certificates(directory: Path) -> dict[str, Path]:
    """Write ``ca.crt``, ``host.crt`` / ``host.key`` (named ``host``), ``guest.crt`` / ``guest.key``
    (``guest-1``), ``guest-2.crt`` / ``guest-2.key``, ``guest-3.crt`` / ``guest-3.key``, ``nothost.crt`` / ``nothost.key`` and
    ``other-ca.crt``; returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = make_ca("fl-split test data-plane CA", days=2)
    # data-plane certificates name parties: the host's ``host`` (what guests require), a guest's its party
    host_key, host = make_leaf(ca_key, ca, "host", server=True, hosts=("host", "localhost", "127.0.0.1"), days=2)
    guest_key, guest = make_leaf(ca_key, ca, "guest-1", server=False, days=2)
    guest2_key, guest2 = make_leaf(ca_key, ca, "guest-2", server=False, days=2)
    guest3_key, guest3 = make_leaf(ca_key, ca, "guest-3", server=False, days=2)
    # a server certificate the CA issued for the machine's names but not to the party ``host``
    nothost_key, nothost = make_leaf(ca_key, ca, "localhost", server=True, days=2)
    _, other = make_ca("some other CA", days=2)
    files = {"ca": (directory / "ca.crt", pem_cert(ca)), "host_cert": (directory / "host.crt", pem_cert(host)),
             "host_key": (directory / "host.key", pem_key(host_key)),
             "guest_cert": (directory / "guest.crt", pem_cert(guest)),
             "guest_key": (directory / "guest.key", pem_key(guest_key)),
             "guest2_cert": (directory / "guest-2.crt", pem_cert(guest2)),
             "guest2_key": (directory / "guest-2.key", pem_key(guest2_key)),
             "guest3_cert": (directory / "guest-3.crt", pem_cert(guest3)),
             "guest3_key": (directory / "guest-3.key", pem_key(guest3_key)),
             "nothost_cert": (directory / "nothost.crt", pem_cert(nothost)),
             "nothost_key": (directory / "nothost.key", pem_key(nothost_key)),
             "other_ca": (directory / "other-ca.crt", pem_cert(other))}
    for path, data in files.values():
        path.write_bytes(data)
    return {k: p for k, (p, _) in files.items()}
