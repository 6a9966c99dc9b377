"""What the ``fl-split`` subcommands share: exit codes, flags → :class:`RunConfig`, the ``--out``
check, the console and the parties' warnings on stderr.

One-way layers (docs/design.md): :mod:`fl_split.cli` and the subcommands it registers
(:mod:`fl_split.attacks.cli`, :mod:`fl_split.privacy.audit_cli`) import this module; it imports
none of them, so no subcommand imports the top-level CLI back.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fl_split.config import RunConfig, coerce, option_fields
from fl_split.errors import ConfigError

EXIT_USAGE = 2
EXIT_FAILED = 1


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    """Turn parsed flags (strings) into a validated :class:`RunConfig`."""
    fields = {f.name: f for f in option_fields()}
    values: dict[str, Any] = {}
    for name, raw in vars(ns).items():
        if name in fields:
            if isinstance(raw, list):  # an appending flag (--data, --encode)
                raw = ";".join(raw)
            values[name] = raw if isinstance(raw, bool) else coerce(fields[name], raw)
    if values.get("data"):  # which flags were given matters with --data (--dataset, --guests)
        from fl_split.data.own import check_given_flags

        check_given_flags(values)
    return RunConfig(**values)


def _check_out_path(path: str) -> None:
    if not path:
        return
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ConfigError("out", path, "a file path in an existing directory", reason=f"{parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError("out", path, "a file path in a writable directory", reason=f"{parent} is not writable")
    if Path(path).is_dir():
        raise ConfigError("out", path, "a file path (not a directory)")


def _console():
    """A rich console; when the output is not a terminal (piped, redirected, CI logs) tables get
    the width they need instead of rich's 80-column default, which cuts names short."""
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def _show_party_warnings() -> None:
    """Print the parties' own warnings (e.g. "releases are mostly noise") on stderr: in the local
    engine every party runs in this process, so its log is this console."""
    import logging

    class StderrHandler(logging.StreamHandler):
        """Writes to whatever ``sys.stderr`` is when a record comes (as logging's last-resort handler
        does): a party thread that logs after its caller swapped stderr back (a test's capture) must
        not write into a closed file."""

        @property  # type: ignore[override]
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, _value) -> None:
            pass

    log = logging.getLogger("fl_split")
    if not any(getattr(h, "_fl_split_cli", False) for h in log.handlers):
        handler = StderrHandler()
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("fl-split: warning: %(message)s"))
        handler._fl_split_cli = True  # type: ignore[attr-defined]
        log.addHandler(handler)
