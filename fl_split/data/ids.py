"""Join keys: a party's raw ID values (integers, text, or several columns together) → int64 **keys**.

Everything after a table is read works on int64 IDs — the train/test split, the batch digests of the
wire and the ledgers, checkpoints, party files, the PSI. This module is the one place where a party's
own ID column(s) become those keys (``--id-column patient_id`` or ``--id-column name,birth_date``);
every party applies the same function to its own values, so equal values give equal keys at every
party and nothing but the keys ever leaves a party.

**The mapping** (:func:`key_of`), applied to each value's *canonical text* (:func:`texts`):

* a canonical non-negative decimal integer — digits only, no sign, no leading zero except ``"0"``,
  below ``2**63`` — is its own key. Integer IDs (and the tables ``fl-split export-parties`` writes for a
  built-in dataset) therefore keep exactly their numbers, and their runs today's results;
* any other value — text (``"P-00301"``, an e-mail address), ``"007"``, a negative integer, an integer
  of ``2**63`` or more, a composite key — is hashed to a **negative** key::

      key = -(1 + (int.from_bytes(sha256(b"fl-split-id\\x00" + utf8(text))[:8], "big") mod (2**63 - 1)))

  so a hashed key never equals an integer's key.

**Canonical text.** Surrounding whitespace is stripped; otherwise matching is exact (case-sensitive,
no Unicode normalisation): normalise e-mails, phone numbers and the like the same way at every party
before the run (docs/datasets.md, "Join keys"). A number column is read as numbers: an integer cell is
its decimal digits, a float cell that holds an integer (``12.0`` — pandas reads an integer column
with an empty cell as floats, and writes it back so) is that integer, and so is a text cell
``12.0`` (digits, a point, zeros); a fractional or non-finite float, or a float beyond
``2**53`` (where floats stop holding every integer), is refused. Dates read as dates (Parquet) are
``YYYY-MM-DD`` when they hold no time of day, ISO 8601 otherwise. A **composite key** (several
columns) is the canonical texts of its parts joined by the unit separator ``\\x1f`` — always hashed.
An empty part (missing cell, or only whitespace) is a missing ID. Negative integers are accepted
and hashed like text (``-5`` and ``"-5"`` give the same key at every party): documented, not refused.

**Collisions.** Two different values of one party's table that get the same key (two 62-bit hashes
that collide) are an error naming both rows (:func:`table_keys`). Across parties a collision would
make two different people one shared ID; with ``n`` and ``m`` hashed IDs its probability is below
``n·m / 2**63`` (1M × 1M: ~1e-7).

**Who sees what.** The keys are what leaves a party (PSI, the public ID list, the shared list); the
key → value mapping stays with its party (:class:`IdNames`), which shows its own values in its own
messages (a duplicate, a collision). A key is a *hash*, not a secret: where the host publishes its
keys (``--align public``) a guest can test guessed values (e-mails, phone numbers) against them, as
it reads integer IDs directly; ``--align psi`` reveals only the intersection.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_split.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

#: domain separation of the hash (a key of this scheme is not a plain SHA-256 of the value)
DOMAIN = b"fl-split-id\x00"
#: joins the parts of a composite key (ASCII unit separator: in no ordinary cell)
SEPARATOR = "\x1f"
INT63 = 2 ** 63
#: floats hold every integer up to here; beyond, a float ID may already be another number
FLOAT_EXACT = 2 ** 53
_CANONICAL = re.compile(r"0|[1-9][0-9]*")
#: a text cell ``12.0``: an integer column written through floats (pandas, a NaN elsewhere)
_FLOAT_TEXT = re.compile(r"(0|[1-9][0-9]*)\.0+")


def hashed_key(text: str) -> int:
    """The negative key of a value that is not a canonical non-negative integer (module docstring)."""
    h = int.from_bytes(hashlib.sha256(DOMAIN + text.encode("utf-8")).digest()[:8], "big")
    return -(1 + h % (INT63 - 1))


def key_of(text: str) -> int:
    """The key of one value's canonical text: itself if it is a canonical integer below ``2**63``,
    else :func:`hashed_key`."""
    if _CANONICAL.fullmatch(text) and (len(text) < 19 or int(text) < INT63):
        return int(text)
    return hashed_key(text)


def keys_of(texts: Sequence[str]) -> np.ndarray:
    """:func:`key_of` of each text, as int64, vectorised: the integers found and converted by Arrow's
    string kernels, the hashes in one pass of SHA-256 and numpy's uint64 arithmetic
    (``tests/test_join_keys.py`` checks it against :func:`key_of`; ``experiments/bench_ids.py``)."""
    import pandas as pd

    arr = np.asarray(texts, dtype=object)
    t = pd.Series(arr, dtype="string[pyarrow]")
    out = np.empty(len(arr), dtype=np.int64)
    canonical = t.str.fullmatch(_CANONICAL.pattern).to_numpy(dtype=bool, na_value=False)
    short = canonical.copy()
    short[canonical] = t[canonical].str.len().to_numpy() < 19
    out[short] = t[short].astype(np.int64).to_numpy()
    rest = np.flatnonzero(~short)
    if rest.size:
        long = canonical[rest]
        sha = hashlib.sha256
        blob = b"".join(sha(DOMAIN + v.encode("utf-8")).digest()[:8] for v in arr[rest[~long]])
        h = np.frombuffer(blob, dtype=">u8").astype(np.uint64)
        out[rest[~long]] = -(1 + (h % np.uint64(INT63 - 1)).astype(np.int64))
        out[rest[long]] = [key_of(v) for v in arr[rest[long]]]  # 19+ digits: below 2**63 or hashed
    return out


def parse_columns(spec: str) -> list[str]:
    """``--id-column 'name,birth_date'`` → ``['name', 'birth_date']`` (one name: a plain key)."""
    return [c.strip() for c in str(spec).split(",")]


class _Bad(Exception):
    def __init__(self, row: int, why: str) -> None:
        self.row, self.why = row, why


def _texts_of_column(raw: "pd.Series") -> np.ndarray:
    """One column's cells as canonical texts (object array, ``""`` for a missing cell); raises
    :class:`_Bad` (row, reason) for a float that is no exact integer."""
    import pandas as pd

    n = len(raw)
    missing = raw.isna().to_numpy()
    if pd.api.types.is_bool_dtype(raw.dtype):
        return np.asarray(["" if m else str(bool(v)) for v, m in zip(raw.to_numpy(object), missing)], dtype=object)
    if pd.api.types.is_integer_dtype(raw.dtype):  # (nullable Int64 too: a missing cell is "")
        vals = raw.to_numpy(dtype=object, na_value=None)
        return np.asarray(["" if v is None else str(int(v)) for v in vals], dtype=object)
    if pd.api.types.is_float_dtype(raw.dtype):
        vals = raw.to_numpy(dtype=np.float64, na_value=np.nan)
        out = np.empty(n, dtype=object)
        for i, v in enumerate(vals.tolist()):
            if math.isnan(v):
                out[i] = ""
            elif not math.isfinite(v) or v != math.floor(v):
                raise _Bad(i, f"{v!r} is not an integer (a number ID column holds integers; write other IDs as "
                              f"text)")
            elif abs(v) > FLOAT_EXACT:
                raise _Bad(i, f"{v!r} is a float beyond 2**53, where floats lose digits (store the IDs as integers "
                              f"or text)")
            else:
                out[i] = str(int(v))
        return out
    if pd.api.types.is_datetime64_any_dtype(raw.dtype):
        ts = pd.to_datetime(raw)
        if getattr(ts.dt, "tz", None) is not None:
            ts = ts.dt.tz_convert("UTC")
        dateonly = bool(((ts.dt.normalize() == ts) | ts.isna()).all())
        return np.asarray(["" if pd.isna(t) else (t.strftime("%Y-%m-%d") if dateonly else t.isoformat())
                           for t in ts], dtype=object)
    if pd.api.types.infer_dtype(raw, skipna=True) in ("string", "empty"):  # text cells (a CSV's): vectorised
        t = raw.str.strip().str.replace(_FLOAT_TEXT.pattern.join("^$"), r"\1", regex=True)
        return t.fillna("").to_numpy(dtype=object)
    out = np.empty(n, dtype=object)
    for i, (v, m) in enumerate(zip(raw.to_numpy(object), missing)):
        if m:
            out[i] = ""
        elif isinstance(v, (bool, np.bool_)):
            out[i] = str(bool(v))
        elif isinstance(v, (int, np.integer)):
            out[i] = str(int(v))
        elif isinstance(v, (float, np.floating)):  # a number cell inside a text column (Parquet object column)
            if not math.isfinite(v) or v != math.floor(v) or abs(v) > FLOAT_EXACT:
                raise _Bad(i, f"{float(v)!r} is not an exact integer ID (write such IDs as text)")
            out[i] = str(int(v))
        elif isinstance(v, bytes):
            try:
                out[i] = v.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise _Bad(i, "bytes that are not UTF-8 text") from None
        else:
            t = str(v).strip()
            m = _FLOAT_TEXT.fullmatch(t)
            out[i] = m.group(1) if m else t
    return out


def texts(frame: "pd.DataFrame", columns: list[str], where: str, flag: str = "--id-column") -> np.ndarray:
    """The canonical text of each row's key (module docstring): one column's cells, or the parts of
    a composite key joined by :data:`SEPARATOR`. One-line :class:`DataError` naming the row and
    column for a missing part or a float that is no integer."""
    parts = []
    for col in columns:
        try:
            t = _texts_of_column(frame[col])
        except _Bad as bad:
            raise DataError(f"{where}: row {bad.row + 1}, column {col!r}: {bad.why} ({flag})") from None
        empty = t == ""
        if empty.any():
            raise DataError(f"{where}: row {_rows(empty)}, column {col!r}: missing ID (rows count from 1 after the "
                            f"header)")
        parts.append(t)
    if len(parts) == 1:
        return parts[0]
    import pandas as pd

    first, *rest = (pd.Series(p, dtype=object) for p in parts)
    return first.str.cat(rest, sep=SEPARATOR).to_numpy(dtype=object)


def shown(text: str) -> str:
    """A canonical text for a message (a composite key's parts joined by ``|``; at most 40 characters)."""
    t = text.replace(SEPARATOR, " | ")
    return repr(t if len(t) <= 40 else t[:39] + "…")


@dataclass(frozen=True)
class IdNames:
    """A party's own key → value mapping (its IDs as its table writes them); it never leaves the
    party. ``None`` where every key is an integer ID (the key *is* the value)."""

    keys: np.ndarray  # sorted keys
    values: np.ndarray  # their canonical texts

    def name(self, key: int) -> str:
        """The value of ``key`` as this party's table writes it (an integer ID: its number)."""
        if int(key) >= 0:
            return str(int(key))
        i = int(np.searchsorted(self.keys, key))
        if i < len(self.keys) and int(self.keys[i]) == int(key):
            return shown(str(self.values[i]))
        return str(int(key))


def table_keys(frame: "pd.DataFrame", columns: list[str], where: str) -> tuple[np.ndarray, IdNames | None]:
    """The key of each row of ``frame`` (its ID column(s) ``columns``) and the party's own key → value
    mapping (``None`` if every key is an integer ID). Duplicate values (after stripping) and two
    different values with one key are one-line :class:`DataError` naming the rows."""
    label = columns[0] if len(columns) == 1 else ",".join(columns)
    keys = _integer_keys(frame[columns[0]]) if len(columns) == 1 else None
    if keys is not None:  # integer IDs (the common case, vectorised): each is its own key
        t = None
    else:
        t = texts(frame, columns, where)
        keys = keys_of(t)
    uniq, counts = np.unique(keys, return_counts=True)
    if (counts > 1).any():
        for d in uniq[counts > 1]:
            rows = keys == d
            distinct = [] if t is None else list(dict.fromkeys(t[rows].tolist()))
            if len(distinct) > 1:  # a hash collision inside one table: two values, one key
                a, b = (np.flatnonzero(rows & (t == v))[0] + 1 for v in distinct[:2])
                raise DataError(f"{where}: rows {a} and {b}, column {label!r}: the different IDs {shown(distinct[0])} "
                                f"and {shown(distinct[1])} hash to the same key {int(d)} (fl_split.data.ids; "
                                f"probability ~ n²/2**64): change one of them")
        dup = uniq[counts > 1][:3]
        rows = "; ".join(f"ID {_display(None if t is None else t[keys == d][0], int(d))} in rows {_rows(keys == d)}"
                         for d in dup)
        raise DataError(f"{where}: duplicate IDs in column {label!r} ({rows}); each row needs its own ID")
    hashed = keys < 0
    if not hashed.any():
        return keys, None
    order = np.argsort(keys, kind="stable")
    return keys, IdNames(keys=keys[order], values=t[order])


def _display(text: str | None, key: int) -> str:
    return str(key) if key >= 0 or text is None else shown(text)


def _integer_keys(raw: "pd.Series") -> np.ndarray | None:
    """A column of non-negative integers (or floats holding them, up to 2**53) with no missing cell:
    its keys, vectorised; ``None`` for anything else (the general path checks and hashes it)."""
    import pandas as pd

    if pd.api.types.is_bool_dtype(raw.dtype) or raw.isna().any():
        return None
    if pd.api.types.is_integer_dtype(raw.dtype):
        if pd.api.types.is_unsigned_integer_dtype(raw.dtype):
            v = raw.to_numpy()
            return v.astype(np.int64) if (v < INT63).all() else None
        v = raw.to_numpy(dtype=np.int64)
        return v if (v >= 0).all() else None
    if pd.api.types.is_float_dtype(raw.dtype):
        v = raw.to_numpy(dtype=np.float64)
        if (np.isfinite(v) & (v == np.floor(v)) & (v >= 0) & (v <= FLOAT_EXACT)).all():
            return v.astype(np.int64)
    return None


def _rows(mask: np.ndarray) -> str:
    """The first rows of ``mask`` (counted from 1 after the header), as every table error names them."""
    rows = np.flatnonzero(mask)[:5] + 1
    return ", ".join(str(r) for r in rows) + (" …" if int(mask.sum()) > 5 else "")


def describe(keys: Any, names: IdNames | None) -> str:
    """Keys as the party that holds ``names`` knows them (its own values; other keys as numbers)."""
    return ", ".join(names.name(k) if names is not None else str(int(k)) for k in keys)
