"""The public Python API (issue 28, ``docs/api.md``): a run from keyword arguments or a
:class:`~fl_split.config.RunConfig`, its results as pandas objects, its saved model, and attacks
mounted on the finished run — what ``fl-split train``, ``fl-split predict`` and ``fl-split attack``
do, from a notebook.

* :func:`train` validates every option as the CLI does (the same :class:`~fl_split.errors.ConfigError`
  line naming the option, the value and what is allowed), runs :func:`fl_split.engine.run_experiment`
  — the CLI's own entry point, so the same configuration and private seed give the same numbers —
  and returns a :class:`Run`;
* :class:`Run` holds the results dictionary (the CLI's results JSON) and shows it as
  :attr:`~Run.history` (one row per epoch), :attr:`~Run.privacy` (one row per party: its mechanism and
  accounted (ε, δ)), :attr:`~Run.metrics` (the last epoch's test metrics), :attr:`~Run.model` (each
  party's saved part, issue 24) and :meth:`~Run.attack`;
* **observed runs**: by default the local engine's parties exchange frames (the wire path, bit-identical
  to the in-process hand-overs) through the attack framework's
  :class:`~fl_split.attacks.view.ObservingTransport`, which keeps each party's inbox and outbox. An attack
  is then mounted on the finished run from exactly the attacker's view
  (:meth:`Session.view <fl_split.attacks.view.Session.view>`), as ``fl-split attack`` does after its own
  training. Under Flower every party records what it holds on its own node
  (:class:`~fl_split.attacks.flower.FlowerSession`). The observations cost memory (every message of the
  run); ``observe=False`` trains without them;
* models as ``nn.Module`` factories: ``model=`` takes the function itself where the CLI takes
  ``package.module:function`` (a :class:`~fl_split.models.user.ModelSpec` in, a module out). A function
  defined at the top level of an importable module is recorded by that name (every engine, every
  file); any other callable (a lambda, a notebook's function) trains with the local engine only, and
  ``engine="flower"`` refuses it in one line, since the ClientApp processes cannot import it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fl_split.config import RunConfig, key_of
from fl_split.errors import ConfigError

__all__ = ["Run", "SavedModel", "attack", "load_model", "train"]


def _private_seed(value: Any):
    """``private_seed=``: a :class:`~fl_split.seeding.PrivateSeed`, a hex string (as ``--private-seed``;
    short or patterned seeds refused), or ``None`` (fresh entropy)."""
    from fl_split.seeding import PrivateSeed

    if value is None or isinstance(value, PrivateSeed):
        return value
    if isinstance(value, str):
        return PrivateSeed.parse(value)
    raise ConfigError("private-seed", "<hidden>", "a hex string of >= 32 digits (`fl-split seed` makes one), a "
                      "fl_split.seeding.PrivateSeed, or None", reason=f"got a {type(value).__name__}")


def make_config(config: RunConfig | Mapping[str, Any] | None = None, **options: Any) -> RunConfig:
    """A :class:`~fl_split.config.RunConfig` from ``config`` (a RunConfig, or a mapping with the CLI's
    kebab- or snake-case keys and string or typed values, as a JSON config holds them) and ``options``
    (snake-case keyword arguments with typed values, overriding ``config``). An unknown option, a value of
    the wrong type or out of range raises the CLI's one-line :class:`~fl_split.errors.ConfigError`."""
    if config is None:
        base = RunConfig()
    elif isinstance(config, RunConfig):
        base = config
    elif isinstance(config, Mapping):
        base = RunConfig.from_mapping(config)
    else:
        raise ConfigError("config", type(config).__name__, "a RunConfig, a mapping of options or None")
    names = {f.name for f in dataclasses.fields(RunConfig)}
    for name, value in options.items():
        if name not in names:
            import difflib

            close = difflib.get_close_matches(name, sorted(names), n=1)
            raise ConfigError(key_of(name), value, "a RunConfig option (the flags of `fl-split train --help` in "
                              "snake case: " + ", ".join(sorted(names)) + ")",
                              reason="unknown option" + (f"; did you mean {close[0]}?" if close else ""))
    return dataclasses.replace(base, **options) if options else base


class _Keeper:
    """Removes a temporary model folder when the last object using it is gone."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._finalizer = weakref.finalize(self, shutil.rmtree, path, True)


def train(config: RunConfig | Mapping[str, Any] | None = None, *, private_seed: Any = None, observe: bool = True,
          **options: Any) -> "Run":
    """Train one split-learning run and return its :class:`Run`.

    ``config``: a :class:`~fl_split.config.RunConfig` or a mapping of options (optional); ``options``:
    any :class:`~fl_split.config.RunConfig` field as a keyword argument (``dataset="credit"``,
    ``guests=2``, ``defense="laplace"``, ``epsilon=1.0``, ``engine="local"`` or ``"flower"``,
    ``model=`` a name, ``"package.module:function"`` or the function itself, …), overriding ``config``.
    ``private_seed``: a hex seed (``--private-seed``) that makes every party's private randomness
    reproducible, or a :class:`~fl_split.seeding.PrivateSeed`; ``None`` draws fresh entropy. It is not
    part of the (public) configuration and appears in no result.

    Each party saves its part of the model (``save_model``: a folder; by default a private temporary one
    removed when the :class:`Run` is gone: give ``save_model="dir"`` to keep it). ``observe`` (default on):
    keep what each party saw, so that :meth:`Run.attack` can mount an attack afterwards (memory: every
    message of the run; off for a checkpointed, resumed, party-files or monolithic run, which have no
    observed session).

    Raises :class:`~fl_split.errors.ConfigError` (one line) for a bad option, as ``fl-split train`` does."""
    cfg = make_config(config, **options)
    seed = _private_seed(private_seed)
    keeper = None
    if not cfg.save_model and not cfg.monolithic:
        keeper = _Keeper(tempfile.mkdtemp(prefix="fl_split_model_"))  # owner-only (0700)
        cfg = cfg.replace(save_model=keeper.path)
    if cfg.save_model:
        cfg = cfg.replace(save_model=os.path.abspath(os.path.expanduser(cfg.save_model)))
    unobserved = "it was trained with observe=False"
    if cfg.monolithic or cfg.checkpoint_dir or cfg.party_files:
        unobserved = "a monolithic, checkpointed or party-files run has no observed session"
    if not cfg.monolithic:  # the CLI's warnings before a run whose releases cannot carry signal
        import sys

        from fl_split.builder import plan_run
        from fl_split.privacy.diagnostics import hopeless_releases

        plan = plan_run(cfg)
        for line in hopeless_releases(plan):
            print(f"fl-split: warning: {line}", file=sys.stderr)
        if plan.task == "regression":  # the attacks are built for class labels (fl_split.attacks.view.Session)
            unobserved = "its task is regression, and the attacks are built for class labels"
    observed = observe and unobserved == "it was trained with observe=False"
    session = None
    if observed and cfg.engine == "flower":
        from fl_split.attacks.flower import FlowerSession

        session = FlowerSession(cfg, seed)
        results = session.run()
        results["saved_model"] = {"dir": cfg.save_model, "parties": cfg.parties}
        if cfg.data:
            from fl_split.builder import prepare_data

            results["alignment"] = prepare_data(cfg).alignment
    elif observed:
        from fl_split.attacks.view import ObservingTransport, Session
        from fl_split.engine import LocalEngine, run_experiment

        built: dict[str, Any] = {}
        boxes: dict[str, dict[str, list]] = {p: {"in": [], "out": []} for p in cfg.parties}

        def observing_engine(run_cfg: RunConfig, run_seed):
            # frames, not in-process hand-overs: an adversary sees what a deployment's wire carries
            engine = LocalEngine(run_cfg, run_seed, transport=lambda local: ObservingTransport(local, boxes),
                                 codec=True)
            built["engine"] = engine
            return engine

        results = run_experiment(cfg, private_seed=seed, local_engine=observing_engine)
        engine = built["engine"]
        session = Session.finished(engine.cfg, seed, engine.host, engine.guests, boxes, results)
    else:
        from fl_split.engine import run_experiment

        results = run_experiment(cfg, private_seed=seed)
    return Run(cfg, results, session=session, keeper=keeper, unobserved=None if session else unobserved)


class Run:
    """A finished run (:func:`train`): its configuration, results, saved model and observed session.

    ``results`` is the dictionary ``fl-split train --out`` writes (``docs/results.md``); the properties
    below are views of it."""

    def __init__(self, config: RunConfig, results: dict[str, Any], *, session=None,
                 keeper: _Keeper | None = None, unobserved: str | None = None) -> None:
        self.config = config
        self.results = results
        self._session = session  # the observed world (every party): attacks get views of it, never it
        self._keeper = keeper
        self._unobserved = unobserved or "it was trained with observe=False"  # why there is no session

    def __repr__(self) -> str:
        final = self.results.get("final", {})
        value = final.get("value")
        shown = "n/a" if value is None else f"{value:.4f}"
        return (f"<fl_split.Run {self.config.dataset if not self.config.data else self.config.data_name}, "
                f"{self.config.guests} guest(s), defense {self.config.defense}, {final.get('metric')} {shown}, "
                f"{self.results.get('stopped_reason', 'completed')}>")

    @property
    def history(self):
        """One row per epoch (a :class:`pandas.DataFrame` indexed by ``epoch``): ``train_loss``,
        ``test_metric`` (the dataset's metric), ``test_loss``, the task's other test metrics
        (binary: ``test_auc`` …) and ``epoch_time_s``; ``None`` where the host keeps its metrics
        (``report_metrics="none"``)."""
        import pandas as pd

        return pd.DataFrame(self.results.get("history", [])).set_index("epoch", drop=True) \
            if self.results.get("history") else pd.DataFrame(columns=["train_loss", "test_metric", "test_loss"])

    @property
    def privacy(self):
        """One row per party (a :class:`pandas.DataFrame` indexed by party): its forward or backward
        ``mechanism``, ``epsilon`` and ``delta`` as its own ledger accounts them (``accountant``; NaN
        where no differential privacy is claimed: ``covered`` False), its ``budget``, ``releases`` and
        the per-record ``releases_per_record``. The full reports (every accountant's ε, the
        assumptions) are in ``results["privacy"]``."""
        import pandas as pd

        rows = []
        for party, rep in self.results.get("privacy", {}).items():
            mech = rep.get("mechanism") or {}
            rows.append({"party": party, "mechanism": mech.get("name") if isinstance(mech, dict) else str(mech),
                         "epsilon": rep.get("epsilon"), "delta": rep.get("delta"), "accountant": rep.get("accountant"),
                         "covered": rep.get("epsilon") is not None, "budget": rep.get("budget"),
                         "releases": rep.get("releases"), "releases_per_record": rep.get("releases_per_record")})
        frame = pd.DataFrame(rows, columns=["party", "mechanism", "epsilon", "delta", "accountant", "covered",
                                            "budget", "releases", "releases_per_record"])
        frame[["epsilon", "delta"]] = frame[["epsilon", "delta"]].astype(float)
        return frame.set_index("party")

    @property
    def metrics(self) -> dict[str, Any]:
        """The last evaluated epoch's test metrics of the task (``{"accuracy": …, "auc": …}`` for a
        binary task; ``{"r2": …}`` …), with ``train_loss``; empty where the host keeps them."""
        final = self.results.get("final", {})
        out = {k: v for k, v in (final.get("metrics") or {}).items()}
        if final.get("train_loss") is not None:
            out["train_loss"] = final["train_loss"]
        return out

    @property
    def model(self) -> "SavedModel":
        """Each party's saved part (``save_model``), as a :class:`SavedModel` that predicts."""
        saved = self.results.get("saved_model")
        if not saved:
            raise ConfigError("save-model", self.config.save_model, "a folder (every split run saves by default)",
                              reason="this run saved no model (a monolithic run has no parties)")
        from fl_split.config import is_model_factory

        factory = self.config.model if is_model_factory(self.config.model) else None
        return SavedModel(saved["dir"], model=factory, keeper=self._keeper)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the results JSON (what ``fl-split train --out`` writes) to ``path``, atomically."""
        from fl_split.results import write_json_atomic

        write_json_atomic(path, self.results)
        return Path(path)

    def attack(self, name: str, **options: Any) -> dict[str, Any]:
        """Mount attack ``name`` (``fl_split.attacks.ATTACK_NAMES``) on this finished run and score it.

        The attack gets exactly its adversary's view — its own party object, what it received and
        sent, the public configuration and results and what its threat model grants — as ``fl-split
        attack`` gives it (``docs/attacks.md``). ``options``: the attack's options
        (:class:`~fl_split.attacks.options.AttackOptions` fields: ``guest="guest-1"``,
        ``adversary=``, ``attack_epochs=``, …). Returns the attack results (``metric``, ``value``,
        ``baseline``, ``threat_model``, …: the JSON of ``fl-split attack --out``).

        Attacks that need their own training run — membership (its threat model grants public records
        taken out of training) and fsha (a malicious host) — are refused in one line: :func:`attack`
        trains one for them."""
        from fl_split.attacks.options import options_from_mapping
        from fl_split.attacks.runner import get_attack, run_attack

        opts = options_from_mapping({"attack": name, **options})
        mounted = get_attack(opts.attack)
        if self._session is None:
            raise ConfigError("attack", name, "an attack on a run trained with observe=True",
                              reason=f"nobody's view of this run was kept: {self._unobserved}")
        if mounted.public or mounted.malicious:
            need = "a malicious host" if mounted.malicious else "public records taken out of training"
            raise ConfigError("attack", name, "an attack whose threat model this finished run meets (property, "
                              "reconstruction, inversion, feature, label-norm, label-direction, label-completion)",
                              reason=f"its threat model needs {need}: fl_split.attack({name!r}, …) trains a run "
                                     f"of its own for it")
        # the session's parties hold their own secrets: no private seed is needed (nor kept) here
        return run_attack(self._session.cfg, opts, None, session=self._session)


def attack(name: str, config: RunConfig | Mapping[str, Any] | None = None, *, private_seed: Any = None,
           attack_options: Mapping[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """Train a run observed for attack ``name`` and mount it: ``fl-split attack`` from Python
    (:func:`fl_split.attacks.run_attack`). ``config`` / ``options`` / ``private_seed`` as in
    :func:`train`; ``attack_options``: the attack's own options (``{"guest": "guest-2"}``). For the
    attacks that need their own run (membership: a public split; fsha: a malicious host); the others
    can share one run: ``train(...).attack(name)``."""
    from fl_split.attacks.options import options_from_mapping
    from fl_split.attacks.runner import run_attack

    cfg = make_config(config, **options)
    opts = options_from_mapping({"attack": name, **dict(attack_options or {})})
    return run_attack(cfg, opts, _private_seed(private_seed))


class SavedModel:
    """A trained split model saved as each party's own part (issue 24, ``docs/serving.md``): the
    folder ``path/<party>/`` of every party. :meth:`predict` scores new rows as ``fl-split predict``
    does: each party loads only its own part and reads only its own table, and every guest's release
    of a new record is charged to its inference ledger."""

    def __init__(self, path: str | os.PathLike, *, model=None, keeper: _Keeper | None = None) -> None:
        from fl_split.serving import check_parts, load_part

        self.path = Path(path).expanduser()
        self._model = model
        self._keeper = keeper  # a temporary folder lives as long as a SavedModel using it
        host, _ = load_part(self.path, "host")
        self.manifests = {p: load_part(self.path, p)[0] for p in host["parties"]}
        check_parts(self.manifests)

    def __repr__(self) -> str:
        return f"<fl_split.SavedModel {self.path} ({', '.join(self.parties)}; {self.manifests['host']['task']})>"

    @property
    def parties(self) -> list[str]:
        """The parties of the model, host first."""
        return list(self.manifests["host"]["parties"])

    def predict(self, tables: Mapping[str, Any], *, id_column: str = "id", label_column: str = "label",
                align: str = "public", out: str | os.PathLike | None = None, budget: float | None = None,
                max_queries_per_id: int = 3):
        """Score new rows: ``tables`` maps each party to its own new table (a CSV/Parquet path or a
        :class:`pandas.DataFrame` with the ``id_column`` and that party's columns; the host's may hold
        the ``label_column``). Returns the predictions as a :class:`pandas.DataFrame` (the host table's
        own ID column(s) — names, values, dtypes — then ``p_k`` per class and ``predicted``, or
        ``prediction`` for regression) with the summary in
        ``frame.attrs["summary"]`` (records, task, each guest's inference ε, the metrics when the host
        holds labels). ``out``: also keep the predictions CSV there (owner-only). ``budget`` and
        ``max_queries_per_id``: each guest's own inference limits (ε over its inference ledger, default
        the ε of ``max_queries_per_id`` releases of one record; releases per record over all calls;
        docs/serving.md "Inference limits")."""
        import pandas as pd

        from fl_split.predict import predict

        with tempfile.TemporaryDirectory(prefix="fl_split_predict_") as work:
            paths = {}
            for party, table in tables.items():
                if isinstance(table, pd.DataFrame):
                    paths[party] = os.path.join(work, f"{party}.csv")
                    table.to_csv(paths[party], index=False)
                else:
                    paths[party] = os.fspath(table)
            target = os.fspath(out) if out is not None else os.path.join(work, "predictions.csv")
            summary = predict(os.fspath(self.path), paths, id_column, target, align, label_column, budget,
                              model=self._model, max_queries_per_id=max_queries_per_id)
            frame = _with_own_ids(pd.read_csv(target), pd.read_csv(target, dtype=str, keep_default_na=False),
                                  tables["host"], paths["host"], id_column)
        frame.attrs["summary"] = {k: v for k, v in summary.items() if k != "out" or out is not None}
        return frame


def _with_own_ids(pred, pred_text, host_table, host_path: str, id_column: str):
    """The predictions with their score columns as numbers and their ID column(s) exactly as the user's
    own host table holds them (the DataFrame passed, or the file as pandas reads it): same names,
    values and dtypes, so ``pred.merge(table, on=ID)`` matches every row."""
    import pandas as pd

    from fl_split.data.ids import parse_columns

    cols = parse_columns(id_column)
    if isinstance(host_table, pd.DataFrame):
        own = host_table.reset_index(drop=True)
    elif host_path.lower().endswith(".csv"):
        own = pd.read_csv(host_path, low_memory=False)
    else:
        own = pd.read_parquet(host_path)
    # the CSV text of each ID cell (as fl-split read the table and wrote the predictions) -> its row
    written = pd.read_csv(host_path, usecols=cols, dtype=str, keep_default_na=False) \
        if host_path.lower().endswith(".csv") else own[cols].astype(str)
    rows = pd.MultiIndex.from_frame(written[cols]).get_indexer(pd.MultiIndex.from_frame(pred_text[cols]))
    if (rows < 0).any():  # cannot happen: every predicted row is a row of the host's table
        raise RuntimeError("a predicted ID is not in the host's table")
    out = {c: own[c].iloc[rows].reset_index(drop=True) for c in cols}
    out.update({c: pred[c] for c in pred.columns if c not in cols})
    return pd.DataFrame(out)


def load_model(path: str | os.PathLike, *, model=None) -> SavedModel:
    """The saved model in ``path`` (``save_model`` of a run, ``fl-split train --save-model``), every
    part checked against its manifest. ``model``: the factory it was trained with, when that was a
    function that cannot be imported by name (a lambda, a notebook's function)."""
    return SavedModel(path, model=model)
