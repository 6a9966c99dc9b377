"""The ledger's vectorised per-record view against a straightforward recomputation.

Random schedules — several mechanisms, training and test phases, amplification on and off,
budgets that refuse, export / restore mid-way, repeated and shared record IDs (integer IDs up to
2**63 - 1 and negative ones, as hashed text IDs are) — are charged to a :class:`Ledger`; after
every charge the test recomputes, from the accepted entries alone, each record's count vector,
the training steps and every accountant's epsilon (the maximum over the records' and steps'
compositions), and asserts the ledger's ``report()`` says the same, to the last digit, and that
it refuses exactly the charges whose epsilon would exceed the budget (docs/accounting.md, "The
ledger" and "Budget").
"""

from __future__ import annotations

import math
from collections import Counter

import dp_accounting as dpa
import numpy as np
import pytest

from fl_split.errors import BudgetExceeded, ConfigError
from fl_split.privacy.accountants import RECORDS, STEPS, NotApplicable, Release, View, get_accountant
from fl_split.privacy.base import PrivacyCost
from fl_split.privacy.events import accounting_key
from fl_split.privacy.ledger import BUDGET_SLACK, Ledger, LedgerEntry
from fl_split.state import flatten, from_json, to_json, unflatten

INTERVAL = 1e-2  # coarse PLD interval: the comparison is exact at any interval, this keeps it fast


def _costs() -> list[PrivacyCost]:
    eb = 0.5
    return [
        PrivacyCost("laplace", dpa.LaplaceDpEvent(noise_multiplier=4.0), epsilon=0.25, sensitivity_l1=1.0,
                    params=(("b", 4.0),)),
        PrivacyCost("laplace", dpa.LaplaceDpEvent(noise_multiplier=2.0), epsilon=0.5, sensitivity_l1=1.0,
                    params=(("b", 2.0),)),
        PrivacyCost("gaussian", dpa.GaussianDpEvent(noise_multiplier=5.0), epsilon=None, sensitivity_l2=1.0,
                    params=(("sigma", 5.0),)),
        PrivacyCost("rr", dpa.SelfComposedDpEvent(dpa.RandomizedResponseDpEvent(
            noise_parameter=2 / (1 + math.exp(eb)), num_buckets=2), 2), epsilon=2 * eb, params=(("d", 2),)),
        PrivacyCost("dpsgd", dpa.GaussianDpEvent(noise_multiplier=4.0), None, sensitivity_l2=1.0,
                    params=(("noise_multiplier", 8.0), ("max_grad_norm", 0.5))),
    ]


class Reference:
    """The accepted releases, recomputed from scratch for every question."""

    def __init__(self, amplification: bool, delta: float) -> None:
        self.amplification, self.delta = amplification, delta
        self.entries: list[LedgerEntry] = []

    def epsilon(self, name: str, extra: list[LedgerEntry] = ()) -> float | None:
        releases: list[Release] = []
        kind: dict[str, int] = {}
        records: dict[int, Counter] = {}
        steps: dict[tuple[int, int], list] = {}
        for e in [*self.entries, *extra]:
            akey = accounting_key(e.cost)
            if akey not in kind:
                kind[akey] = len(releases)
                releases.append(Release(e.cost.dp_event, None if e.cost.epsilon is None else float(e.cost.epsilon),
                                        e.cost.mechanism))
            k, train = kind[akey], e.key[0] == "train"
            for i in np.asarray(e.ids).tolist():
                records.setdefault(i, Counter())[(k, train)] += 1
            if train:
                st = steps.setdefault((e.key[1], e.key[2]), [Counter(), 0.0])
                st[0][k] += 1
                st[1] = max(st[1], 1.0 if e.sample_rate is None else float(e.sample_rate))
        acc = get_accountant(name)
        reads_steps = acc.training == STEPS or (acc.training is None and self.amplification)
        vecs = set()
        for counts in records.values():
            agg: Counter = Counter()
            for (k, train), n in counts.items():
                if not (reads_steps and train):
                    agg[k] += n
            if agg:
                vecs.add(tuple(sorted(agg.items())))
        views = [View(RECORDS, v, releases, INTERVAL) for v in vecs]
        if reads_steps and steps:
            hist = Counter((tuple(sorted(m.items())), q) for m, q in steps.values())
            views.append(View(STEPS, tuple(sorted(hist.items())), releases, INTERVAL))
        best = 0.0
        for v in views:
            try:
                best = max(best, float(acc.epsilon(v, self.delta, set())))
            except NotApplicable:
                return None
        return best

    def counts(self) -> dict:
        per_record: Counter = Counter()
        for e in self.entries:
            per_record.update(np.asarray(e.ids).tolist())
        return {"releases": sum(len(e.ids) for e in self.entries), "batches": len(self.entries),
                "releases_per_record": max(per_record.values(), default=0),
                "training_steps": len({(e.key[1], e.key[2]) for e in self.entries if e.key[0] == "train"})}


def _check(led: Ledger, ref: Reference) -> None:
    rep = led.report()
    assert {k: rep[k] for k in ("releases", "batches", "releases_per_record", "training_steps")} == ref.counts()
    for name, value in rep["epsilons"].items():
        assert value == ref.epsilon(name), name  # to the last digit
    assert rep["epsilon"] == rep["epsilons"][led.accountant]


def _schedule(rng: np.random.Generator, amplification: bool, n_records: int,
              id_kind: str = "hashed") -> list[list[LedgerEntry]]:
    """Charges of three epochs. ``id_kind``: ``hashed`` (large integers and negative keys, as hashed
    text IDs: the ID dictionary), ``small`` (0..3N: the direct table), ``switch`` (small, then the
    last epoch's test batch brings a negative and a large ID: the table becomes a dictionary)."""
    costs = _costs()
    pick = rng.choice(len(costs), size=3, replace=False)
    if id_kind == "hashed":
        ids = np.unique(np.concatenate([rng.integers(-2 ** 63, 0, n_records // 2),
                                        rng.integers(2 ** 62, 2 ** 63 - 1, n_records - n_records // 2)]))
    else:
        ids = np.sort(rng.choice(3 * n_records, size=n_records, replace=False)).astype(np.int64)
    batch = 7
    rate = batch / len(ids)
    charges = []
    for epoch in range(1, 4):
        perm = rng.permutation(ids)
        for index in range(0, len(ids), batch):
            members = perm[index:index + batch]
            entries = [LedgerEntry(epoch, ("train", epoch, index // batch), "forward", costs[pick[0]], members,
                                   rate if amplification or rng.random() < 0.5 else None)]
            if rng.random() < 0.5:  # a second release of the same batch (another direction / mechanism)
                c = costs[pick[1]]
                direction = "update" if c.mechanism == "dpsgd" else "backward"
                entries.append(LedgerEntry(epoch, ("train", epoch, index // batch), direction, c,
                                           members[: rng.integers(1, len(members) + 1)], rate))
            charges.append(entries)
        test_ids = rng.choice(ids, size=10, replace=True)  # a record twice in one batch
        if id_kind == "switch" and epoch == 3:
            test_ids = np.concatenate([test_ids, [-5, 2 ** 40]])
        charges.append([LedgerEntry(epoch, ("test", epoch, 0), "forward", costs[pick[2]], test_ids, None)])
    return charges


@pytest.mark.parametrize("seed,accountant,amplification,budget,id_kind", [
    (0, "pld", False, None, "hashed"),
    (1, "pld", True, None, "hashed"),
    (2, "basic", False, 2.0, "hashed"),
    (3, "pld", True, 2.0, "hashed"),
    (4, "rdp", False, 2.5, "hashed"),
    (5, "pld", False, 3.0, "hashed"),
    (6, "pld", True, None, "small"),
    (7, "pld", False, 3.0, "small"),
    (8, "pld", False, None, "switch"),
    (9, "basic", True, 2.0, "switch"),
])
def test_random_schedules_match_a_straightforward_recomputation(seed, accountant, amplification, budget, id_kind):
    rng = np.random.default_rng(seed)
    delta = 1e-5
    led = Ledger("guest-1", accountant=accountant, delta=delta, budget=budget, amplification=amplification,
                 pld_interval=INTERVAL)
    ref = Reference(amplification, delta)
    charges = _schedule(rng, amplification, n_records=40, id_kind=id_kind)
    refused = 0
    for i, entries in enumerate(charges):
        would = ref.epsilon(accountant, entries)
        if would is None:
            with pytest.raises(ConfigError):
                led.charge(entries)
            refused += 1
        elif budget is not None and would > budget + BUDGET_SLACK:
            with pytest.raises(BudgetExceeded):
                led.charge(entries)
            refused += 1
        else:
            led.charge(entries)
            ref.entries.extend(entries)
        if i % 9 == 0:
            _check(led, ref)
        if i == len(charges) // 2:  # export / restore mid-way: the restored ledger carries on
            arrays, skel = flatten(led.export_state())
            restored = Ledger.from_state(unflatten(arrays, from_json(to_json(skel))))
            assert restored.report() == led.report()
            assert restored.export_state()["records"]["ids"].tolist() == led.export_state()["records"]["ids"].tolist()
            led = restored
    _check(led, ref)
    assert (led._slot is None) == (id_kind == "small")  # the ID table used
    if budget is not None:
        assert refused > 0  # the budgets are chosen to refuse some charges
    else:
        assert refused == 0 or accountant == "rdp"


def test_export_is_sorted_by_record_and_column():
    """The exported per-record arrays list records by ID, each one's columns in order (format 2)."""
    costs = _costs()
    led = Ledger("g", pld_interval=INTERVAL)
    led.charge([LedgerEntry(1, ("train", 1, 0), "forward", costs[0], np.array([5, -3, 2 ** 63 - 1]), None)])
    led.charge([LedgerEntry(1, ("test", 1, 0), "forward", costs[2], np.array([5, 7, 7]), None)])
    rec = led.export_state()["records"]
    assert rec["ids"].tolist() == [-3, 5, 5, 7, 2 ** 63 - 1]
    assert rec["columns"].tolist() == [0, 0, 1, 1, 0]
    assert rec["counts"].tolist() == [1, 1, 1, 2, 1]
