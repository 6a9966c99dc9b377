"""Helpers shared by several test modules."""

from __future__ import annotations

from fl_split.builder import make_parties
from fl_split.protocol import Handoff, Message, decode, encode, open_message
from fl_split.state import flatten, unflatten


def opened(item) -> Message:
    """What a party received, as a message: a frame decoded, or an in-process hand-over as it is."""
    return open_message(item)


def tampered(item, change):
    """``item`` (a frame or an in-process :class:`~fl_split.protocol.Handoff`) after ``change(msg)``
    edited its decoded message in place, sent the same way: re-encoded, or handed over as a new
    ``Handoff`` built directly (what a hostile party in the process can make; nothing checked)."""
    if isinstance(item, Handoff):
        m = Message(item.kind, item.sender, item.receiver, item.round, item.key, item.digest, item.tensor.clone(),
                    item.encoding)
        change(m)
        return Handoff(m.kind, m.sender, m.receiver, m.round, m.key, m.digest, m.tensor, m.encoding)
    m = decode(item)
    change(m)
    return encode(m)


class StatelessTransport:
    """Like Flower deployment: every request rebuilds the party from its exported state.

    Exercises export/import and the guest's recomputed forward (no live autograd graph
    survives between messages).
    """

    def __init__(self, cfg, private_seed: int | None = None):
        self.cfg = cfg
        self.private_seed = private_seed
        host, guests, self.plan = make_parties(cfg, private_seed)
        self.guests = list(guests)
        self.states = {"host": flatten(host.export_state()), **{g: flatten(p.export_state()) for g, p in guests.items()}}

    def _party(self, name):
        host, guests, _ = make_parties(self.cfg)  # fresh secrets: the import replaces them
        party = host if name == "host" else guests[name]
        party.import_state(unflatten(*self.states[name]))
        return party

    def _save(self, name, party):
        self.states[name] = flatten(party.export_state())

    def guest_step(self, owed, keys, round_):
        out = {}
        for g in self.guests:
            p = self._party(g)
            out[g] = p.step(owed[g], keys, round_)
            self._save(g, p)
        return out

    def host_train(self, keys, acts, round_):
        p = self._party("host")
        res = p.train(keys, acts, round_)
        self._save("host", p)
        return res

    def host_evaluate(self, keys, acts, round_):
        p = self._party("host")
        res = p.evaluate(keys, acts)
        self._save("host", p)
        return res

    def reports(self):
        return {}


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """``fl-split argv`` in this process: ``(exit code, stdout, stderr)``."""
    from fl_split.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


#: each defence at the poisoning tests' defaults (tests/test_adversary_poisoning.py; experiments/loss_alarm.py)
POISONING_DEFENCES = {
    "none": dict(defense="none"),
    "gaussian": dict(defense="gaussian", sigma=0.7),
    "laplace": dict(defense="laplace", epsilon=50.0),
    "rr": dict(defense="rr", epsilon=50.0, protect="guest"),
    "r3elu": dict(defense="r3elu", epsilon=50.0),
    "dpsgd": dict(defense="dpsgd", sigma=1.0),
}
