"""``flwr run .`` as a Flower user types it (issue 25, item 2).

Flower's default federation (flwr 1.41: 2 simulated SuperNodes, each ClientApp reserving 2 CPUs)
runs one ClientApp at a time on a 2-core machine, and the direct data plane needs all ``G + 1`` at
once. The ServerApp of ``flwr run`` fits itself to that: it runs the relay data plane and says so in
one line (:func:`fl_split.flower.strategy.fit_data_plane`); an error fl_split raises is one log line,
not a traceback (:class:`fl_split.flower.strategy.OneLineErrors`).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from fl_split.errors import ConfigError
from fl_split.flower import records as R
from fl_split.flower.strategy import OneLineErrors, VerticalSplitStrategy, fit_data_plane
from tests.test_flower import InlineGrid, _cfg, _local, _simulation_nodes, _strip

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("flower_task_identity")
#: what Flower's default federation gives each ClientApp on this 2-core machine (measured inside a
#: ClientApp: ``ray.get_runtime_context().get_assigned_resources()``, ``ray.nodes()``)
DEFAULT_FEDERATION_HERE = {"num_cpus": 2.0, "num_gpus": 0.0, "nodes": [{"CPU": 2.0, "GPU": 0.0}]}


def _capacity(monkeypatch, cap):
    from fl_split.flower import resources

    monkeypatch.setattr(resources, "capacity_here", lambda: dict(cap))


def test_flwr_run_runs_the_relay_data_plane_when_the_clientapps_do_not_fit(monkeypatch, caplog):
    """One ClientApp at a time (the default federation on 2 cores): the ServerApp of ``flwr run``
    switches to the relay data plane before any party is set up, logs one line saying so, and gets
    exactly the local engine's results for the relay configuration; nothing crosses as ``train.epoch``."""
    _capacity(monkeypatch, DEFAULT_FEDERATION_HERE)
    cfg = _cfg(guests=1, epochs=2)
    grid = InlineGrid(_simulation_nodes(2))
    strategy = VerticalSplitStrategy(cfg, fit_resources=True)
    with caplog.at_level(logging.INFO, logger="fl_split"):
        got = strategy.run(grid)
    lines = [r.getMessage() for r in caplog.records if "relay data plane" in r.getMessage()]
    assert lines == ["fl_split: relay data plane (--data-plane flower, one ClientApp at a time, same results, "
                     "slower): Flower's federation fits 1 of the 2 ClientApps at once (2 CPU each, Ray has 2); "
                     "for the direct data plane run `fl-split flwr-run` or give each ClientApp fewer CPUs "
                     "(--federation-config \"client-resources-num-cpus=1 init-args-num-cpus=2\")"]
    assert got["config"]["data_plane"] == "flower"
    assert _strip(got) == _strip(_local(cfg.replace(data_plane="flower")))
    assert R.MSG_EPOCH not in grid.types and R.MSG_STEP in grid.types
    # the setup message already carried the relay configuration: no party made a data-plane key pair
    assert strategy.transport.setup_replies and all("dataplane" not in r for r in strategy.transport.setup_replies.values())


def test_flwr_run_keeps_the_direct_data_plane_when_the_clientapps_fit(monkeypatch, caplog):
    _capacity(monkeypatch, {"num_cpus": 1.0, "num_gpus": 0.0, "nodes": [{"CPU": 2.0, "GPU": 0.0}]})
    cfg = _cfg(guests=1, epochs=1)
    grid = InlineGrid(_simulation_nodes(2))
    with caplog.at_level(logging.INFO, logger="fl_split"):
        got = VerticalSplitStrategy(cfg, fit_resources=True).run(grid)
    assert got["config"]["data_plane"] == "direct" and R.MSG_EPOCH in grid.types
    assert not any("relay data plane" in r.getMessage() for r in caplog.records)


def test_fit_data_plane_rules():
    """What the fitting changes, and what it leaves alone: a relay run, a deployment (no capacity
    reported), and ``--on-guest-failure pad`` (direct only: refused with the capacity message)."""
    cap = R.dumps(DEFAULT_FEDERATION_HERE)
    relay = _cfg(data_plane="flower")
    assert fit_data_plane(relay, cap) == (relay, None)
    assert fit_data_plane(_cfg(), None) == (_cfg(), None)
    for needs_direct in ({"on_guest_failure": "pad"}, {"engine": "flower", "checkpoint_dir": "/tmp/x"}):
        with pytest.raises(ConfigError, match=r"^--num-cpus: got 2.0 \(the direct data plane runs all 3 ClientApps"):
            fit_data_plane(_cfg(**needs_direct), cap)
    cfg, line = fit_data_plane(_cfg(guests=3), R.dumps({"num_cpus": 0.5, "num_gpus": 0.0, "nodes": [{"CPU": 1.0}]}))
    assert cfg.data_plane == "flower" and "fits 2 of the 4 ClientApps" in line and "init-args-num-cpus=4" in line


def test_fl_split_errors_reach_flowers_log_as_one_line():
    """Flower logs the exception that ends a ServerApp with ``exc_info``; for fl_split's own errors
    the filter leaves one line (type and message, line breaks folded), for anything else the traceback."""
    flt = OneLineErrors()

    def record(exc):
        try:
            raise exc
        except Exception:  # noqa: BLE001
            return logging.LogRecord("flwr", logging.ERROR, __file__, 1, "%s raised an exception", ("Simulation",),
                                     sys.exc_info())

    rec = record(ConfigError("num-cpus", 2.0, "1 or less", reason="only 1 fit\nof 2"))
    assert flt.filter(rec) and rec.exc_info is None
    assert logging.Formatter().format(rec) == ("fl_split stopped the run: ConfigError: --num-cpus: got 2.0 "
                                               "(only 1 fit of 2); allowed: 1 or less")
    bug = record(KeyError("x"))
    assert flt.filter(bug) and "Traceback" in logging.Formatter().format(bug)


def _copy_of_the_repository(dest: Path) -> Path:
    """A fresh clone's files (what git tracks, as in the working tree)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(src.read_bytes())
    return dest


#: flwr 1.41 gives the local SuperLink it starts 15 s to answer (``LOCAL_SUPERLINK_STARTUP_TIMEOUT``,
#: not configurable), then kills it; on this shared 2-core machine under load that happens
SUPERLINK_SLOW = "Failed to start local SuperLink within"


def _flwr_run(argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``flwr ARGV`` as typed; started again (at most twice) only when Flower's own 15 s start-up
    limit for its local SuperLink ran out (it then starts nothing else)."""
    for _ in range(3):
        proc = subprocess.run([str(Path(sys.executable).parent / "flwr"), *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
        if SUPERLINK_SLOW not in proc.stdout + proc.stderr:
            return proc
    return proc


@pytest.mark.slow
def test_flwr_run_as_typed_with_the_default_federation(tmp_path):
    """``flwr run . --stream`` from a copy of the repository, with nothing configured: Flower creates
    its default configuration and federation and starts its own local SuperLink (here on private
    ports and a private HOME). A run fl_split refuses is one line, not a traceback; the default job
    then completes on the relay data plane (one line says so) and prints each epoch's accuracy and
    each party's epsilon. Offline: ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (else the
    SuperLink runs ``uv sync``, which needs the package index). The SuperLink ``flwr run`` leaves
    running is stopped here (exactly its sessions)."""
    from tests.services import FlwrRunHome

    app = _copy_of_the_repository(tmp_path / "fl_split")
    home = FlwrRunHome()
    env = dict(home.env, PYTHONPATH=str(app), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    try:
        # pad needs the direct data plane, which does not fit: refused, as one line
        bad = _flwr_run(["run", ".", "--stream", "--run-config", "on-guest-failure='pad' epochs=1"], app, env, 400)
        text = bad.stdout + bad.stderr
        assert "Traceback" not in text, text[-4000:]
        ours = [ln for ln in text.splitlines() if "fl_split stopped the run" in ln]
        assert len(ours) == 1 and "ConfigError: --num-cpus: got 2.0" in ours[0], text[-4000:]
        assert bad.returncode == 0  # Flower's CLI: a failed run still exits 0 (README, next to fl-split flwr-run)
        assert home.ours(), "flwr run left its SuperLink running (measured in flwr 1.41)"

        proc = _flwr_run(["run", ".", "--stream"], app, env, 900)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "Traceback" not in text, text[-4000:]
        assert "(2 simulated SuperNodes)" in text  # Flower's default federation
        assert text.count("fl_split: relay data plane") == 1, text[-4000:]
        assert "epoch 5: train loss" in text and "test accuracy" in text, text[-4000:]
        assert "host: none, no differential privacy claimed" in text
        assert "guest-1: gaussian, epsilon = " in text
    finally:
        home.stop()
        left = home.ours()
        home.cleanup()
    assert left == []
