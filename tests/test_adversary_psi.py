"""A party that inflates its ``--align psi`` input is refused by every party it exceeds.

docs/threat-model.md, "Alignment", "Bounded inputs": a guest that submits the whole ID space (20,000 IDs; the others hold 600) would learn the
others' intersection, IDs it never held included. Every party's set size is announced with its start
and checked by every other party against its own limit (``--psi-max-peer-ids``; in a deployment its
node config) before any element of that party's list is blinded: the refusal is one line naming the
peer, its announced size, the limit and the flag; nothing is learned and nothing written. An honest
unbalanced alignment passes once configured."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import fl_split.psi as psi
from fl_split.config import RunConfig
from fl_split.errors import DataError, ProtocolError
from fl_split.psi import LocalRoute, PsiParty, align_by_psi, list_frame, peer_limit, read_list, run_psi, sizes_frame
from tests.helpers import run_cli

SPACE = 20_000
PARTIES = ["host", "guest-1", "guest-2"]


def _sets(seed: int = 0):
    """host and guest-1 hold 600 IDs each of a 20,000-ID space; guest-2 (the adversary) all of it."""
    rng = np.random.default_rng(seed)
    space = np.arange(1_000_000, 1_000_000 + SPACE)
    host = np.sort(rng.choice(space, 600, replace=False))
    g1 = np.sort(np.concatenate([rng.choice(host, 300, replace=False),
                                 rng.choice(np.setdiff1d(space, host), 300, replace=False)]))
    return {"host": host, "guest-1": g1, "guest-2": space}


def _refusal(line: str, me: str, flag: str) -> None:
    assert "\n" not in line
    assert line.startswith(f"{me}: PSI refused: guest-2 announced 20,000 IDs, more than {me}'s limit of 10,600 "
                           f"peer IDs (the default: the larger of 4x its 600 IDs and 600 + 10,000)"), line
    assert f"{me} sets {flag}" in line, line


def test_default_limits():
    assert peer_limit("", 600) == (10_600, "the default: the larger of 4x its 600 IDs and 600 + 10,000")
    assert peer_limit("", 100_000)[0] == 400_000
    assert peer_limit("25x", 600)[0] == 15_000 and peer_limit("50000", 600)[0] == 50_000
    assert peer_limit("1.5X", 1000)[0] == 1500
    for bad in ("0", "-3", "x", "abc", "0x", "nanx", "4y"):
        with pytest.raises(ValueError, match="psi-max-peer-ids"):
            peer_limit(bad, 600)
    with pytest.raises(Exception, match="psi-max-peer-ids"):
        RunConfig(psi_max_peer_ids="lots")


def test_an_inflated_set_is_refused_before_any_of_it_is_blinded(monkeypatch):
    """In process: both victims refuse guest-2's 20,000 announced IDs before blinding any of them.

    No party blinds a value of guest-2's list, no positions are sent, nobody learns an intersection."""
    ids = _sets()
    blinded: list[tuple[str, int]] = []
    real = psi.blind
    monkeypatch.setattr(psi, "blind", lambda pts, key, what, tick=None: blinded.append((what, len(pts)))
                        or real(pts, key, what, tick))
    seen = []
    route = LocalRoute(ids)
    with pytest.raises(DataError) as err:
        run_psi(route, PARTIES, lambda *m: seen.append(m))
    _refusal(str(err.value), "host", "--psi-max-peer-ids")
    # only the three own lists were blinded (guest-2's by guest-2 itself); nothing of a peer's
    assert sorted(blinded) == sorted([("host: its own IDs", 600), ("guest-1: its own IDs", 600),
                                      ("guest-2: its own IDs", SPACE)])
    assert [m[0] for m in seen] == ["list"] * 3  # the starts; no positions
    assert all(p._shared is None for p in route.parties.values())
    # guest-1 refuses too (its own check, the same line), before reading any of the list
    g1 = route.parties["guest-1"]
    with pytest.raises(DataError) as err:
        g1.hop(sizes_frame("guest-1", [600, 600, SPACE], b"not even a frame"))
    _refusal(str(err.value), "guest-1", "--psi-max-peer-ids")
    assert g1.round == 1 and g1.sizes is None
    # align_by_psi: the same, and no intersection comes back
    with pytest.raises(DataError, match="guest-2 announced 20,000 IDs"):
        align_by_psi(ids)


def test_a_party_that_sends_more_than_it_announced_is_refused():
    """The lists a party blinds must hold exactly what their origin announced.

    A coordinator that misstates the party's own size, or skips the announcement, is refused too."""
    order = ["host", "guest-1"]
    host, guest = PsiParty("host", np.arange(0, 50), order), PsiParty("guest-1", np.arange(25, 80), order)
    mine = host.start()
    guest.start()
    _, _, pts = read_list(mine, "host", "guest-1")
    bigger = list_frame("host", "guest-1", 0, 1, np.concatenate([pts, pts[:5]]))
    with pytest.raises(ProtocolError, match="PSI list of host with 55 values, but host announced 50; refused"):
        guest.hop(sizes_frame("guest-1", [50, 55], bigger))
    with pytest.raises(ProtocolError, match="announced 60 IDs for this party, which holds 55"):
        guest.hop(sizes_frame("guest-1", [50, 60], mine))
    with pytest.raises(ProtocolError, match="expected 'sizes'"):
        guest.hop(mine)
    assert guest.round == 1
    out = guest.hop(sizes_frame("guest-1", [50, 55], mine))  # the honest round still works
    assert read_list(out, "guest-1", "coordinator")[2].shape == (50, 32)


def test_an_honest_unbalanced_alignment_passes_when_configured():
    """An honest unbalanced pair is refused by the default and aligns when configured.

    One small party (600) and one large (15,000, holding the small one's IDs): --psi-max-peer-ids
    25x (or 15000)."""
    small = np.arange(5_000, 5_600)
    ids = {"host": small, "guest-1": np.arange(0, 15_000)}
    with pytest.raises(DataError, match="guest-1 announced 15,000 IDs, more than host's limit of 10,600"):
        align_by_psi(ids)
    for spec in ("25x", "15000"):
        np.testing.assert_array_equal(align_by_psi(ids, max_peer_ids=spec), small)
    with pytest.raises(DataError, match="limit of 14,999 peer IDs"):
        align_by_psi(ids, max_peer_ids="14999")


def _tables(tmp_path, ids: dict[str, np.ndarray]) -> dict[str, str]:
    rng = np.random.default_rng(1)
    paths = {}
    for p, v in ids.items():
        frame = pd.DataFrame({"ID": v, f"{p}-a": rng.normal(size=len(v)), f"{p}-b": rng.normal(size=len(v))})
        if p == "host":
            frame["Y"] = rng.integers(0, 2, len(v))
        paths[p] = str(tmp_path / "tables" / f"{p}.csv")
        (tmp_path / "tables").mkdir(exist_ok=True)
        frame.to_csv(paths[p], index=False)
    return paths


def _train(paths, tmp_path, *extra):
    return ["train", "--data", ";".join(f"{p}={v}" for p, v in paths.items()), "--id-column", "ID",
            "--label-column", "Y", "--guests", str(len(paths) - 1), "--align", "psi", "--epochs", "1",
            "--no-progress", "--out", str(tmp_path / "r.json"), *extra]


def test_the_cli_refuses_the_inflation_with_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    paths = _tables(tmp_path, _sets())
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, _, err = run_cli(_train(paths, tmp_path), capsys)
    assert code == 2, err
    line = err.strip()
    assert line.startswith("fl-split: error: ")
    _refusal(line.removeprefix("fl-split: error: "), "host", "--psi-max-peer-ids")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_the_cli_aligns_an_honest_unbalanced_case_when_configured(tmp_path, capsys, monkeypatch):
    small = np.arange(5_000, 5_600)
    paths = _tables(tmp_path, {"host": small, "guest-1": np.arange(0, 12_000)})
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(_train(paths, tmp_path), capsys)
    assert code == 2 and "guest-1 announced 12,000 IDs" in err and "--psi-max-peer-ids" in err, err
    code, _, err = run_cli(_train(paths, tmp_path, "--psi-max-peer-ids", "20x"), capsys)
    assert code == 0, err
    import json

    res = json.loads((tmp_path / "r.json").read_text())
    assert res["plan"]["n_train"] + res["plan"]["n_test"] == 600


# -- a deployment: each node's own limit from its node config (the in-process node handler) -----------
class _Nodes:
    """The ``exchange`` of a Flower transport, answered in process by each node's ``handle_align``.

    Each node with its own node config and ``context.state`` (what a SuperNode runs per message)."""

    def __init__(self, cfg, paths, node_configs):
        from flwr.app import Context, RecordDict

        from fl_split.flower.node import NodeRole

        self.cfg, self.guests = cfg, [p for p in paths if p != "host"]
        self.roles = {p: NodeRole(p, "host" if p == "host" else "guest", i, "deployment", paths[p])
                      for i, p in enumerate(paths)}
        self.node_configs = node_configs
        self.ctx = {p: Context(run_id=1, node_id=i + 2, node_config=node_configs.get(p, {}), state=RecordDict(),
                               run_config={}) for i, p in enumerate(paths)}

    def exchange(self, requests, _round):
        from fl_split.flower import records as R
        from fl_split.flower.alignment import handle_align

        return {p: handle_align(self.cfg, self.roles[p], R.request_of(content), self.ctx[p].state,
                                dict(self.ctx[p].node_config))
                for p, (_, content) in requests.items()}


def test_deployment_nodes_refuse_the_inflation_with_their_own_limits(tmp_path):
    from fl_split.flower.alignment import ALIGNED, PSI_STATE, align_nodes

    ids = _sets()
    paths = _tables(tmp_path, ids)
    cfg = RunConfig(data="node-tables", align="psi", engine="flower", data_plane="flower", guests=2, seed=3,
                    epochs=1, id_column="ID", label_column="Y", progress=False)
    nodes = _Nodes(cfg, paths, {})
    with pytest.raises(DataError) as err:
        align_nodes(nodes, cfg)
    _refusal(str(err.value), "host", "this node's node-config psi-max-peer-ids")
    for p in PARTIES:  # nothing agreed; no node went past its start
        assert ALIGNED not in nodes.ctx[p].state.config_records
    assert int(nodes.ctx["host"].state.config_records[PSI_STATE]["round"]) == 1
    # the coordinator's run config cannot loosen a node's limit ...
    loose = cfg.replace(psi_max_peer_ids="100000")
    with pytest.raises(DataError, match="guest-2 announced 20,000 IDs, more than host's limit of 10,600"):
        align_nodes(_Nodes(loose, paths, {}), loose)
    # ... a node's own node config can (both victims raise theirs), and the run config can lower it again
    mine = {"host": {"psi-max-peer-ids": "40x"}, "guest-1": {"psi-max-peer-ids": "40x"}}
    got = align_nodes(_Nodes(cfg, paths, mine), cfg)
    assert got["shared_ids"] == len(np.intersect1d(ids["host"], ids["guest-1"]))  # what the adversary would learn
    tight = cfg.replace(psi_max_peer_ids="10x")
    with pytest.raises(DataError, match=r"limit of 6,000 peer IDs \(10x its 600 IDs\).*run config's psi-max-peer-ids"):
        align_nodes(_Nodes(tight, paths, mine), tight)


def test_deploy_local_gives_each_node_the_users_own_limit(tmp_path):
    """``deploy local --psi-max-peer-ids``: every party is the user's, so each node's own node config
    carries the limit (the run config alone could only lower a node's)."""
    from fl_split.deploy import LocalDeployment

    paths = _tables(tmp_path, {"host": np.arange(600), "guest-1": np.arange(12_000)})
    spec = ";".join(f"{p}={v}" for p, v in paths.items())
    for value, want in (("20x", "psi-max-peer-ids='20x'"), ("", None)):
        cfg = RunConfig(data=spec, id_column="ID", label_column="Y", guests=1, align="psi", psi_max_peer_ids=value)
        dep = LocalDeployment(cfg, tmp_path / "dep", tls=False)
        dep.dataplane_port = 1  # not started: only its node configs are read
        text = dep.node_config("host")
        assert (want in text) if want else ("psi-max-peer-ids" not in text), text


def test_predict_refuses_an_inflated_set_and_takes_the_flag(tmp_path, capsys):
    """``fl-split predict --align psi`` (one process): a guest table inflated with 10,000 IDs the
    host never had is refused before anything is released; ``--psi-max-peer-ids`` aligns it."""
    from tests.test_save_predict import _tables as _party_tables
    from tests.test_save_predict import _train as _train_saved

    paths = _party_tables(tmp_path, guests=1)
    _train_saved(tmp_path, paths)
    host = pd.read_csv(paths["host"]).head(50)
    guest = pd.read_csv(paths["guest-1"])
    fake = guest.sample(10_100, replace=True, random_state=0).assign(ID=np.arange(10**9, 10**9 + 10_100))
    new = {"host": tmp_path / "new-host.csv", "guest-1": tmp_path / "new-guest-1.csv"}
    host.to_csv(new["host"], index=False)
    pd.concat([guest, fake]).to_csv(new["guest-1"], index=False)
    n = len(guest) + 10_100
    argv = ["predict", "--model", str(tmp_path / "model"), "--data", f"host={new['host']}",
            "--data", f"guest-1={new['guest-1']}", "--id-column", "ID", "--label-column", "Y", "--align", "psi",
            "--out", str(tmp_path / "p.csv")]
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "model").rglob("*"))
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"host: PSI refused: guest-1 announced {n:,} IDs, more than host's limit of 10,050 peer IDs" in err
    assert "host sets --psi-max-peer-ids" in err
    assert not (tmp_path / "p.csv").exists()
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "model").rglob("*")) == before  # nothing charged
    code, _, err = run_cli([*argv, "--engine", "flower", "--psi-max-peer-ids", "300x"], capsys)
    assert code == 2 and "--psi-max-peer-ids: got '300x'" in err and "node config psi-max-peer-ids" in err, err
    code, out, err = run_cli([*argv, "--psi-max-peer-ids", "300x"], capsys)
    assert code == 0, err
    assert "scored 50 records" in out
