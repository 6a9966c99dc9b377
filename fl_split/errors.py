"""Exceptions meant for people (design principle 4).

Each names what was wrong, the value, and what is allowed. The CLI prints ``str(error)`` on
one line and exits with code 2; Flower parties turn them into error replies.
"""

from __future__ import annotations


class FlSplitError(Exception):
    """Base class of every error fl_split raises on purpose."""


class ConfigError(FlSplitError, ValueError):
    """A configuration value is not allowed.

    ``key`` is the option name in kebab-case (the CLI flag without ``--`` and the Flower
    run-config key), so the message reads the same on both interfaces.
    """

    #: how the message names the key: a flag (``--key``); :class:`KitConfigError` names a kit.toml key
    prefix = "--"

    def __init__(self, key: str, value: object, allowed: str, reason: str | None = None) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        self.reason = reason
        text = f"{self.prefix}{key}: got {value!r}"
        if reason:
            text += f" ({reason})"
        text += f"; allowed: {allowed}"
        super().__init__(text)


class KitConfigError(ConfigError):
    """A value in a kit's ``kit.toml`` is not allowed; the message names the file's key, not a flag
    (``kit.toml data-path: got ''; allowed: …``)."""

    prefix = "kit.toml "


class PrivateSeedError(FlSplitError, ValueError):
    """A private seed that is too short, guessable, malformed, or kept where others can read it
    (:class:`fl_split.seeding.PrivateSeed`); the CLI exits with code 2."""


class DataError(FlSplitError, ValueError):
    """Data cannot be loaded, partitioned or aligned as asked."""


class ProtocolError(FlSplitError, ValueError):
    """A wire message is malformed or not the one the receiver expects.

    Raised by the receiver *before* it touches any of its state.
    """


class BudgetExceeded(FlSplitError):
    """A release would take a party over its privacy budget; the release was refused."""

    def __init__(self, party: str, spent: float, would_be: float, budget: float, accountant: str) -> None:
        self.party = party
        self.spent = spent
        self.would_be = would_be
        self.budget = budget
        self.accountant = accountant
        super().__init__(
            f"{party}: release refused, privacy budget exhausted: epsilon would reach "
            f"{would_be:.4g} > budget {budget:.4g} ({accountant} accountant; spent so far {spent:.4g})"
        )


class PartyError(FlSplitError):
    """A party failed while handling a message (reported by the coordinator)."""

    def __init__(self, party: str, round_: int | None, message: str) -> None:
        self.party = party
        self.round = round_
        self.detail = message
        where = f" in round {round_}" if round_ is not None else ""
        super().__init__(f"{party} failed{where}: {message}")


class ReleaseOutOfRange(ProtocolError):
    """An authenticated peer sent a well-formed release that its public mechanism cannot produce
    (issue 16, ``fl_split.privacy.bounds``): e.g. values far beyond ``bound + k·σ``, off the Laplace
    grid, outside randomized response's bits, or (no defence) a batch RMS far above the peer's
    running median. Raised by the receiver *before* any of its state changes.

    ``sender``: the peer that sent it; ``receiver``: who refused it; ``what``: "activations" or
    "gradients"; ``batch``: the batch key in words; ``reason``: the statistic, its value and the
    public bound."""

    def __init__(self, sender: str, receiver: str, what: str, batch: str, round_: int | None, reason: str) -> None:
        self.sender = sender
        self.receiver = receiver
        self.what = what
        self.batch = batch
        self.round = round_
        self.reason = reason
        where = f" in round {round_}" if round_ is not None else ""
        super().__init__(f"{receiver} refused {sender}'s {what} for {batch}{where}: {reason}")
