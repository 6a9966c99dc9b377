"""``fl-split predict`` (issue 24): score new rows with a saved split model, in one process.

Each party is an object of its own (:class:`GuestScorer`, :class:`HostScorer`) that loads only its
own folder of the saved model (:mod:`fl_split.serving`) and reads only its own new table:

1. the new IDs are aligned as in training: ``--align public`` (the host's IDs are the list; every
   guest must hold each) or ``psi`` (:func:`fl_split.psi.align_by_psi`: only the intersection is
   learnt);
2. each guest encodes its rows with its saved preprocessing, runs its bottom and **releases** the
   cut-layer output through its saved mechanism with fresh noise (OS entropy: inference is a new
   release, never a replay of training noise), charged first to its *inference ledger*, written as
   ``DIR/<guest>/inference-ledger.npz`` (each new record released once per call; the ledger adds up
   over calls), within its **own inference limits** (:class:`InferenceLimits`: an ε budget over that
   ledger and a per-ID query cap counted in ``DIR/<guest>/inference-queries.npz``; a release past
   either is refused before anything is computed, charged or written; docs/serving.md "Inference
   limits");
3. the host merges (its receiver-side denoising included), runs its top and writes the predictions,
   owner-only: the host table's own ID column(s) (names and values as its table holds them; a
   composite key as its columns), one probability column per class (or the value, for regression)
   and the predicted class. With the label column in its table it computes the task's metrics.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_split.errors import ConfigError, DataError, FlSplitError

#: a guest's per-ID query cap when its own configuration sets none (docs/serving.md "Inference limits")
DEFAULT_MAX_QUERIES_PER_ID = 3
#: the files beside a guest's saved part that remember its inference releases (never reset by fl_split)
LEDGER_FILE, QUERIES_FILE = "inference-ledger.npz", "inference-queries.npz"


class InferenceRefused(FlSplitError):
    """A guest refused an inference release under its own per-ID query cap; nothing was released or charged."""


@dataclass(frozen=True)
class InferenceLimits:
    """A guest's own limits on inference releases (docs/serving.md "Inference limits").

    ``budget``: the ε its inference ledger may reach over all its calls; ``None``: the ε that
    ``max_queries_per_id`` releases of one record reach under its saved mechanism (so the cap refuses
    first). ``max_queries_per_id``: how many times one record may be released for inference, over all
    calls. A caller (a coordinator's job) can only tighten them: :meth:`GuestScorer.release`."""

    budget: float | None = None
    max_queries_per_id: int = DEFAULT_MAX_QUERIES_PER_ID

    def __post_init__(self) -> None:
        check_limits(self.budget, self.max_queries_per_id)


def check_limits(budget, max_queries_per_id) -> None:
    """Refuse (one line) an inference budget that is not a finite number > 0 or a per-ID cap that is not
    an integer >= 1 (``None``: not set)."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not (budget > 0 and math.isfinite(budget))):
        raise ConfigError("budget", budget, "a number > 0")
    if max_queries_per_id is not None and (isinstance(max_queries_per_id, bool)
                                           or not isinstance(max_queries_per_id, (int, np.integer))
                                           or max_queries_per_id < 1):
        raise ConfigError("max-queries-per-id", max_queries_per_id, "an integer >= 1")


def _read_queries(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, counts)`` of the per-ID query counts file (sorted IDs; empty before the first call)."""
    if not path.exists():
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    with np.load(path, allow_pickle=False) as z:
        return z["ids"].astype(np.int64), z["counts"].astype(np.int64)


def _counts_of(ids: np.ndarray, counts: np.ndarray, want: np.ndarray) -> np.ndarray:
    """How many times each ID of ``want`` was released so far (0 for one never released)."""
    pos = np.minimum(np.searchsorted(ids, want), max(len(ids) - 1, 0))
    hit = (ids[pos] == want) if len(ids) else np.zeros(len(want), bool)
    return np.where(hit, counts[pos] if len(ids) else 0, 0).astype(np.int64)


def _config(manifest: dict, model=None):
    """The saved public configuration; ``model``: the model factory the run was trained with (a Python
    function that is not importable by name is saved by its label only, docs/api.md)."""
    from fl_split.config import RunConfig

    if model is None:
        return RunConfig.from_mapping(manifest["config"])
    return RunConfig.from_mapping({k: v for k, v in manifest["config"].items() if k != "model"}).replace(model=model)


def refuse_secure_merge(manifest: dict, model_dir) -> None:
    """Refuse, before any table is read or anything released, a model trained with ``--secure-merge``
    (docs/serving.md, "Models trained with secure merge"): its host only ever held the guests' masked
    sum, and prediction has no masking session — each guest would hand the host its own part."""
    if (manifest.get("config") or {}).get("secure_merge"):
        raise ConfigError("model", str(model_dir), "a model trained without --secure-merge",
                          reason="its host held only the guests' masked sum; fl-split predict has no secure "
                                 "merge, so each guest would release its own part to the host: nothing was read "
                                 "or released (docs/serving.md, \"Models trained with secure merge\")")


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
        refuse_secure_merge(self.manifest, directory)  # each party checks its own part too (every engine)
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

    def __init__(self, directory, party, table_path, id_column, model=None,
                 limits: InferenceLimits | None = None) -> None:
        super().__init__(directory, party, table_path, id_column, model)
        #: this guest's own inference limits (its configuration; the defaults when it sets none)
        self.limits = limits if limits is not None else InferenceLimits()
        from fl_split.models.registry import build_bottom
        from fl_split.serving import load_state

        m = self.manifest
        self.bottom = build_bottom(self._arch(), party, tuple(m["input_shape"]), m["cut"], m["guest_cut_activation"], None)
        self.bottom.load_state_dict(load_state(self.files)["bottom"])
        self.bottom.eval()
        if self.cfg.schedule != "constant":
            raise ConfigError("schedule", self.cfg.schedule, "constant for a model that predicts",
                              reason="a geometric schedule has no mechanism for releases after training")

    def release(self, shared: np.ndarray, budget: float | None = None,
                max_queries_per_id: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """The released cut-layer output of the ``shared`` rows (charged first; fresh noise).

        The guest's own :attr:`limits` hold; ``budget`` and ``max_queries_per_id`` (a coordinator's job,
        ``None``: not set) can only tighten them: the smaller of each applies. A release that would
        take one of the ``shared`` records past the per-ID cap (:class:`InferenceRefused`) or the
        inference ledger past the ε budget (:class:`~fl_split.errors.BudgetExceeded`) is refused
        before anything is computed: nothing released, the ledger and query files unchanged."""
        from fl_split.builder import make_ledger
        from fl_split.privacy import factory
        from fl_split.privacy.ledger import Ledger, LedgerEntry
        from fl_split.results import write_bytes_atomic
        from fl_split.seeding import PartySecret

        check_limits(budget, max_queries_per_id)
        own = self.limits
        cap = own.max_queries_per_id if max_queries_per_id is None else min(own.max_queries_per_id,
                                                                            int(max_queries_per_id))
        shared = np.asarray(shared, np.int64)
        qpath = self.directory / self.name / QUERIES_FILE
        q_ids, q_counts = _read_queries(qpath)
        records = np.unique(shared)
        before = _counts_of(q_ids, q_counts, records)
        over = int(np.count_nonzero(before >= cap))
        if over:
            raise InferenceRefused(
                f"{self.name}: release refused, per-ID query cap reached: {over} of the {len(records)} requested "
                f"records were already released {cap} time(s) for inference (max-queries-per-id {cap}"
                f"{'' if cap == own.max_queries_per_id else f': the job’s, below its own {own.max_queries_per_id}'}; "
                f"nothing released or charged; docs/serving.md \"Inference limits\")")
        width = int(np.prod(self.manifest["cut_shape"]))
        mech = factory.forward_mechanism(self.cfg, width, 1)
        path = self.directory / self.name / LEDGER_FILE
        ledger = make_ledger(self.cfg.replace(budget="auto"), self.name)
        if ledger is not None and path.exists():
            from fl_split.state import unflatten

            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files if k != "__skeleton__"}
                ledger = Ledger.from_state(unflatten(arrays, json.loads(str(z["__skeleton__"]))))
        cost = mech.cost()
        limit = None
        if ledger is not None and cost is not None:
            limit = own.budget if own.budget is not None else self.default_budget(cost, own.max_queries_per_id)
            if budget is not None:
                limit = min(limit, float(budget))
        if ledger is not None:
            ledger.budget = limit
        calls = len(ledger) if ledger is not None else 0  # earlier predict calls (one ledger entry each)
        if ledger is not None and cost is not None:  # BudgetExceeded here records nothing
            ledger.charge([LedgerEntry(0, ("predict", 0, int(calls)), "forward", cost, shared, None)])
        with torch.no_grad():
            v = self.bottom(self.features(shared))
        gen = PartySecret.fresh().torch_generator("inference", 0) if mech.random else None
        value = mech.release(v, gen).value
        report: dict[str, Any] = {"mechanism": mech.name, "records": int(len(shared)),
                                  "limits": {"budget": limit, "max_queries_per_id": cap,
                                             "queries_per_id": int(before.max(initial=0)) + 1}}
        # what is spent is written (atomically, owner-only) before the release leaves this object
        all_ids, inv = np.unique(np.concatenate([q_ids, records]), return_inverse=True)
        counts = np.bincount(inv, weights=np.concatenate([q_counts, np.ones(len(records))])).astype(np.int64)
        import io

        buf = io.BytesIO()
        np.savez(buf, ids=all_ids, counts=counts)
        write_bytes_atomic(qpath, buf.getvalue())
        if ledger is None or cost is None:
            report.update(epsilon=None, covered=False,
                          note="released without a differential-privacy mechanism (--defense none): not covered")
        else:
            from fl_split.state import flatten

            arrays, skeleton = flatten(ledger.export_state())
            buf = io.BytesIO()
            np.savez(buf, __skeleton__=np.asarray(json.dumps(skeleton)), **arrays)
            write_bytes_atomic(path, buf.getvalue())
            report.update(epsilon=ledger.epsilon(), covered=True, accountant=self.cfg.accountant,
                          delta=self.cfg.delta, ledger=str(path))
        return value, report

    def default_budget(self, cost, queries: int) -> float:
        """The default inference ε budget: what ``queries`` releases of one record reach under the saved
        mechanism (its accountant), with a relative slack of 1e-9 so the cap, not rounding, refuses first."""
        from fl_split.builder import make_ledger
        from fl_split.privacy.ledger import LedgerEntry

        scratch = make_ledger(self.cfg.replace(budget="auto"), self.name)
        return float(scratch.would_be([LedgerEntry(0, ("predict", 0, k), "forward", cost, np.zeros(1, np.int64), None)
                                       for k in range(int(queries))])) * (1 + 1e-9)


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
            label_column: str = "label", budget: float | None = None, model=None,
            max_queries_per_id: int = DEFAULT_MAX_QUERIES_PER_ID, psi_max_peer_ids: str = "") -> dict[str, Any]:
    """Score the new rows of ``tables`` (party → path) with the saved model in ``model_dir``; write
    ``out`` (owner-only CSV, host only) and return the summary (metrics, each party's epsilon).
    ``budget`` and ``max_queries_per_id``: each guest's own inference limits (:class:`InferenceLimits`;
    ``budget`` None: the ε of ``max_queries_per_id`` releases of one record); a guest that would
    exceed one refuses, and nothing reaches the host (a guest charged before that refusal stays
    charged: conservative).
    ``model``: the model factory of a run trained from Python with a function that cannot be imported
    by name (a lambda, a notebook's function; :class:`fl_split.api.SavedModel` passes it).
    ``psi_max_peer_ids``: with ``align="psi"``, every party's bound on a peer's announced set
    (:func:`fl_split.psi.peer_limit`; ``--psi-max-peer-ids``)."""
    limits = InferenceLimits(budget, max_queries_per_id)
    from fl_split.serving import check_parts, load_part

    if "host" not in tables:
        raise ConfigError("data", ";".join(f"{p}={v}" for p, v in tables.items()), "host=PATH;guest-1=PATH;…",
                          reason="the host's new table is needed")
    parts = {p: load_part(model_dir, p)[0] for p in tables}
    if "host" in parts:
        refuse_secure_merge(parts["host"], model_dir)
    check_parts(parts)
    host = HostScorer(model_dir, "host", tables["host"], id_column, label_column, model)
    guests = {g: GuestScorer(model_dir, g, tables[g], id_column, model, limits) for g in host.manifest["guest_shapes"]}
    if align == "public":
        from fl_split.data.own import check_public_ids

        shared = np.sort(host.ids)
        for g, s in guests.items():  # before any release; the host names its own missing IDs
            check_public_ids(s.ids, shared, s.where, host.names, host.where)
    elif align == "psi":
        from fl_split.psi import align_by_psi

        shared = align_by_psi({"host": host.ids, **{g: s.ids for g, s in guests.items()}}, lambda *a: None,
                              max_peer_ids=psi_max_peer_ids)  # each party's bound on a peer's set
    else:
        raise ConfigError("align", align, "public or psi")
    released, privacy = {}, {}
    for g, s in guests.items():  # each guest releases its new rows' cut-layer outputs
        released[g], privacy[g] = s.release(shared)
    return write_predictions(host, shared, released, privacy, out)


def write_predictions(host: HostScorer, shared: np.ndarray, released: dict[str, torch.Tensor],
                      privacy: dict[str, Any], out: str) -> dict[str, Any]:
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
