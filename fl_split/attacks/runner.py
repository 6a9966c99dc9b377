"""Run an attack end to end: train (observed), build the adversary's view, attack, score.

:func:`run_attack` is what ``fl-split attack`` calls and what experiment scripts reuse; it returns
a plain dictionary (the attack JSON, see ``docs/attacks.md``). To mount several attacks on one
training run, build the :class:`~fl_split.attacks.view.Session` once with :func:`make_session`
and pass it to each :func:`run_attack` call (the attacks must agree on the session's needs: a
public split, or a malicious host).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from fl_split.attacks.base import Attack
from fl_split.attacks.options import AttackOptions
from fl_split.attacks.view import NotObserved, Session
from fl_split.config import AUTO, RunConfig
from fl_split.errors import ConfigError, FlSplitError


class AttackError(FlSplitError):
    """The attack could not run on what its adversary observed (e.g. a run stopped by its budget
    before the epoch the attack needs)."""



def _plain(o: Any) -> Any:
    """``o`` with arrays and tensors as lists and numpy scalars as numbers (JSON-ready)."""
    if isinstance(o, dict):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    if isinstance(o, (np.ndarray, torch.Tensor)):
        return o.tolist()
    if isinstance(o, np.generic):
        return o.item()
    return o


def get_attack(name: str) -> Attack:
    """The attack ``--attack name`` names: a built-in, or a plug-in class ``package.module:Class``
    (:func:`fl_split.plugins.resolve`, docs/plugins.md), constructed without arguments."""
    from fl_split.plugins import resolve

    cls = resolve("attack", name)
    try:
        return cls()
    except Exception as e:  # a plug-in's constructor
        raise ConfigError("attack", name, "an Attack subclass constructed without arguments",
                          reason=f"{cls.__name__}() raised {type(e).__name__}: {e}") from None


def _check(attack: Attack, session: Session, opts: AttackOptions) -> None:
    guests = session.plan.guests
    if opts.guest not in guests:
        raise ConfigError("guest", opts.guest, "one of " + ", ".join(guests),
                          reason=f"the run has {len(guests)} guest(s)")
    adversary = attack.adversary(opts)
    if opts.grid:
        image = len(session.plan.input_shapes.get(opts.guest if adversary == "host" else "host", ())) == 3
        if not hasattr(attack, "write_grid") or not image:
            raise ConfigError("grid", opts.grid, "empty here: image grids are drawn by reconstruction, fsha and "
                              "inversion on image datasets", reason=f"--attack {opts.attack} on {session.cfg.dataset}")
    if isinstance(opts.attack_epoch, int) and opts.attack_epoch > session.cfg.epochs:
        raise ConfigError("attack-epoch", opts.attack_epoch, f"auto, last, all or an epoch in 1..{session.cfg.epochs}")
    attack.check(session.referee, session.plan, opts)


#: FSHA aligns the guest's feature space with its pilot's only through a convolutional guest here
#: (docs/attacks.md, "Measured"): with ``--model auto`` it trains the setting where it works
FSHA_IMAGE_DEFAULT = {"model": "cnn-stripe", "cut_layer": 1}


def attack_defaults(cfg: RunConfig, opts: AttackOptions) -> tuple[RunConfig, dict[str, Any]]:
    """The attack's own defaults for options left at ``auto``: FSHA on an image dataset gets a
    convolutional guest cut after its first block (against the default ``mlp`` stripe the attack
    decodes plausible digits of the wrong records — worse than the mean image). Returns the config
    to train and what was chosen (recorded in the results)."""
    if opts.attack != "fsha" or cfg.model != AUTO:
        return cfg, {}
    from fl_split.data.registry import dataset_info
    from fl_split.models.catalog import model_entry

    default = dataset_info(cfg.dataset).default_model
    if model_entry(default).inputs == "image":
        chosen = {"model": default, "cut_layer": 1 if cfg.cut_layer == AUTO else cfg.cut_layer}
    elif cfg.dataset == "digits":  # 8×8 images whose default model is the vector MLP
        chosen = {"model": FSHA_IMAGE_DEFAULT["model"],
                  "cut_layer": FSHA_IMAGE_DEFAULT["cut_layer"] if cfg.cut_layer == AUTO else cfg.cut_layer}
    else:
        return cfg, {}
    return dataclasses.replace(cfg, **chosen), chosen


def make_session(cfg: RunConfig, opts: AttackOptions, private_seed: int | None = None) -> Session:
    """The observed training run ``opts.attack`` needs (not yet run): with the public split if its
    threat model grants public records, with the malicious host if it is one."""
    cfg, _ = attack_defaults(cfg, opts)
    attack = get_attack(opts.attack)
    if cfg.engine == "flower":
        from fl_split.attacks.flower import FlowerSession

        session: Session = FlowerSession(cfg, private_seed, public=attack.public)
    else:
        session = Session(cfg, private_seed, public=attack.public)
    _check(attack, session, opts)
    if attack.malicious:
        session.hijack_host(attack.hijacker(opts), attack.grants(session.referee, opts, before_training=True))
    return session


def run_attack(cfg: RunConfig, opts: AttackOptions, private_seed: int | None = None,
               session: Session | None = None) -> dict[str, Any]:
    """Train ``cfg`` (or reuse ``session``), mount ``opts.attack`` as its adversary and score it.

    Returns the attack results: ``attack``, ``adversary``, ``victim``, ``metric``, ``value``,
    ``baseline``, ``threat_model``, ``details``, the training's ``final`` metric and ``privacy``
    report, ``training`` (config, plan, history, wire) and ``time_s``."""
    attack = get_attack(opts.attack)
    _, chosen = attack_defaults(cfg, opts)
    if cfg.secure_merge:  # refused before any training: the attacks read one guest's release
        raise ConfigError("secure-merge", True, "off for fl-split attack",
                          reason="under secure merge the host holds only the guests' masked parts and their "
                                 "ring sum, and the attacks read one guest's release; the host's attack on the sum "
                                 "is measured by experiments/exp9_secure_merge_attacks.py (experiments/README.md, 9b)")
    if session is None:
        session = make_session(cfg, opts, private_seed)
    else:
        _check(attack, session, opts)
        if attack.public and not session.public_parties:
            raise ConfigError("attack", opts.attack, "an attack whose needs this session meets",
                              reason="its threat model grants public records: build the session with "
                                     "make_session for it (Session(..., public=True))")
        if attack.malicious != (session._acting_host is not None):
            raise ConfigError("attack", opts.attack, "an attack whose needs this session meets",
                              reason="FSHA needs its own (hijacked) training run, and no other attack may "
                                     "use one")
    t0 = time.perf_counter()
    results = session.run()
    t_train = time.perf_counter() - t0
    adversary, victim = attack.parties(opts)
    view = session.view(adversary, attack.grants(session.referee, opts))
    t1 = time.perf_counter()
    try:
        guess = attack.run(view, opts)
    except NotObserved as exc:  # the adversary did not observe what the attack needs
        raise AttackError(f"{attack.name}: {exc}") from None
    t_attack = time.perf_counter() - t1
    scored = attack.score(guess, session.referee, opts)
    if opts.grid and hasattr(attack, "write_grid"):
        attack.write_grid(guess, session.referee, opts, opts.grid)
    threat = view.describe()
    threat["summary"] = attack.threat_summary(opts) if hasattr(attack, "threat_summary") else ""
    return {
        "attack": attack.name,
        "title": attack.title,
        "reference": attack.reference,
        "adversary": adversary,
        "victim": victim,
        "metric": scored.metric or attack.metric,
        "better": attack.better,
        "value": float(scored.value),
        "baseline": float(scored.baseline),
        "baseline_name": scored.baseline_name or attack.baseline_name,
        "threat_model": threat,
        "options": {k: v for k, v in opts.to_dict().items()},
        "defaults_chosen": chosen,
        "details": _plain({**guess.details, **scored.details}),
        "final": results["final"],
        "privacy": results.get("privacy", {}),
        "stopped_reason": results.get("stopped_reason", "completed"),
        "training": {k: results[k] for k in ("config", "plan", "history", "wire", "time_s") if k in results},
        "time_s": {"training": t_train, "attack": t_attack},
    }
