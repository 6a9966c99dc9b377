"""Milliseconds per split-learning step under emulated network links (issue 25, "Numbers under real
network conditions").

**What runs.** The direct data plane of a deployment, driven by the real engine, one party per
process: the host's process calls :func:`fl_split.flower.direct.host_epochs` (its gRPC stream server,
:class:`~fl_split.dataplane.host.HostEndpoint`, mutual TLS with the certificates of ``fl-split certs``,
and the shared round loop :func:`fl_split.engine.coordinate` over
:class:`~fl_split.dataplane.host.HostDataPlane`), each guest's process
:func:`fl_split.flower.direct.guest_epochs` (its gRPC client, :func:`fl_split.dataplane.guest.serve`)
— the very functions a deployment's ClientApp (or warm party) runs for a ``train.epoch`` message —
with parties built as a deployment node builds them (:func:`fl_split.flower.node.build_party` from
``fl-split export-parties`` files, role ``deployment``), kept warm across epochs, a new session
(connection, TLS and the data plane's own handshake) per epoch as with ``--epochs-per-message 1``.
What is left out is Flower's control plane (SuperLink, SuperNodes, one control message per party
per epoch): this script plays the coordinator, handing each epoch's request (session, address,
public keys) to the parties over pipes. Why: the control plane's cost is per epoch, not per step,
and is measured on its own in ``experiments/bench_deploy.py`` / docs/deploy.md; a full ``deploy
local`` per cell in namespaces would cost minutes per cell on this 2-core machine, and its
per-message polls would blur the per-step times this benchmark is for.

**The links.** Each guest runs in its own network namespace (``ip netns``), joined to the host's
namespace by a veth pair; ``tc … tbf`` limits the rate on both ends of the pair (each guest's own
link, both directions; the host's end of each link is the host's; the host is not limited in
total). ``tc netem`` is unavailable here (no kernel module), so the round-trip time comes from a
userspace relay (:mod:`experiments.netrelay`) in the host's namespace, between the veth and the
host's data-plane port: it holds every chunk RTT/2 in each direction, in order. Its own cost is
measured as the ``relay 0 ms`` link against ``veth`` (no relay) and stated with the results. Each
link is checked before use (the guest's process measures a 64-byte echo's round trip and a 1 MB
transfer each way through the same relay and qdiscs).

**What is recorded** per (link, ``--batches-per-round`` K, defence): for each epoch the host's wall
time of the whole session (connect + handshakes + the epoch's rounds + the close), the time until
every guest was connected, each round's time split into the guest step as the host sees it (STEP
out, every RELEASE back: network + guest compute) and the host's own compute, each guest's compute
per round (measured in the guest), the wire bytes (sealed frames) and the test metric. ``ms per
training step`` = the training rounds' time / the training batches (a round carries K batches).
Medians over epochs 2.. (epoch 1 of a cell is a fresh model's first pass).

    sudo python experiments/bench_network.py --epochs 4           # the grid: 4-5 min on the shared 2-core machine
    sudo python experiments/bench_network.py --rtts 10 --rates 10mbit --ks 1 --defenses none rr --epochs 2 --tag smoke
    python experiments/bench_network.py --table RUN.json [RUN2.json ...] [--plot PNG]   # tables of saved passes

Needs root, ``ip`` and ``tc`` (refused in one line otherwise); uses the addresses 10.213.0.0/16, the
namespaces ``flsb-g*`` and ports 29300-29302 (removed again at the end). Writes
``experiments/results/bench_network[_TAG].json``, ``.csv`` and ``.png``. Results and what they show:
experiments/README.md, "The data plane under emulated network links".
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import queue
import secrets
import shutil
import socketserver
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SERVICE_IP = "10.213.0.1"          # the host's data-plane address, on its loopback; guests route to it over their veth
HOST_PORT, RELAY_PORT, PROBE_PORT = 29300, 29301, 29302
RATES = {"1gbit": 10**9, "100mbit": 10**8, "10mbit": 10**7}


def _ns(i: int) -> str:
    return f"flsb-g{i}"


# ================================================================================================
# a party's process
# ================================================================================================
def _emit(stream, obj) -> None:
    stream.write(json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v)) + "\n")
    stream.flush()


def worker(party: str, workdir: Path) -> None:
    """One party: reads JSON commands from stdin, answers on the original stdout (anything else the
    party prints goes to stderr)."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import torch
    from flwr.app import RecordDict

    from fl_split.config import RunConfig
    from fl_split.flower import direct
    from fl_split.flower import records as R
    from fl_split.flower.node import NodeRole, build_party, plan_of

    from fl_split.privacy import guard

    torch.set_num_threads(1)
    is_host = party == "host"
    violation = guard.TrainTestGuard.violation
    certs = workdir / "certs"
    role = NodeRole(party, "host" if is_host else "guest", 0 if is_host else int(party.split("-")[1]),
                    "deployment", str(workdir / "parties" / f"{party}.npz"))
    if is_host:
        node_config = {"role": "host", "data-path": role.data_path,
                       "dataplane-address": f"{SERVICE_IP}:{HOST_PORT}", "dataplane-bind": f"0.0.0.0:{HOST_PORT}",
                       "dataplane-certfile": str(certs / "dataplane-host.crt"),
                       "dataplane-keyfile": str(certs / "dataplane-host.key"),
                       "dataplane-client-ca": str(certs / "ca.crt")}
        timing = _instrument_host(lambda: _emit(proto, {"event": "listening"}))
    else:
        node_config = {"role": "guest", "guest-index": role.guest_index, "data-path": role.data_path,
                       "dataplane-ca": str(certs / "ca.crt"), "dataplane-certfile": str(certs / f"{party}.crt"),
                       "dataplane-keyfile": str(certs / f"{party}.key")}
    built = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "quit":
                return
            if msg["cmd"] == "build":
                if is_host:  # see --guard-off
                    guard.TrainTestGuard.violation = violation if msg.get("guard", True) else _no_violation
                cfg = RunConfig.from_mapping(msg["cfg"])
                p, _ = build_party(cfg, role)
                state = RecordDict()
                built = (cfg, p, state, direct.new_identity(state))
                _emit(proto, {"public": built[3]})
            elif msg["cmd"] == "probe":
                from experiments.netrelay import probe

                _emit(proto, {"probe": probe(msg["address"])})
            elif msg["cmd"] == "epoch":
                cfg, p, state, _ = built
                req = R.content(**msg["req"]).config_records[R.REQUEST]
                if is_host:
                    timing.clear()
                    t = time.perf_counter()
                    outcome = direct.host_epochs(p, cfg, plan_of(cfg, role), req, role, node_config, state)
                    wall = time.perf_counter() - t
                    _emit(proto, {"outcome": outcome, "wall_s": wall, "timing": dict(timing)})
                else:
                    compute: list[float] = []
                    step = p.step

                    def timed(owed, keys, r, _step=step):
                        t = time.perf_counter()
                        out = _step(owed, keys, r)
                        compute.append(time.perf_counter() - t)
                        return out

                    p.step = timed
                    try:
                        served = direct.guest_epochs(p, cfg, req, role, node_config, state)
                    finally:
                        p.step = step
                    _emit(proto, {"served": served, "compute_s": compute})
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which records the cell as failed
            _emit(proto, {"error": f"{party}: {type(exc).__name__}: {exc}"})


def _no_violation(self, guest, tensors, noisy=False):
    return None


def _instrument_host(on_listen) -> dict:
    """Time the host's data plane without changing it: subclasses of the endpoint and transport that
    record timestamps, installed where :func:`fl_split.flower.direct.host_epochs` looks them up."""
    import fl_split.dataplane.host as H

    timing: dict = {}

    class Endpoint(H.HostEndpoint):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            timing["listen"] = time.perf_counter()
            on_listen()

        def wait_for_guests(self):
            super().wait_for_guests()
            timing["connect_s"] = time.perf_counter() - timing["listen"]

        def close(self, reason="done", grace=5.0):
            t = time.perf_counter()
            super().close(reason, grace)
            timing["close_s"] = time.perf_counter() - t

    class Plane(H.HostDataPlane):
        def guest_step(self, owed, keys, round_):
            t = time.perf_counter()
            out = super().guest_step(owed, keys, round_)
            self._step_s = time.perf_counter() - t
            return out

        def _record(self, phase, keys, fn, *a):
            t = time.perf_counter()
            out = fn(*a)
            timing.setdefault("rounds", []).append(
                {"phase": phase, "batches": len(keys), "guest_step_s": self._step_s,
                 "host_s": time.perf_counter() - t})
            return out

        def host_train(self, keys, acts, round_):
            return self._record("train", keys, super().host_train, keys, acts, round_)

        def host_evaluate(self, keys, acts, round_):
            return self._record("test", keys, super().host_evaluate, keys, acts, round_)

    H.HostEndpoint, H.HostDataPlane = Endpoint, Plane
    return timing


# ================================================================================================
# the emulated network (root)
# ================================================================================================
def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def teardown_net(guests: int) -> None:
    for i in range(1, guests + 1):
        _sh("ip", "netns", "del", _ns(i), check=False)   # takes its veth pair with it
        _sh("ip", "link", "del", f"flsb{i}h", check=False)
    _sh("ip", "addr", "del", f"{SERVICE_IP}/32", "dev", "lo", check=False)


def setup_net(guests: int) -> None:
    teardown_net(guests)
    _sh("ip", "addr", "add", f"{SERVICE_IP}/32", "dev", "lo")
    for i in range(1, guests + 1):
        ns, h, g = _ns(i), f"flsb{i}h", f"flsb{i}g"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", h, "type", "veth", "peer", "name", g)
        _sh("ip", "link", "set", g, "netns", ns)
        _sh("ip", "addr", "add", f"10.213.{i}.1/24", "dev", h)
        _sh("ip", "link", "set", h, "up")
        _sh("ip", "-n", ns, "addr", "add", f"10.213.{i}.2/24", "dev", g)
        _sh("ip", "-n", ns, "link", "set", g, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "route", "add", "default", "via", f"10.213.{i}.1")


def set_rate(guests: int, bps: int | None) -> list[str]:
    """tbf at ``bps`` on both ends of every guest's veth (None: no qdisc); returns the qdisc lines."""
    shown = []
    for i in range(1, guests + 1):
        for pre, dev in (([], f"flsb{i}h"), (["ip", "netns", "exec", _ns(i)], f"flsb{i}g")):
            _sh(*pre, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if bps is not None:
                # bucket: 1 ms of traffic, at least two full-size packets; queue up to 400 ms (no drops)
                burst = max(bps // 8 // 1000, 3000)
                _sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bps}bit", "burst", str(burst),
                    "latency", "400ms")
            shown.append(_sh(*pre, "tc", "qdisc", "show", "dev", dev).stdout.strip())
    return shown


# ================================================================================================
# the driver (root): the coordinator's part, the links, the grid
# ================================================================================================
class Party:
    """A party's process (a guest's inside its namespace) and its JSON line protocol."""

    def __init__(self, name: str, workdir: Path, netns: str | None) -> None:
        self.name = name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--workdir", str(workdir)]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log = open(workdir / f"{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=str(ROOT))
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put({"error": f"{self.name}: its process ended (exit code {self.proc.wait()}; see its log)"})

    def send(self, **msg) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def get(self, timeout: float = 600.0) -> dict:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no answer within {timeout:g} s") from None
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def stop(self) -> None:
        try:
            self.send(cmd="quit")
            self.proc.wait(20)
        except Exception:  # noqa: BLE001 - then by its id
            self.proc.kill()
        self.log.close()


def _links(rtts, rates, baselines: bool) -> list[dict]:
    out = []
    if baselines:
        out += [{"link": "veth", "rtt_ms": 0.0, "rate": "unlimited", "relay": False},
                {"link": "relay 0 ms", "rtt_ms": 0.0, "rate": "unlimited", "relay": True}]
    out += [{"link": f"{r:g} ms, {q}", "rtt_ms": float(r), "rate": q, "relay": True} for r in rtts for q in rates]
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _epoch_row(host: dict, guests: list[dict]) -> dict:
    """One epoch's numbers from the host's and the guests' answers."""
    timing, outcome = host["timing"], host["outcome"]
    rounds = timing.get("rounds", [])
    train = [r for r in rounds if r["phase"] == "train"]
    test = [r for r in rounds if r["phase"] == "test"]
    batches = sum(r["batches"] for r in train)
    train_s = sum(r["guest_step_s"] + r["host_s"] for r in train)
    hist = outcome["history"][-1]
    compute = [c for g in guests for c in g["compute_s"]]
    return {"epoch": hist["epoch"], "epoch_s": host["wall_s"], "connect_s": timing.get("connect_s"),
            "close_s": timing.get("close_s"), "train_rounds": len(train), "train_batches": batches,
            "train_s": train_s, "test_s": sum(r["guest_step_s"] + r["host_s"] for r in test),
            "step_ms": 1e3 * train_s / max(batches, 1),
            "round_ms": 1e3 * _median([r["guest_step_s"] + r["host_s"] for r in train]),
            "guest_step_ms": 1e3 * _median([r["guest_step_s"] for r in train]),
            "host_compute_ms": 1e3 * _median([r["host_s"] for r in train]),
            "guest_compute_ms": 1e3 * (_median(compute) or 0.0),
            "bytes_to_host": outcome["wire"]["bytes_to_host"], "bytes_to_guests": outcome["wire"]["bytes_to_guests"],
            "train_loss": hist.get("train_loss"), "test_metric": hist.get("test_metric")}


SUMMARY = ("epoch_s", "connect_s", "close_s", "train_s", "test_s", "step_ms", "round_ms", "guest_step_ms",
           "host_compute_ms", "guest_compute_ms")


def run_cell(parties: dict[str, Party], base_cfg: dict, k: str, defense: str, epochs: int, address: str,
             guard: bool = True) -> dict:
    cfg = dict(base_cfg, batches_per_round=k, defense=defense, epochs=epochs)
    for p in parties.values():
        p.send(cmd="build", cfg=cfg, guard=guard)
    keys = {name: p.get()["public"] for name, p in parties.items()}
    rows = []
    for e in range(1, epochs + 1):
        req = {"first-epoch": e, "last-epoch": e, "session": secrets.token_hex(8),
               "dataplane": json.dumps({"address": address, "tls": True, "keys": keys})}
        parties["host"].send(cmd="epoch", req=req)
        parties["host"].get()  # listening: the guests get the request now (a deployment's arrive together)
        guests = [p for n, p in parties.items() if n != "host"]
        for g in guests:
            g.send(cmd="epoch", req=req)
        host = parties["host"].get()
        rows.append(_epoch_row(host, [g.get() for g in guests]))
    steady = rows[1:] or rows
    summary = {f: _median([r[f] for r in steady]) for f in SUMMARY}
    summary.update({f: steady[-1][f] for f in ("train_rounds", "train_batches", "bytes_to_host", "bytes_to_guests")})
    summary["test_metric_last"] = rows[-1]["test_metric"]
    return {"batches_per_round": k, "defense": defense, "guard": guard, "epochs": rows, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default="/tmp/fl_split_bench_network")
    ap.add_argument("--rtts", type=float, nargs="+", default=[1, 10, 50], help="round-trip times, ms")
    ap.add_argument("--rates", nargs="+", default=list(RATES), choices=list(RATES))
    ap.add_argument("--ks", nargs="+", default=["1", "8", "epoch"], help="--batches-per-round values")
    ap.add_argument("--defenses", nargs="+", default=["none", "rr"])
    ap.add_argument("--guard-off", nargs="*", default=[], metavar="K",
                    help="--batches-per-round values whose cells run without the host's train-vs-test poisoning "
                         "check (fl_split/privacy/guard.py). The committed results used '--guard-off epoch': the "
                         "check then stopped honest K = epoch runs in epoch 1, fixed since (experiments/README.md). "
                         "Every cell records 'guard' [default: none]")
    ap.add_argument("--no-baselines", action="store_true", help="skip the veth and relay-0-ms links")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--guests", type=int, default=2)
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--table", metavar="JSON", nargs="+",
                    help="print the markdown tables of saved results and exit (several: passes of the same grid, "
                         "the median of all their steady epochs)")
    ap.add_argument("--plot", metavar="PNG", help="with --table: also plot the pooled passes into PNG")
    args = ap.parse_args(argv)
    if args.table:
        outs = [json.loads(Path(t).read_text()) for t in args.table]
        print(tables(outs))
        if args.plot:
            plot(outs, Path(args.plot))
        return 0
    if args.worker:
        worker(args.worker, Path(args.workdir))
        return 0
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        print(f"bench_network: needs {' and '.join(missing)} (iproute2) on PATH; not found", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench_network: needs root (it creates network namespaces, veth pairs and tc qdiscs); run it as root",
              file=sys.stderr)
        return 2
    from experiments.netrelay import PROBE_BYTES, DelayRelay, ProbeHandler

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(mode=0o700, parents=True)
    cli = [sys.executable, "-m", "fl_split.cli"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    names = ["host"] + [f"guest-{i}" for i in range(1, args.guests + 1)]
    data = ["--dataset", args.dataset, "--guests", str(args.guests)] + (["--limit", str(args.limit)] if args.limit else [])
    subprocess.run(cli + ["export-parties", *data, "--out", str(work / "parties")], check=True, env=env,
                   capture_output=True)
    subprocess.run(cli + ["certs", "--out", str(work / "certs"), "--hosts", SERVICE_IP, "--clients", *names[1:]],
                   check=True, env=env, capture_output=True)
    base_cfg = {"dataset": args.dataset, "guests": args.guests, "limit": args.limit, "engine": "flower",
                "data_plane": "direct", "progress": False, "dataplane_timeout": 120.0}
    links = _links(args.rtts, args.rates, not args.no_baselines)
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "setup": {"dataset": args.dataset, "guests": args.guests, "limit": args.limit, "epochs": args.epochs,
                     "service": f"{SERVICE_IP}", "probe_bytes": PROBE_BYTES}, "cells": []}
    relays, parties = [], {}
    t_start = time.time()
    setup_net(args.guests)
    try:
        relay = DelayRelay((SERVICE_IP, RELAY_PORT), ("127.0.0.1", HOST_PORT))
        socketserver.ThreadingTCPServer.allow_reuse_address = True
        echo = socketserver.ThreadingTCPServer(("127.0.0.1", 0), ProbeHandler)
        echo.daemon_threads = True
        threading.Thread(target=echo.serve_forever, daemon=True).start()
        probe_relay = DelayRelay((SERVICE_IP, PROBE_PORT), echo.server_address)
        direct_probe = socketserver.ThreadingTCPServer((SERVICE_IP, 0), ProbeHandler)
        direct_probe.daemon_threads = True
        threading.Thread(target=direct_probe.serve_forever, daemon=True).start()
        for r in (relay, probe_relay):
            r.start()
            relays.append(r)
        parties = {n: Party(n, work, None if n == "host" else _ns(int(n.split("-")[1]))) for n in names}
        for link in links:
            qdiscs = set_rate(args.guests, RATES.get(link["rate"]))
            for r in relays:
                r.set_delay(link["rtt_ms"] / 2000.0)
            probe_addr = f"{SERVICE_IP}:{PROBE_PORT}" if link["relay"] else f"{SERVICE_IP}:{direct_probe.server_address[1]}"
            parties["guest-1"].send(cmd="probe", address=probe_addr)
            check = parties["guest-1"].get()["probe"]
            print(f"link {link['link']}: probe rtt {check['rtt_ms']:.2f} ms, up {check['up_mbit_s']:.1f} Mbit/s, "
                  f"down {check['down_mbit_s']:.1f} Mbit/s", flush=True)
            address = f"{SERVICE_IP}:{RELAY_PORT if link['relay'] else HOST_PORT}"
            for k in args.ks:
                for d in args.defenses:
                    load = os.getloadavg()[0]
                    t = time.time()
                    try:
                        cell = run_cell(parties, base_cfg, k, d, args.epochs, address, k not in args.guard_off)
                    except RuntimeError as exc:
                        cell = {"batches_per_round": k, "defense": d, "guard": k not in args.guard_off,
                                "error": str(exc)}
                    cell.update(link=link["link"], rtt_ms=link["rtt_ms"], rate=link["rate"], relay=link["relay"],
                                probe=check, qdiscs=qdiscs, load_1min=load, wall_s=time.time() - t)
                    out["cells"].append(cell)
                    s = cell.get("summary")
                    print(f"  K={k:>5} {d:>4}: " + (f"{s['step_ms']:7.2f} ms/step, {s['round_ms']:7.2f} ms/round, "
                                                    f"epoch {s['epoch_s']:6.2f} s (connect {s['connect_s']:.2f} s), "
                                                    f"test {s['test_metric_last']:.3f}  [load {load:.1f}]"
                                                    if s else f"FAILED: {cell['error']}"), flush=True)
                    if "error" in cell:  # a party may be mid-session: start the parties again
                        for p in parties.values():
                            p.proc.kill()
                        parties = {n: Party(n, work, None if n == "host" else _ns(int(n.split("-")[1]))) for n in names}
    finally:
        for p in parties.values():
            p.stop()
        for r in relays:
            r.close()
        teardown_net(args.guests)
    out["wall_s"] = time.time() - t_start
    out["relay_stats"] = {"data_plane": vars(relay.stats), "probe": vars(probe_relay.stats)}
    stem = "bench_network" + (f"_{args.tag}" if args.tag else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1))
    write_csv(out, RESULTS / f"{stem}.csv")
    plot([out], RESULTS / f"{stem}.png")
    print(tables([out]))
    print(f"wrote {RESULTS / stem}.json, .csv, .png ({out['wall_s']:.0f} s)")
    return 0


CSV_FIELDS = ("link", "rtt_ms", "rate", "batches_per_round", "defense", "guard", "step_ms", "round_ms", "guest_step_ms",
              "guest_compute_ms", "host_compute_ms", "epoch_s", "connect_s", "close_s", "train_s", "test_s",
              "train_rounds", "train_batches", "bytes_to_host", "bytes_to_guests", "test_metric_last",
              "probe_rtt_ms", "probe_up_mbit_s", "probe_down_mbit_s", "load_1min", "error")


def write_csv(out: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS)
        w.writeheader()
        for c in out["cells"]:
            row = {k: c.get(k) for k in CSV_FIELDS}
            row.update(c.get("summary", {}))
            row.update({f"probe_{k}": c["probe"][k] for k in ("rtt_ms", "up_mbit_s", "down_mbit_s")})
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items() if k in CSV_FIELDS})


def pooled(outs: list[dict]) -> dict[tuple, dict]:
    """``(link, K, defence) -> summary`` over the steady epochs (2..) of every run in ``outs`` (one
    run: its own summary; several passes of the grid: the median of all their steady epochs)."""
    rows: dict[tuple, list] = {}
    probes: dict[str, dict] = {}
    for out in outs:
        for c in out["cells"]:
            key = (c["link"], c["batches_per_round"], c["defense"])
            rows.setdefault(key, [])
            probes.setdefault(c["link"], c["probe"])
            if "epochs" in c:
                rows[key] += c["epochs"][1:] or c["epochs"]
    return {key: ({f: _median([r[f] for r in rs]) for f in SUMMARY} | {"n": len(rs), "probe": probes[key[0]]}
                  if rs else None) for key, rs in rows.items()}


def tables(outs: list[dict]) -> str:
    """Markdown: ms per training step, then seconds per epoch; a row per link, a column per (K, defence)."""
    pool = pooled(outs)
    variants = list(dict.fromkeys((k, d) for _, k, d in pool))
    links = list(dict.fromkeys(link for link, _, _ in pool))
    text = []
    for field, title, fmt in (("step_ms", "ms per training step", "{:.1f}"), ("epoch_s", "s per epoch", "{:.2f}")):
        head = [title, "probe RTT (ms)", "probe up/down (Mbit/s)"] + [f"K={k} {d}" for k, d in variants]
        text += ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
        for link in links:
            p = next(v["probe"] for (lk, _, _), v in pool.items() if lk == link and v)
            row = [link, f"{p['rtt_ms']:.2f}", f"{p['up_mbit_s']:.0f} / {p['down_mbit_s']:.0f}"]
            for k, d in variants:
                v = pool.get((link, k, d), "—")
                row.append(v if isinstance(v, str) else "failed" if v is None else fmt.format(v[field]))
            text.append("| " + " | ".join(row) + " |")
        text.append("")
    return "\n".join(text)


def plot(outs: list[dict], path: Path) -> None:
    """ms per training step against RTT, a line per rate; a panel per (K, defence) (pooled passes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    pool = {key: v for key, v in pooled(outs).items() if v}
    link_of = {c["link"]: c for out in outs for c in out["cells"]}
    ks = sorted({k for _, k, _ in pool}, key=lambda k: (k == "epoch", int(k) if k.isdigit() else 0))
    ds = sorted({d for _, _, d in pool})
    if not pool:
        return
    fig, axes = plt.subplots(len(ds), len(ks), figsize=(4.2 * len(ks), 3.4 * len(ds)), squeeze=False, sharey=True)
    for i, d in enumerate(ds):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            mine = {link: v for (link, kk, dd), v in pool.items() if kk == k and dd == d}
            for rate in RATES:
                pts = sorted((link_of[lk]["rtt_ms"], v["step_ms"]) for lk, v in mine.items()
                             if link_of[lk]["rate"] == rate)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=rate)
            for lk, v in mine.items():
                if link_of[lk]["rate"] == "unlimited":
                    ax.axhline(v["step_ms"], ls=":" if link_of[lk]["relay"] else "--", color="grey", label=lk)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks([1, 10, 50])
            ax.set_xlim(0.7, 70)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(ScalarFormatter())
            ax.tick_params(axis="y", which="minor", labelsize=7)
            ax.set_title(f"K = {k}, --defense {d}", fontsize=10)
            ax.set_xlabel("RTT (ms)")
            if j == 0:
                ax.set_ylabel("ms per training step (batch)")
            ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    setup = outs[0]["setup"]
    fig.suptitle(f"direct data plane, {setup['dataset']}, {setup['guests']} guests: ms per training step "
                 f"(median of epochs 2..{setup['epochs']}{f' of {len(outs)} passes' if len(outs) > 1 else ''})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
