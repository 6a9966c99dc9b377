"""Results files: written once, atomically (a temporary file in the same folder, then a rename),
so a crash or Ctrl-C never leaves a half-written file behind.

Results are strict JSON (RFC 8259): a non-finite number (NaN, ±inf) is written as ``null`` with a
sibling ``<key>_reason`` saying why there is no value (an existing reason is kept), and the encoder
runs with ``allow_nan=False``, so a ``NaN`` token can never reach a file silently
(docs/results.md, "Strict JSON")."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as strict JSON (no NaN: :func:`jsonable`) to ``path`` via a temporary file +
    rename (never half-written)."""
    write_bytes_atomic(path, (json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n").encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file + rename (never half-written)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _nonfinite(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def jsonable(o: Any) -> Any:
    """``o`` with numpy / torch scalars and dataclasses turned into plain JSON values, and every
    non-finite float turned into ``None`` (in a dict, with a sibling ``<key>_reason``)."""
    if isinstance(o, dict):
        out: dict[str, Any] = {}
        for k, v in o.items():
            v = jsonable(v)
            key = str(k)
            if _nonfinite(v):
                reason = o.get(f"{key}_reason") or f"not a finite number ({v!r}): no value was computed"
                out[key], out[f"{key}_reason"] = None, reason
            elif key not in out:  # a reason added for an earlier key is kept
                out[key] = v
        return out
    if isinstance(o, (list, tuple)):
        return [None if _nonfinite(x) else x for x in (jsonable(v) for v in o)]
    if hasattr(o, "item") and callable(o.item):  # numpy / torch scalars
        return jsonable(o.item())
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return jsonable(dataclasses.asdict(o))
    return o
