"""``fl-split``: train, list datasets and models.

Every ``train`` flag comes from :class:`fl_split.config.RunConfig` (``--batch-size`` ↔
``batch_size`` ↔ Flower key ``batch-size``). Bad input prints one line naming the flag, the value
and what is allowed, exits with code 2, and leaves no results file behind. The results JSON is
written once, atomically, after the run.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, NoReturn

from fl_split.cli_support import (EXIT_FAILED, EXIT_USAGE, _check_out_path, _console,  # noqa: F401 (re-exported)
                                  _show_party_warnings, config_from_args)
from fl_split.config import allowed_text, key_of, option_fields
from fl_split.errors import ConfigError, DataError, FlSplitError, PrivateSeedError
from fl_split.results import write_json_atomic


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump) with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"fl-split: error: {message}\n")


def _add_train_flags(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    groups = {
        "core": p.add_argument_group("data, model, optimisation" if only is None else "data"),
        "flower": p.add_argument_group("Flower engine"),
        "privacy": p.add_argument_group("privacy (spec §3 mechanisms, §5 accounting; docs/references.md)"),
        "robustness": p.add_argument_group("checkpoints and failures (docs/robustness.md)"),
        "serving": p.add_argument_group("saving and serving the model (docs/serving.md)"),
    }
    for f in option_fields():
        if only is not None and f.name not in only:
            continue
        meta = f.metadata
        g = groups[meta["group"]]
        flag = "--" + (meta["flag"] or key_of(f.name))
        if isinstance(f.default, bool):
            action = "store_false" if meta["flag"] and meta["flag"].startswith("no-") else "store_true"
            # a "--no-x" flag sets the option to false: its help says what the flag does
            g.add_argument(flag, dest=f.name, action=action, default=argparse.SUPPRESS,
                           help=meta["flag_help"] if action == "store_false" else meta["help"])
        elif f.name in ("data", "encode"):  # --data host=PATH --data guest-1=PATH …: joined with ';' (config_from_args)
            g.add_argument(flag, dest=f.name, metavar="PARTY=PATH" if f.name == "data" else "COLUMN=KIND",
                           action="append", default=argparse.SUPPRESS,
                           help=f"{meta['help']} [{allowed_text(f)}; default: none]")
        else:
            g.add_argument(flag, dest=f.name, metavar=key_of(f.name).upper().replace("-", "_"),
                           default=argparse.SUPPRESS,
                           help=f"{meta['help']} [{allowed_text(f)}; default: {f.default}]")


def _add_private_seed(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("private randomness (docs/accounting.md, threat model)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--private-seed", dest="private_seed", metavar="HEX", default=None,
                     help="reproducible research runs: derive each party's secret randomness (initialisation, "
                          "noise, masks) from this seed and its name (HKDF-SHA256), inside the party. Never "
                          "written to the results. HEX: >= 32 hex digits (128 bits); - reads it from stdin (a "
                          "value on the command line is visible to every local user). Default: fresh OS "
                          "entropy per party, so two runs release different noise")
    src.add_argument("--private-seed-file", dest="private_seed_file", metavar="PATH", default=None,
                     help="read the private seed from an owner-only file (fl-split seed --out PATH makes one); "
                          "a file the group or others can read is refused")
    g.add_argument("--insecure-private-seed", dest="insecure_private_seed", action="store_true", default=False,
                   help="INSECURE, research reproduction only: accept a small integer --private-seed N (anyone "
                        "can search it and rebuild every party's noise; stretched with PBKDF2) or a patterned "
                        "hex seed (000…0, 0123…, abab…: refused without this flag); warned about on every run, "
                        "recorded as private_randomness = insecure-private-seed")


def private_seed_from_args(ns: argparse.Namespace, on_argv: bool = True):
    """The :class:`~fl_split.seeding.PrivateSeed` of ``--private-seed`` / ``--private-seed-file`` /
    ``--insecure-private-seed``, or ``None``. Raises :class:`~fl_split.seeding.PrivateSeedError`
    (exit 2, before anything is written) for a short or guessable seed or a readable file;
    ``on_argv=False`` also refuses a seed value on the command line (``deploy local``)."""
    from fl_split.seeding import SEED_ALLOWED, PrivateSeed

    text, path = getattr(ns, "private_seed", None), getattr(ns, "private_seed_file", None)
    insecure = getattr(ns, "insecure_private_seed", False)
    digits = "" if text is None else str(text).strip()
    # >= 32 digits (or any letter): a hex seed, patterned or not; fewer digits: an integer N
    if insecure and digits not in ("", "-") and (len(digits) >= 32 or not digits.isdigit()):
        seed = PrivateSeed.insecure_hex(text)  # a patterned hex seed (a short or non-hex one: refused)
        print("fl-split: warning: --insecure-private-seed: a patterned private seed can be guessed by anyone who "
              "receives a release, who can then rebuild every party's initial weights and noise; this run is for "
              "reproducing research numbers only (recorded as private_randomness = insecure-private-seed)",
              file=sys.stderr)
        return seed
    if insecure:
        if text is None or not str(text).strip().isdigit():
            raise PrivateSeedError(f"--insecure-private-seed: needs --private-seed N (an integer N >= 0, or a "
                                   f"patterned hex seed), got "
                                   f"{'no --private-seed' if text is None else '<hidden>'}; without the flag "
                                   f"allowed: {SEED_ALLOWED}")
        print(f"fl-split: warning: --insecure-private-seed: the private seed {int(text)} can be searched in "
              f"seconds by anyone who receives a release, who can then rebuild every party's initial weights and "
              f"noise; this run is for reproducing research numbers only (recorded as private_randomness = "
              f"insecure-private-seed)", file=sys.stderr)
        return PrivateSeed.insecure(int(text))
    if path is not None:
        return PrivateSeed.read_file(path)
    if text is None:
        return None
    if str(text).strip() == "-":
        return PrivateSeed.from_text(sys.stdin.read(1 << 16), "--private-seed - (stdin)")
    seed = PrivateSeed.parse(text)  # a short or guessable value: that error first
    if not on_argv:
        raise PrivateSeedError("--private-seed: got <hidden> (a value on the command line is readable by every "
                               "local user, in ps and /proc/PID/cmdline); allowed here: --private-seed-file PATH "
                               "(owner-only) or --private-seed - (stdin)")
    return seed


def _add_run_dir_flags(p: argparse.ArgumentParser) -> None:
    """``train``: where what a researcher keeps goes (fl_split.rundir, docs/results.md)."""
    g = p.add_argument_group("what is kept of the run (docs/results.md)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--run-dir", dest="run_dir", metavar="DIR", default=None,
                       help="write results.json, epochs.csv (per-epoch metrics) and curves.png here after the run "
                            "[default: $FL_SPLIT_RUNS or ./runs, in <UTC time>-<dataset>-<defense>/; with --out "
                            "FILE: none]")
    where.add_argument("--no-run-dir", dest="run_dir", action="store_const", const="", help="write no run directory")
    g.add_argument("--tensorboard", dest="tensorboard", metavar="DIR", default=None,
                   help="also log each epoch's metrics and each party's final epsilon as TensorBoard scalars "
                        "into DIR (tensorboard --logdir DIR)")


def _check_run_dir(path: str | None) -> None:
    """``--run-dir`` / ``--tensorboard``: refused before anything runs when they cannot be written."""
    if not path:
        return
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError("run-dir", path, "a directory (created if missing)", reason="it is a file")
    if (p / "results.json").exists():
        raise ConfigError("run-dir", path, "a directory without results.json",
                          reason="it holds another run's results (a run directory is never overwritten)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fl-split", description="Vertical split learning with privacy protection.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    train = sub.add_parser("train", help="run one split-learning experiment",
                           description="Run one split-learning experiment and print accuracy and each party's epsilon.")
    _add_train_flags(train)
    _add_private_seed(train)
    _add_run_dir_flags(train)
    export = sub.add_parser(
        "export-parties", help="write one data file per party (host.npz, guest-1.npz, ...) for a Flower deployment",
        description="Prepare the dataset as a run would (shared-ID split, column partition, each party's own "
                    "alignment and encoding) and write each party's slice to its own file, for the SuperNode "
                    "of that party (node-config data-path). A guest's file holds no labels.")
    from fl_split.config import DATA_KEYS

    OWN_DATA_KEYS = ("data", "id_column", "label_column", "align", "data_name", "encode")

    _add_train_flags(export, only=(*DATA_KEYS, "data_root", *OWN_DATA_KEYS))
    export.add_argument("--out", dest="out_dir", metavar="DIR", required=True,
                        help="directory to write host.npz, guest-1.npz, ... into (created if missing)")
    export.add_argument("--format", dest="file_format", choices=("npz", "csv", "parquet"), default="npz",
                        help="npz = arrays; csv / parquet = a table per party with an 'id' column, its feature "
                             "columns (and 'label' for the host), rows in the party's own order, and "
                             "<party>.meta.json beside it [default: npz]")
    from fl_split.attacks.cli import add_parser as _add_attack_parser

    _add_attack_parser(sub, _add_train_flags, _add_private_seed)  # fl-split attack (docs/attacks.md)
    _add_deploy_parser(sub)
    from fl_split.privacy.audit_cli import add_parser as _add_audit_parser

    _add_audit_parser(sub, _add_train_flags, _add_private_seed)  # fl-split audit (docs/accounting.md)
    from fl_split.bench.cli import add_parser as _add_bench_parser

    _add_bench_parser(sub)  # fl-split bench (issue 28, experiments/README.md)
    certs = sub.add_parser("certs", help="make a CA, TLS certificates and SuperNode keys for a deployment",
                           description="Write ca.crt/ca.key, superlink.crt/.key and dataplane-host.crt/.key (server "
                                       "certificates for --hosts), and with --node-keys an ECDSA P-384 key pair "
                                       "auth-NAME.key/auth-NAME.pub per name for SuperNode authentication "
                                       "(docs/deploy.md). Private keys get mode 0600.")
    certs.add_argument("--out", dest="out_dir", metavar="DIR", required=True, help="directory to write into")
    certs.add_argument("--hosts", nargs="+", metavar="HOST", default=["localhost", "127.0.0.1"],
                       help="DNS names / IP addresses the server certificates are valid for "
                            "[default: localhost 127.0.0.1]")
    certs.add_argument("--node-keys", nargs="*", metavar="NAME", default=[],
                       help="SuperNode authentication key pairs to make, e.g. host guest-1 guest-2")
    certs.add_argument("--clients", nargs="*", metavar="NAME", default=[],
                       help="data-plane client certificates to make, one per guest named after it, e.g. guest-1 "
                            "guest-2 (the host requires them by default: mutual TLS, name = party)")
    certs.add_argument("--days", type=int, default=365, help="validity in days [default: 365]")
    seed = sub.add_parser("seed", help="write a fresh 256-bit private seed to an owner-only file",
                          description="Write 256 bits of OS entropy, in hex, to a new file with mode 0600, for "
                                      "--private-seed-file (reproducible runs whose party secrets nobody else can "
                                      "derive). An existing file is never overwritten.")
    seed.add_argument("--out", dest="seed_out", metavar="FILE", required=True, help="the file to create")
    fr = sub.add_parser(
        "flwr-run", help="flwr run . --stream with its own SuperLink and a federation that fits this machine",
        description="Run the Flower app like `flwr run . --stream`, with a SuperLink of its own (private FLWR_HOME "
                    "and port), a federation derived from the job (G + 1 SuperNodes sharing this machine's CPUs), "
                    "the outcome read from the SuperLink (exit 1 when the run fails, which flwr run does not "
                    "report) and every process it started ended afterwards, also on Ctrl-C (docs/flower.md).")
    fr.add_argument("--run-config", default="", metavar="'K=V ...'",
                    help="run-config overrides, as flwr run's --run-config (e.g. \"guests=2 epochs=1 "
                         "out='r.json'\"); default: the app's main job")
    fr.add_argument("--federation-config", default="", metavar="'K=V ...'",
                    help="override the derived federation (num-supernodes, client-resources-num-cpus, "
                         "init-args-num-cpus, ...)")
    fr.add_argument("--workdir", default=None, metavar="DIR",
                    help="FLWR_HOME, SuperLink state and logs go here [default: a temporary directory, removed "
                         "after a successful run]")
    fr.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                    help="give up (and tear down) after S seconds [default: 1800]")
    pr = sub.add_parser("predict", help="score new rows with a saved split model (each party its own part and table)",
                        description="Each party loads only its own folder of --model (written by train --save-model) "
                                    "and reads only its own new table; each guest releases its cut-layer outputs "
                                    "through its saved mechanism with fresh noise, charged to DIR/<guest>/inference-"
                                    "ledger.npz; the host writes the predictions, owner-only (docs/serving.md).")
    pr.add_argument("--model", required=True, metavar="DIR", help="the saved model (DIR/host, DIR/guest-1, …)")
    pr.add_argument("--data", action="append", required=True, metavar="PARTY=PATH",
                    help="each party's new table (repeat: --data host=a.csv --data guest-1=b.csv)")
    pr.add_argument("--id-column", default="id", help="every table's ID column [default: id]")
    pr.add_argument("--label-column", default="label",
                    help="the host's label column; when its table has it, the task's metrics are printed")
    pr.add_argument("--align", default="public", choices=("public", "psi"), help="how the new IDs are aligned")
    pr.add_argument("--out", dest="pred_out", required=True, metavar="PRED.csv", help="the predictions (host only)")
    pr.add_argument("--budget", dest="pred_budget", type=float, default=None, metavar="E",
                    help="each guest's own inference budget: refuse a release that would take its inference "
                         "ledger (over all calls) over epsilon E [default: the epsilon of --max-queries-per-id "
                         "releases of one record] (docs/serving.md \"Inference limits\")")
    pr.add_argument("--max-queries-per-id", dest="pred_max_queries", type=int, default=3, metavar="N",
                    help="each guest's own per-ID cap: refuse a release of a record already released N times for "
                         "inference, over all calls [default: 3]")
    pr.add_argument("--psi-max-peer-ids", dest="pred_psi_max", default="", metavar="N|RATIOx",
                    help="--align psi, --engine local: the largest ID set of another party each party aligns with "
                         "(N IDs or RATIOx its own set) [default: the larger of 4x its own set and its own set + "
                         "10,000]; a deployment node: its node config psi-max-peer-ids")
    pr.add_argument("--engine", dest="pred_engine", default="local", choices=("local", "flower", "deploy-local"),
                    help="local: one process; flower: a Flower simulation, one SuperNode per party; deploy-local: "
                         "a SuperLink and one SuperNode per party on this machine (each node-config: its model-dir, "
                         "its new table) [default: local]")
    pr.add_argument("--workdir", dest="pred_workdir", default=None, metavar="DIR",
                    help="deploy-local: certificates, FLWR_HOME, SuperLink state and logs go here")
    pr.add_argument("--insecure", dest="pred_tls", action="store_false", default=True,
                    help="deploy-local: plaintext and no node authentication (loopback tests only)")
    from fl_split.export_cli import add_parser as _add_export_model_parser

    _add_export_model_parser(sub)  # fl-split export-model (docs/serving.md, "Serving outside fl_split")
    from fl_split.flower.warm import add_parser as _add_runtime_parser

    _add_runtime_parser(sub)
    sub.add_parser("datasets", help="list datasets and whether each is available offline")
    sub.add_parser("models", help="list model architectures and their cut positions")
    return parser


def _add_deploy_parser(sub) -> None:
    deploy = sub.add_parser("deploy", help="run a real Flower deployment (docs/deploy.md)")
    kinds = deploy.add_subparsers(dest="deploy_kind", metavar="KIND", parser_class=_Parser, required=True)
    local = kinds.add_parser(
        "local", help="a SuperLink and one SuperNode per party on this machine, as separate processes",
        description="Export each party's file (with --data host=PATH --data guest-1=PATH …: each SuperNode gets "
                    "its own table and the ServerApp aligns the IDs between the nodes, --align public|psi), "
                    "make certificates and SuperNode keys, start a SuperLink and "
                    "one SuperNode per party on 127.0.0.1 (free ports), run the job with flwr run, print "
                    "accuracy and each party's epsilon, and end every process it started (also on failure "
                    "and Ctrl-C). Exits non-zero with the reason when the run fails.")
    _add_train_flags(local)
    _add_private_seed(local)
    g = local.add_argument_group("deployment")
    sec = g.add_mutually_exclusive_group()
    sec.add_argument("--tls", dest="tls", action="store_true", default=True,
                     help="TLS on the SuperLink, the SuperNodes and the data plane, and SuperNode "
                          "authentication [default]")
    sec.add_argument("--insecure", dest="tls", action="store_false",
                     help="plaintext everywhere and no node authentication (loopback tests only)")
    g.add_argument("--no-node-auth", dest="node_auth", action="store_false", default=True,
                   help="TLS without SuperNode authentication")
    g.add_argument("--workdir", metavar="DIR", required=True,
                   help="party files, certificates, FLWR_HOME, SuperLink state and logs go here")
    g.add_argument("--party-format", choices=("npz", "csv", "parquet"), default="npz",
                   help="format of the exported party files [default: npz]")
    g.add_argument("--deploy-timeout", type=float, default=1800.0, metavar="S",
                   help="give up (and tear down) after S seconds [default: 1800]")
    g.add_argument("--clientapp", choices=("warm", "per-message"), default="warm",
                   help="warm: each party in one long-lived process (fl-split party-runtime); per-message: "
                        "Flower's fresh flwr-clientapp process per message [default: warm]")
    from fl_split.kit import add_kit_parsers  # deploy kit, deploy node, deploy local --from-kits

    add_kit_parsers(kinds, g, _add_train_flags)


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def print_summary(results: dict[str, Any]) -> None:
    """A readable summary of a results dictionary on stdout."""
    from rich.table import Table

    from fl_split.privacy.disclosure import snr_bound

    console = _console()
    cfg, final = results["config"], results["final"]
    engine = results["plan"]["engine"]
    title = (f"{cfg.get('data_name') if cfg.get('data') else cfg['dataset']} · {engine} · {cfg['guests']} guest(s)"
             f"{'' if cfg['host_features'] else ' · host without features'} · model {cfg['model']} "
             f"(cut {cfg['cut_layer']}) · merge {cfg['merge']} · defense {cfg['defense']}"
             + (f" ({cfg['protect']})" if cfg["defense"] != "none" else "")
             + (f" · denoise {cfg['denoise']} {cfg['denoise_param']:g} ({cfg['denoise_side']})"
                if cfg["denoise"] != "none" else ""))
    hist = Table(title=title, title_justify="left")
    for col in ("epoch", "train loss", f"test {final['metric']}", "epoch time (s)"):
        hist.add_column(col, justify="right")
    for h in results["history"]:
        hist.add_row(str(h["epoch"]), _fmt(h.get("train_loss")), _fmt(h.get("test_metric")),
                     _fmt(h["epoch_time_s"], 2))
    console.print(hist)
    if final.get("kept_by_host"):
        console.print(f"metrics kept by the host (--report-metrics none): see {final['kept_by_host']}")
    privacy = results.get("privacy")
    if privacy:
        table = Table(title="privacy, per party", title_justify="left")
        for col in ("party", "mechanism", "releases", "per record", "SNR bound", "epsilon", "delta", "accountant"):
            table.add_column(col, justify="right" if col not in ("party", "mechanism", "accountant") else "left")
        for party, rep in privacy.items():
            mech = rep.get("mechanism")
            name = mech.get("name") if isinstance(mech, dict) else str(mech)
            per_record = rep.get("releases_per_record")
            snr = snr_bound(rep)
            table.add_row(party, str(name), str(rep.get("releases", 0)), "-" if per_record is None else str(per_record),
                          "-" if snr is None else f"{snr:.3g}",
                          _fmt(rep.get("epsilon"), 3) if rep.get("epsilon") is not None else "-",
                          "-" if rep.get("delta") is None else f"{rep['delta']:g}", str(rep.get("accountant") or "-"))
        console.print(table)
        unclaimed = [p for p, rep in privacy.items() if rep.get("privacy_claim") == "none"]
        if unclaimed:
            console.print(f"no privacy claimed: {', '.join(unclaimed)} released through a plug-in defence that "
                          "states no differential privacy event (docs/plugins.md); no epsilon is given for them")
        if any(rep.get("epsilon") is None and p not in unclaimed for p, rep in privacy.items()):
            console.print("epsilon '-': that party's releases are not perturbed; no differential privacy is claimed")
        console.print("SNR bound: the largest signal-to-noise ratio per element the mechanism's parameters allow "
                      "(public; each party logs its measured SNR locally, see docs/mechanisms.md)")
    wire = results["wire"]
    value = (f"{final['value']:.4f}" if final.get("value") is not None
             else f"none ({final['value_reason']})" if final.get("value_reason") and not final.get("kept_by_host")
             else "kept by the host")
    line = (f"final test {final['metric']}: {value}   training time: {results['time_s']:.1f} s   "
            f"wire: {wire['bytes_to_host'] / 1e6:.2f} MB to host, {wire['bytes_to_guests'] / 1e6:.2f} MB to guests")
    console.print(line)
    others = {m: v for m, v in (final.get("metrics") or {}).items() if m != final["metric"] and v is not None}
    chosen = f"task {final.get('task')}" + (" (chosen by --task auto, fl_split/tasks.py)"
                                            if results["config"].get("task") == "auto" else "")
    console.print(chosen + (": " + "   ".join(f"{m} {v:.4f}" for m, v in others.items()) if others else ""))
    for f in results.get("guest_failures") or []:
        console.print(f"{f['guest']} failed in round {f['round']} ({f['reason']}); "
                      + ("its embedding is zero-filled from that round" if f["action"] == "pad" else "run stopped"))
    ck = results.get("checkpoint")
    if ck:
        resumed = ck.get("resumed_from_round")
        console.print(f"checkpoints: {ck['checkpoints']} in {ck['dir']} (every {ck['every']})"
                      + ("" if resumed is None else f"; resumed from round {resumed}, replayed "
                         f"{sum((ck.get('replayed') or {}).values())} logged release(s)"))
        lost = {p: n for p, n in (ck.get("recovered") or {}).items() if n}
        if lost:  # the checkpoint directory had been restored from an older copy (docs/robustness.md)
            console.print("the restored write-ahead logs lacked releases their spend records hold, now charged: "
                          + ", ".join(f"{p} {n}" for p, n in lost.items()))
    if results.get("stopped_reason", "completed") != "completed":
        console.print(f"stopped early ({results['stopped_reason']}): {results.get('stopped_detail', '')}")
    if results.get("status") == "degraded":  # ran to its end, worse than the host alone (fl_split/parties/baseline.py)
        console.print(f"status: degraded: {results.get('status_detail', '')}")


def cmd_train(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    _check_out_path(cfg.out)
    from fl_split.engine import run_experiment

    _show_party_warnings()
    if not cfg.monolithic:
        from fl_split.builder import plan_run
        from fl_split.privacy.diagnostics import hopeless_releases

        for line in hopeless_releases(plan_run(cfg)):
            print(f"fl-split: warning: {line}", file=sys.stderr)
    run_dir = getattr(ns, "run_dir", None)
    tb_dir = getattr(ns, "tensorboard", None)
    _check_run_dir(run_dir)
    if tb_dir is not None:
        from fl_split.tracking import check_tensorboard

        check_tensorboard(tb_dir)
    target = None  # the run directory, chosen before the run when the parties save their parts into it
    if (run_dir or (run_dir is None and not cfg.out)) and not cfg.save_model and not cfg.monolithic:
        from fl_split.rundir import default_run_dir

        target = Path(run_dir) if run_dir else default_run_dir({"config": cfg.to_dict()})
        cfg = cfg.replace(save_model=str(target / "model"))  # the default: each party's part beside the results
    if cfg.engine == "flower" and not cfg.monolithic:
        # Ctrl-C / SIGTERM: end Ray's processes and exit 130 at once (fl_split.flower.processes)
        from fl_split.flower.processes import exit_on_signals

        with exit_on_signals("fl-split: interrupted; no results written"):
            results = run_experiment(cfg, private_seed=ns.seed_value, say=_say)
    else:
        results = run_experiment(cfg, private_seed=ns.seed_value)
    if cfg.out:
        write_json_atomic(cfg.out, results)
    kept = None
    if run_dir or (run_dir is None and not cfg.out):
        from fl_split.rundir import default_run_dir, write_run_dir

        kept = write_run_dir(results, target or run_dir or default_run_dir(results))
    if tb_dir is not None:
        from fl_split.tracking import log_tensorboard

        log_tensorboard(results, tb_dir, name=None if kept is None else kept.name)
    print_summary(results)
    if cfg.out:
        print(f"results written to {cfg.out}")
    if kept is not None:
        print(f"run directory: {kept} (results.json, epochs.csv, curves.png"
              + (", model/: each party's saved part" if target is not None else "") + ")")
    elif results.get("saved_model"):
        print(f"each party's saved part: {results['saved_model']['dir']}/<party> (fl-split predict --model)")
    if tb_dir is not None:
        print(f"TensorBoard scalars written to {tb_dir} (tensorboard --logdir {tb_dir})")
    return 0


def _say(line: str) -> None:
    """A one-line note of the run (what --num-cpus auto chose) on stderr."""
    print(f"fl-split: {line}", file=sys.stderr, flush=True)


def cmd_export_parties(ns: argparse.Namespace) -> int:
    from fl_split.party_files import export_parties

    cfg = config_from_args(ns)
    out = Path(ns.out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError("out", ns.out_dir, "a directory (it is created if missing)", reason="it is a file")
    files = export_parties(cfg, out, getattr(ns, "file_format", "npz"))
    for party, path in files.items():
        print(f"{party}: {path}")
    return 0


def _kit_deployment():
    from fl_split.kit import KitDeployment

    return KitDeployment


def cmd_deploy(ns: argparse.Namespace) -> int:
    import faulthandler
    import signal
    from dataclasses import replace

    if ns.deploy_kind != "local":
        from fl_split.kit import cmd_kit

        return cmd_kit(ns, config_from_args)
    print("deploy local: checking the options …", flush=True)  # a deployment is never silent (issue 17)
    from fl_split.deploy import deploy_local

    # a deployment that seems stuck: `kill -USR1 <pid>` prints every thread's stack to stderr
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    # --party-files DIR: the parties' own files (export-parties) instead of an export by the deployment
    party_dir = vars(ns).pop("party_files", None) or None
    cfg = config_from_args(ns)
    if cfg.engine == "local" and "engine" not in vars(ns):
        cfg = replace(cfg, engine="flower")
    if cfg.engine != "flower":
        raise ConfigError("engine", cfg.engine, "flower (a deployment runs on Flower)")
    if party_dir and cfg.data:
        raise ConfigError("party-files", party_dir, "empty with --data",
                          reason="with --data each SuperNode reads its own table (one table: deploy local exports "
                                 "it); --party-files names files already exported")
    if party_dir and not Path(party_dir).expanduser().is_dir():
        raise ConfigError("party-files", party_dir, "a directory holding host.npz|csv|parquet, guest-1.… "
                          "(fl-split export-parties)", reason="no such directory")
    if cfg.monolithic:
        raise ConfigError("monolithic", True, "false", reason="a deployment runs the split parties")
    _check_out_path(cfg.out)
    if not ns.tls:
        print("fl-split: warning: --insecure: the SuperLink, the SuperNodes and the data plane talk in plaintext "
              "and nodes are not authenticated; use this on loopback only", file=sys.stderr)
    print(f"deploy local: {cfg.guests + 1} parties on 127.0.0.1, work directory {ns.workdir}", flush=True)
    results = deploy_local(cfg, ns.workdir, tls=ns.tls, node_auth=ns.node_auth, private_seed=ns.seed_value,
                           party_format=ns.party_format, timeout=ns.deploy_timeout, party_files=party_dir,
                           deployment=_kit_deployment() if ns.from_kits else None,
                           warm=ns.clientapp == "warm")
    if cfg.out:
        write_json_atomic(cfg.out, results)
    print_summary(results)
    dep = results["deployment"]
    print(f"deployment: run {dep['run_id']} on {dep['superlink']} "
          f"({'TLS' if dep['tls'] else 'insecure'}{', node authentication' if dep['node_auth'] else ''}); "
          f"logs in {dep['workdir']}/logs; every process it started has ended")
    if cfg.out:
        print(f"results written to {cfg.out}")
    return 0


def cmd_certs(ns: argparse.Namespace) -> int:
    from fl_split.certs import write_deployment_certificates

    out = Path(ns.out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError("out", ns.out_dir, "a directory (it is created if missing)", reason="it is a file")
    if ns.days < 1:
        raise ConfigError("days", ns.days, "an integer >= 1")
    files = write_deployment_certificates(out, hosts=ns.hosts, node_keys=ns.node_keys, clients=ns.clients,
                                          days=ns.days)
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0


def cmd_predict(ns: argparse.Namespace) -> int:
    from fl_split.predict import predict

    tables: dict[str, str] = {}
    for item in ns.data:
        for chunk in filter(None, (c.strip() for c in item.split(";"))):
            party, sep, path = chunk.partition("=")
            if not sep or not path:
                raise ConfigError("data", item, "PARTY=PATH, e.g. host=a.csv")
            tables[party.strip()] = path.strip()
    args = (ns.model, tables, ns.id_column, ns.pred_out, ns.align, ns.label_column, ns.pred_budget)
    limit = {"max_queries_per_id": ns.pred_max_queries}
    if ns.pred_psi_max:
        from fl_split.psi import PEER_LIMIT_ALLOWED, check_peer_limit

        if not check_peer_limit(ns.pred_psi_max):
            raise ConfigError("psi-max-peer-ids", ns.pred_psi_max, PEER_LIMIT_ALLOWED)
        if ns.pred_engine != "local":
            raise ConfigError("psi-max-peer-ids", ns.pred_psi_max, "--engine local",
                              reason="a Flower node's bound is its own node config psi-max-peer-ids")
    if ns.pred_engine == "flower":
        from fl_split.flower.predict_sim import predict_flower

        s = predict_flower(*args, **limit)
    elif ns.pred_engine == "deploy-local":
        from fl_split.deploy_predict import deploy_predict

        if not ns.pred_workdir:
            raise ConfigError("workdir", "", "a directory", reason="--engine deploy-local needs a work directory")
        s = deploy_predict(*args, workdir=ns.pred_workdir, tls=ns.pred_tls, **limit)
    else:
        s = predict(*args, **limit, psi_max_peer_ids=ns.pred_psi_max)
    print(f"scored {s['records']} records ({s['task']}); predictions (host only): {s['out']}")
    print("host: releases nothing when it predicts (no gradients); the predictions and metrics stay with it")
    for g, r in s["privacy"].items():
        print(f"{g}: {r['mechanism']}, epsilon {r['epsilon']:.4g} over all its inference releases (ledger "
              f"{r['ledger']})" if r["covered"] else f"{g}: {r['note']}")
    if "alignment" in s:
        print(f"alignment (--align {s['alignment']['align']}): {s['alignment']['shared_ids']} shared IDs")
    for m, v in (s.get("metrics") or {}).items():
        print(f"{m}: {v:.4f}")
    return 0


def cmd_seed(ns: argparse.Namespace) -> int:
    from fl_split.seeding import PrivateSeed
    from fl_split.secure_files import write_private

    path = Path(ns.seed_out).expanduser()
    if path.exists():
        raise ConfigError("out", ns.seed_out, "a path where no file exists", reason="a seed file is never overwritten")
    write_private(path, PrivateSeed.generate().file_text().encode("ascii"), exclusive=True)
    print(f"private seed written to {path} (mode 0600); use --private-seed-file {path}")
    return 0


def cmd_flwr_run(ns: argparse.Namespace) -> int:
    from fl_split.flower.flwrrun import flwr_run

    if ns.timeout <= 0:
        raise ConfigError("timeout", ns.timeout, "a number > 0")
    result = flwr_run(ns.run_config, ns.federation_config, ns.workdir, ns.timeout)
    print(f"fl-split: run {result['run_id']} completed; its SuperLink and every process it started have ended",
          file=sys.stderr)
    return 0


def cmd_datasets() -> int:
    from rich.table import Table

    from fl_split.data.registry import data_root, dataset_info, dataset_names

    table = Table(title=f"datasets (downloads go to {data_root()})", title_justify="left")
    for col in ("name", "offline", "available now", "default model", "description"):
        table.add_column(col)
    for name in dataset_names():
        info = dataset_info(name)
        table.add_row(name, "yes" if info.offline else "no (download)", "yes" if info.available() else "no",
                      info.default_model, info.description)
    _console().print(table)
    return 0


def cmd_models() -> int:
    from rich.table import Table

    from fl_split.models.catalog import CATALOG

    table = Table(title="model architectures", title_justify="left")
    for col in ("name", "inputs", "cuts", "default cut", "description"):
        table.add_column(col)
    for m in CATALOG:
        table.add_row(m.name, m.inputs, f"1..{m.num_layers}", str(m.default_cut), m.description)
    _console().print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        if hasattr(ns, "private_seed"):  # train, attack, deploy local: before anything runs or is written
            ns.seed_value = private_seed_from_args(ns, on_argv=ns.command != "deploy")
        if ns.command == "train":
            return cmd_train(ns)
        if ns.command == "export-parties":
            return cmd_export_parties(ns)
        if ns.command == "attack":
            from fl_split.attacks.cli import cmd_attack

            return cmd_attack(ns)
        if ns.command == "deploy":
            return cmd_deploy(ns)
        if ns.command == "audit":
            from fl_split.privacy.audit_cli import cmd_audit

            ns.argv = list(sys.argv[1:] if argv is None else argv)
            return cmd_audit(ns)
        if ns.command == "bench":
            from fl_split.bench.cli import cmd_bench

            return cmd_bench(ns)
        if ns.command == "certs":
            return cmd_certs(ns)
        if ns.command == "seed":
            return cmd_seed(ns)
        if ns.command == "predict":
            return cmd_predict(ns)
        if ns.command == "export-model":
            from fl_split.export_cli import cmd_export_model

            return cmd_export_model(ns)
        if ns.command == "flwr-run":
            return cmd_flwr_run(ns)
        if ns.command == "party-runtime":
            from fl_split.flower.warm import exit_now
            from fl_split.flower.warm import main as party_runtime

            exit_now(party_runtime(ns.supernode, poll=ns.poll, supernode_poll=ns.supernode_poll))
        if ns.command == "datasets":
            return cmd_datasets()
        if ns.command == "models":
            return cmd_models()
        parser.print_help()
        return EXIT_USAGE
    except (ConfigError, DataError, PrivateSeedError) as exc:
        print(f"fl-split: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FlSplitError as exc:
        print(f"fl-split: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("fl-split: interrupted; no results written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
