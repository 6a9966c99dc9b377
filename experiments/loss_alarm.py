"""The host's training-loss jump alarm (issue 25, ``fl_split/privacy/guard.py``, ``LossJumpAlarm``): its margin on
honest runs and what it catches of a guest permuting its training releases' records within each batch.

    .venv/bin/python experiments/loss_alarm.py honest   # every dataset x defence x seed x --batches-per-round
    .venv/bin/python experiments/loss_alarm.py attack   # permutation: test accuracy with the alarm off / stop / pad
    .venv/bin/python experiments/loss_alarm.py rate     # the smallest shuffled fraction of a batch it catches

``honest`` reports, per run, the largest statistic ``loss / threshold`` (a candidate jump above 1) and, for each
candidate, the share of the jump the best single zero-fill undoes (blamed at ``LOSS_BLAME``). Numbers go to
``experiments/results/loss_alarm_<mode>.json`` and the table is printed; ``docs/threat-model.md`` quotes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fl_split.config import RunConfig  # noqa: E402
from fl_split.engine import LocalEngine  # noqa: E402
from fl_split.errors import ReleaseOutOfRange  # noqa: E402
from fl_split.privacy.guard import LOSS_BLAME, LOSS_REPEAT, LOSS_WINDOW  # noqa: E402
from fl_split.seeding import PrivateSeed  # noqa: E402

from tests.helpers import POISONING_DEFENCES as DEFENCES  # noqa: E402 - each defence at the tests' defaults
START = 10


def cfg(dataset: str, defence: str, seed: int, **kw) -> RunConfig:
    base = dict(dataset=dataset, guests=2, epochs=3, progress=False, protect="both", seed=seed)
    base.update(DEFENCES[defence])
    base.update(kw)
    return RunConfig(**base)


def permute(t: torch.Tensor, gen: torch.Generator, fraction: float) -> torch.Tensor:
    """``t``'s records (rows) permuted among a random ``fraction`` of them (all: a full within-batch permutation)."""
    n = t.shape[0]
    k = max(2, round(fraction * n)) if fraction > 0 else 0
    if k < 2:
        return t
    rows = torch.randperm(n, generator=gen)[:k]
    out = t.clone()
    out[rows] = t[rows[torch.randperm(k, generator=gen)]]
    return out


class PermutingGuest:
    """``guest`` permutes the records of each training release within its batch from round ``start``; test honest."""

    def __init__(self, local, guest: str = "guest-1", start: int = START, fraction: float = 1.0, seed: int = 0):
        from tests.helpers import tampered

        self.local, self.guest, self.start, self.fraction = local, guest, start, fraction
        self.guests = local.guests
        self.gen = torch.Generator().manual_seed(seed)
        self._tampered = tampered

    def guest_step(self, owed, keys, round_):
        out = self.local.guest_step(owed, keys, round_)
        if round_ >= self.start and self.guest in out and keys[0].phase == "train":
            def change(m):
                m.tensor = permute(m.tensor, self.gen, self.fraction)
            out[self.guest] = [self._tampered(b, change) for b in out[self.guest]]
        return out

    def __getattr__(self, name):
        return getattr(self.local, name)


def run(c: RunConfig, seed: int, alarm: bool = True, transport=None) -> dict:
    e = LocalEngine(c.replace(loss_alarm=alarm), private_seed=PrivateSeed.legacy(seed), transport=transport)
    if alarm:
        e.host.loss_alarm.trace = []
    else:
        e.host.loss_alarm = None
    t0 = time.perf_counter()
    try:
        r = e.run()
        out = {"stopped": r["stopped_reason"], "accuracy": r["final"]["value"],
               "failures": [(f["guest"], f["round"], f["reason"]) for f in r["guest_failures"]]}
    except ReleaseOutOfRange as exc:
        # stopped: the model the host keeps is that of its last evaluated epoch
        last = e.host.history[-1] if e.host.history else {}
        out = {"stopped": "refused", "accuracy": last.get("test_metric"), "accuracy_epoch": last.get("epoch"),
               "failures": [(exc.sender, exc.round, str(exc))]}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    a = e.host.loss_alarm
    if a is not None:
        cands = [r for r in a.trace if "without" in r]
        undone = [round((r["loss"] - min(r["without"].values())) / (r["loss"] - r["median"]), 3) for r in cands]
        out.update(judged=a.judged, candidates=a.candidates, blamed=a.blamed, largest=round(a.largest[0], 4),
                   at=a.largest[1], undone=undone)
    return out


def honest(args) -> list[dict]:
    rows = []
    for dataset in args.datasets:
        for defence in args.defences:
            for bpr in (1, 8, "epoch"):
                for hf in (True, False) if args.host_features_off else (True,):
                    for seed in args.seeds:
                        extra = {} if hf else {"host_features": False}
                        r = run(cfg(dataset, defence, seed, batches_per_round=bpr, **extra), seed)
                        row = {"dataset": dataset, "defence": defence, "bpr": bpr, "host_features": hf, "seed": seed,
                               **r}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    worst = max(rows, key=lambda r: r["largest"])
    alarms = sum(r["stopped"] != "completed" or bool(r["failures"]) for r in rows)
    print(f"largest statistic {worst['largest']} ({worst['dataset']} {worst['defence']} bpr={worst['bpr']} "
          f"seed {worst['seed']} {worst['at']}); alarms: {alarms}")
    print(f"honest candidates: {sum(r['candidates'] for r in rows)} in {sum(r['judged'] for r in rows)} judged "
          f"batches; "
          f"blamed on one guest: {sum(r['blamed'] for r in rows)} (in {sum(r['blamed'] > 0 for r in rows)} runs; the "
          f"alarm needs {LOSS_REPEAT} of {LOSS_WINDOW} batches, share undone >= {LOSS_BLAME})")
    return rows


def attack(args) -> list[dict]:
    rows = []
    for defence in args.defences:
        for seed in args.seeds:
            c = cfg("digits", defence, seed)
            rows.append({"defence": defence, "seed": seed, "start": None, "alarm": "honest", **run(c, seed)})
            print(json.dumps(rows[-1]), flush=True)
            for start in args.starts:
                for mode in ("off", "stop", "pad"):
                    cc = c.replace(on_guest_failure="pad") if mode == "pad" else c
                    r = run(cc, seed, alarm=mode != "off",
                            transport=lambda t: PermutingGuest(t, seed=seed, start=start))
                    row = {"defence": defence, "seed": seed, "start": start, "alarm": mode, **r}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def rate(args) -> list[dict]:
    rows = []
    for defence in args.defences:
        for fraction in args.fractions:
            for seed in args.seeds:
                for start in args.starts:
                    r = run(cfg("digits", defence, seed), seed,
                            transport=lambda t: PermutingGuest(t, fraction=fraction, seed=seed, start=start))
                    row = {"defence": defence, "fraction": fraction, "seed": seed, "start": start, **r}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("honest", "attack", "rate"))
    p.add_argument("--datasets", nargs="+", default=["digits", "credit", "breast-cancer"])
    p.add_argument("--defences", nargs="+", default=None)
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--starts", nargs="+", type=int, default=[START, 47, 60, 93],
                   help="attack/rate: the first tampered round (47: epoch 2's first, 93: epoch 3's)")
    p.add_argument("--fractions", nargs="+", type=float, default=[1.0, 0.75, 0.5, 0.25])
    p.add_argument("--host-features-off", action="store_true", help="honest: also runs without the host's features")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.defences is None:
        args.defences = list(DEFENCES) if args.mode == "honest" else ["none", "gaussian"]
    torch.set_num_threads(1)
    logging.getLogger("fl_split").setLevel(logging.ERROR)
    rows = {"honest": honest, "attack": attack, "rate": rate}[args.mode](args)
    out = Path(args.out or ROOT / "experiments" / "results" / f"loss_alarm_{args.mode}.json")
    out.write_text(json.dumps({"command": " ".join(["experiments/loss_alarm.py", *(argv or sys.argv[1:])]),
                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
