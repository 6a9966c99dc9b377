"""A trained split model that serves (issue 24): each party saves its own part, ``fl-split predict``
scores new rows across the parties, and every new record's cut-layer output is a release.

**Saving** (``--save-model DIR``, :func:`save_part`): each party writes ``DIR/<party>/`` from its own
party object, owner-only (:mod:`fl_split.secure_files`):

* a guest: ``model.pt`` (its bottom's weights), ``preprocessing.json`` (what it fitted on its own
  training rows, :func:`fl_split.data.base.party_preprocessing`), ``mechanism.json`` (its forward
  mechanism's *public* parameters, as its privacy report gives them);
* the host: ``model.pt`` (its bottom, if it has features, and its top), ``preprocessing.json``,
  ``task.json`` (the task, the number of classes and, for regression, the target's training mean
  and sd: the label mapping stays with the host);
* each: ``manifest.json`` — architecture, cut, its input (and cut-layer) shapes, merge, task, the
  party set, the run's public configuration (data paths and output paths dropped), the fl_split
  and torch versions and the SHA-256 of every file.

Nothing of another party's is in a folder (a guest's has no label, no host weight; the host's no
guest weight), and no secret: no private seed, no noise or generator state, no ledger.

**Loading** (:func:`load_part`) checks every file against its manifest's SHA-256 and the manifests
against each other (:func:`check_parts`: same architecture, cut, merge, task, configuration and party
set; the host's expected cut-layer shape of each guest is that guest's): a mismatch is one line.

**Prediction** (:func:`predict`, ``fl-split predict``) runs in one process, each party object reading
only its own folder and its own new table; see :mod:`fl_split.predict`.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import torch

from fl_split.errors import DataError

FORMAT = "fl_split-model/1"
#: configuration keys that name files or machines of the training run: not part of a saved model
NOT_SAVED = ("data", "party_files", "out", "checkpoint_dir", "host_metrics", "data_root", "ray_address", "resume")


def public_config(cfg) -> dict[str, Any]:
    """The run's public configuration as saved in each manifest (paths dropped: they name another
    party's files)."""
    from fl_split.config import RunConfig

    d = cfg.to_dict()
    defaults = RunConfig().to_dict()
    for k in NOT_SAVED:
        d[k] = defaults[k]
    return d


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _plain_state(module) -> dict:
    """The module's parameters as the plain architecture names them, on the CPU: a DP-SGD party's
    modules are wrapped by Opacus (``GradSampleModule``, its keys prefixed ``_module.``), the saved
    model is the unwrapped one (predict and ``--init-from`` build the plain module)."""
    wrapped = type(module).__name__ == "GradSampleModule"  # (opacus is imported only where DP-SGD runs)
    return _cpu((module._module if wrapped else module).state_dict())


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _versions() -> dict[str, str]:
    import fl_split

    return {"fl_split": fl_split.__version__, "torch": torch.__version__}


def save_part(party, plan, directory: str | Path) -> Path:
    """Write ``party``'s own part (a :class:`~fl_split.parties.GuestParty` or
    :class:`~fl_split.parties.HostParty`) into ``directory/<party>/``; returns that folder."""
    from fl_split.data.base import party_preprocessing
    from fl_split.secure_files import private_dir, write_private

    root = private_dir(Path(directory).expanduser())
    folder = private_dir(root / party.name)
    files: dict[str, bytes] = {}
    manifest: dict[str, Any] = {
        "format": FORMAT, "party": party.name, "role": party.role, "parties": ["host", *plan.guests],
        "arch": plan.arch, "cut": plan.cut, "merge": plan.cfg.merge, "task": plan.task,
        "num_outputs": plan.num_outputs, "guest_cut_activation": plan.guest_cut_activation,
        "input_shape": list(plan.input_shapes[party.name]) if party.name in plan.input_shapes else None,
        "config": public_config(plan.cfg), "versions": _versions()}
    files["preprocessing.json"] = json.dumps(party_preprocessing(party.data), indent=1).encode()
    if party.role == "guest":
        manifest["cut_shape"] = list(plan.cut_shapes[party.name])
        files["model.pt"] = _torch_bytes({"bottom": _plain_state(party.bottom)})
        files["mechanism.json"] = json.dumps(party.mechanism.describe(), indent=1, default=str).encode()
    else:
        manifest["guest_shapes"] = {g: list(plan.cut_shapes[g]) for g in plan.guests}
        manifest["merged_shape"] = list(plan.merged_shape)
        state = {"top": _plain_state(party.top)}
        if party.bottom is not None:
            state["bottom"] = _plain_state(party.bottom)
        files["model.pt"] = _torch_bytes(state)
        scale = party.data.target_scale
        files["task.json"] = json.dumps({"task": plan.task, "num_classes": int(party.data.num_classes),
                                         "classes": party.data.classes,
                                         "target_scale": None if scale is None else [float(scale[0]), float(scale[1])]},
                                        indent=1).encode()
    manifest["files"] = {name: _sha(data) for name, data in sorted(files.items())}
    for name, data in files.items():
        write_private(folder / name, data)
    write_private(folder / "manifest.json", json.dumps(manifest, indent=1).encode())
    return folder


def load_part(directory: str | Path, party: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """``directory/<party>/``'s manifest and files, every file checked against the manifest's SHA-256."""
    folder = Path(directory).expanduser() / party
    where = f"--model {directory}: {party}"
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except FileNotFoundError:
        raise DataError(f"{where}: no manifest.json in {folder} (each party's part is written by --save-model)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{where}: manifest.json is not JSON ({exc.__class__.__name__}); refused") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("party") != party:
        raise DataError(f"{where}: manifest.json is not a {FORMAT} manifest of party {party!r}; refused")
    files: dict[str, bytes] = {}
    for name, digest in dict(manifest.get("files") or {}).items():
        if "/" in name or name.startswith("."):
            raise DataError(f"{where}: manifest names file {name!r}; refused")
        try:
            data = (folder / name).read_bytes()
        except FileNotFoundError:
            raise DataError(f"{where}: {name} is missing; refused") from None
        if _sha(data) != digest:
            raise DataError(f"{where}: {name} does not match the SHA-256 in its manifest (tampered or corrupted); "
                            f"refused")
        files[name] = data
    return manifest, files


#: what every part of one model must agree on
SHARED = ("parties", "arch", "cut", "merge", "task", "num_outputs", "guest_cut_activation", "config")


def check_parts(manifests: dict[str, dict[str, Any]]) -> None:
    """Refuse parts that do not make one model (one line naming the party and the field)."""
    host = manifests.get("host")
    if host is None:
        raise DataError("--model: no host part")
    want = sorted(host["parties"])
    if sorted(manifests) != want:
        raise DataError(f"--model: the parts given are {sorted(manifests)}, the host's manifest lists {want}; refused")
    for party, m in manifests.items():
        for k in SHARED:
            if m.get(k) != host.get(k):
                raise DataError(f"--model: {party}'s manifest has another {k} than the host's "
                                f"({_short(m.get(k))} vs {_short(host.get(k))}); the parts are not of one model")
        if party != "host" and list(m.get("cut_shape") or []) != list(host["guest_shapes"].get(party, [])):
            raise DataError(f"--model: {party}'s cut-layer shape {m.get('cut_shape')} is not the "
                            f"{host['guest_shapes'].get(party)} the host's top expects; refused")


def _short(v: Any) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 60 else "config digest " + _sha(text.encode())[:12]


def init_state(directory: str | Path, party: str, plan) -> dict[str, Any]:
    """``--init-from``: ``party``'s own saved weights, after checking that its part fits this run's plan
    (architecture, cut, merge, task, this party's input and cut-layer shapes)."""
    manifest, files = load_part(directory, party)
    here = {"arch": plan.arch, "cut": plan.cut, "merge": plan.cfg.merge,
            "input_shape": list(plan.input_shapes[party]) if party in plan.input_shapes else None}
    if party != "host":  # a guest's bottom does not depend on the task (a deployed guest may not know it)
        here["cut_shape"] = list(plan.cut_shapes[party])
    else:
        here.update(task=plan.task, num_outputs=plan.num_outputs,
                    guest_shapes={g: list(plan.cut_shapes[g]) for g in plan.guests})
    for k, v in here.items():
        if manifest.get(k) != v:
            raise DataError(f"--init-from {directory}: {party}'s saved part has {k} {_short(manifest.get(k))}, this run "
                            f"has {_short(v)}; refused")
    return load_state(files)


def load_state(files: dict[str, bytes]) -> dict[str, Any]:
    """``model.pt`` of a checked part (tensors only: ``weights_only``)."""
    return torch.load(io.BytesIO(files["model.pt"]), map_location="cpu", weights_only=True)
