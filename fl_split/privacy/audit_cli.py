"""``fl-split audit``: the empirical privacy audit of one defence (``docs/accounting.md``, "Empirical
audit"; the analysis and runner are :mod:`fl_split.privacy.audit`).

The privacy flags are ``train``'s (``--defense``, ``--epsilon``, ``--schedule``, ``--allocation``…,
from :class:`~fl_split.config.RunConfig`); the audit adds its own (trials, releases, width,
confidence). A lower bound above an accountant's epsilon is a wrong claim: the table says
``VIOLATION``, a loud message goes to stderr, the JSON is still written (it is the evidence) and the
exit status is 1. A plug-in's row also lists its two tests (the audit's independent one, and the
plug-in's own pair and ratio when it has them), and the message names the test that flagged it.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from fl_split.errors import ConfigError

#: the RunConfig options an audit reads (the rest of ``train``'s flags do not change a release)
AUDIT_KEYS = ("defense", "defense_options", "protect", "epsilon", "delta", "sigma", "laplace_b", "clip_c", "clip_c_backward", "top_k",
              "allocation", "schedule", "accountant", "max_grad_norm", "dp_sgd_sigma")


def add_parser(sub, add_train_flags, add_private_seed) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "audit", help="empirical epsilon lower bound of a defence beside the ledger's epsilon",
        description="Release a canary record and its neighbour many times through the configured mechanism "
                    "(the factory's objects, a party secret's generators), run the likelihood-ratio test and "
                    "report the empirical epsilon lower bound (Clopper-Pearson) beside every accountant's "
                    "epsilon for the same releases. A plug-in defence is tested with the audit's own canaries and "
                    "statistics (from the public configuration), its own canary_pair/log_likelihood_ratio only in "
                    "addition. A bound above a claim exits 1 (docs/accounting.md).")
    add_train_flags(p, only=AUDIT_KEYS)
    add_private_seed(p)
    g = p.add_argument_group("audit")
    g.add_argument("--trials", type=str, default="200000",
                   help="releases of each record per audited row, a quarter to choose the test (threshold, side), "
                        "the rest to count its errors [an integer >= 100; default: 200000]")
    g.add_argument("--releases", type=str, default="1,5",
                   help="numbers of releases of the record to audit (composition), comma-separated "
                        "[integers >= 1; default: 1,5]")
    g.add_argument("--width", type=str, default="2",
                   help="cut-layer width of one record's tensor [an integer >= 1; default: 2]")
    g.add_argument("--alpha", type=str, default="0.05",
                   help="1 - family-wise confidence: shared among the rows (Bonferroni) [a number strictly between "
                        "0 and 1; default: 0.05]")
    g.add_argument("--family", dest="family", type=str, default=None,
                   help="rows that share --alpha, for a table of several commands (each row's bound at "
                        "alpha/FAMILY) [an integer >= this command's rows; default: this command's rows]")
    g.add_argument("--dpsgd-batch", dest="dpsgd_batch", type=str, default="1024",
                   help="DP-SGD canaries per step, each on its own coordinate (independent trials) "
                        "[an integer >= 1; default: 1024]")
    g.add_argument("--mis-account", dest="mis_account", type=str, default=None,
                   help="testing the audit: charge the ledger 1/F of the mechanism's real cost (a deliberate "
                        "bug the audit must flag) [a number > 1; default: off]")
    g.add_argument("--out", dest="out", metavar="A.json", default="", help="write the JSON results here")
    return p


def _int(flag: str, text: str, lo: int) -> int:
    try:
        v = int(text)
    except (TypeError, ValueError):
        raise ConfigError(flag, text, f"an integer >= {lo}") from None
    if v < lo:
        raise ConfigError(flag, text, f"an integer >= {lo}")
    return v


def _float(flag: str, text: str, ok, allowed: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise ConfigError(flag, text, allowed) from None
    if not (math.isfinite(v) and ok(v)):
        raise ConfigError(flag, text, allowed)
    return v


def options(ns: argparse.Namespace) -> dict[str, Any]:
    """The audit's own flags, checked (a specific error naming the flag before anything runs)."""
    releases = [_int("releases", ns.releases if not part.strip() else part.strip(), 1)
                for part in str(ns.releases).split(",")]
    return {"trials": _int("trials", ns.trials, 100), "releases": sorted(set(releases)),
            "width": _int("width", ns.width, 1),
            "alpha": _float("alpha", ns.alpha, lambda v: 0 < v < 1, "a number strictly between 0 and 1"),
            "batch": _int("dpsgd-batch", ns.dpsgd_batch, 1),
            "family": None if ns.family is None else _int("family", ns.family, 1),
            "mis_account": None if ns.mis_account is None else
            _float("mis-account", ns.mis_account, lambda v: v > 1, "a number > 1")}


def cmd_audit(ns: argparse.Namespace) -> int:
    from rich.progress import Progress

    from fl_split.cli_support import EXIT_FAILED, _check_out_path, _console, config_from_args
    from fl_split.privacy import audit, factory
    from fl_split.results import write_json_atomic
    from fl_split.seeding import PartySecret

    cfg = config_from_args(ns)
    opts = options(ns)
    if cfg.defense == "none":
        raise ConfigError("defense", "none", "laplace, gaussian, r3elu, rr, dpsgd or a plug-in class (nothing to audit)")
    factory.check(cfg)
    cls = factory.plugin_class(cfg)
    if cls is not None:
        from fl_split.privacy.plugin import claims_privacy

        if not claims_privacy(cls):
            raise ConfigError("defense", cfg.defense, "a defence that claims differential privacy (nothing to audit)",
                              reason="no privacy claimed: the plug-in class defines no privacy_cost")
    if not audit.directions_of(cfg):
        raise ConfigError("protect", cfg.protect, "a direction the defence covers")
    _check_out_path(ns.out)
    secret = PartySecret.for_party("audit", ns.seed_value)
    rows = len(audit.directions_of(cfg)) * len(opts["releases"])
    if opts["family"] is not None and opts["family"] < rows:
        raise ConfigError("family", ns.family, f"an integer >= this command's {rows} audited rows")
    total = audit.progress_steps(cfg, opts["releases"], opts["trials"])
    from rich.console import Console

    with Progress(console=Console(file=sys.stderr), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(f"auditing {cfg.defense}", total=max(total, 1))
        doc = audit.run_audit(cfg, width=opts["width"], releases=opts["releases"], trials=opts["trials"],
                              alpha=opts["alpha"], secret=secret, mis_account=opts["mis_account"],
                              batch=opts["batch"], progress=lambda n: bar.advance(task, n), family=opts["family"])
    doc["command"] = ("fl-split " + " ".join(ns.argv)) if getattr(ns, "argv", None) else None
    print_audit(doc, _console())
    if ns.out:
        write_json_atomic(ns.out, doc)
    if doc["violations"]:
        for r in doc["violations"]:
            claims = r["claimed_epsilon_by_accountant"]
            said = ", ".join(f"{n} {claims[n]:.4f}" for n in r["violated_accountants"])
            by = ""
            if r.get("tests"):  # a plug-in: say which test flagged it (the independent one needs no trust)
                by = " by " + " and ".join(f"the {t['test']} test ({t['statistic']}, bound "
                                           f"{t['empirical_epsilon_lower']:.4f})" for t in r["tests"] if t["violation"])
            print(f"fl-split: PRIVACY AUDIT VIOLATION: {r['mechanism']}: empirical epsilon lower bound "
                  f"{r['empirical_epsilon_lower']:.4f} exceeds the epsilon claimed by "
                  f"the ledger ({said}) at {doc['confidence']:.0%} family-wise confidence over {doc['family_rows']} "
                  f"row(s){by}: the accounting of this mechanism "
                  "is wrong", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _f(x: Any) -> str:
    if x is None:
        return "-"
    return "inf" if isinstance(x, float) and math.isinf(x) else f"{x:.3f}"


def print_audit(doc: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(title=f"privacy audit: empirical epsilon at delta={doc['delta']:g}, {doc['confidence']:.0%} "
                        f"family-wise confidence over {doc['family_rows']} row(s) (Bonferroni; paired exact "
                        "binomial test, Clopper-Pearson)")
    for col in ("mechanism", "schedule", "allocation", "releases", "trials/record", "basic", "pld", "rdp",
                "eps lower", "CI", "lower/claim", "status"):
        table.add_column(col, justify="left" if col in ("mechanism", "schedule", "allocation", "status") else "right")
    for r in doc["results"]:
        c = r["claimed_epsilon_by_accountant"]
        ci = r["empirical_epsilon_ci"]
        table.add_row(r["mechanism"], r["schedule"], r["allocation"] or "-", str(r["releases"]),
                      str(r["trials_per_record"]), _f(c.get("basic")), _f(c.get("pld")), _f(c.get("rdp")),
                      _f(r["empirical_epsilon_lower"]), f"[{_f(ci[0])}, {_f(ci[1]) if ci[1] is not None else 'inf'}]",
                      _f(r["ratio_to_claim"]),
                      "[bold red]VIOLATION[/]" if r["violation"] else
                      "[yellow]beyond reach[/]" if r.get("claim_beyond_reach") else "[green]ok[/]")
    console.print(table)
    far = [r for r in doc["results"] if r.get("claim_beyond_reach")]
    if far:  # "ok" there would read as a pass (docs/accounting.md, "Detection power")
        console.print(f"  beyond reach: {len(far)} row(s) claim more than the {_f(far[0]['max_certifiable_epsilon'])} "
                      "that any outcome of these trials can show; not flagged, and not checked either",
                      highlight=False)
    for r in doc["results"]:
        for t in r.get("tests") or []:  # a plug-in's two tests (docs/accounting.md, "A plug-in is audited independently")
            console.print(f"  {r['mechanism']}: {t['test']} test ({t['statistic']}, "
                          f"{1 - t['alpha']:.1%} confidence): eps lower {_f(t['empirical_epsilon_lower'])}"
                          f"{' [bold red]VIOLATION[/]' if t['violation'] else ''}", highlight=False)
