"""``fl-split deploy kit`` and ``fl-split deploy node``: a folder per organisation (issue 25, item 3).

``fl-split deploy kit --out DIR --parties host,guest-1,… --superlink HOST:PORT --dataplane HOST:PORT
[run options]`` writes ``DIR/coordinator``, ``DIR/host``, ``DIR/guest-<g>``; each holds

* ``run.sh``: a POSIX sh script, ``sh run.sh STEP``, that runs ``fl-split deploy node STEP --kit .``
  (or says in words what to install when Python has no fl_split);
* ``kit.toml``: its node configuration (the fl-split version it was written for, role, guest index,
  addresses, ``data-path`` — a placeholder the organisation fills in —, checkpoint and model
  directories, private seed file);
* ``README.txt``: what to install first (``pip install fl-split==VERSION``), its steps, what it
  generates on its own machine and what it sends to whom;
* ``inbox/`` (what others send it), ``outbox/`` (what it sends), and after ``init`` an owner-only
  ``keys/``; the coordinator also ``run-config.toml`` (the job, no party's secret or path).

A kit is **portable**: no file of it holds a path of the machine that wrote it. Paths in it are the
kit's own, relative to its folder and resolved when a step runs there (``results.json``,
``checkpoints/``, ``model/``, ``keys/``); the coordinator's app is the *installed* fl-split package's
Flower app (:func:`package_app`, built at run time from the package's files), and every step first
checks that the installed version is the kit's (:func:`check_version`).

A kit holds **no key at all** when it is written: every key is made by ``init`` on the
organisation's own machine, and only public halves travel (:data:`SENDS`). Two trust roots:

* the **coordinator's CA** signs the SuperLink's TLS certificate (it serves it: natural holder);
  SuperNodes and ``flwr`` trust its ``ca.crt``; SuperNodes authenticate with their own key pair
  whose public key the coordinator registers (``flwr supernode register``) — no certificate;
* the **host's data-plane CA** signs the host's data-plane certificate (named ``host``) and each
  guest's client certificate from the guest's CSR (named ``guest-<g>``, mutual TLS). It is the
  host's, not the coordinator's: the host is the party that checks guests on the data plane, and a
  coordinator holding that CA could issue itself a guest's certificate and pose as that guest to
  the host (docs/deploy.md, "Data-plane identities").

With ``--secure-merge`` each guest's ``init`` also makes its own long-term Ed25519 identity; its public
half goes to every other guest, and each guest's ``start`` pins the run's guests from its own key and
its inbox (docs/deploy.md, "Secure merge in a deployment"): no third trust root, no coordinator in it.

Steps: (1) every organisation ``init``; public files are exchanged; (2) the host ``sign``s the
guests' CSRs, the coordinator ``start``s the SuperLink and ``register``s the SuperNodes' public keys;
(3) every party ``start``s its SuperNode with its own table; (4) the coordinator ``run``s the job.
:class:`KitDeployment` (``fl-split deploy local --from-kits``) runs exactly these scripts on loopback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from fl_split.config import RUN_PLACEHOLDER, RunConfig
from fl_split.deploy import DeploymentError, LocalDeployment, checkpoint_dir_of, free_port
from fl_split.errors import ConfigError, FlSplitError, KitConfigError
from fl_split.secure_files import PRIVATE_UMASK, private_dir, write_private

__all__ = ["SENDS", "KitDeployment", "check_version", "deliver", "node_step", "package_app", "party_names",
           "write_kits"]

KIT_FILE = "kit.toml"
COORDINATOR = "coordinator"
CONNECTION = "fl-split-kit"
STEPS = ("init", "sign", "register", "start", "run", "predict", "fingerprints")
#: the package every organisation installs (pyproject.toml ``[project] name``)
PACKAGE = "fl-split"
#: ``app`` in the coordinator's kit.toml: the Flower app of the installed package (:func:`package_app`)
INSTALLED_APP = PACKAGE
#: run-config keys holding a path: a relative one is the coordinator kit's, resolved when it runs
KIT_PATHS = ("out", "checkpoint-dir")
#: the coordinator's run-config ``checkpoint-dir = "checkpoints/{run}"``: each ``sh run.sh run`` names
#: its own folder there (a UTC time), ``run --resume`` the last one (kept in :data:`LAST_RUN`)
RUN_LABEL = RUN_PLACEHOLDER
LAST_RUN = "state/last-run.json"


def package_version() -> str:
    """The installed fl-split's version (``fl_split.__version__``, pyproject.toml's ``version``)."""
    from fl_split import __version__

    return __version__


def install_line(version: str | None = None) -> str:
    """What an organisation installs for a kit of ``version`` (default: this one's)."""
    v = version or package_version()
    return f"pip install {PACKAGE}=={v} (or, from a checkout of fl_split at version {v}: pip install CHECKOUT)"


def check_version(conf: dict[str, Any]) -> None:
    """Refuse, in one line, a kit written for another fl-split version than the installed one: the
    coordinator's app and every party's code must be the same release (the wire format, the run
    options and the party files are versioned with it)."""
    want = str(conf.get("fl-split-version", "") or "")
    have = package_version()
    if want and want != have:
        raise KitError(f"this kit was written for {PACKAGE} {want}, but {sys.executable} has {PACKAGE} {have}: "
                       f"install the kit's version, {install_line(want)}, or set PYTHON to a Python that has it")


def package_app(dest: str | os.PathLike) -> Path:
    """The Flower app of the **installed** fl-split in ``dest`` (emptied first), for ``flwr run dest``:
    the files its FAB holds (``fl_split/**/*.py``, ``strategies/*.py``, ``clients/*.py``,
    :data:`fl_split.flower.appconfig.FAB_INCLUDE`) copied from where the package is installed — a
    site-packages directory, or a checkout installed in development mode — and a ``pyproject.toml``
    with the package's name and version and the generated ``[tool.flwr.*]`` tables
    (:func:`fl_split.flower.appconfig.render`, the same as the checkout's). No checkout is needed:
    this is how a kit's ``run`` finds the app on the coordinator's machine."""
    import fl_split
    from fl_split.flower.appconfig import render

    root = Path(fl_split.__file__).resolve().parent.parent  # where fl_split, strategies and clients are installed
    sources = {"fl_split": "**/*.py", "strategies": "*.py", "clients": "*.py"}
    missing = [pkg for pkg in sources if not (root / pkg / "__init__.py").is_file()]
    if missing:
        raise KitError(f"the installed {PACKAGE} at {root} lacks {', '.join(missing)}/ (its Flower app); "
                       f"reinstall it: {install_line()}")
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    for pkg, pattern in sources.items():
        for path in sorted((root / pkg).glob(pattern)):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            target = dest / pkg / path.relative_to(root / pkg)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    v = package_version()
    (dest / "pyproject.toml").write_text(
        f'[project]\nname = "{PACKAGE}"\nversion = "{v}"\n'
        'description = "Vertical split learning with privacy protection on Flower, PyTorch and Ray"\n'
        'license = { text = "Apache-2.0" }\n\n' + render(), encoding="utf-8")
    (dest / "README.md").write_text(f"The Flower app of the installed {PACKAGE} {v} (built by fl_split.kit.package_app).\n",
                                    encoding="utf-8")
    return dest


def party_names(text: str, guests: int | None = None) -> list[str]:
    """``--parties host,guest-1,…``: the host and guests 1..G, in any order; returns them ordered."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    g = len(names) - 1
    want = ["host"] + [f"guest-{i}" for i in range(1, g + 1)]
    if g < 1 or sorted(names) != sorted(want) or len(set(names)) != len(names):
        raise ConfigError("parties", text, "host,guest-1,…,guest-G (G >= 1, each once)")
    if guests is not None and guests != g:
        raise ConfigError("parties", text, f"host and {guests} guests", reason=f"--guests is {guests}")
    return want


def _hostport(key: str, text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "'" in host or '"' in host:
        raise ConfigError(key, text, "HOST:PORT (e.g. link.example.org:9093)")
    return host, int(port)


# -- what travels: (sender, file in its outbox, receivers); the only files that leave a kit ------------
def SENDS(parties: list[str], secure_merge: bool = True) -> list[tuple[str, str, list[str]]]:
    """Every public file that travels between kits: ``(sender, its outbox file, receivers)``.
    ``secure_merge``: with each guest's public secure-merge identity, which goes to every *other*
    guest only — each guest pins its peers itself (docs/deploy.md, "Secure merge in a deployment");
    a kit of a job without ``--secure-merge`` makes none, so :func:`deliver` has nothing to move."""
    guests = [p for p in parties if p != "host"]
    rows = [(COORDINATOR, "ca.crt", list(parties))]
    rows += [(p, f"auth-{p}.pub", [COORDINATOR]) for p in parties]
    rows += [(g, f"{g}.csr", ["host"]) for g in guests]
    rows += [("host", "dataplane-ca.crt", guests)]
    rows += [("host", f"{g}.crt", [g]) for g in guests]  # after `sign`
    if secure_merge:
        rows += [(g, identity_file(g), [o for o in guests if o != g]) for g in guests if len(guests) > 1]
    return rows


def identity_file(guest: str) -> str:
    """The name of ``guest``'s public secure-merge identity in its outbox (and its peers' inboxes); its
    private key is ``keys/`` + the same stem + ``.key``."""
    return f"secure-merge-{guest}.pub"


_WHAT = {"ca.crt": "the coordinator's CA certificate (to verify the SuperLink's TLS)",
         "dataplane-ca.crt": "the host's data-plane CA certificate (to verify the host's data plane)",
         ".pub": "its SuperNode public key (registered for SuperNode authentication)",
         ".csr": "its data-plane certificate request (the host's CA signs it)",
         ".crt": "the guest's signed data-plane client certificate"}


def _what(name: str) -> str:
    if name.startswith("secure-merge-"):
        return ("its public secure-merge identity (Ed25519; every other guest pins it to check the keys the "
                "coordinator relays)")
    return _WHAT.get(name) or next(v for k, v in _WHAT.items() if name.endswith(k))


def deliver(kits: Path, parties: list[str], only: str | None = None) -> list[str]:
    """Copy each file of :data:`SENDS` that exists from its sender's ``outbox/`` to each receiver's
    ``inbox/`` (what the organisations do by mail or a file share; ``only``: that file name only).
    Nothing else ever moves between kits. Returns ``"sender/file -> receiver"`` lines."""
    moved = []
    for sender, name, receivers in SENDS(parties):
        src = kits / sender / "outbox" / name
        if (only and name != only) or not src.is_file():
            continue
        for r in receivers:
            shutil.copyfile(src, kits / r / "inbox" / name)
            moved.append(f"{sender}/{name} -> {r}")
    return moved


# -- writing the kits ------------------------------------------------------------------------------------
_RUN_SH = """#!/bin/sh
# fl_split kit of {party}: sh run.sh STEP (see README.txt). Runs `fl-split deploy node STEP --kit <this folder>`
# with $PYTHON (default python3), which must have {package} {version} installed: pip install {package}=={version}
# (or set PYTHON=/path/to/venv/bin/python where it is installed).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
py=${{PYTHON:-python3}}
if ! "$py" -c "import fl_split" >/dev/null 2>&1; then
    echo "run.sh: $py has no fl_split: install {package} {version} first, $py -m pip install {package}=={version} \
(or, from a checkout of fl_split at version {version}: $py -m pip install CHECKOUT), \
or set PYTHON=/path/to/python where it is installed" >&2
    exit 2
fi
umask 077
step=${{1:?usage: sh run.sh {steps} [options]}}
shift
exec "$py" -m fl_split.cli deploy node "$step" --kit "$here" "$@"
"""


def _toml(values: dict[str, Any]) -> str:
    from fl_split.flower.appconfig import toml_value

    def render(v):
        return "[" + ", ".join(toml_value(x) for x in v) + "]" if isinstance(v, list) else toml_value(v)

    return "".join(f"{k} = {render(v)}\n" for k, v in values.items())


def read_kit(kit: Path) -> dict[str, Any]:
    path = kit / KIT_FILE
    if not path.is_file():
        raise ConfigError("kit", str(kit), "a folder written by fl-split deploy kit", reason=f"no {KIT_FILE}")
    return tomllib.loads(path.read_text(encoding="utf-8"))


def update_kit(kit: Path, **values: Any) -> None:
    """Set ``kit.toml`` keys (what an organisation does with an editor: its data path, its seed file)."""
    conf = read_kit(kit)
    conf.update({k.replace("_", "-"): v for k, v in values.items()})
    (kit / KIT_FILE).write_text(_toml(conf), encoding="utf-8")


def write_kits(cfg: RunConfig, out: str | os.PathLike, parties: list[str], superlink: str, dataplane: str,
               *, bind: str = "0.0.0.0", clientappio_ports: dict[str, int] | None = None,
               app: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write one kit per organisation into ``out`` (module docstring); returns ``{name: folder}``.
    ``dataplane``: where guests reach the host's data plane; ``bind``: the SuperLink's listening
    address; ``clientappio_ports``: each SuperNode's local port (distinct only on one machine); ``app``:
    the coordinator's app, default the installed package's (:data:`INSTALLED_APP`; a path names an app
    directory, relative to the coordinator's kit). No file written holds a path of this machine."""
    from fl_split.data.own import NODE_TABLES, parse_data_spec
    from fl_split.deploy import run_config_toml

    _hostport("superlink", superlink)
    _hostport("dataplane", dataplane)
    out = private_dir(Path(out).expanduser().resolve())
    names = [COORDINATOR] + parties
    existing = [n for n in names if (out / n).exists()]
    if existing:
        raise ConfigError("out", str(out), "a directory without kits", reason=f"{', '.join(existing)} exist(s)")
    spec = parse_data_spec(cfg.data) if cfg.data and cfg.data.strip() != NODE_TABLES else None
    node_tables = isinstance(spec, dict) or (cfg.data or "").strip() == NODE_TABLES
    kits = {}
    for name in names:
        kit = private_dir(out / name)
        for sub in ("inbox", "outbox"):
            private_dir(kit / sub)
        (kit / "run.sh").write_text(_RUN_SH.format(party=name, steps="|".join(_steps_of(name)), package=PACKAGE,
                                                   version=package_version()), encoding="utf-8")
        os.chmod(kit / "run.sh", 0o700)
        if name == COORDINATOR:
            conf = {"party": name, "fl-split-version": package_version(), "parties": parties,
                    "superlink": superlink, "superlink-bind": bind, "app": str(app) if app else INSTALLED_APP}
            job = replace(cfg, data=NODE_TABLES) if node_tables else cfg
            # no path of this machine in the job: the kit's own, relative to its folder (resolved by `run`);
            # a deployment node saves into / starts from its own kit.toml model-dir (a non-empty value: on)
            job = replace(job, checkpoint_dir="", data_root="", save_model="model" if cfg.save_model else "",
                          init_from="model" if cfg.init_from else "")
            text = run_config_toml(job, Path("results.json"))
            # every run checkpoints into its own folder (sh run.sh run: a new one; run --resume: the last)
            text = text.replace('checkpoint-dir = ""', f'checkpoint-dir = "checkpoints/{RUN_LABEL}"')
            if node_tables:  # say that the dataset's keys are not what this job trains on
                text = re.sub(r"(?m)^dataset = ", '# data = "node-tables": each party trains on its own table (its '
                              'kit.toml data-path);\n# dataset and its options (limit, columns, padding) are '
                              'not used\ndataset = ', text, count=1)
            write_private(kit / "run-config.toml", text.encode("utf-8"))
        else:
            conf = {"party": name, "fl-split-version": package_version(), "role": "host" if name == "host" else "guest"}
            if name != "host":
                conf["guest-index"] = int(name.split("-")[1])
            conf.update({"superlink": superlink, "dataplane": dataplane,
                         "clientappio-port": (clientappio_ports or {}).get(name, 9094),
                         "data-path": "", "checkpoint-dir": f"checkpoints/{RUN_PLACEHOLDER}",
                         "model-dir": "model", "init-from": "", "predict-data-path": "new-rows.csv",
                         "private-seed-file": "", "clientapp": "warm",
                         # its own training limits (docs/threat-model.md "What each party controls"): a
                         # job can only tighten them; budget "" = the job's, max-test-requests 1 = the default
                         "budget": "", "max-test-requests": 1})
            if name == "host":
                conf["guests"] = [p for p in parties if p != "host"]
                conf["predict-out"] = "predictions.csv"
            else:  # its own inference limits (docs/serving.md "Inference limits"); "" = the default
                from fl_split.predict import DEFAULT_MAX_QUERIES_PER_ID

                conf.update({"inference-budget": "", "max-queries-per-id": DEFAULT_MAX_QUERIES_PER_ID})
                if cfg.secure_merge:  # init makes its identity; start pins the run's guests' (SENDS)
                    conf.update({"secure-merge": True, "guests": [p for p in parties if p != "host"]})
        (kit / KIT_FILE).write_text(_toml(conf), encoding="utf-8")
        (kit / "README.txt").write_text(_readme(name, parties, superlink, dataplane, node_tables,
                                                bool(cfg.secure_merge)), encoding="utf-8")
        kits[name] = kit
    return kits


def _steps_of(name: str) -> tuple[str, ...]:
    return ("init", "start", "register", "run", "predict", "fingerprints") if name == COORDINATOR else (
        ("init", "sign", "start", "fingerprints") if name == "host" else ("init", "start", "fingerprints"))


def _readme(name: str, parties: list[str], superlink: str, dataplane: str, node_tables: bool,
            secure_merge: bool = False) -> str:
    sends = [f"  outbox/{f:<20} -> {', '.join(r)}: {_what(f)}" for s, f, r in SENDS(parties, secure_merge) if s == name]
    gets = [f"  inbox/{f:<21} <- {s}: {_what(f)}" for s, f, r in SENDS(parties, secure_merge) if name in r]
    table = ("your own raw table (CSV/Parquet with the ID column" + (", and the label column" if name == "host" else "")
             + "); the coordinator's job aligns the IDs between the nodes") if node_tables else (
        f"your party file ({name}.npz|csv|parquet, fl-split export-parties)")
    v = package_version()
    head = [f"Install first, on this machine: {PACKAGE} {v} (Python >= 3.11; it brings Flower, PyTorch, ...):",
            f"  pip install {PACKAGE}=={v}",
            f"  or, from a checkout of fl_split at version {v}: pip install /path/to/the/checkout",
            "  Every step runs `python3 -m fl_split.cli`; where fl-split is in a virtual environment, run",
            "  PYTHON=/path/to/venv/bin/python sh run.sh STEP. Every step checks that the installed version",
            f"  is {v} (kit.toml fl-split-version) and stops with one line if it is not.", "",
            f"fl_split kit of: {name}", "",
            "Every path in this kit is relative to this folder: move or copy the folder anywhere.",
            "Every key is made on THIS machine by `sh run.sh init` and stays in keys/ (0700, files 0600).",
            "No private key ever leaves it; only the files listed under 'You send' travel.", ""]
    if name == COORDINATOR:
        steps = ["Steps:",
                 "  1. sh run.sh init      makes keys/ca.key + ca.crt (the CA of the SuperLink's TLS) and",
                 f"                        keys/superlink.key + superlink.crt for {superlink}; outbox/ca.crt",
                 "     Send outbox/ca.crt to every party; wait for each party's auth-<party>.pub in inbox/.",
                 "  2. sh run.sh start     starts the SuperLink (keep it running; one HTTPS port: Fleet + Control API)",
                 "     sh run.sh register  registers every party's SuperNode public key (SuperNode authentication)",
                 "  3. (the parties start their SuperNodes)",
                 "  4. sh run.sh run       submits run-config.toml with flwr run (the Flower app of the installed",
                 f"                        {PACKAGE}: kit.toml app = \"{PACKAGE}\"), streams the log, and exits non-zero",
                 "                        unless the SuperLink reports the run completed; results in results.json here",
                 "                        (run-config.toml out; relative paths there are this folder's)",
                 "",
                 "After the first run (no file to edit; every party keeps its SuperNode running):",
                 "  sh run.sh run                a new run: its own checkpoints/<UTC time>/ here and checkpoints/<run>/",
                 "                               at every party (run-config.toml checkpoint-dir = \"checkpoints/{run}\")",
                 "  sh run.sh run --resume       goes on from the last run's checkpoints (after a party failed and rejoined)",
                 "  sh run.sh run --save-model   every party saves its own part of the model into its kit's model/",
                 "  sh run.sh run --init-from    every party starts from its own saved part (its kit.toml init-from,",
                 "                               else model/): fine-tuning, or a run with more epochs",
                 "  sh run.sh predict            scores each party's new rows (its kit.toml predict-data-path) with the",
                 "                               saved model; the host writes the predictions on its machine (its kit.toml",
                 "                               predict-out); each guest charges its own inference ledger under its own",
                 "                               limits; the summary (rows, metrics if the host has labels, each guest's ε)",
                 "                               in predict-summary.json here",
                 "  sh run.sh fingerprints       the SHA-256 fingerprints of what you sent and received (inbox/*.pub):",
                 "                               compare them with each party's, by phone or another channel, before register",
                 "Keep secret: keys/ca.key, keys/superlink.key, state/superlink.db (messages of past runs)."]
    else:
        steps = ["Steps:",
                 "  0. Edit kit.toml: data-path = " + table + ";",
                 "     optionally private-seed-file = an owner-only seed file (fl-split seed --out keys/private-seed).",
                 "  1. sh run.sh init      makes keys/auth-" + name + ".key (SuperNode authentication, OpenSSH P-384)"
                 + (", keys/dataplane-ca.key + .crt (YOUR data-plane CA: you sign the guests' certificates) and "
                    "keys/dataplane-host.key + .crt (named 'host')" if name == "host"
                    else f" and keys/{name}.key with a certificate request outbox/{name}.csr") + ".",
                 ]
        if name == "host":
            steps += ["  2. sh run.sh sign      once every guest's CSR is in inbox/: writes outbox/guest-<g>.crt",
                      "     (checks each CSR's signature and that it names that guest); send each to its guest.",
                      f"     Guests must reach your data plane at {dataplane} (you listen on its port)."]
        else:
            if secure_merge:
                steps += [f"     The job uses --secure-merge: init also makes keys/secure-merge-{name}.key (your long-term",
                          f"     Ed25519 identity; never sent) and outbox/{identity_file(name)} (its public key, for",
                          "     every other guest). Compare each other guest's inbox/secure-merge-<guest>.pub fingerprint",
                          "     (sh run.sh fingerprints) with the one its operator read you, by phone or another channel:",
                          "     start pins exactly these files (state/secure-merge-roster.json), and a key the coordinator",
                          "     relays at run time that is not signed by the pinned identity stops the run before you release."]
            steps += ["  2. (the host signs your CSR; put the returned certificate in inbox/)"]
        steps += ["  3. sh run.sh start     starts your SuperNode with your own table (keep it running); your party",
                  "                        lives in this one process for the whole run (kit.toml clientapp = \"warm\";",
                  "                        \"per-message\": Flower's fresh flwr-clientapp process per message)",
                  "  4. (the coordinator runs the job; your terminal shows your epochs, your own ε and how the run ended)",
                  "",
                  "Fingerprints: init printed the SHA-256 fingerprint of each file in outbox/; read them to their",
                  "  receivers by phone or another channel; sh run.sh fingerprints shows those of inbox/ to compare.",
                  "After the first run: nothing to edit. Each run checkpoints into its own checkpoints/<run>/ (kit.toml",
                  "  checkpoint-dir); when the coordinator resumes after a failure, restart your SuperNode (sh run.sh",
                  "  start) and it goes on from there. A run with --save-model saves your part into model/" + name + "/;",
                  "  a run with --init-from starts from it (kit.toml init-from, else model-dir).",
                  "Your own limits (the coordinator's job can lower them, never raise them): kit.toml budget (the ε",
                  "  your ledger may reach in a run; \"\" = the job's) and max-test-requests (how often you release",
                  "  one test batch; default 1).",
                  "Predict: put your new rows at new-rows.csv (kit.toml predict-data-path: same columns as your",
                  "  training table, read when the coordinator runs sh run.sh predict; no restart)"
                  + (";\n  the predictions are written to predictions.csv (kit.toml predict-out) with your own ID column."
                     if name == "host" else
                     ";\n  you release each new row under your own limits: kit.toml max-queries-per-id (default 3) and"
                     "\n  inference-budget (\"\" = the ε of max-queries-per-id releases of one row), counted in"
                     "\n  model/" + name + "/inference-ledger.npz, never reset."),
                  "Keep secret: keys/, your table, your seed file, checkpoints/ (your secret and weights),",
                  "  model/ (your own part of the model, model/" + name + "/)"
                  + (", predictions.csv." if name == "host" else ".")]
    return "\n".join(head + steps + ["", "You send:"] + (sends or ["  nothing"]) + ["", "You receive:"]
                     + (gets or ["  nothing"])) + "\n"


# -- the steps (fl-split deploy node STEP --kit DIR) --------------------------------------------------------
def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ConfigError("kit", str(path.parent.parent), what, reason=f"{path.name} is missing in {path.parent.name}/")
    return path


def _fresh(kit: Path, *names: str) -> Path:
    keys = private_dir(kit / "keys")
    done = [n for n in names if (keys / n).exists()]
    if done:
        raise ConfigError("kit", str(kit), "a kit not yet initialised", reason=f"keys/{done[0]} exists: init ran already")
    return keys


def _init(kit: Path, conf: dict[str, Any]) -> list[str]:
    from fl_split.certs import make_ca, make_leaf, make_node_auth_key, pem_cert, pem_key, superlink_hosts

    name = conf["party"]
    if name == COORDINATOR:
        keys = _fresh(kit, "ca.key", "superlink.key")
        host, _ = _hostport("superlink", conf["superlink"])
        ca_key, ca = make_ca("fl-split SuperLink CA (coordinator)")
        # the public name and loopback: the SuperExec Flower launches beside the SuperLink dials 127.0.0.1
        key, cert = make_leaf(ca_key, ca, host, server=True, hosts=superlink_hosts(host))
        write_private(keys / "ca.key", pem_key(ca_key))
        write_private(keys / "superlink.key", pem_key(key))
        for path in (keys / "ca.crt", kit / "outbox" / "ca.crt"):
            path.write_bytes(pem_cert(ca))
        (keys / "superlink.crt").write_bytes(pem_cert(cert))
        _flwr_config(kit, conf)
        return ["keys/ca.key", "keys/superlink.key", "outbox/ca.crt"]
    keys = _fresh(kit, f"auth-{name}.key")
    private, public = make_node_auth_key(f"fl-split-{name}")
    write_private(keys / f"auth-{name}.key", private)
    (kit / "outbox" / f"auth-{name}.pub").write_bytes(public)
    made = [f"keys/auth-{name}.key", f"outbox/auth-{name}.pub"]
    if name == "host":
        from fl_split.dataplane.tls import HOST_NAME

        dp_host, _ = _hostport("dataplane", conf["dataplane"])
        ca_key, ca = make_ca("fl-split data-plane CA (host)")
        key, cert = make_leaf(ca_key, ca, HOST_NAME, server=True, hosts=(HOST_NAME, dp_host))
        write_private(keys / "dataplane-ca.key", pem_key(ca_key))
        write_private(keys / "dataplane-host.key", pem_key(key))
        for path in (keys / "dataplane-ca.crt", kit / "outbox" / "dataplane-ca.crt"):
            path.write_bytes(pem_cert(ca))
        (keys / "dataplane-host.crt").write_bytes(pem_cert(cert))
        return made + ["keys/dataplane-ca.key", "keys/dataplane-host.key", "outbox/dataplane-ca.crt"]
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])).sign(key, hashes.SHA256()))
    write_private(keys / f"{name}.key", pem_key(key))
    (kit / "outbox" / f"{name}.csr").write_bytes(csr.public_bytes(serialization.Encoding.PEM))
    made += [f"keys/{name}.key", f"outbox/{name}.csr"]
    if conf.get("secure-merge"):  # its long-term identity: its peers pin the public half (docs/deploy.md)
        from fl_split.privacy.secure_merge import new_identity_pem, public_identity_line

        pem = new_identity_pem()
        write_private(keys / _identity_key(name), pem)
        (kit / "outbox" / identity_file(name)).write_text(
            public_identity_line(serialization.load_pem_private_key(pem, None), name), encoding="ascii")
        made += [f"keys/{_identity_key(name)}", f"outbox/{identity_file(name)}"]
    return made


def _identity_key(guest: str) -> str:
    return identity_file(guest)[:-len(".pub")] + ".key"


def _secure_merge_items(kit: Path, conf: dict[str, Any]) -> list[str]:
    """A guest's node-config items under ``--secure-merge``: its own identity key and the roster of
    the run's guests that this step writes into ``state/secure-merge-roster.json`` from that key and
    the peers' public identities in ``inbox/`` (what the operator compared by fingerprint) — never
    from anything the coordinator sends (docs/deploy.md, "Secure merge in a deployment")."""
    from cryptography.hazmat.primitives import serialization

    from fl_split.deploy import _literal
    from fl_split.privacy.secure_merge import public_identity, read_public_identity

    name = conf["party"]
    key = _need(kit / "keys" / _identity_key(name), "your secure-merge identity: run init first (a kit written "
                "with --secure-merge makes it)")
    roster = {name: public_identity(serialization.load_pem_private_key(key.read_bytes(), None))}
    for peer in [str(g) for g in conf.get("guests", []) if str(g) != name]:
        path = kit / "inbox" / identity_file(peer)
        if not path.is_file():
            raise KitError(f"secure merge: inbox/{path.name} is missing: {peer}'s public identity, which this guest "
                           f"must pin before the run; get it from {peer}'s operator (its outbox/{path.name}, "
                           f"delivered with the other public files), compare its fingerprint with theirs "
                           f"(sh run.sh fingerprints), then start again")
        try:
            roster[peer] = read_public_identity(path, peer)
        except FlSplitError as exc:
            raise KitError(f"secure merge: inbox/{path.name}: {exc}; ask {peer}'s operator for its "
                           f"outbox/{path.name} again") from None
    out = write_private(private_dir(kit / "state") / "secure-merge-roster.json",
                        json.dumps({g: k.hex() for g, k in sorted(roster.items())}).encode("ascii"))
    for peer in sorted(roster):
        if peer != name:
            print(f"start: secure merge pins {peer}'s identity {fingerprint(kit / 'inbox' / identity_file(peer))} "
                  f"(inbox/{identity_file(peer)})", flush=True)
    return [f"secure-merge-identity={_literal(key)}", f"secure-merge-roster={_literal(out)}"]


def _sign(kit: Path, conf: dict[str, Any]) -> list[str]:
    """The host's CA signs each guest's CSR into a client certificate naming that guest (what
    :func:`fl_split.certs.make_leaf` issues with ``server=False``, for the guest's own public key)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if conf["party"] != "host":
        raise ConfigError("kit", str(kit), "the host's kit (it holds the data-plane CA)", reason=f"this is {conf['party']}'s")
    keys = kit / "keys"
    ca_key = serialization.load_pem_private_key(_need(keys / "dataplane-ca.key", "run init first").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((keys / "dataplane-ca.crt").read_bytes())
    made = []
    for guest in conf["guests"]:
        path = _need(kit / "inbox" / f"{guest}.csr", f"every guest's CSR in inbox/ ({guest} sends {guest}.csr)")
        csr = x509.load_pem_x509_csr(path.read_bytes())
        cns = [a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        if not csr.is_signature_valid or cns != [guest]:
            raise ConfigError("kit", str(path), f"a CSR signed by its key and naming {guest}", reason=f"it names {cns}")
        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(csr.subject).issuer_name(ca.subject)
                .public_key(csr.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=365))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(guest)]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (kit / "outbox" / f"{guest}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        made.append(f"outbox/{guest}.crt")
    return made


def fingerprint(path: Path) -> str:
    """The SHA-256 fingerprint of a public file of a kit, as the standard tools print it, for the
    out-of-band comparison of docs/deploy.md ("Fingerprints"): a certificate (``.crt``) as
    ``openssl x509 -noout -fingerprint -sha256 -in FILE``, an OpenSSH public key (``.pub``) as
    ``ssh-keygen -l -f FILE``, a certificate request (``.csr``) as the hexadecimal SHA-256 of its
    public key's DER (``openssl req -in FILE -noout -pubkey | openssl pkey -pubin -outform DER | sha256sum``)."""
    import base64
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    data = path.read_bytes()
    if path.suffix == ".pub":
        blob = base64.b64decode(data.split()[1])
        return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    if path.suffix == ".csr":
        der = x509.load_pem_x509_csr(data).public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return hashlib.sha256(der).hexdigest()
    der = x509.load_pem_x509_certificate(data).public_bytes(serialization.Encoding.DER)
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def _fingerprints(kit: Path, folder: str, only: str | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """One line per public file in ``folder`` (``outbox``: what this kit sends; ``inbox``: what it got):
    its fingerprint (:func:`fingerprint`), to read out to / compare with its maker by another channel."""
    lines = []
    for path in sorted((kit / folder).glob("*")):
        if path.suffix in (".crt", ".pub", ".csr") and (only is None or path.suffix == only) and path.name not in skip:
            lines.append(f"fingerprint {folder}/{path.name}: {fingerprint(path)}"
                         + (" (compare it with its maker's, by phone or another channel)" if folder == "inbox"
                            else " (read it to its receivers by another channel)"))
    return lines


def _flwr_config(kit: Path, conf: dict[str, Any]) -> None:
    """The coordinator's ``flwr`` connection (``flwr-home/config.toml``), written again by every step
    that uses it: it names ``keys/ca.crt`` by its absolute path, which changes when the kit moves."""
    private_dir(kit / "flwr-home")
    (kit / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{conf["superlink"]}"\n'
        f'root-certificates = "{kit / "keys" / "ca.crt"}"\n', encoding="utf-8")


def _env(kit: Path) -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    return dict(os.environ, FLWR_HOME=str(kit / "flwr-home"), FLWR_TELEMETRY_ENABLED="0",
                FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", PYTHONUNBUFFERED="1",
                PATH=bindir + os.pathsep + os.environ.get("PATH", ""))


def _path(kit: Path, value: str) -> Path:
    return (kit / Path(value).expanduser()).resolve()


def _start_args(kit: Path, conf: dict[str, Any]) -> list[str]:
    from fl_split.deploy import _bin, _literal

    name = conf["party"]
    if name == COORDINATOR:
        keys, (_, port) = kit / "keys", _hostport("superlink", conf["superlink"])
        _need(keys / "superlink.key", "run init first")
        private_dir(kit / "state")
        return [_bin("flower-superlink"), "--host", conf.get("superlink-bind", "0.0.0.0"), "--port", str(port),
                "--database", str(kit / "state" / "superlink.db"), "--disable-runtime-dependency-installation",
                "--ssl-ca-certfile", str(keys / "ca.crt"), "--ssl-certfile", str(keys / "superlink.crt"),
                "--ssl-keyfile", str(keys / "superlink.key"), "--enable-supernode-auth"]
    if not conf.get("data-path"):
        raise KitConfigError("data-path", "", f"the path of {name}'s own table (edit {kit / KIT_FILE})")
    data = _path(kit, conf["data-path"])
    if not data.is_file():
        raise KitConfigError("data-path", conf["data-path"], f"an existing file (edit {kit / KIT_FILE})")
    keys, inbox = kit / "keys", kit / "inbox"
    ca = _need(inbox / "ca.crt", "the coordinator's ca.crt in inbox/")
    items = [f"role='{conf['role']}'"] + ([f"guest-index={conf['guest-index']}"] if name != "host" else [])
    items.append(f"data-path={_literal(data)}")
    if str(conf.get("plugins", "") or "").strip():  # the operator's own plug-in allow-list (fl_split.plugins)
        items.append(f"plugins={_literal(str(conf['plugins']).strip())}")
    if name == "host":
        items += [f"dataplane-address='{conf['dataplane']}'",
                  f"dataplane-certfile={_literal(_need(keys / 'dataplane-host.crt', 'run init first'))}",
                  f"dataplane-keyfile={_literal(keys / 'dataplane-host.key')}",
                  f"dataplane-client-ca={_literal(keys / 'dataplane-ca.crt')}"]
    else:
        dp_ca = _need(inbox / "dataplane-ca.crt", "the host's dataplane-ca.crt in inbox/")
        cert = _need(inbox / f"{name}.crt", "your certificate signed by the host in inbox/")
        key = _need(keys / f"{name}.key", "run init first")
        items += [f"dataplane-ca={_literal(dp_ca)}", f"dataplane-certfile={_literal(cert)}",
                  f"dataplane-keyfile={_literal(key)}"]
        if conf.get("secure-merge"):
            items += _secure_merge_items(kit, conf)
    if conf.get("checkpoint-dir"):  # "checkpoints/{run}": the node makes each run's folder in it
        ckpt = str(conf["checkpoint-dir"])
        base = ckpt[:-len(RUN_PLACEHOLDER)] if ckpt.endswith(RUN_PLACEHOLDER) else ckpt
        if "{" in base or "}" in base:
            raise KitConfigError("checkpoint-dir", ckpt, f"a folder, optionally ending in /{RUN_PLACEHOLDER} "
                                 f"(each run its own folder in it)")
        where = private_dir(_path(kit, base or "."))
        items.append(f"checkpoint-dir={_literal(where / RUN_PLACEHOLDER if base != ckpt else where)}")
    for key in ("predict-data-path", "predict-out"):  # read when a prediction job comes (sh run.sh predict)
        if str(conf.get(key, "") or "").strip():
            items.append(f"{key}={_literal(_path(kit, str(conf[key]).strip()))}")
    # its own limits: a guest's inference limits, every party's training budget and test-request cap
    for key in ("inference-budget", "max-queries-per-id", "budget", "max-test-requests"):
        value = str(conf.get(key, "") or "").strip()
        if value:
            number = key.endswith("budget")
            try:
                items.append(f"{key}={float(value)!r}" if number else f"{key}={int(value)}")
            except ValueError:
                raise KitConfigError(key, conf[key], "a number > 0" if number else "a whole number >= 1",
                                     reason=f"edit {kit / KIT_FILE}") from None
    if conf.get("model-dir"):  # --save-model: this party's own part goes to model-dir/<party>/
        items.append(f"model-dir={_literal(private_dir(_path(kit, conf['model-dir'])))}")
    if conf.get("init-from"):  # --init-from: this party's own part is read from init-from/<party>/ (else model-dir)
        items.append(f"init-from={_literal(_path(kit, conf['init-from']))}")
    if conf.get("private-seed-file"):  # the path only: the seed itself is never on a command line
        items.append(f"private-seed-file={_literal(_path(kit, conf['private-seed-file']))}")
    return [_bin("flower-supernode"), "--superlink", conf["superlink"], "--host", "127.0.0.1",
            "--port", str(conf["clientappio-port"]), "--node-config", " ".join(items),
            "--root-certificates", str(ca), "--auth-supernode-private-key", str(_need(keys / f"auth-{name}.key", "run init first"))]


def _register(kit: Path, conf: dict[str, Any]) -> list[str]:
    """``flwr supernode register`` for every party, in one ``flwr`` process (FlwrCli)."""
    from fl_split.flower.flwrcli import FlwrCli

    done = []
    pubs = {party: _need(kit / "inbox" / f"auth-{party}.pub", f"every party's public key in inbox/ ({party} sends it)")
            for party in conf["parties"]}
    _flwr_config(kit, conf)
    with FlwrCli(_env(kit), kit, own_session=False) as cli:
        for party, pub in pubs.items():
            out = cli.run("supernode", "register", str(pub), CONNECTION, "--name", party, "--format", "json")
            if out.returncode != 0 or '"success": true' not in out.stdout:
                detail = (out.stdout + out.stderr).strip().splitlines()
                raise KitError(f"flwr supernode register for {party} failed: {detail[-1] if detail else out.returncode}")
            done.append(f"registered {party}")
    return done


class KitError(FlSplitError):
    """A step of a kit failed (a ``flwr`` command, the run); one line."""


def _job(kit: Path, *, resume: bool = False, save_model: bool = False, init_from: bool = False) -> tuple[Path, Path]:
    """The kit's ``run-config.toml`` for this run, written to ``state/run-config.toml``; returns it and
    the results' path. Its relative paths (:data:`KIT_PATHS`) are resolved against the kit's folder on
    this machine; ``checkpoint-dir = "checkpoints/{run}"`` names a new folder per run (a UTC time,
    remembered in :data:`LAST_RUN`) or, with ``resume``, the last run's; ``save_model`` /
    ``init_from``: every node saves its own part into / starts from its kit.toml ``model-dir``
    (docs/deploy.md, "After the first run")."""
    job = tomllib.loads(_need(kit / "run-config.toml", "the job").read_text(encoding="utf-8"))
    resume = resume or bool(job.get("resume", False))
    ckpt = str(job.get("checkpoint-dir", "") or "")
    if resume and not ckpt:
        raise KitError("sh run.sh run --resume: run-config.toml checkpoint-dir is empty, so no run of this kit "
                       "checkpointed and none can resume; start a new run with sh run.sh run")
    if ckpt.endswith(RUN_PLACEHOLDER):
        last = kit / LAST_RUN
        if resume:
            try:
                label = str(json.loads(last.read_text(encoding="utf-8"))["label"])
            except (OSError, ValueError, KeyError, TypeError):
                raise KitError(f"sh run.sh run --resume: no earlier run of this kit to resume ({LAST_RUN} is "
                               f"missing); start one with sh run.sh run") from None
        else:
            label = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            base = _path(kit, ckpt[:-len(RUN_PLACEHOLDER)] or ".")
            n = 1
            while (base / label).exists():  # two runs in one second
                n += 1
                label = f"{label.split('-')[0]}-{n}"
            private_dir(base / label)  # taken: the next run in this second gets another
            private_dir(kit / "state")
            write_private(last, json.dumps({"label": label, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                     time.gmtime())}).encode())
        job["checkpoint-dir"] = ckpt[:-len(RUN_PLACEHOLDER)] + label
    elif RUN_PLACEHOLDER in ckpt:
        raise KitConfigError("checkpoint-dir", ckpt, f"a folder, optionally ending in /{RUN_PLACEHOLDER}",
                             reason="edit run-config.toml")
    job["resume"] = resume
    if save_model:
        job["save-model"] = "model"  # a non-empty value: each node saves into its own kit.toml model-dir
    if init_from:
        job["init-from"] = "model"  # each node starts from its kit.toml init-from (else model-dir)
    return _resolved(kit, job, "run-config.toml")


def _resolved(kit: Path, job: dict[str, Any], name: str) -> tuple[Path, Path]:
    for key in KIT_PATHS:
        if str(job.get(key, "") or ""):
            job[key] = str(_path(kit, str(job[key])))
    resolved = private_dir(kit / "state") / name
    write_private(resolved, _toml(job).encode("utf-8"))
    return resolved, Path(str(job.get("out", "") or kit / "results.json"))


def _predict_job(kit: Path) -> tuple[Path, Path]:
    """The prediction job (:mod:`fl_split.flower.predicting`) of the model the kit's job trained: its
    public configuration and the job's ID / label columns and alignment, nothing saved, checkpointed or
    started from; no path and no limit (each node takes its own files and a guest its own inference
    limits from its kit.toml). The summary goes to ``predict-summary.json`` in this kit."""
    from fl_split.flower.predicting import job_spec
    from fl_split.flower.strategy import JOB_KEY

    job = tomllib.loads(_need(kit / "run-config.toml", "the job").read_text(encoding="utf-8"))
    spec = job_spec(str(job.get("id-column") or "id"), str(job.get("label-column") or "label"),
                    str(job.get("align") or "public"), None, int(job.get("guests", 1)))
    job.update({"save-model": "", "checkpoint-dir": "", "resume": False, "init-from": "", "data": "",
                "data-plane": "flower", "progress": False, "out": "predict-summary.json", JOB_KEY: json.dumps(spec)})
    return _resolved(kit, job, "predict-config.toml")


def _app(kit: Path, conf: dict[str, Any]) -> Path:
    """The Flower app to submit, in ``app/``: the installed package's (kit.toml ``app = "fl-split"``,
    :func:`package_app`), or the app directory kit.toml names (a checkout; relative to the kit)."""
    from fl_split.deploy import staged_app

    app = str(conf.get("app", "") or INSTALLED_APP)
    if app == INSTALLED_APP:
        return package_app(kit / "app")
    return staged_app(kit / "app", _path(kit, app))  # the same FAB as the directory's, without walking its .venv


#: the coordinator's SuperLink, as its ``start`` leaves it: its process ID and its output (terminal too)
SUPERLINK_PID, SUPERLINK_LOG = "state/superlink.pid", "state/superlink.log"
#: a run still ``pending`` this long (seconds) is said so in the operator's terminal, once
PENDING_NOTICE = 30.0


def _tee(log: Path) -> None:
    """From here on, this process's stdout and stderr — and those of what it ``execve``s and launches,
    such as Flower's SuperExec — go to the terminal **and** to ``log`` (a forked copier; it ignores
    Ctrl-C so that the last lines still arrive, and ends when every writer has closed the pipe)."""
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    fh = open(log, "wb")  # noqa: SIM115 - the copier's
    read, write = os.pipe()
    if os.fork() == 0:  # the copier
        try:
            os.close(write)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # (SIGPIPE stays ignored: a lost terminal is an OSError)
            terminal = True
            while chunk := os.read(read, 65536):
                if terminal:
                    try:
                        os.write(1, chunk)
                    except OSError:
                        terminal = False  # the terminal went away: keep the log
                fh.write(chunk)
                fh.flush()
        finally:
            os._exit(0)
    fh.close()
    os.close(read)
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)


def _cmdline(pid: str | int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _log_reason(kit: Path) -> str:
    """The SuperLink log's (:data:`SUPERLINK_LOG`) last error, in one line ('' if none): a TLS
    verification failure first, else the last line of its last traceback, else its last ERROR line."""
    from fl_split.deploy import _one_line

    try:
        lines = (kit / SUPERLINK_LOG).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    tls = [ln for ln in lines if "CERTIFICATE_VERIFY_FAILED" in ln or "certificate verify failed" in ln.lower()]
    if tls:
        return _one_line(tls[-1])[-400:]
    last, in_tb = "", False
    for ln in lines:
        if ln.startswith("Traceback (most recent call last)"):
            in_tb = True
        elif in_tb and ln and not ln[0].isspace():
            last, in_tb = ln, False
    if not last:
        errors = [ln for ln in lines if "ERROR" in ln]
        last = errors[-1] if errors else ""
    return _one_line(last)[-400:]


def superexec_down(kit: Path) -> str | None:
    """Why no run can start, in one line, when the coordinator's SuperLink runs on this machine (its
    ``start`` wrote :data:`SUPERLINK_PID`) without the SuperExec that Flower launches beside it to
    start ServerApps (``flower-superexec --parent-pid PID``); ``None`` when that SuperExec runs or
    this machine cannot tell (no SuperLink of this kit here). docs/deploy.md, "When a run fails"."""
    try:
        link = int((kit / SUPERLINK_PID).read_text().strip())
    except (OSError, ValueError):
        return None
    cmd = _cmdline(link)
    if not any(Path(c).name == "flower-superlink" or c.endswith("flower-superlink") for c in cmd[:2]):
        return None  # not running here (or another process took its ID)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            args = _cmdline(entry.name)
            if args and any(a.endswith("flower-superexec") for a in args[:2]) and str(link) in args:
                return None
    reason = _log_reason(kit) or "no error in its log"
    hint = (" — the SuperLink's certificate must name 127.0.0.1 too (kits initialised by this fl-split do: "
            "init a fresh kit)" if "127.0.0.1" in reason or "localhost" in reason else "")
    return (f"the SuperLink (pid {link}) has no SuperExec, so it cannot start any run's ServerApp: its SuperExec "
            f"died: {reason}{hint}; see {SUPERLINK_LOG}, then restart it with sh run.sh start")


def _run(kit: Path, conf: dict[str, Any], options: dict[str, bool] | None = None, timeout: float = 3600.0) -> list[str]:
    """``sh run.sh run [--resume] [--save-model] [--init-from]``: the training job (:func:`_job`)."""
    down = superexec_down(kit)  # before anything is written: a run could not start
    if down:
        raise KitError(down)
    run_config, results = _job(kit, **(options or {}))
    return _submit(kit, conf, run_config, results, timeout)


def _predict(kit: Path, conf: dict[str, Any], timeout: float = 3600.0) -> list[str]:
    """``sh run.sh predict``: the prediction job (:func:`_predict_job`) on each party's new rows."""
    down = superexec_down(kit)
    if down:
        raise KitError(down)
    run_config, summary = _predict_job(kit)
    done = _submit(kit, conf, run_config, summary, timeout)
    try:
        s = json.loads(summary.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return done
    lines = [f"{s.get('records', '?')} rows scored (shared IDs {s.get('alignment', {}).get('shared_ids', '?')}); "
             f"the predictions are in the host's predict-out, on its machine"]
    for g, r in sorted((s.get("privacy") or {}).items()):
        lines.append(f"{g}: ε {r['epsilon']:.4g} over all its inference releases" if r.get("covered")
                     else f"{g}: {r.get('note', 'not covered')}")
    return done + lines


def _submit(kit: Path, conf: dict[str, Any], run_config: Path, results: Path, timeout: float) -> list[str]:
    """``flwr run`` the job ``run_config``, stream its log, then the outcome as the SuperLink reports it
    (``flwr run`` exits 0 even when the ServerApp fails). A SuperLink of this kit on this machine
    without its SuperExec stops it in one line (:func:`superexec_down`) instead of a run left ``pending``."""
    from fl_split.deploy import _one_line, run_status
    from fl_split.flower.flwrcli import FlwrCli

    app = _app(kit, conf)
    _flwr_config(kit, conf)
    with FlwrCli(_env(kit), kit, own_session=False) as cli:  # `flwr run` and `flwr ls`: one flwr process
        proc = cli.start("run", str(app), CONNECTION, "--stream", "--run-config", str(run_config))
        run_id = None
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith("Successfully started run "):
                run_id = line.split()[-1]
        if run_id is None:
            raise KitError(f"flwr run exited with code {proc.returncode} without starting a run")
        start = time.monotonic()
        deadline, checked, told = start + timeout, start, False
        while True:
            status, details = run_status(cli.run("ls", CONNECTION, "--run-id", run_id, "--format", "json"))
            if status.startswith("finished") or time.monotonic() > deadline:
                break
            now = time.monotonic()
            if status.startswith("pending") and now - checked > 2.0:
                checked = now
                down = superexec_down(kit)
                if down:
                    raise KitError(f"run {run_id} stays pending: {down}")
                if not told and now - start > PENDING_NOTICE:
                    told = True
                    print(f"run {run_id} still pending after {now - start:.0f} s: the SuperLink has not started "
                          f"its ServerApp (its log: {SUPERLINK_LOG})", flush=True)
            time.sleep(0.25)
    if details.strip() in ("N/A", "None", "-"):  # Flower's "no details"
        details = ""
    if status != "finished:completed":
        logged = "" if details.strip() else _log_reason(kit)
        why = _one_line(details) or (f"no details; the SuperLink's last logged error: {logged}" if logged else "no details")
        raise KitError(f"run {run_id} {status.replace('finished:', '')}: {why}")
    return [f"run {run_id} completed; results in {results}"]


#: the options of ``sh run.sh run`` (docs/deploy.md, "After the first run")
RUN_OPTIONS = ("resume", "save_model", "init_from")


def node_step(step: str, kit_dir: str | os.PathLike, **options: bool) -> list[str]:
    """Run one step of a kit; ``start`` replaces this process with the SuperLink / SuperNode.
    ``options``: ``resume``, ``save_model``, ``init_from`` — only for the coordinator's ``run``."""
    kit = Path(kit_dir).expanduser().resolve()
    conf = read_kit(kit)
    if step not in _steps_of(conf["party"]):
        raise KitError(f"sh run.sh {step}: not a step of {conf['party']}'s kit; its steps: "
                       f"{', '.join(_steps_of(conf['party']))}")
    given = [k for k, v in options.items() if v]
    if given and step != "run":
        raise KitError(f"sh run.sh {step}: --{given[0].replace('_', '-')} is an option of the coordinator's "
                       f"sh run.sh run only")
    check_version(conf)
    os.umask(PRIVATE_UMASK)
    if step == "init":
        return _init(kit, conf) + _fingerprints(kit, "outbox")
    if step == "sign":
        return _sign(kit, conf) + _fingerprints(kit, "outbox", only=".crt", skip=("dataplane-ca.crt",))
    if step == "fingerprints":
        return _fingerprints(kit, "outbox") + _fingerprints(kit, "inbox")
    if step == "register":
        return _fingerprints(kit, "inbox", only=".pub") + _register(kit, conf)
    if step == "run":
        return _run(kit, conf, {k: bool(options.get(k)) for k in RUN_OPTIONS})
    if step == "predict":
        return _predict(kit, conf)
    args = _start_args(kit, conf)
    sys.stdout.flush()
    os.chdir(kit)
    mode = conf.get("clientapp", "warm")
    if mode not in ("warm", "per-message"):
        raise KitConfigError("clientapp", mode, f"'warm' or 'per-message' (edit {kit / KIT_FILE})")
    if conf["party"] != COORDINATOR and mode == "warm":
        # the party warm in this one process for the whole run (fl_split/flower/warm.py); kit.toml
        # clientapp = "per-message" keeps Flower's flwr-clientapp process per message
        from fl_split.flower.warm import main as party_runtime

        os.environ.update(_env(kit))  # what execve would have given the SuperNode (a superset of ours)
        sys.exit(party_runtime(args))
    if conf["party"] == COORDINATOR:  # its ID and output stay readable to `run` (superexec_down)
        state = private_dir(kit / "state")
        (state / "superlink.pid").write_text(f"{os.getpid()}\n", encoding="ascii")  # execve keeps the ID
        _tee(kit / SUPERLINK_LOG)
    os.execve(args[0], args, _env(kit))  # the organisation's long-running service
    raise AssertionError("unreachable")


# -- the loopback deployment from the kits (fl-split deploy local --from-kits) -----------------------------
class KitDeployment(LocalDeployment):
    """``deploy local --from-kits``: kits written into ``WORKDIR/kits``, then every organisation's
    ``run.sh`` executed as that organisation would (:data:`SENDS` is all that moves between kits),
    on 127.0.0.1 with free ports. Always TLS and SuperNode authentication. The SuperLink and the
    SuperNodes are the kits' ``sh run.sh start`` processes, ended with everything they start."""

    #: deploy_local's phase lines say that the kits make the keys
    FROM_KITS = True

    def __init__(self, cfg: RunConfig, workdir, **kw) -> None:
        if not kw.get("tls", True) or not kw.get("node_auth", True):
            raise ConfigError("from-kits", True, "with TLS and node authentication (no --insecure, --no-node-auth)",
                              reason="a kit always makes keys and certificates")
        kw.update(tls=True, node_auth=True)
        super().__init__(cfg, workdir, **kw)
        self.kits = self.workdir / "kits"
        self.connection = CONNECTION
        self.results_path = self.kits / COORDINATOR / "results.json"
        self.env["PYTHON"] = sys.executable  # run.sh runs fl_split with this interpreter

    def _step(self, who: str, step: str) -> None:
        log = self.group.log_dir / f"kit-{who}-{step}.log"
        private_dir(log.parent)
        with open(log, "wb") as fh:
            rc = subprocess.run(["/bin/sh", str(self.kits / who / "run.sh"), step], env=self.env, cwd=self.kits / who,
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=300,
                                umask=PRIVATE_UMASK).returncode
        if rc != 0:
            tail = log.read_text(errors="replace").strip().splitlines()
            raise DeploymentError(f"{who}: sh run.sh {step} exited with code {rc}: "
                                    f"{tail[-1] if tail else 'no output'} (log: {log})")

    def prepare(self) -> None:
        self.prepare_data()
        if self.kits.exists():  # a fresh set of kits (and keys) for every deployment
            shutil.rmtree(self.kits)
        self.link_port, self.dataplane_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.link_port}"
        kits = write_kits(self.cfg, self.kits, self.parties, self.address, f"127.0.0.1:{self.dataplane_port}",
                          bind="127.0.0.1", clientappio_ports={p: free_port() for p in self.parties})
        for who in [COORDINATOR] + self.parties:  # (1) each organisation makes its keys
            self._step(who, "init")
        for party in self.parties:  # (0) each organisation names its own table (and seed) in its kit.toml
            values: dict[str, Any] = {"data_path": str(self.party_file(party)),
                                      "clientapp": "warm" if self.warm else "per-message"}
            if self.private_seed is not None:
                write_private(kits[party] / "keys" / "private-seed",
                              self.private_seed.for_party(party).file_text().encode("ascii"))
                values["private_seed_file"] = "keys/private-seed"
            # deploy local's layout: DIR/<party>, DIR/coordinator (the kits' own: a folder per run)
            values["checkpoint_dir"] = str(checkpoint_dir_of(self.cfg, party)) if self.cfg.checkpoint_dir else ""
            # --save-model DIR / --init-from DIR: deploy local's layout, every node's part in the one DIR
            for key, where in (("model_dir", self.cfg.save_model), ("init_from", self.cfg.init_from)):
                if where:
                    values[key] = str(Path(where).expanduser().resolve())
            update_kit(kits[party], **values)
        job = kits[COORDINATOR] / "run-config.toml"
        where = str(checkpoint_dir_of(self.cfg, COORDINATOR)) if self.cfg.checkpoint_dir else ""
        text = job.read_text(encoding="utf-8").replace(f'checkpoint-dir = "checkpoints/{RUN_LABEL}"',
                                                       f'checkpoint-dir = "{where}"')
        write_private(job, text.encode("utf-8"))
        deliver(self.kits, self.parties)  # public keys, CSRs, CA certificates
        self._step("host", "sign")  # (2) the host's data-plane CA signs the guests' CSRs
        deliver(self.kits, self.parties)  # the signed certificates back to their guests
        self.certs = self.kits / COORDINATOR / "keys"  # ca.crt: to check the SuperLink answers
        self.flwr_home = self.kits / COORDINATOR / "flwr-home"
        self.env["FLWR_HOME"] = str(self.flwr_home)
        self._mark("prepared")

    def start_superlink(self) -> None:
        self.group.spawn("superlink", ["/bin/sh", str(self.kits / COORDINATOR / "run.sh"), "start"], self.env,
                         cwd=self.kits / COORDINATOR)
        self._wait_superlink()
        self._mark("superlink")

    def register_nodes(self) -> None:
        self._step(COORDINATOR, "register")
        self._mark("registered")

    def start_supernodes(self) -> None:
        for party in self.parties:
            self.group.spawn(f"supernode-{party}", ["/bin/sh", str(self.kits / party / "run.sh"), "start"],
                             self.env, cwd=self.kits / party)
        self._mark("supernodes")

    def run(self) -> dict[str, Any]:
        self.results_path.unlink(missing_ok=True)
        self._submit(["/bin/sh", str(self.kits / COORDINATOR / "run.sh"), "run"], umask=PRIVATE_UMASK,
                     follow_host=True)
        if not self.results_path.exists():
            raise DeploymentError(f"run {self.run_id} completed but wrote no results to {self.results_path}")
        return json.loads(self.results_path.read_text(encoding="utf-8"))


# -- the command line -------------------------------------------------------------------------------------
def add_kit_parsers(kinds, local_group, add_train_flags) -> None:
    """``deploy kit``, ``deploy node`` and ``deploy local --from-kits`` (registered by fl_split.cli, which
    hands over its ``add_train_flags``: the package's layers import one way, docs/design.md)."""
    local_group.add_argument("--from-kits", action="store_true", default=False,
                             help="write a kit per organisation into WORKDIR/kits and run the deployment by "
                                  "executing each kit's run.sh (always TLS and node authentication)")
    kit = kinds.add_parser(
        "kit", help="write a folder per organisation (coordinator, host, guests): script, config, README",
        description="Write DIR/coordinator, DIR/host, DIR/guest-<g>: run.sh (sh run.sh init|sign|register|start|run), "
                    "kit.toml and README.txt saying what each generates on its own machine and sends to whom. "
                    "No key is written: each organisation makes its own with `sh run.sh init` (docs/deploy.md).")
    add_train_flags(kit)
    g = kit.add_argument_group("kit")
    g.add_argument("--parties", required=True, metavar="host,guest-1,…", help="the organisations' party names")
    g.add_argument("--superlink", default="127.0.0.1:9093", metavar="HOST:PORT",
                   help="where SuperNodes and flwr reach the coordinator's SuperLink (its certificate names HOST)")
    g.add_argument("--dataplane", default="127.0.0.1:9300", metavar="HOST:PORT",
                   help="where guests reach the host's data plane (the host listens on PORT)")
    node = kinds.add_parser("node", help="one step of a kit (what its run.sh runs)")
    node.add_argument("step", choices=STEPS)
    node.add_argument("--kit", default=".", metavar="DIR", help="the kit folder [default: .]")
    node.add_argument("--resume", action="store_true", help="run: go on from the last run's checkpoints")
    node.add_argument("--save-model", action="store_true",
                      help="run: every node saves its own part into its kit.toml model-dir")
    node.add_argument("--init-from", action="store_true",
                      help="run: every node starts from its own saved part (kit.toml init-from, else model-dir)")


def cmd_kit(ns, config_from_args) -> int:
    """``deploy kit`` / ``deploy node``; ``config_from_args``: fl_split.cli's (handed over, as above)."""
    if ns.deploy_kind == "node":
        for line in node_step(ns.step, ns.kit, **{k: getattr(ns, k, False) for k in RUN_OPTIONS}):
            print(f"{ns.step}: {line}", flush=True)
        return 0
    if not getattr(ns, "out", None):
        raise ConfigError("out", "", "the directory to write the kits into")
    guests = getattr(ns, "guests", None)  # the train flags arrive as text
    try:
        guests = None if guests in (None, "") else int(guests)
    except (TypeError, ValueError):
        raise ConfigError("guests", guests, "a whole number (or leave it out: --parties says it)") from None
    parties = party_names(ns.parties, guests)
    ns.guests = len(parties) - 1
    cfg = config_from_args(ns)
    if cfg.monolithic:
        raise ConfigError("monolithic", True, "false", reason="a deployment runs the split parties")
    kits = write_kits(replace(cfg, engine="flower", out=""), cfg.out, parties, ns.superlink, ns.dataplane)
    for name, path in kits.items():
        print(f"{name}: {path} (README.txt)")
    print(f"each organisation installs {PACKAGE} {package_version()} first (README.txt): pip install "
          f"{PACKAGE}=={package_version()}")
    print("no key was written: each organisation runs `sh run.sh init` on its own machine")
    return 0
