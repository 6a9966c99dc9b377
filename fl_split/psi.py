"""Private set intersection of the parties' ID lists (ECDH-PSI), for ``--align psi``.

Own data (:mod:`fl_split.data.own`) comes as one table per party, each with its own ID set. With
``--align public`` the host's ID list is the shared list, published to every party (the
assumption of the built-in datasets: the ID set is public). With ``--align psi`` no party learns
another's IDs outside the intersection: the parties run the ECDH-PSI protocol of
``openmined-psi`` (PyVertical's choice; SecretFlow's default is ECDH-PSI too) — every ID is hashed
to a curve point (P-256) and blinded with a party's secret scalar; blinding commutes, so
``H(x)^(ab)`` can be compared without either side seeing the other's ``H(x)^a`` unblinded.

**Who is who, who learns what** (G guests; ``I = H ∩ G1 ∩ … ∩ GG``):

1. for ``g = 1 … G`` in order the host is the PSI *client* with a fresh key per guest, guest-g
   the *server* with a fresh key: the host sends ``request`` (its current candidates ``C_{g-1}``
   blinded: ``C_0`` = its own IDs), guest-g answers ``setup`` (its own IDs blinded with its key,
   in random order) and ``response`` (the request re-blinded with its key). The host unblinds and
   keeps ``C_g = C_{g-1} ∩ G_g``;
2. the host sends ``shared-ids`` (``I = C_G``, sorted) to every guest, which checks ``I ⊆`` its
   own IDs and aligns its rows to it.

* guest-g learns ``|C_{g-1}|`` (the size of the request) and ``I``; no ID of another party outside
  ``I``.
* the host learns ``|G_g|`` (the size of the setup) and the chain ``C_1 ⊇ C_2 ⊇ … ⊇ I``: which of
  *its own* IDs guest-1 (guest-1 and guest-2, …) hold. It learns no ID it does not hold. This is
  the price of building a G+1-party intersection from two-party PSI; the last guest's membership
  is revealed only within ``I``. With one guest the host learns exactly ``I``.
* the coordinator (which routes the messages) sees blinded points and ``I``, which every party
  learns anyway: after alignment ``I`` is the run's *public* shared ID list, and the accounting's
  public-ID assumption (docs/accounting.md) covers ``I`` only.

**Over the run's channels.** Each message is one framed ``bytes`` blob (:func:`encode` /
:func:`decode`: ``b"P1" | kind | sender | receiver | payload``) with the sender and receiver
checked by the receiver, bounded in size, routed by :func:`align_by_psi` between
:class:`PsiParty` objects that each hold only their own party's IDs (the local engine and the
in-process Flower simulation prepare data in one process). A Flower *deployment* node does not run
this protocol yet: there, own data is aligned before deployment (``fl-split export-parties
--data … --align psi``) and each node gets its aligned party file (docs/datasets.md says so).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fl_split.errors import DataError, ProtocolError
from fl_split.protocol import _read_varint, _varint, party_index, party_name

MAGIC = b"P1"
KINDS = ("request", "setup", "response", "shared-ids")
#: at most this many bytes per PSI frame: ~ 10 million IDs of 33-byte compressed points
MAX_PSI_FRAME = 512 * 1024 * 1024


def _psi():
    try:
        import private_set_intersection.python as psi
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise DataError("--align psi needs the openmined-psi package (pip install openmined-psi)") from exc
    return psi


def encode(kind: str, sender: str, receiver: str, payload: bytes) -> bytes:
    """One PSI frame."""
    return MAGIC + bytes([KINDS.index(kind)]) + _varint(party_index(sender), "sender") \
        + _varint(party_index(receiver), "receiver") + payload


def decode(blob: object, *, kind: str, sender: str, receiver: str) -> bytes:
    """The payload of ``blob`` if it is a PSI frame of ``kind`` from ``sender`` to ``receiver``;
    :class:`ProtocolError` otherwise (before anything else is touched)."""
    if not isinstance(blob, (bytes, bytearray)):
        raise ProtocolError(f"a PSI message must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) > MAX_PSI_FRAME:
        raise ProtocolError(f"PSI message of {len(blob)} bytes exceeds {MAX_PSI_FRAME}")
    if len(blob) < 5 or blob[:2] != MAGIC:
        raise ProtocolError("not a PSI message (bad magic)")
    if blob[2] >= len(KINDS) or KINDS[blob[2]] != kind:
        raise ProtocolError(f"PSI message of kind {blob[2]}, expected {kind!r}")
    s, pos = _read_varint(blob, 3, "sender")
    r, pos = _read_varint(blob, pos, "receiver")
    if (s, r) != (party_index(sender), party_index(receiver)):
        raise ProtocolError(f"PSI {kind} from {party_name(s)} to {party_name(r)}, expected {sender} to {receiver}")
    return blob[pos:]


class PsiParty:
    """One party's side of the intersection: it holds only its own IDs and fresh ECDH keys."""

    def __init__(self, party: str, ids: np.ndarray) -> None:
        self.party = party
        self._own = np.unique(np.asarray(ids, np.int64))
        self._candidates = self._own  # host: C_g
        self._clients: dict[str, object] = {}

    @staticmethod
    def _items(ids: np.ndarray) -> list[str]:
        return [str(int(i)) for i in ids]

    # -- host (PSI client) ------------------------------------------------------------------
    def request(self, guest: str) -> bytes:
        """Host: its current candidates, blinded with a fresh key for ``guest``."""
        psi = _psi()
        client = psi.client.CreateWithNewKey(True)
        self._clients[guest] = client
        req = client.CreateRequest(self._items(self._candidates))
        return encode("request", self.party, guest, req.SerializeToString())

    def receive(self, guest: str, setup_blob: bytes, response_blob: bytes) -> int:
        """Host: keep the candidates ``guest`` holds too; returns how many remain."""
        psi = _psi()
        client = self._clients.pop(guest, None)
        if client is None:
            raise ProtocolError(f"{self.party}: a PSI answer from {guest} without a request")
        setup, response = psi.ServerSetup(), psi.Response()
        try:
            setup.ParseFromString(decode(setup_blob, kind="setup", sender=guest, receiver=self.party))
            response.ParseFromString(decode(response_blob, kind="response", sender=guest, receiver=self.party))
            idx = np.asarray(sorted(client.GetIntersection(setup, response)), np.int64)
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - a peer's malformed protobuf
            raise ProtocolError(f"{self.party}: a malformed PSI answer from {guest} ({type(exc).__name__})") from None
        if idx.size and (idx.min() < 0 or idx.max() >= len(self._candidates)):
            raise ProtocolError(f"{self.party}: PSI answer from {guest} out of range")
        self._candidates = self._candidates[idx]
        return len(self._candidates)

    def shared_ids(self, guest: str) -> bytes:
        """Host: the intersection ``I`` for ``guest`` (int64, sorted)."""
        return encode("shared-ids", self.party, guest, np.ascontiguousarray(self._candidates, "<i8").tobytes())

    @property
    def intersection(self) -> np.ndarray:
        return self._candidates.copy()

    # -- guest (PSI server) -----------------------------------------------------------------
    def answer(self, request_blob: bytes, host: str = "host") -> tuple[bytes, bytes]:
        """Guest: ``(setup, response)`` for the host's request, with a fresh key (dropped after)."""
        psi = _psi()
        req = psi.Request()
        try:
            req.ParseFromString(decode(request_blob, kind="request", sender=host, receiver=self.party))
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ProtocolError(f"{self.party}: a malformed PSI request ({type(exc).__name__})") from None
        server = psi.server.CreateWithNewKey(True)
        items = self._items(np.random.default_rng().permutation(self._own))  # no order to read
        setup = server.CreateSetupMessage(1e-9, max(len(req.encrypted_elements), 1), items, psi.DataStructure.RAW)
        try:
            response = server.ProcessRequest(req)
        except Exception as exc:  # noqa: BLE001
            raise ProtocolError(f"{self.party}: a malformed PSI request ({type(exc).__name__})") from None
        return (encode("setup", self.party, host, setup.SerializeToString()),
                encode("response", self.party, host, response.SerializeToString()))

    def receive_shared(self, blob: bytes, host: str = "host") -> np.ndarray:
        """Guest: the intersection from the host, refused unless sorted, unique and ⊆ its own IDs."""
        payload = decode(blob, kind="shared-ids", sender=host, receiver=self.party)
        if len(payload) % 8:
            raise ProtocolError(f"{self.party}: shared-ids payload of {len(payload)} bytes is not int64s")
        ids = np.frombuffer(payload, "<i8").astype(np.int64)
        if ids.size > 1 and not np.all(np.diff(ids) > 0):
            raise ProtocolError(f"{self.party}: the shared IDs from {host} are not sorted and unique")
        if not np.isin(ids, self._own).all():
            raise ProtocolError(f"{self.party}: {host} sent {int((~np.isin(ids, self._own)).sum())} shared ID(s) "
                                f"this party does not hold; not an intersection")
        return ids


def align_by_psi(ids: dict[str, np.ndarray],
                 transcript: Callable[[str, str, str, bytes], None] | None = None) -> np.ndarray:
    """Route the PSI messages between one :class:`PsiParty` per party (``ids``: each party's own
    IDs, ``host`` first) and return the intersection every party agreed on (sorted).

    ``transcript(kind, sender, receiver, blob)`` sees every message (tests scan it). Raises
    :class:`DataError` when the intersection is empty or the guests' views disagree."""
    parties = {p: PsiParty(p, v) for p, v in ids.items()}
    host = parties["host"]
    guests = [p for p in ids if p != "host"]
    log = transcript or (lambda *a: None)
    for g in guests:
        req = host.request(g)
        log("request", "host", g, req)
        setup, response = parties[g].answer(req)
        log("setup", g, "host", setup)
        log("response", g, "host", response)
        host.receive(g, setup, response)
    shared = host.intersection
    if not len(shared):
        raise DataError(f"--align psi: the parties' ID sets have no ID in common ({', '.join(ids)}); nothing to "
                        f"train on")
    for g in guests:
        blob = host.shared_ids(g)
        log("shared-ids", "host", g, blob)
        if not np.array_equal(parties[g].receive_shared(blob), shared):
            raise DataError(f"--align psi: {g} received another intersection than the host computed")
    return shared
