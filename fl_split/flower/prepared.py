"""Each simulated party's data, prepared once by the simulation's driver (issue 18: start-up).

Before, every ClientApp actor of ``fl-split train --engine flower`` prepared the whole dataset
itself (:func:`fl_split.builder.prepare_data`: load, split the shared IDs, partition the columns,
align and encode every party's slice) and kept one party's slice: ``G + 1`` times the same work,
on the same shared cores, and every actor held every party's data. The driver prepares the data
anyway (:meth:`fl_split.flower.engine.FlowerEngine.check` plans the run), so now it hands each
party **its own slice** through Ray's object store (:class:`Handoff`, one object per party and
data configuration) and a simulated node is built the way a deployment node is built from its
party file (``docs/deploy.md``): from its own :class:`~fl_split.data.base.PartyData` and the run's
public facts (:class:`~fl_split.party_files.PublicFacts`: a guest's carry no number of classes),
the plan from those facts (:func:`fl_split.party_files.plan_from_facts`, identical to
:func:`fl_split.builder.plan_run` on the full data). The data are the very objects the actor
would have computed (the same function on the same configuration, pickled): the parties are
bit-identical (``tests/test_flower_startup.py``).

What a party may see does not change for the worse: in a simulation whoever runs it runs every
party (``docs/flower.md``, "Trust root"); an actor now fetches only the slices of the nodes it
serves (a Ray actor serves whichever node's message comes next) instead of computing all of them.

A configuration the handoff does not cover — one-shot runs (their pretraining reads the public
records of every party), a node whose configuration differs from the driver's (``flwr run``
simulations, which have no driver here) — is prepared by the node itself, as before
(:meth:`Handoff.fetch` returns ``None``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from fl_split.config import RunConfig


@dataclass(frozen=True)
class PreparedParty:
    """One party's slice of a run's data and the public facts it may know."""

    data: Any    # fl_split.data.base.PartyData
    facts: Any   # fl_split.party_files.PublicFacts (a guest's: without the number of classes)


def data_key(cfg: RunConfig) -> tuple:
    """What :func:`fl_split.builder.prepare_data` depends on (its cache key)."""
    from fl_split.builder import _data_key

    return _data_key(cfg)


def covered(cfg: RunConfig) -> bool:
    """Whether a simulated party of ``cfg`` can be built from a handed-over slice (one-shot
    pretraining reads every party's public records, so its parties prepare the data themselves)."""
    return not cfg.one_shot


def prepare_parties(cfg: RunConfig) -> dict[str, PreparedParty]:
    """Every party's :class:`PreparedParty` for ``cfg`` (the driver's side)."""
    from fl_split.builder import prepare_data
    from fl_split.party_files import public_facts

    prepared = prepare_data(cfg)
    facts = public_facts(cfg, prepared)
    return {p: PreparedParty(d, facts if p == "host" else facts.without_labels()) for p, d in prepared.parties.items()}


#: per process: (data key, party) -> the fetched PreparedParty; (cfg, party) -> its plan (each at most
#: CACHED entries, the oldest dropped first: an actor lives for one simulation, a process running
#: parties as threads may run many)
CACHED = 16
_FETCHED: dict[tuple, PreparedParty] = {}
_PLANS: dict[tuple, Any] = {}
_LOCK = threading.Lock()
#: how many slices this process fetched from a handoff / prepared itself (tests read them)
stats = {"fetched": 0}


class Handoff:
    """``{data key: {party: slice}}``, where a slice is a Ray ``ObjectRef`` (a simulation: the
    ClientApp closure carries the references, :func:`fl_split.flower.node.make_client_app`) or a
    :class:`PreparedParty` itself (parties that are threads of one process)."""

    def __init__(self, slices: dict[tuple, dict[str, Any]]) -> None:
        self.slices = slices

    @classmethod
    def offer(cls, cfgs: list[RunConfig], put=None) -> "Handoff":
        """Prepare every covered configuration's parties once; ``put`` stores one slice and returns
        its handle (``ray.put`` in a simulation; by default the slice itself)."""
        slices: dict[tuple, dict[str, Any]] = {}
        for cfg in cfgs:
            key = data_key(cfg)
            if covered(cfg) and key not in slices:
                slices[key] = {p: (put(s) if put is not None else s) for p, s in prepare_parties(cfg).items()}
        return cls(slices)

    def fetch(self, cfg: RunConfig, party: str) -> PreparedParty | None:
        """``party``'s slice of ``cfg``'s data, or ``None`` when this handoff does not hold it."""
        if not covered(cfg):
            return None
        key = data_key(cfg)
        handle = self.slices.get(key, {}).get(party)
        if handle is None:
            return None
        with _LOCK:
            got = _FETCHED.get((key, party))
            if got is None:
                got = handle if isinstance(handle, PreparedParty) else _ray_get(handle)
                if not isinstance(got, PreparedParty) or getattr(got.data, "party", None) != party:
                    from fl_split.errors import ProtocolError

                    raise ProtocolError(f"{party}: the simulation handed this node another party's data")
                _remember(_FETCHED, (key, party), got)
                stats["fetched"] += 1
        return got

    def plan(self, cfg: RunConfig, party: str):
        """The run plan of ``party``'s node from its slice's public facts, or ``None``."""
        got = self.fetch(cfg, party)
        if got is None:
            return None
        with _LOCK:
            plan = _PLANS.get((cfg, party))
        if plan is None:
            from fl_split.party_files import check_facts, plan_from_facts

            check_facts(cfg, got.facts, f"the data handed to {party}")
            plan = plan_from_facts(cfg, got.facts)
            with _LOCK:
                _remember(_PLANS, (cfg, party), plan)
        return plan


def _remember(cache: dict, key, value) -> None:
    cache[key] = value
    while len(cache) > CACHED:
        cache.pop(next(iter(cache)))


def _ray_get(ref):
    import ray

    return ray.get(ref)
