"""Helpers shared by several test modules."""

from __future__ import annotations

import math
import re

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


# -- comparing numbers: exactly, or with a stated tolerance ------------------------------------------------
#
# Which comparison a test makes depends on what it claims:
#
# * **Exact** (``==``, bit for bit) where exactness *is* the claim and both sides are computed by the
#   same code on the same machine, usually in one process: split ≡ monolithic, in-process ≡ wire,
#   local engine ≡ Flower, a resumed run ≡ the uninterrupted one, Ray workers ≡ inline. Those tests
#   keep ``==``; a tolerance there would hide exactly the bugs they exist to find.
# * **Tolerant** (the helpers below) where one side was computed elsewhere: a number read from a
#   committed file (``experiments/results/...``), made on the machine that committed it, against
#   the same number computed here. Different CPUs take different floating-point paths — numpy picks
#   its SIMD loops for ``exp``/``log``/reductions at run time from the CPU's features (AVX2,
#   AVX-512), BLAS sums in another order, FMA fuses a multiply-add — so the last bits differ: the
#   committed small grid's ε came out ``7.988415183574831`` on an AMD EPYC against
#   ``7.988415183574826`` committed (6e-16 relative).

#: relative tolerance for ε and metrics compared with a committed file or across machines. float64
#: carries ~1e-16 relative; the rounding differences above stay within a few units of that after
#: the accountant's (or training's) chain of operations (seen: 6e-16), so 1e-9 leaves six orders of
#: magnitude of margin, while any real change — another seed, calibration, or code path — moves
#: these numbers by far more (a calibrated ε is only pinned to 1 %, one test prediction moves an
#: accuracy by 1/n).
REL_TOL = 1e-9
#: absolute floor of the tolerance, for values at 0 (an advantage of 0 may come out as a 1e-17 residue)
ABS_TOL = 1e-12

# a number as text: not glued to a word before it ("guest-1" reads as the word "guest-" and 1)
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")


def _parse(cell: str):
    """``int``, ``float`` or ``None`` (text) for one CSV cell."""
    text = cell.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


def close(got: float, want: float, rel: float = REL_TOL, abs_: float = ABS_TOL) -> bool:
    """``got`` within ``rel`` (relative) or ``abs_`` of ``want``; NaN equals NaN, infinities only
    themselves."""
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    return math.isclose(got, want, rel_tol=rel, abs_tol=abs_)


def same_cell(got: str, want: str, rel: float = REL_TOL) -> bool:
    """One CSV cell: integers exactly (counts, seeds), other numbers with :func:`close` (the cells
    hold full-precision ``repr`` floats), text exactly."""
    g, w = _parse(got), _parse(want)
    if isinstance(g, int) and isinstance(w, int):
        return g == w
    if g is None or w is None:
        return got == want
    return close(float(g), float(w), rel)


def assert_same_rows(got: list[dict], want: list[dict], rel: float = REL_TOL) -> None:
    """CSV rows (``csv.DictReader``) computed here against committed ones: the same columns and rows
    in the same order, every cell :func:`same_cell`. Fails naming the first differing cells."""
    assert len(got) == len(want), f"{len(got)} rows, committed {len(want)}"
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), f"row {i}: columns {list(g)}, committed {list(w)}"
        bad += [f"row {i} {k}: {g[k]!r}, committed {w[k]!r}" for k in w if not same_cell(g[k], w[k], rel)]
    assert not bad, f"{len(bad)} cell(s) differ beyond rel {rel:g}: " + "; ".join(bad[:10])


def _last_digit_unit(token: str) -> float:
    """One unit of the last printed digit of a number with a fractional part (``0.833`` → 0.001,
    ``7.99`` → 0.01, ``1.5e-05`` → 1e-06); 0 for one without (``8``, ``2023``, ``1e-05``)."""
    mantissa, _, exponent = token.lower().partition("e")
    if "." not in mantissa:
        return 0.0
    return 10.0 ** (-len(mantissa.split(".")[1]) + (int(exponent) if exponent else 0))


def assert_same_text(got: str, want: str, rel: float = REL_TOL) -> None:
    """Text with numbers in it (a Markdown report) made here against a committed one: the text with
    every number masked must be equal exactly, and the numbers pairwise

    * printed **without** a fractional part (ranks, counts, seeds, ``8``, ``1e-05``): exactly;
    * printed **with** one: within one unit of the last printed digit (or ``rel``, whichever is
      larger). Such numbers are formatted with few digits (``0.833``, ``7.99``, ``13.62``); a value
      that sits within a rounding difference of a rounding boundary (``0.8335``) may print as
      ``0.833`` on one machine and ``0.834`` on another — a flip of exactly one unit. The underlying
      full-precision values are what :func:`assert_same_rows` checks at ``rel``.
    """
    mask = lambda s: _NUMBER.sub("#", s)  # noqa: E731
    if mask(got) != mask(want):
        g_lines, w_lines = mask(got).splitlines(), mask(want).splitlines()
        diff = next((f"line {i + 1}: {g!r}, committed {w!r}" for i, (g, w) in enumerate(zip(g_lines, w_lines))
                     if g != w), f"{len(g_lines)} lines, committed {len(w_lines)}")
        raise AssertionError(f"the text differs (numbers masked): {diff}")
    bad = []
    for g, w in zip(_NUMBER.findall(got), _NUMBER.findall(want)):
        unit = max(_last_digit_unit(g), _last_digit_unit(w))
        ok = g == w or (unit > 0 and (abs(float(g) - float(w)) <= unit * (1 + 1e-9) or close(float(g), float(w), rel)))
        if not ok:
            bad.append(f"{g} (committed {w})")
    assert not bad, f"{len(bad)} number(s) differ: " + "; ".join(bad[:10])
