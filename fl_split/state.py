"""Flatten nested party state (module / optimizer state dicts, ledgers) to arrays + JSON and back.

Flower keeps a party's state between messages in ``context.state``, a record of arrays and plain
config values; in deployment each message may even start a fresh process. :func:`flatten`
turns any nesting of dicts, lists, tensors, arrays and scalars into ``(arrays, skeleton)``:
``arrays`` maps a path to a NumPy array, ``skeleton`` is JSON-able with ``{"__array__": path}``
where the tensors were. :func:`unflatten` inverts it exactly (dtypes included).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

_ARRAY = "__array__"
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_INTKEYS = "__intkeys__"


def flatten(obj: Any, prefix: str = "s") -> tuple[dict[str, np.ndarray], Any]:
    arrays: dict[str, np.ndarray] = {}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu()
            if t.dtype == torch.bfloat16:
                t = t.float()
            arrays[path] = t.numpy().copy()
            return {_TENSOR: path}
        if isinstance(o, np.ndarray):
            arrays[path] = o.copy()
            return {_ARRAY: path}
        if isinstance(o, dict):
            int_keys = all(isinstance(k, int) for k in o) and len(o) > 0
            out = {str(k): walk(v, f"{path}.{k}") for k, v in o.items()}
            return {_INTKEYS: out} if int_keys else out
        if isinstance(o, tuple):
            return {_TUPLE: [walk(v, f"{path}.{i}") for i, v in enumerate(o)]}
        if isinstance(o, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(o)]
        if isinstance(o, (np.integer,)):
            return int(o)
        if isinstance(o, (np.floating,)):
            return float(o)
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        raise TypeError(f"cannot flatten {type(o).__name__} at {path}")

    return arrays, walk(obj, prefix)


def unflatten(arrays: dict[str, np.ndarray], skeleton: Any) -> Any:
    def walk(o: Any) -> Any:
        if isinstance(o, dict):
            if _TENSOR in o and len(o) == 1:
                return torch.from_numpy(np.array(arrays[o[_TENSOR]], copy=True))
            if _ARRAY in o and len(o) == 1:
                return np.array(arrays[o[_ARRAY]], copy=True)
            if _TUPLE in o and len(o) == 1:
                return tuple(walk(v) for v in o[_TUPLE])
            if _INTKEYS in o and len(o) == 1:
                return {int(k): walk(v) for k, v in o[_INTKEYS].items()}
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        return o

    return walk(skeleton)


def to_json(skeleton: Any) -> str:
    return json.dumps(skeleton, separators=(",", ":"))


def from_json(text: str) -> Any:
    return json.loads(text)
