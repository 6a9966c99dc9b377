"""Attacks on a training run made under Flower (``fl-split attack --engine flower``).

Under Flower every party lives in its own process (a Ray actor of the simulation), so the attack
process cannot hand the adversary its party object the way :class:`~fl_split.attacks.view.Session`
does with the local engine. Instead each party **records what it holds, on its own node**:

* :func:`recording_client_app` is the fl_split ClientApp with one addition: each party appends
  every blob delivered to it and every blob it returns to ``DIR/<party>.in`` / ``DIR/<party>.out``
  (length-prefixed, in order, written through, so a party served by several actors over the run
  keeps one record), and when the coordinator asks for its report it writes its whole final state
  (models, optimizer, ledger, its own secret) to ``DIR/<party>.state``. The blobs are taken where
  the party's own methods receive and return them (``step`` for a guest, ``train`` / ``evaluate``
  for the host), which is the same point on the direct data plane and on the relay.
* :class:`FlowerSession` runs the Flower simulation with that app into a private temporary
  directory, then rebuilds every party in this process from its recorded state and fills the
  session's boxes from the recordings, so :meth:`~fl_split.attacks.view.Session.view` builds the
  same :class:`~fl_split.attacks.view.AdversaryView` as for the local engine: the adversary's own
  party and its own inbox and outbox, nothing else. The local and Flower engines give bit-identical
  trainings, and the attack then gives the local engine's numbers
  (``tests/test_attacks_flower.py``).

Not under Flower: attacks whose threat model needs the public split taken out of training
(membership) — the federation's parties prepare their data from the run configuration — and FSHA,
whose malicious host would have to be a ClientApp of its own.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from fl_split.attacks.view import Session
from fl_split.config import RunConfig
from fl_split.errors import ConfigError

_LEN = struct.Struct("<Q")


# -- the parties' side: record what each party holds, on its own node ------------------------------
def _append(path: Path, blobs) -> None:
    with open(path, "ab") as fh:
        for b in blobs:
            fh.write(_LEN.pack(len(b)))
            fh.write(b)


def read_blobs(path: Path) -> list[bytes]:
    """The blobs :func:`_append` wrote to ``path`` (none when it does not exist)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        out.append(data[pos:pos + n])
        pos += n
    return out


def instrument(party, directory: Path) -> Any:
    """``party`` with its message methods recording their blobs under ``directory`` (see module)."""
    inbox, outbox = directory / f"{party.name}.in", directory / f"{party.name}.out"
    if party.name == "host":
        train, evaluate = party.train, party.evaluate

        # a Flower party's messages cross processes: bytes (in_process stays False), recorded as such
        def recorded_train(keys, acts, round_, **kw):
            _append(inbox, [b for bl in acts.values() for b in bl])
            grads = train(keys, acts, round_, **kw)
            _append(outbox, [b for bl in grads.values() for b in bl])
            return grads

        def recorded_evaluate(keys, acts, round_):
            _append(inbox, [b for bl in acts.values() for b in bl])
            return evaluate(keys, acts, round_)

        party.train, party.evaluate = recorded_train, recorded_evaluate
    else:
        step = party.step

        def recorded_step(owed, keys, round_, **kw):
            _append(inbox, owed)
            blobs = step(owed, keys, round_, **kw)
            _append(outbox, blobs)
            return blobs

        party.step = recorded_step
    return party


def recording_client_app(directory: str, private_seed: int | None = None):
    """The fl_split ClientApp whose parties record their inboxes, outboxes and final states under
    ``directory`` (a path on the party's own machine)."""
    from fl_split.flower import node as node_mod
    from fl_split.flower import records as R

    where = Path(directory)

    def handler(message, context):
        if getattr(node_mod.build_party, "_records_to", None) != str(where):  # once per process and app
            build = getattr(node_mod.build_party, "_original", node_mod.build_party)

            def build_recorded(*args, **kw):
                party, facts = build(*args, **kw)
                return instrument(party, where), facts

            build_recorded._records_to, build_recorded._original = str(where), build
            node_mod.build_party = build_recorded
        reply = node_mod.handle(message, context, private_seed)
        if message.metadata.message_type == R.MSG_REPORT and not reply.has_error() \
                and R.ERROR not in reply.content.config_records:
            role = node_mod.node_role(dict(context.node_config))
            party, _ = node_mod._restore(context, role)
            tmp = where / f"{party.name}.state.tmp"
            torch.save(party.export_state(), tmp)
            os.replace(tmp, where / f"{party.name}.state")
        return reply

    return node_mod.client_app_for(handler)


# -- the attack process's side ----------------------------------------------------------------------
class FlowerSession(Session):
    """A :class:`~fl_split.attacks.view.Session` whose training runs as a Flower simulation
    (``--engine flower``: Ray actors, the direct data plane or the relay); the parties record what
    they hold on their own nodes and are rebuilt here from it (module docstring)."""

    ENGINES = ("flower",)

    def __init__(self, cfg: RunConfig, private_seed: int | None = None, *, public: bool = False) -> None:
        if public:
            raise ConfigError("engine", cfg.engine, "local for this attack",
                              reason="its threat model grants public records taken out of training, and a "
                                     "federation's parties prepare their data from the run configuration")
        super().__init__(cfg, private_seed, public=False)

    def hijack_host(self, factory, grants=()):
        raise ConfigError("engine", self.cfg.engine, "local for fsha",
                          reason="the malicious host would have to run as a ClientApp of its own")

    def run(self) -> dict:
        """Train (once) through Flower and rebuild the parties from their recordings."""
        if self.results is None:
            from fl_split.builder import make_guest, make_host
            from fl_split.flower import FlowerEngine
            from fl_split.seeding import PartySecret

            with tempfile.TemporaryDirectory(prefix="fl_split_attack_") as d:
                where = Path(d)
                app = recording_client_app(d, self.private_seed)
                results = FlowerEngine(self.cfg, client_app=app, private_seed=self.private_seed).run()
                parties: dict[str, Any] = {}
                for name in ["host", *self.plan.guests]:
                    state_file = where / f"{name}.state"
                    if not state_file.exists():
                        raise ConfigError("engine", "flower", "local",
                                          reason=f"{name} recorded no final state (it failed during the run)")
                    state = torch.load(state_file, weights_only=False)
                    secret = PartySecret.from_state(state["secret"])
                    data = self.prepared.parties[name]
                    party = (make_host(self.plan, data, secret=secret) if name == "host"
                             else make_guest(self.plan, data, name, secret=secret))
                    party.import_state(state)
                    parties[name] = party
                    self._boxes[name] = {"in": read_blobs(where / f"{name}.in"),
                                         "out": read_blobs(where / f"{name}.out")}
            self._host = parties["host"]
            self._guests = {g: parties[g] for g in self.plan.guests}
            self.results = results
        return self.results
