"""Where a run's tensors live: one rule for ``--device`` in every engine, and what each party records.

``--device auto`` is resolved **once, before any party is built, by the engine that starts the
run**, to ``cuda`` when this machine has a CUDA device and ``cpu`` otherwise — the same rule for the
local engine, the monolithic baseline and the in-process Flower simulation — and the resolved value
is what every party receives and what the results' ``config.device`` says. A Flower ClientApp
sees a GPU only when Ray reserves one for it, so a simulation whose parties use CUDA needs
``--num-gpus > 0`` (each party's tensors then live on the GPU Ray assigned to its actor); asking for
CUDA without it is refused with a message naming both flags instead of silently running the parties
on the CPU. Under ``flwr run`` and in a deployment the coordinator cannot see the parties' machines:
there each party resolves ``auto`` on its own machine by the same rule.

Every party's end-of-run report carries ``device`` (``cpu`` or ``cuda:<index>``) and, on a GPU,
``accelerator`` (the device's name and the GPU IDs Ray assigned), so the results say where each
party ran.

Determinism (``--deterministic``, :func:`apply_deterministic`): deterministic cuDNN/cuBLAS kernels in
every process that builds a party, set where parties are built (:mod:`fl_split.builder`), so the local
engine, each Flower ClientApp and a deployment node alike; process-wide, never switched back off.

Threads (``--threads``, :func:`party_threads`): how many torch intra-op threads a party uses — the
whole CPUs its Flower ClientApp reserves, 1 where it reserves none (the local engine, a deployment
node) unless ``--threads N`` says otherwise.
"""

from __future__ import annotations

import math
from typing import Any

from fl_split.errors import ConfigError


def resolve(name: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` for ``--device name`` in this process (``auto``: CUDA if
    visible). ``cuda:N`` must name a GPU this process can see: otherwise one line naming --device
    and the devices that are available."""
    import torch

    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError("device", name, "auto or cpu (no CUDA device is visible)")
        if name != "cuda":
            index = name[5:]
            if not index.isdigit() or int(index) >= n:
                raise ConfigError("device", name, available_text(n),
                                  reason=f"this machine has {n} visible GPU(s), numbered 0..{n - 1}")
        return name
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    raise ConfigError("device", name, "auto, cpu, cuda or cuda:N")


def available_text(n: int) -> str:
    """What ``--device`` may be on a machine with ``n`` visible GPUs."""
    return "auto, cpu" + ("" if n == 0 else ", cuda or " + ", ".join(f"cuda:{i}" for i in range(n)))


def with_device(cfg):
    """``cfg`` with ``--device`` resolved for parties that run in this process."""
    return cfg if cfg.device in ("cpu",) else cfg.replace(device=resolve(cfg.device))


def for_simulation(cfg):
    """``cfg`` with ``--device`` resolved for an in-process Flower simulation on this machine: the
    same rule as :func:`with_device`; CUDA needs ``--num-gpus > 0`` (Ray hides GPUs from actors
    that reserve none)."""
    if cfg.device.startswith("cuda:"):
        raise ConfigError("device", cfg.device, "auto, cpu or cuda with --engine flower",
                          reason="Ray assigns each ClientApp its GPU(s) (--num-gpus) and renumbers them, so GPU "
                                 "number N of this machine means nothing inside a ClientApp")
    device = resolve(cfg.device) if cfg.device == "auto" else cfg.device
    if device.startswith("cuda") and cfg.num_gpus <= 0:
        import torch

        n = torch.cuda.device_count() if cfg.device == "auto" else 0
        share = f"{max(0.01, int(100 * n / (cfg.guests + 1)) / 100):g}" if n else "0.33"
        chose = (f"--device auto chose cuda (this machine has {n} GPU(s), as the local engine would use)"
                 if cfg.device == "auto" else f"--device {cfg.device}")
        raise ConfigError("num-gpus", cfg.num_gpus, f"a share of a GPU per ClientApp, e.g. --num-gpus {share} "
                          f"({cfg.guests + 1} parties on {max(n, 1)} GPU(s)), or --device cpu",
                          reason=f"{chose}, but a Flower ClientApp sees a GPU only when Ray reserves one for it")
    return cfg.replace(device=device)


def describe(device) -> dict[str, Any]:
    """What a party's report says about where it ran (no data: a device name, Ray's GPU IDs)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return {"device": dev.type}
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    info: dict[str, Any] = {"name": torch.cuda.get_device_name(index)}
    try:
        import sys

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            info["ray_gpu_ids"] = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # noqa: BLE001 - not in a Ray worker
        pass
    return {"device": f"cuda:{index}", "accelerator": info}


def report_with_device(party) -> dict[str, Any]:
    """``party.report()`` plus where the party's tensors live."""
    return {**party.report(), **describe(party.device)}


#: cuBLAS workspace configurations under which cuBLAS is deterministic (NVIDIA's cuBLAS docs,
#: "Results reproducibility"); fl_split sets the first unless one of them is already set
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def apply_deterministic(enabled: bool) -> bool:
    """``--deterministic``: make this process's torch kernels deterministic (idempotent; returns
    ``enabled``). Nothing happens when ``enabled`` is false (a caller's own setting is left alone).

    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS splits a reduction across a workspace whose use
      depends on the stream's scheduling unless its workspace is fixed; torch reads the variable when it
      creates its first cuBLAS handle, so it must be set before the process's first CUDA matmul — a
      party is built before any, in every engine;
    * ``torch.use_deterministic_algorithms(True)``: ops with atomics-based CUDA kernels (scatter/index
      adds, some pooling backwards) take a deterministic kernel, and an op that has none raises
      torch's error naming it instead of silently differing between runs;
    * ``cudnn.deterministic = True``, ``cudnn.benchmark = False``: cuDNN picks a fixed deterministic
      convolution algorithm instead of timing candidates (whose choice can change between runs).

    Process-wide and left on (torch has no per-thread switch): a process that built a party with
    ``--deterministic`` stays deterministic. On the CPU fl_split's runs are deterministic already
    (for a fixed ``--threads``); the flag is not needed there (a few CPU ops, e.g. an accumulating
    ``index_put``, then take their deterministic variant)."""
    if not enabled:
        return False
    import os

    import torch

    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return True


def party_threads(setting: Any, cpus_given: float | None, limit: int | None = None) -> int:
    """Torch intra-op threads of one party: ``--threads N`` as given; ``auto`` = the whole CPUs its
    ClientApp reserves (``floor(--num-cpus)``, at least 1, and at most ``limit``), or 1 where a party
    reserves nothing (the local engine runs the parties one after the other in one process).

    Why 1 and not torch's default (one per core): a party's work per batch is small, and torch's
    OpenMP threads spin-wait for each other; when another process takes a core they stall. Measured
    on the 2-core machine (issue 17): a CLI epoch took 8.1–8.3 s with torch's default threads while
    another job ran, 0.06–0.09 s with one thread (``experiments/bench_threads.py``)."""
    if setting != "auto":
        return max(1, int(setting))
    if not cpus_given:
        return 1
    n = max(1, int(math.floor(float(cpus_given) + 1e-9)))
    return n if limit is None else max(1, min(n, limit))


def apply_threads(n: int) -> int:
    """Set torch's intra-op threads of this process to ``n`` (returns the previous value)."""
    import torch

    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
    return old
