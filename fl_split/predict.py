"""``fl-split predict`` (issue 24): score new rows with a saved split model, in one process.

Each party is an object of its own (:class:`GuestScorer`, :class:`HostScorer`) that loads only its
own folder of the saved model (:mod:`fl_split.serving`) and reads only its own new table:

1. the new IDs are aligned as in training: ``--align public`` (the host's IDs are the list; every
   guest must hold each) or ``psi`` (:func:`fl_split.psi.align_by_psi`: only the intersection is
   learnt);
2. each guest encodes its rows with its saved preprocessing, runs its bottom and **releases** the
   cut-layer output through its saved mechanism with fresh noise (OS entropy: inference is a new
   release, never a replay of training noise), charged first to its *inference ledger*, written as
   ``DIR/<guest>/inference-ledger.json`` (each new record released once per call; the ledger adds up
   over calls);
3. the host merges (its receiver-side denoising included), runs its top and writes the predictions,
   owner-only: the host table's own ID column(s) (names and values as its table holds them; a
   composite key as its columns), one probability column per class (or the value, for regression)
   and the predicted class. With the label column in its table it computes the task's metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_split.errors import ConfigError, DataError


def _config(manifest: dict, model=None):
    """The saved public configuration; ``model``: the model factory the run was trained with (a Python
    function that is not importable by name is saved by its label only, docs/api.md)."""
    from fl_split.config import RunConfig

    if model is None:
        return RunConfig.from_mapping(manifest["config"])
    return RunConfig.from_mapping({k: v for k, v in manifest["config"].items() if k != "model"}).replace(model=model)


def _table(path: str, party: str, id_column: str):
    from fl_split.data.own import _ids, read_table

    from fl_split.data.ids import parse_columns

    frame = read_table(path, f"--data {party}", parse_columns(id_column))
    ids, names = _ids(frame, id_column, f"{party} ({Path(path).name})")
    return ids, names, frame


class _Scorer:
    def __init__(self, directory: str | Path, party: str, table_path: str, id_column: str, model=None) -> None:
        from fl_split.serving import load_part

        self.name = party
        self.manifest, self.files = load_part(directory, party)
        self.directory = Path(directory).expanduser()
        self.cfg = _config(self.manifest, model)
        self.pre = json.loads(self.files["preprocessing.json"])
        if self.pre.get("padded"):
            raise DataError(f"--model: {party}'s part was trained with --padding; predict does not pad yet")
        # names: the party's own key -> ID value mapping (text IDs; None for integer IDs), never sent
        self.ids, self.names, self.frame = _table(table_path, party, id_column)
        #: how this party's errors about its table open: the party, its table's path, its saved part
        self.where = f"{party} (table {table_path}, saved part {self.directory / party})"

    def _arch(self):
        from fl_split.builder import _architecture

        return _architecture(self.cfg, self.manifest["num_outputs"], None)

    def features(self, shared: np.ndarray) -> torch.Tensor:
        from fl_split.data.base import apply_preprocessing, positions_of

        pos = positions_of(self.ids, shared, who=self.name)
        return torch.from_numpy(apply_preprocessing(self.pre, table=self.frame.iloc[pos].reset_index(drop=True),
                                                    where=self.where))


class GuestScorer(_Scorer):
    """A guest at prediction time: its bottom, its preprocessing, its mechanism, its inference ledger."""

    def __init__(self, directory, party, table_path, id_column, model=None) -> None:
        super().__init__(directory, party, table_path, id_column, model)
        from fl_split.models.registry import build_bottom
        from fl_split.serving import load_state

        m = self.manifest
        self.bottom = build_bottom(self._arch(), party, tuple(m["input_shape"]), m["cut"], m["guest_cut_activation"], None)
        self.bottom.load_state_dict(load_state(self.files)["bottom"])
        self.bottom.eval()
        if self.cfg.schedule != "constant":
            raise ConfigError("schedule", self.cfg.schedule, "constant for a model that predicts",
                              reason="a geometric schedule has no mechanism for releases after training")

    def release(self, shared: np.ndarray, budget: float | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """The released cut-layer output of the ``shared`` rows (charged first; fresh noise). ``budget``:
        a release that would take the inference ledger over ε = ``budget`` is refused before anything
        is computed (:class:`~fl_split.errors.BudgetExceeded`; the ledger file is unchanged)."""
        from fl_split.builder import make_ledger
        from fl_split.privacy import factory
        from fl_split.privacy.ledger import Ledger, LedgerEntry
        from fl_split.seeding import PartySecret

        width = int(np.prod(self.manifest["cut_shape"]))
        mech = factory.forward_mechanism(self.cfg, width, 1)
        path = self.directory / self.name / "inference-ledger.npz"
        ledger = make_ledger(self.cfg.replace(budget="auto"), self.name)
        if ledger is not None and path.exists():
            from fl_split.state import unflatten

            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files if k != "__skeleton__"}
                ledger = Ledger.from_state(unflatten(arrays, json.loads(str(z["__skeleton__"]))))
        if ledger is not None:
            ledger.budget = None if budget is None else float(budget)
        calls = len(ledger) if ledger is not None else 0  # earlier predict calls (one ledger entry each)
        cost = mech.cost()
        if ledger is not None and cost is not None:
            ledger.charge([LedgerEntry(0, ("predict", 0, int(calls)), "forward", cost, np.asarray(shared, np.int64),
                                       None)])
        with torch.no_grad():
            v = self.bottom(self.features(shared))
        gen = PartySecret.fresh().torch_generator("inference", 0) if mech.random else None
        value = mech.release(v, gen).value
        report: dict[str, Any] = {"mechanism": mech.name, "records": int(len(shared))}
        if ledger is None or cost is None:
            report.update(epsilon=None, covered=False,
                          note="released without a differential-privacy mechanism (--defense none): not covered")
        else:
            from fl_split.secure_files import write_private
            from fl_split.state import flatten

            import io

            arrays, skeleton = flatten(ledger.export_state())
            buf = io.BytesIO()
            np.savez(buf, __skeleton__=np.asarray(json.dumps(skeleton)), **arrays)
            write_private(path, buf.getvalue())
            report.update(epsilon=ledger.epsilon(), covered=True, accountant=self.cfg.accountant,
                          delta=self.cfg.delta, ledger=str(path))
        return value, report


class HostScorer(_Scorer):
    """The host at prediction time: its bottom (if any), merge, top, task; the predictions stay with it."""

    def __init__(self, directory, party, table_path, id_column, label_column: str, model=None) -> None:
        super().__init__(directory, party, table_path, id_column, model)
        from fl_split.merge import Merge
        from fl_split.models.registry import build_bottom, build_top
        from fl_split.seeding import PartySecret
        from fl_split.serving import load_state

        m = self.manifest
        state = load_state(self.files)
        arch = self._arch()
        secret = PartySecret.fresh()  # initial weights, all replaced by the saved ones
        self.bottom = None
        if "bottom" in state:
            self.bottom = build_bottom(arch, "host", tuple(m["input_shape"]), m["cut"], "native", None)
            self.bottom.load_state_dict(state["bottom"])
            self.bottom.eval()
        self.top = build_top(arch, tuple(m["merged_shape"]), m["cut"], m["num_outputs"], secret)
        self.top.load_state_dict(state["top"])
        self.top.eval()
        self.merge = Merge(m["merge"])
        self.task_info = json.loads(self.files["task.json"])
        self.label_column = label_column
        self.id_column = id_column
        from fl_split.data.ids import parse_columns

        # the predictions hold the ID column(s) beside the score columns: a name both would use is
        # refused here, before any guest releases anything
        taken = [c for c in parse_columns(id_column) if c in {"prediction", "predicted"}
                 or (c.startswith("p_") and c[2:].isdigit())]
        if taken:
            raise ConfigError("id-column", id_column, "ID column names other than prediction, predicted and p_0, "
                              "p_1, … (the predictions' own columns)", reason=f"{taken[0]!r} would be written twice")

    def id_columns(self, shared: np.ndarray) -> dict[str, Any]:
        """The ``shared`` rows' ID column(s) exactly as the host's own table holds them: the same names,
        values and types (a composite key as its columns; a CSV's IDs as their text), so the
        predictions join back on the user's own key."""
        from fl_split.data.base import positions_of
        from fl_split.data.ids import parse_columns

        pos = positions_of(self.ids, shared, who=self.name)
        return {c: self.frame[c].iloc[pos].reset_index(drop=True) for c in parse_columns(self.id_column)}

    def predict(self, shared: np.ndarray, released: dict[str, torch.Tensor]) -> dict[str, Any]:
        from fl_split.privacy import factory
        from fl_split.seeding import PartySecret

        post = factory.postprocess(self.cfg, "forward")
        gen = PartySecret.fresh().torch_generator("denoise", 0) if post.random else None
        with torch.no_grad():
            parts = [self.bottom(self.features(shared))] if self.bottom is not None else []
            parts += [post(released[g], gen) for g in self.manifest["guest_shapes"]]
            return {"out": self.top(self.merge(parts))}

    def class_index(self, y: np.ndarray) -> np.ndarray:
        """Label values as class indices (the saved label mapping; an unseen value is refused)."""
        classes = self.task_info.get("classes")
        if not classes:
            try:
                return np.asarray(y).astype(np.int64)
            except (TypeError, ValueError):
                raise DataError(f"host: column {self.label_column!r} holds {y[0]!r}; the model's classes are "
                                f"0..{self.task_info['num_classes'] - 1}") from None
        index = {str(c): k for k, c in enumerate(classes)}
        out = np.empty(len(y), np.int64)
        for i, v in enumerate(y):
            key = str(int(v)) if isinstance(v, (float, np.floating)) and float(v).is_integer() else str(v)
            if key not in index:
                raise DataError(f"host: column {self.label_column!r} holds {v!r}, not one of the model's classes "
                                f"{classes}")
            out[i] = index[key]
        return out

    def labels(self, shared: np.ndarray) -> np.ndarray | None:
        from fl_split.data.base import positions_of

        if self.label_column not in self.frame.columns:
            return None
        pos = positions_of(self.ids, shared, who="host")
        return self.frame[self.label_column].to_numpy()[pos]


def predict(model_dir: str, tables: dict[str, str], id_column: str, out: str, align: str = "public",
            label_column: str = "label", budget: float | None = None, model=None) -> dict[str, Any]:
    """Score the new rows of ``tables`` (party → path) with the saved model in ``model_dir``; write
    ``out`` (owner-only CSV, host only) and return the summary (metrics, each party's epsilon).
    ``budget``: each guest's inference-ledger ε budget; a guest that would exceed it refuses, and
    nothing reaches the host (a guest charged before that refusal stays charged: conservative).
    ``model``: the model factory of a run trained from Python with a function that cannot be imported
    by name (a lambda, a notebook's function; :class:`fl_split.api.SavedModel` passes it)."""
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0 and np.isfinite(budget)):
        raise ConfigError("budget", budget, "a number > 0")
    from fl_split.serving import check_parts, load_part

    if "host" not in tables:
        raise ConfigError("data", ";".join(f"{p}={v}" for p, v in tables.items()), "host=PATH;guest-1=PATH;…",
                          reason="the host's new table is needed")
    check_parts({p: load_part(model_dir, p)[0] for p in tables})
    host = HostScorer(model_dir, "host", tables["host"], id_column, label_column, model)
    guests = {g: GuestScorer(model_dir, g, tables[g], id_column, model) for g in host.manifest["guest_shapes"]}
    if align == "public":
        from fl_split.data.own import check_public_ids

        shared = np.sort(host.ids)
        for g, s in guests.items():  # before any release; the host names its own missing IDs
            check_public_ids(s.ids, shared, s.where, host.names, host.where)
    elif align == "psi":
        from fl_split.psi import align_by_psi

        shared = align_by_psi({"host": host.ids, **{g: s.ids for g, s in guests.items()}}, lambda *a: None)
    else:
        raise ConfigError("align", align, "public or psi")
    released, privacy = {}, {}
    for g, s in guests.items():  # each guest releases its new rows' cut-layer outputs
        released[g], privacy[g] = s.release(shared, budget)
    return write_predictions(host, shared, released, privacy, id_column, out)


def write_predictions(host: HostScorer, shared: np.ndarray, released: dict[str, torch.Tensor],
                      privacy: dict[str, Any], id_column: str, out: str) -> dict[str, Any]:
    """The host's last step, wherever the parties run (one process, a Flower simulation or
    deployment, :mod:`fl_split.flower.predicting`): merge the guests' ``released`` cut-layer outputs
    of the ``shared`` rows, run the top, write ``out`` (owner-only) and return the summary (with the
    task's metrics when the host's table has the label; ``privacy``: the guests' reports)."""
    import pandas as pd

    from fl_split.secure_files import create_private
    from fl_split.tasks import task_metrics

    out_t = host.predict(shared, released)["out"]
    task = host.task_info["task"]
    frame = host.id_columns(shared)
    if task == "regression":
        mean, sd = host.task_info["target_scale"]
        frame["prediction"] = out_t[:, 0].double().numpy() * sd + mean
        scores = out_t[:, 0].double().numpy()
    else:
        prob = torch.softmax(out_t.float(), dim=1).double().numpy()  # as the host scored the test split
        for k in range(prob.shape[1]):
            frame[f"p_{k}"] = prob[:, k]
        predicted = out_t.argmax(dim=1).numpy()
        classes = host.task_info.get("classes")
        frame["predicted"] = np.asarray(classes, dtype=object)[predicted] if classes else predicted
        scores = prob[:, 1] if task == "binary" else predicted.astype(np.float64)
    create_private(out)
    pd.DataFrame(frame).to_csv(out, index=False)
    summary: dict[str, Any] = {"records": int(len(shared)), "task": task, "out": out, "privacy": privacy}
    y = host.labels(shared)
    if y is not None:
        scale = tuple(host.task_info["target_scale"] or (0.0, 1.0))
        if task == "regression":
            y = (np.asarray(y, np.float64) - scale[0]) / scale[1]
        else:
            y = host.class_index(y)
        summary["metrics"] = task_metrics("multiclass" if task == "next-item" else task, scores, y, scale)
    return summary
