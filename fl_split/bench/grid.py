"""The grid of ``fl-split bench``: datasets × defences × attacks × ε × seeds, from a TOML/JSON file
and/or flags (flags win), validated before anything trains.

Every defence name goes into :class:`~fl_split.config.RunConfig` (``defense=``) and every attack name
into :class:`~fl_split.attacks.options.AttackOptions` / :func:`fl_split.attacks.runner.get_attack`,
exactly as ``fl-split train`` / ``fl-split attack`` pass ``--defense`` / ``--attack``: whatever those
accept (the built-ins, and ``package.module:Class`` plug-ins where the installed version takes them)
the bench accepts, with the same one-line error otherwise.

A grid file (``experiments/bench_grid.toml`` is the committed one)::

    datasets = ["digits", "credit"]
    defences = ["laplace", "gaussian", "rr", "r3elu", "dpsgd"]   # "none" is always added (MP*, DCS)
    attacks = ["property", "label-direction"]
    epsilons = [1.0, 8.0, 64.0]        # per-party target ε after training (PLD, δ = 1e-5)
    seeds = [0, 1, 2, 3, 4]            # the default: the verdicts need >= 5 (fl_split/bench/verdicts.py)
    guests = 1
    epochs = 3
    protect = "guest"                  # whose releases the defence protects (RunConfig --protect)
    [train]                            # any other RunConfig field, e.g. limit, batch_size, lr
    limit = 600
    [attack_options.property]         # AttackOptions fields per attack
    attack_epochs = 20
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_split.errors import ConfigError

#: the accounting every target ε is matched under (tight: PLD; issue 26)
ACCOUNTANT = "pld"
DELTA = 1e-5
KEYS = ("datasets", "defences", "attacks", "epsilons", "seeds", "guests", "epochs", "protect", "train",
        "attack_options")
#: fields the grid sets itself (not through [train])
OWN = ("dataset", "defense", "guests", "epochs", "protect", "seed", "accountant", "delta", "progress")


@dataclass(frozen=True)
class Grid:
    datasets: tuple[str, ...]
    defences: tuple[str, ...]
    attacks: tuple[str, ...] = ()
    epsilons: tuple[float, ...] = ()
    #: the published table's seeds by default: its verdicts are paired tests over seeds (verdicts.py)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    guests: int = 1
    epochs: int = 3
    protect: str = "guest"
    train: dict[str, Any] = field(default_factory=dict)
    attack_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def base(self, dataset: str) -> dict[str, Any]:
        """The RunConfig fields every cell of ``dataset`` shares (defence, parameter and seed aside)."""
        return {**self.train, "dataset": dataset, "guests": self.guests, "epochs": self.epochs,
                "protect": self.protect, "progress": False, "accountant": ACCOUNTANT, "delta": DELTA}

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


def _bad(where: str, key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError("grid", value, allowed, reason=f"{where}: {key}")


def _list(where: str, key: str, v: Any, kind: type, allowed: str, check=lambda x: True) -> tuple:
    if isinstance(v, (str, int, float)) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, list) or not v:
        raise _bad(where, key, v, f"a non-empty list of {allowed}")
    out = []
    for x in v:
        if kind is float and isinstance(x, int) and not isinstance(x, bool):
            x = float(x)
        if not isinstance(x, kind) or isinstance(x, bool) or not check(x):
            raise _bad(where, key, x, allowed)
        out.append(x)
    if len(set(out)) != len(out):
        raise _bad(where, key, v, f"{allowed}, each once")
    return tuple(out)


def read_file(path: str | Path) -> dict[str, Any]:
    """A grid file's table (TOML by default, JSON for ``*.json``); one-line errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("grid", str(path), "an existing TOML or JSON file", reason="no such file")
    text = p.read_text(encoding="utf-8", errors="replace")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except (ValueError, json.JSONDecodeError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        kind = "JSON" if p.suffix.lower() == ".json" else "TOML"
        raise ConfigError("grid", str(path), f"a valid {kind} file",
                          reason=str(exc).splitlines()[0] if str(exc) else "unreadable") from None
    if not isinstance(data, dict):
        raise ConfigError("grid", str(path), "a table of " + ", ".join(KEYS), reason="not a table")
    return data


def make_grid(data: dict[str, Any], where: str = "flags") -> Grid:
    """Validate ``data`` (a grid file's table, flags merged over it) into a :class:`Grid`."""
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise _bad(where, "key", unknown[0], "one of " + ", ".join(KEYS))
    for k in ("datasets", "defences"):
        if k not in data:
            raise _bad(where, k, None, f"{k}: a non-empty list (a grid needs datasets and defences)")
    name = "a name (built-in or package.module:Class)"
    datasets = _list(where, "datasets", data["datasets"], str, "dataset names")
    defences = _list(where, "defences", data["defences"], str, name)
    defences = ("none",) + tuple(d for d in defences if d != "none")  # the undefended run: MP* of every DCS
    attacks = _list(where, "attacks", data["attacks"], str, name) if data.get("attacks") else ()
    eps_ok = lambda x: math.isfinite(x) and x > 0  # noqa: E731
    epsilons = (_list(where, "epsilons", data["epsilons"], float, "numbers > 0 (target ε per party)", eps_ok)
                if "epsilons" in data else ())
    if len(defences) > 1 and not epsilons:
        raise _bad(where, "epsilons", None, "a non-empty list of numbers > 0 (target ε per party): the grid "
                                            "has defences to calibrate")
    seeds = _list(where, "seeds", data.get("seeds", list(Grid.seeds)), int, "integers >= 0", lambda x: x >= 0)
    ints = {}
    for k, lo in (("guests", 1), ("epochs", 1)):
        v = data.get(k, Grid.__dataclass_fields__[k].default)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise _bad(where, k, v, f"an integer >= {lo}")
        ints[k] = v
    protect = data.get("protect", "guest")
    train = data.get("train", {})
    if not isinstance(train, dict):
        raise _bad(where, "train", train, "a table of RunConfig fields (e.g. limit, batch_size, lr)")
    clash = [k for k in train if k in OWN or k in ("epsilon", "sigma")]
    if clash:
        raise _bad(where, f"train.{clash[0]}", train[clash[0]], "a RunConfig field the grid does not set itself "
                   "(datasets, defences, epsilons, seeds, guests, epochs and protect are grid keys; the noise "
                   "parameter is calibrated)")
    aopts = data.get("attack_options", {})
    if not isinstance(aopts, dict) or not all(isinstance(v, dict) for v in aopts.values()):
        raise _bad(where, "attack_options", aopts, "a table of tables: [attack_options.NAME] with AttackOptions "
                                                   "fields")
    extra = [a for a in aopts if a not in attacks]
    if extra:
        raise _bad(where, "attack_options", extra[0], "an attack of the grid: " + (", ".join(attacks) or "none"))
    grid = Grid(datasets, defences, attacks, epsilons, seeds, ints["guests"], ints["epochs"], protect, dict(train),
                {k: dict(v) for k, v in aopts.items()})
    check(grid, where)
    return grid


def attack_options(grid: Grid, name: str):
    """The :class:`AttackOptions` of attack ``name`` in ``grid`` (validated as ``fl-split attack`` does)."""
    from fl_split.attacks.options import options_from_mapping

    return options_from_mapping({**grid.attack_options.get(name, {}), "attack": name})


def check(grid: Grid, where: str = "flags") -> None:
    """Build every RunConfig and attack of the grid once (no training): a bad name or value fails here,
    in one line, naming the grid entry, before the first cell runs."""
    from fl_split.attacks.runner import get_attack
    from fl_split.bench.calibrate import parameter_of
    from fl_split.config import RunConfig

    for ds in grid.datasets:
        for d in grid.defences:
            changes = {} if d == "none" else {"defense": d, parameter_of(d)[0]: 1.0}
            try:
                RunConfig(**grid.base(ds), **changes, seed=grid.seeds[0])
            except ConfigError as exc:
                raise ConfigError(exc.key, exc.value, exc.allowed,
                                  reason=f"{where}: dataset {ds}, defence {d}"
                                         + (f"; {exc.reason}" if exc.reason else "")) from None
            except TypeError as exc:  # an unknown RunConfig field under [train]
                raise _bad(where, "train", str(exc).split("argument ")[-1], "RunConfig fields (fl-split train "
                           "flags in snake_case)") from None
    for a in grid.attacks:
        try:
            get_attack(a)
            attack_options(grid, a)
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.value, exc.allowed, reason=f"{where}: attack {a}"
                              + (f"; {exc.reason}" if exc.reason else "")) from None


def load(path: str | None, overrides: dict[str, Any]) -> Grid:
    """The grid of ``path`` (if any) with ``overrides`` (flags given, not None) on top."""
    data = read_file(path) if path else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return make_grid(data, where=str(path) if path else "flags")


__all__ = ["Grid", "ACCOUNTANT", "DELTA", "KEYS", "read_file", "make_grid", "attack_options", "check", "load"]
