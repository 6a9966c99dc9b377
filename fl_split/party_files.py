"""One party's deployment data in one file: ``host.npz``, ``guest-1.npz``, …

In a real deployment each organisation runs its own Flower SuperNode with only its own data.
``fl-split export-parties`` prepares the shipped / downloaded dataset the same way a simulation
does (:func:`fl_split.builder.prepare_data`: shared-ID split, column partition, each party's own
alignment and encoding) and writes one file per party, so a SuperNode gets its party's slice and
nothing else (a guest file holds no labels).

A file is a NumPy ``.npz`` (loaded with ``allow_pickle=False``) holding the party's
``train_ids``, ``test_ids``, ``x_train`` / ``x_test`` (feature holders) and ``y_train`` /
``y_test`` (host only), plus a JSON document ``__meta__`` with the party's own metadata and the
run's **public facts**: dataset, the data options it was prepared with, the sizes of the shared
train/test ID lists, every feature holder's input shape (widths are public metadata in VFL) and
the metric. The host's file adds the number of classes (the top model's output size).

From the facts any node — and the coordinator, which never sees data — rebuilds the run plan
(:func:`plan_from_facts`), identical to :func:`fl_split.builder.plan_run` on the full data.

**Tables an organisation actually has** (``--format csv|parquet``): ``guest-1.csv`` holds the
party's rows *in its own order* with an ``id`` column, its (encoded) feature columns and, for the
host only, a ``label`` column; ``guest-1.meta.json`` beside it holds the same metadata and public
facts as an npz file, plus the shared train/test ID lists (public: the ID set is known to every
party). A party aligns its rows to the shared lists by ID (extra rows are ignored). Parquet needs
``pyarrow``.

**Checks before any training or release** (each error names the party and the problem): a missing
or unreadable file (:class:`~fl_split.errors.DataError`, never another exception: the loaders are
fuzzed), a file of another party, IDs that do not align (a shared ID missing from its rows,
duplicated IDs), non-finite values, shapes that disagree with the facts, labels in a guest's file,
options that differ from the export (:func:`check_facts`, a ``ConfigError`` naming the option) and,
across parties (:func:`check_parties`), facts that disagree (another export) and feature columns
claimed by two parties (their names are public metadata here).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_split.config import DATA_KEYS, RunConfig, key_of
from fl_split.errors import ConfigError, DataError
from fl_split.secure_files import create_private, private_dir

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI imports this module to build its parser
    from fl_split.data.base import PartyData

FORMAT = "fl_split.party/1"
#: file formats ``export-parties --format`` writes and :func:`load_party` reads (by suffix)
FORMATS = ("npz", "csv", "parquet")
ID_COLUMN = "id"
LABEL_COLUMN = "label"

#: options that decide what a party's data file contains; a run must use the same values


@dataclass
class PublicFacts:
    """What every party may know about the run's data (and all the coordinator needs)."""

    dataset: str
    task: str
    metric: str
    n_train: int
    n_test: int
    input_shapes: dict[str, tuple[int, ...]]
    data_config: dict[str, Any]
    #: the number of classes; only in the host's file (guests do not need the label space)
    num_classes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "task": self.task, "metric": self.metric, "n_train": self.n_train,
                "n_test": self.n_test, "input_shapes": {p: list(s) for p, s in self.input_shapes.items()},
                "data_config": dict(self.data_config), "num_classes": self.num_classes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PublicFacts":
        return cls(dataset=str(d["dataset"]), task=str(d["task"]), metric=str(d["metric"]),
                   n_train=int(d["n_train"]), n_test=int(d["n_test"]),
                   input_shapes={str(p): tuple(int(x) for x in s) for p, s in d["input_shapes"].items()},
                   data_config=dict(d["data_config"]),
                   num_classes=None if d.get("num_classes") is None else int(d["num_classes"]))

    def without_labels(self) -> "PublicFacts":
        return PublicFacts(self.dataset, self.task, self.metric, self.n_train, self.n_test,
                           dict(self.input_shapes), dict(self.data_config), None)


def data_config(cfg: RunConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in DATA_KEYS}


def public_facts(cfg: RunConfig, prepared) -> PublicFacts:
    """The public facts of ``prepared`` (a :class:`fl_split.builder.PreparedData`)."""
    from fl_split.data.base import feature_parties

    holders = feature_parties(cfg.guests, cfg.host_features)
    return PublicFacts(dataset=prepared.dataset, task=prepared.task, metric=prepared.metric,
                       n_train=len(prepared.train_ids), n_test=len(prepared.test_ids),
                       input_shapes={p: tuple(prepared.parties[p].input_shape) for p in holders},
                       data_config=data_config(cfg), num_classes=int(prepared.num_classes))


def ids_digest(train_ids, test_ids) -> str:
    """A digest of the shared train and test ID lists, in order (public)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for a in (train_ids, test_ids):
        arr = np.ascontiguousarray(np.asarray(a), dtype="<i8")
        h.update(len(arr).to_bytes(8, "little"))
        h.update(arr.tobytes())
    return h.hexdigest()


def check_facts(cfg: RunConfig, facts: PublicFacts, source: str) -> None:
    """Raise :class:`ConfigError` if ``cfg`` asks for other data than ``facts`` describe."""
    for k in DATA_KEYS:
        have, want = facts.data_config.get(k, "auto" if k == "task" else None), getattr(cfg, k)
        if have != want:
            raise ConfigError(key_of(k), want, repr(have),
                              reason=f"{source} was exported with {key_of(k)}={have!r}; re-export the "
                                     f"party files or run with the same value")


def plan_from_facts(cfg: RunConfig, facts: PublicFacts):
    """The :class:`~fl_split.builder.RunPlan` of ``cfg`` from public facts alone (no data)."""
    from fl_split.builder import plan_run
    from fl_split.data.base import feature_parties

    holders = feature_parties(cfg.guests, cfg.host_features)
    missing = [p for p in holders if p not in facts.input_shapes]
    if missing:
        raise DataError(f"the run's public facts have no input shape for {missing} "
                        f"(they list {sorted(facts.input_shapes)})")
    # plan_run reads only these public attributes of its ``prepared`` argument
    stand_in = SimpleNamespace(
        parties={p: SimpleNamespace(input_shape=tuple(s)) for p, s in facts.input_shapes.items()},
        train_ids=range(facts.n_train), test_ids=range(facts.n_test),
        num_classes=facts.num_classes or 0, metric=facts.metric, task=facts.task)
    return plan_run(cfg, stand_in)


# -- files -------------------------------------------------------------------------------------
def _meta(data: "PartyData", facts: PublicFacts) -> dict[str, Any]:
    is_host = data.party == "host"
    return {"format": FORMAT, "party": data.party, "feature_names": list(data.feature_names),
            "task": data.task, "metric": data.metric, "padded": bool(data.padded),
            "num_classes": int(data.num_classes) if is_host else 0,
            "ids_digest": ids_digest(data.train_ids, data.test_ids),
            # the party's own fitted encoding of its raw columns (statistics and categories of its training
            # rows: its private data, in its own file only), so a later run or predict applies the same one
            "encoder": data.encoder.to_dict() if data.encoder is not None else None,
            "facts": (facts if is_host else facts.without_labels()).to_json()}


def _encoder(meta: dict[str, Any], party: str, path: Path):
    """The fitted :class:`~fl_split.data.encoding.ColumnEncoder` a file's metadata holds, or ``None``."""
    d = meta.get("encoder")
    if d is None:
        return None
    from fl_split.data.encoding import ColumnEncoder

    if not isinstance(d, dict):
        raise DataError(f"{party}: {path}: damaged encoder (not a JSON object)")
    enc = ColumnEncoder.from_dict(d, where=f"{party}: {path}")
    if enc.output_names != [str(n) for n in meta["feature_names"]] and not meta.get("padded"):
        raise DataError(f"{party}: {path}: the encoder's columns are not the file's feature names")
    return enc


def _no_labels_in_guest(data: "PartyData") -> None:
    if data.party != "host" and (data.y_train is not None or data.y_test is not None):
        raise ValueError(f"{data.party}: a guest's data must not hold labels")


def save_party(path: str | os.PathLike, data: "PartyData", facts: PublicFacts) -> Path:
    """Write ``data`` (one party) and the public ``facts`` to ``path`` (``.npz``).

    A guest's file never contains labels nor the number of classes."""
    path = Path(path)
    _no_labels_in_guest(data)
    is_host = data.party == "host"
    arrays: dict[str, np.ndarray] = {
        "train_ids": np.asarray(data.train_ids, np.int64), "test_ids": np.asarray(data.test_ids, np.int64)}
    if data.x_train is not None:
        arrays["x_train"] = data.x_train.numpy()
        arrays["x_test"] = data.x_test.numpy()
    if is_host:
        arrays["y_train"] = data.y_train.numpy()
        arrays["y_test"] = data.y_test.numpy()
    arrays["__meta__"] = np.frombuffer(json.dumps(_meta(data, facts)).encode("utf-8"), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = create_private(path.with_name(f".{path.name}.tmp.npz"))  # 0600 before the data goes in
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def _feature_columns(data: "PartyData") -> list[str]:
    """Column names of the party's flattened features in a table file (unique, never id/label)."""
    if data.x_train is None:
        return []
    shape = tuple(data.x_train.shape[1:])
    names = list(data.feature_names)
    if len(shape) == 3:  # an image stripe (C, H, W): W pixel columns named by the dataset
        c, h, w = shape
        cols = names if len(names) == w else [str(j) for j in range(w)]
        out = [f"c{ci}_r{hi}_col{cols[wi]}" for ci in range(c) for hi in range(h) for wi in range(w)]
    else:
        width = int(np.prod(shape))
        out = names if len(names) == width else [f"x{j}" for j in range(width)]
    seen: dict[str, int] = {}
    unique = []
    for name in out:
        base = name if name not in (ID_COLUMN, LABEL_COLUMN) else f"feature:{name}"
        n = seen.get(base, 0)
        seen[base] = n + 1
        unique.append(base if n == 0 else f"{base}#{n}")
    return unique


def save_party_table(path: str | os.PathLike, data: "PartyData", facts: PublicFacts, seed: int = 0) -> Path:
    """Write ``data`` as a table an organisation would hold (``.csv`` or ``.parquet``): its train and
    test rows in its own order (seeded by ``seed`` and the party), an ``id`` column, its feature
    columns and — host only — a ``label`` column; metadata and facts go to ``<party>.meta.json``."""
    import pandas as pd

    from fl_split.seeding import numpy_rng

    path = Path(path)
    fmt = path.suffix.lstrip(".")
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"{path}: a table file ends in .csv or .parquet")
    _no_labels_in_guest(data)
    ids = np.concatenate([np.asarray(data.train_ids, np.int64), np.asarray(data.test_ids, np.int64)])
    order = numpy_rng(seed, "file-rows", data.party).permutation(len(ids))
    cols = {ID_COLUMN: ids[order]}
    features = _feature_columns(data)
    if features:
        x = np.concatenate([data.x_train.numpy().reshape(len(data.train_ids), -1),
                            data.x_test.numpy().reshape(len(data.test_ids), -1)])[order]
        cols.update({name: x[:, j] for j, name in enumerate(features)})
    if data.party == "host":
        cols[LABEL_COLUMN] = np.concatenate([data.y_train.numpy(), data.y_test.numpy()]).astype(np.int64)[order]
    frame = pd.DataFrame(cols)
    meta = {**_meta(data, facts), "data_file": path.name, "data_format": fmt, "id_column": ID_COLUMN,
            "label_column": LABEL_COLUMN if data.party == "host" else None, "feature_columns": features,
            "input_shape": list(data.input_shape), "train_ids": np.asarray(data.train_ids).tolist(),
            "test_ids": np.asarray(data.test_ids).tolist()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = create_private(path.with_name(f".{path.name}.tmp"))  # 0600 before the data goes in
    if fmt == "csv":
        frame.to_csv(tmp, index=False, float_format="%.9g")
    else:
        frame.to_parquet(tmp, index=False, engine="pyarrow")
    os.replace(tmp, path)
    meta_path = meta_path_of(path)
    tmp_meta = create_private(meta_path.with_name(f".{meta_path.name}.tmp"))
    tmp_meta.write_text(json.dumps(meta))
    os.replace(tmp_meta, meta_path)
    return path


def meta_path_of(path: str | os.PathLike) -> Path:
    """``guest-1.csv`` → ``guest-1.meta.json``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.meta.json")


def format_of(path: str | os.PathLike) -> str:
    fmt = Path(path).suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise DataError(f"party data file {str(path)!r}: unknown format {fmt or '(no suffix)'!r}; "
                        f"allowed: {', '.join('.' + f for f in FORMATS)}")
    return fmt


def load_party(path: str | os.PathLike, party: str | None = None) -> tuple["PartyData", PublicFacts]:
    """Read one party's file (``.npz``, ``.csv`` or ``.parquet``, by suffix) and check it.

    ``party``: the party this file must belong to. Anything wrong — a missing, unreadable, foreign
    or inconsistent file — is a :class:`DataError` naming the party and the problem."""
    path = Path(path).expanduser()
    who = party or path.stem
    fmt = format_of(path)
    if not path.is_file():
        raise DataError(f"{who}: party data file {str(path)!r} does not exist (node-config 'data-path'; "
                        f"write the files with `fl-split export-parties`)")
    try:
        data, facts, digest = _load_npz(path) if fmt == "npz" else _load_table(path, fmt, who)
    except DataError:
        raise
    except MemoryError:
        raise DataError(f"{who}: {path}: declares arrays too large to load; not an fl_split party file") from None
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, the answer is a DataError
        raise DataError(f"{who}: {path}: not an fl_split party file ({type(exc).__name__}: {exc})"[:500]) from None
    if party is not None and data.party != party:
        raise DataError(f"{party}: {path} holds {data.party}'s data, not {party}'s")
    _check_data(data, facts, path, digest)
    return data, facts


def _parse_meta(meta: Any, path: Path) -> tuple[dict, PublicFacts]:
    if not isinstance(meta, dict):
        raise DataError(f"{path}: metadata is not a JSON object")
    if meta.get("format") != FORMAT:
        raise DataError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    party = meta.get("party")
    if not isinstance(party, str) or not (party == "host" or (party.startswith("guest-") and party[6:].isdigit())):
        raise DataError(f"{path}: metadata names party {party!r}; allowed: host or guest-<g>")
    if not isinstance(meta.get("feature_names"), list) or not isinstance(meta.get("facts"), dict):
        raise DataError(f"{party}: {path}: metadata lacks feature_names or facts")
    try:
        facts = PublicFacts.from_json(meta["facts"])
        int(meta["num_classes"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataError(f"{party}: {path}: damaged public facts ({type(exc).__name__}: {exc})") from None
    return meta, facts


def _load_npz(path: Path) -> tuple["PartyData", PublicFacts, str]:
    import torch

    from fl_split.data.base import PartyData

    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if "__meta__" not in arrays:
        raise DataError(f"{path}: not an fl_split party file (no __meta__)")
    meta, facts = _parse_meta(json.loads(arrays.pop("__meta__").tobytes().decode("utf-8")), path)
    for k in ("train_ids", "test_ids"):
        if k not in arrays:
            raise DataError(f"{meta['party']}: {path}: no {k}")

    def tensor(name: str) -> "torch.Tensor | None":
        return torch.from_numpy(np.ascontiguousarray(arrays[name])) if name in arrays else None

    data = PartyData(party=str(meta["party"]), train_ids=_int_ids(arrays["train_ids"], meta["party"], path),
                     test_ids=_int_ids(arrays["test_ids"], meta["party"], path), x_train=tensor("x_train"),
                     x_test=tensor("x_test"), y_train=tensor("y_train"), y_test=tensor("y_test"),
                     feature_names=[str(n) for n in meta["feature_names"]], num_classes=int(meta["num_classes"]),
                     task=str(meta.get("task", facts.task)), metric=str(meta.get("metric", facts.metric)),
                     padded=bool(meta.get("padded", False)), encoder=_encoder(meta, str(meta["party"]), path))
    return data, facts, str(meta.get("ids_digest", ""))


def _int_ids(a: Any, party: str, path: Path) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise DataError(f"{party}: {path}: IDs must be a list of integers, got dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64)


def _load_table(path: Path, fmt: str, who: str) -> tuple["PartyData", PublicFacts, str]:
    import pandas as pd
    import torch

    from fl_split.data.base import PartyData, positions_of

    meta_path = meta_path_of(path)
    if not meta_path.is_file():
        raise DataError(f"{who}: {path} has no metadata file {meta_path.name} beside it (written by "
                        f"`fl-split export-parties`)")
    try:
        meta_raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DataError(f"{who}: {meta_path}: not JSON ({type(exc).__name__})") from None
    meta, facts = _parse_meta(meta_raw, meta_path)
    party = meta["party"]
    id_col = meta.get("id_column", ID_COLUMN)
    label_col = meta.get("label_column")
    features = meta.get("feature_columns")
    shape = meta.get("input_shape")
    if not (isinstance(id_col, str) and isinstance(features, list) and all(isinstance(f, str) for f in features)
            and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
            and (label_col is None or isinstance(label_col, str))):
        raise DataError(f"{party}: {meta_path}: damaged column description")
    if party != "host" and label_col is not None:
        raise DataError(f"{party}: {meta_path} declares a label column; a guest's file must not hold labels")
    train_ids = _int_ids(meta.get("train_ids"), party, meta_path)
    test_ids = _int_ids(meta.get("test_ids"), party, meta_path)
    if fmt == "csv":
        frame = pd.read_csv(path, low_memory=False)
    else:
        frame = pd.read_parquet(path, engine="pyarrow")
    wanted = [id_col, *features, *([label_col] if label_col else [])]
    missing = [c for c in wanted if c not in frame.columns]
    if missing:
        shown = ", ".join(repr(c) for c in missing[:5])
        raise DataError(f"{party}: {path} lacks the column(s) {shown}{' …' if len(missing) > 5 else ''} its metadata "
                        f"lists")
    if party != "host" and LABEL_COLUMN in frame.columns and LABEL_COLUMN not in features:
        raise DataError(f"{party}: {path} has a {LABEL_COLUMN!r} column; a guest's file must not hold labels")
    ids = pd.to_numeric(frame[id_col], errors="coerce")
    if ids.isna().any() or not np.all(np.asarray(ids) == np.round(np.asarray(ids))):
        raise DataError(f"{party}: {path}: column {id_col!r} holds values that are not integer IDs")
    ids = np.asarray(ids, dtype=np.int64)
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][:5]
        raise DataError(f"{party}: {path}: IDs {', '.join(map(str, dup))} appear more than once; each row needs "
                        f"its own ID")
    who_rows = f"{party} ({path.name})"
    train_pos = positions_of(ids, train_ids, who=who_rows)
    test_pos = positions_of(ids, test_ids, who=who_rows)
    x_all = None
    if features:
        block = frame[features]
        bad = [c for c in features if not pd.api.types.is_numeric_dtype(block[c])]
        if bad:
            raise DataError(f"{party}: {path}: column(s) {bad[:5]} are not numeric")
        x_all = block.to_numpy(dtype=np.float64).astype(np.float32)
        if int(np.prod(shape)) != x_all.shape[1]:
            raise DataError(f"{party}: {meta_path}: input shape {shape} does not fit {x_all.shape[1]} feature columns")

    def part(pos: np.ndarray) -> "torch.Tensor | None":
        if x_all is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(x_all[pos].reshape(len(pos), *shape)))

    y_train = y_test = None
    if label_col:
        y = pd.to_numeric(frame[label_col], errors="coerce")
        if y.isna().any() or not np.all(np.asarray(y) == np.round(np.asarray(y))):
            raise DataError(f"{party}: {path}: column {label_col!r} holds values that are not class labels")
        y = np.asarray(y, dtype=np.int64)
        y_train, y_test = torch.from_numpy(y[train_pos]), torch.from_numpy(y[test_pos])
    data = PartyData(party=party, train_ids=train_ids, test_ids=test_ids, x_train=part(train_pos), x_test=part(test_pos),
                     y_train=y_train, y_test=y_test, feature_names=[str(n) for n in meta["feature_names"]],
                     num_classes=int(meta["num_classes"]), task=str(meta.get("task", facts.task)),
                     metric=str(meta.get("metric", facts.metric)), padded=bool(meta.get("padded", False)),
                     encoder=_encoder(meta, party, meta_path))
    return data, facts, str(meta.get("ids_digest", ""))


def _check_data(data: "PartyData", facts: PublicFacts, path: Path, digest: str = "") -> None:
    """Consistency of one party's loaded data with itself and with its facts."""
    import torch

    p = data.party
    if data.party != "host" and (data.y_train is not None or data.y_test is not None):
        raise DataError(f"{p}: {path} holds labels; a guest's file must not")
    if len(data.train_ids) != facts.n_train or len(data.test_ids) != facts.n_test:
        raise DataError(f"{p}: {path} has {len(data.train_ids)}/{len(data.test_ids)} train/test IDs, its facts say "
                        f"{facts.n_train}/{facts.n_test}")
    for name, ids in (("train", data.train_ids), ("test", data.test_ids)):
        if len(np.unique(ids)) != len(ids):
            raise DataError(f"{p}: {path}: the shared {name} ID list has duplicates")
    if np.intersect1d(data.train_ids, data.test_ids).size:
        raise DataError(f"{p}: {path}: IDs in both the train and the test list")
    if digest and ids_digest(data.train_ids, data.test_ids) != digest:
        raise DataError(f"{p}: {path}: its ID lists do not match the digest in its metadata (damaged or edited file)")
    if (data.x_train is None) != (data.x_test is None):
        raise DataError(f"{p}: {path}: features for one split only")
    if data.x_train is not None:
        for name, x, ids in (("x_train", data.x_train, data.train_ids), ("x_test", data.x_test, data.test_ids)):
            if x.dtype != torch.float32 or x.shape[0] != len(ids):
                raise DataError(f"{p}: {path}: {name} is {x.dtype} with {x.shape[0]} rows; expected float32 with "
                                f"{len(ids)} rows")
            if x.numel() and not bool(torch.isfinite(x).all()):
                raise DataError(f"{p}: {path}: {name} holds NaN or infinite values")
        want = facts.input_shapes.get(p)
        if want is not None and tuple(data.x_train.shape[1:]) != tuple(want):
            raise DataError(f"{p}: {path}: features of shape {tuple(data.x_train.shape[1:])}, its facts say {tuple(want)}")
        if tuple(data.x_test.shape[1:]) != tuple(data.x_train.shape[1:]):
            raise DataError(f"{p}: {path}: train and test features differ in shape")
    if p == "host":
        if data.y_train is None or data.y_test is None:
            raise DataError(f"host: {path} holds no labels")
        k = data.num_classes
        for name, y, ids in (("y_train", data.y_train, data.train_ids), ("y_test", data.y_test, data.test_ids)):
            if y.dtype != torch.int64 or y.ndim != 1 or len(y) != len(ids):
                raise DataError(f"host: {path}: {name} must be {len(ids)} int64 labels")
            if len(y) and (int(y.min()) < 0 or int(y.max()) >= k):
                raise DataError(f"host: {path}: {name} has labels outside 0..{k - 1}")


def check_parties(loaded: dict[str, tuple["PartyData", PublicFacts]], expected: list[str] | None = None) -> None:
    """Cross-check the parties' files before any training: the expected parties, the same export
    (data options, sizes, shared ID lists, input shapes) and no feature column claimed twice."""
    if expected is not None:
        missing = [p for p in expected if p not in loaded]
        if missing:
            raise DataError(f"no data file for {', '.join(missing)}")
    items = sorted(loaded.items(), key=lambda kv: (kv[0] != "host", kv[0]))
    if not items:
        return
    ref_party, (ref_data, ref) = items[0]
    ref_ids = ids_digest(ref_data.train_ids, ref_data.test_ids)
    for party, (data, facts) in items[1:]:
        for what, a, b in (("data options", facts.data_config, ref.data_config), ("dataset", facts.dataset, ref.dataset),
                           ("split sizes", (facts.n_train, facts.n_test), (ref.n_train, ref.n_test)),
                           ("shared ID lists", ids_digest(data.train_ids, data.test_ids), ref_ids),
                           ("feature holders' input shapes", facts.input_shapes, ref.input_shapes)):
            if a != b:
                raise DataError(f"{party}: its file disagrees with {ref_party}'s about the {what} ({a!r} vs {b!r}); "
                                f"were they exported together?")
    owner: dict[str, str] = {}
    for party, (data, _) in items:
        clash = []
        for name in data.feature_names:
            if name.startswith("<pad"):
                continue
            if name in owner and owner[name] != party:
                clash.append(name)
            owner.setdefault(name, party)
        if clash:
            others = sorted({owner[c] for c in clash})
            raise DataError(f"{party}: feature column(s) {clash[:5]} are also {', '.join(others)}'s; each column "
                            f"belongs to one party")


def load_parties(cfg: RunConfig, directory: str | os.PathLike) -> dict[str, tuple["PartyData", PublicFacts]]:
    """Each party's own file from ``directory`` (``host.*``, ``guest-1.*``, …, whichever format is
    there), checked against ``cfg`` and against each other, before anything is built."""
    d = Path(directory).expanduser()
    out: dict[str, tuple] = {}
    for party in cfg.parties:
        found = [d / f"{party}.{f}" for f in FORMATS if (d / f"{party}.{f}").is_file()]
        if not found:
            raise DataError(f"{party}: no data file in {str(d)!r} (looked for {party}.npz, .csv, .parquet; write "
                            f"them with `fl-split export-parties`)")
        if len(found) > 1:
            raise DataError(f"{party}: several data files in {str(d)!r} ({', '.join(p.name for p in found)}); keep one")
        data, facts = load_party(found[0], party)
        check_facts(cfg, facts, f"{party}'s file {found[0].name}")
        out[party] = (data, facts)
    check_parties(out, cfg.parties)
    return out


def parties_from_files(cfg: RunConfig, directory: str | os.PathLike, private_seed: int | None = None):
    """``(host, guests, plan)`` of the local engine, each party built from its own file only."""
    from fl_split.builder import make_guest, make_host

    loaded = load_parties(cfg, directory)
    host_data, host_facts = loaded["host"]
    plan = plan_from_facts(cfg, host_facts)
    host = make_host(plan, host_data, private_seed=private_seed)
    # a guest plans from its own file's facts (they lack the label space, which only the top needs)
    guests = {g: make_guest(plan_from_facts(cfg, loaded[g][1]), loaded[g][0], g, private_seed=private_seed)
              for g in plan.guests}
    return host, guests, plan


def export_parties(cfg: RunConfig, out_dir: str | os.PathLike, fmt: str = "npz") -> dict[str, Path]:
    """Prepare ``cfg``'s data and write ``host.<fmt>``, ``guest-1.<fmt>`` … into ``out_dir``
    (``csv`` / ``parquet``: with ``<party>.meta.json`` beside each)."""
    from fl_split.builder import prepare_data

    if fmt not in FORMATS:
        raise ConfigError("format", fmt, ", ".join(FORMATS))
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ConfigError("format", fmt, "npz or csv", reason="parquet needs the pyarrow package") from None
    if cfg.one_shot:
        raise ConfigError("one-shot", True, "false", reason="party files hold private data only; one-shot "
                          "pretraining needs the public records and runs in simulation")
    prepared = prepare_data(cfg)
    if prepared.task == "regression":
        raise ConfigError("task", "regression", "a classification or next-item dataset for party files",
                          reason="party files hold class labels; a regression target and the host's scaling of it "
                                 "are not carried yet (docs/serving.md, Limits)")
    facts = public_facts(cfg, prepared)
    out = private_dir(Path(out_dir).expanduser())  # 0700, files 0600: the host's file holds the labels
    if fmt == "npz":
        return {p: save_party(out / f"{p}.npz", d, facts) for p, d in prepared.parties.items()}
    return {p: save_party_table(out / f"{p}.{fmt}", d, facts, seed=cfg.seed) for p, d in prepared.parties.items()}
