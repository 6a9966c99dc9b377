"""One party's deployment data in one file: ``host.npz``, ``guest-1.npz``, …

In a real deployment each organisation runs its own Flower SuperNode with only its own data.
``fl-split export-parties`` prepares the shipped / downloaded dataset the same way a simulation
does (:func:`fl_split.builder.prepare_data`: shared-ID split, column partition, each party's own
alignment and encoding) and writes one file per party, so a SuperNode gets its party's slice and
nothing else (a guest file holds no labels).

A file is a NumPy ``.npz`` (loaded with ``allow_pickle=False``) holding the party's
``train_ids``, ``test_ids``, ``x_train`` / ``x_test`` (feature holders) and ``y_train`` /
``y_test`` (host only), plus a JSON document ``__meta__`` with the party's own metadata and the
run's **public facts**: dataset, the data options it was prepared with, the sizes of the shared
train/test ID lists, every feature holder's input shape (widths are public metadata in VFL) and
the metric. The host's file adds the number of classes (the top model's output size).

From the facts any node — and the coordinator, which never sees data — rebuilds the run plan
(:func:`plan_from_facts`), identical to :func:`fl_split.builder.plan_run` on the full data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_split.config import DATA_KEYS, RunConfig, key_of
from fl_split.errors import ConfigError, DataError

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI imports this module to build its parser
    from fl_split.data.base import PartyData

FORMAT = "fl_split.party/1"

#: options that decide what a party's data file contains; a run must use the same values


@dataclass
class PublicFacts:
    """What every party may know about the run's data (and all the coordinator needs)."""

    dataset: str
    task: str
    metric: str
    n_train: int
    n_test: int
    input_shapes: dict[str, tuple[int, ...]]
    data_config: dict[str, Any]
    #: the number of classes; only in the host's file (guests do not need the label space)
    num_classes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "task": self.task, "metric": self.metric, "n_train": self.n_train,
                "n_test": self.n_test, "input_shapes": {p: list(s) for p, s in self.input_shapes.items()},
                "data_config": dict(self.data_config), "num_classes": self.num_classes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PublicFacts":
        return cls(dataset=str(d["dataset"]), task=str(d["task"]), metric=str(d["metric"]),
                   n_train=int(d["n_train"]), n_test=int(d["n_test"]),
                   input_shapes={p: tuple(int(x) for x in s) for p, s in d["input_shapes"].items()},
                   data_config=dict(d["data_config"]),
                   num_classes=None if d.get("num_classes") is None else int(d["num_classes"]))

    def without_labels(self) -> "PublicFacts":
        return PublicFacts(self.dataset, self.task, self.metric, self.n_train, self.n_test,
                           dict(self.input_shapes), dict(self.data_config), None)


def data_config(cfg: RunConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in DATA_KEYS}


def public_facts(cfg: RunConfig, prepared) -> PublicFacts:
    """The public facts of ``prepared`` (a :class:`fl_split.builder.PreparedData`)."""
    from fl_split.data.base import feature_parties

    holders = feature_parties(cfg.guests, cfg.host_features)
    return PublicFacts(dataset=prepared.dataset, task=prepared.task, metric=prepared.metric,
                       n_train=len(prepared.train_ids), n_test=len(prepared.test_ids),
                       input_shapes={p: tuple(prepared.parties[p].input_shape) for p in holders},
                       data_config=data_config(cfg), num_classes=int(prepared.num_classes))


def check_facts(cfg: RunConfig, facts: PublicFacts, source: str) -> None:
    """Raise :class:`ConfigError` if ``cfg`` asks for other data than ``facts`` describe."""
    for k in DATA_KEYS:
        have, want = facts.data_config.get(k), getattr(cfg, k)
        if have != want:
            raise ConfigError(key_of(k), want, repr(have),
                              reason=f"{source} was exported with {key_of(k)}={have!r}; re-export the "
                                     f"party files or run with the same value")


def plan_from_facts(cfg: RunConfig, facts: PublicFacts):
    """The :class:`~fl_split.builder.RunPlan` of ``cfg`` from public facts alone (no data)."""
    from fl_split.builder import plan_run
    from fl_split.data.base import feature_parties

    holders = feature_parties(cfg.guests, cfg.host_features)
    missing = [p for p in holders if p not in facts.input_shapes]
    if missing:
        raise DataError(f"the run's public facts have no input shape for {missing} "
                        f"(they list {sorted(facts.input_shapes)})")
    # plan_run reads only these public attributes of its ``prepared`` argument
    stand_in = SimpleNamespace(
        parties={p: SimpleNamespace(input_shape=tuple(s)) for p, s in facts.input_shapes.items()},
        train_ids=range(facts.n_train), test_ids=range(facts.n_test),
        num_classes=facts.num_classes or 0, metric=facts.metric)
    return plan_run(cfg, stand_in)


# -- files -------------------------------------------------------------------------------------
def save_party(path: str | os.PathLike, data: "PartyData", facts: PublicFacts) -> Path:
    """Write ``data`` (one party) and the public ``facts`` to ``path`` (``.npz``).

    A guest's file never contains labels nor the number of classes."""
    path = Path(path)
    is_host = data.party == "host"
    if not is_host and (data.y_train is not None or data.y_test is not None):
        raise ValueError(f"{data.party}: a guest's data must not hold labels")
    arrays: dict[str, np.ndarray] = {
        "train_ids": np.asarray(data.train_ids, np.int64), "test_ids": np.asarray(data.test_ids, np.int64)}
    if data.x_train is not None:
        arrays["x_train"] = data.x_train.numpy()
        arrays["x_test"] = data.x_test.numpy()
    if is_host:
        arrays["y_train"] = data.y_train.numpy()
        arrays["y_test"] = data.y_test.numpy()
    meta = {"format": FORMAT, "party": data.party, "feature_names": list(data.feature_names),
            "task": data.task, "metric": data.metric, "padded": bool(data.padded),
            "num_classes": int(data.num_classes) if is_host else 0,
            "facts": (facts if is_host else facts.without_labels()).to_json()}
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def load_party(path: str | os.PathLike) -> tuple["PartyData", PublicFacts]:
    """Read a file written by :func:`save_party`; a missing or foreign file is a :class:`DataError`."""
    import torch

    from fl_split.data.base import PartyData
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"party data file {str(path)!r} does not exist (node-config 'data-path'; "
                        f"write the files with `fl-split export-parties`)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(arrays.pop("__meta__").tobytes().decode("utf-8"))
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{path}: not an fl_split party file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise DataError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")

    def tensor(name: str) -> "torch.Tensor | None":
        return torch.from_numpy(np.ascontiguousarray(arrays[name])) if name in arrays else None

    data = PartyData(party=str(meta["party"]), train_ids=arrays["train_ids"].astype(np.int64),
                     test_ids=arrays["test_ids"].astype(np.int64), x_train=tensor("x_train"),
                     x_test=tensor("x_test"), y_train=tensor("y_train"), y_test=tensor("y_test"),
                     feature_names=list(meta["feature_names"]), num_classes=int(meta["num_classes"]),
                     task=str(meta["task"]), metric=str(meta["metric"]), padded=bool(meta["padded"]))
    return data, PublicFacts.from_json(meta["facts"])


def export_parties(cfg: RunConfig, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Prepare ``cfg``'s data and write ``host.npz``, ``guest-1.npz`` … into ``out_dir``."""
    from fl_split.builder import prepare_data

    if cfg.one_shot:
        raise ConfigError("one-shot", True, "false", reason="party files hold private data only; one-shot "
                          "pretraining needs the public records and runs in simulation")
    prepared = prepare_data(cfg)
    facts = public_facts(cfg, prepared)
    out = Path(out_dir).expanduser()
    return {p: save_party(out / f"{p}.npz", d, facts) for p, d in prepared.parties.items()}
