"""``fl-split predict --engine deploy-local``: the prediction job (:mod:`fl_split.flower.predicting`)
in a real Flower deployment on loopback — the same SuperLink, SuperNodes, TLS, node authentication
and teardown as ``fl-split deploy local`` (:class:`fl_split.deploy.LocalDeployment`), with each
SuperNode's ``--node-config`` naming **its own** files:

* ``data-path``: its new table (``--data PARTY=PATH``);
* ``model-dir``: the folder holding its saved part (``model-dir/<party>/``, written there by
  ``train --save-model`` or by a training deployment's node with the same ``model-dir``); its
  inference ledger is written beside its part, on its machine;
* the host's ``predict-out``: where it writes the predictions (``--out``), owner-only;
* a guest's ``inference-budget`` and ``max-queries-per-id``: its own inference limits (``--budget``,
  ``--max-queries-per-id``; on loopback the one user is every party; docs/serving.md "Inference
  limits"). The job itself sets no limit; a coordinator's job could only tighten a guest's.

The run config carries the saved run's public configuration and the job (``predict-job``: the ID and
label column names, ``--align``; no path, no limit), so the ServerApp of ``flwr run`` runs the
job instead of training (:func:`fl_split.flower.predicting.run_flwr_job`); it writes the summary
(records, metrics, each guest's privacy report, the alignment's sizes) to the work directory.
On loopback every party's folder is under the one ``--model DIR``; on separate machines each
organisation gives its own SuperNode its own folder.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from fl_split.deploy import LocalDeployment, _literal, deploy_local, run_config_toml
from fl_split.errors import ConfigError
from fl_split.secure_files import make_owner_only, private_dir, write_private


class PredictDeployment(LocalDeployment):
    """A loopback deployment that runs the prediction job ``job`` (see the module docstring)."""

    def __init__(self, cfg, workdir, *, job: dict[str, Any], model: Path, out: Path, limits=None, **kw) -> None:
        super().__init__(cfg, workdir, **kw)
        self.job, self.model, self.out = job, model, out
        self.limits = limits  # the guests' own inference limits (their node configs)

    def prepare_data(self) -> None:
        """The work directory; each party's part checked (its files' SHA-256, the parts one model) and
        its table present, before any process starts (each node checks its own again)."""
        from fl_split.serving import check_parts, load_part

        check_parts({p: load_part(self.model, p)[0] for p in self.parties})
        for party, path in (self.own_tables or {}).items():
            if not path.is_file():
                raise ConfigError("data", f"{party}={path}", "an existing CSV or Parquet table", reason="no such file")
        private_dir(self.workdir)
        make_owner_only(self.workdir)
        private_dir(self.flwr_home)

    def node_config(self, party: str) -> str:
        items = [super().node_config(party), f"model-dir={_literal(self.model)}"]
        if party == "host":
            items.append(f"predict-out={_literal(self.out)}")
        elif self.limits is not None:
            if self.limits.budget is not None:
                items.append(f"inference-budget={float(self.limits.budget)!r}")
            items.append(f"max-queries-per-id={int(self.limits.max_queries_per_id)}")
        return " ".join(items)

    def run(self) -> dict[str, Any]:
        from fl_split.deploy import _bin
        from fl_split.flower.appconfig import toml_value
        from fl_split.flower.strategy import JOB_KEY
        from fl_split.secure_files import PRIVATE_UMASK

        config = self.workdir / "run-config.toml"
        text = run_config_toml(replace(self.cfg, data=""), self.results_path)
        write_private(config, (text + f"{JOB_KEY} = {toml_value(json.dumps(self.job))}\n").encode("utf-8"))
        self._submit([_bin("flwr"), "run", str(self.staged_app()), self.connection, "--stream", "--run-config",
                      str(config)], umask=PRIVATE_UMASK)
        if not self.results_path.exists():
            from fl_split.deploy import DeploymentError

            raise DeploymentError(f"run {self.run_id} completed but wrote no results to {self.results_path}")
        return json.loads(self.results_path.read_text(encoding="utf-8"))


def deploy_predict(model_dir: str, tables: dict[str, str], id_column: str, out: str, align: str = "public",
                   label_column: str = "label", budget: float | None = None, *, workdir: str, tls: bool = True,
                   echo=None, timeout: float = 1800.0, max_queries_per_id: int | None = None) -> dict[str, Any]:
    """Run the prediction job as a loopback deployment (module docstring); returns the summary, with
    ``summary["deployment"]`` (run ID, work directory, phases' seconds) as ``deploy local`` adds it.
    ``budget`` and ``max_queries_per_id``: each guest's own inference limits, in its node config."""
    from fl_split.flower.predicting import federation_config, job_spec
    from fl_split.predict import DEFAULT_MAX_QUERIES_PER_ID, InferenceLimits

    own = InferenceLimits(budget, DEFAULT_MAX_QUERIES_PER_ID if max_queries_per_id is None else max_queries_per_id)
    from fl_split.predict import refuse_secure_merge
    from fl_split.serving import load_part

    if "host" not in tables:
        raise ConfigError("data", ";".join(f"{p}={v}" for p, v in tables.items()), "host=PATH;guest-1=PATH;…",
                          reason="the host's new table is needed")
    model = Path(model_dir).expanduser().resolve()
    host = load_part(model, "host")[0]
    refuse_secure_merge(host, model_dir)
    if sorted(tables) != sorted(host["parties"]):
        raise ConfigError("data", ";".join(sorted(tables)), ";".join(host["parties"]),
                          reason="one new table per party of the saved model")
    guests = len(host["guest_shapes"])
    spec = ";".join(f"{p}={Path(v).expanduser().resolve()}" for p, v in tables.items())
    cfg = federation_config(host["config"], guests, data=spec, align=align, id_column=id_column,
                            label_column=label_column)
    job = job_spec(id_column, label_column, align, None, guests)
    kind = functools.partial(PredictDeployment, job=job, model=model, out=Path(out).expanduser().resolve(),
                             limits=own)
    summary = deploy_local(cfg, workdir, tls=tls, node_auth=tls, echo=echo, timeout=timeout, deployment=kind)
    summary["out"] = out
    return summary
