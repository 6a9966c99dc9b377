"""What goes wrong on the data plane, said for people (design principle 4, `docs/references.md`).

Every error names the peer (``guest-2``, or the address of an unknown peer) and what was wrong.
:class:`PeerFailure` also names the round, so the coordinator reports it exactly like a party's
own error (``guest-2 failed in round 7: data plane: …``).
"""

from __future__ import annotations

from fl_split.errors import FlSplitError, PartyError


class DataPlaneError(FlSplitError):
    """The data plane could not be set up or used (address, TLS material, rendezvous)."""


class CredentialError(DataPlaneError):
    """A peer did not prove it is the party it claims (its private key, its certificate's name), or
    asked for another session; nothing it sent was read."""


class FrameError(DataPlaneError):
    """A data-plane frame is malformed, out of sequence or not signed with the session's key; it
    was refused before any tensor in it was read."""


class PeerFailure(PartyError):
    """A peer failed on the data plane (disconnected, stalled, refused, or sent a bad frame):
    ``party`` is the peer at fault, ``round`` the round it failed in (``None`` before the first)."""

    def __init__(self, party: str, round_: int | None, message: str) -> None:
        super().__init__(party, round_, f"data plane: {message}")


class FloodError(DataPlaneError):
    """Guests could not connect while the host was refusing unauthenticated connections that never
    named a guest (silent, evicted, oversized or malformed): the cause is the flood, not a guest;
    the message says how many, of which kinds and from which addresses (issue 16)."""
