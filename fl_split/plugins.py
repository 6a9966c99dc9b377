"""A researcher's own defence and attack: ``--defense package.module:Class`` and
``--attack package.module:Class`` (docs/plugins.md, issue 28).

:func:`resolve` is the **one** place a defence or attack name becomes what runs: a built-in name
stays a name (defences: the factory builds it, :mod:`fl_split.privacy.factory`) or becomes its
:class:`~fl_split.attacks.base.Attack` class; a plug-in string is imported and checked to be a
class implementing the project's interface — a defence subclasses
:class:`fl_split.privacy.base.Mechanism` (best: :class:`fl_split.privacy.plugin.PluginMechanism`),
an attack subclasses :class:`fl_split.attacks.base.Attack`. Anything else is one
:class:`~fl_split.errors.ConfigError` line naming the flag, the string and what is required.
``fl-split attack``, the Python API and ``fl-split bench`` call it; the privacy factory (a lower
layer, which must not import this module back) calls its defence half,
:func:`fl_split.privacy.plugin.mechanism_class`, directly.

**A plug-in is code run with the party's rights.** Importing ``package.module`` runs that module;
constructing the class runs its ``__init__``. On one machine (the local engine, an in-process
Flower simulation, ``fl-split deploy local``'s own config) the string is the user's own, typed by
the user who runs every party, so it is trusted like the rest of the command line. In a Flower
*deployment* a party (a SuperNode with ``role`` in its node-config) receives the run
configuration from the coordinator (the ServerApp): a malicious coordinator could name
``os:system``-like objects, or any importable module whose import has side effects. A deployment
node therefore loads a plug-in only when **its own operator** lists the exact string, before
anything is imported (:func:`check_node_plugins`):

* node-config ``plugins = "pkg.mod:Class,pkg.mod:Other"`` (``flower-supernode --node-config``), or
* the environment variable ``FL_SPLIT_PLUGINS`` (same syntax) of the SuperNode process.

The same rule covers ``--model package.module:function`` (a function the party calls: the same
code execution).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fl_split.errors import ConfigError

#: environment variable of a deployment node's own plug-in allow-list
ENV_ALLOW = "FL_SPLIT_PLUGINS"
#: node-config key of a deployment node's own plug-in allow-list
NODE_KEY = "plugins"

#: what an attack plug-in must be (a defence's: :data:`fl_split.privacy.plugin.REQUIRED`)
ATTACK_REQUIRED = ("a class subclassing fl_split.attacks.base.Attack: name, adversaries, run(view, opts) and "
                   "score(guess, referee, opts) (docs/plugins.md)")


def is_plugin(value: Any) -> bool:
    """``package.module:Class`` (syntax only: nothing is imported; the rule of ``--model``'s strings)."""
    from fl_split.config import is_user_model

    return is_user_model(value)


def resolve(kind: str, value: str) -> Any:
    """What ``--defense`` / ``--attack`` ``value`` names (``kind`` = "defense" or "attack").

    Defence: a built-in name is returned as it is; a plug-in string gives its class (a
    :class:`~fl_split.privacy.base.Mechanism` subclass). Attack: the :class:`Attack` subclass of a
    built-in name or of a plug-in string. Raises :class:`ConfigError` naming the flag otherwise.
    """
    if kind == "defense":
        from fl_split.config import DEFENSES

        if value in DEFENSES:
            return value
        builtins = DEFENSES
    elif kind == "attack":
        from fl_split.attacks.options import ATTACK_CLASSES, ATTACK_NAMES

        if value in ATTACK_NAMES:
            import importlib

            module, cls = ATTACK_CLASSES[value]
            return getattr(importlib.import_module(module), cls)
        builtins = ATTACK_NAMES
    else:
        raise ValueError(f"plug-in kind {kind!r}; allowed: defense, attack")
    from fl_split.privacy.plugin import REQUIRED, load_class, mechanism_class

    required = REQUIRED if kind == "defense" else ATTACK_REQUIRED
    if not is_plugin(value):
        raise ConfigError(kind, value, "one of " + ", ".join(builtins) + f" or 'package.module:Class' ({required})")
    if kind == "defense":
        return mechanism_class(value)
    from fl_split.attacks.base import Attack

    obj = load_class(kind, value, Attack, required)
    if not (isinstance(getattr(obj, "name", ""), str) and obj.name):
        raise ConfigError(kind, value, required, reason=f"{obj.__name__}.name is empty")
    return obj


# -- deployment nodes: only the operator's own allow-list --------------------------------------------
def node_allow_list(node_config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> set[str]:
    """The plug-in strings this node's operator allows: node-config ``plugins`` and ``$FL_SPLIT_PLUGINS``."""
    env = os.environ if environ is None else environ
    out: set[str] = set()
    for text in (str(node_config.get(NODE_KEY, "") or ""), str(env.get(ENV_ALLOW, "") or "")):
        out |= {p.strip() for p in text.split(",") if p.strip()}
    return out


def plugin_strings(config: Mapping[str, Any]) -> dict[str, str]:
    """``{option: string}`` of the code-naming options of a run config (kebab- or snake-case keys):
    a plug-in defence, attack, or a user model function."""
    out = {}
    for raw_key, value in config.items():
        key = str(raw_key).replace("_", "-")
        if key in ("defense", "attack", "model") and is_plugin(value):
            out[key] = str(value)
    return out


def check_node_plugins(config: Mapping[str, Any], node_config: Mapping[str, Any],
                       environ: Mapping[str, str] | None = None) -> None:
    """Refuse, **before anything is imported**, a coordinator's run config naming code this deployment
    node's operator did not allow (module docstring). A simulation node (``partition-id``, no
    ``role``) runs in the user's own process with the user's own config and is not restricted."""
    if "role" not in node_config:
        return
    allowed = node_allow_list(node_config, environ)
    for key, value in plugin_strings(config).items():
        if value not in allowed:
            raise ConfigError(key, value, f"a string this node's operator listed in node-config '{NODE_KEY}' or "
                                          f"${ENV_ALLOW} (comma-separated)",
                              reason="the coordinator's run config names code to run on this party, and a "
                                     "deployment node loads only plug-ins its own operator allows")
