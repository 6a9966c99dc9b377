"""What fl_split puts into Flower records, and back.

Flower messages carry a :class:`~flwr.app.RecordDict` of typed records. fl_split uses two:

* ``ConfigRecord`` — the request / reply of one operation: the round, the batch keys (JSON),
  and the :mod:`fl_split.protocol` blobs as ``list[bytes]`` (one list per party; any length,
  including empty — e.g. one-shot guests release nothing in later epochs);
* ``ArrayRecord`` — a party's whole state in ``context.state`` between messages
  (:func:`fl_split.parties.export_flat`: NumPy arrays + a JSON skeleton in a ConfigRecord).

Errors travel as an ``error`` ConfigRecord (:func:`error_record`) that the coordinator turns back
into an exception (:func:`raise_error_record`): :class:`~fl_split.errors.BudgetExceeded` keeps its
fields (so the run stops with ``stopped_reason: "budget"``); anything else becomes a
:class:`~fl_split.errors.PartyError` naming the party and the round.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fl_split.errors import BudgetExceeded, FlSplitError, PartyError
from fl_split.schedule import BatchKey

#: record names inside a message's RecordDict
REQUEST = "fl_split.request"
REPLY = "fl_split.reply"
ERROR = "fl_split.error"
#: record names inside ``context.state``
STATE_ARRAYS = "fl_split.state"
STATE_META = "fl_split.node"

#: Flower message types (``<category>.<action>``) of the operations
MSG_ROLE = "query.role"
MSG_SETUP = "query.setup"
MSG_REPORT = "query.report"
MSG_STEP = "train.step"          # a guest applies owed gradients, releases the round's batches
MSG_HOST_TRAIN = "train.host"    # the host trains on the released activations
MSG_HOST_EVAL = "evaluate.host"  # the host evaluates the test split
MSG_EPOCH = "train.epoch"        # direct data plane: every party plays / serves whole epochs
MSG_CHECKPOINTS = "query.checkpoints"  # a resume: the rounds each party holds a checkpoint of
MSG_STOPPED = "query.stopped"    # the run failed elsewhere: the coordinator tells each party why
MSG_SECURE_ANNOUNCE = "query.secure_announce"  # --secure-merge: a guest's signed key for a new session
MSG_SECURE_AGREE = "query.secure_agree"        # --secure-merge: every member's announcement, relayed
MSG_REDO = "train.redo"          # --secure-merge, pad (relay): a guest releases the round again in a new session
MSG_DROP = "train.drop"          # pad (relay): the host goes on without a failed guest


class FederationError(FlSplitError):
    """The Flower federation does not match the run configuration (roles, counts), or a node
    did not register / answer in time."""


# -- batch keys ----------------------------------------------------------------------------------
def keys_to_json(keys) -> str:
    return json.dumps([list(k.as_tuple()) for k in keys], separators=(",", ":"))


def keys_from_json(text: object) -> tuple[BatchKey, ...]:
    """Batch keys of a request; anything malformed is a :class:`~fl_split.errors.ProtocolError`."""
    from fl_split.protocol import parse_keys

    return parse_keys(text)


# -- JSON that survives numpy scalars and NaN ----------------------------------------------------
def _default(o: Any) -> Any:
    if hasattr(o, "item") and callable(o.item):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=_default, separators=(",", ":"), allow_nan=True)


def loads(text: str) -> Any:
    return json.loads(text)


# -- request / reply -----------------------------------------------------------------------------
def content(**values: Any) -> RecordDict:
    """A RecordDict holding one ConfigRecord ``REQUEST`` with ``values`` (bytes lists allowed)."""
    return RecordDict({REQUEST: ConfigRecord(_plain(values))})


def reply_content(**values: Any) -> RecordDict:
    return RecordDict({REPLY: ConfigRecord(_plain(values))})


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, list):
            v = [bytes(b) if isinstance(b, (bytes, bytearray, memoryview)) else b for b in v]
        out[k] = v
    return out


def request_of(rd: RecordDict) -> ConfigRecord:
    return rd.config_records[REQUEST]


def reply_of(rd: RecordDict) -> ConfigRecord:
    return rd.config_records[REPLY]


def blob_list(rec: ConfigRecord, key: str) -> list[bytes]:
    """A list of blobs from a record (a missing key or an empty list is ``[]``); anything but a list of
    byte strings is a :class:`~fl_split.errors.ProtocolError`."""
    from fl_split.protocol import blob_list as checked

    v = rec.get(key, None)
    return checked(list(v) if isinstance(v, (list, tuple)) else v, what=key) if v else []


def int_field(rec: ConfigRecord, key: str, default: int) -> int:
    """An integer field of a request (``default`` when absent); anything else is a ProtocolError."""
    from fl_split.errors import ProtocolError

    v = rec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"malformed request: {key} is {str(v)[:40]!r}, expected an integer")
    return int(v)


# -- errors ------------------------------------------------------------------------------------
def error_record(exc: BaseException, party: str, round_: int | None) -> RecordDict:
    """A reply describing ``exc`` raised by ``party`` while handling round ``round_``."""
    if isinstance(exc, PartyError) and not isinstance(exc, BudgetExceeded):
        # a failure the party attributes to a peer (direct data plane: the host names the guest
        # that was lost; a guest names the host): report it as that peer's, with its own round
        party, round_ = exc.party, exc.round if exc.round is not None else round_
        values: dict[str, Any] = {"type": "PartyError", "message": exc.detail, "party": party,
                                  "round": -1 if round_ is None else int(round_)}
        return RecordDict({ERROR: ConfigRecord(values)})
    values = {"type": type(exc).__name__, "message": str(exc), "party": party,
              "round": -1 if round_ is None else int(round_)}
    if isinstance(exc, BudgetExceeded):
        values["fields"] = dumps({"party": exc.party, "spent": exc.spent, "would_be": exc.would_be,
                                  "budget": exc.budget, "accountant": exc.accountant})
    return RecordDict({ERROR: ConfigRecord(values)})


def raise_error_record(rd: RecordDict, party: str, round_: int | None) -> None:
    """Raise the exception an error reply describes (no-op for a normal reply). A reply that is
    itself damaged (a non-integer round, unreadable budget fields) still becomes a
    :class:`~fl_split.errors.PartyError` naming ``party``."""
    if ERROR not in rd.config_records:
        return
    rec = rd.config_records[ERROR]
    kind = str(rec.get("type", "Error"))[:200]
    message = str(rec.get("message", ""))[:4000]
    if kind == "BudgetExceeded" and "fields" in rec:
        try:
            f = loads(str(rec["fields"]))
            exc = BudgetExceeded(str(f["party"]), _num(f["spent"]), _num(f["would_be"]), _num(f["budget"]),
                                 str(f["accountant"]))
        except (ValueError, KeyError, TypeError):
            exc = None
        if exc is not None:
            raise exc
    r = rec.get("round", -1)
    r = r if isinstance(r, int) and not isinstance(r, bool) else -1
    who = str(rec.get("party", party))[:100]
    detail = message if kind == "PartyError" else f"{kind}: {message}"
    raise PartyError(who, round_ if r < 0 else r, detail)


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


# -- party state in context.state ----------------------------------------------------------------
def arrays_to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def record_to_arrays(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in rec.items()}
