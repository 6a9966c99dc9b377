"""This process's descendants, read from Linux ``/proc`` (no process is ever found by name).

The in-process simulation's watchdog (:mod:`fl_split.flower.engine`) uses :func:`descendants` to
end the ClientApp actors of *its own* Ray instance that are still busy after a failed run, and
the processes of a Ray start that failed half-way (:func:`end_processes`). Starting
and stopping background services (a loopback Ray cluster, a SuperLink) is test machinery:
``tests/services.py``. :func:`exit_on_signals` is how ``fl-split train --engine flower`` stops on
Ctrl-C or SIGTERM: it ends every process this one started and exits 130 (docs/flower.md, "Failures").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Callable, Iterator


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


class DeferredInterrupt:
    """SIGTERM/SIGINT (install :meth:`handler`): recorded always, raised as KeyboardInterrupt only
    inside :meth:`interruptible` (the party runtime's ClientApp task, to cut a long task short;
    ``deploy local``'s waits, :meth:`sleep`), never while the process imports or sets up.

    Why not raise everywhere: CPython 3.11 marks the process as ended by an *unhandled*
    KeyboardInterrupt when one passes through ``exec`` of a string (``PyRun_StringFlags`` — every
    ``@dataclass`` built at import time), even if the runtime catches it later; at exit the
    interpreter then kills itself with SIGINT, so a SIGTERMed runtime reported -2 instead of 143
    about once in ten (the signal landing while ``PartyRuntime`` imported fl_split and torch), and
    an interrupted ``deploy local`` 3 times in 30 (the signal landing while it imported Flower's
    FAB builder; a KeyboardInterrupt inside a class body's ``__set_name__`` even turned into a
    RuntimeError traceback). Outside those blocks the loops check :attr:`signal` instead."""

    def __init__(self) -> None:
        self.signal = 0
        self._raising = False

    def handler(self, signum, frame) -> None:  # noqa: ARG002
        first = not self.signal
        self.signal = self.signal or signum
        if first and self._raising:  # a second signal during the clean-up is only recorded
            self._raising = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self):
        self.raise_if_stopped()
        self._raising = True
        try:
            yield
        finally:
            self._raising = False

    def raise_if_stopped(self) -> None:
        if self.signal:
            raise KeyboardInterrupt

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that a recorded or arriving signal cuts short with KeyboardInterrupt."""
        with self.interruptible():
            time.sleep(seconds)


def pids_with_env(prefix: bytes, table: dict | None = None) -> list[int]:
    """Live processes (not this one) whose environment holds a variable starting with ``prefix``
    (e.g. ``b"FLWR_HOME=/tmp/x"``): what a deployment started, whoever became their parent (a
    process whose parent died is re-parented to init and may lead a session of its own)."""
    found = []
    for pid, (state, *_rest) in (process_table() if table is None else table).items():
        if state == "Z" or pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(prefix) for v in env):
            found.append(pid)
    return found


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


def _is_raylet(cmd: str) -> bool:
    return bool(cmd) and os.path.basename(cmd.split()[0]) == "raylet"


def end_descendants(grace: float = 2.0, rounds: int = 3) -> None:
    """End every descendant of this process (:func:`end_processes`), looking again up to ``rounds``
    times: a Ray raylet may have started a worker while the first ones were being ended.

    Ray's raylet is ended last and not waited for: a Ray driver in this process shuts itself down
    with exit status 1 as soon as its raylet is gone ("Shutting down the core worker because the
    local raylet failed" — measured: 1 in 4 Ctrl-C/SIGTERM runs of the CLI exited 1 instead of
    130), so the raylet gets its SIGTERM (it ends in ≈ 0.04 s, ending its workers) only when
    everything else has ended, and the caller exits right after."""
    raylets: set[int] = set()
    for _ in range(rounds):
        table = descendants(os.getpid())
        raylets = {p for p, cmd in table.items() if _is_raylet(cmd)}
        pids = set(table) - raylets
        if not alive(pids):
            break
        end_processes(pids, grace=grace, while_waiting=_reap)
    signal_all(alive(raylets), signal.SIGTERM)


def _reap() -> None:
    """Collect this process's ended children (so they do not linger as zombies)."""
    with contextlib.suppress(ChildProcessError, OSError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


#: exit status of a run stopped by Ctrl-C / SIGTERM (128 + SIGINT, as shells report it)
EXIT_INTERRUPTED = 130


@contextlib.contextmanager
def exit_on_signals(message: str, grace: float = 2.0, settle: float = 5.0) -> Iterator[None]:
    """SIGINT or SIGTERM during the block: print ``message``, end this process's descendants, exit 130.

    On SIGINT (Ctrl-C) or SIGTERM while the block runs, ``message`` goes to stderr, every process
    this one started is ended (Ray's daemons and actors: this process's descendants, by PID — never
    by name), and the process exits at once with status 130, with no traceback.

    Why exit instead of raising ``KeyboardInterrupt``: Flower's simulation threads wait on Ray actors
    that the same Ctrl-C has killed, and Python waits for those (non-daemon) threads before it
    exits — measured: still alive 180 s later (issue 17). Nothing is half-written: the results file
    is written once, after the run, outside this block. A second signal during the clean-up is
    ignored; the clean-up is bounded (``grace`` s for SIGTERM, then SIGKILL: well under 10 s).

    A signal is seen two ways: this function's Python handler, and — because Ray's deferral can
    replace that handler and swallow the signal — a thread reading the signal's byte from
    ``signal.set_wakeup_fd``. When the block ends (with an error from the actors the clean-up is
    killing, or normally) a signal may still be on its way, its byte not yet read by that thread.
    So the block's end first puts this function's handler back (a signal from then on runs it in
    this thread, byte or no byte), stops the wakeup fd, writes a sentinel byte into the pipe and
    waits (at most ``settle`` s) until the thread has read up to the sentinel — a pipe keeps order,
    so every signal byte written before it has been seen. If a signal was seen on either path, it
    then waits for that clean-up, which exits 130; the block's own error never overtakes it. Only
    then are the caller's handlers put back: a signal after that is the caller's. Only in the main
    thread (Python delivers signals there); elsewhere the block runs unchanged."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    once = threading.Lock()
    settled = threading.Event()  # the watcher read the sentinel, or a signal is being handled

    def interrupted() -> None:
        if not once.acquire(blocking=False):  # the other path is already ending the run
            return
        settled.set()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        try:
            end_descendants(grace)
        finally:
            os._exit(EXIT_INTERRUPTED)

    def handler(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        interrupted()

    # Ray defers SIGINT inside some of its calls (DeferSigint: its own handler only notes the
    # signal, and drops it when the call then fails — as it does when the same Ctrl-C killed the
    # actors), so the run would end with the actors' error and exit 1. The wakeup fd sees every
    # signal at the C level, whichever Python handler is installed: a thread watching it ends the run.
    r, w = os.pipe()
    os.set_blocking(w, False)
    wanted = {int(signal.SIGINT), int(signal.SIGTERM)}
    sentinel = b"\0"  # no signal has number 0

    def watch() -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data:
                    return
                if wanted.intersection(data):
                    interrupted()  # does not return, unless the handler is already ending the run
                if sentinel in data:
                    settled.set()
                    return
        except OSError:
            return
        finally:
            os.close(r)

    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    threading.Thread(target=watch, name="fl_split-signal-watch", daemon=True).start()
    try:
        yield
    finally:
        # 1. our handler again (the block may have replaced it, as Ray's deferral does): a signal
        #    from now on, whether or not its byte reaches the pipe, ends the run in this thread
        for sig in saved:
            signal.signal(sig, handler)
        # 2. no more bytes into the pipe; then the sentinel after every byte already written
        signal.set_wakeup_fd(old_fd)
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            try:
                os.write(w, sentinel)
                break
            except BlockingIOError:  # a full pipe (thousands of signals): the watcher drains it
                time.sleep(0.01)
        # 3. the watcher has seen every signal that came through the pipe (or is handling one)
        settled.wait(max(0.0, deadline - time.monotonic()))
        if once.locked():
            # a signal is being handled on the other path (the watcher thread, or the handler while
            # this thread was inside Ray's deferral): the run's own ending — an error from the actors
            # that clean-up is killing, exit status 1 (measured) — must not overtake it. That path
            # ends the process with 130 once the clean-up is done.
            threading.Event().wait()
        os.close(w)  # a watcher still reading (the wait above ran out) reads end-of-file and stops
        # 4. the caller's handlers: a signal from now on is the caller's (one landing while they are
        #    put back may run either handler)
        for sig, old in saved.items():
            signal.signal(sig, old)
