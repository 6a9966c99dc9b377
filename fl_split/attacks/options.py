"""The attack hyper-parameters: one declaration gives the ``fl-split attack`` flags, their help and
their validation (errors name the flag, the value and what is allowed), as
:class:`fl_split.config.RunConfig` does for the training flags.

``auto`` means "the attack's own default" (``docs/attacks.md`` lists them per attack).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from fl_split.errors import ConfigError

AUTO = "auto"
ATTACK_NAMES = ("property", "reconstruction", "fsha", "inversion", "feature", "membership", "label-norm",
                "label-direction", "label-completion")
#: where each built-in attack's class lives (imported on use: :func:`fl_split.plugins.resolve`)
ATTACK_CLASSES = {
    "property": ("fl_split.attacks.property", "PropertyInference"),
    "reconstruction": ("fl_split.attacks.reconstruction", "Reconstruction"),
    "fsha": ("fl_split.attacks.fsha", "FSHA"),
    "inversion": ("fl_split.attacks.inversion", "WhiteBoxInversion"),
    "feature": ("fl_split.attacks.feature", "FeatureInference"),
    "membership": ("fl_split.attacks.membership", "MembershipInference"),
    "label-norm": ("fl_split.attacks.label", "NormScoring"),
    "label-direction": ("fl_split.attacks.label", "DirectionScoring"),
    "label-completion": ("fl_split.attacks.label", "ModelCompletion"),
}
assert tuple(ATTACK_CLASSES) == ATTACK_NAMES


def _opt(default: Any, help: str, *, kind: str, allowed: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "kind": kind, "allowed": allowed, "choices": choices})


def _int(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class AttackOptions:
    """Every option of an attack run. Field ``x_y`` is flag ``--x-y``."""

    attack: str = _opt("property", "which attack to mount (docs/attacks.md), or your own class "
                                   "'package.module:Class' (docs/plugins.md)", kind="attack",
                       allowed="one of " + ", ".join(ATTACK_NAMES) + " or 'package.module:Class' (docs/plugins.md)",
                       choices=ATTACK_NAMES)
    adversary: str = _opt(AUTO, "who mounts it: host or guest (property inference runs both ways; every other "
                                "attack has one adversary); auto = the attack's own",
                          kind="choice", allowed="auto, host or guest", choices=(AUTO, "host", "guest"))
    guest: str = _opt("guest-1", "the guest under attack (host attacks) or mounting it (guest attacks)",
                      kind="guest", allowed="guest-1 ... guest-G")
    property: str = _opt(AUTO, "property inference target: a binary property of the victim's data (credit: "
                               "age-over-40, married, has-records; images: patch-ink; tables: above-median:FEATURE); "
                               "auto = the victim's first", kind="str", allowed="a property of the victim's data")
    aux_fraction: float = _opt(0.5, "share of the training records whose property (property) or raw inputs "
                                    "(reconstruction) the threat model grants the adversary; the attack is "
                                    "scored on the other training records",
                               kind="unit", allowed="a number strictly between 0 and 1")
    attack_epoch: Any = _opt(AUTO, "which epoch's messages the attack uses: last, all (stacked per record; "
                                   "label scoring averages per-epoch AUCs) or an epoch number; auto = the "
                                   "attack's own", kind="epoch", allowed="auto, last, all or an integer >= 1")
    attack_epochs: Any = _opt(AUTO, "training epochs of the attack's own model (classifier, decoder, generator, "
                                    "attack model; FSHA ignores it: it trains during the split training)",
                              kind="auto_int", allowed="auto or an integer >= 1")
    attack_lr: Any = _opt(AUTO, "learning rate of the attack's own model (Adam)", kind="auto_float",
                          allowed="auto or a number > 0")
    attack_hidden: Any = _opt(AUTO, "hidden width of the attack's own networks", kind="auto_int",
                              allowed="auto or an integer >= 1")
    attack_records: Any = _opt(AUTO, "how many target records to attack (inversion: 32; others: all)",
                               kind="auto_int", allowed="auto or an integer >= 1")
    known_labels: Any = _opt(AUTO, "label attacks: labels the guest knows, per class (Fu et al. 2022; direction "
                                   "scoring's references); auto = 4", kind="auto_int",
                             allowed="auto or an integer >= 1")
    shadow_models: int = _opt(4, "membership inference: number of shadow models", kind="int",
                              allowed="an integer >= 1")
    inversion_steps: int = _opt(500, "white-box inversion: gradient steps on the input", kind="int",
                                allowed="an integer >= 1")
    tv_weight: float = _opt(0.0, "white-box inversion: weight of the total-variation prior (He et al. 2019 rMLE)",
                            kind="nonneg", allowed="a number >= 0")
    grn_target: str = _opt("embedding", "feature inference: what the generator's guess must reproduce: the "
                                        "guest's released embedding, or the model's prediction (Luo et al. 2021)",
                           kind="choice", allowed="embedding or prediction", choices=("embedding", "prediction"))
    fsha_lr: float = _opt(1e-3, "FSHA: learning rate of the attacker's pilot, decoder and discriminator (Adam)",
                          kind="positive", allowed="a number > 0")
    fsha_gp: float = _opt(10.0, "FSHA: gradient-penalty weight of the WGAN discriminator (Gulrajani et al.: 10; the "
                                "official FSHA code: 500, which trained worse here, docs/attacks.md)",
                          kind="nonneg", allowed="a number >= 0")
    fsha_every: int = _opt(100, "FSHA: the attacker keeps its reconstruction of the current batch every N "
                                "iterations (the MSE-vs-iterations curve)", kind="int",
                           allowed="an integer >= 1")
    grid: str = _opt("", "image attacks (reconstruction, fsha, inversion): write a PNG grid of private inputs "
                         "(top) and reconstructions (bottom) here", kind="str", allowed="a file path")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _validate(f, getattr(self, f.name))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "AttackOptions":
        return dataclasses.replace(self, **changes)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def option_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(AttackOptions)


def coerce(f: dataclasses.Field, raw: Any) -> Any:
    """A CLI string to the field's type (range checks are :func:`_validate`'s)."""
    kind = f.metadata["kind"]
    key = f.name.replace("_", "-")
    allowed = f.metadata["allowed"]
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    try:
        if kind in ("auto_int", "auto_float", "epoch") and text.lower() == AUTO:
            return AUTO
        if kind == "epoch":
            return text.lower() if text.lower() in ("last", "all") else int(text)
        if kind in ("auto_int", "int"):
            return int(text)
        if kind in ("auto_float", "unit", "positive", "nonneg"):
            return float(text)
    except ValueError:
        raise ConfigError(key, raw, allowed) from None
    return text


def _is_plugin(v: Any) -> bool:
    from fl_split.config import is_user_model  # ``package.module:Class``, syntax only (fl_split.plugins)

    return is_user_model(v)


def _validate(f: dataclasses.Field, v: Any) -> None:
    kind = f.metadata["kind"]
    ok = {
        "choice": lambda: v in (f.metadata["choices"] or ()),
        "attack": lambda: v in (f.metadata["choices"] or ()) or _is_plugin(v),
        "guest": lambda: isinstance(v, str) and v.startswith("guest-") and v[6:].isdigit() and int(v[6:]) >= 1,
        "str": lambda: isinstance(v, str),
        "unit": lambda: _float(v) and 0 < v < 1,
        "positive": lambda: _float(v) and v > 0,
        "nonneg": lambda: _float(v) and v >= 0,
        "int": lambda: _int(v, 1),
        "auto_int": lambda: v == AUTO or _int(v, 1),
        "auto_float": lambda: v == AUTO or (_float(v) and v > 0),
        "epoch": lambda: v in (AUTO, "last", "all") or _int(v, 1),
    }[kind]()
    if not ok:
        raise ConfigError(f.name.replace("_", "-"), v, f.metadata["allowed"])


def options_from_mapping(values: dict[str, Any]) -> AttackOptions:
    """Build from ``{name: value}`` (snake- or kebab-case, strings or typed values)."""
    fields = {f.name: f for f in option_fields()}
    kwargs = {}
    for k, raw in values.items():
        name = str(k).replace("-", "_")
        if name not in fields:
            raise ConfigError(str(k).replace("_", "-"), raw, "one of the attack options: "
                              + ", ".join(n.replace("_", "-") for n in fields), reason="unknown option")
        kwargs[name] = coerce(fields[name], raw)
    return AttackOptions(**kwargs)
