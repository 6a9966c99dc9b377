"""Can a simulation run all ``G + 1`` ClientApps at once? (the direct data plane needs it)

With the direct data plane every party's ClientApp works for a whole epoch at the same time: the
host drives the rounds and each guest answers over its stream. A Flower simulation runs one
ClientApp per Ray actor, and its actor pool holds as many actors as fit in the cluster's resources
(per node: ``int(node CPUs / num-cpus)``, and ``int(node GPUs / num-gpus)`` when a GPU is reserved —
``flwr.simulation.ray_transport.ray_actor.pool_size_from_resources``). With fewer actors than
parties the host would wait for guests that never start; fl_split checks before the first epoch
and stops with what was asked, what Ray has and which flag to change.

* :func:`capacity_here` — measured inside a simulation's ClientApp (the host's setup reply
  carries it): the actor's own reservation and every node's totals;
* :func:`local_capacity` — for the in-process engine before Ray starts (this machine);
* :func:`check_capacity` — the verdict and the message;
* :func:`flower_worker_threads` / :func:`widened_worker_pool` — Flower's own limit on ClientApps
  running at once in a simulation (a thread pool, whatever Ray allows), and the in-process
  engine's way past it; :func:`check_worker_threads` — the message where it cannot be widened.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any

from fl_split.errors import ConfigError


def slots(nodes: list[dict[str, float]], num_cpus: float, num_gpus: float) -> int:
    """How many actors reserving ``num_cpus`` / ``num_gpus`` fit on ``nodes`` (Flower's rule)."""
    total = 0
    for node in nodes:
        n = int(node.get("CPU", 0) / num_cpus + 1e-9) if num_cpus > 0 else 10 ** 6
        if num_gpus > 0:
            gpus = node.get("GPU", 0)
            n = min(n, int(gpus / num_gpus + 1e-9)) if gpus else 0
        total += n
    return total


def capacity_here() -> dict[str, Any] | None:
    """Inside a Ray actor: ``{"num_cpus", "num_gpus", "nodes": [{"CPU", "GPU"}…]}`` — this actor's
    reservation (= every ClientApp's) and each live node's totals; ``None`` outside Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        assigned = ray.get_runtime_context().get_assigned_resources()
        nodes = [{"CPU": float(n["Resources"].get("CPU", 0)), "GPU": float(n["Resources"].get("GPU", 0))}
                 for n in ray.nodes() if n.get("Alive") and n.get("Resources")]
    except Exception:  # noqa: BLE001 - the driver, or Ray without a runtime context: nothing to say
        return None
    if not assigned:
        return None
    return {"num_cpus": float(assigned.get("CPU", 0.0)), "num_gpus": float(assigned.get("GPU", 0.0)), "nodes": nodes}


def local_cpus() -> int:
    """CPUs a local Ray instance would report on this machine (Ray's own count, cgroup-aware)."""
    try:
        from ray._private.utils import get_num_cpus

        return int(get_num_cpus())
    except Exception:  # noqa: BLE001 - Ray's private helper moved: fall back to the OS
        import os

        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def local_capacity(num_cpus: float, num_gpus: float, cpus: int | None = None, gpus: int | None = None) -> dict:
    """The capacity of a one-node local Ray instance on this machine."""
    if gpus is None:
        gpus = 0
        if num_gpus > 0:
            import torch

            gpus = torch.cuda.device_count()
    return {"num_cpus": float(num_cpus), "num_gpus": float(num_gpus),
            "nodes": [{"CPU": float(local_cpus() if cpus is None else cpus), "GPU": float(gpus)}]}


def check_capacity(guests: int, capacity: dict[str, Any], where: str = "") -> None:
    """Raise :class:`~fl_split.errors.ConfigError` unless ``guests + 1`` ClientApps fit at once."""
    parties = guests + 1
    c, g = float(capacity["num_cpus"]), float(capacity["num_gpus"])
    nodes = capacity["nodes"]
    fit = slots(nodes, c, g)
    if fit >= parties:
        return
    cpus = sum(n.get("CPU", 0) for n in nodes)
    gpus = sum(n.get("GPU", 0) for n in nodes)
    n_nodes = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    have = f"Ray has {cpus:g} CPU(s)" + (f" and {gpus:g} GPU(s)" if g > 0 else "") + f" on {n_nodes}{where}"
    ask = f"each reserves --num-cpus {c:g}" + (f" and --num-gpus {g:g}" if g > 0 else "")
    fixes = []
    cpu_fit = slots(nodes, c, 0)
    if cpu_fit < parties:
        per_node_max = max(n.get("CPU", 0) for n in nodes) if nodes else 0
        best = _largest_share([n.get("CPU", 0) for n in nodes], parties)
        fixes.append(f"--num-cpus {best:g} or less" if best > 0 else f"a node with more than {per_node_max:g} CPUs")
    if g > 0 and slots(nodes, 0, g) < parties:
        best = _largest_share([n.get("GPU", 0) for n in nodes], parties)
        fixes.append(f"--num-gpus {best:g} or less" if best > 0 else "more GPUs")
    flwr_run = (f"flwr run: fl-split flwr-run derives a federation that fits, or --federation-config "
                f"\"init-args-num-cpus={math.ceil(parties * max(c, 1) - 1e-9)}\" lets Ray count that many CPUs"
                if cpu_fit < parties else "flwr run: client-resources-num-gpus")
    raise ConfigError("num-cpus" if cpu_fit < parties else "num-gpus", c if cpu_fit < parties else g,
                      " and ".join(fixes) + f" ({flwr_run}), more Ray nodes, or --data-plane flower (one ClientApp "
                      "at a time, no such need)",
                      reason=f"the direct data plane runs all {parties} ClientApps (1 host + {guests} guest"
                             f"{'s' if guests != 1 else ''}) at once, but only {fit} fit: {ask}, and {have}")


def _largest_share(amounts: list[float], parties: int) -> float:
    """The largest per-ClientApp amount (2 decimals, rounded down) with which ``parties`` fit on
    nodes holding ``amounts``."""
    best = 0.0
    for k in range(1, 10001):
        share = math.floor(100 * max(amounts, default=0) / k) / 100 if amounts else 0
        if share <= 0:
            break
        if sum(int(a / share + 1e-9) for a in amounts) >= parties:
            best = share
            break
    return best


def flower_worker_threads() -> int:
    """How many ClientApps Flower's simulation runtime runs at once: ``vce_api`` hands messages to the
    backend from a ``ThreadPoolExecutor()`` of Python's default size, ``min(32, cpus + 4)`` of the
    machine running the simulation (flwr 1.41), whatever Ray's resources allow. A direct-data-plane
    epoch needs all ``G + 1`` at once (measured: on 2 cores, G = 8 guests never all connected)."""
    return min(32, (os.cpu_count() or 1) + 4)


@contextlib.contextmanager
def widened_worker_pool(parties: int):
    """In this process, let Flower's simulation run ``parties`` ClientApps at once (the in-process
    engine; ``flwr run``'s SuperLink is another process: :func:`check_worker_threads`)."""
    if parties <= flower_worker_threads():
        yield False
        return
    import functools
    from concurrent.futures import ThreadPoolExecutor

    from flwr.server.superlink.fleet.vce import vce_api

    old = vce_api.ThreadPoolExecutor
    vce_api.ThreadPoolExecutor = functools.partial(ThreadPoolExecutor, max_workers=parties)
    try:
        yield True
    finally:
        vce_api.ThreadPoolExecutor = old


def pool_widened_here() -> bool:
    """Whether this process runs the simulation with :func:`widened_worker_pool` in force."""
    vce_api = sys.modules.get("flwr.server.superlink.fleet.vce.vce_api")
    return vce_api is not None and not isinstance(vce_api.ThreadPoolExecutor, type)


def check_worker_threads(guests: int) -> None:
    """Under ``flwr run`` (the SuperLink runs the simulation, assumed on this machine): refuse a direct
    data plane whose ``G + 1`` ClientApps exceed Flower's thread pool, instead of timing out."""
    parties, limit = guests + 1, flower_worker_threads()
    if parties > limit:
        raise ConfigError("guests", guests, f"at most {limit - 1} guests with the direct data plane under `flwr run` "
                          f"on this machine, `fl-split train --engine flower` (which lifts the limit), or "
                          f"--data-plane flower (one ClientApp at a time)",
                          reason=f"Flower's simulation runs at most min(32, CPUs + 4) = {limit} ClientApps at once "
                                 f"(a thread pool in flwr's vce_api), and an epoch needs all {parties}")



# -- --num-cpus auto and torch threads (docs/flower.md, "CPUs and threads") ----------------------------
def auto_share(parties: int, node_cpus: list[float]) -> float:
    """``--num-cpus auto``: the largest CPU share per ClientApp (2 decimals, rounded down) with
    which all ``parties`` ClientApps fit at once on nodes holding ``node_cpus`` — the CPUs Ray sees,
    shared by the ``G + 1`` parties (2 CPUs, 3 parties: 0.66). Whole CPUs when they divide evenly
    (16 CPUs, 3 parties: 5.33; 4 CPUs, 2 parties: 2). ``1.0`` when Ray reports no CPU at all (Ray
    then refuses the run with its own reason)."""
    return _largest_share([float(c) for c in node_cpus], parties) or 1.0


def resolve_num_cpus(cfg, parties: int, node_cpus: list[float]):
    """``cfg`` with ``num_cpus = auto`` replaced by :func:`auto_share` (unchanged otherwise)."""
    from fl_split.config import AUTO

    if cfg.num_cpus != AUTO:
        return cfg
    return cfg.replace(num_cpus=auto_share(parties, node_cpus))


def share_line(cfg, parties: int, node_cpus: list[float], where: str) -> str:
    """The one line that says what ``--num-cpus auto`` chose (printed by the CLI)."""
    from fl_split.devices import party_threads

    cpus = sum(node_cpus)
    guests = parties - 1
    return (f"--num-cpus auto: {cfg.num_cpus:g} CPU per ClientApp ({cpus:g} CPU(s) {where} shared by {parties} "
            f"ClientApps: 1 host + {guests} guest{'s' if guests != 1 else ''}); "
            f"{party_threads(cfg.threads, cfg.num_cpus)} torch thread(s) each")
