"""The direct data plane: per-batch tensors straight between guests and host (issue 10).

Flower is the control plane (discovery, roles, setup, one message per party per epoch, reports,
failures); within an epoch the host drives the shared round loop and reaches its guests over one
gRPC bidirectional stream each. Nothing here knows Flower:

* :mod:`fl_split.dataplane.frames` — the frame format, the handshake authenticating each party
  by its own key pair, sealed (AES-GCM) frames;
* :mod:`fl_split.dataplane.host` — the host's gRPC server (:class:`HostEndpoint`) and the
  transport its round loop runs over (:class:`HostDataPlane`);
* :mod:`fl_split.dataplane.guest` — a guest's client loop (:func:`serve`);
* :mod:`fl_split.dataplane.tls` — PEM certificates for TLS;
* :mod:`fl_split.dataplane.rendezvous` — how a simulated guest learns the host's address;
* :mod:`fl_split.dataplane.limits` — what an unauthenticated peer can make the host hold (bytes,
  streams, seconds, log lines) and the largest frame a run's plan allows;
* :mod:`fl_split.dataplane.errors` — what goes wrong, naming the peer.

Why gRPC and not ``torch.distributed``: ``docs/flower.md``, "The direct data plane".
"""

from fl_split.dataplane.errors import CredentialError, DataPlaneError, FloodError, FrameError, PeerFailure

__all__ = ["CredentialError", "DataPlaneError", "FloodError", "FrameError", "PeerFailure"]
