"""What a party discloses at the end of a run: its ``privacy`` entry of the results (spec §5).

Everything here is public or computed from public facts and the party's ledger: the mechanism's
parameters (:meth:`Mechanism.describe`), its public diagnostics (noise scale, the largest SNR it
allows), the ledger's accounting, where the party's randomness came from (never the secret) and
the assumptions the guarantee rests on. Diagnostics computed from private values stay in the
party's local log (:mod:`fl_split.privacy.diagnostics`).
"""

from __future__ import annotations

from typing import Any

from fl_split.privacy.base import Mechanism

WEIGHTS_ASSUMPTION = (
    "a cut-layer mechanism protects each release given the party's current weights; the weights are "
    "trained on other records and what they carry is not covered, unless the party trains its own model "
    "with DP-SGD ('update' entries of the same ledger)")
AGGREGATES_ASSUMPTION = (
    "aggregate metrics released to the coordinator, not covered by DP: the per-epoch training loss, test "
    "metric and test loss, and the task's other test metrics (binary: AUC, F1, precision, recall, KS; "
    "regression: MAE, RMSE) (one number each per epoch, over the whole split); --report-metrics none keeps "
    "them at the host")


def party_privacy_report(*, role: str, ledger, mechanism: Mechanism, update: dict | None, released: dict,
                         cut_width: int, randomness: str, aggregates: bool,
                         extra_assumptions: list[str] | None = None,
                         per_epoch: dict[str, float | None] | None = None) -> dict[str, Any]:
    """A party's entry of the results' ``privacy`` block.

    ``mechanism``: the party's cut-layer mechanism (first iteration); ``update``: the description of
    its local-update policy when that is DP-SGD; ``randomness``: ``"os-entropy"``, ``"insecure-private-seed"`` or
    ``"private-seed"``; ``aggregates``: the party (the host) reports per-epoch aggregate metrics;
    ``per_epoch``: the ledger's epsilon after each epoch (``epsilon_by_epoch``).
    """
    desc = dict(mechanism.describe())
    desc["cut_width"] = cut_width
    if update is not None:
        desc["local_update"] = update
    out: dict[str, Any] = {"mechanism": desc, "private_randomness": randomness,
                           "release_diagnostics": mechanism.public_diagnostics()}
    extra = list(extra_assumptions or [])
    if hasattr(mechanism, "assumptions"):  # what the mechanism's own guarantee rests on (secure merge: k)
        extra.extend(mechanism.assumptions())
    if aggregates:
        extra.append(AGGREGATES_ASSUMPTION)
    from fl_split.privacy.plugin import is_plugin_mechanism

    if ledger is None:
        what = "forward releases (cut-layer activations)" if role == "guest" else "backward releases (partial losses)"
        if is_plugin_mechanism(mechanism):  # perturbed by a plug-in that gives the ledger no DP event
            said = (f"no privacy claimed: this party's {what} go through the plug-in defence "
                    f"{desc.get('name')!r}, which states no differential privacy event (no privacy_cost), so "
                    f"no ledger charges them and no epsilon is reported for them")
            out["privacy_claim"] = "none"
        else:
            said = f"unprotected: this party's {what} are not perturbed; no differential privacy is claimed for them"
        out.update(releases=released.get("records", 0), releases_per_record=None, delta=None, epsilon=None,
                   accountant=None, epsilons={}, budget=None, assumptions=[said, *extra])
        return out
    rep = ledger.report()
    assumptions = list(rep.get("assumptions", [])) + [WEIGHTS_ASSUMPTION, *extra]
    out.update(rep)
    out["epsilon_by_epoch"] = dict(per_epoch or {})
    out["mechanism"] = desc
    out["assumptions"] = assumptions
    return out


def snr_bound(privacy_entry: dict) -> float | None:
    """The public SNR bound (largest per-element signal-to-noise ratio the mechanism's parameters
    allow) from a party's ``privacy`` results entry; ``None`` when its releases are not perturbed."""
    return (privacy_entry.get("release_diagnostics") or {}).get("snr_bound")
