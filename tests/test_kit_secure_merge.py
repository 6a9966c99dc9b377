"""``--secure-merge`` in deployments built from kits (docs/deploy.md, "Secure merge in a deployment"):
each guest kit's ``init`` makes a long-term identity of its own, only its public half travels — to
the other guests — and each guest's ``start`` pins the run's guests from its own key and its inbox;
a tampered identity in one guest's inbox makes that guest refuse before any release."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from fl_split.config import RunConfig
from fl_split.errors import PartyError
from fl_split.flower import records as R
from fl_split.kit import COORDINATOR, KitError, _start_args, deliver, node_step, read_kit, update_kit, write_kits
from fl_split.privacy import secure_merge as sm
from tests.test_flower import PS, InlineGrid, _strip
from tests.test_secure_merge_flower import _cfg

pytestmark = pytest.mark.usefixtures("flower_task_identity")

FLSPLIT = [sys.executable, "-m", "fl_split.cli"]




@pytest.fixture
def kits(tmp_path):
    """Kits of a secure-merge job for a host and three guests, each initialised by its own ``init``, the
    public files delivered and the guests' certificates signed (this process's umask restored)."""
    parties = ["host", "guest-1", "guest-2", "guest-3"]
    old = os.umask(0o077)
    try:
        made = write_kits(_cfg(), tmp_path / "kits", parties, "127.0.0.1:9093", "127.0.0.1:9300")
        for kit in made.values():
            node_step("init", kit)
        deliver(tmp_path / "kits", parties)
        node_step("sign", made["host"])
        deliver(tmp_path / "kits", parties)
    finally:
        os.umask(old)
    return made


def _node_config(kit: Path, table: Path) -> dict:
    """The ``--node-config`` a guest kit's ``start`` hands its SuperNode (its roster written by that step)."""
    from flwr.common.config import parse_config_args

    update_kit(kit, data_path=str(table))
    args = _start_args(kit, read_kit(kit))
    return parse_config_args([args[args.index("--node-config") + 1]])


def _run(tmp_path: Path, kits: dict[str, Path], cfg: RunConfig):
    """The job on in-process nodes (the relay data plane) whose guests have their kits' secure-merge node
    config; every party also its own seed file, so that the numbers can equal the local engine's. Each
    message restores its node's party from its state (the identity is read again from the key file)."""
    from fl_split.flower.node import handle
    from fl_split.flower.strategy import VerticalSplitStrategy
    from fl_split.party_files import export_parties
    from fl_split.secure_files import write_private

    files = export_parties(cfg.replace(engine="local"), tmp_path / "parties")
    nodes = []
    for p in ["host", "guest-1", "guest-2", "guest-3"]:
        node = {"role": "host"} if p == "host" else {"role": "guest", "guest-index": int(p.split("-")[1])}
        if p != "host":
            kit_config = _node_config(kits[p], files[p])
            node.update({k: kit_config[k] for k in ("secure-merge-identity", "secure-merge-roster")})
        seed = write_private(tmp_path / f"{p}.seed", PS.for_party(p).file_text().encode())
        node.update({"data-path": str(files[p]), "private-seed-file": str(seed)})
        nodes.append(node)
    grid = InlineGrid(nodes, app=lambda message, context: handle(message, context, None), fresh_process=True)
    return grid, (lambda: VerticalSplitStrategy(cfg).run(grid))


def test_each_guest_pins_every_guest_from_its_own_kit_and_the_numbers_are_the_local_engines(kits, tmp_path):
    """Only the guests' public identities travel, each to the other guests (never to the host or the
    coordinator); each guest's roster lists every guest, its own entry from its own key; the job on the
    kits' node configs equals the local engine's (the masks cancel whatever the identities)."""
    from fl_split.engine import LocalEngine

    guests = ["guest-1", "guest-2", "guest-3"]
    for other in ("host", COORDINATOR):
        assert not [p for p in (kits[other] / "inbox").iterdir() if p.name.startswith("secure-merge-")]
    for g in guests:
        assert sorted(p.name for p in (kits[g] / "inbox").glob("secure-merge-*")) == sorted(
            f"secure-merge-{o}.pub" for o in guests if o != g)
        assert oct((kits[g] / "keys" / f"secure-merge-{g}.key").stat().st_mode & 0o777) == "0o600"
    cfg = _cfg()
    grid, run = _run(tmp_path, kits, cfg)
    rosters = {g: json.loads((kits[g] / "state" / "secure-merge-roster.json").read_text()) for g in guests}
    for g in guests:
        assert sorted(rosters[g]) == guests and rosters[g] == rosters["guest-1"]
        own = sm.read_identity(str(kits[g] / "keys" / f"secure-merge-{g}.key"), g)
        assert bytes.fromhex(rosters[g][g]) == sm.public_identity(own)
    got = run()
    assert got["stopped_reason"] == "completed"
    assert _strip(got) == _strip(LocalEngine(cfg.replace(engine="local"), PS).run())
    assert all(got["privacy"][g]["epsilon"] > 0 for g in guests)


def test_a_tampered_identity_in_a_guests_inbox_makes_it_refuse_before_any_release(kits, tmp_path):
    """guest-2's identity in guest-1's inbox replaced by another key (the file exchange was tampered
    with, and guest-1's operator did not compare the fingerprint): guest-1 refuses guest-2's relayed key
    in one line and no guest released anything; a missing identity stops guest-1's ``start`` in one line
    naming the file and what to do."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    inbox = kits["guest-1"] / "inbox"
    (inbox / "secure-merge-guest-2.pub").write_text(sm.public_identity_line(ed25519.Ed25519PrivateKey.generate(),
                                                                            "guest-2"))
    grid, run = _run(tmp_path, kits, _cfg(defense="none"))
    with pytest.raises(PartyError) as err:
        run()
    text = str(err.value)
    assert "guest-1: secure merge: guest-2's key is not signed by guest-2's pinned identity" in text, text
    assert "\n" not in text
    assert R.MSG_STEP not in grid.types and R.MSG_EPOCH not in grid.types  # nothing was released
    (inbox / "secure-merge-guest-3.pub").unlink()
    with pytest.raises(KitError) as err:
        _node_config(kits["guest-1"], tmp_path / "parties" / "guest-1.npz")
    text = str(err.value)
    assert text.startswith("secure merge: inbox/secure-merge-guest-3.pub is missing") and "\n" not in text
    assert "guest-3's operator" in text and "fingerprint" in text


def _kit_pids(workdir: Path) -> list[int]:
    from tests.services import pids_with_env

    return pids_with_env(f"FLWR_HOME={workdir.resolve()}".encode())


# The whole deployment (`fl-split deploy local --from-kits --secure-merge`) runs in
# tests/test_deploy_kit.py::test_loopback_deployment_from_the_kits, with the kits' other features.
