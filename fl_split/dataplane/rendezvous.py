"""How a guest learns where the host's data plane listens.

* **Deployment**: the host's SuperNode is configured with the address guests reach it at
  (node config ``dataplane-address``); it tells the coordinator at setup, and the coordinator sends
  it to every guest with each epoch's control message. Nothing else is needed.
* **Simulation**: a ClientApp runs on whichever Ray actor is free, so where the host listens is
  known only once its epoch message runs. The host binds a free port on its own Ray node and
  *publishes* the address under the epoch's session identifier on a board every party of the
  simulation can read: Ray's cluster key-value store (:class:`RayBoard`; reaches every node of a
  multi-node cluster), or a board in this process when the parties are threads of one process
  (:class:`ProcessBoard`, the inline tests). The address is public: a connection still has to prove
  it is the party it claims (:mod:`fl_split.dataplane.frames`).
"""

from __future__ import annotations

import sys
import threading
import time

from fl_split.dataplane.errors import DataPlaneError

NAMESPACE = "fl_split"


class ProcessBoard:
    """Addresses published by parties that run in this process (threads)."""

    _lock = threading.Condition()
    _addresses: dict[str, str] = {}

    def publish(self, session: str, address: str) -> None:
        with self._lock:
            self._addresses[session] = address
            self._lock.notify_all()

    def lookup(self, session: str, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while session not in self._addresses:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)
            return self._addresses[session]

    def withdraw(self, session: str) -> None:
        with self._lock:
            self._addresses.pop(session, None)


class RayBoard:
    """Addresses in the Ray cluster's key-value store (GCS), readable from every node."""

    POLL = 0.02

    def __init__(self) -> None:
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            raise DataPlaneError("the Ray key-value store is not reachable from this process")
        self._kv = internal_kv

    def _key(self, session: str) -> bytes:
        return f"dataplane/{session}".encode()

    def publish(self, session: str, address: str) -> None:
        self._kv._internal_kv_put(self._key(session), address.encode(), overwrite=True, namespace=NAMESPACE)

    def lookup(self, session: str, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while True:
            value = self._kv._internal_kv_get(self._key(session), namespace=NAMESPACE)
            if value is not None:
                return value.decode()
            if time.monotonic() > deadline:
                return None
            time.sleep(self.POLL)

    def withdraw(self, session: str) -> None:
        try:
            self._kv._internal_kv_del(self._key(session), namespace=NAMESPACE)
        except Exception:  # noqa: BLE001 - Ray shutting down: nothing to withdraw from
            pass


def in_ray_worker() -> bool:
    """Whether this process is connected to Ray (a simulation's ClientApp actor, or its driver)."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def board():
    """The board the parties of this simulation share (Ray's, inside Ray; else this process's)."""
    return RayBoard() if in_ray_worker() else ProcessBoard()


def local_ip() -> str:
    """The address a simulated host binds: its Ray node's IP inside Ray, else the loopback."""
    if in_ray_worker():
        import ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1"
