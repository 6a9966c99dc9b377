"""Issue 16: secrets never on a command line, in an environment, in a file others can read, or in
what the SuperLink stores; private seeds that cannot be guessed.

The adversary here is (a) a receiving party that searches the private seed from one release —
a small integer falls in seconds, so it is refused unless ``--insecure-private-seed`` says the
run is a research reproduction — and (b) another local user of the machine, who can read every
process's ``/proc/PID/cmdline`` and every file whose mode lets the group or others in.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

from fl_split.config import RunConfig
from fl_split.engine import run_experiment
from fl_split.seeding import (INSECURE_PBKDF2_ITERATIONS, PartySecret, PrivateSeed, PrivateSeedError,
                              SECRET_BYTES)
from fl_split.secure_files import readable_by_others, write_private
from tests.helpers import run_cli

TINY = ["--dataset", "breast-cancer", "--epochs", "1", "--no-progress", "--defense", "laplace", "--epsilon", "50"]
HEX = "b8ce85e1a8955a3bd1dfe1f20ab2a846"  # 128 bits: the shortest seed allowed


def _run(argv, capsys):
    return run_cli(argv, capsys)


def _strip(res: dict) -> dict:
    res = json.loads(json.dumps(res))
    res.pop("time_s", None)
    res["config"].pop("out", None)
    for h in res.get("history", []):
        h.pop("epoch_time_s", None)
    return res


# -- small integers are refused; the insecure research flag accepts them, loudly -----------------------
@pytest.mark.parametrize("seed", ["0", "1", "11", "271828"])
@pytest.mark.parametrize("command", ["train", "attack", "deploy"])
def test_small_integer_private_seed_is_refused_before_anything_is_written(tmp_path, capsys, seed, command):
    out = tmp_path / "r.json"
    argv = {"train": ["train", *TINY],
            "attack": ["attack", "--attack", "label-direction", *TINY],
            "deploy": ["deploy", "local", *TINY, "--workdir", str(tmp_path / "dep")]}[command]
    code, _, err = _run([*argv, "--private-seed", seed, "--out", str(out)], capsys)
    assert code == 2
    line = err.strip()
    assert line.count("\n") == 0 and line.startswith("fl-split: error: --private-seed: got")
    assert "allowed: at least 32 hexadecimal digits (128 bits" in line and "--insecure-private-seed" in line
    assert not out.exists() and not (tmp_path / "dep").exists()


def test_short_or_malformed_hex_seeds_are_refused(capsys, tmp_path):
    for bad in ["abcdef", "0x" + "ab" * 15, "zz" * 20, "-5"]:
        code, _, err = _run(["train", *TINY, "--private-seed", bad, "--out", str(tmp_path / "r.json")], capsys)
        assert code == 2 and "allowed: at least 32 hexadecimal digits" in err, (bad, err)
        assert "zz" * 20 not in err  # a refused long value is not echoed
    assert not (tmp_path / "r.json").exists()


# -- patterned hex seeds (issue 25): refused with the rule that caught them, unless --insecure-private-seed -----
@pytest.mark.parametrize("seed,rule", [
    ("0" * 32, "1 distinct digits"),                                  # repeated bytes
    ("ab" * 16, "it repeats a 2-digit block"),
    ("5eed" * 8, "it repeats a 4-digit block"),
    ("deadbeef" * 4, "it repeats a 8-digit block"),
    ("0123456789abcdef" * 2, "its digits step by regular differences"),
    ("fedcba9876543210" * 2, "its digits step by regular differences"),
    ("12211212121122121211212212112122", "2 distinct digits"),        # no period, no steps: few symbols
    # near-patterns: a refused pattern with a few digits edited (threat model, "Curious host")
    ("deadbeef" * 3 + "deadbeee", "it is mostly copies of its own earlier digits"),   # was 67 bits: passed
    ("deadbeefcafebabe" * 2, "it repeats a 16-digit block"),                         # exactly 64 bits: passed
    ("deadbeefdeadbeefdeadb0efdeadbeef", "it is mostly copies of its own earlier digits"),  # a substitution
    ("deadbeefdeadbeef1deadbeefdeadbee", "it is mostly copies of its own earlier digits"),  # an insertion
    ("c0ffee00c0ffee00c0ffee00c0ffee01", "it is mostly copies of its own earlier digits"),
    ("abababababababababababab12ababab", "it is mostly copies of its own earlier digits"),
    ("0123456789abcdef56789abcdef01234", "its digits step by regular differences"),   # a run with one break
])
def test_patterned_hex_seeds_are_refused_with_the_rule(tmp_path, capsys, seed, rule):
    out = tmp_path / "r.json"
    code, _, err = _run(["train", *TINY, "--private-seed", seed, "--out", str(out)], capsys)
    line = err.strip()
    assert code == 2 and line.count("\n") == 0, err
    assert line.startswith("fl-split: error: --private-seed: got <hidden> (a patterned seed: ") and seed not in line
    assert f"{rule}, estimated entropy " in line and "bits, at most 64)" in line, line
    assert line.endswith("a patterned hex seed only with --insecure-private-seed")
    assert not out.exists()


def test_patterned_seed_in_a_seed_file_is_refused_too(tmp_path):
    path = write_private(tmp_path / "seed", ("# fl-split private seed\n" + "ab" * 16 + "\n").encode())
    with pytest.raises(PrivateSeedError, match=r"a patterned seed: it repeats a 2-digit block"):
        PrivateSeed.read_file(path)


def test_random_seeds_pass_the_pattern_rules():
    """The rules only catch patterns: 32 random hex digits (the shortest seed) estimate > 64 bits
    (the least of 10^5 draws was 91 bits; 2000 here), `fl-split seed`'s 64 digits far more."""
    import secrets

    from fl_split.seeding import MIN_PATTERN_BITS, pattern_estimate

    assert min(pattern_estimate(secrets.token_hex(16))[0] for _ in range(2000)) > MIN_PATTERN_BITS
    refused = []
    for _ in range(2000):  # what --private-seed does with them: zero refusals
        seed = secrets.token_hex(16)
        try:
            PrivateSeed.parse(seed)
        except PrivateSeedError:
            refused.append(seed)
    assert refused == []
    assert min(pattern_estimate(PrivateSeed.generate().file_text().splitlines()[-1])[0] for _ in range(200)) > 150


def test_insecure_flag_accepts_a_patterned_hex_seed_reproducibly(tmp_path, capsys):
    runs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        code, _, err = _run(["train", *TINY, "--private-seed", "5eed" * 8, "--insecure-private-seed",
                             "--out", str(out)], capsys)
        assert code == 0, err
        assert "warning: --insecure-private-seed: a patterned private seed can be guessed" in err
        runs.append(json.loads(out.read_text()))
    assert {r["private_randomness"] for r in runs[0]["privacy"].values()} == {"insecure-private-seed"}
    assert _strip(runs[0]) == _strip(runs[1])
    # the same material as a hex seed would derive (HKDF), only reported as insecure — also for 32 decimal
    # digits (experiments/audit_table.py's committed seed), which are a hex seed, not an integer N
    import argparse

    from fl_split.cli import private_seed_from_args

    for text in ("5eed" * 8, "20261124" * 4):
        seed = private_seed_from_args(argparse.Namespace(private_seed=text, private_seed_file=None,
                                                         insecure_private_seed=True))
        assert seed.source == "insecure-private-seed"
        assert seed.party_key("host") == PrivateSeed.parse(text, allow_pattern=True).party_key("host")


def test_insecure_flag_accepts_a_small_integer_with_a_warning_every_run(tmp_path, capsys):
    runs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        code, _, err = _run(["train", *TINY, "--private-seed", "11", "--insecure-private-seed", "--out", str(out)], capsys)
        assert code == 0, err
        assert "warning: --insecure-private-seed" in err and "can be searched" in err
        runs.append(json.loads(out.read_text()))
    assert {r["private_randomness"] for r in runs[0]["privacy"].values()} == {"insecure-private-seed"}
    assert _strip(runs[0]) == _strip(runs[1])  # still reproducible: what the flag is for
    # the flag without an integer seed is refused
    code, _, err = _run(["train", *TINY, "--insecure-private-seed", "--out", str(tmp_path / "x.json")], capsys)
    assert code == 2 and "--insecure-private-seed: needs --private-seed N" in err
    assert not (tmp_path / "x.json").exists()


def test_an_integer_is_refused_through_the_api_too():
    with pytest.raises(PrivateSeedError, match=r"got a int; allowed: .*PrivateSeed.insecure\(n\)"):
        PartySecret.from_private_seed(5, "host")
    with pytest.raises(PrivateSeedError):
        run_experiment(RunConfig(dataset="breast-cancer", epochs=1, progress=False), private_seed=5)


# -- seed files: owner-only, >= 128 bits ------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_seed_file_others_can_read_is_refused(tmp_path, capsys, mode):
    path = write_private(tmp_path / "seed", PrivateSeed.generate().file_text().encode())
    os.chmod(path, mode)
    out = tmp_path / "r.json"
    code, _, err = _run(["train", *TINY, "--private-seed-file", str(path), "--out", str(out)], capsys)
    assert code == 2
    assert f"--private-seed-file: '{path}' has mode {mode:04o}" in err and "chmod 600" in err
    assert not out.exists()


def test_seed_file_contents_are_checked(tmp_path, capsys):
    for name, text in {"short": "abcdef\n", "decimal": "11\n", "empty": "", "words": "my secret seed\n"}.items():
        path = write_private(tmp_path / name, text.encode())
        code, _, err = _run(["train", *TINY, "--private-seed-file", str(path)], capsys)
        assert code == 2 and f"--private-seed-file '{path}'" in err and "allowed" in err, (name, err)
    code, _, err = _run(["train", *TINY, "--private-seed-file", str(tmp_path / "missing")], capsys)
    assert code == 2 and "cannot read" in err


def test_seed_command_writes_a_fresh_owner_only_seed_and_never_overwrites(tmp_path, capsys):
    a, b = tmp_path / "a.seed", tmp_path / "b.seed"
    assert _run(["seed", "--out", str(a)], capsys)[0] == 0
    assert _run(["seed", "--out", str(b)], capsys)[0] == 0
    assert a.stat().st_mode & 0o777 == 0o600
    sa, sb = PrivateSeed.read_file(a), PrivateSeed.read_file(b)
    assert sa != sb and sa.source == "private-seed" and sa.party is None
    assert len(a.read_text().split()[-1]) == 2 * SECRET_BYTES  # 256 bits of hex
    before = a.read_bytes()
    code, _, err = _run(["seed", "--out", str(a)], capsys)
    assert code == 2 and "never overwritten" in err and a.read_bytes() == before


# -- the same seed reproduces a run; parties' secrets are unrelated -------------------------------------
def test_the_same_seed_reproduces_a_run_exactly_from_argv_file_and_stdin(tmp_path, capsys, monkeypatch):
    import io

    seed_file = write_private(tmp_path / "s", f"# a comment\n{HEX}\n".encode())
    outs = [tmp_path / f"r{i}.json" for i in range(4)]
    assert _run(["train", *TINY, "--private-seed", HEX, "--out", str(outs[0])], capsys)[0] == 0
    assert _run(["train", *TINY, "--private-seed-file", str(seed_file), "--out", str(outs[1])], capsys)[0] == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO(HEX + "\n"))
    assert _run(["train", *TINY, "--private-seed", "-", "--out", str(outs[2])], capsys)[0] == 0
    assert _run(["train", *TINY, "--private-seed", "f" + HEX[1:], "--out", str(outs[3])], capsys)[0] == 0
    res = [json.loads(o.read_text()) for o in outs]
    assert _strip(res[0]) == _strip(res[1]) == _strip(res[2])
    assert res[0]["history"][0]["train_loss"] != res[3]["history"][0]["train_loss"]  # another seed, another run
    assert {r["private_randomness"] for r in res[0]["privacy"].values()} == {"private-seed"}
    for text in (o.read_text() for o in outs):
        assert HEX not in text and HEX[1:] not in text


def test_party_secrets_are_hkdf_of_the_seed_and_unrelated_across_parties():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    seed = PrivateSeed.parse(HEX)
    parties = ["host", "guest-1", "guest-2", "guest-10"]
    keys = {p: seed.party_key(p) for p in parties}
    for p, key in keys.items():  # RFC 5869, checked against an independent implementation
        want = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"fl_split private seed v2",
                    info=f"party secret\x1f{p}".encode()).derive(bytes.fromhex(HEX))
        assert key == want
    assert len(set(keys.values())) == len(parties)
    # a node's own seed derives its party's secret and refuses any other party
    own = seed.for_party("guest-1")
    assert PartySecret.from_private_seed(own, "guest-1") == PartySecret.from_private_seed(seed, "guest-1")
    with pytest.raises(PrivateSeedError, match="belongs to guest-1, not host"):
        PartySecret.from_private_seed(own, "host")
    # the insecure research form: PBKDF2-HMAC-SHA256 at the stated cost, per party
    ins = PrivateSeed.insecure(11)
    assert ins.party_key("host") == hashlib.pbkdf2_hmac("sha256", b"11", "fl_split insecure private seed\x1fhost".encode(),
                                                        INSECURE_PBKDF2_ITERATIONS, 32)
    assert ins.party_key("host") != ins.party_key("guest-1")
    assert INSECURE_PBKDF2_ITERATIONS >= 600_000
    # PrivateSeed.legacy (API only) is exactly the pre-issue-16 derivation, so committed numbers reproduce
    assert PrivateSeed.legacy(11).party_key("guest-1") == hashlib.sha256(
        "fl_split private seed\x1f11\x1fguest-1".encode()).digest()
    assert PartySecret.from_private_seed(PrivateSeed.legacy(11), "host").source == "insecure-private-seed"
    # nothing of the seed shows in its repr
    assert HEX not in repr(seed) and HEX not in str(seed) and "hidden" in repr(seed)


# -- files: owner-only --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["npz", "csv"])
def test_party_files_and_their_directory_are_owner_only(tmp_path, fmt):
    from fl_split.party_files import export_parties

    old = os.umask(0o022)  # the usual default: files would be world-readable without explicit modes
    try:
        files = export_parties(RunConfig(dataset="breast-cancer", guests=2), tmp_path / "parties", fmt)
    finally:
        os.umask(old)
    assert set(files) == {"host", "guest-1", "guest-2"}
    assert (tmp_path / "parties").stat().st_mode & 0o777 == 0o700
    assert readable_by_others(tmp_path / "parties") == []


def test_certificates_keys_and_checkpoints_are_owner_only(tmp_path, capsys):
    from fl_split.certs import write_deployment_certificates

    old = os.umask(0o022)
    try:
        write_deployment_certificates(tmp_path / "certs", node_keys=["host", "guest-1"], clients=["guest-1"])
        ck = tmp_path / "ck"
        code, _, err = _run(["train", *TINY, "--checkpoint-dir", str(ck), "--checkpoint-every", "5"], capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    keys = list((tmp_path / "certs").glob("*.key"))
    assert len(keys) == 6 and all(k.stat().st_mode & 0o777 == 0o600 for k in keys)
    assert (tmp_path / "certs").stat().st_mode & 0o077 == 0
    assert any(ck.iterdir()) and readable_by_others(ck) == []  # they hold each party's secret


# -- under flwr run: no seed value in the run config ---------------------------------------------------------
def test_the_serverapp_refuses_a_seed_value_in_the_run_config():
    from flwr.app import Context, RecordDict

    from fl_split.errors import ConfigError
    from fl_split.flower.strategy import config_from_context

    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"private-seed": HEX})
    with pytest.raises(ConfigError, match=r"^--private-seed: got '<hidden>' \(the SuperLink stores the run config"):
        config_from_context(ctx)
    ctx.run_config = {"private-seed-file": "/somewhere/seed", "guests": 2}
    assert config_from_context(ctx).guests == 2  # the path key is the parties', dropped by the coordinator


# -- deploy local: no secret on any command line, in any environment or readable file -------------------------
@pytest.mark.slow
def test_deploy_local_keeps_every_secret_off_argv_environ_and_readable_files(tls_deployment):
    """A TLS loopback deployment with a private seed file (the session's shared run,
    tests/shared_runs.py; tests/test_deploy.py checks its results). While it ran, every process it
    started (found by its FLWR_HOME, as tests/test_deploy.py does) and the command itself were
    sampled: no seed (the user's or any node's), and no line of any private key, is in a ``cmdline``
    or ``environ``; nothing under the work directory is group- or other-accessible, during the run or
    after it. Each node got its own seed file (bound to its party); the results equal the local
    engine's with the same seeds; the SuperLink's database holds no seed."""
    from tests.test_deploy import SMALL

    run = tls_deployment
    seed, workdir = run.seed, run.workdir
    parties = ["host", "guest-1", "guest-2"]
    secrets = [seed.file_text().split()[-1].encode()] + [seed.for_party(p).file_text().split()[-1].encode()
                                                       for p in parties]
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert run.left == [], f"processes left running: {run.left}"
    # the processes were seen (the SuperLink and every SuperNode), and none holds a secret
    every = b"".join(run.seen.values())
    assert every.count(b"flower-supernode") >= 3 and b"flower-superlink" in every
    assert len(run.key_lines) >= 10
    for pid, data in run.seen.items():
        for s in secrets:
            assert s not in data and s.upper() not in data, f"a private seed in /proc/{pid}"
        for line in run.key_lines:
            assert line not in data, f"private key material in /proc/{pid}"
    assert b"private-seed-file=" in every and b"private-seed=" not in every.replace(b"private-seed-file=", b"")
    # files: owner-only throughout and afterwards (the SuperLink's database included)
    assert run.exposed == set(), sorted(run.exposed)[:10]
    assert workdir.stat().st_mode & 0o777 == 0o700 and readable_by_others(workdir) == []
    # the SuperLink keeps its state in memory: no database of the run's messages on disk
    assert list(workdir.rglob("*.db*")) == []
    # each node its own seed, bound to its party
    node_seeds = {p: PrivateSeed.read_file(workdir / "nodes" / p / "private-seed") for p in parties}
    assert {p: s.party for p, s in node_seeds.items()} == {p: p for p in parties}
    assert len({s.file_text() for s in node_seeds.values()}) == len(parties)
    # the same results as the local engine with the same seed
    from fl_split.cli import build_parser, config_from_args

    results = json.loads(run.out_path.read_text())
    assert {r["private_randomness"] for r in results["privacy"].values()} == {"private-seed"}
    local = run_experiment(config_from_args(build_parser().parse_args(["train", *SMALL])), private_seed=seed)
    assert results["final"]["value"] == local["final"]["value"]
    assert results["final"]["train_loss"] == pytest.approx(local["final"]["train_loss"], rel=1e-6)
    for party, rep in local["privacy"].items():
        assert results["privacy"][party]["epsilon"] == rep["epsilon"]


def test_deploy_local_refuses_a_seed_value_on_its_command_line(tmp_path, capsys):
    code, _, err = _run(["deploy", "local", *TINY, "--private-seed", HEX, "--workdir", str(tmp_path / "dep")], capsys)
    assert code == 2 and "readable by every local user" in err and "--private-seed-file" in err
    assert HEX not in err and not (tmp_path / "dep").exists()
