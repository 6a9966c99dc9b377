"""``fl-split deploy kit`` / ``deploy node`` / ``deploy local --from-kits`` (issue 25, item 3): a
folder per organisation, keys made by each organisation's own ``run.sh init``, only public files
exchanged (:data:`fl_split.kit.SENDS`), and the loopback deployment run by executing the kits.

A process belongs to a kit deployment when its ``FLWR_HOME`` lies under the work directory (each
kit sets its own; everything they start inherits it)."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fl_split.config import RunConfig
from fl_split.errors import ConfigError
from tests.services import pids_with_env
from fl_split.kit import COORDINATOR, deliver, update_kit, write_kits

FLSPLIT = [sys.executable, "-m", "fl_split.cli"]
PARTIES = ["host", "guest-1", "guest-2"]
SMALL = ["--dataset", "digits", "--guests", "2", "--epochs", "1", "--limit", "150", "--seed", "3",
         "--defense", "gaussian", "--batch-size", "32"]
ENV = dict(os.environ, PYTHON=sys.executable)


def _step(kit: Path, step: str, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", str(kit / "run.sh"), step, *options], env=ENV, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def _private_keys(kit: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in (kit / "keys").iterdir() if p.suffix == ".key" or p.name == "private-seed"} \
        if (kit / "keys").is_dir() else {}


def _assert_no_foreign_secret(kits: dict[str, Path], secrets: dict[str, list[bytes]]) -> None:
    """No file in ``name``'s kit holds a secret (private key, seed, table) of another organisation."""
    for name, kit in kits.items():
        foreign = [s for other, found in secrets.items() if other != name for s in found]
        for path in kit.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert not any(s in data for s in foreign), f"{path} holds another organisation's secret"


def _initialised(tmp_path: Path) -> dict[str, Path]:
    cfg = RunConfig(dataset="digits", guests=2, limit=150, seed=3, engine="flower")
    kits = write_kits(cfg, tmp_path / "kits", PARTIES, "127.0.0.1:9093", "127.0.0.1:9300")
    assert not any(p.name == "keys" for p in (tmp_path / "kits").rglob("*"))  # no key is in a fresh kit
    for name, kit in kits.items():
        out = _step(kit, "init")
        assert out.returncode == 0, out.stderr
    deliver(tmp_path / "kits", PARTIES)
    return kits


def test_kit_command_writes_a_folder_per_organisation_without_any_key(tmp_path):
    out = subprocess.run([*FLSPLIT, "deploy", "kit", "--out", str(tmp_path / "kits"), "--parties", "guest-1,host",
                          "--dataset", "digits", "--limit", "150", "--superlink", "link.example.org:9093",
                          "--dataplane", "10.0.0.7:9300"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kits = tmp_path / "kits"
    assert sorted(p.name for p in kits.iterdir()) == ["coordinator", "guest-1", "host"]
    for name in ("coordinator", "guest-1", "host"):
        assert {"run.sh", "kit.toml", "README.txt"} <= {p.name for p in (kits / name).iterdir()}
        assert stat.S_IMODE((kits / name).stat().st_mode) == 0o700
    files = [p for p in kits.rglob("*") if p.is_file()]
    assert not any(b"PRIVATE KEY" in p.read_bytes() for p in files)
    job = (kits / "coordinator" / "run-config.toml").read_text()
    assert "guests = 1" in job and "private-seed" not in job and "link.example.org" not in job
    readme = (kits / "guest-1" / "README.txt").read_text()
    assert "outbox/guest-1.csr" in readme and "-> host" in readme and "-> coordinator" in readme
    assert 'data-path = ""' in (kits / "guest-1" / "kit.toml").read_text()  # the organisation fills it in


def test_kit_command_accepts_guests_that_agree_with_parties(tmp_path):
    out = subprocess.run([*FLSPLIT, "deploy", "kit", "--out", str(tmp_path / "k"), "--parties", "host,guest-1,guest-2",
                          "--guests", "2", "--dataset", "digits", "--limit", "150"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([*FLSPLIT, "deploy", "kit", "--out", str(tmp_path / "k1"), "--parties", "host,guest-1",
                          "--guests", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "host and 2 guests" in out.stderr, out.stderr


@pytest.mark.parametrize("parties, allowed", [("host,guest-2", "host,guest-1"), ("guest-1", "host,guest-1"),
                                              ("host,guest-1,guest-1", "each once")])
def test_kit_command_refuses_bad_parties_in_one_line(tmp_path, parties, allowed):
    out = subprocess.run([*FLSPLIT, "deploy", "kit", "--out", str(tmp_path / "k"), "--parties", parties],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--parties" in out.stderr and allowed in out.stderr


def test_each_organisation_makes_its_own_keys_and_only_public_files_travel(tmp_path):
    """``init`` in every kit, the exchange, the host's ``sign``: every private key is an owner-only
    file in its owner's ``keys/`` (0700) and in no other kit; each guest's certificate is the host
    CA's signature on the guest's own key, naming that guest."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    kits = _initialised(tmp_path)
    out = _step(kits["host"], "sign")
    assert out.returncode == 0, out.stderr
    deliver(tmp_path / "kits", PARTIES)
    secrets = {}
    for name, kit in kits.items():
        keys = _private_keys(kit)
        assert keys, name
        assert stat.S_IMODE((kit / "keys").stat().st_mode) == 0o700
        for path in keys:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        secrets[name] = list(keys.values())
    assert {p.name for p in _private_keys(kits["coordinator"])} == {"ca.key", "superlink.key"}
    assert {p.name for p in _private_keys(kits["host"])} == {"auth-host.key", "dataplane-ca.key", "dataplane-host.key"}
    assert {p.name for p in _private_keys(kits["guest-1"])} == {"auth-guest-1.key", "guest-1.key"}
    _assert_no_foreign_secret(kits, secrets)
    ca = x509.load_pem_x509_certificate((kits["guest-1"] / "inbox" / "dataplane-ca.crt").read_bytes())
    for guest in ("guest-1", "guest-2"):
        cert = x509.load_pem_x509_certificate((kits[guest] / "inbox" / f"{guest}.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        own = load_pem_private_key((kits[guest] / "keys" / f"{guest}.key").read_bytes(), None)
        assert cert.public_key().public_numbers() == own.public_key().public_numbers()
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [guest]
    # what the coordinator received: CA certificate out, the parties' public keys in, nothing else
    assert sorted(p.name for p in (kits[COORDINATOR] / "inbox").iterdir()) == [
        "auth-guest-1.pub", "auth-guest-2.pub", "auth-host.pub"]
    again = _step(kits["guest-1"], "init")  # never overwrites a key
    assert again.returncode == 2 and "init ran already" in again.stderr


def test_host_refuses_a_csr_naming_another_guest(tmp_path):
    kits = _initialised(tmp_path)
    inbox = kits["host"] / "inbox"
    (inbox / "guest-2.csr").write_bytes((inbox / "guest-1.csr").read_bytes())  # guest-1 asks to be guest-2
    out = _step(kits["host"], "sign")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "guest-2.csr" in out.stderr and "naming guest-2" in out.stderr
    assert not (kits["host"] / "outbox" / "guest-2.crt").exists()


def test_start_names_a_missing_table_or_file_in_one_line(tmp_path):
    kits = _initialised(tmp_path)
    out = _step(kits["guest-1"], "start")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "kit.toml data-path: got ''" in out.stderr and "--data-path" not in out.stderr, out.stderr  # a key, not a flag
    table = tmp_path / "guest-1.npz"
    table.write_bytes(b"")
    update_kit(kits["guest-1"], data_path=str(table))
    out = _step(kits["guest-1"], "start")  # the host has not signed its CSR yet
    assert out.returncode == 2 and "guest-1.crt is missing in inbox/" in out.stderr, out.stderr
    out = _step(kits["host"], "run")
    assert out.returncode != 0 and out.stderr.count("\n") == 1, out.stderr
    assert "sh run.sh run: not a step of host's kit; its steps: init, sign, start, fingerprints" in out.stderr
    out = _step(kits["guest-1"], "init", "--resume")  # the run's options are the coordinator's run's
    assert out.returncode != 0 and "--resume is an option of the coordinator's sh run.sh run only" in out.stderr


def _pyproject_version() -> str:
    import tomllib

    from fl_split.deploy import find_app_dir

    return tomllib.loads((find_app_dir() / "pyproject.toml").read_text())["project"]["version"]


def test_a_kit_holds_no_path_of_the_machine_that_wrote_it(tmp_path):
    """Kits are portable: written in a temporary folder from this checkout, no file of any kit holds
    that folder, the checkout's path or the home directory; the job's paths are the kit's own,
    relative, and resolve against wherever the kit lies when it runs (here: after a move); the app is
    the installed package, with its version."""
    import shutil
    import tomllib

    import fl_split
    from fl_split.kit import _job

    out = subprocess.run([*FLSPLIT, "deploy", "kit", "--out", "kits", "--parties", "host,guest-1,guest-2",
                          "--dataset", "digits", "--limit", "150", "--save-model", "model", "--checkpoint-dir",
                          "ck", "--data-root", str(tmp_path / "data")], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    checkout = str(Path(fl_split.__file__).resolve().parent.parent)
    home = str(Path.home())
    where = {str(tmp_path), str(tmp_path.resolve()), checkout} | ({home} if len(home) > 5 else set())
    files = [p for p in (tmp_path / "kits").rglob("*") if p.is_file()]
    assert len(files) == 4 + 3 * 3
    for path in files:
        data = path.read_bytes()
        assert not [w for w in where if w.encode() in data], f"{path} holds a path of this machine"
    coordinator = tomllib.loads((tmp_path / "kits" / COORDINATOR / "kit.toml").read_text())
    assert coordinator["app"] == "fl-split" and coordinator["fl-split-version"] == _pyproject_version()
    job = tomllib.loads((tmp_path / "kits" / COORDINATOR / "run-config.toml").read_text())
    assert (job["out"], job["checkpoint-dir"], job["save-model"], job["data-root"]) == (
        "results.json", "checkpoints/{run}", "model", "")
    host = tomllib.loads((tmp_path / "kits" / "host" / "kit.toml").read_text())
    assert (host["model-dir"], host["checkpoint-dir"], host["fl-split-version"], host["predict-out"]) == (
        "model", "checkpoints/{run}", _pyproject_version(), "predictions.csv")
    assert (host["budget"], host["max-test-requests"]) == ("", 1)  # its own limits (docs/threat-model.md)
    moved = tmp_path / "elsewhere" / "coordinator"
    shutil.copytree(tmp_path / "kits" / COORDINATOR, moved)
    resolved, results = _job(moved)
    assert results == moved / "results.json"
    job = tomllib.loads(resolved.read_text())
    first = Path(job["checkpoint-dir"])  # each run its own folder in the kit's checkpoints/
    assert job["out"] == str(moved / "results.json") and first.parent == moved / "checkpoints"
    assert job["resume"] is False
    job = tomllib.loads(_job(moved, resume=True)[0].read_text())  # --resume: the last run's folder
    assert (job["checkpoint-dir"], job["resume"]) == (str(first), True)
    job = tomllib.loads(_job(moved, save_model=True, init_from=True)[0].read_text())  # a new run: a new folder
    assert Path(job["checkpoint-dir"]).parent == first.parent and job["checkpoint-dir"] != str(first)
    assert (job["save-model"], job["init-from"], job["resume"]) == ("model", "model", False)


def test_each_readme_starts_with_what_to_install_and_run_sh_says_it_in_words(tmp_path):
    """README.txt opens with ``pip install fl-split==VERSION`` (pyproject's name and version); ``sh
    run.sh init`` with a Python lacking fl_split says what to install instead of a traceback; with
    another installed version, ``init`` stops with one line naming both versions and writes no key."""
    version = _pyproject_version()
    kits = write_kits(RunConfig(dataset="digits", guests=2, limit=150, engine="flower"), tmp_path / "kits",
                      PARTIES, "127.0.0.1:9093", "127.0.0.1:9300")
    for kit in kits.values():
        first = (kit / "README.txt").read_text().splitlines()[:3]
        assert first[0].startswith(f"Install first, on this machine: fl-split {version}"), first
        assert first[1].strip() == f"pip install fl-split=={version}"
    fake = tmp_path / "python-without-fl-split"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'fl_split'\" >&2\nexit 1\n")
    fake.chmod(0o700)
    out = subprocess.run(["/bin/sh", str(kits["guest-1"] / "run.sh"), "init"], env=dict(ENV, PYTHON=str(fake)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"pip install fl-split=={version}" in out.stderr and "No module named" not in out.stderr
    update_kit(kits["guest-1"], fl_split_version="0.0.0")
    out = _step(kits["guest-1"], "init")
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert f"written for fl-split 0.0.0, but {sys.executable} has fl-split {version}" in out.stderr
    assert "pip install fl-split==0.0.0" in out.stderr and not (kits["guest-1"] / "keys").exists()


def test_the_installed_packages_app_is_the_checkouts_code(tmp_path):
    """A kit's ``run`` submits the Flower app of the installed package (:func:`fl_split.kit.package_app`,
    no checkout needed): its FAB holds the same code and the same ``[tool.flwr]`` tables as the
    checkout's FAB, under the package's name and version."""
    import io
    import tomllib
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    from fl_split.deploy import staged_app
    from fl_split.kit import package_app

    ours, checkout = (zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))) for app in (
        package_app(tmp_path / "app"), staged_app(tmp_path / "checkout")))
    code = [{n: z.read(n) for n in z.namelist() if n.endswith(".py")} for z in (ours, checkout)]
    assert code[0] == code[1] and "strategies/server_app.py" in code[0] and "clients/client_app.py" in code[0]
    meta = [tomllib.loads(z.read("pyproject.toml").decode()) for z in (ours, checkout)]
    assert meta[0]["tool"]["flwr"] == meta[1]["tool"]["flwr"]
    assert (meta[0]["project"]["name"], meta[0]["project"]["version"]) == ("fl-split", _pyproject_version())


def _kit_pids(workdir: Path) -> list[int]:
    return pids_with_env(f"FLWR_HOME={workdir.resolve()}".encode())


@pytest.mark.slow
def test_loopback_deployment_from_the_kits(tmp_path):
    """``deploy local --from-kits --secure-merge --merge sum``: the kits' run.sh executed as the
    organisations would (TLS, SuperNode authentication, the host's CA signing the guests' CSRs, each
    guest's own secure-merge identity exchanged through the kits); the same final accuracy, loss and
    ε as the local engine with the same seeds (as ``deploy local``, tests/test_deploy.py); no kit holds
    another organisation's key, seed or table; each guest's roster (its ``start``'s) lists both
    guests; nothing left. The coordinator submitted the installed package's app (kit.toml ``app =
    "fl-split"``); with ``--save-model`` each kit's node saved its own part and the results record the
    saved model. (One deployment for both features: a user meets them together, and a deployment
    costs ~40 s of the suite.)"""
    small = [*SMALL, "--sigma", "1.0", "--merge", "sum", "--secure-merge"]
    workdir, out_path, model = tmp_path / "dep", tmp_path / "results.json", tmp_path / "model"
    proc = subprocess.run([*FLSPLIT, "deploy", "local", "--from-kits", *small, "--private-seed", "5",
                           "--insecure-private-seed", "--save-model", str(model), "--workdir", str(workdir),
                           "--out", str(out_path)],
                          capture_output=True, text=True, timeout=1200)
    left = _kit_pids(workdir)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert left == [], f"processes left running: {left}"
    results = json.loads(out_path.read_text())
    assert results["config"]["secure_merge"] and results["deployment"]["tls"] and results["deployment"]["node_auth"]
    assert results["saved_model"] == {"dir": str(model.resolve()), "parties": PARTIES}
    assert sorted(p.name for p in model.iterdir()) == sorted(PARTIES)
    kits = {p.name: p for p in (workdir / "kits").iterdir()}
    assert (kits[COORDINATOR] / "app" / "strategies" / "server_app.py").is_file()
    assert sorted(kits) == ["coordinator", "guest-1", "guest-2", "host"]
    assert not (workdir / "certs").exists()  # no central key maker: every key came from a kit's init
    secrets = {name: list(_private_keys(kit).values()) for name, kit in kits.items()}
    for party in PARTIES:  # its table is its own secret too (the host's holds the labels)
        secrets[party].append((workdir / "parties" / f"{party}.npz").read_bytes())
        assert (kits[party] / "keys" / "private-seed").is_file()
    for g in ("guest-1", "guest-2"):  # its secure-merge identity key is a secret of its own kit too
        secrets[g].append((kits[g] / "keys" / f"secure-merge-{g}.key").read_bytes())
        roster = json.loads((kits[g] / "state" / "secure-merge-roster.json").read_text())
        assert sorted(roster) == ["guest-1", "guest-2"]
        assert f"secure merge pins guest-{3 - int(g[-1])}'s identity SHA256:" in (
            workdir / "logs" / f"supernode-{g}.log").read_text(errors="replace")
    _assert_no_foreign_secret(kits, secrets)
    assert "https://127.0.0.1" in (workdir / "logs" / "superlink.log").read_text()
    for party in PARTIES:  # each kit's `start` kept its party warm: one process served every message
        log = (workdir / "logs" / f"supernode-{party}.log").read_text(errors="replace")
        # (a guest's first messages are the secure merge's key agreement: the epoch's number varies)
        assert log.count("party-runtime: pid ") == 1 and re.search(r"party-runtime: message \d+ \(train\.epoch\)",
                                                                    log), log[-2000:]
    from fl_split.cli import build_parser, config_from_args
    from fl_split.engine import run_experiment
    from fl_split.seeding import PrivateSeed

    local = run_experiment(config_from_args(build_parser().parse_args(["train", *small])),
                           private_seed=PrivateSeed.insecure(5))
    assert results["final"]["value"] == local["final"]["value"]
    assert results["final"]["train_loss"] == pytest.approx(local["final"]["train_loss"], rel=1e-6)
    for party, rep in local["privacy"].items():
        assert results["privacy"][party]["epsilon"] == rep["epsilon"]


def test_from_kits_refuses_insecure_in_one_line(tmp_path):
    out = subprocess.run([*FLSPLIT, "deploy", "local", "--from-kits", "--insecure", *SMALL,
                          "--workdir", str(tmp_path / "dep")], capture_output=True, text=True, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("fl-split: error:")]
    assert out.returncode == 2 and len(errors) == 1 and "--from-kits" in errors[0], out.stderr
    assert not (tmp_path / "dep").exists()  # refused before anything was written


def test_the_superlink_certificate_names_its_address_and_loopback(tmp_path):
    """``init`` names the ``--superlink`` host (an IP or a DNS name) **and** 127.0.0.1/localhost/::1
    in ``superlink.crt``: the SuperExec that Flower launches beside a SuperLink bound to 0.0.0.0
    dials 127.0.0.1 and checks the certificate against that."""
    from cryptography import x509

    for public in ("10.77.0.1", "link.example.org"):
        kits = write_kits(RunConfig(dataset="digits", guests=1, limit=150, engine="flower"), tmp_path / public,
                          ["host", "guest-1"], f"{public}:9093", "10.77.0.2:9300")
        assert _step(kits[COORDINATOR], "init").returncode == 0
        cert = x509.load_pem_x509_certificate((kits[COORDINATOR] / "keys" / "superlink.crt").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = set(san.get_values_for_type(x509.DNSName)) | {str(a) for a in san.get_values_for_type(x509.IPAddress)}
        assert {public, "127.0.0.1", "localhost", "::1"} <= names, names


def test_a_superlink_without_its_superexec_stops_run_in_one_line(tmp_path):
    """The coordinator's SuperLink runs here (``state/superlink.pid``) but its SuperExec died: ``run``
    says so with the reason from the SuperLink's log (``state/superlink.log``) before submitting,
    instead of a run left pending; a SuperLink not on this machine is not judged."""
    from fl_split.kit import KitError, _run, superexec_down

    kit = tmp_path / "coordinator"
    (kit / "state").mkdir(parents=True)
    assert superexec_down(kit) is None  # no SuperLink of this kit here
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "flower-superlink"])
    try:
        # what a SuperLink's process looks like: its script as argv[1] (python .../flower-superlink)
        script = tmp_path / "flower-superlink"
        script.write_text("import time\ntime.sleep(60)\n")
        link = subprocess.Popen([sys.executable, str(script)])
        try:
            import time

            from fl_split.kit import _cmdline

            while str(script) not in _cmdline(link.pid):  # until its exec is done
                time.sleep(0.01)
            (kit / "state" / "superlink.pid").write_text(f"{link.pid}\n")
            (kit / "state" / "superlink.log").write_text(
                "INFO : Starting Flower SuperLink\nTraceback (most recent call last):\n  File \"x\", line 1\n"
                "ssl.SSLCertVerificationError: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: IP address "
                "mismatch, certificate is not valid for '127.0.0.1'. (_ssl.c:1006)\n")
            down = superexec_down(kit)
            assert down and "no SuperExec" in down and "not valid for '127.0.0.1'" in down and "\n" not in down
            assert "must name 127.0.0.1" in down
            with pytest.raises(KitError, match="no SuperExec"):
                _run(kit, {"party": COORDINATOR, "superlink": "127.0.0.1:9093"})
            (kit / "state" / "superlink.pid").write_text(f"{fake.pid}\n")  # not a SuperLink: not judged
            assert superexec_down(kit) is None
        finally:
            link.kill()
            link.wait()
    finally:
        fake.kill()
        fake.wait()


def test_a_restarted_node_waits_in_words_and_an_unknown_key_is_named(capsys):
    """A refused activation (Flower's code 2004: a previous start still held online, or a key never
    registered) is retried and said once; past the window it is reported as an unregistered key; an
    unreachable SuperLink is said as such. docs/deploy.md, "A party restarts"."""
    import httpx

    from fl_split.flower.warm import patient_activation

    refusal = httpx.Response(412, text=json.dumps({"code": 2004, "detail": "Failed to activate SuperNode."}),
                             request=httpx.Request("POST", "https://link/v1/fleet/activate-node"))

    def client(refusals: int | None, window: float):
        class Client:  # Flower's Fleet HTTP client, as far as activation goes
            def ActivateNode(self, request):
                nonlocal refusals
                if refusals is None:
                    raise httpx.ConnectError("[Errno 111] Connection refused")
                if refusals:
                    refusals -= 1
                    raise httpx.HTTPStatusError("412", request=refusal.request, response=refusal)
                return "activated"

        patient_activation(Client, "link.example.org:9093", window=window, pause=0.01)
        return Client()

    assert client(2, 5).ActivateNode(None) == "activated"  # a restarted node: in once the old one expires
    err = capsys.readouterr().err
    assert err.count("still holds this node online") == 1, err
    with pytest.raises(RuntimeError, match="refused this SuperNode for 1 s: it has no registered public key .*"
                                           "`sh run.sh register`"):
        client(10 ** 6, 0.6).ActivateNode(None)  # never accepted: the key is not registered
    capsys.readouterr()
    unreachable = client(None, 5)
    for _ in range(2):  # Flower retries transport errors: said once
        with pytest.raises(httpx.ConnectError):
            unreachable.ActivateNode(None)
    err = capsys.readouterr().err
    assert err.count("cannot reach the SuperLink at link.example.org:9093") == 1 and "registered" not in err, err


def test_init_sign_and_fingerprints_print_what_the_standard_tools_print(tmp_path):
    """The out-of-band check (docs/deploy.md "Fingerprints"): ``init`` prints the fingerprint of every
    public file it makes, ``sign`` of every certificate it issues, ``fingerprints`` of what a kit sent
    and received — each as ``openssl x509 -fingerprint -sha256`` / ``ssh-keygen -l`` print it
    (recomputed here with those tools where installed, else with cryptography's own fingerprint)."""
    import re
    import shutil

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    def standard(path: Path) -> str:
        if path.suffix == ".crt":
            if shutil.which("openssl"):
                out = subprocess.run(["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", str(path)],
                                     capture_output=True, text=True, check=True).stdout
                return out.strip().split("=", 1)[1]
            return ":".join(f"{b:02X}" for b in x509.load_pem_x509_certificate(path.read_bytes())
                            .fingerprint(hashes.SHA256()))
        if path.suffix == ".pub" and shutil.which("ssh-keygen"):
            return subprocess.run(["ssh-keygen", "-l", "-f", str(path)], capture_output=True, text=True,
                                  check=True).stdout.split()[1]
        pytest.skip("no ssh-keygen to recompute an OpenSSH fingerprint independently")

    kits = write_kits(RunConfig(dataset="digits", guests=2, limit=150, seed=3, engine="flower"), tmp_path / "kits",
                      PARTIES, "127.0.0.1:9093", "127.0.0.1:9300")
    printed = {}
    for name, kit in kits.items():
        out = _step(kit, "init")
        assert out.returncode == 0, out.stderr
        for folder, file, value in re.findall(r"fingerprint (outbox|inbox)/(\S+): (\S+)", out.stdout):
            printed[(name, folder, file)] = value
    deliver(tmp_path / "kits", PARTIES)
    out = _step(kits["host"], "sign")
    assert out.returncode == 0, out.stderr
    signed = dict((f, v) for _, f, v in re.findall(r"fingerprint (outbox)/(\S+): (\S+)", out.stdout))
    assert sorted(signed) == ["guest-1.crt", "guest-2.crt"]
    for file, value in signed.items():
        assert value == standard(kits["host"] / "outbox" / file)
    made = {(n, f) for n, folder, f in printed}
    assert {(COORDINATOR, "ca.crt"), ("host", "auth-host.pub"), ("host", "dataplane-ca.crt"),
            ("guest-1", "auth-guest-1.pub"), ("guest-1", "guest-1.csr")} <= made
    for (name, folder, file), value in printed.items():
        if not file.endswith(".csr"):
            assert value == standard(kits[name] / folder / file), (name, file)
    deliver(tmp_path / "kits", PARTIES)
    out = _step(kits["guest-1"], "fingerprints")  # what guest-1 received: compare with what the makers read out
    got = dict((f, v) for f, v in re.findall(r"fingerprint inbox/(\S+): (\S+)", out.stdout))
    assert got["ca.crt"] == printed[(COORDINATOR, "outbox", "ca.crt")]
    assert got["dataplane-ca.crt"] == printed[("host", "outbox", "dataplane-ca.crt")]
    assert got["guest-1.crt"] == signed["guest-1.crt"]


def test_a_node_tables_job_says_its_dataset_is_unused(tmp_path):
    """A job on the parties' own tables (``--data host=…;guest-1=…``) names ``node-tables`` and says,
    above the ``dataset`` key every run-config carries, that the dataset's options are not used."""
    import tomllib

    cfg = RunConfig(data="host=h.csv;guest-1=g1.csv;guest-2=g2.csv", id_column="ID", label_column="Y", guests=2,
                    engine="flower")
    kits = write_kits(cfg, tmp_path / "kits", PARTIES, "127.0.0.1:9093", "127.0.0.1:9300")
    text = (kits[COORDINATOR] / "run-config.toml").read_text()
    job = tomllib.loads(text)
    assert job["data"] == "node-tables" and job["checkpoint-dir"] == "checkpoints/{run}"
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("dataset = "))
    before = lines[at - 2:at]
    assert before[0].startswith("# data = \"node-tables\": each party trains on its own table"), before
    assert "are not used" in before[1], before
    for party in PARTIES:  # each names its own table in its own kit.toml; nothing of h.csv travels
        assert tomllib.loads((kits[party] / "kit.toml").read_text())["data-path"] == ""


def test_start_hands_each_partys_own_limits_to_its_supernode(tmp_path):
    """kit.toml's own limits reach the SuperNode's node config as the node reads them
    (:func:`fl_split.flower.node.own_limits`, :func:`fl_split.flower.predicting.guest_limits`), and a bad
    one is named as a kit.toml key."""
    from fl_split.kit import _start_args

    kits = _initialised(tmp_path)
    out = _step(kits["host"], "sign")
    assert out.returncode == 0, out.stderr
    deliver(tmp_path / "kits", PARTIES)
    (kits["guest-1"] / "mine.csv").write_text("ID,a\n1,2\n")
    update_kit(kits["guest-1"], data_path="mine.csv", budget="8", max_queries_per_id=2, inference_budget="3.5")
    from fl_split.kit import read_kit

    args = _start_args(kits["guest-1"], read_kit(kits["guest-1"]))
    node = args[args.index("--node-config") + 1].split(" ")
    for item in ("budget=8.0", "max-test-requests=1", "inference-budget=3.5", "max-queries-per-id=2"):
        assert item in node, node
    update_kit(kits["guest-1"], budget="lots")
    with pytest.raises(ConfigError, match=r"^kit.toml budget: got 'lots'"):
        _start_args(kits["guest-1"], read_kit(kits["guest-1"]))
