"""``privacy_utility.py --matched``: accuracy of every mechanism at the same tightly accounted ε (issue 26).

For each target ε (per guest, δ = 1e-5, PLD, after the run's epochs, no amplification) each
mechanism is calibrated without training (:mod:`calibrate`), trained on ``--seeds``, and every
guest's reported ε is compared with the target. One CSV row per (dataset, mechanism, ε target,
seed, party, metric): ``accuracy`` (the host's final test metric) and ``epsilon`` (each guest's
ledger), with the calibrated parameter and whether the reported ε is within tolerance.
"""

from __future__ import annotations

import csv
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

try:  # run as a script: experiments/ is sys.path[0]; imported as experiments.matched otherwise
    import calibrate as cal
except ImportError:  # pragma: no cover
    from experiments import calibrate as cal

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.seeding import PrivateSeed

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ["dataset", "mechanism", "epsilon_target", "seed", "party", "metric", "value", "parameter",
          "parameter_value", "planned_epsilon", "within_tolerance", "tolerance"]


def mechanisms_of(defenses: list[str] | None) -> tuple[str, ...]:
    """The mechanisms ``--defenses`` names, in :data:`calibrate.MECHANISMS` order (``gaussian+scale``,
    the sweep's name, is the ``gaussian`` mechanism here; none given: all of them)."""
    if not defenses:
        return tuple(cal.MECHANISMS)
    names = {"gaussian" if d == "gaussian+scale" else d for d in defenses}
    return tuple(m for m in cal.MECHANISMS if m in names)


def _previous(stem: Path, args, mechs: tuple[str, ...]) -> dict | None:
    """The committed results a run of only some mechanisms is merged into (``None``: all mechanisms
    run, or no file yet); refused when they were run with other settings."""
    path = stem.with_suffix(".json")
    if mechs == tuple(cal.MECHANISMS) or not path.exists():
        return None
    doc = json.loads(path.read_text())
    m = doc["meta"]
    mine = {"dataset": args.dataset, "guests": args.guests, "epochs": args.epochs, "seeds": list(args.seeds)}
    theirs = {k: m.get(k) for k in mine}
    if mine != theirs:
        raise SystemExit(f"{path}: written with {theirs}, this run is {mine}: rerun every mechanism, or "
                         "move the file away")
    return doc


def _merge(old: list[dict], new: list[dict], mechs: tuple[str, ...]) -> list[dict]:
    """``old`` with the rows of ``mechs`` replaced by ``new``'s, each (mechanism, target) group where
    the old one stood (a group ``old`` lacks goes at the end): the other mechanisms' rows are kept as
    they are."""
    group = lambda r: (r["mechanism"], float(r["epsilon_target"]))  # noqa: E731
    fresh: dict[tuple, list[dict]] = {}
    for r in new:
        fresh.setdefault(group(r), []).append(r)
    out: list[dict] = []
    for r in old:
        if r["mechanism"] not in mechs:
            out.append(r)
        elif group(r) in fresh:
            out.extend(fresh.pop(group(r)))
    for rows in fresh.values():
        out.extend(rows)
    return out


def run_matched(args) -> int:
    """Calibrate, train and write ``matched_<dataset>``. With ``--defenses`` naming only some
    mechanisms and the file already there, only those are re-run: their rows replace theirs in the
    existing CSV/JSON, the other mechanisms' and the undefended rows are kept, and the PNG is redrawn
    from the merged rows."""
    base = dict(dataset=args.dataset, guests=args.guests, epochs=args.epochs, protect="guest", progress=False,
                accountant="pld", delta=1e-5)
    t0 = time.perf_counter()
    mechs = mechanisms_of(getattr(args, "defenses", None))
    stem = RESULTS / f"matched_{args.dataset}"
    previous = _previous(stem, args, mechs)
    parties = cal.probe(base)
    print(f"{args.dataset}: guests {parties}", flush=True)
    if previous is not None and previous["meta"].get("guest_cuts") != parties:
        raise SystemExit(f"{stem}.json: guest cuts {previous['meta'].get('guest_cuts')}, now {parties}")
    rows: list[dict] = []
    none_acc = []
    for seed in args.seeds if previous is None else ():  # merged: the committed undefended rows are kept
        res = LocalEngine(RunConfig(**base, seed=seed), private_seed=PrivateSeed.legacy(seed)).run()
        none_acc.append(res["final"]["value"])
        rows.append(dict(dataset=args.dataset, mechanism="none", epsilon_target="", seed=seed, party="host",
                         metric=res["final"]["name"] if "name" in res["final"] else "accuracy",
                         value=res["final"]["value"], parameter="", parameter_value="", planned_epsilon="",
                         within_tolerance="", tolerance=""))
    if none_acc:
        print(f"  no defence: {statistics.fmean(none_acc):.4f}", flush=True)
    ok_all = True
    for target in args.targets:
        for mech in mechs:
            c = cal.calibrate(base, mech, target, parties)
            name = cal.PARAMETER[mech][0]
            common = dict(dataset=args.dataset, mechanism=mech, epsilon_target=target, parameter=name,
                          parameter_value=c["changes"][name], planned_epsilon=c["planned_epsilon"],
                          tolerance=cal.TOLERANCE)
            accs = []
            for seed in args.seeds:
                cfg = RunConfig(**base, **c["changes"], seed=seed)
                res = LocalEngine(cfg, private_seed=PrivateSeed.legacy(seed)).run()
                accs.append(res["final"]["value"])
                rows.append(dict(common, seed=seed, party="host", metric="accuracy", value=res["final"]["value"],
                                 within_tolerance=""))
                for party in sorted(parties):
                    eps = res["privacy"][party]["epsilon"]
                    ok = cal.reported_ok(eps, target)
                    ok_all &= ok
                    rows.append(dict(common, seed=seed, party=party, metric="epsilon", value=eps, within_tolerance=ok))
            print(f"  ε {target:g} {mech:9s} {name} = {c['changes'][name]:.4g}  accuracy "
                  f"{statistics.fmean(accs):.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    stem.parent.mkdir(parents=True, exist_ok=True)
    if previous is None:
        meta = {"dataset": args.dataset, "guests": args.guests, "epochs": args.epochs, "seeds": args.seeds,
                "targets": args.targets, "accountant": "pld", "delta": 1e-5, "tolerance": cal.TOLERANCE,
                "guest_cuts": parties, "no_defense_accuracy": statistics.fmean(none_acc),
                "all_within_tolerance": ok_all, "seconds": round(time.perf_counter() - t0, 1),
                "python": sys.version.split()[0], "torch": torch.__version__}
    else:
        rows = _merge(previous["rows"], rows, mechs)
        meta = previous["meta"]
        ok_all = all(r["within_tolerance"] is True for r in rows if r["metric"] == "epsilon")
        meta["targets"] = sorted({float(r["epsilon_target"]) for r in rows if r["mechanism"] != "none"})
        meta["all_within_tolerance"] = ok_all
        if "rr" in mechs:  # reaccount.py's stamp on RR rows it re-charged without retraining: they are gone
            meta.pop("reaccounted_rr", None)
        meta.setdefault("reruns", []).append({
            "mechanisms": list(mechs), "targets": args.targets,
            "command": " ".join(["python", *sys.argv]) if sys.argv and sys.argv[0].endswith(".py") else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - t0, 1), "python": sys.version.split()[0],
            "torch": torch.__version__,
            "why": "re-run alone (--defenses): its rows replaced, the other mechanisms' rows kept as committed"})
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    with stem.with_suffix(".csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")  # JSON-only keys (charged_value)
        w.writeheader()
        w.writerows(rows)
    plot(rows, meta, stem.with_suffix(".png"))
    print(f"saved {stem}.json / .csv / .png; every reported ε within tolerance: {ok_all}")
    return 0 if ok_all else 1


def summary(rows: list[dict]) -> dict[tuple[str, float], tuple[float, float, int]]:
    """(mechanism, target) -> (mean accuracy, sd over seeds, n)."""
    acc: dict[tuple, list[float]] = {}
    for r in rows:
        if r["metric"] == "accuracy" and r["mechanism"] != "none":
            acc.setdefault((r["mechanism"], float(r["epsilon_target"])), []).append(float(r["value"]))
    return {k: (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)) for k, v in acc.items()}


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary(rows)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for mech in cal.MECHANISMS:
        pts = sorted((t, m, sd) for (k, t), (m, sd, _) in s.items() if k == mech)
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                        capsize=3, label=mech + (" (ε of parameters)" if mech == "dpsgd" else ""))
    ax.axhline(meta["no_defense_accuracy"], color="grey", lw=1, ls=":",
               label=f"no defence ({meta['no_defense_accuracy']:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel(f"per-guest ε after {meta['epochs']} epochs (calibrated; PLD, δ = {meta['delta']:g})")
    ax.set_ylabel("test accuracy (mean ± sd over seeds)")
    ax.set_title(f"{meta['dataset']}: accuracy at matched accounted ε ({meta['guests']} guests, "
                 f"seeds {meta['seeds']})", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
