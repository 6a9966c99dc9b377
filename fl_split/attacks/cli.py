"""``fl-split attack``: train with the given flags, mount an attack as the party that would, score it.

Every ``train`` flag is accepted (the same :class:`~fl_split.config.RunConfig`), plus
``--private-seed`` and the attack's own options (:class:`~fl_split.attacks.options.AttackOptions`).
Bad input gets one line naming the flag, the value and what is allowed, exit code 2, and no file
(every check runs before training; the JSON is written once, atomically, at the end).

This module imports nothing heavy at import time: ``fl-split --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

PREFIX = "attack_opt_"


def add_parser(sub, add_train_flags, add_private_seed) -> argparse.ArgumentParser:
    """Register the ``attack`` subcommand on ``sub`` (the ``fl-split`` subparsers)."""
    from fl_split.attacks.options import AUTO, flag, option_fields

    p = sub.add_parser(
        "attack", help="train, then mount an attack as the party that would (docs/attacks.md)",
        description="Run the configured training (every train flag), mount --attack as its adversary on what "
                    "that party legitimately holds, and print the attack's metric beside a trivial baseline.")
    add_train_flags(p)
    add_private_seed(p)
    g = p.add_argument_group("attack (docs/attacks.md)")
    for f in option_fields():
        meta = f.metadata
        default = "" if f.default == "" else f.default
        g.add_argument(flag(f.name), dest=PREFIX + f.name, metavar=f.name.replace("_", "-").upper(),
                       default=argparse.SUPPRESS, required=f.name == "attack",
                       help=f"{meta['help']} [{meta['allowed']}; default: {default if default != AUTO else 'auto'}]")
    return p


def options_from_args(ns: argparse.Namespace):
    from fl_split.attacks.options import options_from_mapping

    return options_from_mapping({k[len(PREFIX):]: v for k, v in vars(ns).items() if k.startswith(PREFIX)})


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.4f}"
    return str(x)


def print_attack_summary(result: dict[str, Any]) -> None:
    from rich.table import Table

    from fl_split.cli_support import _console

    console = _console()
    cfg = result["training"]["config"]
    title = (f"{result['title']} · {result['adversary']} attacks {result['victim']} · {cfg['dataset']} · defense "
             f"{cfg['defense']}" + (f" ({cfg['protect']})" if cfg["defense"] != "none" else "")
             + (f" · denoise {cfg['denoise']} {cfg['denoise_param']:g}" if cfg["denoise"] != "none" else ""))
    table = Table(title=title, title_justify="left")
    for col in ("metric", "attack", "baseline", "better", "baseline is"):
        table.add_column(col, justify="right" if col in ("attack", "baseline") else "left")
    table.add_row(result["metric"], _fmt(result["value"]), _fmt(result["baseline"]), result["better"],
                  result["baseline_name"])
    d = result["details"]
    for key in ("ssim", "psnr", "auc", "mse_pm1"):
        if isinstance(d.get(key), float):
            table.add_row(key, _fmt(d[key]), _fmt(d.get(f"baseline_{key}")), "higher" if key != "mse_pm1" else "lower",
                          "same baseline guess" if f"baseline_{key}" in d else "-")
    console.print(table)
    final = result["final"]
    value = "none (no task model)" if final.get("value") is None else f"{final['value']:.4f}"
    console.print(f"threat model: {result['threat_model'].get('summary') or '; '.join(result['threat_model']['holds'])}")
    console.print(f"training: final test {final['metric']} {value}; attack took {result['time_s']['attack']:.1f} s "
                  f"after {result['time_s']['training']:.1f} s of training")


def cmd_attack(ns: argparse.Namespace) -> int:
    from fl_split.attacks.images import check_grid_path
    from fl_split.cli_support import _check_out_path, _show_party_warnings, config_from_args
    from fl_split.results import write_json_atomic

    cfg = config_from_args(ns)
    _check_out_path(cfg.out)
    opts = options_from_args(ns)
    check_grid_path(opts.grid)
    from fl_split.attacks.runner import run_attack

    _show_party_warnings()
    result = run_attack(cfg, opts, private_seed=ns.seed_value)
    if cfg.out:
        write_json_atomic(cfg.out, result)
    print_attack_summary(result)
    if opts.grid and result["details"].get("image"):
        print(f"image grid written to {opts.grid}")
    if cfg.out:
        print(f"attack results written to {cfg.out}")
    return 0
