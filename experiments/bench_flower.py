"""Benchmark of the Flower engine with the direct data plane (issue 10).

* **latency** — one per-batch exchange on the data plane: the host sends every guest a STEP frame
  (owed gradients) and waits for every RELEASE (activations), payloads of the real runs' size
  (digits: 32 × 64 float32; movielens-small: 32 × 128), each guest in its own process, over loopback
  gRPC (plaintext and TLS). ``--compare-gloo`` adds ``torch.distributed`` (gloo) send/recv of the
  same tensors, the alternative transport considered (``docs/flower.md``).
* **ratio** — exact training (K = 1) on the Flower simulation ÷ the local engine, per epoch (median of
  the epochs after the first), digits (2 guests) and movielens-small (1 guest); one control message
  per epoch (the default) and one for all epochs. Goal ≤ 1.5×. Every Flower run is checked to equal
  the local engine bit for bit.
* **startup** — issue 18: a 2-epoch digits run at G = 2 and 4 (``--startup-guests``), each repeat
  (``--repeats``, default 3) a fresh process running the Flower engine as the CLI does and another
  the local engine: start-up (the Flower process's wall time − its training time), the engine's
  timeline (:meth:`FlowerEngine.startup`: imports, Ray start, actors, setup, …) and Flower ÷ local
  *total* training time (every epoch, the first one's connections included); medians. The ratio
  part also records the timeline of its own runs.
* **scaling** — time per epoch and peak memory (resident memory of this process and every descendant:
  Ray's daemons and the ClientApp actors, sampled every 0.2 s) vs the number of guests G ∈ {1, 2, 4,
  8, 16} on breast-cancer (30 feature columns, so 16 guests fit), each party reserving
  ``--num-cpus 2/(G+1)`` (rounded down) so that all ClientApps run at once on the machine's cores.
  Flower's simulation runtime runs at most ``min(32, CPUs + 4)`` ClientApps at once (a default-size
  thread pool in ``vce_api.py``); the in-process engine widens that pool for the direct data plane
  (``fl_split.flower.resources.widened_worker_pool``; said per row), and the part
  gives the G + 1 actors 600 s to start and connect. JSON and a PNG plot.
* **wire** — 002's 1-bit claim: bytes guest → host of a randomized-response run ÷ the same run in
  float32 (digits, 2 guests, 1 epoch, local engine: every engine sends the same blobs, which the
  ratio part checks), and the same for one full batch's message (goal ≤ 1/30; 1/32 is the payload
  alone).

    python experiments/bench_flower.py                  # everything (~15-25 min on the 2-core machine)
    python experiments/bench_flower.py --quick          # latency + an in-process direct run (< 1 min)
    python experiments/bench_flower.py --only ratio startup
    python experiments/bench_flower.py --only startup --startup-guests 2 --repeats 3
    python experiments/bench_flower.py --relay-sweep    # the relay's batches-per-round sweep (issue 3)

Writes ``experiments/results/bench_flower.json`` (``--quick``: ``bench_flower_quick.json``), the plot
``experiments/results/bench_flower_scaling.png``, and prints Markdown tables (``docs/flower.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# heavy imports (torch, the engines) happen inside the functions: the latency guests are spawned
# processes, which import this module again and must stay light

RESULTS = Path(__file__).parent / "results"
PS_INT = 0  # private seed of every compared run (the Flower and local runs must draw the same noise)


def _ps():
    """``PS_INT`` with the pre-issue-16 derivation (``PrivateSeed.legacy``): committed numbers reproduce."""
    from fl_split.seeding import PrivateSeed

    return PrivateSeed.legacy(PS_INT)
RATIO_GOAL = 1.5
DATAPLANE_TIMEOUT = 600.0  # scaling part: seconds to wait for G + 1 actors to start and the guests to connect


def _bench_key(party: str) -> bytes:
    """A fixed X25519 private key per party for the latency part (a benchmark's, not a secret)."""
    import hashlib

    return hashlib.sha256(f"fl_split bench_flower latency {party}".encode()).digest()


def _bench_keys(party: str, peers: list[str]):
    """``party``'s data-plane identity with the public keys of ``peers`` (issue 16's LinkKeys)."""
    from fl_split.dataplane import frames as F

    return F.LinkKeys(_bench_key(party), {p: F.public_key(_bench_key(p)) for p in peers})


def _versions() -> dict:
    import flwr
    import grpc
    import ray
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "flwr": flwr.__version__,
            "ray": ray.__version__, "grpcio": grpc.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
            "loadavg_start": os.getloadavg()}


def _same_training(a: dict, b: dict) -> bool:
    strip = ("epoch_time_s",)
    ha = [{k: v for k, v in h.items() if k not in strip} for h in a["history"]]
    hb = [{k: v for k, v in h.items() if k not in strip} for h in b["history"]]
    return ha == hb and a["wire"] == b["wire"]


def _steady(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def _cpus_each(parties: int) -> float:
    from fl_split.flower.resources import local_cpus

    return max(0.01, math.floor(100 * min(1.0, local_cpus() / parties)) / 100)


# -- latency ------------------------------------------------------------------------------------------
def _latency_guest(name: str, address: str, nbytes: int, tls_ca: str | None) -> None:
    from fl_split.dataplane.guest import serve
    from fl_split.dataplane.tls import ClientTLS

    payload = os.urandom(nbytes)
    serve(name, lambda owed, keys, r: [payload], address, _bench_keys(name, ["host"]), "00ff00ff00ff00ff",
          ClientTLS.from_files(tls_ca) if tls_ca else None, timeout=60)


def dataplane_latency(guests: int, nbytes: int, rounds: int = 400, tls: dict | None = None) -> dict:
    """Median round trip of one exchange (STEP to every guest, every RELEASE back), milliseconds."""
    from fl_split.dataplane import frames as F
    from fl_split.dataplane.host import HostEndpoint
    from fl_split.dataplane.tls import ServerTLS

    names = [f"guest-{i + 1}" for i in range(guests)]
    server = ServerTLS.from_files(str(tls["host_cert"]), str(tls["host_key"])) if tls else None
    ep = HostEndpoint(names, _bench_keys("host", names), "00ff00ff00ff00ff", "127.0.0.1:0", tls=server, timeout=60)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_latency_guest, args=(g, ep.address, nbytes, str(tls["ca"]) if tls else None))
             for g in names]
    for p in procs:
        p.start()
    try:
        ep.wait_for_guests()
        payload = os.urandom(nbytes)
        times = []
        for r in range(1, rounds + 1):
            t = time.perf_counter()
            for g in names:
                ep.send(g, F.STEP, {"round": r, "keys": [["train", 1, 0]]}, [payload])
            out, failed, _ = ep.collect(r, names)
            assert not failed and len(out) == guests
            times.append(time.perf_counter() - t)
    finally:
        ep.close()
        for p in procs:
            p.join(30)
    steady = sorted(times[rounds // 10:])
    return {"guests": guests, "bytes_each_way": nbytes, "tls": bool(tls), "median_ms": 1e3 * statistics.median(steady),
            "p90_ms": 1e3 * steady[int(0.9 * len(steady))]}


def _gloo_peer(rank: int, world: int, port: int, numel: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.zeros(numel)
    for _ in range(rounds):
        dist.recv(t, src=0)
        dist.send(t, dst=0)
    dist.destroy_process_group()


def gloo_latency(guests: int, nbytes: int, rounds: int = 400) -> dict:
    """The same exchange with torch.distributed point-to-point (gloo), for comparison."""
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    numel = nbytes // 4
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_gloo_peer, args=(i + 1, guests + 1, port, numel, rounds)) for i in range(guests)]
    for p in procs:
        p.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=guests + 1)
    t, bufs, times = torch.zeros(numel), [torch.zeros(numel) for _ in range(guests)], []
    for _ in range(rounds):
        a = time.perf_counter()
        for i in range(guests):
            dist.send(t, dst=i + 1)
        for i in range(guests):
            dist.recv(bufs[i], src=i + 1)
        times.append(time.perf_counter() - a)
    dist.destroy_process_group()
    for p in procs:
        p.join(30)
    steady = sorted(times[rounds // 10:])
    return {"guests": guests, "bytes_each_way": nbytes, "median_ms": 1e3 * statistics.median(steady),
            "p90_ms": 1e3 * steady[int(0.9 * len(steady))]}


def bench_latency(compare_gloo: bool, rounds: int, quick: bool = False) -> dict:
    import tempfile

    sizes = {"digits (32 x 64)": 32 * 64 * 4, "movielens-small (32 x 128)": 32 * 128 * 4}
    if quick:
        sizes = {"digits (32 x 64)": 32 * 64 * 4}
    rows = []
    tls = None
    try:
        if quick:
            raise RuntimeError("--quick")
        from tests.tlsutil import make_certificates

        tls = make_certificates(Path(tempfile.mkdtemp(prefix="fl_split_bench_tls")))
    except Exception as exc:  # noqa: BLE001 - cryptography missing: plaintext only
        print(f"note: no TLS latency ({exc})", flush=True)
    for label, nbytes in sizes.items():
        for g in (1, 2):
            row = {"payload": label, **dataplane_latency(g, nbytes, rounds)}
            if tls:
                row["tls_median_ms"] = dataplane_latency(g, nbytes, rounds, tls)["median_ms"]
            if compare_gloo:
                row["gloo_median_ms"] = gloo_latency(g, nbytes, rounds)["median_ms"]
            rows.append(row)
            print(f"[latency] {label}, {g} guest(s): {row['median_ms']:.3f} ms"
                  + (f", TLS {row['tls_median_ms']:.3f} ms" if "tls_median_ms" in row else "")
                  + (f", gloo {row['gloo_median_ms']:.3f} ms" if "gloo_median_ms" in row else ""), flush=True)
    return {"rounds": rounds, "rows": rows}


# -- epoch time ratio -----------------------------------------------------------------------------------
SETUPS = {"digits": {"guests": 2, "epochs": 5}, "movielens-small": {"guests": 1, "epochs": 3}}


def bench_ratio(name: str, setup: dict, limit: int = 0) -> dict:
    from fl_split.config import RunConfig
    from fl_split.engine import LocalEngine
    from fl_split.flower import FlowerEngine

    parties = setup["guests"] + 1
    base = RunConfig(dataset=name, guests=setup["guests"], epochs=setup["epochs"], progress=False, seed=0,
                     engine="flower", device="cpu", limit=limit, num_cpus=_cpus_each(parties), epochs_per_message=1)
    cfgs = [base, base.replace(epochs_per_message=setup["epochs"])]
    print(f"[ratio] {name}: Flower simulation, direct data plane, K = 1, {setup['epochs']} epochs, "
          f"1 and {setup['epochs']} epochs per control message", flush=True)
    # the local engine before and after the Flower runs (Ray's start and teardown load the machine
    # for a while): its per-epoch time is the median over both runs' steady epochs
    local = LocalEngine(base.replace(engine="local"), _ps()).run()
    load_before = os.getloadavg()
    engine = FlowerEngine(base, private_seed=_ps())
    flower = engine.run_series(cfgs)
    startup = engine.startup()
    load_after = os.getloadavg()
    local_after = LocalEngine(base.replace(engine="local"), _ps()).run()
    local_times = [h["epoch_time_s"] for h in local["history"][1:] + local_after["history"][1:]]
    l_ep = statistics.median(local_times)
    rows = []
    for cfg, f in zip(cfgs, flower):
        f_ep = _steady([h["epoch_time_s"] for h in f["history"]])
        rows.append({"epochs_per_message": cfg.epochs_per_message, "flower_epoch_s": f_ep, "local_epoch_s": l_ep,
                     "ratio": f_ep / l_ep, "flower_epoch_times": [h["epoch_time_s"] for h in f["history"]],
                     "flower_time_s": f["time_s"], "local_time_s": local["time_s"],
                     "flower_equals_local": _same_training(f, local)})
        print(f"[ratio] {name}, {cfg.epochs_per_message} epoch(s)/message: Flower {f_ep:.3f} s, local {l_ep:.3f} s "
              f"per epoch = {f_ep / l_ep:.2f}x; equal: {rows[-1]['flower_equals_local']}", flush=True)
    return {"dataset": name, "guests": setup["guests"], "epochs": setup["epochs"],
            "n_train": local["plan"]["n_train"], "batches_per_epoch": local["plan"]["batches_per_epoch"],
            "num_cpus": base.num_cpus, "local_epoch_times": [h["epoch_time_s"] for h in local["history"]],
            "local_epoch_times_after": [h["epoch_time_s"] for h in local_after["history"]],
            "rows": rows, "startup": startup, "loadavg_before_flower": load_before, "loadavg_after_flower": load_after}


# -- start-up: a fresh `fl-split train --engine flower` vs a fresh local run (issue 18) --------------------
STARTUP_ORDER = ("imports", "ray_start", "simulation_start", "node_registration", "actors_ready", "setup", "checks",
                 "training", "reports", "shutdown")


def _process_age() -> float:
    """Seconds since this process started (its start time in /proc, 10 ms ticks)."""
    with open(f"/proc/{os.getpid()}/stat") as fh:
        start = int(fh.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start


class TreeCPU(threading.Thread):
    """CPU seconds (user + system) used by this process and every descendant (Ray's daemons, the
    ClientApp actors), sampled every 0.2 s and kept per process at its last reading: a measure of
    the work a run does that the machine's load hardly changes (wall times on the shared 2-core
    machine vary twofold with it). A process that ends between samples loses < 0.2 s."""

    def __init__(self, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.period, self.seen, self.halt = period, {}, threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def sample(self) -> None:
        from fl_split.flower.processes import descendants

        for pid in [os.getpid(), *descendants(os.getpid())]:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
                self.seen[pid] = (int(f[11]) + int(f[12])) / self.tick
            except (OSError, ValueError, IndexError):
                pass

    def run(self) -> None:
        while not self.halt.wait(self.period):
            self.sample()

    def total(self) -> float:
        self.halt.set()
        self.sample()
        return sum(self.seen.values())


def startup_child(guests: int, engine: str, epochs: int) -> dict:
    """One run in this fresh process, as the CLI runs it (``--num-cpus auto``, one torch thread per
    party): the process's wall time from its start, the training time of the results, and for
    Flower the engine's timeline (:meth:`FlowerEngine.startup`)."""
    import torch

    torch.set_num_threads(1)
    from fl_split.config import RunConfig

    cfg = RunConfig(dataset="digits", guests=guests, epochs=epochs, progress=False, seed=0, engine=engine, device="cpu")
    load = os.getloadavg()
    cpu = TreeCPU()
    cpu.start()
    if engine == "flower":
        from fl_split.flower import FlowerEngine

        runner = FlowerEngine(cfg, private_seed=_ps())
        res = runner.run()
        timeline = runner.startup()
    else:
        from fl_split.engine import LocalEngine

        res, timeline = LocalEngine(cfg, _ps()).run(), {}
    wall = _process_age()
    return {"engine": engine, "guests": guests, "epochs": epochs, "process_wall_s": wall, "training_s": res["time_s"],
            "cpu_s": cpu.total(),
            "startup_s": wall - res["time_s"], "epoch_times": [h["epoch_time_s"] for h in res["history"]],
            "timeline": timeline, "loadavg_before": load, "loadavg_after": os.getloadavg(),
            "final_loss": res["history"][-1]["train_loss"]}


def bench_startup(guests_list: list[int], repeats: int = 3, epochs: int = 2) -> dict:
    """Each repeat: a fresh process runs the Flower engine, another the local engine (the order
    alternates); medians over the repeats. Start-up = the Flower process's wall time − its training
    time; the ratio = Flower's total training time (``time_s``: every epoch, the first one's
    connections included) ÷ the local engine's."""
    import subprocess

    rows = []
    for g in guests_list:
        runs: dict[str, list[dict]] = {"flower": [], "local": []}
        for r in range(repeats):
            for engine in (("flower", "local") if r % 2 == 0 else ("local", "flower")):
                out = subprocess.run([sys.executable, __file__, "--startup-child", str(g), engine, str(epochs)],
                                     capture_output=True, text=True, timeout=1200)
                if out.returncode != 0:
                    raise RuntimeError(f"startup child (G = {g}, {engine}) failed:\n{out.stderr[-3000:]}")
                runs[engine].append(json.loads(out.stdout.strip().splitlines()[-1]))
                d = runs[engine][-1]
                print(f"[startup] G = {g}, {engine} #{r + 1}: wall {d['process_wall_s']:.1f} s, training "
                      f"{d['training_s']:.2f} s, load {d['loadavg_before'][0]:.1f}", flush=True)
        fl, lo = runs["flower"], runs["local"]
        med = statistics.median
        row = {"guests": g, "epochs": epochs, "repeats": repeats,
               "flower_startup_s": med([d["startup_s"] for d in fl]),
               "flower_wall_s": med([d["process_wall_s"] for d in fl]),
               "flower_training_s": med([d["training_s"] for d in fl]),
               "local_training_s": med([d["training_s"] for d in lo]),
               "local_wall_s": med([d["process_wall_s"] for d in lo]),
               "flower_cpu_s": med([d["cpu_s"] for d in fl]), "local_cpu_s": med([d["cpu_s"] for d in lo]),
               "timeline": {k: med([d["timeline"].get(k, float("nan")) for d in fl]) for k in STARTUP_ORDER},
               "loadavg": med([d["loadavg_before"][0] for d in fl + lo]),
               "same_final_loss": len({d["final_loss"] for d in fl + lo}) == 1, "runs": runs}
        row["training_ratio"] = row["flower_training_s"] / row["local_training_s"]
        rows.append(row)
        print(f"[startup] G = {g}: start-up {row['flower_startup_s']:.1f} s (wall {row['flower_wall_s']:.1f} s), "
              f"training Flower {row['flower_training_s']:.2f} s / local {row['local_training_s']:.2f} s = "
              f"{row['training_ratio']:.2f}x; CPU Flower {row['flower_cpu_s']:.1f} s, local {row['local_cpu_s']:.1f} s "
              f"(median of {repeats}; load {row['loadavg']:.1f})", flush=True)
    return {"dataset": "digits", "rows": rows, "goal_startup_s": 8.0, "goal_training_ratio": 1.5}


# -- wire: randomized response vs float32 ---------------------------------------------------------------
def bench_wire() -> dict:
    import torch

    from fl_split.config import RunConfig
    from fl_split.engine import LocalEngine
    from fl_split.protocol import Message, encode
    from fl_split.schedule import BatchKey

    base = RunConfig(dataset="digits", guests=2, epochs=1, progress=False, seed=0, device="cpu")
    plain = LocalEngine(base, _ps()).run()
    rr = LocalEngine(base.replace(defense="rr"), _ps()).run()
    width = plain["plan"]["cut_shapes"]["guest-1"][0]
    key = BatchKey("train", 1, 0)
    one = {enc: len(encode(Message("activations", "guest-1", "host", 1, key, 0, torch.ones(32, width), enc)))
           for enc in ("float32", "bits")}
    row = {"dataset": "digits", "guests": 2, "cut_width": width, "bytes_to_host_float32": plain["wire"]["bytes_to_host"],
           "bytes_to_host_rr": rr["wire"]["bytes_to_host"], "messages_to_host": rr["wire"]["messages_to_host"],
           "run_ratio": rr["wire"]["bytes_to_host"] / plain["wire"]["bytes_to_host"],
           "batch_message_bytes": one, "batch_message_ratio": one["bits"] / one["float32"], "goal": 1 / 30}
    print(f"[wire] RR / float32 bytes guest -> host: run {row['run_ratio']:.4f} (1/{1 / row['run_ratio']:.1f}), "
          f"one 32 x {width} message {one['bits']} / {one['float32']} B = 1/{one['float32'] / one['bits']:.1f}", flush=True)
    return row


# -- scaling with G ----------------------------------------------------------------------------------------
class PeakMemory:
    """Samples the resident memory of this process and all its descendants (Ray's daemons and
    actors, which a local Ray instance starts under it)."""

    def __init__(self, period: float = 0.2) -> None:
        self.period = period
        self.peak = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def _run(self) -> None:
        from fl_split.flower.processes import descendants

        while not self._stop.is_set():
            pids = [os.getpid(), *descendants(os.getpid())]
            total = sum(self._rss(p) for p in pids)
            if total > self.peak:
                self.peak, self.peak_processes = total, len(pids)
            self._stop.wait(self.period)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def bench_scaling(guests_list: list[int], epochs: int = 3, out: Path | None = None) -> dict:
    from fl_split.config import RunConfig
    from fl_split.engine import LocalEngine
    from fl_split.flower import FlowerEngine
    from fl_split.flower.resources import flower_worker_threads

    rows = []
    for g in guests_list:
        # Flower's simulation runtime runs at most min(32, cpus + 4) ClientApps at once (6 on 2 cores);
        # the engine widens that pool itself (fl_split.flower.resources.widened_worker_pool), said per row
        widened = g + 1 > flower_worker_threads()
        # G + 1 actors importing torch on a few shared cores take minutes to reach the data plane:
        # a generous --dataplane-timeout (the default 60 s failed at G = 8 on the loaded 2-core machine)
        cfg = RunConfig(dataset="breast-cancer", guests=g, epochs=epochs, progress=False, seed=0, engine="flower",
                        device="cpu", num_cpus=_cpus_each(g + 1), dataplane_timeout=DATAPLANE_TIMEOUT,
                        node_timeout=DATAPLANE_TIMEOUT)
        print(f"[scaling] breast-cancer, G = {g}: {g + 1} ClientApps, --num-cpus {cfg.num_cpus}", flush=True)
        engine = FlowerEngine(cfg, private_seed=_ps())
        t0 = time.perf_counter()
        try:
            with PeakMemory() as mem:
                res = engine.run()
        except Exception as exc:  # noqa: BLE001 - record it and go on with the next G
            rows.append({"guests": g, "num_cpus": cfg.num_cpus, "error": f"{type(exc).__name__}: {exc}",
                         "wall_s": time.perf_counter() - t0, "loadavg": os.getloadavg(),
                         "flower_thread_pool_widened": widened})
            print(f"[scaling] G = {g}: failed: {rows[-1]['error']}", flush=True)
            continue
        wall = time.perf_counter() - t0
        local = LocalEngine(cfg.replace(engine="local"), _ps()).run()
        row = {"guests": g, "num_cpus": cfg.num_cpus, "flower_epoch_s": _steady([h["epoch_time_s"] for h in res["history"]]),
               "local_epoch_s": _steady([h["epoch_time_s"] for h in local["history"]]),
               "peak_rss_mb": mem.peak / 2 ** 20, "peak_processes": mem.peak_processes, "wall_s": wall,
               "startup": engine.startup(), "flower_equals_local": _same_training(res, local),
               "bytes_per_epoch": (res["wire"]["bytes_to_host"] + res["wire"]["bytes_to_guests"]) / epochs,
               "loadavg": os.getloadavg(), "flower_thread_pool_widened": widened}
        rows.append(row)
        print(f"[scaling] G = {g}: {row['flower_epoch_s']:.3f} s/epoch (local {row['local_epoch_s']:.3f} s), peak "
              f"{row['peak_rss_mb']:.0f} MB over {row['peak_processes']} processes, wall {wall:.0f} s", flush=True)
        if out is not None:  # what is done so far, in case a later G fails badly
            out.write_text(json.dumps({"dataset": "breast-cancer", "epochs": epochs, "rows": rows}, indent=2) + "\n")
    return {"dataset": "breast-cancer", "epochs": epochs, "rows": rows,
            "flower_worker_threads": flower_worker_threads()}


def plot_scaling(scaling: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in scaling["rows"] if "error" not in r]
    g = [r["guests"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(g, [r["flower_epoch_s"] for r in rows], "o-", label="Flower, direct data plane")
    a.plot(g, [r["local_epoch_s"] for r in rows], "s--", label="local engine")
    a.set_xscale("log", base=2)
    a.set_xticks(g, [str(x) for x in g])
    a.set_xlabel("guests G")
    a.set_ylabel("seconds per epoch")
    a.set_title(f"{scaling['dataset']}: time per epoch")
    a.legend()
    b.plot(g, [r["peak_rss_mb"] / 1024 for r in rows], "o-")
    b.set_xscale("log", base=2)
    b.set_xticks(g, [str(x) for x in g])
    b.set_xlabel("guests G")
    b.set_ylabel("peak resident memory (GiB)")
    b.set_title("driver + Ray + G+1 ClientApps")
    fig.suptitle(f"{os.cpu_count()} CPU cores; every party reserves 2/(G+1) of them")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- quick: in-process direct run (threads, loopback gRPC, no Ray) ----------------------------------------
def bench_inline(epochs: int = 3) -> dict:
    """Host and guests as threads of this process over the real data plane (the inline grid of the
    tests): the data plane's cost without Ray or the simulation runtime."""
    from flwr.supercore.task_identity import TaskIdentity

    from fl_split.config import RunConfig
    from fl_split.engine import LocalEngine
    from fl_split.flower.strategy import VerticalSplitStrategy
    from tests.test_flower import InlineGrid, _simulation_nodes

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 11, 7, 1
    cfg = RunConfig(dataset="digits", guests=2, epochs=epochs, progress=False, seed=0, device="cpu")
    got = VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3)))
    local = LocalEngine(cfg, _ps()).run()
    f_ep, l_ep = _steady([h["epoch_time_s"] for h in got["history"]]), _steady([h["epoch_time_s"] for h in local["history"]])
    print(f"[inline] digits, 2 guests, threads of one process: {f_ep:.3f} s vs local {l_ep:.3f} s per epoch "
          f"({f_ep / l_ep:.2f}x)", flush=True)
    return {"dataset": "digits", "guests": 2, "flower_epoch_s": f_ep, "local_epoch_s": l_ep, "ratio": f_ep / l_ep}


# -- the relay's K sweep (issue 3; numbers in docs/flower.md, "Relay mode") ---------------------------------
def relay_sweep(out: Path, ks=(1, 4, 16, 64, "epoch")) -> dict:
    from fl_split.config import RunConfig
    from fl_split.engine import LocalEngine
    from fl_split.flower import FlowerEngine

    report = {"versions": _versions(), "datasets": []}
    for name, setup in SETUPS.items():
        base = RunConfig(dataset=name, guests=setup["guests"], epochs=2, progress=False, seed=0, engine="flower",
                         device="cpu", data_plane="flower", num_cpus=_cpus_each(setup["guests"] + 1))
        cfgs = [base.replace(batches_per_round=k) for k in ks]
        flower = FlowerEngine(base, private_seed=_ps()).run_series(cfgs)
        rows = []
        for k, c, f in zip(ks, cfgs, flower):
            loc = LocalEngine(c.replace(engine="local"), _ps()).run()
            f_ep, l_ep = _steady([h["epoch_time_s"] for h in f["history"]]), _steady([h["epoch_time_s"] for h in loc["history"]])
            rows.append({"K": k, "flower_epoch_s": f_ep, "local_epoch_s": l_ep, "ratio": f_ep / l_ep,
                         "flower_equals_local": _same_training(f, loc)})
            print(f"[relay] {name} K = {k}: {f_ep:.2f} s vs {l_ep:.2f} s ({f_ep / l_ep:.1f}x)", flush=True)
        report["datasets"].append({"dataset": name, "rows": rows})
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _yes(v) -> str:
    return "—" if v is None else ("yes" if v else "NO")


# -- report -----------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    lines = []
    if "latency" in report:
        lines += ["**Data-plane latency** (one exchange: STEP to every guest, every RELEASE back; median over "
                  f"{report['latency']['rounds']} rounds, guests in their own processes, loopback)", "",
                  "| payload each way | guests | gRPC (ms) | gRPC + TLS (ms) | gloo (ms) |", "|---|---:|---:|---:|---:|"]
        for r in report["latency"]["rows"]:
            lines.append(f"| {r['payload']} | {r['guests']} | {r['median_ms']:.2f} | "
                         f"{r.get('tls_median_ms', float('nan')):.2f} | {r.get('gloo_median_ms', float('nan')):.2f} |")
        lines.append("")
    if report.get("ratio"):
        lines += ["**Exact training (K = 1): Flower (direct data plane) ÷ local engine, per epoch**", "",
                  "| dataset | guests | batches/epoch | epochs/message | Flower (s) | local (s) | ratio | Flower ≡ local |",
                  "|---|---:|---:|---:|---:|---:|---:|:---:|"]
        for d in report["ratio"]:
            for r in d["rows"]:
                lines.append(f"| {d['dataset']} | {d['guests']} | {d['batches_per_epoch']} | {r['epochs_per_message']} "
                             f"| {r['flower_epoch_s']:.3f} | {r['local_epoch_s']:.3f} | {r['ratio']:.2f}× "
                             f"| {'yes' if r['flower_equals_local'] else 'NO'} |")
        lines.append("")
    if report.get("startup"):
        lines += ["**Start-up and total training time** (digits, fresh processes, `--num-cpus auto`; medians; "
                  "start-up = process wall − training; CPU = CPU seconds of the Flower process and all its descendants)", "",
                  "| G | epochs | start-up (s) | wall (s) | CPU (s) | Flower training (s) | local training (s) | Flower ÷ local | "
                  + " | ".join(STARTUP_ORDER) + " | load |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(STARTUP_ORDER) + "---:|"]
        for r in report["startup"]["rows"]:
            lines.append(f"| {r['guests']} | {r['epochs']} | {r['flower_startup_s']:.1f} | {r['flower_wall_s']:.1f} "
                         f"| {r.get('flower_cpu_s', float('nan')):.1f} "
                         f"| {r['flower_training_s']:.2f} | {r['local_training_s']:.2f} | {r['training_ratio']:.2f}× | "
                         + " | ".join(f"{r['timeline'][k]:.1f}" for k in STARTUP_ORDER) + f" | {r['loadavg']:.1f} |")
        lines.append("")
    if report.get("ratio"):
        lines += ["**Start-up** (`fl-split train --engine flower`, seconds)", "",
                  "| dataset | imports + checks | Ray start | simulation start | node registration | actors ready "
                  "(role query) | setup | before first batch | training | reports | shutdown |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for d in report["ratio"]:
            s = d["startup"]
            lines.append(f"| {d['dataset']} | " + " | ".join(f"{s.get(k, float('nan')):.1f}" for k in (
                "imports", "ray_start", "simulation_start", "node_registration", "actors_ready", "setup",
                "before_first_batch", "training", "reports", "shutdown")) + " |")
        lines.append("")
    if "scaling" in report:
        lines += [f"**Scaling with the number of guests** ({report['scaling']['dataset']}, "
                  f"{report['scaling']['epochs']} epochs)", "",
                  "| G | --num-cpus | Flower s/epoch | local s/epoch | peak RSS (MiB) | processes | wall (s) | Flower ≡ local |",
                  "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in report["scaling"]["rows"]:
            if "error" in r:
                lines.append(f"| {r['guests']} | {r['num_cpus']:g} | failed: {r['error'][:120]} | | | | {r['wall_s']:.0f} | |")
                continue
            lines.append(f"| {r['guests']} | {r['num_cpus']:g} | {r['flower_epoch_s']:.3f} | {r['local_epoch_s']:.3f} "
                         f"| {r['peak_rss_mb']:.0f} | {r['peak_processes']} | {r['wall_s']:.0f} "
                         f"| {_yes(r.get('flower_equals_local'))} |")
        lines.append("")
    if "wire" in report:
        w = report["wire"]
        lines += [f"**Wire, randomized response vs float32** (digits, 2 guests, cut width {w['cut_width']}, 1 epoch): "
                  f"{w['bytes_to_host_rr']:,} vs {w['bytes_to_host_float32']:,} bytes guest → host over "
                  f"{w['messages_to_host']} messages = 1/{1 / w['run_ratio']:.1f}; one full batch (32 samples) "
                  f"{w['batch_message_bytes']['bits']} vs {w['batch_message_bytes']['float32']} bytes = "
                  f"1/{1 / w['batch_message_ratio']:.1f} (goal ≤ 1/30).", ""]
    if "inline" in report:
        r = report["inline"]
        lines.append(f"In-process direct run (threads, loopback gRPC, no Ray): digits, 2 guests, {r['flower_epoch_s']:.3f} s "
                     f"vs {r['local_epoch_s']:.3f} s per epoch ({r['ratio']:.2f}×).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="latency + an in-process direct run, under a minute")
    p.add_argument("--only", nargs="+", choices=("latency", "ratio", "startup", "scaling", "wire"),
                   help="run only these parts")
    p.add_argument("--guests", nargs="+", type=int, default=[1, 2, 4, 8, 16], help="G values of the scaling part")
    p.add_argument("--compare-gloo", action="store_true", help="also time torch.distributed gloo send/recv")
    p.add_argument("--relay-sweep", action="store_true", help="the relay's batches-per-round sweep instead")
    p.add_argument("--startup-guests", nargs="+", type=int, default=[2, 4], help="G values of the startup part")
    p.add_argument("--repeats", type=int, default=3, help="fresh-process repeats of the startup part")
    p.add_argument("--startup-child", nargs=3, metavar=("G", "ENGINE", "EPOCHS"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    if ns.startup_child:
        g, engine, epochs = ns.startup_child
        print(json.dumps(startup_child(int(g), engine, int(epochs))))
        return 0
    import torch

    torch.set_num_threads(1)  # Ray gives each ClientApp actor one thread: compare like with like
    os.environ.setdefault("FL_SPLIT_NO_DOWNLOAD", "1")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if ns.relay_sweep:
        relay_sweep(Path(ns.out or RESULTS / "bench_flower_relay_sweep.json"))
        return 0
    parts = set(ns.only or ("latency", "ratio", "startup", "scaling", "wire"))
    report: dict = {"versions": _versions(), "ratio_goal": RATIO_GOAL}
    t0 = time.perf_counter()
    if ns.quick:
        report["latency"] = bench_latency(ns.compare_gloo, rounds=200, quick=True)
        report["inline"] = bench_inline()
        out = Path(ns.out or RESULTS / "bench_flower_quick.json")
    else:
        if "latency" in parts:
            report["latency"] = bench_latency(ns.compare_gloo, rounds=400)
        if "ratio" in parts:
            report["ratio"] = [bench_ratio(name, setup) for name, setup in SETUPS.items()]
        if "startup" in parts:
            report["startup"] = bench_startup(ns.startup_guests, ns.repeats)
        if "wire" in parts:
            report["wire"] = bench_wire()
        if "scaling" in parts:
            partial = Path(str(ns.out or RESULTS / "bench_flower.json") + ".partial")
            report["scaling"] = bench_scaling(ns.guests, out=partial)
            partial.unlink(missing_ok=True)
            plot_scaling(report["scaling"], RESULTS / "bench_flower_scaling.png")
        out = Path(ns.out or RESULTS / "bench_flower.json")
    report["versions"]["loadavg_end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nwritten to {out} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
