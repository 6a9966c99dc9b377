"""``--init-from DIR`` under Flower (issue 24): each node continues from its own saved part.

A simulation's nodes read ``DIR/<party>/`` (one machine); a deployment node reads its node-config
``init-from`` (else ``model-dir``), never the coordinator's path. Both equal the local engine's
continued run on the same private seed, which differs from a run from a fresh initialisation.
"""

from __future__ import annotations

import pytest

from fl_split.errors import PartyError
from fl_split.flower.strategy import VerticalSplitStrategy
from fl_split.party_files import export_parties
from tests.test_flower import PS, InlineGrid, _cfg, _local, _simulation_nodes, _strip

pytestmark = pytest.mark.usefixtures("flower_task_identity")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model trained locally and saved (each party's own part under ``DIR/<party>/``)."""
    directory = tmp_path_factory.mktemp("model") / "model"
    _local(_cfg(epochs=2, save_model=str(directory)))
    return directory


def _continued(saved, **kw):
    # the next month's run: another seed for the batch order, the saved weights as the start
    return _cfg(epochs=1, seed=4, init_from=str(saved), **kw)


def test_simulation_continues_from_each_partys_saved_part(saved):
    cfg = _continued(saved)
    want = _local(cfg)
    fresh = _local(cfg.replace(init_from=""))
    assert want["history"][0]["test_metric"] != fresh["history"][0]["test_metric"]  # the saved weights count
    got = VerticalSplitStrategy(cfg).run(InlineGrid(_simulation_nodes(3), fresh_process=True))
    assert _strip(got) == _strip(want)


def _deployment_configs(tmp_path, cfg, key: str | None, saved):
    from fl_split.secure_files import write_private

    files = export_parties(cfg.replace(init_from=""), tmp_path / "parties")
    configs = []
    for party, path in files.items():
        node = {"role": "host"} if party == "host" else {"role": "guest", "guest-index": int(party.split("-")[1])}
        seed = write_private(tmp_path / f"{party}.seed", PS.for_party(party).file_text().encode())
        node.update({"data-path": str(path), "private-seed-file": str(seed)})
        if key is not None:
            node[key] = str(saved)
        configs.append(node)
    return configs


@pytest.mark.parametrize("key", ["init-from", "model-dir"])
def test_deployment_nodes_read_their_own_part_from_their_node_config(tmp_path, saved, key):
    """The coordinator's ``--init-from`` names a folder that does not exist on the nodes: each node
    reads the folder its own node-config names (``init-from``, else ``model-dir``)."""
    cfg = _continued(saved, data_plane="flower")
    want = _local(cfg)
    sent = cfg.replace(init_from="/nowhere/on/the/coordinator")
    configs = _deployment_configs(tmp_path, cfg, key, saved)
    got = VerticalSplitStrategy(sent).run(InlineGrid(configs, fresh_process=True))
    assert _strip(got)["history"] == _strip(want)["history"]
    assert got["privacy"] == want["privacy"]


def test_a_deployment_node_without_a_folder_is_refused_in_one_line(tmp_path, saved):
    cfg = _continued(saved, data_plane="flower")
    configs = _deployment_configs(tmp_path, cfg, None, saved)
    with pytest.raises(PartyError, match=r"failed in round 0: FederationError: (host|guest-\d) node-config: no "
                                         r"init-from \(or model-dir\); the run continues from a saved model"):
        VerticalSplitStrategy(cfg).run(InlineGrid(configs))
