"""Your own vertical data: one CSV / Parquet table per party (``--data host=PATH --data guest-1=PATH``)
or one table whose columns ``--columns`` assigns (``--data PATH``), with an ID column
(``--id-column``) and, at the host only, a label column (``--label-column``).

The tables go through the same pipeline as a built-in dataset (:mod:`fl_split.data.base`, spec §1,
§2, §6): each party's rows stay **in its own order**; the parties agree on a shared ID list
(``--align public``: the host's IDs, sent to every party — the built-in datasets' assumption — or
``--align psi``: the private intersection of :mod:`fl_split.psi`); the list is split into train and
test with ``--seed`` (:func:`~fl_split.data.base.split_shared`, keyed by ``--data-name``); each party
aligns its rows to it and standardises its own numeric columns with its own training rows
(:func:`~fl_split.data.base.prepare_party`). So a table exported from a built-in dataset and run
under that dataset's name (``--data-name breast-cancer``) trains to the same numbers as the
dataset itself (``tests/test_own_data.py``).

**Checks before anything is built** (one line each, naming the party, the file, the row and the
column; :class:`~fl_split.errors.DataError`, exit 2): a missing or unreadable file, a missing ID
column, an empty or non-integer ID (row), duplicate IDs (the IDs and their rows), an empty or
non-numeric feature cell (row and column; **categorical columns are refused**: one-hot encode them
first, one 0/1 column per category — a party's categories are its private data, and an encoding
fitted on one party's rows is the party's own decision), a label column in a guest's table, a host
table without labels or with one class, a feature column claimed by two parties (column names are
public metadata), a host without feature columns unless ``--no-host-features``. Labels are
classification labels: integers or strings, mapped to classes ``0 … K-1`` in sorted order of the
values the host holds for the shared IDs (the mapping and ``K`` stay with the host: only the top
model's size depends on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_split.errors import ConfigError, DataError

if TYPE_CHECKING:
    import pandas as pd

    from fl_split.config import RunConfig
    from fl_split.data.base import PartyData, PartySlice

SUFFIXES = (".csv", ".parquet")
ALLOWED = "'host=PATH;guest-1=PATH;…' naming each party of the run once (or one table PATH), files ending in .csv or .parquet"
#: ``--data node-tables`` (a Flower deployment's run config): every SuperNode reads its own table from
#: its node-config ``data-path``; the ServerApp runs the ``--align`` phase between the nodes
#: (:mod:`fl_split.flower.alignment`) before the parties are built
NODE_TABLES = "node-tables"


def parse_data_spec(spec: str) -> dict[str, str] | str:
    """``'host=a.csv;guest-1=b.csv'`` → ``{party: path}``; a spec without ``=`` is one table's path."""
    chunks = [c.strip() for c in spec.split(";") if c.strip()]
    if len(chunks) == 1 and "=" not in chunks[0]:
        return chunks[0]
    out: dict[str, str] = {}
    for chunk in chunks:
        if "=" not in chunk:
            raise ConfigError("data", spec, ALLOWED, reason=f"'{chunk}' has no 'party='")
        party, path = (s.strip() for s in chunk.split("=", 1))
        if party in out:
            raise ConfigError("data", spec, ALLOWED, reason=f"party '{party}' given twice")
        if not path:
            raise ConfigError("data", spec, ALLOWED, reason=f"no path for '{party}'")
        out[party] = path
    return out


def check_data_option(cfg: "RunConfig") -> None:
    """The rules of ``--data`` that need no file (called by :class:`~fl_split.config.RunConfig`)."""
    if cfg.party_files:
        raise ConfigError("party-files", cfg.party_files, "empty with --data",
                          reason="--data reads your tables; --party-files reads exported party files")
    if cfg.id_column == cfg.label_column:
        raise ConfigError("label-column", cfg.label_column, f"a column other than --id-column {cfg.id_column!r}")
    if cfg.data.strip() == NODE_TABLES:
        for key, value in (("columns", cfg.columns), ("padding", cfg.padding), ("one-shot", cfg.one_shot)):
            if value:
                raise ConfigError(key, value, f"{'empty' if key == 'columns' else 'false'} with --data {NODE_TABLES}",
                                  reason="each SuperNode reads its own table and knows only the others' column "
                                         "names and widths after the alignment phase")
        return
    spec = parse_data_spec(cfg.data)
    paths = [spec] if isinstance(spec, str) else list(spec.values())
    for path in paths:
        if Path(path).suffix.lower() not in SUFFIXES:
            raise ConfigError("data", cfg.data, ALLOWED, reason=f"{path!r} is neither .csv nor .parquet")
    if isinstance(spec, str):
        if cfg.align == "psi":
            raise ConfigError("align", "psi", "public with one table",
                              reason="one table already holds every party's rows under one ID; PSI aligns "
                                     "separate tables (--data host=PATH --data guest-1=PATH …)")
        return
    unknown = [p for p in spec if p not in cfg.parties]
    if unknown:
        raise ConfigError("data", cfg.data, ALLOWED, reason=f"unknown party '{unknown[0]}'; this run's parties are "
                                                            f"{', '.join(cfg.parties)} (--guests {cfg.guests})")
    missing = [p for p in cfg.parties if p not in spec]
    if missing:
        raise ConfigError("data", cfg.data, ALLOWED, reason=f"no table for {', '.join(missing)}")
    if cfg.columns:
        raise ConfigError("columns", cfg.columns, "empty with one table per party",
                          reason="each party's table holds its own columns; --columns assigns the columns of one "
                                 "table (--data PATH)")


# -- reading and checking one table ------------------------------------------------------------
def read_table(path: str, who: str) -> "pd.DataFrame":
    import pandas as pd

    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{who}: --data file {str(p)!r} does not exist")
    try:
        if p.suffix.lower() == ".csv":
            return pd.read_csv(p, low_memory=False)
        return pd.read_parquet(p)
    except ImportError:
        raise DataError(f"{who}: reading {p.name} needs the pyarrow package") from None
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, the answer is a DataError
        raise DataError(f"{who}: {p}: not a readable {p.suffix.lstrip('.')} table ({type(exc).__name__}: "
                        f"{str(exc)[:200]})") from None


def _rows(mask: np.ndarray) -> str:
    rows = np.flatnonzero(mask)[:5] + 1
    return ", ".join(str(r) for r in rows) + (" …" if int(mask.sum()) > 5 else "")


def _ids(frame: "pd.DataFrame", col: str, where: str) -> np.ndarray:
    import pandas as pd

    if col not in frame.columns:
        shown = ", ".join(repr(str(c)) for c in list(frame.columns)[:8])
        raise DataError(f"{where}: no ID column {col!r} (--id-column); its columns are {shown}"
                        f"{' …' if len(frame.columns) > 8 else ''}")
    raw = frame[col]
    missing = raw.isna().to_numpy()
    if missing.any():
        raise DataError(f"{where}: row {_rows(missing)}, column {col!r}: missing ID (rows count from 1 after the header)")
    num = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(num) | (num != np.round(num))
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise DataError(f"{where}: row {r + 1}, column {col!r}: {str(raw.iloc[r])[:40]!r} is not an integer ID")
    ids = pd.to_numeric(raw).to_numpy().astype(np.int64)
    uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][:3]
        rows = "; ".join(f"ID {d} in rows {_rows(ids == d)}" for d in dup)
        raise DataError(f"{where}: duplicate IDs in column {col!r} ({rows}); each row needs its own ID")
    return ids


def _features(frame: "pd.DataFrame", cols: list[str], where: str) -> "pd.DataFrame":
    import pandas as pd

    out = {}
    for c in cols:
        raw = frame[c]
        num = pd.to_numeric(raw, errors="coerce")
        missing = raw.isna().to_numpy()
        if missing.any():
            raise DataError(f"{where}: row {_rows(missing)}, column {c!r}: empty cell; fill or drop it (rows count "
                            f"from 1 after the header)")
        bad = num.isna().to_numpy()
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise DataError(f"{where}: row {r + 1}, column {c!r}: {str(raw.iloc[r])[:40]!r} is not a number "
                            f"(categorical columns: one-hot encode them first, one 0/1 column per category)")
        values = num.to_numpy(dtype=np.float64)
        if not np.isfinite(values).all():
            r = int(np.flatnonzero(~np.isfinite(values))[0])
            raise DataError(f"{where}: row {r + 1}, column {c!r}: {values[r]} is not a finite number")
        out[c] = values
    return pd.DataFrame(out, columns=cols)


def _labels(raw: "pd.Series", where: str, col: str) -> tuple[np.ndarray, list[Any]]:
    """Class indices and the sorted class values (integers if every label is one, else strings)."""
    import pandas as pd

    missing = raw.isna().to_numpy()
    if missing.any():
        raise DataError(f"{where}: row {_rows(missing)}, column {col!r}: missing label")
    num = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    if np.isfinite(num).all() and (num == np.round(num)).all():
        values = num.astype(np.int64)
    else:
        values = raw.astype(str).to_numpy()
    classes, idx = np.unique(values, return_inverse=True)
    return idx.astype(np.int64), classes.tolist()


def _table_parts(frame: "pd.DataFrame", cfg: "RunConfig", where: str, with_labels: bool):
    ids = _ids(frame, cfg.id_column, where)
    cols = [str(c) for c in frame.columns if c not in (cfg.id_column, cfg.label_column)]
    if len(set(cols)) != len(cols):
        raise DataError(f"{where}: a column name appears twice")
    feats = _features(frame, [c for c in frame.columns if c not in (cfg.id_column, cfg.label_column)], where)
    feats.columns = cols
    labels = None
    if with_labels:
        if cfg.label_column not in frame.columns:
            raise DataError(f"{where}: no label column {cfg.label_column!r} (--label-column); the host's table holds "
                            f"the labels")
        labels = frame[cfg.label_column]
    elif cfg.label_column in frame.columns:
        raise DataError(f"{where}: has the label column {cfg.label_column!r}; labels belong to the host's table only "
                        f"(drop the column from this party's table)")
    return ids, feats, labels


# -- one party's table, on its own (a deployment node reads only its own) ---------------------------
@dataclass
class OwnTable:
    """One party's checked table: its rows in its own order (``slice``) and, at the host, the raw
    label column. ``where``: ``party (file name)``, as every error about it says."""

    party: str
    where: str
    slice: "PartySlice"
    raw_labels: Any = None


def read_own_table(cfg: "RunConfig", party: str, path: str) -> OwnTable:
    """Read and check ``party``'s table at ``path`` — every check that needs this table alone (module
    docstring): the ID column, duplicate IDs, cells, the label column (host only), host features."""
    from fl_split.data.base import PartySlice

    where = f"{party} ({Path(path).name})"
    ids, feats, lab = _table_parts(read_table(path, party), cfg, where, with_labels=party == "host")
    cols = list(feats.columns)
    if party == "host":
        if cfg.host_features and not cols:
            raise DataError(f"{where}: no feature columns besides {cfg.id_column!r} and {cfg.label_column!r}; "
                            f"run with --no-host-features if the host holds labels only")
        if not cfg.host_features and cols:
            raise DataError(f"{where}: feature columns {cols[:5]} but --no-host-features; drop them or the flag")
    elif not cols:
        raise DataError(f"{where}: no feature columns besides {cfg.id_column!r}")
    return OwnTable(party, where, PartySlice(party=party, ids=ids, columns=cols, table=feats if cols else None), lab)


def check_column_owner(owner: dict[str, str], where: str, party: str, columns: list[str]) -> None:
    """Feature column names are public metadata: a name claimed by two parties is refused. ``owner``
    (column -> party, of the parties checked so far) is updated."""
    for c in columns:
        if c in owner:
            raise DataError(f"{where}: column {c!r} is also {owner[c]}'s; each column belongs to one party "
                            f"(rename one)")
        owner[c] = party


def check_public(table: OwnTable, shared: np.ndarray) -> None:
    """``--align public``: a guest holds every one of the host's (published) IDs."""
    from fl_split.data.base import positions_of

    try:
        positions_of(table.slice.ids, shared, who=table.where)
    except DataError as exc:
        raise DataError(f"{exc} (with --align public every guest holds each of the host's IDs; --align psi "
                        f"trains on the intersection)") from None


def split_of(cfg: "RunConfig", shared: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The train/test split of the shared ID list (public: every party computes the same)."""
    from fl_split.data.base import split_shared

    train_ids, test_ids = split_shared(shared, cfg.data_name, cfg.test_fraction, cfg.seed, cfg.limit)
    if len(test_ids) < 1 or len(train_ids) < 1:
        raise ConfigError("test-fraction", cfg.test_fraction, "a fraction leaving at least one train and one test "
                          "sample", reason=f"{len(shared)} shared IDs")
    return train_ids, test_ids


def align_own(cfg: "RunConfig", table: OwnTable, shared: np.ndarray) -> "PartyData":
    """``table``'s party aligned to the shared ID list and encoded with its own training rows
    (:func:`~fl_split.data.base.prepare_party`); at the host, labels mapped to classes ``0…K-1`` among
    the shared rows (``num_classes`` = K; the mapping stays with the host)."""
    import dataclasses

    from fl_split.data.base import positions_of, prepare_party

    sl = table.slice
    if table.party == "host":
        labels, classes = _labels(table.raw_labels, table.where, cfg.label_column)
        # classes: those of the shared rows (the host's rows outside the shared list take no part)
        rows = positions_of(sl.ids, shared, who="host")
        kept = np.unique(labels[rows])
        if len(kept) < 2:
            raise DataError(f"{table.where}: column {cfg.label_column!r} holds one class among the shared IDs; "
                            f"nothing to learn")
        remap = np.full(len(classes), -1, np.int64)
        remap[kept] = np.arange(len(kept))
        # -1 only on rows outside the shared list, which are never used
        sl = dataclasses.replace(sl, labels=remap[labels], num_classes=int(len(kept)))
    train_ids, test_ids = split_of(cfg, shared)
    return prepare_party(sl, train_ids, test_ids)


# -- the pipeline ----------------------------------------------------------------------------------
def load_own(cfg: "RunConfig", transcript=None) -> dict[str, Any]:
    """Every party's aligned, encoded data from ``cfg.data`` (simulation: all parties in one process).

    Returns ``name, task, metric, num_classes, parties, train_ids, test_ids, alignment`` for
    :func:`fl_split.builder.prepare_data`. ``transcript``: see :func:`fl_split.psi.align_by_psi`."""
    from fl_split.data.base import VerticalDataset, partition, prepare_party, split_ids

    if cfg.data.strip() == NODE_TABLES:
        raise ConfigError("data", cfg.data, ALLOWED, reason=f"'{NODE_TABLES}' is for a Flower deployment, whose "
                          f"SuperNodes each read their own table (node-config data-path); in one process give every "
                          f"party's table (--data host=PATH --data guest-1=PATH …)")
    spec = parse_data_spec(cfg.data)
    if isinstance(spec, str):  # one table: every column belongs to one party (--columns or contiguous blocks)
        where = f"--data {Path(spec).name}"
        ids, feats, raw_labels = _table_parts(read_table(spec, "--data"), cfg, where, with_labels=True)
        labels, classes = _labels(raw_labels, where, cfg.label_column)
        if len(classes) < 2:
            raise DataError(f"{where}: column {cfg.label_column!r} holds one class ({classes[0]!r}); nothing to learn")
        ds = VerticalDataset(name=cfg.data_name, task="classification", ids=ids, labels=labels,
                             num_classes=len(classes), table=feats, description=f"own table {spec}")
        train_ids, test_ids = split_ids(ds, cfg.test_fraction, cfg.seed, cfg.limit)
        slices = partition(ds, cfg.guests, cfg.host_features, cfg.columns, seed=cfg.seed)
        parties = {p: prepare_party(sl, train_ids, test_ids) for p, sl in slices.items()}
        return dict(name=cfg.data_name, task="classification", metric="accuracy", num_classes=len(classes),
                    parties=parties, train_ids=train_ids, test_ids=test_ids,
                    alignment={"align": "public", "tables": 1, "shared_ids": len(ids)})

    tables: dict[str, OwnTable] = {}
    owner: dict[str, str] = {}
    for party in cfg.parties:
        tables[party] = read_own_table(cfg, party, spec[party])
        check_column_owner(owner, tables[party].where, party, tables[party].slice.columns)

    if cfg.align == "public":  # the host's ID list is published; every guest must hold each ID
        shared = np.sort(tables["host"].slice.ids)
        for g in cfg.parties[1:]:
            check_public(tables[g], shared)
        alignment: dict[str, Any] = {"align": "public", "shared_ids": int(len(shared))}
    else:
        from fl_split.psi import align_by_psi

        stats: dict[str, Any] = {}
        shared = align_by_psi({p: tables[p].slice.ids for p in cfg.parties}, transcript, progress=cfg.progress,
                              stats=stats)
        alignment = {"align": "psi", "shared_ids": int(len(shared)), "psi_messages": stats["messages"],
                     "psi_bytes": stats["bytes"], "time_s": stats["time_s"]}

    host = align_own(cfg, tables["host"], shared)
    parties = {"host": host, **{g: align_own(cfg, tables[g], shared) for g in cfg.parties[1:]}}
    return dict(name=cfg.data_name, task="classification", metric="accuracy", num_classes=int(host.num_classes),
                parties=parties, train_ids=host.train_ids, test_ids=host.test_ids, alignment=alignment)
