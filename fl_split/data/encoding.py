"""Each party's encoding of its own raw columns (issue 23): :class:`ColumnEncoder`.

A party's table arrives as the organisation holds it — numbers, text categories, empty cells. The
party turns it into the float matrix its bottom model reads, with statistics of **its own training
rows only** (fitted after the shared train/test split, :func:`fl_split.data.base.prepare_party`).
Nothing it fits leaves the party: no mean, no standard deviation, no category list. What the other
parties learn is the public metadata of VFL — its column names and its **input width** (the number
of encoded columns, one per one-hot category and missing indicator), which is part of every
party's plan (``docs/accounting.md``, "What is public").

**Defaults on a raw table** (``policy="raw"``, ``fl-split train --data …``):

* a column is **categorical** when one of its non-empty training cells is not a number (text such as
  ``male`` / ``1st``; a boolean column, ``True``/``False``); every other column is **numeric**. A
  numeric-looking code (zip codes, class 1/2/3) stays numeric unless overridden
  (``--encode 'Zip=categorical'``);
* numeric → standardised with the training rows' mean and standard deviation (population, as the
  built-in datasets; a constant column is only centred);
* categorical → one-hot over the categories seen in the training rows, sorted; a category seen only
  later (test rows, a later predict) encodes as all zeros. Integral numbers spell the same category
  however the file stored them (``1`` and ``1.0`` are ``'1'``);
* empty cells → the training rows' median (numeric) or most frequent category (categorical, ties:
  the first in sorted order), plus one 0/1 column ``<column>:missing`` for each column that has an
  empty cell in its **training** rows (a column empty only in test rows is imputed without one:
  the width is fixed by the training rows);
* a categorical column found by the rule above with more than :data:`MAX_CATEGORIES` training
  categories is refused — most likely an identifier or free text (a name, a ticket number); drop it
  (``--encode 'Name=drop'``) or declare it categorical explicitly, which lifts the limit. Hashing
  such columns is not offered.

Per-column **overrides** (``--encode 'Age=numeric;Pclass=categorical;Name=drop'``, :func:`parse_encode`):
``numeric``, ``categorical`` or ``drop``; each party applies the entries that name its own columns.

**The built-in datasets** (``policy="builtin"``) keep their encoding exactly: the loader names the
categorical columns; an empty numeric cell becomes the training mean (0 after standardisation), an
empty categorical cell encodes as all zeros; no indicator columns.

The fitted encoder is part of the party's state (:attr:`fl_split.data.base.PartyData.encoder`):
:meth:`to_dict` / :meth:`from_dict` (plain JSON) carry it into party files and checkpoints, so a
resumed run and a later prediction apply the very same encoding (:meth:`transform`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_split.errors import ConfigError, DataError

if TYPE_CHECKING:
    import pandas as pd

FORMAT = "fl_split.encoder/1"
KINDS = ("numeric", "categorical", "drop")
POLICIES = ("raw", "builtin")
#: more training categories than this in a column classified as categorical by default is refused
MAX_CATEGORIES = 100
#: suffix of a missing-indicator column's name
MISSING = ":missing"
ENCODE_ALLOWED = ("'COLUMN=KIND;…' with KIND numeric, categorical or drop (e.g. 'Age=numeric;Pclass=categorical;"
                  "Name=drop'); an entry '@FILE' reads such entries from a file (one per line or ';'-separated)")


def parse_encode(spec: str) -> dict[str, str]:
    """``--encode``: ``'Age=numeric;Name=drop'`` → ``{column: kind}``. An entry ``@FILE`` reads more
    entries from that file (one per line or ``;``-separated, ``#`` starts a comment). Checks the syntax
    and the kinds only: which party owns a column is decided where the tables are read."""
    out: dict[str, str] = {}

    def entries(text: str, files: bool):
        for chunk in (c.strip() for line in text.splitlines() for c in line.split(";")):
            if chunk.startswith("@") and files:
                path = Path(chunk[1:].strip()).expanduser()
                try:
                    body = path.read_text(encoding="utf-8")
                except OSError as exc:
                    raise ConfigError("encode", spec, ENCODE_ALLOWED, reason=f"cannot read {str(path)!r}: "
                                      f"{exc.strerror or type(exc).__name__}") from None
                yield from entries("\n".join(line.split("#", 1)[0] for line in body.splitlines()), False)
            elif chunk:
                yield chunk

    for chunk in entries(spec, True):
        if "=" not in chunk:
            raise ConfigError("encode", spec, ENCODE_ALLOWED, reason=f"'{chunk}' has no '='")
        col, kind = (s.strip() for s in chunk.rsplit("=", 1))
        if not col:
            raise ConfigError("encode", spec, ENCODE_ALLOWED, reason=f"'{chunk}' names no column")
        if kind not in KINDS:
            raise ConfigError("encode", spec, ENCODE_ALLOWED, reason=f"column {col!r}: unknown kind {kind!r}")
        if col in out and out[col] != kind:
            raise ConfigError("encode", spec, ENCODE_ALLOWED, reason=f"column {col!r} given two kinds")
        out[col] = kind
    return out


def _empty(series: "pd.Series") -> np.ndarray:
    """Empty cells: NaN/None, or text of only whitespace."""
    empty = np.array(series.isna().to_numpy(), dtype=bool)  # a copy: pandas may hand out read-only arrays
    if series.dtype.kind not in "biufcmM":  # object or text dtype
        if _all_text(series):
            empty |= series.fillna("x").astype(str).str.strip().eq("").to_numpy(dtype=bool)
        else:
            empty |= np.array([isinstance(v, str) and not v.strip() for v in series.to_numpy()], dtype=bool)
    return empty


def _all_text(series: "pd.Series") -> bool:
    """Every non-empty cell is a string (pandas' C-level type inference)."""
    import pandas as pd

    return pd.api.types.infer_dtype(series, skipna=True) in ("string", "empty")


def _text(series: "pd.Series", empty: np.ndarray) -> np.ndarray:
    """Each cell's category as text (``None`` where empty); integral numbers as integers (``1.0`` → ``'1'``)."""
    values = series.to_numpy()
    out = np.empty(len(values), dtype=object)
    if series.dtype.kind == "b":
        out[:] = ["True" if v else "False" for v in values]
    elif series.dtype.kind in "iu":
        out[:] = values.astype(str)
    elif series.dtype.kind == "f":
        v = np.where(empty, 0.0, values.astype(np.float64))
        integral = np.isfinite(v) & (v == np.round(v)) & (np.abs(v) < 2 ** 53)
        out[:] = [str(int(x)) if i else repr(float(x)) for x, i in zip(v, integral)]
    elif _all_text(series):
        out[:] = series.fillna("").astype(str).str.strip().to_numpy(dtype=object)
    else:
        def one(v: Any) -> str:
            if isinstance(v, (bool, np.bool_)):
                return "True" if v else "False"
            if isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer():
                return str(int(v))
            return str(v).strip()

        out[:] = [one(v) for v in values]
    out[empty] = None
    return out


def _boolean(series: "pd.Series", empty: np.ndarray) -> bool:
    """A boolean column (``True``/``False`` cells; with empty cells pandas keeps them as objects)."""
    if series.dtype.kind == "b":
        return True
    values = series.to_numpy()[~empty]
    return series.dtype == object and len(values) > 0 and all(isinstance(v, (bool, np.bool_)) for v in values)


def _numbers(series: "pd.Series", empty: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(values, bad)``: float64 values (NaN where empty) and the non-empty cells that are no number."""
    import pandas as pd

    if series.dtype.kind == "b":
        num = series.to_numpy().astype(np.float64)
    elif series.dtype.kind in "iuf":
        num = series.to_numpy(dtype=np.float64, na_value=np.nan)
    else:  # text: parse each distinct value once (a category column has few)
        codes, uniques = pd.factorize(series, use_na_sentinel=True)
        parsed = pd.to_numeric(pd.Series(uniques, dtype=object), errors="coerce").to_numpy(dtype=np.float64,
                                                                                          na_value=np.nan)
        num = np.append(parsed, np.nan)[np.where(codes < 0, len(parsed), codes)]
    bad = np.isnan(num) & ~empty
    num = np.where(empty, np.nan, num)
    return num, bad


def stray_text(name: str, series: "pd.Series", num: np.ndarray, bad: np.ndarray, empty: np.ndarray) -> str:
    """The error for a column whose cells are mostly numbers but not all (most likely a typo or a
    placeholder such as ``n/a``), or ``""``: such a column is neither guessed numeric nor categorical."""
    if not bad.any() or int((~bad & ~empty).sum()) <= int(bad.sum()):
        return ""
    r = int(np.flatnonzero(bad)[0])
    return (f"row {_rows(series, bad)}, column {name!r}: {str(series.iloc[r])[:40]!r} is not a number, but most of "
            f"the column's cells are{_more(bad)}; fix or empty the cell, or declare the column's kind (--encode "
            f"'{name}=categorical': one 0/1 column per value, or '{name}=drop')")


def _rows(series: "pd.Series", mask: np.ndarray) -> str:
    """The first row of ``mask`` as the file counts it (from 1 after the header; a party's table keeps
    its row positions as the index, so a training-row subset still names the file's row)."""
    pos = int(np.flatnonzero(mask)[0])
    index = series.index
    return str(int(index[pos]) + 1 if index.dtype.kind in "iu" else pos + 1)


def _more(mask: np.ndarray) -> str:
    k = int(mask.sum()) - 1
    return f" ({k} more such cell{'s' if k > 1 else ''})" if k > 0 else ""


class ColumnEncoder:
    """One party's encoding of its raw columns (module docstring), fitted on its training rows.

    ``overrides``: ``{column: kind}`` (``--encode``; entries naming other parties' columns are
    ignored here). ``categorical``: the columns a built-in dataset declares categorical
    (``policy="builtin"``). ``where`` only labels error messages (``party (file)``)."""

    def __init__(self, overrides: Mapping[str, str] | None = None, categorical: Sequence[str] = (),
                 policy: str = "raw", max_categories: int = MAX_CATEGORIES, where: str = "") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        self.overrides = {str(k): str(v) for k, v in (overrides or {}).items()}
        bad = {k: v for k, v in self.overrides.items() if v not in KINDS}
        if bad:
            raise ConfigError("encode", bad, ENCODE_ALLOWED, reason="unknown kind")
        self.categorical = tuple(str(c) for c in categorical)
        self.policy = policy
        self.max_categories = int(max_categories)
        self.where = where
        #: per input column, in table order: ``{"name", "kind", …statistics}`` (empty until fitted)
        self.columns: list[dict[str, Any]] = []
        self.fitted = False

    # -- fitting --------------------------------------------------------------------------------
    def unfitted(self) -> "ColumnEncoder":
        """A fresh, unfitted encoder with the same settings (a template is never fitted in place)."""
        return ColumnEncoder(copy.deepcopy(self.overrides), self.categorical, self.policy, self.max_categories,
                             self.where)

    def _say(self, text: str) -> str:
        return f"{self.where}: {text}" if self.where else text

    def fit(self, frame: "pd.DataFrame") -> "ColumnEncoder":
        """Fit every statistic on ``frame`` — the party's **training rows** only — and return ``self``."""
        columns: list[dict[str, Any]] = []
        for col in frame.columns:
            name = str(col)
            series = frame[col]
            if self.policy == "builtin":
                columns.append(self._fit_builtin(name, series))
                continue
            kind = self.overrides.get(name, "auto")
            if kind == "drop":
                columns.append({"name": name, "kind": "drop"})
                continue
            empty = _empty(series)
            num, bad = _numbers(series, empty)
            if kind == "auto":
                stray = stray_text(name, series, num, bad, empty)
                if stray:
                    raise DataError(self._say(stray))
                kind = "categorical" if (bad.any() or _boolean(series, empty)) else "numeric"
                explicit = False
            else:
                explicit = True
            if kind == "numeric":
                if bad.any():
                    r = int(np.flatnonzero(bad)[0])
                    value = str(series.iloc[r])[:40]
                    raise DataError(self._say(f"row {_rows(series, bad)}, column {name!r}: {value!r} is not a number, "
                                              f"but --encode declares the column numeric{_more(bad)}"))
                columns.append(self._fit_numeric(name, series, num, empty))
            else:
                columns.append(self._fit_categorical(name, _text(series, empty), empty, explicit))
        self.columns = columns
        self.fitted = True
        return self

    def _fit_builtin(self, name: str, series: "pd.Series") -> dict[str, Any]:
        # the built-in datasets' encoding, statistic for statistic (their equivalence tests pin it)
        if name in self.categorical:
            cats = sorted(series.dropna().astype(str).unique())
            return {"name": name, "kind": "categorical", "categories": [str(c) for c in cats]}
        import pandas as pd

        tr = pd.to_numeric(series, errors="coerce").to_numpy(dtype=np.float64)
        some = bool(np.isfinite(tr).any())
        mean = float(np.nanmean(tr)) if some else 0.0
        std = float(np.nanstd(tr)) if some else 1.0
        return {"name": name, "kind": "numeric", "mean": mean, "std": std if std > 1e-12 else 1.0}

    def _fit_numeric(self, name: str, series: "pd.Series", num: np.ndarray, empty: np.ndarray) -> dict[str, Any]:
        inf = np.isinf(num)
        if inf.any():
            raise DataError(self._say(f"row {_rows(series, inf)}, column {name!r}: not a finite number{_more(inf)}"))
        present = num[~empty]
        mean = float(np.mean(present)) if present.size else 0.0
        std = float(np.std(present)) if present.size else 1.0
        return {"name": name, "kind": "numeric", "mean": mean, "std": std if std > 1e-12 else 1.0,
                "fill": float(np.median(present)) if present.size else 0.0, "indicator": bool(empty.any())}

    def _fit_categorical(self, name: str, text: np.ndarray, empty: np.ndarray, explicit: bool) -> dict[str, Any]:
        cats, counts = np.unique(text[~empty].astype(str), return_counts=True) if (~empty).any() else ([], [])
        cats = [str(c) for c in cats]
        if not explicit and len(cats) > self.max_categories:
            raise DataError(self._say(
                f"column {name!r}: {len(cats)} distinct text values in the training rows (more than "
                f"{self.max_categories}): an identifier or free text? drop it (--encode '{name}=drop') or declare it "
                f"categorical (--encode '{name}=categorical', one 0/1 column per value)"))
        fill = cats[int(np.argmax(counts))] if len(cats) else None  # argmax: the first of the most frequent
        return {"name": name, "kind": "categorical", "categories": cats, "fill": fill,
                "indicator": bool(empty.any())}

    # -- applying ------------------------------------------------------------------------------------
    @property
    def output_names(self) -> list[str]:
        """The encoded columns' names, in order (``col``, ``col=category``, ``col:missing``)."""
        self._need_fitted()
        names: list[str] = []
        for c in self.columns:
            if c["kind"] == "numeric":
                names.append(c["name"])
            elif c["kind"] == "categorical":
                names.extend(f"{c['name']}={v}" for v in c["categories"])
            if c.get("indicator"):
                names.append(c["name"] + MISSING)
        return names

    @property
    def width(self) -> int:
        return len(self.output_names)

    def _need_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError("ColumnEncoder: fit it on the training rows first")

    def transform(self, frame: "pd.DataFrame") -> np.ndarray:
        """``frame``'s rows encoded with the fitted statistics: a float32 array ``(rows, width)``.
        ``frame`` needs every fitted column (extra columns are ignored); nothing is refitted."""
        self._need_fitted()
        missing = [c["name"] for c in self.columns if c["kind"] != "drop" and c["name"] not in frame.columns]
        if missing:
            fitted = [c["name"] for c in self.columns if c["kind"] != "drop"]
            found = [str(c) for c in frame.columns]
            raise DataError(self._say(f"column{'s' if len(missing) > 1 else ''} {missing[:5]}"
                                      f"{' …' if len(missing) > 5 else ''} missing; expected the {len(fitted)} "
                                      f"column(s) the encoder was fitted on {fitted[:8]}{' …' if len(fitted) > 8 else ''}"
                                      f", found {found[:8]}{' …' if len(found) > 8 else ''}"))
        n = len(frame)
        blocks: list[np.ndarray] = []
        for c in self.columns:
            if c["kind"] == "drop":
                continue
            series = frame[c["name"]]
            if self.policy == "builtin":
                blocks.append(self._builtin_block(c, series))
                continue
            empty = _empty(series)
            if c["kind"] == "numeric":
                num, bad = _numbers(series, empty)
                if bad.any():
                    r = int(np.flatnonzero(bad)[0])
                    value = str(series.iloc[r])[:40]
                    raise DataError(self._say(
                        f"row {_rows(series, bad)}, column {c['name']!r}: {value!r} is not a number (the "
                        f"column's training rows are numeric; declare it categorical with --encode "
                        f"'{c['name']}=categorical'){_more(bad)}"))
                if np.isinf(num).any():
                    raise DataError(self._say(f"row {_rows(series, np.isinf(num))}, column {c['name']!r}: not a finite "
                                              f"number{_more(np.isinf(num))}"))
                num = np.where(empty, c["fill"], num)
                blocks.append(((num - c["mean"]) / c["std"]).astype(np.float32)[:, None])
            else:
                text = _text(series, empty)
                if c["fill"] is not None:
                    text = np.where(empty, c["fill"], text)
                blocks.append(_onehot(text, c["categories"]))
            if c.get("indicator"):
                blocks.append(empty.astype(np.float32)[:, None])
        x = np.concatenate(blocks, axis=1) if blocks else np.zeros((n, 0), np.float32)
        return np.ascontiguousarray(x, dtype=np.float32)

    @staticmethod
    def _builtin_block(c: dict[str, Any], series: "pd.Series") -> np.ndarray:
        if c["kind"] == "categorical":
            return _onehot(series.astype(str).to_numpy(), c["categories"])
        import pandas as pd

        arr = pd.to_numeric(series, errors="coerce").to_numpy(dtype=np.float64)
        z = (arr - c["mean"]) / c["std"]
        z[~np.isfinite(z)] = 0.0
        return z.astype(np.float32)[:, None]

    # -- state ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fitted encoder as plain JSON (the party's own state: never sent to another party)."""
        self._need_fitted()
        return {"format": FORMAT, "policy": self.policy, "overrides": dict(self.overrides),
                "categorical": list(self.categorical), "max_categories": self.max_categories,
                "columns": copy.deepcopy(self.columns)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "") -> "ColumnEncoder":
        """The encoder :meth:`to_dict` wrote (:class:`DataError` if ``d`` is not one).

        Also the ``encoder`` of a ``schema.json`` (``fl-split export-model``): today the same dict plus
        ``how``; schemas written before it agreed with this reader have no ``format`` and call the
        columns ``raw_columns`` (still read)."""
        try:
            if isinstance(d, Mapping) and "format" not in d and "raw_columns" in d and "columns" not in d:
                d = {**d, "format": FORMAT, "columns": d["raw_columns"]}  # an older schema.json's encoder
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT!r}")
            enc = cls(d.get("overrides") or {}, d.get("categorical") or (), str(d["policy"]),
                      int(d.get("max_categories", MAX_CATEGORIES)), where)
            columns = []
            for c in d["columns"]:
                kind = str(c["kind"])
                if kind not in KINDS:
                    raise ValueError(f"column kind {kind!r}")
                col: dict[str, Any] = {"name": str(c["name"]), "kind": kind}
                if kind == "numeric":
                    col.update(mean=float(c["mean"]), std=float(c["std"]))
                    if not (math.isfinite(col["mean"]) and math.isfinite(col["std"]) and col["std"] > 0):
                        raise ValueError(f"column {col['name']!r}: mean/std not finite")
                elif kind == "categorical":
                    col["categories"] = [str(v) for v in c["categories"]]
                if "fill" in c:
                    col["fill"] = None if c["fill"] is None else (float(c["fill"]) if kind == "numeric"
                                                                  else str(c["fill"]))
                if "indicator" in c:
                    col["indicator"] = bool(c["indicator"])
                columns.append(col)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{where or 'encoder'}: not an fl_split column encoder ({exc})") from None
        enc.columns, enc.fitted = columns, True
        return enc

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ColumnEncoder) and self.fitted and other.fitted and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        state = f"{self.width} columns" if self.fitted else "unfitted"
        return f"ColumnEncoder({self.policy}, {state})"


def _onehot(text: np.ndarray, categories: Sequence[str]) -> np.ndarray:
    """One 0/1 column per category (a hash lookup per cell: ``k`` categories cost no ``k`` passes);
    a cell that is no category (unseen, empty) is all zeros."""
    import pandas as pd

    out = np.zeros((len(text), len(categories)), np.float32)
    if categories:
        codes = pd.Index(list(categories), dtype=object).get_indexer(np.asarray(text, dtype=object))
        hit = np.flatnonzero(codes >= 0)
        out[hit, codes[hit]] = 1.0
    return out
