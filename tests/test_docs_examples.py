"""Every example in README.md and docs/*.md runs as written (issue 35).

The fenced code blocks of README.md and docs/*.md are cut into **examples**: one per command of a
shell block (```bash, ```sh, ```console …; continuation lines joined, comment-only lines dropped),
one per `$ command` of a console transcript (any block whose lines start with ``$ ``: the lines after
it are the output the doc promises), one per Python, TOML or JSON block, and one per other block
(output, diagrams, trees). Each example is a test of its own, named ``doc:line``:

* **run** as written, with this environment's ``fl-split`` first on PATH, in a working directory of
  its doc (every example of a doc shares one, so a file a doc names is made by an earlier example of
  the same doc; the few the docs leave to the reader are made by :data:`INPUTS`, each with a comment
  saying why). It must exit 0 (a transcript: show its output, and fail when it shows a failure), and
  where the doc promises something visible (an accuracy line, an ε table, a file), :data:`EXPECT`
  checks it;
* or **registered** in :data:`REGISTRY`, the one list of examples not run as written, keyed by doc
  and a stable fragment of the example, each with its reason: illustrative (a synopsis, output,
  needs several machines, installs packages, a Flower run whose equivalent another test runs —
  named), or a variant run instead (the command the doc wraps, or the same command made cheaper).

A new example that is neither runnable nor registered fails (docs cannot drift), and so does a
registry entry whose fragment no longer occurs in its doc (:func:`test_registry_is_not_stale`).

Cost: the 21 examples run here took 2.3–2.9 min of wall time and ~90 s of CPU on the shared 2-core
machine (``pytest tests/test_docs_examples.py --durations=25``; tests/README.md); the Flower
simulations and loopback deployments of the docs (30–60 s each) are registered with the tests that
run their equivalents.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console", "zsh"}
PYTHON = {"python", "py", "python3"}
TIMEOUT = 300  # seconds per example; the slowest run here takes ~25 s on the 2-core CI machine


# -- the examples --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # the file's line of the block's first body line (1-based)
    lang: str
    text: str


@dataclass(frozen=True)
class Example:
    doc: str
    line: int
    kind: str  # shell | console | python | toml | json | text
    text: str  # the command (continuations kept), or the whole block
    block: Block
    output: tuple[str, ...] = ()  # console: the lines the doc shows after the command

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


def blocks(doc: str) -> list[Block]:
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, body = m.group(1), m.group(2).lower(), []
        start = i + 2
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{doc}:{start - 1}: a code block that is never closed"
        out.append(Block(doc, start, lang, "\n".join(body)))
        i += 1
    return out


def _commands(block: Block) -> list[Example]:
    """A shell block's commands: continuation lines joined, comment-only and blank lines dropped."""
    out, lines, i = [], block.text.split("\n"), 0
    while i < len(lines):
        if not lines[i].strip() or lines[i].lstrip().startswith("#"):
            i += 1
            continue
        first, cmd = i, [lines[i]]
        while cmd[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd.append(lines[i])
        out.append(Example(block.doc, block.line + first, "shell", "\n".join(cmd), block))
        i += 1
    return out


def _transcript(block: Block) -> list[Example]:
    """A console transcript: each ``$ command`` with the output lines the doc shows after it."""
    out, lines = [], block.text.split("\n")
    starts = [i for i, ln in enumerate(lines) if ln.startswith("$ ")]
    for n, i in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        shown = tuple(ln for ln in lines[i + 1:end] if ln.strip())
        out.append(Example(block.doc, block.line + i, "console", lines[i][2:], block, shown))
    return out


def examples(doc: str) -> list[Example]:
    out = []
    for b in blocks(doc):
        if any(ln.startswith("$ ") for ln in b.text.split("\n")):
            out += _transcript(b)
        elif b.lang in SHELL:
            out += _commands(b)
        else:
            kind = "python" if b.lang in PYTHON else b.lang if b.lang in ("toml", "json") else "text"
            out.append(Example(b.doc, b.line, kind, b.text, b))
    return out


ALL = [e for doc in DOCS for e in examples(doc)]


# -- the registry: every example that is not run as written, and why ---------------------------------
@dataclass(frozen=True)
class Illustrative:
    """Not run: ``reason`` says why, and names the test that runs its equivalent where there is one.
    ``block=True``: the fragment names a block, and every example of it is covered."""
    reason: str
    block: bool = False


@dataclass(frozen=True)
class Variant:
    """Not run as written; ``run(text)`` is run instead, in the doc's working directory (``reason``:
    what differs and why)."""
    reason: str
    run: Callable[[str], str]


@dataclass(frozen=True)
class KnownBug:
    """Run as written, expected to fail until the named bug is fixed (xfail, not strict)."""
    reason: str


AFTER_LAST_AND = lambda cmd: cmd.rsplit("&& ", 1)[1]  # noqa: E731
FLOWER_SIM = "a Flower simulation (30-60 s here); "
DEPLOYMENT = "a loopback deployment (SuperLink + SuperNodes, 30-60 s here); "
SYNOPSIS = "a flag synopsis ([optional] flags, placeholders), not a command"
OUTPUT = "output the doc shows, not a command"

REGISTRY: dict[tuple[str, str], Illustrative | Variant | KnownBug] = {
    # -- README.md
    ("README.md", "python3 -m venv .venv && .venv/bin/pip install -e . &&"): Variant(
        "creates a venv and installs packages; the train command after the last && is run as written (the "
        "tests run in that venv), and its privacy rows are compared with the README's output block", AFTER_LAST_AND),
    ("README.md", '.venv/bin/pip install -e ".[test,psi]" && .venv/bin/python -m pytest -q'): Illustrative(
        "installs packages and runs this whole test suite (which is what CI runs)"),
    ("README.md", "│ guest-1 │ gaussian  │     8985 │"): Illustrative(
        "output of README.md:3's train command; its rows are compared with that run's (EXPECT)"),
    ("README.md", 'print(run.attack("label-norm")["value"])'): Illustrative(
        "run as written by tests/test_api.py::test_readme_python_example_runs_as_written (which owns it)"),
    ("README.md", "fl-split train --dataset NAME --guests G"): Illustrative(SYNOPSIS, block=True),
    ("README.md", "fl_split/      the library (transport-agnostic)"): Illustrative(
        "a map of the repository's directories, not a command"),
    # -- docs/accounting.md
    ("docs/accounting.md", "fl-split audit --defense dpsgd --sigma 1 --releases 1 --trials 40000 --mis-account 2"):
        Illustrative("exits 1 by design (flagged); the same command (with --out) is run by tests/test_audit_power.py"
                     "::test_cli_flags_a_2x_mis_accounted_dpsgd_at_sigma_1[2], which asserts the flag"),
    ("docs/accounting.md", "fl-split audit --defense laplace --epsilon 4 --releases 1\n"): Illustrative(
        "the 16 commands behind the audit table (~10 s each, ~25 min with the table's 200000 trials; "
        "experiments/audit_table.py), with {a,b} alternatives; the audit's rows are tested by "
        "tests/test_audit.py", block=True),
    # -- docs/api.md
    ("docs/api.md", "run = fl_split.train(dataset=\"breast-cancer\""): Illustrative(
        "a tour of the API with placeholders (private_seed=\"…\", df_h); tests/test_api.py runs each part: "
        "test_api_equals_cli_for_the_same_config_and_seed, test_attack_on_the_finished_run_equals_fl_split_attack, "
        "test_model_factory_equals_module_function_and_its_saved_model_predicts, "
        "test_readme_python_example_runs_as_written"),
    ("docs/api.md", "--epoch: got 3 (unknown option; did you mean epochs?)"): Illustrative(
        "error messages; tests/test_api.py::test_bad_options_are_one_line_config_errors asserts each"),
    # -- docs/attacks.md
    ("docs/attacks.md", "fl-split attack --attack {property,reconstruction"): Illustrative(SYNOPSIS),
    ("docs/attacks.md", "fl-split attack --attack property --dataset digits --epochs 5"): Variant(
        "trains 5 epochs on all of digits, then the attack: ~47 s here; the same command is run with "
        "--epochs 1 --limit 300 appended (~14 s)", lambda cmd: cmd + " --epochs 1 --limit 300"),
    ("docs/attacks.md", "session = make_session(cfg, AttackOptions(attack=\"membership\")"): Illustrative(
        "a fragment: cfg and HEX are the reader's; one session serving several attacks is run by "
        "tests/test_attacks.py::test_every_attack_runs_under_each_defence"),
    # -- docs/datasets.md
    ("docs/datasets.md", "fl-split train --data host=bank.csv"): Illustrative(SYNOPSIS),
    ("docs/datasets.md", "fl-split deploy local --data host=bank.csv"): Illustrative(
        DEPLOYMENT + "the same (own tables, --align psi) is run by "
        "tests/test_deploy_align.py::test_deploy_local_aligns_own_tables_between_the_nodes"),
    ("docs/datasets.md", "fl-split export-parties --data host=… --data guest-1=…"): Illustrative(
        SYNOPSIS + "; tests/test_own_data.py::test_deploy_local_party_files_from_own_tables exports own "
        "tables with --align psi"),
    ("docs/datasets.md", "fl-split deploy local --party-files parts/ --guests 1"): Illustrative(
        DEPLOYMENT + "the same (party files exported from own tables) is run by "
        "tests/test_own_data.py::test_deploy_local_party_files_from_own_tables"),
    # -- docs/deploy.md
    ("docs/deploy.md", "fl-split deploy local --tls --dataset digits --guests 2 --epochs 1 --limit 300"): Illustrative(
        DEPLOYMENT + "the same with --limit 150 --seed 3 is run by "
        "tests/test_deploy.py::test_loopback_tls_deployment_with_two_guests (conftest's tls_deployment)"),
    ("docs/deploy.md", "fl-split: failed: run 2998… failed: ServerApp failed"): Illustrative(
        OUTPUT + "; the refusal is tests/test_flower.py::test_inline_deployment_setup_errors[change1-…] and the "
        "one line deploy local prints "
        "tests/test_deploy.py::test_deploy_command_exits_nonzero_with_one_line_when_the_serverapp_fails"),
    ("docs/deploy.md", "export FLWR_TELEMETRY_ENABLED=0"): Illustrative(
        "a walk-through of four organisations' steps: a SuperLink and three SuperNodes in the background on "
        "fixed ports 9093-9096, key registration, flwr run (~4 min); deploy local --tls runs these steps: "
        "tests/test_deploy.py::test_loopback_tls_deployment_with_two_guests, and each organisation's own: "
        "tests/test_deploy_kit.py::test_loopback_deployment_from_the_kits", block=True),
    ("docs/deploy.md", "fl-split party-runtime -- flower-supernode --superlink …"): Illustrative(
        SYNOPSIS + "; the warm party is run by tests/test_warm.py"),
    ("docs/deploy.md", "flwr ls deploy                                  # table"): Illustrative(
        "needs a running SuperLink with a connection named deploy and a RUN_ID; `flwr ls --format json` is "
        "what deploy local reads (fl_split/deploy.py, run_status), in every deploy local test, e.g. "
        "tests/test_deploy.py::test_deploy_command_exits_nonzero_with_one_line_when_the_serverapp_fails",
        block=True),
    # -- docs/flower.md
    ("docs/flower.md", "coordinator (ServerApp)                host (ClientApp)"): Illustrative("a diagram of the processes, not a command"),
    ("docs/flower.md", "guest → host   HELLO    {party, session, nonce N_g"): Illustrative(
        "the handshake's messages, not a command; tests/test_dataplane.py runs it"),
    ("docs/flower.md", "fl-split train --engine flower --dataset digits --guests 2 --epochs 5"): Illustrative(
        FLOWER_SIM + "the same with --epochs 1 --limit 200 is run by "
        "tests/test_flower.py::test_cli_flower_engine_fits_a_small_machine_with_no_resource_flags, which "
        "asserts the --num-cpus auto line shown below it"),
    ("docs/flower.md", "fl-split train --engine flower --guests 2 --num-cpus 1"): Illustrative(
        "its message depends on the machine's CPUs (with 3 or more the command starts a full simulation); "
        "tests/test_dataplane.py::test_cli_refuses_a_simulation_that_cannot_run_every_clientapp runs it with "
        "--num-cpus set to this machine's CPU count and asserts the message"),
    ("docs/flower.md", "source .venv/bin/activate\nfl-split flwr-run"): Illustrative(
        FLOWER_SIM + "activates a venv; fl-split flwr-run with --run-config 'guests=2 epochs=1 …' is run by "
        "tests/test_flower.py::test_flwr_run_wrapper_completes_and_leaves_nothing", block=True),
    ("docs/flower.md", "export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1"): Illustrative(
        FLOWER_SIM + "`flwr run . --stream` as typed (default federation) is run by "
        "tests/test_flwr_run.py::test_flwr_run_as_typed_with_the_default_federation, and with this "
        "--federation-config by tests/test_flower.py::test_flwr_run_cli_against_our_own_superlink", block=True),
    ("docs/flower.md", "WARNING : fl_split: relay data plane"): Illustrative(
        OUTPUT + "; tests/test_flwr_run.py::test_flwr_run_runs_the_relay_data_plane_when_the_clientapps_do_not_fit "
        "asserts it"),
    ("docs/flower.md", "host: none, no differential privacy claimed (7190 record releases)"): Illustrative(
        OUTPUT + "; tests/test_flwr_run.py::test_flwr_run_as_typed_with_the_default_federation asserts these lines"),
    ("docs/flower.md", "flower-superlink --insecure --simulation --host 127.0.0.1 --port 39191"): Illustrative(
        FLOWER_SIM + "a SuperLink of one's own on a fixed port, left running; "
        "tests/test_flower.py::test_flwr_run_cli_against_our_own_superlink starts one (private ports) and runs "
        "flwr run . with the same --federation-config", block=True),
    ("docs/flower.md", "ray start --head --port 6379 --num-cpus 4"): Illustrative(
        "needs several machines (a Ray cluster); tests/test_flower.py::test_simulation_on_a_two_node_ray_cluster "
        "runs one on loopback", block=True),
    ("docs/flower.md", "# certificates and SuperNode keys: fl-split certs"): Illustrative(
        "a deployment sketch with placeholder hosts (COORDINATOR, host.example.org); docs/deploy.md's "
        "walk-through is its runnable form, run by deploy local: "
        "tests/test_deploy.py::test_loopback_tls_deployment_with_two_guests", block=True),
    # -- docs/plugins.md
    ("docs/plugins.md", "fl-split attack --dataset credit --attack cluster_label:ClusterLabelInference"): Variant(
        "~25 s here (the attack's training run); the same command with --epochs 2 --limit 800 appended "
        "(~10 s; tests/test_plugins.py::test_cluster_label_example_beats_its_baseline asserts it beats its "
        "baseline at that size)", lambda cmd: cmd + " --epochs 2 --limit 800"),
    ("docs/plugins.md", "--defense: got 'my_plugins:NotAMechanism'"): Illustrative(
        "an error message; tests/test_plugins.py::test_bad_defense_plugin_is_one_line[my_plugins:NotAMechanism-…] "
        "asserts it"),
    # -- docs/results.md
    ("docs/results.md", "fl-split train --dataset credit --guests 2 --epochs 5 --class-weight balanced ["): Illustrative(
        "the commands behind the table, with [a | b] alternatives (6 runs, ~2 min); the binary metrics are run "
        "by tests/test_tasks.py::test_credit_binary_run_reports_auc_and_writes_task_columns, regression by "
        "tests/test_tasks.py::test_own_table_with_a_numeric_target_is_regression", block=True),
    ("docs/results.md", '"value_reason": "no epoch was evaluated'): Illustrative(
        "an excerpt of a results file; fl_split/engine.py writes it and "
        "tests/test_results_kept.py::test_non_finite_numbers_become_null_with_a_reason asserts the null/reason form"),
    # -- docs/robustness.md
    ("docs/robustness.md", "--checkpoint-dir runs/ck --resume"): Illustrative(
        "needs the run above killed mid-run (the comment between them; after a completed run --resume is "
        "refused); kill and resume from the command line: "
        "tests/test_checkpoint.py::test_sigkill_and_resume_from_the_command_line"),
    ("docs/robustness.md", "fl-split: failed: host refused guest-1's activations"): Illustrative(
        OUTPUT + " (a guest scaling its releases); tests/test_adversary_releases.py::test_cli_exit_status_and_one_line "
        "and ::test_a_guest_scaling_its_releases_is_stopped_within_the_epoch assert it"),
    # -- docs/serving.md
    ("docs/serving.md", "fl-split train … --init-from model/"): Illustrative(
        SYNOPSIS + " (…); continued training: tests/test_init_from_flower.py, tests/test_save_predict.py"),
    ("docs/serving.md", "fl-split predict … --engine flower"): Illustrative(
        SYNOPSIS + " (…); " + FLOWER_SIM + "tests/test_predict_flower.py::test_flower_predict_with_psi_gives_the_runs_metrics"),
    ("docs/serving.md", "fl-split predict … --engine deploy-local --workdir W"): Illustrative(
        SYNOPSIS + " (…); " + DEPLOYMENT
        + "tests/test_deploy_predict.py::test_deploy_local_trains_saves_and_predicts_the_runs_metrics"),
}


def entry(ex: Example) -> tuple[tuple[str, str], Illustrative | Variant | KnownBug] | None:
    """The registry entry covering ``ex``: one, or none; two is a sloppy registry."""
    hits = [(k, v) for k, v in REGISTRY.items()
            if k[0] == ex.doc and k[1] in (ex.block.text if isinstance(v, Illustrative) and v.block else ex.text)]
    assert len(hits) <= 1, f"{ex.id}: several registry entries cover it: {[k for k, _ in hits]}"
    return hits[0] if hits else None


# -- what the docs leave to the reader: files made here ------------------------------------------------
def _serving_tables(d: Path) -> None:
    # docs/serving.md trains on the reader's own h.csv / g1.csv (ID, label Y at the host) and predicts on
    # "next month's rows" new-h.csv / new-g1.csv: the shipped breast-cancer data, split by rows and columns
    from sklearn.datasets import load_breast_cancer

    frame = load_breast_cancer(as_frame=True).frame.rename(columns={"target": "Y"})
    frame.insert(0, "ID", range(1, len(frame) + 1))
    cols = [c for c in frame.columns if c not in ("ID", "Y")]
    for prefix, rows in (("", frame.iloc[:450]), ("new-", frame.iloc[450:])):
        rows[["ID", "Y", *cols[:15]]].to_csv(d / f"{prefix}h.csv", index=False)
        rows[["ID", *cols[15:]]].sample(frac=1, random_state=0).to_csv(d / f"{prefix}g1.csv", index=False)


def _one_table(d: Path) -> None:
    # docs/datasets.md's one-table example names the reader's all.csv with the columns id, income, debt,
    # age, zip and the label y: a small synthetic one (zip as text codes, a raw column to encode)
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    n = 300
    income, debt = rng.normal(50, 15, n).round(1), rng.normal(20, 8, n).round(1)
    pd.DataFrame({"id": np.arange(1, n + 1), "income": income, "debt": debt, "age": rng.integers(18, 80, n),
                  "zip": rng.choice(["D-10115", "D-20095", "D-80331"], n),
                  "y": (income - debt + rng.normal(0, 5, n) > 30).astype(int)}).to_csv(d / "all.csv", index=False)


INPUTS: dict[str, Callable[[Path], None]] = {"docs/serving.md": _serving_tables, "docs/datasets.md": _one_table}


# -- what a run must show, beyond exit 0 ---------------------------------------------------------------
def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("│").split("│")]


def _final_accuracy(out: str) -> float:
    m = re.search(r"final test accuracy: ([0-9.]+)", out)
    assert m, "no 'final test accuracy' line"
    return float(m.group(1))


def _readme_main_job(out: str, cwd: Path) -> None:
    """The README's output block: the epoch-5 row, and each party's privacy row cell for cell (the
    accuracy and the epoch time vary from run to run: fresh private randomness)."""
    shown = next(b for b in blocks("README.md") if "│ guest-1 │" in b.text).text.split("\n")
    got = {_cells(ln)[0]: _cells(ln) for ln in out.splitlines() if ln.startswith("│")}
    for row in shown:
        want = _cells(row)
        if want[0] in ("host", "guest-1", "guest-2"):
            assert got.get(want[0]) == want, f"README shows {want}, the run printed {got.get(want[0])}"
        else:
            assert want[0] in got, f"no row {want[0]!r} (README shows {row!r})"
    assert _final_accuracy(out) > 0.85


def _titanic_prints_the_next_command(out: str, cwd: Path) -> None:
    """experiments/titanic_tables.py prints the command the doc shows after it."""
    cmd = next(e for e in examples("docs/datasets.md") if e.text.startswith("fl-split train --data host=DIR/host.csv"))
    assert _norm(cmd.text.replace("\\\n", " ")) in _norm(out), f"the script printed:\n{out}"


def _files(*paths: str) -> Callable[[str, Path], None]:
    def check(out: str, cwd: Path) -> None:
        missing = [p for p in paths if not (cwd / p).exists()]
        assert not missing, f"not written: {missing}"
    return check


def _accuracy_above(floor: float) -> Callable[[str, Path], None]:
    def check(out: str, cwd: Path) -> None:
        assert _final_accuracy(out) > floor, f"final test accuracy {_final_accuracy(out)} <= {floor}"
    return check


EXPECT: dict[tuple[str, str], tuple[str | Callable[[str, Path], None], ...]] = {
    ("README.md", "python3 -m venv .venv && .venv/bin/pip install -e . &&"): (_readme_main_job,),
    ("docs/accounting.md", "fl-split audit --defense laplace --epsilon 1 --releases 1,5 --trials 40000 --out A.json"):
        ("laplace/forward/1", "laplace/forward/5", _files("A.json")),
    ("docs/accounting.md", "fl-split audit --defense r3elu --schedule geometric"): ("r3elu/forward/5",),
    ("docs/attacks.md", "fl-split attack --attack property --dataset digits"):
        ("majority rate", "attack results written to property.json", _files("property.json")),
    ("docs/datasets.md", ".venv/bin/python experiments/titanic_tables.py DIR"):
        (_titanic_prints_the_next_command, _files("DIR/host.csv", "DIR/guest-1.csv", "DIR/guest-2.csv",
                                                  "DIR/guest-3.csv")),
    ("docs/datasets.md", "fl-split train --data host=DIR/host.csv"): (_accuracy_above(0.75), "task binary"),
    ("docs/datasets.md", "fl-split train --data all.csv --columns"): (_accuracy_above(0.7),),
    ("docs/deploy.md", "fl-split deploy kit --out kits"):
        ("no key was written", _files("kits/coordinator/README.txt", "kits/host/README.txt",
                                      "kits/guest-1/README.txt", "kits/guest-2/README.txt")),
    ("docs/flower.md", "fl-split export-parties --dataset digits --guests 2 --seed 0 --out parties/"):
        (_files("parties/host.npz", "parties/guest-1.npz", "parties/guest-2.npz"),),
    ("docs/models.md", "fl-split seed --out seed.hex"): (_files("seed.hex"),),
    ("docs/models.md", "--model own_mlp:build"): (_accuracy_above(0.5),),
    ("docs/plugins.md", "--defense gradient_sparsification:GradientSparsification"): ("final test accuracy",),
    ("docs/plugins.md", "cluster_label:ClusterLabelInference"): ("label inference by clustering", "majority rate"),
    ("docs/robustness.md", "--checkpoint-dir runs/ck --checkpoint-every epoch"):
        ("final test accuracy", _files("runs/ck/coordinator.ckpt")),
    ("docs/serving.md", "--defense laplace --epsilon 1 --save-model model/"):
        (_files("model/host/manifest.json", "model/guest-1/manifest.json"),),
    ("docs/serving.md", "fl-split predict --model model/"): ("scored 119 records", "accuracy:", _files("pred.csv")),
    ("docs/serving.md", "--party guest-1 --format onnx --out served/"): (_files("served/guest-1/guest-1.onnx",
                                                                                  "served/guest-1/schema.json"),),
    ("docs/serving.md", "--party host --format torchscript --out served/"): (_files("served/host/host.pt"),),
    ("docs/serving.md", "--party all --out served/"): (_files("served/host/host.onnx"),),
}


# -- running ------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    command: str
    code: int
    out: str = field(repr=False)


_DIRS: dict[str, Path] = {}
_RAN: dict[str, Outcome] = {}


def _workdir(doc: str, factory: pytest.TempPathFactory) -> Path:
    if doc not in _DIRS:
        d = factory.mktemp(re.sub(r"\W", "_", doc))
        # the docs' commands run from a checkout whose venv is .venv (README.md): its example and
        # experiment directories and the venv are linked in, so nothing is written into the checkout
        for name in ("examples", "experiments"):
            (d / name).symlink_to(ROOT / name)
        (d / ".venv").symlink_to(Path(sys.prefix))
        if doc in INPUTS:
            INPUTS[doc](d)
        _DIRS[doc] = d
    return _DIRS[doc]


def _env() -> dict[str, str]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               FL_SPLIT_NO_DOWNLOAD="1", FLWR_TELEMETRY_ENABLED="0", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    env.pop("PYTHONPATH", None)
    return env


def _run(ex: Example, factory: pytest.TempPathFactory) -> Outcome:
    """Run ``ex`` (or its registered variant) once per session, in its doc's working directory."""
    if ex.id in _RAN:
        return _RAN[ex.id]
    cwd = _workdir(ex.doc, factory)
    reg = entry(ex)
    if ex.kind == "python":
        script = cwd / f"example_{ex.line}.py"
        script.write_text(ex.text + "\n")
        argv, command = [sys.executable, script.name], f"python {script.name}"
    elif ex.kind in ("toml", "json"):
        try:
            tomllib.loads(ex.text) if ex.kind == "toml" else json.loads(ex.text)
            outcome = Outcome(ex.kind, 0, "")
        except ValueError as e:
            outcome = Outcome(ex.kind, 1, f"does not parse as {ex.kind}: {e}")
        _RAN[ex.id] = outcome
        return outcome
    else:
        command = reg[1].run(ex.text) if reg and isinstance(reg[1], Variant) else ex.text
        argv = ["bash", "-o", "pipefail", "-c", command]
    try:
        proc = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
        outcome = Outcome(command, proc.returncode, proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as e:
        outcome = Outcome(command, -1, f"timed out after {TIMEOUT} s\n{e.stdout or ''}{e.stderr or ''}")
    _RAN[ex.id] = outcome
    return outcome


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _param(ex: Example):
    reg = entry(ex)
    if reg and isinstance(reg[1], KnownBug):  # runs; a failure is expected until the fix lands (not strict)
        return pytest.param(ex, id=ex.id, marks=pytest.mark.xfail(strict=False, reason=reg[1].reason))
    return pytest.param(ex, id=ex.id)


def _illustrative(ex: Example) -> bool:
    reg = entry(ex)
    return bool(reg) and isinstance(reg[1], Illustrative)


def test_every_example_not_run_is_registered_with_its_reason():
    """An example is a test below unless REGISTRY marks it illustrative — with a reason a reader can
    check (the test that runs its equivalent, or why nothing can); such examples are not tests at all,
    so none is reported as a skipped test standing in for one."""
    shown = [e for e in ALL if _illustrative(e)]
    assert [e.id for e in shown if len(entry(e)[1].reason.split()) < 3] == []
    assert len(shown) < len(ALL)


@pytest.mark.parametrize("ex", [_param(e) for e in ALL if not _illustrative(e)])
def test_example_runs_as_written(ex: Example, tmp_path_factory):
    if ex.kind == "text":
        pytest.fail(f"{ex.id}: a ```{ex.block.lang or ''} block that is not a command: make it runnable "
                    f"(```bash, or a `$ command` transcript) or register it in REGISTRY (tests/test_docs_examples.py) "
                    f"with the reason it is not run:\n{ex.text[:500]}")
    # a file a doc names is made by an earlier example of the same doc: run those first (once each)
    earlier = [e for e in ALL if e.doc == ex.doc and e.line < ex.line and e.kind != "text"
               and not (entry(e) and isinstance(entry(e)[1], Illustrative))]
    failed = [e.id for e in earlier if _run(e, tmp_path_factory).code != 0]
    got = _run(ex, tmp_path_factory)
    where = f"{ex.id}: `{got.command}`" + (f" (earlier examples of this doc failed: {failed})" if failed else "")
    if ex.kind == "console":
        shown = "\n".join(ex.output)
        # a transcript shows its exit: a failure or refusal, or success
        failure = re.search(r"^(fl-split: (error|failed)|Traceback|Error)", shown, re.M)
        assert (got.code != 0) == bool(failure), f"{where} exited {got.code}:\n{got.out[-3000:]}"
        for line in ex.output:
            assert _norm(line) in _norm(got.out), f"{where}: the doc shows {line!r}; it printed:\n{got.out[-3000:]}"
    else:
        assert got.code == 0, f"{where} exited {got.code}:\n{got.out[-4000:]}"
    checks = [v for (doc, frag), v in EXPECT.items() if doc == ex.doc and frag in ex.text]
    for check in (c for group in checks for c in group):
        if callable(check):
            check(got.out, _DIRS[ex.doc])
        else:
            assert _norm(check) in _norm(got.out), f"{where}: no {check!r} in its output:\n{got.out[-3000:]}"


def test_registry_is_not_stale():
    """Every registry and EXPECT entry names a fragment that still occurs in an example of its doc, and
    every EXPECT entry an example that is run."""
    stale = []
    for (doc, frag), value in REGISTRY.items():
        texts = [e.block.text if isinstance(value, Illustrative) and value.block else e.text
                 for e in ALL if e.doc == doc]
        if not any(frag in t for t in texts):
            stale.append((doc, frag))
    for doc, frag in EXPECT:
        hits = [e for e in ALL if e.doc == doc and frag in e.text]
        if not hits or any(entry(e) and isinstance(entry(e)[1], Illustrative) for e in hits):
            stale.append((doc, frag))
    assert not stale, f"registry entries whose example is gone or not run (update tests/test_docs_examples.py): {stale}"
    assert set(INPUTS) <= set(DOCS)


FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
INVOCATION = re.compile(r"(?<![\w/.-])fl-split ([a-z][\w-]*)(?: ([a-z][\w-]*))?")


def _options(parser) -> dict:
    import argparse

    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def test_flags_of_every_fl_split_command_exist():
    """The commands not run as written (synopses, deployments, Flower runs) cannot drift either: each
    `--flag` of an `fl-split SUBCOMMAND` line (comments and what follows ` -- ` aside) is one of that
    subcommand's flags (in process: the CLI's own parser)."""
    from fl_split.cli import build_parser

    commands = _options(build_parser())
    wrong = []
    for ex in (e for e in ALL if e.kind in ("shell", "console")):
        text = "\n".join(re.sub(r"(^|\s)#.*", "", ln) for ln in ex.text.replace("\\\n", " ").split("\n"))
        found = list(INVOCATION.finditer(text))
        for n, m in enumerate(found):
            parser = commands.get(m.group(1))
            if parser is None:
                wrong.append(f"{ex.id}: no subcommand {m.group(1)!r}")
                continue
            start = m.end(1)
            if _options(parser):  # deploy local|kit|node
                parser = _options(parser).get(m.group(2) or "")
                if parser is None:
                    wrong.append(f"{ex.id}: no subcommand 'fl-split {m.group(1)} {m.group(2)}'")
                    continue
                start = m.end(2)
            segment = text[start:found[n + 1].start() if n + 1 < len(found) else len(text)]
            segment = re.split(r"\s--\s|&&|\|\||;", segment)[0]
            known = set(parser._option_string_actions)
            wrong += [f"{ex.id}: fl-split {m.group(0)[9:]} has no {f}" for f in FLAG.findall(segment) if f not in known]
    assert not wrong, "flags the docs use that the CLI does not have:\n" + "\n".join(wrong)


def test_every_doc_is_scanned_and_blocks_are_cut_right():
    """The scan sees README.md and every docs/*.md, every fence is closed, and no example is empty."""
    assert "README.md" in DOCS and len(DOCS) > 10
    assert ALL and all(e.text.strip() for e in ALL)
    assert len({e.id for e in ALL}) == len(ALL)
