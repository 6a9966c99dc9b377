"""One ``flwr`` process for the many ``flwr`` commands of a deployment.

A loopback deployment runs ``flwr supernode register`` once per party, ``flwr run --stream`` and
``flwr ls`` (the outcome): five or more ``flwr`` commands. Each used to be a fresh process that
spends ~1.5 s of CPU importing Flower's CLI before it sends one request (measured on this 2-core
machine: ``flwr --help`` 1.54 s). :class:`FlwrCli` starts **one** such process
(``python -m fl_split.flower.flwrcli``) and hands it each command in turn; the process runs it through
Flower's own CLI (``flwr.cli.app.app``, exactly what the ``flwr`` script calls, with the same
``sys.argv``), so output, JSON, errors and exit codes are the command's own.

Protocol (stdin/stdout of the helper, one command at a time): the client writes a JSON array (the
arguments after ``flwr``) as one line; the helper runs it, flushes, and writes the end marker
``<token> <exit code>`` on a line of its own. The token is random per helper (environment
``FL_SPLIT_FLWR_END``), so no output of a command can fake the end of it. Standard error is merged
into standard output, as ``deploy`` always read it. A command must not read standard input (none
of ``register``, ``run``, ``ls`` does): the helper's is the command stream.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["FlwrCli", "FlwrCommand"]

END = "FL_SPLIT_FLWR_END"
_EOF = object()


class FlwrCommand:
    """One command running in a :class:`FlwrCli`: the part of :class:`subprocess.Popen` the deployment
    reads (``stdout`` as lines, ``poll``, ``wait``, ``returncode``)."""

    def __init__(self, cli: "FlwrCli") -> None:
        self._cli, self.returncode = cli, None

    @property
    def stdout(self) -> Iterator[str]:
        """The command's output lines (with their newlines), up to its end marker."""
        blank = None  # the helper writes a newline before the end marker: dropped if nothing follows it
        while self.returncode is None:
            item = self._cli._lines.get()
            if item is _EOF:  # the helper died: the command ends with the helper's status
                self._cli._lines.put(_EOF)  # later commands see it too
                self.returncode = self._cli.proc.wait()
                self._cli._busy = False
                return
            code = self._cli._end_code(item)
            if code is not None:
                self.returncode = code
                self._cli._busy = False
                return
            if blank is not None:
                yield blank
                blank = None
            if item == "\n":
                blank = item
            else:
                yield item

    def poll(self) -> int | None:
        return self.returncode

    def communicate(self, timeout: float | None = None) -> str:
        """The rest of the output, once the command has ended (TimeoutExpired after ``timeout``)."""
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.extend(self.stdout), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired("flwr", timeout or 0)
        return "".join(out)

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (the rest of the output is read and dropped)."""
        self.communicate(timeout)
        return self.returncode  # type: ignore[return-value]


class FlwrCli:
    """A long-lived ``flwr`` CLI process (module docstring); commands run one after the other.
    ``own_session``: in a session of its own, out of reach of a Ctrl-C at the terminal (``deploy
    local`` adds :attr:`proc` to its :class:`~fl_split.deploy.ProcessGroup`, which ends it with the
    rest); else it shares the caller's, as a ``flwr`` command would (a kit's ``run.sh``)."""

    def __init__(self, env: dict[str, str], cwd: Path, umask: int = -1, own_session: bool = True) -> None:
        self.token = secrets.token_hex(16)
        self.proc = subprocess.Popen([sys.executable, "-m", "fl_split.flower.flwrcli"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**env, END: self.token}, cwd=cwd, start_new_session=own_session,
                                     umask=umask)
        self._lines: queue.Queue = queue.Queue()
        self._busy = False
        threading.Thread(target=self._read, daemon=True, name="flwr-cli-reader").start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._lines.put(line)
        self._lines.put(_EOF)

    def _end_code(self, line: str) -> int | None:
        words = line.split()
        if len(words) == 2 and words[0] == self.token:
            return int(words[1])
        return None

    def start(self, *args: str) -> FlwrCommand:
        """Start ``flwr ARGS`` (the previous command must have ended)."""
        if self._busy:
            raise RuntimeError("flwr helper: a command is still running")
        self._busy = True
        try:
            self.proc.stdin.write(json.dumps(list(args)) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            pass  # the helper is gone: the command reads its end (EOF) at once
        return FlwrCommand(self)

    def run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """``flwr ARGS`` to its end: like ``subprocess.run(capture_output=True, text=True)`` (the
        output in ``stdout``, ``stderr`` empty: merged). On ``timeout`` the helper is killed (a
        command that hangs cannot be interrupted inside it) and TimeoutExpired raised."""
        cmd = self.start(*args)
        try:
            out = cmd.communicate(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()  # ended for whoever looks next (a deployment then starts another)
            raise subprocess.TimeoutExpired(["flwr", *args], timeout) from None
        return subprocess.CompletedProcess(["flwr", *args], cmd.returncode or 0, out, "")

    def __enter__(self) -> "FlwrCli":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the helper: at once if a command is still running (the caller is leaving it), else
        by closing its input."""
        if self._busy:
            self.proc.kill()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with for ``exc`` (a message is printed, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def main() -> None:
    """The helper: run each command line read from stdin through Flower's CLI (module docstring)."""
    import traceback

    token = os.environ.pop(END)
    from flwr.cli.app import app

    for raw in sys.stdin:
        args = json.loads(raw)
        sys.argv = ["flwr", *args]  # Flower's CLI also reads sys.argv (its --format json check)
        try:
            app(args=args, prog_name="flwr")
            code = 0
        except SystemExit as exc:  # every command ends here: Click's standalone mode exits
            code = _exit_code(exc)
        except BaseException:  # noqa: BLE001 - a crash of one command is its exit status 1, as in `flwr`
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout.write(f"\n{token} {code}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
