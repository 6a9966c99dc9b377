"""Experiment 9, attacks: the host's inference of one guest with and without secure merge, same per-guest ε.

The host's reconstruction, property and feature inference of guest-1 from what it sees.

Setting of :mod:`experiments.exp9_secure_merge` (``digits``, G guests holding vertical stripes, no host
features, ``--merge sum --defense gaussian``, the same σ and the PLD accountant in every arm, so the same
per-guest ε). The attack is the project's learned inversion decoder
(:class:`fl_split.attacks.reconstruction.Reconstruction`, He et al. 2019; as in experiment 3): the host
holds guest-1's raw inputs for half of the training records (known pairs) and decodes the other half. It
is fed what the host actually holds of the last epoch (3 training epochs and 100 decoder epochs by
default, fewer than experiments 3 and 9 use, to keep the run short):

* ``alone``: each guest noises alone (N(0, σ²)); the host sees guest-1's own noisy release;
* ``alone-sum`` (diagnostic, same training as ``alone``): the plain sum of all guests' releases, to
  separate "the host sees only a sum" from "the noise is split";
* ``secure-k0``: ``--secure-merge --secure-merge-collusion 0``: the host holds only the decoded ring
  sum (:func:`fl_split.privacy.secure_merge.unmask_sum`), which carries σ² in all (each guest adds σ²/G);
* ``secure-kall``: the default k = G − 1: the decoded sum, carrying G·σ².

Expectation stated before running: the sum mixes the other guests' features (and, for k = all, G·σ² of
noise) into what the decoder reads, so the host's reconstruction of guest-1 is worse than or equal to its
reconstruction from guest-1's own release: MSE(secure) ≥ MSE(alone). Rule: per seed, the paired
difference MSE(arm) − MSE(alone), one-sided t-tests (:mod:`experiments.verdicts`), Holm over the table:
"new" if clearly above 0, "does not hold" if clearly below, else "inconclusive"; "uninformative" where
the attack on ``alone`` does not clearly beat its mean-sample baseline.

``--attacks`` (default: all three) adds two more of the host's attacks on guest-1, in the same four arms,
seeds and σ, each fed exactly what the host holds (guest-1's release, or the sum through
:class:`HostSumView`):

* ``property`` (:class:`fl_split.attacks.property.PropertyInference`, Mao et al. 001 Eq. 1): the host
  knows guest-1's ``patch-ink`` property (the middle rows' ink of its stripe above the training median)
  for half of the training records and classifies the other half from the last epoch's releases; the
  same digits runs as the reconstruction (the attack follows the reconstruction on each run, so the
  reconstruction's numbers do not depend on it). Metric: accuracy against the majority rate.
* ``feature`` (:class:`fl_split.attacks.feature.FeatureInference`, GRN, Luo et al. 2021): refused on
  images (guest stripes of digits), and record-blind without host features (the generator's only
  per-record input is the host's own columns), so it runs on ``credit`` **with host features**
  (otherwise section 9's setting: sum merge, Gaussian, PLD, the same σ), 3 training epochs, the
  generator trained ``--feature-epochs`` (100, not 300) epochs on the last evaluation's (test) records.
  Metric: per-feature MSE on min–max normalised features against the attack's random guess U(0, 1) and
  the stricter **mean guess** (guest-1's training mean for every record, what a record-blind guess gets).

Expectation stated before running, for both: as for the reconstruction, the sum mixes the other
guests' features (and for k = all G·σ² of noise) into what the attack reads, so the host infers guest-1
worse than or equal to from guest-1's own release: accuracy(secure) ≤ accuracy(alone) and MSE(secure) ≥
MSE(alone). Same rule: per seed, the paired difference against ``alone``, Holm over each new table, "new"
if clearly in the expected direction, "does not hold" if clearly against it, else "inconclusive";
"uninformative" where the attack on ``alone`` does not clearly beat the majority rate (property) or the
mean guess (feature).

    .venv/bin/python experiments/exp9_secure_merge_attacks.py          # ≈ 12 min on the shared 2 cores
    .venv/bin/python experiments/exp9_secure_merge_attacks.py --attacks property feature  # ≈ 8 min
    .venv/bin/python experiments/exp9_secure_merge_attacks.py --quick  # seconds

Writes ``experiments/results/exp9_secure_merge_attacks/``: ``runs.csv``, ``table.md``, ``claims.json``,
``run.json`` (reconstruction); ``runs_property.csv``, ``table_property.md``, ``claims_property.json``
and the same for ``feature``; ``run_<attacks>.json`` when the reconstruction is not among ``--attacks``
(so the reconstruction's ``run.json`` keeps its provenance).
"""

from __future__ import annotations

import sys
import time

try:
    from experiments import common as C
    from experiments import verdicts as V
    from experiments.exp9_secure_merge import ARMS, BASE
except ImportError:  # run as a script
    import common as C  # type: ignore
    import verdicts as V  # type: ignore
    from exp9_secure_merge import ARMS, BASE  # type: ignore

NAME = "exp9_secure_merge_attacks"
SIGMAS = (0.25, 1.5)
#: arm -> (training arm of exp9, what the host's decoder is fed)
ATTACK_ARMS = {"alone": ("local", "release"), "alone-sum": ("local", "sum"),
               "secure-k0": ("secure", "sum"), "secure-kall": ("secure-all", "sum")}
ATTACKS = ("reconstruction", "property", "feature")
#: per attack: the training setting on top of exp9's BASE (the feature attack needs a table with host
#: features: see the module docstring)
SETTING = {"reconstruction": {}, "property": {}, "feature": {"dataset": "credit", "host_features": True}}
#: per new attack: (metric column, True if higher is better for the host, its baseline column)
METRIC = {"property": ("attack_accuracy", True, "majority_rate"), "feature": ("attack_mse", False, "mean_guess_mse")}


class HostSumView:
    """The host's view with guest ``victim``'s activations replaced by what the host can attribute to
    it when it reads only the merge's sum: the plain sum of every guest's release (no secure merge),
    or the decoded ring sum of their masked releases (secure merge, the host's only guest value:
    ``fl_split/parties/host.py``, ``_forward_secure``). Everything else is the wrapped view's."""

    def __init__(self, view, victim: str) -> None:
        self._view = view
        self._victim = victim

    def __getattr__(self, name):
        return getattr(self._view, name)

    def records(self, kind, phase="train", epoch="last", *, box="in", peer=None):
        if kind != "activations" or peer != self._victim or box != "in":
            return self._view.records(kind, phase, epoch, box=box, peer=peer)
        return host_sum(self._view, phase, epoch)


def host_sum(view, phase: str = "train", epoch="last"):
    """Per-record sum of the guests' activations as the host decodes it (the ring sum under
    ``--secure-merge``, the float sum otherwise), from the host's inbox only."""
    import numpy as np
    import torch

    from fl_split.attacks.view import Records
    from fl_split.privacy.factory import fixed_point_of
    from fl_split.privacy.secure_merge import decode, unmask_sum

    guests = [f"guest-{i}" for i in range(1, view.cfg.guests + 1)]
    parts = [view.records("activations", phase, epoch, peer=g) for g in guests]
    common = parts[0].positions
    for p in parts[1:]:
        common = np.intersect1d(common, p.positions)
    parts = [p.select(common) for p in parts]
    if view.cfg.secure_merge:
        clip, scale = fixed_point_of(view.cfg)
        total = decode(torch.from_numpy(unmask_sum([p.values for p in parts])), clip, scale).float()
    else:
        total = sum(p.values for p in parts)
    return Records(phase, common, parts[0].ids, total)


def session(seed: int, attack: str = "reconstruction", **kw):
    """An observed training run (not yet run) that ``attack`` can use; under ``--secure-merge`` its
    parties get their identities and the host the fixed point, as the local engine gives them
    (:func:`fl_split.privacy.secure_merge.setup_parties`)."""
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.runner import make_session
    from fl_split.privacy.secure_merge import setup_parties
    from fl_split.seeding import PrivateSeed

    s = make_session(C.config(seed, **kw), AttackOptions(attack=attack), PrivateSeed.legacy(seed))
    if s.cfg.secure_merge:
        setup_parties(s.host, s.guests)
    return s


def attack_arm(session, feed: str, opts: dict) -> dict:
    """Mount the reconstruction attack as the host on ``session``, fed guest-1's release or the sum."""
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.reconstruction import Reconstruction

    attack, o = Reconstruction(), AttackOptions(attack="reconstruction", **opts)
    view = session.view("host", attack.grants(session.referee, o))
    guess = attack.run(view if feed == "release" else HostSumView(view, o.guest), o)
    scored = attack.score(guess, session.referee, o)
    return {"mse": float(scored.value), "baseline_mse": float(scored.baseline),
            "ssim": scored.details.get("ssim"), "baseline_ssim": scored.details.get("baseline_ssim")}


def fed_view(view, feed: str, victim: str = "guest-1"):
    """What an attack reads as ``victim``'s releases: its own (``release``) or the host's sum."""
    return view if feed == "release" else HostSumView(view, victim)


def property_arm(session, feed: str, opts: dict) -> dict:
    """Mount the property inference (guest-1's default property) as the host, fed guest-1's release
    or the sum; its accuracy on the records whose property the host does not know, and the majority rate."""
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.property import PropertyInference

    attack, o = PropertyInference(), AttackOptions(attack="property", **opts)
    view = session.view("host", attack.grants(session.referee, o))
    guess = attack.run(fed_view(view, feed, o.guest), o)
    scored = attack.score(guess, session.referee, o)
    return {"attack_accuracy": float(scored.value), "majority_rate": float(scored.baseline),
            "train_accuracy": guess.details["train_accuracy"], "property": guess.details["property"]}


def feature_arm(session, feed: str, opts: dict) -> dict:
    """Mount the feature inference (GRN) as the host, fed guest-1's release or the sum; its
    per-feature MSE, the random guess's and the mean guess's (guest-1's training mean, every record)."""
    import numpy as np

    from fl_split.attacks.base import Guess
    from fl_split.attacks.feature import FeatureInference
    from fl_split.attacks.options import AttackOptions

    attack, o = FeatureInference(), AttackOptions(attack="feature", **opts)
    view = session.view("host", attack.grants(session.referee, o))
    guess = attack.run(fed_view(view, feed, o.guest), o)
    scored = attack.score(guess, session.referee, o)
    ref = session.referee
    mean = ref.features(o.guest, "train", np.arange(ref.n("train"))).reshape(ref.n("train"), -1)
    mean = mean.float().mean(dim=0)
    flat = Guess("test", guess.positions, mean.expand(len(guess.positions), -1).clone(), None, {})
    blind = attack.score(flat, ref, o)
    return {"attack_mse": float(scored.value), "random_guess_mse": float(scored.baseline),
            "mean_guess_mse": float(blind.value), "generator_final_loss": guess.details["generator_final_loss"],
            "target_records": guess.details["target_records"]}


ARM_OF = {"reconstruction": attack_arm, "property": property_arm, "feature": feature_arm}


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__, seeds=(0, 1, 2, 3, 4))
    ap.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS),
                    help="the host's attacks to mount (default: %(default)s)")
    ap.add_argument("--guests", nargs="+", type=int, default=[2, 4], help="G values (default: %(default)s)")
    ap.add_argument("--sigmas", nargs="+", type=float, default=list(SIGMAS), help="σ values (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=3, help="training epochs (default: %(default)s)")
    ap.add_argument("--attack-epochs", type=int, default=100, help="decoder epochs (default: %(default)s)")
    ap.add_argument("--property-epochs", type=int, default=200,
                    help="property classifier epochs, early-stopped (default: %(default)s, the attack's own)")
    ap.add_argument("--feature-epochs", type=int, default=100, help="GRN generator epochs (default: %(default)s)")
    args = ap.parse_args(argv)
    C.setup()
    if args.quick:
        args.seeds = args.seeds[:2]
        args.guests = [2]
    attacks = [a for a in ATTACKS if a in args.attacks]
    out = C.Out(NAME, args, "exp9_secure_merge_attacks.py")
    extra = dict(limit=300, epochs=1) if args.quick else dict(epochs=args.epochs)
    aopts = {"reconstruction": {"attack_epochs": 10 if args.quick else args.attack_epochs},
             "property": {"attack_epochs": 10 if args.quick else args.property_epochs},
             "feature": {"attack_epochs": 5 if args.quick else args.feature_epochs}}
    runs = {a: (C.read_runs(out.dir / runs_file(a)) if args.from_runs else []) for a in attacks}
    t0 = time.perf_counter()
    if not args.from_runs:
        for g, sigma in [(g, s) for g in args.guests for s in args.sigmas]:
            for seed in args.seeds:
                # the reconstruction and the property share each digits run (reconstruction first, as
                # before this option existed); the feature attack has its own credit runs
                sessions: dict = {}
                for attack in attacks:
                    setting = SETTING[attack]
                    for arm, (train_arm, feed) in ATTACK_ARMS.items():
                        key = (tuple(sorted(setting.items())), train_arm)
                        if key not in sessions:
                            s = session(seed, attack="feature" if attack == "feature" else "reconstruction",
                                        **{**BASE, **extra, **setting, "guests": g, "sigma": sigma, **ARMS[train_arm]})
                            sessions[key] = (s, s.run())
                        s, res = sessions[key]
                        r = ARM_OF[attack](s, feed, aopts[attack])
                        runs[attack].append({"guests": g, "sigma": sigma, "arm": arm, "seed": seed, **r,
                                             "epsilon_guest": res["privacy"]["guest-1"]["epsilon"],
                                             "accuracy": res["final"]["value"]})
                        print(f"[{NAME}] {attack} G={g} sigma={sigma} {arm} seed={seed}: {describe(attack, r)} "
                              f"acc {runs[attack][-1]['accuracy']:.3f} eps {runs[attack][-1]['epsilon_guest']:.1f} "
                              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        for attack in attacks:
            out.csv(runs_file(attack), runs[attack])
    tables = []
    for attack in attacks:
        if attack == "reconstruction":
            table, claims = summarise(runs[attack])
            out.md("table.md", table)
            out.claims(claims)
        else:
            table, claims = summarise_attack(attack, runs[attack])
            out.md(f"table_{attack}.md", table)
            for c in claims:
                c.setdefault("experiment", NAME)
                V.guard(c, int(c["n"]))
                assert c["verdict"] in V.VERDICTS and c.get("rule"), c
            out.json(f"claims_{attack}.json", claims)
        tables.append(f"{attack}:\n{table}")
    if "reconstruction" in attacks or args.quick:
        out.finish()
    elif not args.from_runs:  # the reconstruction's run.json keeps its provenance
        import datetime as dt
        import json

        meta = {"experiment": NAME, "command": out.command(),
                "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "seconds": round(time.perf_counter() - out.t0, 1), "quick": False, "seeds": list(args.seeds),
                "attacks": attacks, "versions": C._versions(), "cpu_threads": 1, "files": sorted(set(out.files))}
        (out.dir / f"run_{'_'.join(attacks)}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print("\n\n".join(tables))
    return 0


def runs_file(attack: str) -> str:
    """The runs file of ``attack`` (the reconstruction's keeps its original name)."""
    return "runs.csv" if attack == "reconstruction" else f"runs_{attack}.csv"


def describe(attack: str, r: dict) -> str:
    """One progress line's numbers for ``attack``'s result ``r``."""
    if attack == "reconstruction":
        return f"mse {r['mse']:.4f} (mean sample {r['baseline_mse']:.4f})"
    if attack == "property":
        return f"property acc {r['attack_accuracy']:.3f} (majority {r['majority_rate']:.3f})"
    return f"grn mse {r['attack_mse']:.4f} (mean guess {r['mean_guess_mse']:.4f}, random {r['random_guess_mse']:.4f})"


def _values(runs: list[dict], g: int, s: float, arm: str, key: str) -> list[float]:
    """``key`` of the runs of one cell and arm, in seed order (the pairing of the t-tests)."""
    rows = sorted((r for r in runs if int(r["guests"]) == g and float(r["sigma"]) == s and r["arm"] == arm),
                  key=lambda r: int(r["seed"]))
    return [float(r[key]) for r in rows]


def _verdicts(claims: list[dict], expected) -> None:
    """Holm over ``claims`` (their one-sided ``p``) and each claim's verdict: uninformative unless the attack
    works on ``alone``; else new where significant in the ``expected(diff)`` direction (the host does
    worse), does not hold where significant the other way, inconclusive otherwise."""
    for c, p in zip(claims, V.holm([c["p"] for c in claims])):
        c["p_holm"] = p
        if not c["attack_works_p"] < V.ALPHA:
            c["verdict"] = V.UNINFORMATIVE
        elif p < V.ALPHA:
            c["verdict"] = V.NEW if expected(c["diff"]) else V.FAILS
        else:
            c["verdict"] = V.INCONCLUSIVE


def summarise(runs: list[dict]) -> tuple[str, list[dict]]:
    """The table (mean ± sd per arm, paired differences against ``alone``) and the claims."""
    def values(g, s, arm, key="mse"):
        return _values(runs, g, s, arm, key)

    rows, claims = [], []
    for g, s in sorted({(int(r["guests"]), float(r["sigma"])) for r in runs}):
        alone = values(g, s, "alone")
        works = V.paired(values(g, s, "alone", "baseline_mse"), alone)  # mean sample − attack > 0: it works
        for arm in ATTACK_ARMS:
            v = values(g, s, arm)
            if not v:
                continue
            test = V.paired(v, alone) if arm != "alone" else None
            eps = max(values(g, s, arm, "epsilon_guest"))
            rows.append([g, s, arm, f"{eps:.4g}", C.fmt_ms(values(g, s, arm, "accuracy")), C.fmt_ms(v, digits=4),
                         C.fmt_ms(values(g, s, arm, "baseline_mse"), digits=4), C.fmt_ms(values(g, s, arm, "ssim")),
                         f"{test['diff']:+.4f}" if test else "–", C.sig(test["p"]) if test else "–"])
            if test is None:
                continue
            claims.append({"id": f"9-attack-G{g}-sigma{s}-{arm}", "claim": f"the host's reconstruction of guest-1 from "
                           f"{arm} is worse (higher MSE) than from guest-1's own noisy release (G = {g}, "
                           f"sigma = {s}, the same per-guest epsilon)",
                           "rule": "paired t-test over seeds of MSE(arm) - MSE(alone), one-sided, Holm over this "
                                   "table: new if clearly above 0, does not hold if clearly below, else "
                                   "inconclusive; uninformative unless the attack on alone clearly beats the "
                                   "mean sample (one-sided paired t-test)",
                           "p": min(test["p_above"], test["p_below"]), "diff": test["diff"], "n": test["n"],
                           "attack_works_p": works["p_above"]})
    _verdicts(claims, expected=lambda diff: diff > 0)
    header = ["G", "σ", "arm", "ε per guest", "accuracy", "attack MSE", "mean-sample MSE", "SSIM",
              "MSE − alone", "p (two-sided)"]
    return C.md_table(header, rows), claims


def summarise_attack(attack: str, runs: list[dict]) -> tuple[str, list[dict]]:
    """The property or feature table (mean ± sd per arm, paired differences against ``alone``, Holm
    over the table's comparisons, verdicts) and its claims."""
    metric, higher, base = METRIC[attack]

    def values(g, s, arm, key=metric):
        return _values(runs, g, s, arm, key)

    cells, claims = [], []
    for g, s in sorted({(int(r["guests"]), float(r["sigma"])) for r in runs}):
        alone = values(g, s, "alone")
        # the attack works on alone: it clearly beats its baseline (accuracy above / MSE below)
        works = V.paired(alone, values(g, s, "alone", base)) if higher else V.paired(values(g, s, "alone", base), alone)
        for arm in ATTACK_ARMS:
            v = values(g, s, arm)
            if not v:
                continue
            test = V.paired(v, alone) if arm != "alone" else None
            cells.append((g, s, arm, v, test))
            if test is None:
                continue
            worse = "lower accuracy" if higher else "higher per-feature MSE"
            what = "property (patch-ink) inference" if attack == "property" else "feature inference (GRN)"
            claims.append({"id": f"9-{attack}-G{g}-sigma{s}-{arm}",
                           "claim": f"the host's {what} of guest-1 from {arm} is worse ({worse}) than from guest-1's "
                                    f"own noisy release (G = {g}, sigma = {s}, the same per-guest epsilon)",
                           "rule": f"paired t-test over seeds of {metric}(arm) - {metric}(alone), one-sided, Holm over "
                                   f"this table: new if clearly {'below' if higher else 'above'} 0 (the host does "
                                   f"worse), does not hold if clearly {'above' if higher else 'below'}, else "
                                   f"inconclusive; uninformative unless the attack on alone clearly beats the "
                                   f"{base.replace('_', ' ')} (one-sided paired t-test, p < 0.05)",
                           "p": min(test["p_above"], test["p_below"]), "diff": test["diff"], "n": test["n"],
                           "attack_works_p": works["p_above"], "guests": g, "sigma": s, "arm": arm})
    _verdicts(claims, expected=(lambda diff: diff < 0) if higher else (lambda diff: diff > 0))
    by_id = {c["id"]: c for c in claims}
    rows = []
    for g, s, arm, v, test in cells:
        c = by_id.get(f"9-{attack}-G{g}-sigma{s}-{arm}")
        eps = max(values(g, s, arm, "epsilon_guest"))
        row = [g, s, arm, f"{eps:.4g}", C.fmt_ms(values(g, s, arm, "accuracy")), C.fmt_ms(v, digits=4),
               C.fmt_ms(values(g, s, arm, base), digits=4)]
        if attack == "feature":
            row.append(C.fmt_ms(values(g, s, arm, "random_guess_mse"), digits=4))
        row += [f"{test['diff']:+.4f}" if test else "–", C.sig(test["p"]) if test else "–",
                C.sig(c["p_holm"]) if c else "–", c["verdict"] if c else "–"]
        rows.append(row)
    if attack == "property":
        header = ["G", "σ", "arm", "ε per guest", "model accuracy", "attack accuracy", "majority rate",
                  "accuracy − alone", "p (two-sided)", "Holm p (one-sided)", "verdict"]
    else:
        header = ["G", "σ", "arm", "ε per guest", "model accuracy", "GRN MSE", "mean-guess MSE", "random-guess MSE",
                  "MSE − alone", "p (two-sided)", "Holm p (one-sided)", "verdict"]
    return C.md_table(header, rows), claims


if __name__ == "__main__":
    sys.exit(main())
