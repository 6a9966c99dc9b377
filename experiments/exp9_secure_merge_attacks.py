"""Experiment 9, attacks — the host's reconstruction of one guest's inputs from what it sees, with and
without the secure merge, at the same per-guest ε.

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

    .venv/bin/python experiments/exp9_secure_merge_attacks.py          # ≈ 3–4 min on the shared 2 cores
    .venv/bin/python experiments/exp9_secure_merge_attacks.py --quick  # seconds

Writes ``experiments/results/exp9_secure_merge_attacks/``: ``runs.csv``, ``table.md``, ``claims.json``,
``run.json``.
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


def session(seed: int, **kw):
    """An observed training run (not yet run) that the reconstruction attack can use; under
    ``--secure-merge`` its parties get their identities and the host the fixed point, as the local
    engine gives them (:func:`fl_split.privacy.secure_merge.setup_parties`)."""
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.runner import make_session
    from fl_split.privacy.secure_merge import setup_parties
    from fl_split.seeding import PrivateSeed

    s = make_session(C.config(seed, **kw), AttackOptions(attack="reconstruction"), PrivateSeed.legacy(seed))
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


def main(argv: list[str] | None = None) -> int:
    ap = C.parser(__doc__, seeds=(0, 1, 2, 3, 4))
    ap.add_argument("--guests", nargs="+", type=int, default=[2, 4], help="G values (default: %(default)s)")
    ap.add_argument("--sigmas", nargs="+", type=float, default=list(SIGMAS), help="σ values (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=3, help="training epochs (default: %(default)s)")
    ap.add_argument("--attack-epochs", type=int, default=100, help="decoder epochs (default: %(default)s)")
    args = ap.parse_args(argv)
    C.setup()
    if args.quick:
        args.seeds = args.seeds[:2]
        args.guests = [2]
    out = C.Out(NAME, args, "exp9_secure_merge_attacks.py")
    extra = dict(limit=300, epochs=1) if args.quick else dict(epochs=args.epochs)
    aopts = {"attack_epochs": 10 if args.quick else args.attack_epochs}
    runs = C.read_runs(out.dir / "runs.csv") if args.from_runs else []
    t0 = time.perf_counter()
    if not args.from_runs:
        for g, sigma in [(g, s) for g in args.guests for s in args.sigmas]:
            for seed in args.seeds:
                sessions = {}
                for arm, (train_arm, feed) in ATTACK_ARMS.items():
                    if train_arm not in sessions:
                        sessions[train_arm] = s = session(
                            seed, **{**BASE, **extra, "guests": g, "sigma": sigma, **ARMS[train_arm]})
                        sessions[train_arm + ":results"] = s.run()
                    res = sessions[train_arm + ":results"]
                    r = attack_arm(sessions[train_arm], feed, aopts)
                    runs.append({"guests": g, "sigma": sigma, "arm": arm, "seed": seed, **r,
                                 "epsilon_guest": res["privacy"]["guest-1"]["epsilon"],
                                 "accuracy": res["final"]["value"]})
                    print(f"[{NAME}] G={g} sigma={sigma} {arm} seed={seed}: mse {r['mse']:.4f} (mean sample "
                          f"{r['baseline_mse']:.4f}) acc {runs[-1]['accuracy']:.3f} eps "
                          f"{runs[-1]['epsilon_guest']:.1f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        out.csv("runs.csv", runs)
    table, claims = summarise(runs)
    out.md("table.md", table)
    out.claims(claims)
    out.finish()
    print(table)
    return 0


def summarise(runs: list[dict]) -> tuple[str, list[dict]]:
    """The table (mean ± sd per arm, paired differences against ``alone``) and the claims."""
    def values(g, s, arm, key="mse"):
        rows = sorted((r for r in runs if int(r["guests"]) == g and float(r["sigma"]) == s and r["arm"] == arm),
                      key=lambda r: int(r["seed"]))
        return [float(r[key]) for r in rows]

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
    adj = V.holm([c["p"] for c in claims])
    for c, p in zip(claims, adj):
        c["p_holm"] = p
        if not c["attack_works_p"] < V.ALPHA:
            c["verdict"] = V.UNINFORMATIVE
        elif p < V.ALPHA:
            c["verdict"] = V.NEW if c["diff"] > 0 else V.FAILS
        else:
            c["verdict"] = V.INCONCLUSIVE
    header = ["G", "σ", "arm", "ε per guest", "accuracy", "attack MSE", "mean-sample MSE", "SSIM",
              "MSE − alone", "p (two-sided)"]
    return C.md_table(header, rows), claims


if __name__ == "__main__":
    sys.exit(main())
