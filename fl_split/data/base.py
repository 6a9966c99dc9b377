"""Vertical datasets: the raw table or image set, its partition across parties, ID alignment,
and each party's own encoding.

The pipeline (spec §1, §2, §6):

1. a loader returns a :class:`VerticalDataset`: sample IDs, labels and the raw feature
   columns (a DataFrame for tables, an ``(n, C, H, W)`` array for images);
2. :func:`split_ids` draws the train/test split of the *shared ID list* from the seed;
3. :func:`partition` gives every atomic column (table column / image pixel column) to exactly
   one party and returns one :class:`PartySlice` per party, each holding its rows **in its own
   order** (as separate organisations would);
4. each party aligns its rows to the shared ID list and encodes its own columns with
   statistics from **its own training rows** (:func:`prepare_party`) — nothing about one
   party's columns reaches another;
5. optionally :func:`apply_padding` zero-pads every party's vector into the full width
   (001 Table 1 "padding"), which needs only the parties' public widths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fl_split.errors import ConfigError, DataError
from fl_split.seeding import numpy_rng

if TYPE_CHECKING:  # pandas is imported where tables are encoded: a party built from its prepared slice never needs it
    import pandas as pd

TASKS = ("classification", "next-item", "regression")


@dataclass
class VerticalDataset:
    """A dataset before partitioning. Exactly one of ``table`` / ``images`` is set.

    ``ids`` are the sample IDs (unique int64); row ``i`` of ``labels``, ``table`` and
    ``images`` belongs to ``ids[i]``. ``table`` columns are the atomic feature columns (raw,
    unencoded); ``categorical`` names the ones to one-hot encode. ``images`` are float32 in
    ``[0, 1]``; their atomic columns are the pixel columns (width positions).
    """

    name: str
    task: str
    ids: np.ndarray
    labels: np.ndarray
    num_classes: int
    table: pd.DataFrame | None = None
    categorical: tuple[str, ...] = ()
    images: np.ndarray | None = None
    #: ``groups(P) -> [[columns of party 0], …]`` overriding the contiguous default split.
    default_groups: Callable[[int], list[list[str]]] | None = None
    #: ``(train_ids, test_ids)`` fixed by the dataset (e.g. a temporal split) instead of the seed.
    fixed_split: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None
    #: binary properties of samples, targets of property-inference attacks: name -> (owner column, values)
    properties: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)
    metric: str = "accuracy"
    description: str = ""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise DataError(f"{self.name}: task {self.task!r} is not one of {TASKS}")
        if (self.table is None) == (self.images is None):
            raise DataError(f"{self.name}: exactly one of table / images must be given")
        self.ids = np.asarray(self.ids, dtype=np.int64)
        # a regression target is a number per row (fl_split/tasks.py); classes are int64
        self.labels = np.asarray(self.labels, dtype=np.float64 if self.task == "regression" else np.int64)
        n = len(self.ids)
        if len(np.unique(self.ids)) != n:
            raise DataError(f"{self.name}: sample IDs are not unique")
        rows = len(self.table) if self.table is not None else len(self.images)
        if len(self.labels) != n or rows != n:
            raise DataError(f"{self.name}: {n} IDs but {len(self.labels)} labels and {rows} feature rows")
        if self.images is not None:
            if self.images.ndim != 4:
                raise DataError(f"{self.name}: images must be (n, C, H, W), got shape {self.images.shape}")
            self.images = np.ascontiguousarray(self.images, dtype=np.float32)
        else:
            missing = [c for c in self.categorical if c not in self.table.columns]
            if missing:
                raise DataError(f"{self.name}: categorical columns {missing} are not in the table")
            self.table = self.table.reset_index(drop=True)

    @property
    def kind(self) -> str:
        return "image" if self.images is not None else "table"

    @property
    def columns(self) -> list[str]:
        """The atomic columns, in canonical order (pixel columns are ``'0'…'W-1'``)."""
        if self.images is not None:
            return [str(i) for i in range(self.images.shape[3])]
        return [str(c) for c in self.table.columns]

    def subset(self, ids: np.ndarray) -> "VerticalDataset":
        """The same dataset restricted to ``ids`` (in that order)."""
        pos = positions_of(self.ids, ids, who=self.name)
        return VerticalDataset(
            name=self.name, task=self.task, ids=self.ids[pos], labels=self.labels[pos],
            num_classes=self.num_classes,
            table=None if self.table is None else self.table.iloc[pos].reset_index(drop=True),
            categorical=self.categorical,
            images=None if self.images is None else self.images[pos],
            default_groups=self.default_groups, fixed_split=self.fixed_split,
            properties={k: (owner, v[pos]) for k, (owner, v) in self.properties.items()},
            metric=self.metric, description=self.description,
        )


def positions_of(have_ids: np.ndarray, want_ids: np.ndarray, who: str = "party") -> np.ndarray:
    """Row positions in ``have_ids`` of each of ``want_ids`` (the ID alignment step).

    Raises :class:`DataError` naming a few missing IDs if some are absent; extra rows in
    ``have_ids`` are fine (they are simply not used).
    """
    have_ids = np.asarray(have_ids, dtype=np.int64)
    want_ids = np.asarray(want_ids, dtype=np.int64)
    order = np.argsort(have_ids, kind="stable")
    sorted_ids = have_ids[order]
    idx = np.searchsorted(sorted_ids, want_ids)
    idx_clipped = np.minimum(idx, max(len(sorted_ids) - 1, 0))
    found = (len(sorted_ids) > 0) & (sorted_ids[idx_clipped] == want_ids) if len(sorted_ids) else np.zeros(len(want_ids), bool)
    if not np.all(found):
        missing = want_ids[~found]
        shown = ", ".join(str(i) for i in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise DataError(f"{who}: {len(missing)} shared IDs are missing from its rows: {shown}{more}")
    return order[idx_clipped]


def split_ids(ds: VerticalDataset, test_fraction: float, seed: int, limit: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/test split of the shared IDs.

    The IDs are shuffled with a generator derived from ``seed``; ``limit > 0`` keeps only the
    first ``limit`` of them (quick runs); the last ``test_fraction`` become the test split. A
    dataset with a ``fixed_split`` (e.g. movielens' temporal split) uses it instead, and
    ``limit`` then subsamples both parts proportionally.
    """
    ids = np.sort(ds.ids)
    if ds.fixed_split is not None:
        train, test = ds.fixed_split(ids)
        if limit:
            rng = numpy_rng(seed, "limit", ds.name)
            keep = limit / len(ids)
            train = np.sort(rng.permutation(train)[: max(1, int(round(len(train) * keep)))])
            test = np.sort(rng.permutation(test)[: max(1, int(round(len(test) * keep)))])
        return np.asarray(train, np.int64), np.asarray(test, np.int64)
    return split_shared(ids, ds.name, test_fraction, seed, limit)


def split_shared(ids: np.ndarray, name: str, test_fraction: float, seed: int,
                 limit: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The seeded train/test split of a shared ID list (:func:`split_ids` without a dataset):
    the sorted IDs are permuted by a generator keyed by ``(seed, "split", name)``. Own data
    (:mod:`fl_split.data.own`) splits its aligned ID list here, so a table exported from a
    built-in dataset and run under that dataset's name gets that dataset's split."""
    ids = np.sort(np.asarray(ids, np.int64))
    perm = numpy_rng(seed, "split", name).permutation(ids)
    if limit:
        perm = perm[:limit]
    n_test = int(round(len(perm) * test_fraction))
    if n_test < 1 or n_test >= len(perm):
        raise ConfigError("test-fraction", test_fraction,
                          "a fraction leaving at least one train and one test sample",
                          reason=f"{len(perm)} samples")
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


# --------------------------------------------------------------------------------------------
# Partitioning


@dataclass
class PartySlice:
    """One party's raw data: its own columns, its rows in its own order (labels: host only)."""

    party: str
    ids: np.ndarray
    columns: list[str]
    table: pd.DataFrame | None = None
    categorical: tuple[str, ...] = ()
    images: np.ndarray | None = None
    labels: np.ndarray | None = None
    num_classes: int = 0
    task: str = "classification"
    metric: str = "accuracy"
    #: how the party encodes its raw ``table`` (an unfitted :class:`~fl_split.data.encoding.ColumnEncoder`,
    #: e.g. own data's raw-column defaults and ``--encode``); ``None``: the built-in datasets' encoding
    #: of ``categorical``
    encoder: Any = None


def parse_columns_spec(spec: str, parties: Sequence[str], all_columns: Sequence[str],
                       image: bool) -> dict[str, list[str]]:
    """Parse ``--columns`` (``'host=a,b;guest-1=c'``; images: ``'host=0:4;guest-1=4:8'``)."""
    allowed = ("'party=col,col;party=col,…' naming every feature-holding party once"
               if not image else "'party=start:stop;…' pixel-column ranges")
    owners: dict[str, list[str]] = {}
    for chunk in filter(None, (c.strip() for c in spec.split(";"))):
        if "=" not in chunk:
            raise ConfigError("columns", spec, allowed, reason=f"'{chunk}' has no '='")
        party, cols = (s.strip() for s in chunk.split("=", 1))
        if party not in parties:
            raise ConfigError("columns", spec, allowed, reason=f"unknown party '{party}', parties are {list(parties)}")
        if party in owners:
            raise ConfigError("columns", spec, allowed, reason=f"party '{party}' given twice")
        names: list[str] = []
        for item in filter(None, (c.strip() for c in cols.split(","))):
            if image and ":" in item:
                a, b = item.split(":", 1)
                try:
                    names.extend(str(i) for i in range(int(a), int(b)))
                except ValueError:
                    raise ConfigError("columns", spec, allowed, reason=f"bad range '{item}'") from None
            else:
                names.append(item)
        if not names:
            raise ConfigError("columns", spec, allowed, reason=f"party '{party}' gets no columns")
        owners[party] = names
    missing_parties = [p for p in parties if p not in owners]
    if missing_parties:
        raise ConfigError("columns", spec, allowed, reason=f"no columns for {missing_parties}")
    seen: dict[str, str] = {}
    for party, names in owners.items():
        for c in names:
            if c not in all_columns:
                raise ConfigError("columns", spec, allowed, reason=f"unknown column '{c}'")
            if c in seen:
                raise ConfigError("columns", spec, allowed, reason=f"column '{c}' given to both {seen[c]} and {party}")
            seen[c] = party
    unowned = [c for c in all_columns if c not in seen]
    if unowned:
        raise ConfigError("columns", spec, allowed, reason=f"columns {unowned[:6]} belong to no party")
    if image:
        for party, names in owners.items():
            idx = sorted(int(c) for c in names)
            if idx != list(range(idx[0], idx[-1] + 1)):
                raise ConfigError("columns", spec, allowed, reason=f"{party}'s pixel columns are not contiguous")
    return owners


def default_groups(ds: VerticalDataset, n_parties: int) -> list[list[str]]:
    """The documented default ownership: the dataset's own rule if it has one, otherwise
    contiguous, near-equal blocks of the canonical column order (party 0 = first block)."""
    if ds.default_groups is not None:
        groups = ds.default_groups(n_parties)
        if groups is not None:
            return groups
    cols = ds.columns
    return [list(block) for block in np.array_split(np.array(cols, dtype=object), n_parties)]


def feature_parties(n_guests: int, host_features: bool) -> list[str]:
    """Parties that hold features, in merge order."""
    guests = [f"guest-{i}" for i in range(1, n_guests + 1)]
    return (["host"] if host_features else []) + guests


def partition(ds: VerticalDataset, n_guests: int, host_features: bool, columns: str = "",
              seed: int = 0, shuffle_rows: bool = True) -> dict[str, PartySlice]:
    """Give every atomic column to exactly one party; returns ``{party: PartySlice}``.

    The host slice always exists (it holds the labels); with ``host_features=False`` it has no
    columns. With ``shuffle_rows`` each party gets its rows in its own seeded order, so the
    alignment step is exercised exactly as between real organisations.
    """
    holders = feature_parties(n_guests, host_features)
    n_cols = len(ds.columns)
    if n_guests < 1:
        raise ConfigError("guests", n_guests, "an integer >= 1")
    if len(holders) > n_cols:
        raise ConfigError("guests", n_guests,
                          f"at most {n_cols - int(host_features)} for dataset '{ds.name}'",
                          reason=f"{len(holders)} feature-holding parties but only {n_cols} feature columns")
    if columns:
        owners = parse_columns_spec(columns, holders, ds.columns, image=ds.kind == "image")
    else:
        owners = dict(zip(holders, default_groups(ds, len(holders))))
    slices: dict[str, PartySlice] = {}
    for party in ["host", *[f"guest-{i}" for i in range(1, n_guests + 1)]]:
        cols = owners.get(party, [])
        order = numpy_rng(seed, "rows", party).permutation(len(ds.ids)) if shuffle_rows else np.arange(len(ds.ids))
        sl = PartySlice(party=party, ids=ds.ids[order].copy(), columns=list(cols), task=ds.task, metric=ds.metric)
        if ds.images is not None and cols:
            idx = sorted(int(c) for c in cols)
            sl.images = ds.images[order][:, :, :, idx[0]: idx[-1] + 1]
        elif ds.table is not None and cols:
            sl.table = ds.table.iloc[order][cols].reset_index(drop=True)
            sl.categorical = tuple(c for c in ds.categorical if c in cols)
        if party == "host":
            sl.labels = ds.labels[order].copy()
            sl.num_classes = ds.num_classes
        slices[party] = sl
    return slices


# --------------------------------------------------------------------------------------------
# Per-party preparation


@dataclass
class PartyData:
    """A party's encoded, aligned data: row ``i`` of ``x_train`` is ``train_ids[i]``.

    ``x_*`` is ``None`` for a host without features; ``y_*`` is set for the host only.
    ``offset``/``full_width`` place this party's columns in the full vector (used by padding).
    ``encoder``: the :class:`~fl_split.data.encoding.ColumnEncoder` fitted on this party's training
    rows that produced ``x_*`` from its table (``None`` for images and a host without features); the
    party's own state, kept by party files and checkpoints, never sent.
    """

    party: str
    train_ids: np.ndarray
    test_ids: np.ndarray
    x_train: torch.Tensor | None
    x_test: torch.Tensor | None
    y_train: torch.Tensor | None = None
    y_test: torch.Tensor | None = None
    feature_names: list[str] = field(default_factory=list)
    num_classes: int = 0
    task: str = "classification"
    metric: str = "accuracy"
    padded: bool = False
    #: the party's column encoder, fitted on its own training rows (:class:`~fl_split.data.encoding.ColumnEncoder`; None for images)
    encoder: Any = None
    #: host, regression: ``(mean, sd)`` of the training labels; ``y_*`` are standardised with it (never leaves the host)
    target_scale: tuple[float, float] | None = None
    #: host, classes of an own table: the label value of class ``k`` (``None``: the classes are 0…K-1)
    classes: list | None = None

    @property
    def has_features(self) -> bool:
        return self.x_train is not None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:]) if self.x_train is not None else ()

    @property
    def width(self) -> int:
        """Size along the partitioned axis (features for tables, pixel columns for images)."""
        return int(self.x_train.shape[-1]) if self.x_train is not None else 0


def _encode_table(table: pd.DataFrame, categorical: Sequence[str], train_pos: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """The built-in datasets' encoding (:class:`~fl_split.data.encoding.ColumnEncoder`, ``policy="builtin"``):
    numeric columns standardised and ``categorical`` ones one-hot, with train-row statistics.

    Categories are those seen in this party's training rows (sorted); a category seen only
    in test rows encodes as all zeros. Missing numeric values become the train mean (0 after
    standardisation).
    """
    enc = _fit_encoder(None, table, categorical, train_pos)
    return enc.transform(table), enc.output_names


def _fit_encoder(template: Any, table: pd.DataFrame, categorical: Sequence[str], train_pos: np.ndarray):
    from fl_split.data.encoding import ColumnEncoder

    enc = template.unfitted() if template is not None else ColumnEncoder(categorical=categorical, policy="builtin")
    return enc.fit(table.iloc[train_pos])


def party_preprocessing(data: "PartyData") -> dict:
    """What ``data``'s party fitted on its own training rows to encode its columns (JSON-able; saved
    with its model part, :mod:`fl_split.serving`): its :class:`~fl_split.data.encoding.ColumnEncoder`
    (``kind: table``), ``{"kind": "image"}`` (pixels are used as they are) or ``{"kind": "none"}`` for a
    host without features; ``padded`` records 001's padding."""
    if data.encoder is not None:
        pre = {"kind": "table", **data.encoder.to_dict()}
    elif data.x_train is not None:
        pre = {"kind": "image", "columns": list(data.feature_names)}
    else:
        pre = {"kind": "none"}
    return {**pre, "padded": bool(data.padded)}


def apply_preprocessing(pre: dict, table: "pd.DataFrame | None" = None, images: np.ndarray | None = None,
                        where: str = "the saved part") -> np.ndarray:
    """The inverse direction of :func:`party_preprocessing`: encode new rows with the saved encoder.

    ``where`` opens an error about the table (``predict``: the party, its table's path and its saved part)."""
    kind = pre.get("kind")
    if kind == "table":
        from fl_split.data.encoding import ColumnEncoder

        if table is None:
            raise DataError("the saved preprocessing encodes a table, and no table was given")
        return ColumnEncoder.from_dict(pre, where).transform(table)
    if kind == "image":
        if images is None:
            raise DataError("the saved preprocessing is of images, and no images were given")
        return np.ascontiguousarray(images, dtype=np.float32)
    raise DataError(f"this party's saved part encodes no features (preprocessing {kind!r})")


def prepare_party(sl: PartySlice, train_ids: np.ndarray, test_ids: np.ndarray) -> PartyData:
    """Align ``sl`` to the shared train/test IDs and encode its columns (train statistics only)."""
    train_pos = positions_of(sl.ids, train_ids, who=sl.party)
    test_pos = positions_of(sl.ids, test_ids, who=sl.party)
    x_all: np.ndarray | None
    names: list[str] = list(sl.columns)
    encoder = None
    if sl.images is not None:
        x_all = sl.images
    elif sl.table is not None:  # every statistic from this party's training rows (train_pos) only
        encoder = _fit_encoder(sl.encoder, sl.table, sl.categorical, train_pos)
        x_all, names = encoder.transform(sl.table), encoder.output_names
    else:
        x_all = None
    pd_ = PartyData(
        party=sl.party, train_ids=np.asarray(train_ids, np.int64), test_ids=np.asarray(test_ids, np.int64),
        x_train=None if x_all is None else torch.from_numpy(np.ascontiguousarray(x_all[train_pos], dtype=np.float32)),
        x_test=None if x_all is None else torch.from_numpy(np.ascontiguousarray(x_all[test_pos], dtype=np.float32)),
        feature_names=names, num_classes=sl.num_classes, task=sl.task, metric=sl.metric, encoder=encoder,
    )
    if sl.labels is not None:
        if sl.task == "regression":  # the host standardises its target with its own training rows
            y = np.asarray(sl.labels, np.float64)
            mean, sd = float(y[train_pos].mean()), float(y[train_pos].std())
            sd = sd if sd > 1e-12 else 1.0
            pd_.target_scale = (mean, sd)
            pd_.y_train = torch.from_numpy(((y[train_pos] - mean) / sd).astype(np.float32))
            pd_.y_test = torch.from_numpy(((y[test_pos] - mean) / sd).astype(np.float32))
        else:
            pd_.y_train = torch.from_numpy(sl.labels[train_pos].astype(np.int64))
            pd_.y_test = torch.from_numpy(sl.labels[test_pos].astype(np.int64))
    return pd_


def apply_padding(parties: dict[str, PartyData]) -> dict[str, PartyData]:
    """Zero-pad each party's features into the full width (001 §2.2 "padding").

    Widths (after encoding) are public metadata: each party learns the others' widths and its
    own offset in the canonical order (host first, then guests), never their values.
    """
    holders = [p for p, d in parties.items() if d.has_features]
    widths = {p: parties[p].width for p in holders}
    full = sum(widths.values())
    out: dict[str, PartyData] = {}
    offset = 0
    for party, d in parties.items():
        if not d.has_features:
            out[party] = d
            continue
        w = widths[party]

        def pad(x: torch.Tensor, offset=offset, w=w) -> torch.Tensor:
            z = x.new_zeros((*x.shape[:-1], full))
            z[..., offset: offset + w] = x
            return z

        out[party] = PartyData(
            party=d.party, train_ids=d.train_ids, test_ids=d.test_ids, x_train=pad(d.x_train), x_test=pad(d.x_test),
            y_train=d.y_train, y_test=d.y_test,
            feature_names=[f"<pad>"] * offset + d.feature_names + ["<pad>"] * (full - offset - w),
            num_classes=d.num_classes, task=d.task, metric=d.metric, padded=True, encoder=d.encoder,
            target_scale=d.target_scale, classes=d.classes,
        )
        offset += w
    return out
