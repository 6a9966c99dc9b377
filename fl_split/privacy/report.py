"""A ledger's privacy report: the ``privacy`` block of a party and the assumptions it rests on.

:func:`build_report` reads a :class:`~fl_split.privacy.ledger.Ledger` (its state and every
listed accountant's answer) and returns plain JSON values; field meanings are in
docs/accounting.md. Every approximation an accountant used (a bound instead of the exact worst
record, merged PLD releases, the dominating pair of an amplified step…) is stated in
``assumptions``, next to the view (per record or amplified), the neighbouring relation, and why an
accountant does not apply.

Layering (one-way, docs/design.md "One-way layers"): the ledger imports this module, never the reverse; the
ledger's constants this report needs are read off the ledger it is given (``ledger.directions``,
``ledger.max_candidates``).
"""

from __future__ import annotations

from typing import Any

from fl_split.privacy import accountants as A
from fl_split.privacy.events import MAX_RR_EPSILON, contains, event_to_json, is_epsilon_delta, json_value

#: the one neighbouring relation of every mechanism and accountant (privacy principle 3)
NEIGHBOURING_RELATION = "replace-one"

_NOTES = {
    A.NOTE_BASIC_DELTA: "basic: each (epsilon, delta)-only release of the worst record (with amplification: each "
                        "training step holding one) is counted at delta/T (T = such releases or steps) and the "
                        "epsilons are summed",
    A.NOTE_PLD_TAIL: f"pld: beyond the {A.MAX_PLD_ATOMS} largest distinct pure-DP releases of a composition, the "
                     "smaller ones are merged into one pure-DP release of their summed epsilon (valid by basic "
                     "composition; a small overestimate)",
    A.NOTE_PLD_SGAUSS: f"pld: beyond {A.MAX_PLD_ATOMS} distinct subsampled Gaussian steps, every step of a rate is "
                       "accounted with the smallest noise multiplier of that rate (an upper bound)",
    A.NOTE_STEPS_GAUSSIAN: "amplified steps whose releases are all Gaussian: the step's Gaussians compose exactly into "
                           "one Gaussian (multiplier (sum n/z^2)^-1/2), Poisson-subsampled (exact subsampled PLD/RDP)",
    A.NOTE_STEPS_LAPLACE: "amplified steps with a single Laplace release: dp_accounting's subsampled Laplace PLD",
    A.NOTE_STEPS_PURE: "amplified steps of several pure-DP releases (or without a library PLD/RDP of their "
                       "subsampled form): the step is (sum of epsilons)-DP, Poisson sampling makes it "
                       "ln(1+q(e^eps-1))-DP, accounted as binary randomized response of that epsilon (its "
                       "dominating pair): a valid bound, looser than an exact subsampled analysis",
    A.NOTE_STEPS_MIXED: "basic: an amplified step mixing (epsilon, delta)-only and pure releases is "
                        "(eps_step, delta_step)-DP by basic composition and (ln(1+q(e^eps_step-1)), q delta_step)-DP "
                        "after Poisson sampling",
    A.NOTE_STEPS_APPROX: "pld: an amplified step mixing Gaussian and pure-DP releases (e.g. a cut-layer mechanism and "
                         "a DP-SGD update of the same batch) has no library PLD once subsampled: it is "
                         "(eps_p + eps_G(delta_s), delta_s)-DP by basic composition of its pure part and its Gaussians "
                         "(merged exactly), delta_s = delta/(2 T q) for its T such steps, "
                         "(ln(1+q(e^eps-1)), q delta_s)-DP after Poisson sampling, and composed as the dominating pair "
                         "of that guarantee (dp_accounting's from_privacy_parameters): half of delta is spent there",
    A.NOTE_PLD_SLACK: "pld: some releases state a pure epsilon above their event's (the discrete Laplace sampler's "
                      "slack: the event is the ideal mechanism); the PLD of the events is taken at delta e^(-S/2) and "
                      "S, their summed excess over the composition, is added to its epsilon",
    A.NOTE_PLD_BASIC_CAP: "pld: where the PLD would exceed basic composition (pessimistic rounding for few releases, "
                          "or float overflow for per-release losses of several hundred) basic is reported",
}


def build_report(ledger) -> dict[str, Any]:
    """The party's privacy block (see docs/accounting.md, "Reading the privacy block")."""
    state = ledger._state
    names = A.reported_names(state.releases)
    if ledger.accountant not in names:
        names.append(ledger.accountant)
    results = {name: ledger._accounting(name, state) for name in names}
    epsilons = {name: r.value for name, r in results.items()}
    reasons = {name: (r.why or "not applicable") for name, r in results.items() if r.value is None}
    by_direction: dict[str, dict[str, int]] = {}
    for d, n in zip(ledger._log["direction"], ledger._log["n"]):
        slot = by_direction.setdefault(ledger.directions[d], {"batches": 0, "releases": 0})
        slot["batches"] += 1
        slot["releases"] += int(n)
    per_cost = ledger._releases_per_cost()
    mechanisms = [{"name": c.mechanism, "params": {k: json_value(v) for k, v in c.params},
                   "epsilon": c.epsilon, "sensitivity_l1": c.sensitivity_l1,
                   "sensitivity_l2": c.sensitivity_l2, "dp_event": event_to_json(c.dp_event),
                   "releases": per_cost.get(k, 0)} for k, c in ledger._costs.items()]
    return {
        "releases": ledger.releases,
        "batches": len(ledger),
        "releases_per_record": ledger.releases_per_record(),
        "training_steps": ledger.training_steps,
        "delta": ledger.delta,
        "epsilon": epsilons[ledger.accountant],
        "accountant": ledger.accountant,
        "epsilons": epsilons,
        "budget": ledger.budget,
        "amplification": ledger.amplification,
        "neighbouring_relation": NEIGHBOURING_RELATION,
        "assumptions": assumptions(ledger, results, reasons),
        "mechanisms": mechanisms,
        "by_direction": by_direction,
        "pld_interval": ledger.pld_interval,
    }


def assumptions(ledger, results: dict, reasons: dict[str, str]) -> list[str]:
    """What the epsilons of ``results`` assume, in words (one statement per entry)."""
    costs = list(ledger._costs.values())
    out = []
    if ledger.amplification:
        out.append("amplification by subsampling: everything released about one training batch (every "
                   "direction, every guest, every charge) is one Poisson-sampled step (rate = batch size / "
                   "training records), and the steps are composed; this assumes Poisson batches hidden from the "
                   "adversary, which vertical split learning does not provide (the host knows every batch's IDs "
                   "and batches are shuffled fixed-size slices), so this epsilon is optimistic; test-phase "
                   "releases stay per record and the epsilon is the larger of the two views")
    else:
        out.append(f"per-record view: each record's loss composes the releases that contained it "
                   f"(at most {ledger.releases_per_record()} per record); epsilon is the worst record's; "
                   f"no amplification by subsampling is claimed (the host knows which IDs are in each batch)")
    relation = ("neighbouring datasets differ in one record's value (replace-one, the ID set is public); every "
                "release's event is its replace-one event (sensitivities bound the change of one record's "
                "released tensor)")
    if ledger.amplification:
        relation += ("; the subsampling lemmas are dp_accounting's add/remove ones (Balle, Barthe & Gaboardi "
                     "2018) applied to each step's replace-one event")
    out.append(relation)
    if any(r.bounded for r in results.values()):
        out.append(f"per-record bound: more than {ledger.max_candidates} records' release counts are incomparable "
                   "(e.g. a distinct cost per step), so one bound of them all is composed instead of the exact worst "
                   "record: each record's Laplace (by epsilon), Gaussian (by noise) and binary randomized response / "
                   "pure (epsilon, 0) releases sorted largest first, and at each position the largest release any "
                   "record has there (it dominates that record's release); other kinds at the element-wise maximum "
                   "of their counts; an upper bound by monotonicity of composition. basic is exact (the worst "
                   "record's own sum, kept record by record) and bounds pld too")
    notes = set().union(*(r.notes for r in results.values())) if results else set()
    for key in (A.NOTE_BASIC_DELTA, A.NOTE_STEPS_GAUSSIAN, A.NOTE_STEPS_LAPLACE, A.NOTE_STEPS_PURE,
                A.NOTE_STEPS_MIXED, A.NOTE_STEPS_APPROX, A.NOTE_PLD_TAIL, A.NOTE_PLD_SLACK, A.NOTE_PLD_SGAUSS,
                A.NOTE_PLD_BASIC_CAP):
        if key in notes:
            out.append(_NOTES[key])
    if costs and "paper" not in reasons:
        out.append(f"paper: 001 Cor. 4/5 as published, with T = {ledger.training_steps} training steps this party "
                   f"released in, gamma = B/N and epsilon the per-step pure epsilon; the corollary assumes "
                   f"amplification by subsampling whatever --amplification says (optimistic in vertical learning); "
                   f"test-phase releases per record with gamma = 1; it can exceed basic composition for few steps"
                   + (f"; {ledger._missing_rate} training entries had no sample rate and count with gamma = 1"
                      if ledger._missing_rate else ""))
    if costs and "paper-record" not in reasons:
        out.append("paper-record: 001 Cor. 4/5 read per record: T = the worst record's releases, gamma = 1")
    for name, why in reasons.items():
        out.append(f"{name} accountant not applicable: {why}")
    if any(c.mechanism == "dpsgd" for c in costs):
        out.append("DP-SGD ('update' entries) protects what the trained parameters reveal, not the cut-layer "
                   "tensors the party exchanges (those are covered only by the mechanism they were released "
                   "through); under replace-one one step is a Gaussian of multiplier sigma/2 (the clipped sum "
                   "moves by up to 2C), i.e. Opacus' add/remove epsilon at sigma/2")
    if any(contains(c.dp_event, is_epsilon_delta) for c in costs):
        out.append("pure epsilon-DP parts without a dp_accounting event (EpsilonDeltaDpEvent) are accounted as "
                   "binary randomized response of the same epsilon (their dominating pair); beyond epsilon "
                   f"{MAX_RR_EPSILON:g}, which no float can carry as e^epsilon, by basic composition only")
    if any(contains(c.dp_event, _is_discrete_laplace) for c in costs):
        out.append("discrete Laplace releases (DiscreteLaplaceDpEvent(a, sensitivity)): pure epsilon a x sensitivity "
                   "(basic), dp_accounting's from_discrete_laplace_mechanism (pld); dp_accounting has no RDP "
                   "of them")
    return out


def _is_discrete_laplace(ev) -> bool:
    return type(ev).__name__ == "DiscreteLaplaceDpEvent"

