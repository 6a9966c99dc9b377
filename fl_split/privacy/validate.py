"""Refuse models whose releases couple the records of a batch (privacy principle 4).

A per-record guarantee charges each record for the releases that contain *its* row. That is only
right if each released row depends on its own record alone (given the weights). BatchNorm in
training mode normalises every row with the batch's mean and variance: changing record 0 moves
every other row of the release (measured here: rows 1–15 by up to 1.07), so the per-record
epsilon would be wrong. Like Opacus' ``ModuleValidator``, fl_split refuses such modules in the
models of a party that claims differential privacy, naming the module, and points to
``--norm group|layer|none`` (GroupNorm / LayerNorm normalise each record on its own).

Which models matter: a guest's bottom produces its forward releases; the host's backward
release ``δ_g = ∂L/∂ã_g`` is computed through its bottom and top; a DP-SGD party's per-sample
gradients go through all its modules.
"""

from __future__ import annotations

from torch import nn

from fl_split.errors import ConfigError

#: module types whose training-mode output row depends on other records of the batch
COUPLING = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def coupling_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every record-coupling module inside ``module``."""
    return [(name or type(module).__name__, m) for name, m in module.named_modules() if isinstance(m, COUPLING)]


def check_record_independent(party: str, models: dict[str, nn.Module | None], why: str) -> None:
    """Raise :class:`ConfigError` (``--norm``) if a model of ``party`` couples records.

    ``models`` maps a model's role ("bottom", "top") to the module; ``why`` says what the party
    claims (e.g. "--defense laplace protects its forward releases")."""
    found = [(role, name, m) for role, mod in models.items() if mod is not None
             for name, m in coupling_modules(mod)]
    if not found:
        return
    role, name, m = found[0]
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    raise ConfigError(
        "norm", "batch", "group, layer or none (normalise each record on its own)",
        reason=f"{party}'s {role} module '{name}' ({type(m).__name__}){more} mixes the records of a batch in "
               f"training mode, so a per-record epsilon would be wrong; {why}")


def check_opacus_compatible(party: str, module: nn.Module) -> None:
    """Opacus' own validator for a DP-SGD model (after :func:`check_record_independent`)."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(module, strict=False)
    if errors:
        raise ConfigError("defense", "dpsgd", "a model Opacus supports",
                          reason=f"{party}: " + "; ".join(map(str, errors[:3])))
