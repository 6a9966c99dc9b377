"""Split-learning overhead: epoch time of the local split engine ÷ the monolithic model.

Same config, same modules, same batch order, no defence; both run in this process, alternated
``--repeats`` times so machine noise hits both alike. Prints a table and saves JSON under
``experiments/results/``. Goals (issue 10): ≤ 1.25 on the small CPU models (digits,
movielens-small), ≤ 1.05 on a compute-bound one (digits-wide).

``ratio`` is the ratio of the medians of all epoch times; ``ratio_paired`` the median over repeats of
(split ÷ monolithic) of runs made back to back, which is the steadier of the two on a loaded machine.
The JSON records the load average before and after (``os.getloadavg()``): other processes on
the machine slow both sides, but not by the same factor when the split side does more calls.

The split engine adds a roughly constant cost per batch and guest (a second backward call and
optimizer step per party, encoding, decoding and checking two messages), so the ratio depends on
how much compute a batch has. ``digits-wide`` is the digits run with a wide MLP
(``--hidden 2048,1024``) to show the ratio when compute dominates; the JSON also reports the
absolute overhead in milliseconds per batch.

    python experiments/bench_overhead.py                  # digits, movielens-small, digits-wide
    python experiments/bench_overhead.py --datasets digits --epochs 3 --repeats 5
    python experiments/bench_overhead.py --profile          # where the split's extra time goes
    python experiments/bench_overhead.py --profile --codec  # the same, parties exchanging frames (the wire path)
    python experiments/bench_overhead.py --datasets digits --both   # + the split run on frames, alternated (issue 18)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine, MonolithicEngine
from fl_split.seeding import PrivateSeed

RESULTS = Path(__file__).resolve().parent / "results"

DEFAULTS = {
    # the README's digits setup: 2 guests + host, concat, Adam
    "digits": dict(dataset="digits", guests=2, merge="concat", batch_size=32),
    # 001's MovieLens setup: host + 1 guest (96/64 columns), avg merge, batch 32, lr 0.01, Adam
    "movielens-small": dict(dataset="movielens-small", guests=1, merge="avg", batch_size=32),
    # compute-bound variant of the digits run
    "digits-wide": dict(dataset="digits", guests=2, merge="concat", batch_size=32, model="mlp", hidden="2048,1024"),
}


#: ``--cpu-time``: time each run in this thread's CPU time (whole run ÷ epochs) instead of wall time
CPU_TIME = False


def epoch_times(engine_cls, cfg: RunConfig, codec: bool = False) -> list[float]:
    # the same private seed on both sides: the same initial weights, so the same training (the
    # final metrics must agree, a check that both sides did the same work)
    kw = {"codec": True} if codec and engine_cls is LocalEngine else {}
    eng = engine_cls(cfg, private_seed=PRIVATE_SEED, **kw)
    t = time.thread_time()
    res = eng.run()
    if CPU_TIME:  # every epoch with its evaluation (and the end-of-run reports) in CPU time
        return [(time.thread_time() - t) / len(res["history"])] * len(res["history"]), res["final"]["value"]
    return [h["epoch_time_s"] for h in res["history"]], res["final"]["value"]


PRIVATE_SEED = PrivateSeed.legacy(0)  # the pre-issue-16 derivation: committed numbers reproduce


class Timers:
    """Wall time spent inside chosen callables (patched in place; :meth:`restore` undoes it).

    Times are *exclusive*: a timed call inside another timed call (a ``float()`` inside a bounds
    check, an encode inside a release) counts for its own label only, so the components add up
    and "other" is the time no timer saw."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []
        self._stack: list[float] = []  # time spent in timed children of each open call

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr)
        had = attr in vars(owner)  # False: an instance using its class's method (restore = delete)
        stack, clock = self._stack, self.clock

        def timed(*a, **k):
            stack.append(0.0)
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                took = clock() - t
                inner = stack.pop()
                if stack:
                    stack[-1] += took
                self.total[label] = self.total.get(label, 0.0) + took - inner
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn, had))

    def restore(self) -> None:
        for owner, attr, fn, had in reversed(self._undo):
            if had:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)
        self._undo = []


def profile_breakdown(name: str, epochs: int, limit: int, codec: bool = False, defense: str = "none",
                      cpu_time: bool = False) -> dict:
    """Per-batch wall time by component, split vs monolithic, in one run each (exclusive timers,
    ~1 µs a call). Components: the torch calls every party makes (backward, optimizer step,
    zero_grad, forward), the hand-over (encoding a message, or handing the tensor over in one
    process), the receiver's checks of a message (decode + shape/dtype/finite checks), the bounds
    checks of issue 16 (``PeerTrust``), the request checks, the mechanisms' releases, the ledger
    (charge and settle), the digests (value digests for the write-ahead log, batch digests),
    ``Tensor.item()``/``float(tensor)`` (host synchronisations on a GPU) and the rest ("other":
    batch lookup, loss, merge, the coordinator, evaluation). ``codec``: force the wire path in
    one process (``LocalEngine(codec=True)``) where the engine has an in-process path. ``cpu_time``:
    every time is this thread's CPU time (``time.thread_time``; with one torch thread the parties'
    work runs in it), which other processes on a loaded machine disturb far less than wall time."""
    import inspect

    import fl_split.parties as parties
    import fl_split.privacy.bounds as bounds
    from fl_split.local_update import OptimizerUpdate

    cfg = RunConfig(**DEFAULTS[name], epochs=epochs, progress=False, limit=limit, defense=defense)
    out = {}
    clock = time.thread_time if cpu_time else time.perf_counter
    for label in ("split", "mono"):
        timers = Timers(clock)
        timers.wrap(torch.Tensor, "backward", "backward")
        try:
            if label == "split":
                kw = {"codec": codec} if "codec" in inspect.signature(LocalEngine).parameters else {}
                eng = LocalEngine(cfg, PRIVATE_SEED, **kw)
                timers.wrap(OptimizerUpdate, "step", "optimizer step")
                timers.wrap(OptimizerUpdate, "zero_grad", "zero_grad")
                timers.wrap(parties, "encode", "encode / hand over")
                if hasattr(parties, "handoff"):
                    timers.wrap(parties, "handoff", "encode / hand over")
                for fn in ("decode_expected", "decode", "receive_expected", "open_message"):  # before / after issue 18
                    if hasattr(parties, fn):
                        timers.wrap(parties, fn, "check (+ decode)")
                timers.wrap(bounds.PeerTrust, "check", "bounds checks")
                timers.wrap(bounds.PeerTrust, "record", "bounds checks")
                timers.wrap(parties._Party, "_request", "request checks")
                timers.wrap(parties._Party, "_charge", "ledger")
                timers.wrap(parties._Party, "_settle", "ledger")
                timers.wrap(parties, "value_digest", "digests")
                timers.wrap(parties._Party, "digest", "digests")
                timers.wrap(torch.Tensor, "item", ".item() / float()")
                timers.wrap(torch.Tensor, "__float__", ".item() / float()")
                mechs = {type(m) for p in eng.guests.values() for m in [p.mechanism]}
                mechs |= {type(s()) for s in eng.host.backward_mechanisms.values()}
                for cls in mechs:
                    timers.wrap(cls, "release", "mechanism")
                for party in (eng.host, *eng.guests.values()):
                    for m in party.update.modules:
                        timers.wrap(m, "forward", "forward")
            else:
                eng = MonolithicEngine(cfg, private_seed=PRIVATE_SEED)
                timers.wrap(torch.Tensor, "item", ".item() / float()")
                timers.wrap(torch.Tensor, "__float__", ".item() / float()")
                timers.wrap(eng.optimizer, "step", "optimizer step")
                timers.wrap(eng.optimizer, "zero_grad", "zero_grad")
                timers.wrap(eng.model, "forward", "forward")
            t_run = clock()
            res = eng.run()
            t_run = clock() - t_run
        finally:
            timers.restore()
        if cpu_time:  # the whole run (training and evaluation) in CPU time, instead of the engine's wall time
            res["time_s"] = t_run
        batches = epochs * res["plan"]["batches_per_epoch"]
        epoch = statistics.median(h["epoch_time_s"] for h in res["history"])
        comp = {k: {"ms_per_batch": 1e3 * v / batches, "calls_per_batch": timers.calls[k] / batches,
                    "us_per_call": 1e6 * v / timers.calls[k]} for k, v in timers.total.items()}
        # exclusive times: the components and "other" add up to the run's time
        comp["other"] = {"ms_per_batch": 1e3 * res["time_s"] / batches - sum(c["ms_per_batch"] for c in comp.values())}
        out[label] = {"epoch_s_median": epoch, "ms_per_batch_total": 1e3 * res["time_s"] / batches, "components": comp,
                      "final_metric": res["final"]["value"]}
    return {"dataset": name, "epochs": epochs, "defense": defense, "codec": codec,
            "clock": "thread CPU time" if cpu_time else "wall", "loadavg": os.getloadavg(), **out}


def print_breakdown(b: dict) -> None:
    print(f"  {b['dataset']} (defence {b.get('defense', 'none')}{', codec forced' if b.get('codec') else ''}): "
          f"per-batch wall time by component (ms; split vs monolithic)")
    keys = list(dict.fromkeys([*b["split"]["components"], *b["mono"]["components"]]))
    for k in keys:
        s = b["split"]["components"].get(k, {})
        m = b["mono"]["components"].get(k, {})
        calls = f"{s['calls_per_batch']:.1f} calls x {s['us_per_call']:.0f} us" if "calls_per_batch" in s else ""
        print(f"    {k:16s} split {s.get('ms_per_batch', 0.0):7.3f}   mono {m.get('ms_per_batch', 0.0):7.3f}   {calls}")
    print(f"    {'total':16s} split {b['split']['ms_per_batch_total']:7.3f}   mono {b['mono']['ms_per_batch_total']:7.3f}")


def cfg_batches(cfg: RunConfig) -> int:
    from fl_split.builder import plan_run

    return plan_run(cfg).schedule.num_train_batches()


def bench(name: str, epochs: int, repeats: int, limit: int, codec: bool = False, both: bool = False) -> dict:
    """``both``: a third side, the split run with the wire path forced (``LocalEngine(codec=True)``),
    alternated with the two others: in-process hand-over vs frames in the same run (issue 18)."""
    cfg = RunConfig(**DEFAULTS[name], epochs=epochs, progress=False, limit=limit)
    split, mono, wire, metrics, paired, paired_wire = [], [], [], {}, [], []
    load_before = os.getloadavg()
    for r in range(repeats):
        # alternate the order so drift (thermal, other load) does not favour one side
        order = [("split", LocalEngine, codec), ("mono", MonolithicEngine, False)]
        if both:
            order.append(("wire", LocalEngine, True))
        pair = {}
        for label, cls, forced in (order if r % 2 == 0 else order[::-1]):
            times, metric = epoch_times(cls, cfg, forced)
            {"split": split, "mono": mono, "wire": wire}[label].extend(times)
            metrics[label] = metric
            pair[label] = statistics.median(times)
        paired.append(pair["split"] / pair["mono"])
        if both:
            paired_wire.append(pair["wire"] / pair["mono"])
    s, m = statistics.median(split), statistics.median(mono)
    batches = cfg_batches(cfg)
    out = {"dataset": name, "epochs": epochs, "repeats": repeats, "limit": limit, "batches_per_epoch": batches,
           "overhead_ms_per_batch": 1000 * (s - m) / batches,
           "config": {k: v for k, v in cfg.to_dict().items() if k in DEFAULTS[name] or k in ("epochs", "lr", "optimizer")},
           "split_epoch_s_median": s, "monolithic_epoch_s_median": m, "ratio": s / m,
           "ratio_paired": statistics.median(paired), "ratios_per_repeat": paired,
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "split_epoch_s": split, "monolithic_epoch_s": mono,
           "final_metric_split": metrics["split"], "final_metric_monolithic": metrics["mono"]}
    if both:
        w = statistics.median(wire)
        out.update(wire_epoch_s_median=w, wire_epoch_s=wire, ratio_wire=w / m,
                   ratio_wire_paired=statistics.median(paired_wire), ratios_wire_per_repeat=paired_wire,
                   final_metric_wire=metrics["wire"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--limit", type=int, default=0, help="use only N shared IDs (0 = all)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = least noisy)")
    ap.add_argument("--out", default=str(RESULTS / "bench_overhead.json"))
    ap.add_argument("--profile", action="store_true",
                    help="instead: per-batch time by component (backward, optimizer step, codec, forward, the rest), "
                         "split vs monolithic; JSON bench_overhead_profile.json")
    ap.add_argument("--codec", action="store_true",
                    help="split side: force the wire path (encode, decode) although the parties share this process")
    ap.add_argument("--both", action="store_true",
                    help="a third side: the split run with the wire path forced, alternated with the others "
                         "(in-process hand-over vs frames in the same run)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time in this thread's CPU time instead of wall time (steadier on a loaded machine; "
                         "without --profile: each run's CPU time ÷ its epochs)")
    ap.add_argument("--defense", default="none", help="--profile only: the defence of both sides (default none)")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else ran on the machine)")
    args = ap.parse_args(argv)
    global CPU_TIME
    CPU_TIME = args.cpu_time
    torch.set_num_threads(args.threads)
    if args.profile:
        report = [profile_breakdown(name, args.epochs, args.limit, args.codec, args.defense, args.cpu_time)
                  for name in args.datasets]
        for b in report:
            print_breakdown(b)
        out = Path(args.out if args.out != ap.get_default("out") else RESULTS / "bench_overhead_profile.json")
        out.write_text(json.dumps({"meta": {"torch": torch.__version__, "threads": args.threads, "note": args.note,
                                            "argv": sys.argv[1:] if argv is None else list(argv)},
                                   "breakdown": report}, indent=2) + "\n")
        print(f"saved {out}")
        return 0
    rows = []
    for name in args.datasets:
        t0 = time.perf_counter()
        row = bench(name, args.epochs, args.repeats, args.limit, args.codec, args.both)
        rows.append(row)
        print(f"{name:16s} split {row['split_epoch_s_median']:.3f} s/epoch   monolithic "
              f"{row['monolithic_epoch_s_median']:.3f} s/epoch   ratio {row['ratio']:.3f} "
              f"(paired {row['ratio_paired']:.3f})   "
              f"(+{row['overhead_ms_per_batch']:.2f} ms/batch)   "
              f"(metric split {row['final_metric_split']:.4f} / mono {row['final_metric_monolithic']:.4f}; "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
        if args.both:
            print(f"{'':16s} split with frames {row['wire_epoch_s_median']:.3f} s/epoch   ratio {row['ratio_wire']:.3f} "
                  f"(paired {row['ratio_wire_paired']:.3f})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": sys.version.split()[0], "torch": torch.__version__, "machine": platform.machine(),
            "threads": args.threads, "cpus": os.cpu_count(), "codec_forced": args.codec, "cpu_time": args.cpu_time,
            "argv": sys.argv[1:] if argv is None else list(argv), "goal_ratio": {"small_cpu": 1.25, "compute_bound": 1.05},
            "note": args.note}
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
