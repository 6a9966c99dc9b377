"""The ground truth of a simulated run: what the attacks are scored against.

A :class:`Referee` holds every party's data of a run simulated in one process (the *world*), so it
can say how close an attack came. It is never given to an attack: attacks receive an
:class:`~fl_split.attacks.view.AdversaryView` and return a guess; the runner scores the guess with
the referee (:mod:`fl_split.attacks.runner`).

**Properties** (targets of property inference, 001 §2.3 Eq. 1) are binary facts about one party's
records. A property belongs to a *victim* party when it is computed from that party's columns
only, so an attacker cannot read it off its own data:

* the dataset's own properties (``VerticalDataset.properties``: ``credit`` ``age-over-40`` /
  ``married`` owned by the partner, ``has-records`` by the bank; ``breast-cancer``
  ``large-radius``; ``movielens`` ``gender`` / ``age-over-35`` / ``likes-drama``), owned by the
  party holding the property's column. ``digits``' ``ink-left`` compares both halves of an image,
  so it is a property of no single party and is not offered;
* ``patch-ink`` (images; 001 §5.2.1 infers "an unknown patch of image samples"): the mean ink of
  the victim's stripe over its middle rows (rows ``H/4 … 3H/4``) is above its median over the
  victim's training records;
* ``above-median:FEATURE`` (tables): the victim's encoded feature ``FEATURE`` (a name from its
  ``feature_names``; a one-hot column is its own indicator) is above its median over the
  victim's training records.
"""

from __future__ import annotations

import numpy as np
import torch

from fl_split.config import RunConfig
from fl_split.data.base import PartyData, positions_of
from fl_split.errors import ConfigError

PATCH = "patch-ink"
ABOVE_MEDIAN = "above-median:"
#: dataset properties computed from columns of several parties (offered to nobody)
MIXED = {"ink-left", "bright-left"}


class Referee:
    """Ground truth of a run: each party's data (train/test rows in the shared order), the labels,
    the properties and membership. Built by :class:`~fl_split.attacks.view.Session`."""

    def __init__(self, cfg: RunConfig, parties: dict[str, PartyData]) -> None:
        self.cfg = cfg
        self._parties = parties
        self._dataset = None

    # -- records ------------------------------------------------------------------------------------
    def _party(self, party: str) -> PartyData:
        if party not in self._parties:
            raise KeyError(f"no party {party!r}; parties are {sorted(self._parties)}")
        return self._parties[party]

    def ids(self, phase: str, positions: np.ndarray) -> np.ndarray:
        d = self._party("host")
        return (d.train_ids if phase == "train" else d.test_ids)[np.asarray(positions, dtype=np.int64)]

    def features(self, party: str, phase: str, positions: np.ndarray) -> torch.Tensor:
        """The party's encoded input rows at ``positions`` (a copy)."""
        d = self._party(party)
        if not d.has_features:
            raise ValueError(f"{party} holds no features")
        x = d.x_train if phase == "train" else d.x_test
        return x.index_select(0, torch.as_tensor(np.asarray(positions, dtype=np.int64))).clone()

    def labels(self, phase: str, positions: np.ndarray) -> np.ndarray:
        d = self._party("host")
        y = d.y_train if phase == "train" else d.y_test
        return y.numpy()[np.asarray(positions, dtype=np.int64)].copy()

    def n(self, phase: str) -> int:
        d = self._party("host")
        return len(d.train_ids if phase == "train" else d.test_ids)

    def is_image(self, party: str) -> bool:
        return self._party(party).x_train.dim() == 4

    # -- properties -------------------------------------------------------------------------------
    @property
    def dataset(self):
        if self._dataset is None:
            from fl_split.data.registry import load_dataset

            if self.cfg.data:  # own tables (docs/datasets.md) declare no property targets
                raise ConfigError("data", self.cfg.data, "a built-in --dataset for property targets",
                                  reason="own tables declare no property columns")

            self._dataset = load_dataset(self.cfg.dataset, self.cfg.data_root)
        return self._dataset

    def owner(self, column: str) -> str | None:
        """The party holding raw column ``column`` (a one-hot column ``c=v`` belongs to ``c``'s owner)."""
        for party, d in self._parties.items():
            names = d.feature_names
            if column in names or any(n.startswith(f"{column}=") for n in names):
                return party
        return None

    def property_names(self, party: str) -> list[str]:
        """Properties of ``party``'s data (see the module docstring), the dataset's first."""
        d = self._party(party)
        if not d.has_features:
            return []
        names = [name for name, (col, _) in self.dataset.properties.items()
                 if name not in MIXED and self.owner(col) == party]
        if d.x_train.dim() == 4:
            names.append(PATCH)
        return names

    def check_property(self, name: str, party: str) -> None:
        """Raise a :class:`ConfigError` on ``--property`` unless ``name`` is a property of ``party``."""
        d = self._party(party)
        offered = self.property_names(party)
        table = d.has_features and d.x_train.dim() == 2
        allowed = ", ".join(offered) or "none"
        if table:
            allowed += f", or {ABOVE_MEDIAN}FEATURE with FEATURE one of {party}'s features " \
                       f"({', '.join(d.feature_names[:6])}{', …' if len(d.feature_names) > 6 else ''})"
        if name in offered:
            return
        if table and name.startswith(ABOVE_MEDIAN) and name[len(ABOVE_MEDIAN):] in d.feature_names:
            return
        reason = None
        if name in self.dataset.properties:
            col = self.dataset.properties[name][0]
            reason = ("it compares columns of several parties" if name in MIXED
                      else f"its column '{col}' belongs to {self.owner(col)}, not to {party}")
        raise ConfigError("property", name, f"a property of {party}'s data: {allowed}", reason=reason)

    def property(self, name: str, party: str, phase: str, positions: np.ndarray) -> np.ndarray:
        """The binary property ``name`` of ``party``'s records at ``positions`` (0/1 int64)."""
        self.check_property(name, party)
        positions = np.asarray(positions, dtype=np.int64)
        d = self._party(party)
        if name == PATCH:
            def score(x: torch.Tensor) -> np.ndarray:
                h = x.shape[2]
                lo, hi = h // 4, h - h // 4
                return x[:, :, lo:hi, :].mean(dim=(1, 2, 3)).numpy()
            threshold = float(np.median(score(d.x_train)))
            x = d.x_train if phase == "train" else d.x_test
            return (score(x)[positions] > threshold).astype(np.int64)
        if name.startswith(ABOVE_MEDIAN):
            j = d.feature_names.index(name[len(ABOVE_MEDIAN):])
            col = d.x_train[:, j].numpy()
            # a one-hot (0/1) column is its own indicator; otherwise above the training median
            threshold = 0.5 if set(np.unique(col)) <= {0.0, 1.0} else float(np.median(col))
            x = d.x_train if phase == "train" else d.x_test
            return (x[:, j].numpy()[positions] > threshold).astype(np.int64)
        _, values = self.dataset.properties[name]
        rows = positions_of(self.dataset.ids, self.ids(phase, positions), who="referee")
        return np.asarray(values, dtype=np.int64)[rows]

    def default_property(self, party: str) -> str:
        names = self.property_names(party)
        if names:
            return names[0]
        d = self._party(party)
        if d.has_features and d.x_train.dim() == 2:
            return ABOVE_MEDIAN + d.feature_names[0]
        raise ConfigError("property", "auto", "a property of the victim's data",
                          reason=f"{party} has no property to infer")
