"""``fl-split predict --engine flower``: the prediction job (:mod:`fl_split.flower.predicting`) in a
Flower simulation in this process (issue 24).

Kept apart from :mod:`fl_split.flower.predicting`, which the nodes import: this runner builds the
simulation engine, and the engine imports the nodes (no import circle, docs/design.md "One-way layers").
"""

from __future__ import annotations

from typing import Any

from fl_split.config import RunConfig
from fl_split.errors import ConfigError
from fl_split.flower.predicting import federation_config, job_spec, predict_server_app


def predict_flower(model_dir: str, tables: dict[str, str], id_column: str, out: str, align: str = "public",
                   label_column: str = "label", budget: float | None = None, verbose: bool = False,
                   max_queries_per_id: int | None = None) -> dict[str, Any]:
    """``fl-split predict --engine flower``: the job in a Flower simulation in this process, one
    virtual SuperNode per party of the saved model (each loads its own part and reads its own table).
    ``budget`` and ``max_queries_per_id``: the guests' own inference limits (one user runs every
    party; ``None``: the defaults, :class:`fl_split.predict.InferenceLimits`); the job sets none."""
    from fl_split.predict import DEFAULT_MAX_QUERIES_PER_ID, InferenceLimits
    from pathlib import Path

    from fl_split.flower.engine import FlowerEngine
    from fl_split.flower.node import make_client_app
    from fl_split.predict import refuse_secure_merge
    from fl_split.serving import load_part

    if "host" not in tables:
        raise ConfigError("data", ";".join(f"{p}={v}" for p, v in tables.items()), "host=PATH;guest-1=PATH;…",
                          reason="the host's new table is needed")
    host = load_part(model_dir, "host")[0]
    refuse_secure_merge(host, model_dir)
    guests = len(host["guest_shapes"])
    if sorted(tables) != sorted(host["parties"]):
        raise ConfigError("data", ";".join(sorted(tables)), ";".join(host["parties"]),
                          reason="one new table per party of the saved model")
    absolute = {p: str(Path(v).expanduser().resolve()) for p, v in tables.items()}
    own = InferenceLimits(budget, DEFAULT_MAX_QUERIES_PER_ID if max_queries_per_id is None else max_queries_per_id)
    spec = job_spec(id_column, label_column, align, None, guests, str(Path(model_dir).expanduser().resolve()),
                    absolute, str(Path(out).expanduser().resolve()), limits=own)
    cfg = federation_config(host["config"], guests)

    class PredictEngine(FlowerEngine):
        @staticmethod
        def check(cfg: RunConfig) -> None:  # nothing to plan: the parts are checked by the nodes
            from fl_split.devices import for_simulation

            for_simulation(cfg)

        def server_app(self, cfgs, sink, poll, done):
            return predict_server_app(cfgs[0], spec, sink, poll, done)

    summary = PredictEngine(cfg, client_app=make_client_app(), verbose=verbose).run()
    summary["out"] = out
    return summary
