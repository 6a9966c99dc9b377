"""Re-account committed runs under tight accounting (issue 26), without changing what they measured.

A run's accuracy and attack results do not depend on how its releases are accounted (the
mechanisms and their noise are unchanged), only its ε does: a protected party's ledger ε is a
function of the mechanism's parameters, of how many times the worst record was released and, for
R3eLU's importance allocation, of the importances the run computed. The committed Laplace and R3eLU
numbers were charged as one 1-D event of L1 sensitivity 2Cd per release (the *basic* value); the
ledger now charges the per-element worst-case pair (``pld``, ``docs/accounting.md``). Gaussian, RR
and DP-SGD were accounted tightly already and are not re-run.

Sources (``--source``):

* ``privacy_utility`` — the Laplace/R3eLU rows of ``results/privacy_utility_<dataset>.json``,
  re-run through ``LocalEngine`` on ``--limit`` records (every record is still released once per
  epoch, so the worst record's count and the ledger's ε are the full run's) →
  ``results/reaccount_privacy_utility_<dataset>.json``;
* ``exp2`` / ``exp8`` — every Laplace / R3eLU configuration of experiment 2 / 8, re-run **in full**
  for seed 0 with the experiment's own settings (``common.train``, the committed seed-0 run: R3eLU's
  importances, and so its per-element budgets, come from the training itself, so no ``--limit``).
  The seed-0 utility is printed beside the committed one: equal means the re-run is the committed
  run. Writes ``results/<experiment>/reaccounted.json``, which the experiment's ``--from-runs``
  rebuild reads to report the tight ε and to check that each comparison it credits is at matched
  privacy.

    python experiments/reaccount.py                       # ~1 min
    python experiments/reaccount.py --source exp2         # ~15 min on 2 cores
    python experiments/reaccount.py --source exp8         # ~3 min
    python experiments/reaccount.py --source rr           # RR rows of exp5/6/8 (issue 37), ~1 min

``--source rr`` (issue 37): randomized response was accounted tightly per bit but its bits were
rounded on a grid set by the whole release's ε; the ledger now composes a d-bit release as one exact
binomial. The committed RR rows of experiments 5, 6 and 8 get the ε charged now in their
``runs.csv`` (the committed value kept as ``charged_<column>``), from the real ledger: experiment 6
releases each record once (computed directly, :func:`rr_release_epsilon`), experiments 5 and 8 are
re-run on a few records with their own settings (the worst record's count is the full run's), and
so are the RR rows of ``privacy_utility_digits`` and ``matched_<dataset>`` (their ``within_tolerance``
re-checked; this script does not re-calibrate or retrain RR, nor redraw the PNGs: ``privacy_utility.py
--matched --defenses rr`` does, experiments/README.md "Matched privacy").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as `python experiments/reaccount.py` from the repository root
    sys.path.insert(0, str(HERE.parent))

from experiments import common as C  # noqa: E402

RESULTS = HERE / "results"
#: the defences whose accounting changed (issue 26, item 1)
RECHARGED = ("laplace", "r3elu")
REACCOUNTED = "reaccounted.json"


def config_key(dataset: str, defence: str, direction: str, epsilon: float) -> str:
    """How a configuration is named in ``reaccounted.json`` (and looked up by the experiments)."""
    return f"{dataset}|{defence}|{direction}|{float(epsilon):g}"


def load_tight(folder: Path) -> dict[str, dict]:
    """``{config_key: row}`` of ``folder/reaccounted.json``, or ``{}`` when it was never written."""
    path = folder / REACCOUNTED
    if not path.exists():
        return {}
    return {row["key"]: row for row in json.loads(path.read_text())["rows"]}


def _privacy_utility(args) -> None:
    from fl_split.config import RunConfig
    from fl_split.engine import LocalEngine
    from fl_split.seeding import PrivateSeed

    src = RESULTS / f"privacy_utility_{args.dataset}.json"
    doc = json.loads(src.read_text())
    meta = doc["meta"]
    seen, rows = set(), []
    for row in doc["rows"]:
        if row["defense"] not in RECHARGED:
            continue
        key = json.dumps(row["config"], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        cfg = RunConfig(dataset=meta["dataset"], guests=meta["guests"], epochs=meta["epochs"], protect="guest",
                        accountant=meta["accountant"], delta=meta["delta"], limit=args.limit, progress=False,
                        seed=0, **row["config"])
        rep = LocalEngine(cfg, private_seed=PrivateSeed.legacy(0)).run()["privacy"]["guest-1"]
        out = {"defense": row["defense"], "config": row["config"], "committed_guest_epsilon": row["guest_epsilon"],
               "releases_per_record": rep["releases_per_record"], "basic": rep["epsilons"]["basic"],
               "pld_tight": rep["epsilon"], "ratio": row["guest_epsilon"] / rep["epsilon"],
               "cut_width": rep["mechanism"].get("cut_width", rep["mechanism"].get("width"))}
        rows.append(out)
        print(f"{row['defense']:8s} {json.dumps(row['config']):40s} committed {row['guest_epsilon']:10.4g}  "
              f"basic {out['basic']:10.4g}  now {out['pld_tight']:10.4g}  ({out['ratio']:.2f}x looser)", flush=True)
    dest = RESULTS / f"reaccount_privacy_utility_{args.dataset}.json"
    dest.write_text(json.dumps({"source": src.name, "delta": meta["delta"], "epochs": meta["epochs"],
                                "limit": args.limit, "rows": rows}, indent=1))
    print(f"wrote {dest}")


def _exp2_configs(runs: list[dict]):
    """``(key, committed seed-0 run, kwargs of common.train, {party: committed ε})`` of experiment 2."""
    from experiments import exp2_utility_epsilon as E

    for r in runs:
        if r["seed"] != 0 or not str(r["defence"]).startswith(RECHARGED):
            continue
        eps = float(r["epsilon"])
        kw = E.defence_kwargs(r["defence"], eps, r["direction"])
        party = E.protected(r["direction"]) if r["direction"] in E.DIRECTIONS else "guest-1"
        yield (config_key(r["dataset"], r["defence"], r["direction"], eps), r["value"],
               {**E.DATASETS[r["dataset"]], **E.TRAIN, **kw}, {party: r["accounted_epsilon"]})


def _exp8_configs(runs: list[dict]):
    """The same for experiment 8 (both directions: the guest's and the host's ε)."""
    from experiments import exp8_privacy_utility_attacks as E

    for r in runs:
        if r["seed"] != 0 or r["defence"] not in RECHARGED or r["attack"] != "label":
            continue
        eps = float(r["epsilon"])
        yield (config_key(r["dataset"], r["defence"], "both", eps), r["utility"],
               {**E.DATASETS[r["dataset"]], **E.TRAIN, **E.defence_kwargs(r["defence"], eps)},
               {"guest-1": r["guest_epsilon"], "host": r["host_epsilon"]})


def _experiment(args) -> None:
    """Re-run each Laplace / R3eLU configuration of experiment 2 or 8 (seed 0, in full) and record
    its parties' ε: committed (basic) and now (tight)."""
    folder = RESULTS / {"exp2": "exp2_utility_epsilon", "exp8": "exp8_privacy_utility_attacks"}[args.source]
    C.setup()
    runs = C.read_runs(folder / "runs.csv")
    configs = list((_exp2_configs if args.source == "exp2" else _exp8_configs)(runs))
    rows, t0 = [], time.perf_counter()
    for i, (key, committed_value, kw, committed) in enumerate(configs, 1):
        res = C.train(0, **kw)
        parties = {}
        for party, old in committed.items():
            rep = C.guest_report(res, party)
            parties[party] = {"committed": old, "basic": rep["epsilons"]["basic"], "tight": rep["epsilon"],
                              "accountant": rep.get("accountant"), "delta": rep.get("delta")}
        value = res["final"]["value"]
        rows.append({"key": key, "seed": 0, "committed_value": committed_value, "value": value,
                     "same_run": abs(value - committed_value) < 1e-6, "parties": parties})
        eps_text = "; ".join(f"{p} {C.sig(v['committed'])} → {C.sig(v['tight'])}" for p, v in parties.items())
        print(f"[{i}/{len(configs)} {time.perf_counter() - t0:6.0f} s] {key:40s} utility {value:.4f} "
              f"(committed {committed_value:.4f})  ε {eps_text}", flush=True)
    dest = folder / REACCOUNTED
    dest.write_text(json.dumps({
        "what": "seed 0 of every Laplace / R3eLU configuration re-run in full with the experiment's settings; "
                "ε committed (one 1-D event of L1 sensitivity 2Cd per release) and now (the per-element "
                "worst-case pair, PLD)",
        "command": f".venv/bin/python experiments/reaccount.py --source {args.source}",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 1), "versions": C._versions(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {dest}")


def rr_release_epsilon(width: int, epsilon: float, releases: int = 1, delta: float = 1e-5) -> float:
    """The ledger's ε for a record released ``releases`` times by a ``width``-bit randomized response
    of ε ``epsilon`` per release (``fl_split.privacy.mechanisms.RandomizedResponse``): charged through
    the real :class:`~fl_split.privacy.ledger.Ledger`, so the reported accountant is the tightest
    valid one (the exact binomial PLD, docs/accounting.md)."""
    import numpy as np

    from fl_split.privacy.ledger import Ledger, LedgerEntry
    from fl_split.privacy.mechanisms import RandomizedResponse

    cost = RandomizedResponse(int(width), float(epsilon)).privacy_cost()
    ledger = Ledger("guest-1", delta=delta)
    for i in range(int(releases)):
        ledger.charge([LedgerEntry(round=i, key=("train", i, 0), direction="forward", cost=cost, ids=np.array([0]))])
    return float(ledger.epsilon())


#: the committed runs whose randomized-response ε was charged by the looser accountant (before RR's exact
#: binomial PLD): folder, the runs.csv column holding the protected party's ε, how a row is recognised
RR_SOURCES = {"exp5_denoising": ("guest_epsilon", lambda r: r["family"] == "rr"),
              "exp6_rr_vs_laplace": ("accounted_epsilon", lambda r: r["mechanism"] == "rr"),
              "exp8_privacy_utility_attacks": ("guest_epsilon", lambda r: r["defence"] == "rr")}


def _rr_tight(folder: str, r: dict, cache: dict) -> tuple[float, int]:
    """(the ε the ledger charges now, releases per record) of one committed RR row."""
    if folder == "exp6_rr_vs_laplace":  # one-shot: every record released once, ``width`` bits
        return rr_release_epsilon(int(r["width"]), float(r["epsilon_per_record"]), 1), 1
    if folder == "exp5_denoising":
        from experiments import exp5_denoising as E

        kw, key = {**E.BASE, "defense": "rr", "epsilon": float(r["level"])}, ("exp5", float(r["level"]))
    else:
        from experiments import exp8_privacy_utility_attacks as E

        kw = {**E.DATASETS[r["dataset"]], **E.TRAIN, **E.defence_kwargs("rr", float(r["epsilon"]))}
        key = ("exp8", r["dataset"], float(r["epsilon"]))
    if key not in cache:  # the experiment's own settings on a few records: every record is still released
        # once per epoch, so the worst record's count, and its ε, are the full run's
        rep = C.guest_report(C.train(0, **kw, limit=160))
        cache[key] = (float(rep["epsilon"]), int(rep["releases_per_record"]))
    return cache[key]


def _rr(args) -> None:
    """Re-account the committed RR rows of experiments 5, 6 and 8 (issue 37): their ``runs.csv`` ε column
    gets the ledger's ε now, the committed value kept beside it as ``charged_<column>``; ``run.json``
    records the re-accounting. Accuracies and attacks are untouched (the ε does not depend on the draws)."""
    C.setup()
    cache: dict = {}
    t0 = time.perf_counter()
    if args.summaries_only:
        _rr_summaries(cache)
        return
    for folder, (col, is_rr) in RR_SOURCES.items():
        path = RESULTS / folder / "runs.csv"
        runs = C.read_runs(path)
        changed = []
        for r in runs:
            if not is_rr(r) or r.get(col) is None:
                continue
            old = float(r.get("charged_" + col) or r[col])
            new, k = _rr_tight(folder, r, cache)
            r["charged_" + col], r[col] = old, new
            changed.append((old, new, k))
        for r in runs:  # every row has the column (CSV)
            r.setdefault("charged_" + col, None)
        with path.open("w", newline="") as fh:
            import csv

            w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in runs for k in r)))
            w.writeheader()
            w.writerows({k: C._cell(v) for k, v in r.items()} for r in runs)
        pairs = sorted({(round(o, 4), round(n, 4), k) for o, n, k in changed})
        meta_path = RESULTS / folder / "run.json"
        meta = json.loads(meta_path.read_text())
        meta["reaccounted_rr"] = {
            "command": ".venv/bin/python experiments/reaccount.py --source rr",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "versions": C._versions(),
            "why": "randomized response's ε as the ledger charges it now (the exact binomial PLD of its bits); the "
                   f"committed value kept as charged_{col}",
            "rows": len(changed), "committed_to_now": [{"committed": o, "now": n, "releases_per_record": k}
                                                       for o, n, k in pairs]}
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        print(f"[{time.perf_counter() - t0:5.0f} s] {folder}: {len(changed)} RR rows re-accounted: "
              + "; ".join(f"{C.sig(o)} → {C.sig(n)} ({k} rel.)" for o, n, k in pairs), flush=True)
    _rr_summaries(cache)


def _ledger_rr(dataset: str, guests: int, epochs: int, epsilon: float, cache: dict) -> dict[str, float]:
    """Each guest's ε now for ``epochs`` of RR at ``epsilon`` per release (privacy_utility / matched
    settings), from a run on a few records (every record is still released once per epoch)."""
    from fl_split.config import RunConfig
    from fl_split.engine import LocalEngine
    from fl_split.seeding import PrivateSeed

    key = (dataset, guests, epochs, float(epsilon))
    if key not in cache:
        cfg = RunConfig(dataset=dataset, guests=guests, epochs=epochs, defense="rr", epsilon=float(epsilon),
                        protect="guest", accountant="pld", delta=1e-5, limit=120, progress=False, seed=0)
        rep = LocalEngine(cfg, private_seed=PrivateSeed.legacy(0)).run()["privacy"]
        cache[key] = {p: float(r["epsilon"]) for p, r in rep.items() if p != "host" and r.get("epsilon") is not None}
    return cache[key]


def _rewrite_csv(path: Path, update) -> int:
    """Apply ``update(row) -> bool`` to every row of ``path`` (strings kept as written); rows changed."""
    import csv

    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    changed = sum(bool(update(r)) for r in rows)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    return changed


def _rr_summaries(cache: dict) -> None:
    """The RR rows of ``privacy_utility_digits.json`` and ``matched_<dataset>.json`` (+ their CSVs): each
    guest's ε as the ledger charges it now (the committed value kept as ``charged_*``); a matched cell's
    ``within_tolerance`` re-checked against its target, by the calibration's rule (within the tolerance
    below, never above: :func:`fl_split.bench.calibrate.reported_ok`). The RR models are not re-calibrated
    or retrained here: a cell now outside the tolerance says so. The PNGs are not redrawn."""
    stamp = {"command": ".venv/bin/python experiments/reaccount.py --source rr",
             "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
             "why": "randomized response's ε as the ledger charges it now (exact binomial PLD); committed values "
                    "kept as charged_*; RR not re-calibrated: a matched cell outside the tolerance says so"}
    pu = RESULTS / "privacy_utility_digits.json"
    doc = json.loads(pu.read_text())
    m = doc["meta"]
    now = {}
    for r in doc["rows"]:
        if r["defense"] == "rr":
            e = _ledger_rr(m["dataset"], m["guests"], m["epochs"], r["epsilon"], cache)["guest-1"]
            r.setdefault("charged_guest_epsilon", r["guest_epsilon"])
            r["guest_epsilon"] = now[float(r["epsilon"])] = e
            print(f"privacy_utility rr ε={r['epsilon']:g}: {C.sig(r['charged_guest_epsilon'])} → {C.sig(e)}", flush=True)
    m["reaccounted_rr"] = stamp
    pu.write_text(json.dumps(doc, indent=2) + "\n")

    def pu_row(r: dict) -> bool:
        if r["defense"] != "rr":
            return False
        r["guest_epsilon"] = repr(now[float(r["epsilon"])])
        return True
    _rewrite_csv(pu.with_suffix(".csv"), pu_row)
    for ds in ("digits", "credit"):
        path = RESULTS / f"matched_{ds}.json"
        doc = json.loads(path.read_text())
        m = doc["meta"]
        fixed = {}
        for r in doc["rows"]:
            if r.get("mechanism") != "rr" or r.get("metric") != "epsilon":
                continue
            e = _ledger_rr(ds, m["guests"], m["epochs"], r["parameter_value"], cache)[r["party"]]
            r.setdefault("charged_value", r["value"])
            r["value"] = e
            target = r["epsilon_target"]
            r["within_tolerance"] = target * (1 - r["tolerance"]) <= e <= target * (1 + 1e-9)
            fixed[(str(r["seed"]), r["party"], repr(r["epsilon_target"]))] = r
            print(f"matched {ds} rr target {r['epsilon_target']:g} seed {r['seed']} {r['party']}: "
                  f"{C.sig(r['charged_value'], 5)} → {C.sig(e, 5)} (within {r['tolerance']:.0%}: "
                  f"{r['within_tolerance']})", flush=True)
        m["all_within_tolerance"] = all(r["within_tolerance"] for r in doc["rows"] if r.get("metric") == "epsilon")
        m["reaccounted_rr"] = stamp
        path.write_text(json.dumps(doc, indent=1) + "\n")  # as experiments/matched.py writes it

        def m_row(r: dict) -> bool:
            if r["mechanism"] != "rr" or r["metric"] != "epsilon":
                return False
            new = next(v for (sd, party, tgt), v in fixed.items()
                       if sd == r["seed"] and party == r["party"] and float(tgt) == float(r["epsilon_target"]))
            r["value"], r["within_tolerance"] = repr(new["value"]), str(new["within_tolerance"])
            return True
        _rewrite_csv(path.with_suffix(".csv"), m_row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", choices=("privacy_utility", "exp2", "exp8", "rr"), default="privacy_utility",
                    help="rr: the committed randomized-response rows of experiments 5, 6 and 8, "
                         "privacy_utility_digits and matched_<dataset> (issue 37)")
    ap.add_argument("--summaries-only", action="store_true",
                    help="with --source rr: only privacy_utility_digits and matched_<dataset>")
    ap.add_argument("--dataset", default="digits", help="privacy_utility: which dataset's file")
    ap.add_argument("--limit", type=int, default=120, help="privacy_utility: records per re-run")
    args = ap.parse_args()
    {"privacy_utility": _privacy_utility, "rr": _rr}.get(args.source, _experiment)(args)


if __name__ == "__main__":
    main()
