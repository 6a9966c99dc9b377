"""This process's descendants, read from Linux ``/proc`` (no process is ever found by name).

The in-process simulation's watchdog (:mod:`fl_split.flower.engine`) uses :func:`descendants` to
end the ClientApp actors of *its own* Ray instance that are still busy after a failed run, and
the processes of a Ray start that failed half-way (:func:`end_processes`). Starting
and stopping background services (a loopback Ray cluster, a SuperLink) is test machinery:
``tests/services.py``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable


def process_table(cmdline: bool = False) -> dict[int, tuple[str, int, int, str]]:
    """``{pid: (state, parent pid, session id, command line)}`` of every process (Linux ``/proc``);
    the command line is read only when ``cmdline`` (else ``""``). Processes that exit while the
    table is read are left out."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                # fields after the parenthesised command: state ppid pgrp session ...
                rest = fh.read().decode("utf-8", "replace").rsplit(")", 1)[-1].split()
            cmd = ""
            if cmdline:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            table[int(entry)] = (rest[0], int(rest[1]), int(rest[3]), cmd)
        except (OSError, IndexError, ValueError):
            continue
    return table


def descendants(root: int) -> dict[int, str]:
    """``{pid: command line}`` of every descendant of ``root``."""
    table = process_table(cmdline=True)
    out: dict[int, str] = {}
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, (_, parent, _, cmd) in table.items():
            if parent == p and child not in out:
                out[child] = cmd
                frontier.append(child)
    return out


def alive(pids: set[int]) -> set[int]:
    """The members of ``pids`` that still run (zombies count as ended)."""
    table = process_table()
    return {p for p in pids if p in table and table[p][0] != "Z"}


def signal_all(pids: set[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``; those already gone (or not ours) are skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_processes(pids: set[int], grace: float = 5.0, while_waiting: Callable[[], None] | None = None) -> None:
    """SIGTERM ``pids``, wait up to ``grace`` seconds, SIGKILL those still running and wait up to 5 s
    for them to go. ``while_waiting`` is called on every poll (a parent reaping its children there
    lets them leave the table at once instead of lingering as zombies)."""
    def wait(seconds: float, interval: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and alive(pids):
            if while_waiting is not None:
                while_waiting()
            time.sleep(interval)

    signal_all(pids, signal.SIGTERM)
    wait(grace, 0.05)
    signal_all(alive(pids), signal.SIGKILL)
    wait(5.0, 0.05)
