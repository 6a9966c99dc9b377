"""Your own vertical data: one CSV / Parquet table per party (``--data host=PATH --data guest-1=PATH``,
the parties read from it: :func:`infer_parties`) or one table whose columns ``--columns`` assigns
(``--data PATH``), with an ID column or several (``--id-column id`` / ``name,birth_date``: integers
or text, turned into int64 keys by :mod:`fl_split.data.ids`) and, at the host only, a label column
(``--label-column``).

The tables go through the same pipeline as a built-in dataset (:mod:`fl_split.data.base`, spec §1,
§2, §6): each party's rows stay **in its own order**; the parties agree on a shared ID list
(``--align public``: the host's IDs, sent to every party — the built-in datasets' assumption — or
``--align psi``: the private intersection of :mod:`fl_split.psi`); the list is split into train and
test with ``--seed`` (:func:`~fl_split.data.base.split_shared`, keyed by ``--data-name``); each party
aligns its rows to it and encodes its own raw columns with statistics of its own training rows
(:func:`~fl_split.data.base.prepare_party`, :class:`~fl_split.data.encoding.ColumnEncoder`: numbers
standardised, text categories one-hot, empty cells imputed plus a missing indicator; ``--encode``
overrides per column). So a table exported from a built-in dataset and run
under that dataset's name (``--data-name breast-cancer``) trains to the same numbers as the
dataset itself (``tests/test_own_data.py``); integer IDs are their own keys, so text IDs change
nothing but the keys (``tests/test_join_keys.py``).

**The parties** (:func:`data_guests`): ``host`` and ``guest-1`` … ``guest-G`` without gaps; ``--guests``
is not needed, and one that disagrees, ``--dataset`` with ``--data``, an unknown party name or a gap
are one-line :class:`~fl_split.errors.ConfigError` errors (the CLI also refuses such flags given at their
default values: :func:`check_given_flags`).

**Checks before anything is built** (one line each, naming the party, the file, the row and the
column; :class:`~fl_split.errors.DataError`, exit 2): a missing or unreadable file, a CSV that is
tab- or semicolon-separated, a missing ID column or label column (with the table's close column
names), an empty ID (row), duplicate IDs (the values and their rows) or two values with one key, a feature cell
that is not finite, a text cell in a column whose other cells are numbers (most likely a typo) or
that ``--encode`` declares numeric, an ``--encode`` entry naming no party's column, a label column
in a guest's table, a host table without labels or with one class, a feature column claimed by two
parties (column names are public metadata), a host without feature columns unless
``--no-host-features``. Text categories and empty cells are not refused: each party encodes them
itself, fitted on its own training rows after the split (a text column with more than 100 training
categories is refused there, :mod:`fl_split.data.encoding`) — a party's categories and statistics
are its private data and never leave it; its input width (one column per training category, number
and missing indicator) is public metadata like its column names. Labels are
classification labels: integers or strings, mapped to classes ``0 … K-1`` in sorted order of the
values the host holds for the shared IDs (the mapping and ``K`` stay with the host: only the top
model's size depends on it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from dataclasses import fields as dataclasses_fields
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


#: the ``--dataset`` refusal with ``--data`` (RunConfig for a non-default value, the CLI for any given one)
DATASET_WITH_DATA = dict(allowed="no --dataset with --data",
                         reason="--data trains on your own tables, --dataset on a built-in one; --data-name "
                                "names your data in the results")


def _guest_number(party: str) -> int | None:
    """``guest-N`` (N written without leading zeros, from 1) → N; anything else → None."""
    if party.startswith("guest-") and party[6:].isdigit() and str(int(party[6:])) == party[6:] and int(party[6:]) >= 1:
        return int(party[6:])
    return None


def data_guests(data: str, guests: int | None = None) -> int | None:
    """The number of guests G a per-party ``--data`` spec names — ``host`` and ``guest-1`` …
    ``guest-G`` with no gap — or ``None`` for one table or ``node-tables``. ``guests``: a ``--guests``
    that was given (the parties then are the run's: an extra or a missing table is named). Every
    contradiction is one :class:`ConfigError` line naming the flag."""
    if data.strip() == NODE_TABLES:
        return None
    spec = parse_data_spec(data)
    if isinstance(spec, str):
        return None
    for p in spec:
        if p != "host" and _guest_number(p) is None:
            raise ConfigError("data", data, ALLOWED, reason=f"unknown party '{p}'; the parties are host, guest-1, "
                                                            f"guest-2, … (guests numbered from 1)")
    numbers = sorted(n for n in (_guest_number(p) for p in spec) if n is not None)
    if guests is not None:
        parties = ["host", *(f"guest-{i}" for i in range(1, guests + 1))]
        unknown = [p for p in spec if p not in parties]
        if unknown:
            raise ConfigError("data", data, ALLOWED, reason=f"unknown party '{unknown[0]}'; this run's parties are "
                                                            f"{', '.join(parties)} (--guests {guests}; without "
                                                            f"--guests the parties are read from --data)")
        missing = [p for p in parties if p not in spec]
        if missing:
            raise ConfigError("data", data, ALLOWED, reason=f"no table for {', '.join(missing)} (--guests {guests}; "
                                                            f"without --guests the parties are read from --data)")
        return guests
    if "host" not in spec:
        raise ConfigError("data", data, ALLOWED, reason="no table for host (the host's table holds the labels)")
    if not numbers:
        raise ConfigError("data", data, ALLOWED, reason="no guest's table (guest-1=PATH …)")
    gap = next(i for i in range(1, numbers[-1] + 2) if i not in numbers)
    if gap <= numbers[-1]:
        raise ConfigError("data", data, ALLOWED, reason=f"no table for guest-{gap}: guests are numbered guest-1 … "
                                                        f"guest-G without gaps (given: "
                                                        f"{', '.join(f'guest-{n}' for n in numbers)})")
    return numbers[-1]


def infer_parties(cfg: "RunConfig") -> None:
    """Called by :class:`~fl_split.config.RunConfig` before its other checks: with one table per party,
    ``guests`` is the number of guest tables when it has its default (1: a Flower run config always
    holds the key, so 1 counts as not given there); another value must agree (:func:`data_guests`)."""
    default = next(f.default for f in dataclasses_fields(cfg) if f.name == "guests")
    g = data_guests(cfg.data, None if cfg.guests == default else cfg.guests)
    if g is not None and g != cfg.guests:
        object.__setattr__(cfg, "guests", g)  # frozen: set once, inside __post_init__


def check_given_flags(given: dict[str, Any]) -> None:
    """The CLI knows which flags were given (``given``: flag name → value): ``--dataset`` with
    ``--data`` is refused even at its default, and a given ``--guests`` must match the tables even
    at 1 (:func:`data_guests`)."""
    data = given.get("data")
    if not data:
        return
    if "dataset" in given:
        raise ConfigError("dataset", given["dataset"], DATASET_WITH_DATA["allowed"],
                          reason=DATASET_WITH_DATA["reason"])
    if "guests" in given and isinstance(given["guests"], int):
        data_guests(str(data), given["guests"])


def check_data_option(cfg: "RunConfig") -> None:
    """The rules of ``--data`` that need no file (called by :class:`~fl_split.config.RunConfig`, after
    :func:`infer_parties`)."""
    from fl_split.data.ids import parse_columns

    if cfg.party_files:
        raise ConfigError("party-files", cfg.party_files, "empty with --data",
                          reason="--data reads your tables; --party-files reads exported party files")
    default_dataset = next(f.default for f in dataclasses_fields(cfg) if f.name == "dataset")
    if cfg.dataset != default_dataset:
        raise ConfigError("dataset", cfg.dataset, DATASET_WITH_DATA["allowed"], reason=DATASET_WITH_DATA["reason"])
    id_columns = parse_columns(cfg.id_column)
    if "" in id_columns or len(set(id_columns)) != len(id_columns):
        raise ConfigError("id-column", cfg.id_column, "a column name, or several joined by commas (a composite key), "
                                                      "each once")
    if cfg.label_column in id_columns:
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
    data_guests(cfg.data, cfg.guests)  # (inferred or agreeing: an extra or missing table named)
    if cfg.columns:
        raise ConfigError("columns", cfg.columns, "empty with one table per party",
                          reason="each party's table holds its own columns; --columns assigns the columns of one "
                                 "table (--data PATH)")


# -- reading and checking one table ------------------------------------------------------------
def read_table(path: str, who: str, id_columns: tuple[str, ...] | list[str] = ()) -> "pd.DataFrame":
    """``path`` as a DataFrame. In a CSV the ID columns are read as text, exactly as written (``007``
    stays ``007``, ``NA`` is an ID, only an empty cell is missing; :mod:`fl_split.data.ids`); a
    Parquet file's columns keep their types. A CSV parsed into one column whose header holds a tab or
    ``;`` is refused with a hint: fl-split reads comma-separated ``.csv`` (a semicolon file usually
    writes decimal commas too, which no guess of the delimiter would read right)."""
    import pandas as pd

    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{who}: --data file {str(p)!r} does not exist")
    try:
        if p.suffix.lower() == ".csv":
            frame = pd.read_csv(p, low_memory=False, dtype={c: str for c in id_columns})
            blank = [c for c in id_columns if c in frame.columns and frame[c].isna().any()]
            if blank:  # pandas' NA words ("NA", "null", …) are IDs here: only an empty cell is missing
                raw = pd.read_csv(p, usecols=blank, dtype=str, keep_default_na=False, low_memory=False)
                for c in blank:
                    frame[c] = raw[c].where(raw[c].str.strip() != "", None)
        else:
            frame = pd.read_parquet(p)
    except ImportError:
        raise DataError(f"{who}: reading {p.name} needs the pyarrow package") from None
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, the answer is a DataError
        raise DataError(f"{who}: {p}: not a readable {p.suffix.lstrip('.')} table ({type(exc).__name__}: "
                        f"{str(exc)[:200]})") from None
    if p.suffix.lower() == ".csv" and len(frame.columns) == 1:
        head = str(frame.columns[0])
        for sep, name in (("\t", "tab"), (";", "semicolon")):
            if sep in head:
                raise DataError(f"{who}: {p.name} looks {name}-separated (its header {head[:60]!r} is one column); "
                                f"fl-split reads comma-separated .csv: convert it (e.g. pandas.read_csv(path, "
                                f"sep={sep!r}).to_csv(new_path, index=False)) or save it as .parquet")
    return frame


def _rows(mask: np.ndarray) -> str:
    rows = np.flatnonzero(mask)[:5] + 1
    return ", ".join(str(r) for r in rows) + (" …" if int(mask.sum()) > 5 else "")


def _missing_column(frame: "pd.DataFrame", col: str, where: str, what: str, flag: str) -> DataError:
    """``where: no <what> column 'x' (--flag)``, with the table's close column names (difflib) or its first."""
    import difflib

    names = [str(c) for c in frame.columns]
    close = difflib.get_close_matches(col, names, n=3, cutoff=0.6) or [
        c for c in names if c.lower() == col.lower() or col.lower() in c.lower()][:3]
    if close:
        hint = "did you mean " + " or ".join(repr(c) for c in close) + "?"
    else:
        hint = "its columns are " + ", ".join(repr(c) for c in names[:8]) + (" …" if len(names) > 8 else "")
    return DataError(f"{where}: no {what} column {col!r} ({flag}); {hint}")


def _ids(frame: "pd.DataFrame", col: str, where: str) -> "tuple[np.ndarray, IdNames | None]":
    """Each row's int64 key from its ID column(s) (``--id-column id`` or ``name,birth_date``) and the
    party's own key → value mapping (:mod:`fl_split.data.ids`: integers are their own keys, any other
    value is hashed to a negative key)."""
    from fl_split.data.ids import parse_columns, table_keys

    cols = parse_columns(col)
    for c in cols:
        if c not in frame.columns:
            raise _missing_column(frame, c, where, "ID", "--id-column")
    return table_keys(frame, cols, where)


def _features(frame: "pd.DataFrame", cols: list[str], where: str,
              kinds: dict[str, str] | None = None) -> "pd.DataFrame":
    """The party's feature columns as it holds them (raw: numbers, text, empty cells), checked where a
    check needs no statistic: a column ``--encode`` declares numeric holds numbers (or empty cells), no
    number is infinite. Each party encodes them itself, fitted on its own training rows
    (:class:`~fl_split.data.encoding.ColumnEncoder`, in :func:`align_own`)."""
    import pandas as pd

    from fl_split.data.encoding import _empty, _more, _numbers, stray_text
    from fl_split.data.encoding import _rows as _row

    kinds = kinds or {}
    out = {}
    for c in cols:
        raw = frame[c].reset_index(drop=True)
        if kinds.get(str(c)) != "drop":
            empty = _empty(raw)
            num, bad = _numbers(raw, empty)
            stray = "" if kinds.get(str(c)) else stray_text(str(c), raw, num, bad, empty)
            if stray:
                raise DataError(f"{where}: {stray}")
            if kinds.get(str(c)) == "numeric" and bad.any():
                r = int(np.flatnonzero(bad)[0])
                raise DataError(f"{where}: row {_row(raw, bad)}, column {c!r}: {str(raw.iloc[r])[:40]!r} is not a "
                                f"number, but --encode declares the column numeric{_more(bad)}")
            if np.isinf(num).any():
                raise DataError(f"{where}: row {_row(raw, np.isinf(num))}, column {c!r}: not a finite number"
                                f"{_more(np.isinf(num))}")
        out[c] = raw
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


def _is_target(raw: "pd.Series", cfg: "RunConfig", where: str) -> bool:
    """Whether the host's label column is a regression target (``--task``; auto: fl_split/tasks.py's rule)."""
    from fl_split.tasks import looks_numeric_target

    if cfg.task == "regression":
        return True
    return cfg.task == "auto" and looks_numeric_target(raw, cfg.label_column)


def _targets(raw: "pd.Series", where: str, col: str) -> np.ndarray:
    """A numeric regression target (``--task regression``): every value a finite number."""
    import pandas as pd

    num = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(num)
    if bad.any():
        raise DataError(f"{where}: row {_rows(bad)}, column {col!r}: {raw.iloc[int(np.flatnonzero(bad)[0])]!r} is "
                        f"not a number (--task regression needs a numeric label)")
    return num


def _table_parts(frame: "pd.DataFrame", cfg: "RunConfig", where: str, with_labels: bool):
    from fl_split.data.ids import parse_columns

    ids, names = _ids(frame, cfg.id_column, where)
    # the label column before the features: a misspelt --label-column is named as such, not as a
    # feature column that is not a number
    labels = None
    if with_labels:
        if cfg.label_column not in frame.columns:
            raise _missing_column(frame, cfg.label_column, where, "label", "--label-column")
        labels = frame[cfg.label_column]
    elif cfg.label_column in frame.columns:
        raise DataError(f"{where}: has the label column {cfg.label_column!r}; labels belong to the host's table only "
                        f"(drop the column from this party's table)")
    skip = {*parse_columns(cfg.id_column), cfg.label_column}
    cols = [str(c) for c in frame.columns if c not in skip]
    if len(set(cols)) != len(cols):
        raise DataError(f"{where}: a column name appears twice")
    feats = _features(frame, [c for c in frame.columns if c not in skip], where, _kinds(cfg))
    feats.columns = cols
    return ids, feats, labels, names


def _kinds(cfg: "RunConfig") -> dict[str, str]:
    from fl_split.data.encoding import parse_encode

    return parse_encode(cfg.encode) if cfg.encode else {}


def check_encode(cfg: "RunConfig", columns: dict[str, list[str]]) -> None:
    """Every ``--encode`` entry names some party's feature column (``columns``: party -> its column
    names, public metadata)."""
    known = {c for cols in columns.values() for c in cols}
    for col in _kinds(cfg):
        if col not in known:
            shown = "; ".join(f"{p}: {', '.join(cols[:6])}{' …' if len(cols) > 6 else ''}"
                              for p, cols in columns.items() if cols)
            raise ConfigError("encode", cfg.encode, "entries naming the parties' feature columns",
                              reason=f"no party's table has a column {col!r} ({shown or 'no feature columns'})")


# -- one party's table, on its own (a deployment node reads only its own) ---------------------------
@dataclass
class OwnTable:
    """One party's checked table: its rows in its own order (``slice``) and, at the host, the raw
    label column. ``where``: ``party (file name)``, as every error about it says."""

    party: str
    where: str
    slice: "PartySlice"
    raw_labels: Any = None
    #: the party's own key → ID value mapping (:class:`fl_split.data.ids.IdNames`; ``None`` when every
    #: ID is an integer, its own key): for this party's messages only, never sent
    names: Any = None


def read_own_table(cfg: "RunConfig", party: str, path: str) -> OwnTable:
    """Read and check ``party``'s table at ``path`` — every check that needs this table alone (module
    docstring): the ID column, duplicate IDs, cells, the label column (host only), host features."""
    from fl_split.data.base import PartySlice
    from fl_split.data.encoding import ColumnEncoder

    where = f"{party} ({Path(path).name})"
    from fl_split.data.ids import parse_columns

    frame = read_table(path, party, parse_columns(cfg.id_column))
    ids, feats, lab, names = _table_parts(frame, cfg, where, with_labels=party == "host")
    kinds = _kinds(cfg)
    cols = [c for c in feats.columns if kinds.get(c) != "drop"]  # the columns it encodes
    if party == "host":
        if cfg.host_features and not cols:
            raise DataError(f"{where}: no feature columns besides {cfg.id_column!r} and {cfg.label_column!r}; "
                            f"run with --no-host-features if the host holds labels only")
        if not cfg.host_features and cols:
            raise DataError(f"{where}: feature columns {cols[:5]} but --no-host-features; drop them or the flag")
    elif not cols:
        raise DataError(f"{where}: no feature columns besides {cfg.id_column!r}"
                        f"{' (--encode drops the others)' if len(feats.columns) else ''}")
    encoder = ColumnEncoder({c: k for c, k in kinds.items() if c in feats.columns}, where=where)
    return OwnTable(party, where, PartySlice(party=party, ids=ids, columns=list(feats.columns),
                                             table=feats if cols else None, encoder=encoder), lab,
                    names)


def check_column_owner(owner: dict[str, str], where: str, party: str, columns: list[str]) -> None:
    """Feature column names are public metadata: a name claimed by two parties is refused. ``owner``
    (column -> party, of the parties checked so far) is updated."""
    for c in columns:
        if c in owner:
            raise DataError(f"{where}: column {c!r} is also {owner[c]}'s; each column belongs to one party "
                            f"(rename one)")
        owner[c] = party


def check_public(table: OwnTable, shared: np.ndarray, host: OwnTable | None = None) -> None:
    """``--align public``: a guest holds every one of the host's (published) IDs (:func:`check_public_ids`;
    ``host``: the host's table, when it is in this process, to name the missing IDs as it writes them)."""
    check_public_ids(table.slice.ids, shared, table.where, None if host is None else host.names,
                     None if host is None else host.where)


def check_public_ids(have: np.ndarray, shared: np.ndarray, where: str, host_names: Any = None,
                     host_where: str | None = None) -> None:
    """A one-line :class:`DataError` when a guest's IDs ``have`` lack some of the host's ``shared`` ones.

    It names the guest (``where``: party and file). The missing IDs are the host's: a guest knows them
    as keys only, and no party's message shows another's values (docs/datasets.md "Join keys"). Integer
    IDs are their own keys: shown as they are. Text IDs: the host, when its table is at hand
    (``host_where``, its own ``host_names``: one process, a ``predict``), names them in its part of the
    message as its table writes them; a guest alone shows the published keys and says they are hashes."""
    from fl_split.data.ids import describe

    have = np.asarray(have, dtype=np.int64)
    want = np.asarray(shared, dtype=np.int64)
    missing = want[~np.isin(want, have)]
    if not missing.size:
        return
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    n = f"{len(missing)} of the host's {len(want)} IDs {'is' if len(missing) == 1 else 'are'} not in its rows"
    if not (missing < 0).any():  # integer IDs: the published keys are the values (the same line on every path)
        told = f"IDs {describe(missing[:5], None)}{more}"
    elif host_where is not None:
        told = f"{host_where} holds them: {describe(missing[:5], host_names)}{more}"
    else:
        told = (f"their keys {describe(missing[:5], None)}{more} (text IDs travel as hashed keys, fl_split.data.ids: "
                f"the host's own table names them)")
    raise DataError(f"{where}: {n}; {told} (with --align public every guest holds each of the host's IDs; "
                    f"--align psi uses the intersection)")


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
    if table.party == "host" and _is_target(table.raw_labels, cfg, table.where):
        sl = dataclasses.replace(sl, labels=_targets(table.raw_labels, table.where, cfg.label_column), num_classes=1,
                                 task="regression", metric="r2")
    elif table.party == "host":
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
        # the label mapping (class k = this value of the label column) stays with the host
        return dataclasses.replace(prepare_party(sl, train_ids, test_ids),
                                   classes=[_plain(classes[k]) for k in kept])
    train_ids, test_ids = split_of(cfg, shared)
    return prepare_party(sl, train_ids, test_ids)


def _plain(v: Any) -> Any:
    """A class value as JSON writes it (int or str)."""
    return int(v) if isinstance(v, (int, np.integer)) else str(v)


# -- the pipeline ----------------------------------------------------------------------------------
def load_own(cfg: "RunConfig", transcript=None) -> dict[str, Any]:
    """Every party's aligned, encoded data from ``cfg.data`` (simulation: all parties in one process).

    Returns ``name, task, metric, num_classes, parties, train_ids, test_ids, alignment`` for
    :func:`fl_split.builder.prepare_data`. ``transcript``: see :func:`fl_split.psi.align_by_psi`."""
    from fl_split.data.base import VerticalDataset, partition, prepare_party, split_ids
    from fl_split.data.encoding import ColumnEncoder

    if cfg.data.strip() == NODE_TABLES:
        raise ConfigError("data", cfg.data, ALLOWED, reason=f"'{NODE_TABLES}' is for a Flower deployment, whose "
                          f"SuperNodes each read their own table (node-config data-path); in one process give every "
                          f"party's table (--data host=PATH --data guest-1=PATH …)")
    spec = parse_data_spec(cfg.data)
    if isinstance(spec, str):  # one table: every column belongs to one party (--columns or contiguous blocks)
        where = f"--data {Path(spec).name}"
        from fl_split.data.ids import parse_columns

        frame = read_table(spec, "--data", parse_columns(cfg.id_column))
        ids, feats, raw_labels, _names = _table_parts(frame, cfg, where, with_labels=True)
        if _is_target(raw_labels, cfg, where):
            task, labels, classes = "regression", _targets(raw_labels, where, cfg.label_column), [None]
        else:
            task, (labels, classes) = "classification", _labels(raw_labels, where, cfg.label_column)
            if len(classes) < 2:
                raise DataError(f"{where}: column {cfg.label_column!r} holds one class ({classes[0]!r}); nothing to "
                                f"learn")
        kinds = _kinds(cfg)
        check_encode(cfg, {where: list(feats.columns)})
        feats = feats[[c for c in feats.columns if kinds.get(c) != "drop"]]
        ds = VerticalDataset(name=cfg.data_name, task=task, ids=ids, labels=labels,
                             num_classes=len(classes), table=feats, description=f"own table {spec}")
        train_ids, test_ids = split_ids(ds, cfg.test_fraction, cfg.seed, cfg.limit)
        slices = partition(ds, cfg.guests, cfg.host_features, cfg.columns, seed=cfg.seed)
        for p, sl in slices.items():  # each party encodes its own columns (raw-table defaults, --encode)
            sl.encoder = ColumnEncoder({c: k for c, k in kinds.items() if c in sl.columns}, where=f"{p} ({where})")
        parties = {p: prepare_party(sl, train_ids, test_ids) for p, sl in slices.items()}
        if task == "classification":
            parties["host"] = dataclasses.replace(parties["host"], classes=[_plain(c) for c in classes])
        return dict(name=cfg.data_name, task=task, metric="accuracy", num_classes=len(classes),
                    parties=parties, train_ids=train_ids, test_ids=test_ids,
                    alignment={"align": "public", "tables": 1, "shared_ids": len(ids)})

    tables: dict[str, OwnTable] = {}
    owner: dict[str, str] = {}
    for party in cfg.parties:
        tables[party] = read_own_table(cfg, party, spec[party])
        check_column_owner(owner, tables[party].where, party, tables[party].slice.columns)
    check_encode(cfg, {p: t.slice.columns for p, t in tables.items()})

    if cfg.align == "public":  # the host's ID list is published; every guest must hold each ID
        shared = np.sort(tables["host"].slice.ids)
        for g in cfg.parties[1:]:
            check_public(tables[g], shared, tables["host"])  # one process: the host names its own IDs
        alignment: dict[str, Any] = {"align": "public", "shared_ids": int(len(shared))}
    else:
        from fl_split.psi import align_by_psi

        stats: dict[str, Any] = {}
        shared = align_by_psi({p: tables[p].slice.ids for p in cfg.parties}, transcript, progress=cfg.progress,
                              stats=stats, max_peer_ids=cfg.psi_max_peer_ids)
        alignment = {"align": "psi", "shared_ids": int(len(shared)), "psi_messages": stats["messages"],
                     "psi_bytes": stats["bytes"], "time_s": stats["time_s"]}

    host = align_own(cfg, tables["host"], shared)
    parties = {"host": host, **{g: align_own(cfg, tables[g], shared) for g in cfg.parties[1:]}}
    return dict(name=cfg.data_name, task=host.task, metric="accuracy", num_classes=int(host.num_classes),
                parties=parties, train_ids=host.train_ids, test_ids=host.test_ids, alignment=alignment)
