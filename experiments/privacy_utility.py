"""Accuracy vs the guests' accounted epsilon, every forward defence on one task (spec §3, §5, §7).

Compare defences under the same budget: each defence protects the guests' forward releases
(``--protect guest``) on the same split task, and its noise parameter is swept; for each run the
x-coordinate is the epsilon the guest's ledger reports after training (the worst record, PLD
accountant, δ = 1e-5, no amplification) and the y-coordinate is the final test accuracy.

* ``laplace``, ``r3elu``, ``rr`` — per-release ``--epsilon`` ∈ {1, 8, 64, 512, 4096};
* ``gaussian`` (+ ``scale`` denoising, 003) — ``--sigma`` ∈ {0.1, 0.3, 0.7, 2, 8};
* ``dpsgd`` — Opacus noise multiplier ∈ {0.3, 0.7, 1.5, 4} on the guests' own parameters
  (its epsilon covers the trained parameters, not the released activations: plotted apart).

No attack is run here, so no privacy score is computed: what each defence *stops* at equal ε —
the measured success of property inference, reconstruction and label inference, and VFLAIR's DCS
computed from it — is ``experiments/exp8_privacy_utility_attacks.py`` (issue 9). (This script used
to report a DCS with a placeholder privacy term, min(1, ε/100); it was removed.)

    python experiments/privacy_utility.py                       # digits, 2 guests, 5 epochs, 1 seed (~3 min)
    python experiments/privacy_utility.py --dataset breast-cancer --seeds 0 1 2

Writes ``experiments/results/privacy_utility_<dataset>.{json,csv,png}``.

``--matched`` (issue 26) compares the mechanisms at the *same tightly accounted* per-party
(ε, δ = 1e-5) after the run's epochs instead of the same nominal parameter: for each target in
``--targets`` every mechanism (laplace, gaussian, rr, r3elu, dpsgd) is calibrated without training
(``experiments/calibrate.py``: its noise parameter bisected through the real ledger), then trained;
each guest's reported ε is checked against the target (within ``calibrate.TOLERANCE``, never
above). Mechanisms run at the project's defaults (``--clip-c auto``, ``--top-k auto``), no denoising.

    python experiments/privacy_utility.py --matched --dataset digits --epochs 3 --seeds 0 1

Writes ``experiments/results/matched_<dataset>.{json,csv,png}``; the CSV has one row per
(dataset, mechanism, ε target, seed, party, metric). ``--defenses rr`` (say) re-runs only those
mechanisms and merges them into the existing files (their rows replaced, the others' kept, the PNG
redrawn from all rows; ``gaussian+scale`` names the ``gaussian`` mechanism here):

    python experiments/privacy_utility.py --matched --dataset digits --epochs 3 --seeds 0 1 --defenses rr
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from fl_split.config import RunConfig
from fl_split.engine import LocalEngine
from fl_split.privacy.disclosure import snr_bound
from fl_split.seeding import PrivateSeed

RESULTS = Path(__file__).resolve().parent / "results"
EPSILONS = (1.0, 8.0, 64.0, 512.0, 4096.0)
SWEEPS = {
    "laplace": [dict(defense="laplace", epsilon=e) for e in EPSILONS],
    "r3elu": [dict(defense="r3elu", epsilon=e) for e in EPSILONS],
    "rr": [dict(defense="rr", epsilon=e) for e in EPSILONS],
    "gaussian+scale": [dict(defense="gaussian", sigma=s, denoise="scale", denoise_param=0.2)
                       for s in (8.0, 2.0, 0.7, 0.3, 0.1)],
    "dpsgd": [dict(defense="dpsgd", sigma=s) for s in (4.0, 1.5, 0.7, 0.3)],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--guests", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--defenses", nargs="+", choices=list(SWEEPS),
                    help="default: all; with --matched, re-run only these and merge them into the existing files")
    ap.add_argument("--matched", action="store_true", help="calibrate every mechanism to the same accounted ε")
    ap.add_argument("--targets", nargs="+", type=float, default=[1.0, 8.0, 64.0])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.matched:
        try:  # experiments/ is sys.path[0] when run as a script
            from matched import run_matched
        except ImportError:  # pragma: no cover
            from experiments.matched import run_matched

        return run_matched(args)
    base = dict(dataset=args.dataset, guests=args.guests, epochs=args.epochs, protect="guest", progress=False,
                clip_c=10.0, top_k="half")  # the setting its results were recorded with (001's C, K = N/2)
    t0 = time.perf_counter()

    def run(changes: dict) -> tuple[float, float | None, float | None]:
        accs, eps, snr = [], None, None
        for seed in args.seeds:
            res = LocalEngine(RunConfig(**base, **changes, seed=seed), private_seed=PrivateSeed.legacy(seed)).run()
            accs.append(res["final"]["value"])
            rep = res["privacy"]["guest-1"]
            eps = rep["epsilon"]
            snr = snr_bound(rep)
        return statistics.fmean(accs), eps, snr

    acc_star, _, _ = run({})
    print(f"{args.dataset}: no defence accuracy {acc_star:.4f}", flush=True)
    rows = []
    for name in args.defenses or list(SWEEPS):
        for changes in SWEEPS[name]:
            acc, eps, snr = run(changes)
            param = {k: v for k, v in changes.items() if k in ("epsilon", "sigma")}
            rows.append({"defense": name, **param, "accuracy": acc, "guest_epsilon": eps, "snr": snr,
                         "config": changes})
            print(f"  {name:15s} {param}  accuracy {acc:.4f}  guest ε {eps:.4g}  SNR {snr if snr is None else f'{snr:.3g}'}"
                  f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    stem = RESULTS / f"privacy_utility_{args.dataset}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = {"dataset": args.dataset, "guests": args.guests, "epochs": args.epochs, "seeds": args.seeds,
            "accountant": "pld", "delta": 1e-5, "no_defense_accuracy": acc_star, "python": sys.version.split()[0], "torch": torch.__version__}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    with stem.with_suffix(".csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["defense", "epsilon", "sigma", "accuracy", "guest_epsilon", "snr"])
        for r in rows:
            w.writerow([r["defense"], r.get("epsilon", ""), r.get("sigma", ""), r["accuracy"], r["guest_epsilon"],
                        r["snr"]])
    plot(rows, acc_star, meta, stem.with_suffix(".png"))
    print(f"saved {stem}.json / .csv / .png")
    return 0


def plot(rows: list[dict], acc_star: float, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for name in dict.fromkeys(r["defense"] for r in rows):
        pts = sorted((r["guest_epsilon"], r["accuracy"]) for r in rows if r["defense"] == name)
        style = "--" if name == "dpsgd" else "-"
        label = name + (" (ε of parameters)" if name == "dpsgd" else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
    ax.axhline(acc_star, color="grey", lw=1, ls=":", label=f"no defence ({acc_star:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel(f"guest epsilon after {meta['epochs']} epochs (worst record, PLD, δ = {meta['delta']:g})")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{meta['dataset']}: accuracy vs accounted epsilon, guests protected ({meta['guests']} guests)")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
