"""What the issue-9 experiment scripts share: seeds, runs, attacks, mean ± sd, outputs, claims, DCS.

Every ``experiments/expN_*.py`` script:

* runs its trainings with :func:`train` (``LocalEngine(RunConfig(...), private_seed=seed)``: the
  public ``--seed`` and each party's private secret both come from the seed, so a run is
  reproducible) and its attacks with :func:`attack_session` / :func:`attack` (the attacks'
  own API, ``fl_split.attacks.runner``);
* reports mean ± sd over ``--seeds`` (three by default);
* writes into ``experiments/results/<name>/``: CSV, a Markdown table, PNG plots, ``claims.json``
  (paper claim, the paper's number, ours, verdict) and ``run.json`` (the exact command, date,
  versions, seconds);
* has a ``--quick`` mode (one seed, ``--limit``, one or two epochs, seconds) that
  ``tests/test_experiments.py`` runs; quick outputs go to a temporary folder unless ``--out``
  says otherwise, so they never overwrite committed results.

``python experiments/claims.py`` gathers every ``claims.json`` into ``results/claims.md``, the
claim table at the top of ``experiments/README.md``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
if str(ROOT) not in sys.path:  # run as `python experiments/expN.py` from the repository root
    sys.path.insert(0, str(ROOT))

from experiments.verdicts import (  # noqa: E402,F401 - the verdict rules, re-exported as C.*
    ALPHA, FAILS, HOLDS, INCONCLUSIVE, NEW, NOT_APPLICABLE, NOT_APPLICABLE_WHY, NOT_MEASURED, PARTLY, UNINFORMATIVE,
    USABLE_RULE, VERDICTS, ATTACK_CHANNEL, channel_of, guard, holm, mean_sd, paired, t_test, touches, usable, welch, within)


# -- setup -------------------------------------------------------------------------------------------
def setup() -> None:
    """One torch thread (the machine is shared), no progress bars, parties' warnings silenced (the
    "releases are mostly noise" warning is expected in these sweeps: the public SNR bound is
    reported instead)."""
    import torch

    torch.set_num_threads(1)
    logging.getLogger("fl_split").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def parser(doc: str, seeds: Sequence[int] = (0, 1, 2)) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: one seed, a few records, one or two epochs (seconds); writes to a temporary "
                         "folder unless --out is given")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(seeds),
                    help="public and private seeds of the repeated runs (default: %(default)s)")
    ap.add_argument("--out", default="", help="output folder (default: experiments/results/<name>/)")
    ap.add_argument("--substitute", action="append", default=[], metavar="OFFLINE=REAL",
                    help="run every configuration of OFFLINE (e.g. digits) on the downloadable dataset REAL instead "
                         "(e.g. mnist, from --data-root), same models and options; repeatable. Results go to "
                         "experiments/results/<name>+REAL/ so the committed offline numbers stay as they are")
    ap.add_argument("--data-root", default="", help="where the downloadable datasets are (see `fl-split datasets`)")
    ap.add_argument("--verify", action="store_true",
                    help="re-run seed 0 at the current code into a temporary folder and compare every cell with the "
                         "committed runs.csv (tolerance: the larger of 2 sd over the committed seeds and 0.005 + 2 %% "
                         "of the value); exit 1 if any cell drifted. Combine with --datasets / --parts for a subset")
    ap.add_argument("--from-runs", action="store_true",
                    help="train nothing: rebuild the tables, claims and plots from the output folder's runs.csv "
                         "(after a change to a verdict rule)")
    return ap


#: ``--substitute``: offline dataset -> the real dataset it stands for in this process, and --data-root
_SUBSTITUTE: dict[str, str] = {}
_DATA_ROOT: list[str] = [""]


def use_datasets(pairs: Sequence[str], data_root: str = "") -> dict[str, str]:
    """Apply ``--substitute OFFLINE=REAL`` to every later :func:`config` (checked now: both names
    known, REAL present under ``data_root``; nothing downloads)."""
    from fl_split.data.registry import dataset_info, dataset_names

    subs: dict[str, str] = {}
    for pair in pairs:
        off, sep, real = pair.partition("=")
        if not sep or off not in dataset_names() or real not in dataset_names():
            raise SystemExit(f"--substitute {pair!r}: expected OFFLINE=REAL with two dataset names from "
                             f"{', '.join(dataset_names())}")
        if not dataset_info(real).available(Path(data_root).expanduser() if data_root else None):
            raise SystemExit(f"--substitute {pair!r}: {real} is not under --data-root {data_root or '(default)'}; "
                             f"`fl-split datasets` says where it is looked for")
        subs[off] = real
    _SUBSTITUTE.clear()
    _SUBSTITUTE.update(subs)
    _DATA_ROOT[0] = data_root
    return subs


# -- statistics ----------------------------------------------------------------------------------------
def fmt(m: float, s: float | None = None, digits: int = 3, pct: bool = False) -> str:
    """``0.941 ± 0.012`` (or ``94.1 ± 1.2`` with ``pct``)."""
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "–"
    k = 100.0 if pct else 1.0
    d = max(digits - 2, 1) if pct else digits
    if s is None:
        return f"{k * m:.{d}f}"
    return f"{k * m:.{d}f} ± {k * s:.{d}f}"


def fmt_ms(xs: Iterable[float | None], digits: int = 3, pct: bool = False) -> str:
    return fmt(*mean_sd(xs), digits=digits, pct=pct)


def sig(x: float | None, n: int = 3) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "–" if x is None or math.isnan(x) else "∞"
    return f"{x:.{n}g}"


# -- runs ----------------------------------------------------------------------------------------------
#: the papers' clipping setting, which every experiment was run and recorded with: C = 10, R3eLU's
#: K = N/2 (001). fl_split's own ``auto`` defaults (Laplace C = 0.01, R3eLU C = 0.1, K = N/32) are
#: chosen for a first run that trains (docs/mechanisms.md); an experiment's own value wins.
PAPER_CLIPPING = {"clip_c": 10.0, "top_k": "half"}


def config(seed: int, **kw: Any):
    """The run configuration of one experiment cell: :data:`PAPER_CLIPPING` unless ``kw`` says otherwise."""
    from fl_split.config import RunConfig

    kw = dict(kw)
    if kw.get("dataset") in _SUBSTITUTE:  # --substitute digits=mnist
        kw["dataset"] = _SUBSTITUTE[kw["dataset"]]
        kw["data_root"] = _DATA_ROOT[0]
    return RunConfig(**{"progress": False, **PAPER_CLIPPING, **kw, "seed": seed})


def train(seed: int, **kw: Any) -> dict:
    """One training on the local engine: public seed = private seed = ``seed``."""
    from fl_split.engine import LocalEngine
    from fl_split.seeding import PrivateSeed

    # PrivateSeed.legacy: the pre-issue-16 derivation, so the committed results reproduce exactly
    return LocalEngine(config(seed, **kw), private_seed=PrivateSeed.legacy(seed)).run()


def _host_alone_data(prepare):
    """``prepare`` (:func:`fl_split.builder.prepare_data`) with every guest's features replaced by
    zeros: each guest then sends the same cut-layer output for every record, so the trained model is
    a function of the host's own features alone (same modules, head, optimizer, seeds)."""
    import dataclasses

    import torch

    def wrapped(cfg):
        data = prepare(cfg)
        parties = {p: (dataclasses.replace(d, x_train=torch.zeros_like(d.x_train), x_test=torch.zeros_like(d.x_test))
                       if p != "host" and d.x_train is not None else d) for p, d in data.parties.items()}
        return dataclasses.replace(data, parties=parties)
    return wrapped


def train_host_alone(seed: int, **kw: Any) -> dict:
    """The host-alone baseline (experiments/README.md, "Verdict rules"): the same configuration as
    :func:`train`, trained as one model (``monolithic``: the same modules, weights, batch order and
    optimizer as the split run, tests/test_equivalence.py) with the guests' inputs zeroed — the
    host's own features and labels only, the same model head, epochs, batches and seed. What a split model falls back to when the guests' releases
    carry nothing: a host-protection claim is judged on the gain over it, not over the constant
    prediction. Needs a host with features (``host_features``, the default)."""
    from fl_split import builder

    if kw.get("host_features") is False:
        raise ValueError("train_host_alone: the host holds no features (host_features=False); a host-alone "
                         "model needs the host's own columns")
    if kw.get("defense", "none") != "none":
        raise ValueError(f"train_host_alone: defense={kw['defense']!r}; the host-alone baseline is undefended "
                         "(nothing leaves the host)")
    from fl_split.engine import MonolithicEngine
    from fl_split.seeding import PrivateSeed

    original = builder.prepare_data
    builder.prepare_data = _host_alone_data(original)
    try:  # the monolithic engine: the same modules and batches as the split run, without the host's checks
        # of the guests' releases (a guest releasing one constant fails its train-vs-test check)
        return MonolithicEngine(config(seed, **kw, monolithic=True), private_seed=PrivateSeed.legacy(seed)).run()
    finally:
        builder.prepare_data = original


def trivial_metric(dataset: str, seed: int, test_fraction: float = 0.2, limit: int = 0) -> float:
    """The test metric of the best *constant* prediction — the most frequent training label
    (accuracy) or the 10 most frequent (hit@10) — on the run's own split: the level a model that
    learned nothing from the features reaches (chance on balanced digits, popularity on movielens)."""
    import numpy as np

    from fl_split.data.base import positions_of, split_ids
    from fl_split.data.registry import load_dataset

    ds = load_dataset(dataset, _DATA_ROOT[0] if dataset in _SUBSTITUTE.values() else "")
    train, test = split_ids(ds, test_fraction, seed, limit)
    y_train = ds.labels[positions_of(ds.ids, train)]
    y_test = ds.labels[positions_of(ds.ids, test)]
    k = 10 if ds.metric == "hit@10" else 1
    top = np.argsort(-np.bincount(y_train, minlength=ds.num_classes), kind="stable")[:k]
    return float(np.isin(y_test, top).mean())


def read_runs(path: Path) -> list[dict]:
    """``runs.csv`` back as dicts with numbers where numbers were written (for ``--from-runs``)."""
    def cell(v: str) -> Any:
        if v == "":
            return None
        if v in ("True", "False"):
            return v == "True"
        try:
            f = float(v)
        except ValueError:
            return v
        return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f

    with path.open(newline="") as fh:
        return [{k: cell(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def merge_earlier(out: "Out", runs: list[dict], key: str, now: Sequence[Any]) -> tuple[list[dict], list[Any]]:
    """An experiment run in parts (``exp5 --parts``, ``exp8 --datasets``): the rows of the folder's
    existing ``runs.csv`` whose ``key`` this invocation did not run, put before ``runs``, so the
    tables and claims cover every part run so far. Returns the merged rows and the ``key`` values
    kept from before (``run.json`` records them). ``--quick`` and ``--out`` folders start afresh."""
    path = out.dir / "runs.csv"
    if out.args.quick or out.args.out or not path.exists():
        return runs, []
    kept = [r for r in read_runs(path) if r.get(key) not in set(now)]
    earlier = list(dict.fromkeys(r.get(key) for r in kept))
    if earlier:
        print(f"{out.name}: kept the earlier runs of {key} = {', '.join(map(str, earlier))} from {path}", flush=True)
    return kept + runs, earlier


def best_metric(res: dict) -> float | None:
    """The best per-epoch test metric (003 Tables 3 and 10 record the best, not the final one)."""
    vals = [h.get("test_metric") for h in res.get("history", []) if h.get("test_metric") is not None]
    return max(vals) if vals else None


def guest_report(res: dict, party: str = "guest-1") -> dict:
    return res.get("privacy", {}).get(party) or {}


def snr_bound(rep: dict) -> float | None:
    from fl_split.privacy.disclosure import snr_bound as _snr

    return _snr(rep) if rep else None


def attack_session(seed: int, need: str, **kw: Any):
    """A trained, observed run that the attacks named by ``need`` can share: ``membership`` (or any
    attack granted public records) builds it with the public split, ``property`` without."""
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.runner import make_session
    from fl_split.seeding import PrivateSeed

    s = make_session(config(seed, **kw), AttackOptions(attack=need), PrivateSeed.legacy(seed))
    s.run()
    return s


def attack(session, **opts: Any) -> dict:
    """Mount one attack on a trained session; the attack dict of ``run_attack``."""
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.runner import run_attack

    return run_attack(session.cfg, AttackOptions(**opts), session=session)


def run_fsha(seed: int, opts: dict, **kw: Any) -> dict:
    from fl_split.attacks.options import AttackOptions
    from fl_split.attacks.runner import run_attack
    from fl_split.seeding import PrivateSeed

    return run_attack(config(seed, **kw), AttackOptions(attack="fsha", **opts), PrivateSeed.legacy(seed))


def advantage(r: dict, perfect: float | None = None) -> float:
    """An attack's success as a normalised advantage over its trivial baseline, in [0, 1]
    (:func:`fl_split.bench.scores.advantage`, which ``fl-split bench`` uses too)."""
    from fl_split.bench.scores import advantage as _advantage

    return _advantage(r, perfect)


def dcs(ap: float, mp: float, mp_star: float, ap_star: float = 0.0, beta: float = 0.5) -> float:
    """VFLAIR's Defense Capability Score ``1/(1 + √((1−β)(AP−AP*)² + β(MP−MP*)²))`` (SPEC §7): AP =
    attack performance, MP = main-task performance, (AP*, MP*) = the ideal defence (attack at its
    trivial baseline, utility of the undefended run)."""
    return 1.0 / (1.0 + math.sqrt((1 - beta) * (ap - ap_star) ** 2 + beta * (mp - mp_star) ** 2))


def dpsgd_sigma_for(epsilon: float, delta: float = 1e-5) -> float:
    """DP-SGD noise multiplier σ (``--sigma``) whose one step costs ``epsilon`` per record at
    ``delta``: fl_split charges a step as the Gaussian mechanism of multiplier σ/2 (replace-one
    moves a clipped sum by 2C) and each record is in one step per epoch, so this is DP-SGD at
    ``epsilon`` per record per epoch, the same footing as a cut-layer mechanism's ``--epsilon``
    per release (one release per record per epoch). Solved by bisection on the analytic
    Gaussian (``dp_accounting``)."""
    from fl_split.privacy.accountants import gaussian_epsilon

    lo, hi = 1e-3, 1e4
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if gaussian_epsilon(mid / 2.0, delta) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def gaussian_sigma_for(epsilon: float, width: int, bound: float = 1.0, delta: float = 1e-5) -> float:
    """σ of the Gaussian cut-layer mechanism (tanh layer of ``width`` elements, L2 sensitivity
    ``2·bound·√width``) whose one release costs ``epsilon`` at ``delta``."""
    from fl_split.privacy.accountants import gaussian_epsilon

    sens = 2.0 * bound * math.sqrt(width)
    lo, hi = 1e-4, 1e6
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if gaussian_epsilon(mid / sens, delta) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


# -- outputs -------------------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in ("torch", "numpy", "opacus", "dp_accounting", "flwr", "sklearn", "fl_split"):
        try:
            m = __import__(mod)
            out[mod] = str(getattr(m, "__version__", "?"))
        except Exception:  # pragma: no cover - optional
            out[mod] = "not installed"
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           timeout=10).stdout.strip()
    except Exception:  # pragma: no cover
        out["git_commit"] = "?"
    return out


class Out:
    """The output folder of one experiment and what goes into it."""

    def __init__(self, name: str, args: argparse.Namespace, script: str) -> None:
        self.name = name
        self.args = args
        self.t0 = time.perf_counter()
        subs = use_datasets(getattr(args, "substitute", []), getattr(args, "data_root", ""))
        folder = name + "".join(f"+{real}" for real in subs.values())
        self.committed = RESULTS / folder
        if getattr(args, "verify", False):
            if args.quick or getattr(args, "from_runs", False):
                raise SystemExit(f"{name}: --verify re-runs the committed configuration; it does not combine with "
                                 "--quick or --from-runs")
            args.seeds = [0]
            self.dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"fl_split_verify_{name}_"))
        elif args.out:
            self.dir = Path(args.out)
        elif args.quick:
            self.dir = Path(tempfile.gettempdir()) / "fl_split_experiments_quick" / folder
        else:
            self.dir = RESULTS / folder
        self.dir.mkdir(parents=True, exist_ok=True)
        self.script = script
        self.files: list[str] = []

    def path(self, fname: str) -> Path:
        self.files.append(fname)
        return self.dir / fname

    def csv(self, fname: str, rows: list[dict], fields: Sequence[str] | None = None) -> Path:
        fields = list(fields or dict.fromkeys(k for r in rows for k in r))
        p = self.path(fname)
        if fname == "runs.csv" and getattr(self.args, "from_runs", False):
            return p  # the measured runs are the input of a rebuild, never rewritten by it
        with p.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow({k: _cell(r.get(k)) for k in fields})
        return p

    def md(self, fname: str, text: str) -> Path:
        p = self.path(fname)
        p.write_text(text.rstrip() + "\n")
        return p

    def json(self, fname: str, obj: Any) -> Path:
        p = self.path(fname)
        p.write_text(json.dumps(obj, indent=1, default=_jsonable, allow_nan=True) + "\n")
        return p

    def figure(self, fname: str, fig) -> Path:
        p = self.path(fname)
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        import matplotlib.pyplot as plt

        plt.close(fig)
        return p

    def claims(self, claims: list[dict]) -> Path:
        for c in claims:
            c.setdefault("experiment", self.name)
            c.setdefault("n", len(self.args.seeds))
            guard(c, int(c["n"]))  # n ≥ 2 or inconclusive (issue 26)
            assert c["verdict"] in VERDICTS, c
            assert c.get("rule"), f"claim {c['id']} has no rule (issue 19: every verdict states its rule)"
        return self.json("claims.json", claims)

    def command(self) -> str:
        """The command line that reproduces this invocation."""
        if Path(sys.argv[0]).name == self.script:
            return " ".join([".venv/bin/python", f"experiments/{self.script}", *sys.argv[1:]])
        return f".venv/bin/python experiments/{self.script} " + " ".join(_argv_of(self.args))

    def record_addition(self, what: dict) -> dict:
        """Runs added to a committed folder (e.g. ``exp2 --settle``'s extra seeds): the earlier
        ``run.json`` keeps its provenance and lists this addition under ``added``."""
        prior = self.dir / "run.json"
        meta = json.loads(prior.read_text()) if prior.exists() else {"experiment": self.name}
        meta.setdefault("added", []).append({
            "command": self.command(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - self.t0, 1), "versions": _versions(), **what})
        prior.write_text(json.dumps(meta, indent=1, default=_jsonable) + "\n")
        print(f"[{self.name}] added runs recorded in {prior}", flush=True)
        return meta

    def finish(self, extra: dict | None = None) -> dict:
        if getattr(self.args, "verify", False):
            return self._verify()
        prior = self.dir / "run.json"
        if getattr(self.args, "from_runs", False) and prior.exists():
            # the numbers are the earlier run's: keep its provenance, record the rebuild beside it
            meta = json.loads(prior.read_text())
            meta["rebuilt_from_runs"] = {
                "command": self.command(),
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "versions": _versions()}
            prior.write_text(json.dumps(meta, indent=1, default=_jsonable) + "\n")
            print(f"[{self.name}] rebuilt tables and claims from runs.csv in {self.dir}", flush=True)
            return meta
        meta = {
            "experiment": self.name,
            "command": self.command(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - self.t0, 1),
            "quick": bool(self.args.quick),
            "seeds": list(self.args.seeds),
            "versions": _versions(),
            "cpu_threads": 1,
            "files": sorted(set(self.files)),
            **(extra or {}),
        }
        (self.dir / "run.json").write_text(json.dumps(meta, indent=1, default=_jsonable) + "\n")
        print(f"[{self.name}] wrote {len(set(self.files))} files to {self.dir} in {meta['seconds']:.0f} s", flush=True)
        return meta


    def _verify(self) -> dict:
        """``--verify``: compare this seed-0 re-run with the committed runs (see :func:`verify_runs`)."""
        report = {"experiment": self.name, "command": self.command(), "versions": _versions(),
                  "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "committed": str(self.committed), "files": {}}
        drifted = 0
        for fname, (keys, values) in VERIFY_KEYS[self.name].items():
            new, old = self.dir / fname, self.committed / fname
            if not new.exists():
                continue
            if not old.exists():
                raise SystemExit(f"{self.name}: --verify has nothing to compare with: {old} does not exist")
            cells = verify_runs(read_runs(new), read_runs(old), keys, values)
            report["files"][fname] = cells
            drifted += sum(not c["ok"] for c in cells)
            for c in cells:
                flag = "ok   " if c["ok"] else "DRIFT"
                print(f"[{self.name} verify] {flag} {fname} {c['cell']} {c['field']}: committed {c['committed']:.6g} "
                      f"now {c['now']:.6g} (|Δ| {c['diff']:.3g}, tolerance {c['tolerance']:.3g})", flush=True)
        report["drifted"] = drifted
        report["cells"] = sum(len(v) for v in report["files"].values())
        (self.dir / "verify.json").write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
        print(f"[{self.name} verify] {report['cells'] - drifted} of {report['cells']} cells reproduce the committed "
              f"seed-0 numbers; report {self.dir / 'verify.json'}", flush=True)
        if drifted:
            raise SystemExit(1)
        return report


#: per experiment, per runs file: the columns that name a cell and the measured columns compared by --verify
VERIFY_KEYS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "exp1_merge_padding": {"runs.csv": (("dataset", "padding", "merge"), ("value",))},
    "exp2_utility_epsilon": {"runs.csv": (("dataset", "defence", "direction", "epsilon"), ("value",))},
    "exp3_property_reconstruction": {"runs.csv": (("dataset", "defence", "direction", "epsilon", "attack"),
                                                  ("value", "utility"))},
    "exp4_fsha": {"runs.csv": (("config",), ("mse", "ssim"))},
    "exp5_denoising": {"runs.csv": (("family", "level", "denoise"), ("best",))},
    "exp6_rr_vs_laplace": {"runs.csv": (("cut", "mechanism", "eps_per_element"), ("accuracy", "ssim", "f1"))},
    "exp7_cut_layer_labels": {"cut_runs.csv": (("padding", "cut"), ("value",)),
                              "label_runs.csv": (("dataset", "defence", "attack"), ("value", "utility"))},
    "exp8_privacy_utility_attacks": {"runs.csv": (("dataset", "defence", "epsilon", "attack"), ("value", "utility"))},
}


def verify_runs(new: list[dict], old: list[dict], keys: Sequence[str], values: Sequence[str]) -> list[dict]:
    """Each re-run cell (seed 0) against the committed seed-0 run of the same cell. A cell reproduces
    when ``|now − committed|`` is within the larger of 2 sd over the committed seeds (the seed spread
    the verdicts are judged with) and ``0.005 + 2 %`` of the committed value (numerical drift)."""
    out = []
    for r in new:
        cell = tuple(r.get(k) for k in keys)
        same = [o for o in old if tuple(o.get(k) for k in keys) == cell]
        base = [o for o in same if o.get("seed") == r.get("seed")]
        for f in values:
            now, ref = r.get(f), (base[0].get(f) if base else None)
            if now is None or ref is None:
                continue
            sd = mean_sd(o.get(f) for o in same)[1] if len(same) > 1 else 0.0
            tol = max(2 * sd, 0.005 + 0.02 * abs(float(ref)))
            diff = abs(float(now) - float(ref))
            out.append({"cell": dict(zip(keys, cell)), "field": f, "committed": float(ref), "now": float(now),
                        "diff": diff, "tolerance": tol, "ok": diff <= tol})
    return out


def _argv_of(args: argparse.Namespace) -> list[str]:
    out = []
    for k, v in vars(args).items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            if v:
                out.append(flag)
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        elif v not in ("", None):
            out += [flag, str(v)]
    return out


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return " ".join(_cell(x) if not isinstance(x, str) else x for x in map(_cell, v))
    return "" if v is None else v


def _jsonable(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except Exception:  # pragma: no cover
        pass
    return str(o)


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    header = list(header)
    al = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else "---" for a in al]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as _plt

    return _plt


def claim(cid: str, source: str, claim_text: str, paper: str, ours: str, verdict: str, note: str = "", *,
          rule: str, p: float | None = None, n: int | None = None, deterministic: bool = False,
          tested: bool = True) -> dict:
    """One row of the claim table (experiments/README.md, "Verdict rules").

    ``rule``: how the verdict is decided — the statistic, the threshold and the seeds (printed in the
    table beside the verdict). ``p``: the p-value of the test the verdict rests on — for a decided
    verdict the test that decided it, for an *inconclusive* one the test that came closest to
    deciding it (the smallest p among the tests that would have) — so that ``claims.py``'s Holm
    correction counts every test run, significant or not; ``n``: the seeds it rests on (default: the
    run's; fewer than 2 makes a decided verdict inconclusive unless ``deterministic``).
    ``tested=False`` marks a verdict decided without a test (a ranking of means, a count):
    ``claims.py`` refuses a decided or inconclusive verdict on ≥ 2 seeds that carries no p unless
    it is marked so."""
    c = {"id": cid, "source": source, "claim": claim_text, "paper": paper, "ours": ours, "verdict": verdict,
         "note": note, "rule": rule}
    if p is not None and p == p and verdict in (HOLDS, PARTLY, FAILS, INCONCLUSIVE):
        c["p"] = float(f"{p:.3g}")  # 3 significant digits: a rebuild from runs.csv (6 digits) gives the same
    if n is not None:
        c["n"] = int(n)
    if deterministic:
        c["deterministic"] = True
    if not tested:
        c["tested"] = False
    return c


def runs_or_train(out: "Out", args: argparse.Namespace) -> list[dict] | None:
    """``--from-runs``: the output folder's ``runs.csv`` (nothing is trained; tables, claims and plots
    are rebuilt from it), else ``None``."""
    if not getattr(args, "from_runs", False):
        return None
    path = out.dir / "runs.csv"
    if not path.exists():
        raise SystemExit(f"{out.name}: --from-runs needs {path} (run the experiment once first)")
    runs = read_runs(path)
    seeds = sorted({int(r["seed"]) for r in runs if r.get("seed") is not None})
    if seeds:
        args.seeds = seeds
    return runs


def progress(name: str, t0: float, *what: Any) -> None:
    print(f"[{name} {time.perf_counter() - t0:6.0f} s]", *what, flush=True)


def quiet_env() -> None:
    os.environ.setdefault("FL_SPLIT_NO_DOWNLOAD", "1")
