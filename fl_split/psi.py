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
checked by the receiver, bounded in size. :func:`run_psi` is the protocol — the order of the steps
and the router's checks — over a :class:`PsiRoute`, which delivers each step to the party that
performs it:

* :class:`LocalRoute` (:func:`align_by_psi`): between :class:`PsiParty` objects in one process,
  each holding only its own party's IDs (the local engine and the in-process Flower simulation
  prepare every party's data in one process);
* :class:`fl_split.flower.alignment.FlowerPsiRoute`: a Flower deployment's ServerApp sends each step
  to the party's SuperNode as a Flower message, each SuperNode reading only its own table
  (``data = "node-tables"``). The host's state between its messages (candidates, the key of its open
  request: :meth:`PsiParty.export_host`) stays in its node's ``context.state``, never in a message.

Either way the coordinator's view is the one above, and each party learns what it says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from fl_split.errors import DataError, ProtocolError
from fl_split.protocol import _read_varint, _varint, party_index, party_name

MAGIC = b"P1"
KINDS = ("request", "setup", "response", "shared-ids")
#: at most this many bytes per PSI frame: ~ 10 million IDs of 33-byte compressed points
MAX_PSI_FRAME = 512 * 1024 * 1024


#: how to install the PSI library (``--no-deps``: openmined-psi pins a protobuf older than Flower's;
#: docs/datasets.md, "openmined-psi and protobuf")
PSI_INSTALL = 'pip install --no-deps "openmined-psi>=2.0.6"'


def _psi():
    try:
        import private_set_intersection.python as psi
    except ImportError as exc:  # a dependency of the optional extra fl-split[psi]
        raise DataError(f"--align psi needs the openmined-psi package ({PSI_INSTALL})") from exc
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

    @property
    def pending(self) -> list[str]:
        """Host: the guests whose answer it still waits for (a request is open)."""
        return list(self._clients)

    def export_host(self) -> dict[str, bytes]:
        """Host: what it must keep between two messages when each may run in a fresh process (a
        Flower deployment node keeps it in its own ``context.state``, never in a message): its
        candidates ``C_g`` (its own IDs) and the secret key of each request still unanswered."""
        out = {"candidates": np.ascontiguousarray(self._candidates, "<i8").tobytes()}
        out.update({f"key.{g}": bytes(c.GetPrivateKeyBytes()) for g, c in self._clients.items()})
        return out

    @classmethod
    def import_host(cls, party: str, ids: np.ndarray, state: dict[str, bytes]) -> "PsiParty":
        """Host: the party :meth:`export_host` saved (``ids``: its own IDs, read again from its table).
        Candidates that are not its own IDs are refused (a damaged state)."""
        me = cls(party, ids)
        raw = bytes(state.get("candidates", b""))
        if len(raw) % 8:
            raise ProtocolError(f"{party}: damaged PSI state (candidates of {len(raw)} bytes)")
        cand = np.frombuffer(raw, "<i8").astype(np.int64)
        if not np.isin(cand, me._own).all() or (cand.size > 1 and not np.all(np.diff(cand) > 0)):
            raise ProtocolError(f"{party}: damaged PSI state (candidates that are not its own sorted IDs)")
        me._candidates = cand
        for key, value in state.items():
            if key.startswith("key."):
                me._clients[key[4:]] = _psi().client.CreateFromKey(bytes(value), True)
        return me

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


class PsiRoute(Protocol):
    """How the protocol's steps reach the parties: each method delivers one step to the party that
    performs it and returns the frames that party sends back. :class:`LocalRoute` calls
    :class:`PsiParty` objects in this process; a Flower deployment's ServerApp sends each step to the
    party's node as a Flower message (:mod:`fl_split.flower.alignment`). The order of the steps and
    the checks between them are :func:`run_psi`'s, the same for every route."""

    def request(self, guest: str) -> bytes: ...                                  # host
    def answer(self, guest: str, request: bytes) -> tuple[bytes, bytes]: ...      # guest
    def receive(self, guest: str, setup: bytes, response: bytes) -> None: ...     # host
    def shared(self, guests: list[str]) -> dict[str, bytes]: ...                  # host
    def accept(self, frames: dict[str, bytes]) -> dict[str, str]: ...             # each guest: ids_digest of I


class LocalRoute:
    """:class:`PsiRoute` between :class:`PsiParty` objects in one process (the local engine and the
    in-process Flower simulation, which prepare every party's data in one process)."""

    def __init__(self, ids: dict[str, np.ndarray]) -> None:
        self.parties = {p: PsiParty(p, v) for p, v in ids.items()}

    def request(self, guest):
        return self.parties["host"].request(guest)

    def answer(self, guest, request):
        return self.parties[guest].answer(request)

    def receive(self, guest, setup, response):
        self.parties["host"].receive(guest, setup, response)

    def shared(self, guests):
        return {g: self.parties["host"].shared_ids(g) for g in guests}

    def accept(self, frames):
        return {g: ids_digest(self.parties[g].receive_shared(b)) for g, b in frames.items()}


def ids_digest(ids: np.ndarray) -> str:
    """A digest of an ID list (int64, in order): how a guest tells the router which intersection it
    accepted without sending it back."""
    import hashlib

    return hashlib.blake2b(np.ascontiguousarray(np.asarray(ids), "<i8").tobytes(), digest_size=16).hexdigest()


def run_psi(route: PsiRoute, guests: list[str],
            transcript: Callable[[str, str, str, bytes], None] | None = None) -> np.ndarray:
    """The protocol of the module docstring over ``route``: for each guest in order the host's
    ``request``, the guest's ``setup`` and ``response``, the host's update; then ``shared-ids`` to
    every guest. Returns the intersection ``I`` (sorted), which the router reads from the
    ``shared-ids`` frames (the coordinator's view: blinded points and ``I``).

    ``transcript(kind, sender, receiver, blob)`` sees every message. Raises :class:`DataError` when
    the intersection is empty or a guest accepted another intersection than the host sent, and
    :class:`ProtocolError` for a malformed frame, before ``I`` reaches any guest."""
    log = transcript or (lambda *a: None)
    for g in guests:
        req = route.request(g)
        log("request", "host", g, req)
        setup, response = route.answer(g, req)
        log("setup", g, "host", setup)
        log("response", g, "host", response)
        route.receive(g, setup, response)
    frames = route.shared(list(guests))
    if set(frames) != set(guests):
        raise ProtocolError(f"host: shared-ids for {sorted(frames)}, expected {list(guests)}")
    views = {g: decode(frames[g], kind="shared-ids", sender="host", receiver=g) for g in guests}
    shared = np.frombuffer(views[guests[0]], "<i8").astype(np.int64) if guests else np.zeros(0, np.int64)
    if any(v != views[guests[0]] for v in views.values()):
        raise ProtocolError("host: the shared-ids differ between guests; every guest gets the same intersection")
    if not len(shared):
        raise DataError(f"--align psi: the parties' ID sets have no ID in common (host, {', '.join(guests)}); "
                        f"nothing to train on")
    for g in guests:
        log("shared-ids", "host", g, frames[g])
    accepted = route.accept(frames)
    want = ids_digest(shared)
    for g in guests:
        if accepted.get(g) != want:
            raise DataError(f"--align psi: {g} received another intersection than the host computed")
    return shared


def align_by_psi(ids: dict[str, np.ndarray],
                 transcript: Callable[[str, str, str, bytes], None] | None = None) -> np.ndarray:
    """Route the PSI messages between one :class:`PsiParty` per party (``ids``: each party's own
    IDs, ``host`` first) and return the intersection every party agreed on (sorted):
    :func:`run_psi` over a :class:`LocalRoute`.

    ``transcript(kind, sender, receiver, blob)`` sees every message (tests scan it). Raises
    :class:`DataError` when the intersection is empty or the guests' views disagree."""
    return run_psi(LocalRoute(ids), [p for p in ids if p != "host"], transcript)
