"""Flower's simulation runtime in this process, made prompt (issue 18: start-up and control latency).

``flwr.simulation.run_simulation`` plays the SuperNodes' side in
``flwr.server.superlink.fleet.vce.vce_api`` (flwr 1.41): one thread moves the nodes' new messages
from the LinkState into a queue and then waits ``f_stop.wait(0.1)``; ``G + 1`` worker threads and a
reply thread wait on queues with ``get(timeout=1.0)``, only to look at the stop event once a second.
Measured on the 2-core machine (digits, 2 guests): a control message waited up to 0.1 s (0.05 s on
average) before its ClientApp saw it — once per ``train.epoch`` message, and once per setup, role
and report message — and after the ServerApp returned, the simulation took **1.0 s** to stop
(the workers' queue timeout) before Flower shut Ray down.

:func:`prompt_runtime` changes, for one in-process simulation (``fl-split train --engine flower``;
``flwr run``'s SuperLink is another process, left as it is), two waiting times and nothing else:

* the stop event handed to the runtime is wrapped so that a *timed* wait lasts at most
  :data:`DELIVERY_POLL` (0.005 s, as the coordinator polls for replies): the delivery thread looks
  for new messages 200 times a second (each look is one pass over the few undelivered messages,
  under the LinkState's lock). Measured, 4-epoch digits runs at 2 guests, three runs per process,
  two processes per value: total training 1.22–1.73 s with Flower's 0.1 s, 0.86–1.48 s with 0.005 s
  (0.01 s and 0.002 s fell in between);
* the runtime's queues cap a timed ``get`` at :data:`STOP_POLL` (0.05 s): a waiting worker sees the
  stop event within 0.05 s. A queue that has an item returns it at once, as before.

What is delivered, in which order, and to whom is unchanged. Both are substitutions of module
attributes for the duration of the block (as :func:`fl_split.flower.resources.widened_worker_pool`
does), made only when ``vce_api`` has the shape they were written against (``run_api`` taking
``f_stop``, a module-level ``Queue``); otherwise Flower's own timing is kept.
"""

from __future__ import annotations

import contextlib
import inspect
import queue
import threading
from collections.abc import Iterator

#: longest timed wait of the delivery thread (Flower's: 0.1 s), seconds
DELIVERY_POLL = 0.005
#: longest timed ``get`` of the runtime's queues (Flower's: 1.0 s), seconds
STOP_POLL = 0.05


class PromptStop:
    """The simulation's stop event, seen through a wrapper whose timed waits last at most ``poll``
    seconds (an untimed wait is not changed). Setting and reading it reach the real event, which
    Flower's ServerApp thread and ``run_simulation`` set."""

    def __init__(self, event: threading.Event, poll: float = DELIVERY_POLL) -> None:
        self.event, self.poll = event, poll

    def is_set(self) -> bool:
        return self.event.is_set()

    def set(self) -> None:
        self.event.set()

    def clear(self) -> None:
        self.event.clear()

    def wait(self, timeout: float | None = None) -> bool:
        return self.event.wait(None if timeout is None else min(timeout, self.poll))


class PromptQueue(queue.Queue):
    """A queue whose timed ``get`` waits at most :data:`STOP_POLL` seconds (its caller then loops,
    looking at the stop event first)."""

    def get(self, block: bool = True, timeout: float | None = None):
        return super().get(block, timeout if timeout is None else min(timeout, STOP_POLL))


def _shaped_as_expected(vce_api) -> bool:
    run_api = getattr(vce_api, "run_api", None)
    if not callable(run_api) or getattr(vce_api, "Queue", None) is not queue.Queue:
        return False
    try:
        return "f_stop" in inspect.signature(run_api).parameters
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def prompt_runtime(poll: float = DELIVERY_POLL) -> Iterator[bool]:
    """For the block, Flower's in-process simulation runtime delivers each message within ``poll``
    seconds and stops within :data:`STOP_POLL` seconds of the ServerApp's end; yields whether the
    substitution was made (``False``: this flwr's runtime is not the one described above)."""
    from flwr.server.superlink.fleet.vce import vce_api

    if not _shaped_as_expected(vce_api):
        yield False
        return
    original = vce_api.run_api
    signature = inspect.signature(original)

    def run_api(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["f_stop"] = PromptStop(bound.arguments["f_stop"], poll)
        return original(*bound.args, **bound.kwargs)

    vce_api.run_api, vce_api.Queue = run_api, PromptQueue
    try:
        yield True
    finally:
        vce_api.run_api, vce_api.Queue = original, queue.Queue
