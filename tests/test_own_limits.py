"""Each party's own training limits in a deployment (docs/threat-model.md, "What each party controls"):
a node's ``budget`` and ``max-test-requests`` come from its own node config; the coordinator's job can
tighten them, never loosen them. The prediction limits (``inference-budget``, ``max-queries-per-id``)
and the PSI bound (``psi-max-peer-ids``) follow the same rule: tests/test_deploy_predict.py,
tests/test_adversary_psi.py."""

from __future__ import annotations

import pytest

from fl_split.config import AUTO, RunConfig
from fl_split.flower.node import own_limits
from fl_split.flower.records import FederationError
from fl_split.flower.strategy import VerticalSplitStrategy
from fl_split.seeding import PrivateSeed
from tests.test_deploy_align import RUN, _nodes
from tests.test_flower import InlineGrid
from tests.test_own_data import write_party_tables

pytestmark = pytest.mark.usefixtures("flower_task_identity")
NODE = {"role": "guest", "guest-index": 1, "data-path": "g.csv"}


@pytest.mark.parametrize("job, own, want", [
    (AUTO, None, AUTO), (100.0, None, 100.0), (AUTO, "5", 5.0), (100.0, "5", 5.0), (3.0, "5", 3.0)])
def test_a_nodes_budget_is_the_tighter_of_its_own_and_the_jobs(job, own, want):
    node = dict(NODE, **({} if own is None else {"budget": own}))
    assert own_limits(RunConfig(budget=job, defense="laplace"), node).budget == want


@pytest.mark.parametrize("job, own, want", [(4, None, 1), (1, "3", 1), (5, "3", 3), (2, "3", 2)])
def test_a_nodes_test_request_cap_defaults_to_one_and_the_job_only_tightens_it(job, own, want):
    node = dict(NODE, **({} if own is None else {"max-test-requests": own}))
    assert own_limits(RunConfig(max_test_requests=job), node).max_test_requests == want


def test_a_simulations_nodes_keep_the_runs_options():
    cfg = RunConfig(budget=7.0, max_test_requests=4, defense="gaussian")
    assert own_limits(cfg, {"partition-id": 0, "num-partitions": 3}) == cfg


def test_an_own_budget_is_moot_where_the_run_charges_nothing():
    cfg = own_limits(RunConfig(defense="none"), dict(NODE, budget="5"))
    assert cfg.budget == AUTO and cfg.max_test_requests == 1


@pytest.mark.parametrize("key, value", [("budget", "-1"), ("budget", "inf"), ("budget", "lots"),
                                        ("max-test-requests", "0"), ("max-test-requests", "2.5")])
def test_a_bad_own_limit_is_one_line_naming_the_node_config_key(key, value):
    with pytest.raises(FederationError) as err:
        own_limits(RunConfig(), dict(NODE, **{key: value}))
    assert str(err.value).startswith(f"node-config: {key}={value!r}; allowed:") and "\n" not in str(err.value)


def test_a_guests_own_budget_stops_a_run_whose_job_allows_more(tmp_path):
    """Deployment nodes over the real coordinator and ClientApp handler: the job allows ε 10,000 per
    party, guest-1's node config only what its first epoch costs plus half its second: the run stops
    cleanly (``budget``) after epoch 1, guest-1's ledger within its own budget, nothing over it released;
    the same job without the node's limit runs every epoch."""
    paths = write_party_tables(tmp_path)
    seed = PrivateSeed.generate()
    cfg = RunConfig(data="node-tables", engine="flower", data_plane="flower", defense="laplace", epsilon=4.0,
                    **{**RUN, "epochs": 3}, budget=10_000.0)
    free = VerticalSplitStrategy(cfg).run(InlineGrid(_nodes(tmp_path, paths, seed)))
    assert len(free["history"]) == 3 and free["stopped_reason"] == "completed"
    per_epoch = free["privacy"]["guest-1"]["epsilon_by_epoch"]
    own = (float(per_epoch["1"]) + float(per_epoch["2"])) / 2
    nodes = _nodes(tmp_path, paths, seed)
    nodes[1]["budget"] = repr(own)  # guest-1's operator's own limit
    tight = VerticalSplitStrategy(cfg).run(InlineGrid(nodes))
    assert tight["stopped_reason"] == "budget" and len(tight["history"]) == 1, tight.get("stopped_detail")
    assert "guest-1" in tight["stopped_detail"]
    assert tight["privacy"]["guest-1"]["epsilon"] <= own < free["privacy"]["guest-1"]["epsilon"]
