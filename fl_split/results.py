"""Results files: written once, atomically (a temporary file in the same folder, then a rename),
so a crash or Ctrl-C never leaves a half-written file behind."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary file + rename (never half-written)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(jsonable(data), fh, indent=2, allow_nan=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def jsonable(o: Any) -> Any:
    """``o`` with numpy / torch scalars and dataclasses turned into plain JSON values."""
    if isinstance(o, dict):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [jsonable(v) for v in o]
    if hasattr(o, "item") and callable(o.item):  # numpy / torch scalars
        return o.item()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return jsonable(dataclasses.asdict(o))
    return o
