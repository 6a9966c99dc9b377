"""The warm party (issue 25): one long-lived process per organisation runs every message of its node.

Flower's default (``flower-supernode --isolation subprocess``) starts a SuperExec beside the
SuperNode that, for every message, starts a fresh ``flwr-clientapp --token …`` process (flwr 1.41
``flwr/supernode/runtime/run_clientapp.py``: it handles *one* token, then ``flwr_exit``). fl_split's
ClientApp then imports torch and fl_split and rebuilds the party (models, optimizer, ledger, encoder,
data) from ``context.state`` — tens of seconds a message on a loaded machine, paid every epoch.

``fl-split party-runtime -- flower-supernode ARGS…`` replaces that pair. It starts the SuperNode with
``--isolation process`` (Flower's mode for "a separate, independent process" that runs the apps) as
its child and plays, in this one process, both roles the SuperNode no longer starts:

* **SuperExec** (``flwr/supercore/superexec/run_superexec.py``): polls the SuperNode's local Runtime
  API with ``AcquireTask`` (ClientApp tasks only), signed with a SuperExec auth secret made here
  (``--superexec-auth-secret-file``, an owner-only file that lives as long as this process): no other
  local process can acquire this node's tasks or their tokens — in subprocess isolation Flower turns
  that check off and the token is on the ``flwr-clientapp`` command line;
* **flwr-clientapp** (``run_clientapp``): for each token it pulls the task input (message, context,
  run, FAB) with the same Flower functions, sends task heartbeats, runs the ClientApp **in this
  process**, pushes the reply and the context (``PushTaskOutput``), and goes back to polling.

torch, fl_split and the live party stay loaded: :mod:`fl_split.flower.node`'s per-process cache hits
on every message after ``setup``, so nothing is restored. The party still writes its whole state to
``context.state`` after every message (pushed back to the SuperNode as before), and the write-ahead
ledger, checkpoints and private-seed handling are :mod:`fl_split.flower.node`'s, unchanged: what a
process start bought before — a party that any process can continue — still holds (a new runtime
restores from ``context.state`` as a fresh ``flwr-clientapp`` did).

The ClientApp run is fl_split's own, from the code installed on the organisation's machine
(:func:`fl_split.flower.node.make_client_app`), never code from the submitted FAB: a FAB whose
``clientapp`` is not fl_split's (``clients.client_app:app``) is refused with one line in the error
reply. ``setup``'s checks decide whether the job's options are compatible, as before.

Lifetime: the runtime and its SuperNode end together. The SuperNode is started in the runtime's
session and (on Linux) with a parent-death signal; when the SuperNode exits the runtime exits with
its code; SIGTERM/SIGINT to the runtime ends the SuperNode (SIGTERM, then SIGKILL after
``grace``); if the runtime's loop fails it ends the SuperNode and exits with one line, so a
deployment never keeps a node that accepts messages nobody answers.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from io import BytesIO
from pathlib import Path
from typing import Callable

# short_object_waits / PULL_BACKOFF live in a leaf module: the ServerApp's transport uses them too,
# and importing this module from there would close an import circle (warm -> node -> … -> transport)
from fl_split.flower.objectwaits import PULL_BACKOFF, short_object_waits
from fl_split.flower.processes import DeferredInterrupt

#: seconds between ``AcquireTask`` polls (Flower's SuperExec default: 1.0)
POLL_INTERVAL = 0.05
#: an idle runtime's polls space out to this (seconds): its SuperNode hears of a new message only
#: every :data:`SUPERNODE_POLL` s, so faster polls would only spend both processes' CPU
IDLE_POLL_CAP = 0.2
#: seconds between the SuperNode's polls of the SuperLink when idle, and of its local state for a
#: reply (flwr 1.41 ``start_client_internal``: a fixed ``time.sleep(3)`` / ``time.sleep(0.5)``)
SUPERNODE_POLL = 0.25
#: the ClientApp reference a FAB must name to be run here (pyproject.toml ``[tool.flwr.app.components]``)
CLIENTAPP_REF = "clients.client_app:app"

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _PollClock:
    """The ``time`` module as :mod:`flwr.supernode.start_client_internal` sees it, with every sleep
    cut to ``poll`` seconds: the SuperNode loop's only use of ``time`` is those fixed waits."""

    def __init__(self, poll: float) -> None:
        self.poll = poll

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.poll))

    def __getattr__(self, name: str):
        return getattr(time, name)


#: seconds between the SuperNode's heartbeats (Flower's default 30, its minimum 10): the SuperLink
#: holds a node online until two intervals pass without one, so a restarted node is refused that long
NODE_HEARTBEAT = 10
#: how long a refused activation is retried (seconds): past two heartbeat intervals, a refusal is no
#: longer a previous start still held online but a key the SuperLink does not know
ACTIVATION_WINDOW = 2 * NODE_HEARTBEAT + 8
#: Flower's error code of a refused ``ActivateNode`` (flwr 1.41 ``FLEET_NODE_ACTIVATION_FAILED``)
ACTIVATION_REFUSED = 2004


def _say(line: str) -> None:
    print(f"party-runtime: {line}", file=sys.stderr, flush=True)


def patient_activation(client_cls, superlink: str, window: float = ACTIVATION_WINDOW, pause: float = 2.0) -> None:
    """Make ``client_cls.ActivateNode`` (Flower's Fleet HTTP client) tell a restarted node, an unknown
    key and an unreachable SuperLink apart, in words (docs/deploy.md, "A party restarts"): a refusal
    (Flower's code 2004, the same for both of the first two) is retried every ``pause`` s for up to
    ``window`` s — a previous start of this node, held online until two heartbeats are missed, expires
    in that time and the node rejoins — and then reported as a key the SuperLink has not registered;
    a transport error is said once as the SuperLink unreachable (Flower keeps retrying it)."""
    import httpx
    from flwr.supercore.error.base import FlowerError

    original = client_cls.ActivateNode
    unreachable_said = [False]

    def activate(self, request):
        deadline, told = time.monotonic() + window, False
        while True:
            try:
                return original(self, request)
            except httpx.TransportError as exc:
                if not unreachable_said[0]:
                    unreachable_said[0] = True
                    _say(f"cannot reach the SuperLink at {superlink} ({type(exc).__name__}: {exc}): is it started, "
                         "and does this machine reach that address and port? retrying")
                raise
            except httpx.HTTPStatusError as exc:
                error = FlowerError.from_json(exc.response.text)
                if error is None or error.code != ACTIVATION_REFUSED:
                    raise
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"the SuperLink at {superlink} refused this SuperNode for {window:.0f} s: it has no "
                        "registered public key for it (the coordinator registers outbox/auth-<party>.pub with "
                        "`sh run.sh register`)") from None
                if not told:
                    told = True
                    _say(f"the SuperLink refused to activate this SuperNode: it still holds this node online from "
                         f"its previous start (it does so until {2 * NODE_HEARTBEAT} s pass without a heartbeat), or "
                         f"its key is not registered; retrying every {pause:g} s for up to {window:.0f} s")
                time.sleep(pause)

    client_cls.ActivateNode = activate


def supernode(argv: list[str], poll: float = SUPERNODE_POLL) -> None:
    """``flower-supernode ARGV`` in this process, polling the SuperLink every ``poll`` s when idle
    (and its state for a reply every ``poll`` s) instead of Flower's fixed 3 s (0.5 s): one message
    costs up to 3.5 s of waiting otherwise, a warm party's whole epoch on a small table. The price:
    an idle node asks the SuperLink ``1/poll`` times a second instead of once in 3 s. Its heartbeat
    is :data:`NODE_HEARTBEAT` s and a refused activation is retried (:func:`patient_activation`), so a
    node restarted after a crash rejoins within seconds."""
    import flwr.supernode.fleet_http_connection as fleet
    import flwr.supernode.start_client_internal as loop
    from flwr.supernode.cli.flower_supernode import flower_supernode
    from flwr.supernode.fleet_http_client import FleetHttpClient

    loop.time = _PollClock(poll)  # type: ignore[assignment]
    short_object_waits(loop)  # a message's objects the ServerApp is still pushing to the SuperLink
    import flwr.supercore.heartbeat as beat

    # the interval the node announces and the one its sender keeps (flwr 1.41 reads both module globals)
    fleet.HEARTBEAT_DEFAULT_INTERVAL = beat.HEARTBEAT_DEFAULT_INTERVAL = NODE_HEARTBEAT  # type: ignore[attr-defined]
    superlink = next((b for a, b in zip(argv, argv[1:]) if a == "--superlink"), "its --superlink address")
    patient_activation(FleetHttpClient, superlink)
    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


def runtime_address(supernode_args: list[str]) -> str:
    """``HOST:PORT`` of the SuperNode's Runtime API from its ``--host``/``--port`` (Flower's defaults
    127.0.0.1 and 9094); a wildcard host is reached on loopback."""
    from flwr.supercore.constant import SUPERNODE_UVICORN_DEFAULT_PORT, UVICORN_DEFAULT_HOST

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default=UVICORN_DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=SUPERNODE_UVICORN_DEFAULT_PORT)
    parser.add_argument("--isolation")
    known, _ = parser.parse_known_args(supernode_args)
    if known.isolation not in (None, "process"):
        from fl_split.errors import ConfigError

        raise ConfigError("isolation", known.isolation, "'process' (or leave it out)",
                          reason="party-runtime runs the SuperNode's ClientApps itself")
    host = "127.0.0.1" if known.host in ("0.0.0.0", "", "::") else known.host
    return f"[{host}]:{known.port}" if ":" in host else f"{host}:{known.port}"


def fab_clientapp(fab_content: bytes) -> str:
    """The ``clientapp`` reference a FAB's ``pyproject.toml`` names ('' if none)."""
    with zipfile.ZipFile(BytesIO(fab_content)) as zf:
        conf = tomllib.loads(zf.read("pyproject.toml").decode("utf-8"))
    return str(conf.get("tool", {}).get("flwr", {}).get("app", {}).get("components", {}).get("clientapp", ""))


def quiet_retry_invoker(max_tries: int | None, max_time: float | None):
    """A retry invoker for the Runtime API that retries what Flower's does (transport errors, HTTP
    502/503/504) and raises everything else to its caller.

    Flower's ``make_simple_http_retry_invoker`` answers an HTTP 401 by sending SIGINT *to this
    process* and sleeping (flwr 1.41 ``supercore/retry/http_retry.py``): right for a one-shot
    ``flwr-clientapp``, wrong for a long-lived runtime, whose SuperNode answers 401 while it shuts
    down. Here a 401 is an exception like any other; :meth:`PartyRuntime.serve` decides."""
    import httpx
    from flwr.supercore.retry.retry_invoker import RetryInvoker, exponential

    retryable = {httpx.codes.BAD_GATEWAY, httpx.codes.SERVICE_UNAVAILABLE, httpx.codes.GATEWAY_TIMEOUT}

    def giveup(exc: Exception) -> bool:
        return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code not in retryable

    return RetryInvoker(wait_gen_factory=lambda: exponential(base_delay=0.1, max_delay=2),
                        recoverable_exceptions=(httpx.TransportError, httpx.HTTPStatusError),
                        max_tries=max_tries, max_time=max_time, should_giveup=giveup)


def pull_task_input(client, marks: dict | None = None):
    """Flower's ``run_clientapp.pull_task_input`` (the task's context, run and FAB, then its
    message), with a short first wait for objects the SuperNode is still pulling."""
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf, make_pull_object_fn_protobuf)
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    if marks is not None:
        marks["input"] = time.monotonic()
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("no message for this task in the SuperNode's Runtime API")
    node, tree = Node(node_id=context.node_id), pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=PULL_BACKOFF, backoff_cap=0.5, max_tries_per_object=None)
    message.metadata.__dict__["_message_id"] = tree.object_id  # a deflated message lacks its own ID
    return message, context, run, fab


class PartyRuntime:
    """SuperExec + in-process ClientApp for one SuperNode's Runtime API (module docstring)."""

    def __init__(self, address: str, secret: bytes | None, app=None, poll: float = POLL_INTERVAL,
                 log: Callable[[str], None] | None = None) -> None:
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
        from flwr.supercore.runtime import RuntimeHttpClient

        self.address, self.poll = address, poll
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        if app is None:
            from fl_split.flower.node import make_client_app

            app = make_client_app()
        self.app = app
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if secret:
            interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret,
                                                             protected_methods={"/flwr.proto.Runtime/AcquireTask"}))
        self.invoker = quiet_retry_invoker(max_tries=3, max_time=None)
        self.client = RuntimeHttpClient.from_server_address(server_address=address, insecure=True,
                                                            root_certificates=None, interceptors=interceptors,
                                                            retry_invoker=self.invoker)
        self.handled = 0
        self.interruptible: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def acquire(self) -> str | None:
        """One ``AcquireTask`` poll: a ClientApp task's token, or None."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.constant import TaskType

        res = self.client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value],
                                                         agentapp_fab_hashes=[]))
        return res.token if res.HasField("task") and res.token else None

    def run_task(self, token: str) -> dict[str, float]:
        """What ``flwr-clientapp --token TOKEN`` does, in this process, without exiting; returns the
        message's timeline (seconds: pull, app, push)."""
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        # a SuperNode that cannot be reached for a minute is gone: give up rather than hang the runtime
        invoker = quiet_retry_invoker(max_tries=None, max_time=60.0)
        client = RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=True, root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                          RuntimeTokenHttpInterceptor(token)], retry_invoker=invoker)
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        message = reply = context = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        marks = {"start": time.monotonic()}
        mtype = "?"
        try:
            heartbeat.start()
            message, context, _run, fab = pull_task_input(client, marks)
            mtype = message.metadata.message_type
            marks["pulled"] = time.monotonic()
            ref = fab_clientapp(fab.content)
            if ref != CLIENTAPP_REF:
                raise RuntimeError(f"party-runtime runs fl_split's ClientApp only; the submitted app names "
                                   f"clientapp={ref!r}, allowed: {CLIENTAPP_REF!r}")
            with self.interruptible():
                reply = self.app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as exc:  # noqa: BLE001 - reported to the ServerApp, as flwr-clientapp does
            details = f"{type(exc)}:<'{exc}'>"
            self.log(f"party-runtime: task failed: {type(exc).__name__}: {exc}")
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                                reply_to=message)
        finally:
            marks["app"] = time.monotonic()
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
            finally:
                invoker.max_tries = 1
                push_task_output(client=client, context=context, sub_status=status, details=details)
                if heartbeat.is_running:
                    heartbeat.stop()
                client.close()
            marks["pushed"] = time.monotonic()
        self.handled += 1
        t = {"pull": marks.get("pulled", marks["app"]) - marks["start"],
             "input": marks.get("input", marks["start"]) - marks["start"],
             "app": marks["app"] - marks.get("pulled", marks["app"]), "push": marks["pushed"] - marks["app"]}
        self.log(f"party-runtime: message {self.handled} ({mtype}): pull {t['pull']:.3f} s, "
                 f"app {t['app']:.3f} s, push {t['push']:.3f} s (pull: context + FAB {t['input']:.3f} s)")
        return t

    def serve(self, alive: Callable[[], bool]) -> None:
        """Poll and run tasks while ``alive()``: every :attr:`poll` s after a task, spacing out to
        :data:`IDLE_POLL_CAP` while none comes."""
        wait = self.poll
        while alive():
            try:
                token = self.acquire()
            except Exception:  # noqa: BLE001 - the SuperNode may be going away: look before raising
                if not alive():
                    return
                raise
            if token is not None:
                self.run_task(token)
                wait = self.poll
            else:
                time.sleep(wait)
                wait = min(wait * 1.5, max(self.poll, IDLE_POLL_CAP))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


def add_parser(sub) -> None:
    """``fl-split party-runtime`` on the CLI's subcommand parsers."""
    rt = sub.add_parser("party-runtime", help="run a SuperNode with its party warm in one long-lived process",
                        description="Start `flower-supernode ARGS` with --isolation process and run every ClientApp "
                                    "task of it in this process (torch, fl_split and the party stay loaded) until "
                                    "the SuperNode ends (docs/deploy.md, \"The warm party\").")
    rt.add_argument("--poll", type=float, default=POLL_INTERVAL, metavar="S",
                    help=f"seconds between task polls [default: {POLL_INTERVAL}]")
    rt.add_argument("--supernode-poll", type=float, default=SUPERNODE_POLL, metavar="S",
                    help="seconds between the SuperNode's polls of the SuperLink when idle (Flower's own: 3; "
                         f"3 runs Flower's flower-supernode unchanged) [default: {SUPERNODE_POLL}]")
    rt.add_argument("supernode", nargs=argparse.REMAINDER, metavar="-- flower-supernode ARGS")


def _wait_port(address: str, alive: Callable[[], bool], timeout: float = 120.0) -> bool:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1.0):
            return True
        time.sleep(0.1)
    return False


def _end(proc: subprocess.Popen, grace: float) -> int:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    return proc.returncode


def exit_now(code: int) -> None:
    """End the runtime's process with ``code`` at once, without the interpreter's finalisation.

    Measured: a runtime whose :func:`main` had returned took another 2.6–3.8 s to exit, in native
    code (``faulthandler`` one second in showed no Python frame and no other thread: the gRPC and
    torch libraries' shutdown), and a deployment waits for its nodes at every end. Nothing is lost by
    skipping it: each message's state was pushed to the SuperNode when the message ended, the ledger's
    log and the checkpoints are fsynced as they are written (a SIGKILLed runtime resumes,
    tests/test_warm.py), and the log handlers and standard streams are flushed here."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(supernode_args: list[str], poll: float = POLL_INTERVAL, grace: float = 10.0,
         supernode_poll: float = SUPERNODE_POLL) -> int:
    """``fl-split party-runtime -- flower-supernode ARGS…``: start the SuperNode with
    ``--isolation process`` and serve its ClientApp tasks here until it ends (module docstring);
    returns the exit code (the SuperNode's, or 1 with one line if the runtime failed)."""
    from fl_split.errors import ConfigError

    args = list(supernode_args)
    if args and args[0] == "--":
        args = args[1:]
    if not args or Path(args[0]).name != "flower-supernode":
        raise ConfigError("party-runtime", " ".join(args[:1]) or "no command",
                          "-- flower-supernode ARGS… (the SuperNode it serves)")
    if any(a == "--superexec-auth-secret-file" or a.startswith("--superexec-auth-secret-file=") for a in args):
        raise ConfigError("superexec-auth-secret-file", "given", "left out",
                          reason="the runtime makes a fresh secret per start")
    for key, value in (("poll", poll), ("supernode-poll", supernode_poll)):
        if not 0 < value <= 60:
            raise ConfigError(key, value, "seconds, more than 0 and at most 60")
    address = runtime_address(args[1:])
    if "--isolation" not in args:
        args += ["--isolation", "process"]
    # the SuperExec auth secret: fresh per start, in an owner-only file only this user can read,
    # removed when the runtime ends (the SuperNode reads it once at start-up)
    secret_dir = Path(tempfile.mkdtemp(prefix="fl-split-runtime-"))
    os.chmod(secret_dir, 0o700)
    secret = secrets.token_bytes(32)
    secret_file = secret_dir / "superexec-secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret)
    args += ["--superexec-auth-secret-file", str(secret_file)]

    stop = DeferredInterrupt()
    previous = {s: signal.signal(s, stop.handler) for s in (signal.SIGTERM, signal.SIGINT)}
    if supernode_poll < 3:  # Flower's SuperNode with shorter waits (supernode()); 3: Flower's own binary
        args = [sys.executable, "-m", "fl_split.flower.warm", "--supernode-poll", repr(supernode_poll), *args[1:]]
    proc = subprocess.Popen(args, preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    print(f"party-runtime: pid {os.getpid()} serves the ClientApp tasks of SuperNode pid {proc.pid} "
          f"(Runtime API {address}, isolation process): one process, the party stays loaded", file=sys.stderr,
          flush=True)
    runtime = None
    code = 0
    try:
        alive = lambda: proc.poll() is None and not stop.signal  # noqa: E731
        if not _wait_port(address, alive):
            stop.raise_if_stopped()
            raise RuntimeError(f"the SuperNode's Runtime API {address} did not open" + (
                f" (the SuperNode exited with code {proc.returncode})" if proc.poll() is not None else " in 120 s"))
        secret_file.unlink()  # read by the SuperNode at start-up; the runtime keeps it in memory
        runtime = PartyRuntime(address, secret, poll=poll)
        runtime.interruptible = stop.interruptible
        runtime.serve(alive)
        stop.raise_if_stopped()
        code = proc.wait()
        code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
        print(f"party-runtime: the SuperNode exited with code {code}; {runtime.handled} messages served",
              file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        code = 128 + (stop.signal or signal.SIGINT)
    except Exception as exc:  # noqa: BLE001 - one line; the SuperNode must not outlive its runtime
        print(f"party-runtime: failed: {type(exc).__name__}: {exc}; ending the SuperNode", file=sys.stderr,
              flush=True)
        code = 1
    finally:
        if runtime is not None:
            runtime.close()
        _end(proc, grace)
        for s, h in previous.items():
            signal.signal(s, h)
        with contextlib.suppress(OSError):
            secret_file.unlink()
        with contextlib.suppress(OSError):
            secret_dir.rmdir()
    return code


if __name__ == "__main__":  # the SuperNode process main() starts: python -m fl_split.flower.warm --supernode-poll S ARGS
    _argv = sys.argv[1:]
    _poll = SUPERNODE_POLL
    if _argv[:1] == ["--supernode-poll"]:
        _poll, _argv = float(_argv[1]), _argv[2:]
    supernode(_argv, _poll)
