"""Export each party's part for serving outside fl_split (issue 24): ``fl-split export-model``.

``fl-split export-model --model DIR --party guest-1|host|all --format torchscript|onnx --out OUTDIR``
reads a saved model (:mod:`fl_split.serving`: ``DIR/<party>/``, every file checked against its
manifest's SHA-256 and, where all parts are present, the manifests against each other) and writes,
for each party asked, ``OUTDIR/<party>/<party>.pt`` (TorchScript, ``torch.jit.trace``) or
``OUTDIR/<party>/<party>.onnx`` (``torch.onnx.export``, a dynamic batch axis) and ``schema.json``
beside it, owner-only (:mod:`fl_split.secure_files`).

**What each exported module computes.**

* A **guest**: its bottom model, ``features → cut-layer activation``. The release mechanism is
  **not** in it (the decision, ``docs/serving.md``, "Serving outside fl_split"): the mechanism draws
  noise from the party's secret stream and charges every release to the party's ledger, and neither
  a TorchScript nor an ONNX graph can do either (ONNX's random operators take a seed baked into the
  file — the same noise for every call, readable by whoever holds the file — and a float sampler
  without the discrete-Laplace grid voids the pure ε, ``docs/accounting.md``). The schema therefore
  says, in ``release``, that the module's output is the **raw activation**, gives the mechanism's
  public parameters (its ``mechanism.json``) and what must be applied to every output before it
  leaves the guest.
* The **host**: its bottom (if it holds features), its receiver-side denoising of each guest's
  release (a deterministic ``scale``; a random ``mask`` cannot be exported and is refused), the
  merge, the top and the task's head: class probabilities (softmax, as ``fl-split predict``) or the
  regression value in the label's units (the host's own training mean and sd). Its inputs, in merge
  order: its own features, then each guest's released cut-layer output.

**Schema** (``schema.json``): the inputs in order (name, dtype, shape with ``-1`` for the batch; a
features input lists the encoded columns in order and the party's own fitted encoder, so a serving
team can build the input from raw columns), the output, the mechanism (guest) or the denoising and
classes (host), the saved part's manifest digest, versions, and the export's own check: the
exported module and the fl_split module on the same random inputs, the largest difference.

Nothing of another party's and no secret is written: a guest's export holds its bottom and its own
encoder; the host's its bottom, top, denoising, label mapping and target scale (test).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fl_split.errors import ConfigError, DataError

FORMATS = ("torchscript", "onnx")
SCHEMA_FORMAT = "fl_split-export/1"
SUFFIX = {"torchscript": ".pt", "onnx": ".onnx"}
#: largest |exported − fl_split| the export's own check accepts (float32 kernels of another runtime
#: sum in another order: ~1e-7 relative per operation; see docs/serving.md)
CHECK_ATOL, CHECK_RTOL = 1e-4, 1e-4
ONNX_OPSET = 18
#: what every guest schema says first (the decision of docs/serving.md)
RAW_WARNING = ("THIS MODULE DOES NOT PROTECT ITS OUTPUT. It computes the guest's cut-layer activation before its "
               "release mechanism: served as it is, it releases raw activations, from which the receiver can "
               "reconstruct features (docs/attacks.md), with no differential-privacy guarantee and no ledger. "
               "Release each output only through the mechanism in 'release.mechanism' (fresh noise from the "
               "guest's own unpredictable generator, every release charged to the guest's ledger), e.g. through "
               "fl_split's GuestScorer.")


class GuestExport(nn.Module):
    """A guest's served module: its bottom (eval mode), ``features → cut-layer activation``."""

    def __init__(self, bottom: nn.Module) -> None:
        super().__init__()
        self.bottom = bottom

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:  # noqa: D102 - one input: the features
        return self.bottom(inputs[0])


class HostExport(nn.Module):
    """The host's served module: ``(own features?, guest cut outputs in merge order) → output``.

    ``lam``: the deterministic denoising ``S(x) = λ·x`` of each received release (003 §3.1), or
    ``None``; ``scale``: ``(mean, sd)`` of a regression target (output in the label's units), or
    ``None`` for a classifier (softmax probabilities, as :func:`fl_split.predict.predict`)."""

    def __init__(self, bottom: nn.Module | None, top: nn.Module, op: str, guests: int, lam: float | None,
                 scale: tuple[float, float] | None) -> None:
        super().__init__()
        self.bottom, self.top, self.op, self.guests = bottom, top, op, guests
        self.lam = lam
        self.scale = scale

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:  # noqa: D102
        from fl_split.merge import merge_tensors

        own = 1 if self.bottom is not None else 0
        parts = [self.bottom(inputs[0])] if self.bottom is not None else []
        for t in inputs[own:own + self.guests]:
            parts.append(t * self.lam if self.lam is not None else t)
        out = self.top(merge_tensors(self.op, parts))
        if self.scale is None:
            return torch.softmax(out.float(), dim=1)
        return out * self.scale[1] + self.scale[0]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_checked(model_dir: str, parties: list[str]) -> dict[str, tuple[dict, dict]]:
    """The asked parts, checked (:func:`fl_split.serving.load_part`: SHA-256 of every file); when
    every part of the model is in ``model_dir`` (one organisation's test copy, or ``--party all``),
    also the manifests against each other (:func:`fl_split.serving.check_parts`). A party exporting
    on its own machine holds only its own folder: then its own part is checked alone."""
    from fl_split.serving import check_parts, load_part

    parts = {p: load_part(model_dir, p) for p in parties}
    listed = next(iter(parts.values()))[0].get("parties") or []
    root = Path(model_dir).expanduser()
    if all((root / p / "manifest.json").exists() for p in listed):
        everything = {p: parts[p][0] if p in parts else load_part(model_dir, p)[0] for p in listed}
        check_parts(everything)
    return parts


def _arch(manifest: dict):
    from fl_split.builder import _architecture
    from fl_split.config import RunConfig

    cfg = RunConfig.from_mapping(manifest["config"])
    return cfg, _architecture(cfg, manifest["num_outputs"], None)


def _features_input(name: str, manifest: dict, pre: dict) -> dict[str, Any]:
    """A features input of the schema: shape, the encoded columns in order, the party's own encoder."""
    shape = [-1, *manifest["input_shape"]]
    entry: dict[str, Any] = {"name": name, "dtype": "float32", "shape": shape}
    if pre.get("kind") == "table":
        from fl_split.data.encoding import ColumnEncoder

        enc = ColumnEncoder.from_dict(pre, f"{manifest['party']}'s saved preprocessing")
        entry["columns"] = enc.output_names
        # the encoder's own dict (ColumnEncoder.to_dict: format, policy, columns …), so that the recipe in
        # 'how' works on it as it stands (docs/serving.md, "Schema")
        entry["encoder"] = {
            **enc.to_dict(),
            "how": ("each raw column in 'columns' order gives: numeric → (value − mean) / std, an empty cell "
                    "first replaced by 'fill' (policy raw; policy builtin: an empty cell gives 0); categorical → "
                    "one 0/1 column per category in 'categories' order (an unseen value: all zeros; an empty cell: "
                    "'fill' when not null); a column with indicator true adds a 0/1 column '<name>:missing'; drop → "
                    "nothing. With raw = this 'encoder' object as json.load gives it, "
                    "fl_split.data.encoding.ColumnEncoder.from_dict(raw).transform(table) does exactly this.")}
    else:
        entry["columns"] = list(pre.get("columns") or [])
        entry["encoder"] = {"policy": "image",
                            "how": "the pixel values as the dataset loader gives them (no encoder is fitted)"}
    if pre.get("kind") == "table" and len(entry["columns"]) != int(np.prod(manifest["input_shape"])):
        raise DataError(f"--model: {manifest['party']}'s encoder gives {len(entry['columns'])} columns, its manifest's "
                        f"input shape is {manifest['input_shape']}; refused")
    return entry


def guest_module(manifest: dict, files: dict[str, bytes]) -> tuple[GuestExport, dict[str, Any]]:
    """A guest's module (bottom only) and its schema, from its checked saved part."""
    from fl_split.models.registry import build_bottom
    from fl_split.serving import load_state

    party = manifest["party"]
    pre = json.loads(files["preprocessing.json"])
    if pre.get("padded"):
        raise DataError(f"--model: {party}'s part was trained with --padding; export-model does not pad (its "
                        f"input would hold zeros at the other parties' offsets)")
    cfg, arch = _arch(manifest)
    if cfg.schedule != "constant":
        raise ConfigError("schedule", cfg.schedule, "constant for a model that is served",
                          reason=f"{party}'s geometric schedule has no mechanism for releases after training")
    from fl_split.privacy.factory import guest_cut_activation

    if manifest["guest_cut_activation"] != guest_cut_activation(cfg):  # the manifest against its own config
        raise DataError(f"--model: {party}'s manifest has cut activation {manifest['guest_cut_activation']!r}, its "
                        f"configuration (--defense {cfg.defense}) gives {guest_cut_activation(cfg)!r}; refused")
    bottom = build_bottom(arch, party, tuple(manifest["input_shape"]), manifest["cut"],
                          manifest["guest_cut_activation"], None)
    bottom.load_state_dict(load_state(files)["bottom"])
    module = GuestExport(bottom).eval()
    mech = json.loads(files["mechanism.json"])
    protected = mech.get("name", "none") != "none"
    schema = {
        "inputs": [_features_input("features", manifest, pre)],
        "output": {"name": "cut", "dtype": "float32", "shape": [-1, *manifest["cut_shape"]],
                   "meaning": f"{party}'s cut-layer activation (its bottom's output, cut activation "
                              f"{manifest['guest_cut_activation']!r}) BEFORE its release mechanism"},
        "release": {
            "included": False, "mechanism": mech,
            "warning": RAW_WARNING if protected else (
                "trained without a forward mechanism (--defense none or a defence of training only): fl_split "
                "releases this output as it is, with no differential-privacy guarantee; so does this module"),
            "how": _how_to_release(mech)},
    }
    return module, schema


def _how_to_release(mech: dict) -> str:
    name = mech.get("name")
    if name == "laplace":
        return (f"clip each element to [-{mech['bound']}, {mech['bound']}], snap to the grid {mech['grid']} and add "
                f"discrete Laplace noise of parameter t = {mech['t']} grid steps (scale b = {mech['b']}) per element: "
                f"epsilon {mech['epsilon']} per record per release (fl_split.privacy.mechanisms.Laplace)")
    if name == "gaussian":
        return (f"clamp each element to [-{mech['bound']}, {mech['bound']}] and add N(0, {mech['sigma']}^2) per "
                f"element (noise multiplier {mech['noise_multiplier']}; fl_split.privacy.mechanisms.Gaussian)")
    if name == "rr":
        return (f"binarise (value > 0) and keep each bit with probability {mech['keep_probability']} "
                f"(epsilon {mech['epsilon']} per record per release; fl_split.privacy.mechanisms.RandomizedResponse)")
    if name == "r3elu":
        return "R3eLU with the parameters above (fl_split.privacy.mechanisms.R3eLU)"
    return "none: the output is released as it is"


def host_module(manifest: dict, files: dict[str, bytes]) -> tuple[HostExport, dict[str, Any]]:
    """The host's module (bottom, denoising, merge, top, head) and its schema, from its checked part."""
    from fl_split.models.registry import build_bottom, build_top
    from fl_split.privacy import factory
    from fl_split.seeding import PartySecret
    from fl_split.serving import load_state

    cfg, arch = _arch(manifest)
    state = load_state(files)
    pre = json.loads(files["preprocessing.json"])
    if pre.get("padded"):
        raise DataError("--model: host's part was trained with --padding; export-model does not pad")
    bottom = None
    if "bottom" in state:
        bottom = build_bottom(arch, "host", tuple(manifest["input_shape"]), manifest["cut"], "native", None)
        bottom.load_state_dict(state["bottom"])
    top = build_top(arch, tuple(manifest["merged_shape"]), manifest["cut"], manifest["num_outputs"],
                    PartySecret.fresh())  # initial weights, all replaced by the saved ones
    top.load_state_dict(state["top"])
    post = factory.postprocess(cfg, "forward")
    if post.random:
        raise DataError(f"--model: host's part denoises each release with a random {post.name} (--denoise "
                        f"{cfg.denoise}); a served module must be deterministic: export-model supports scale or none")
    lam = float(post.lam) if post.name == "scale" else None
    task = json.loads(files["task.json"])
    scale = None
    if task["task"] == "regression":
        scale = (float(task["target_scale"][0]), float(task["target_scale"][1]))
    guests = list(manifest["guest_shapes"])
    module = HostExport(bottom, top, manifest["merge"], len(guests), lam, scale).eval()
    inputs = [_features_input("host_features", manifest, pre)] if bottom is not None else []
    for g in guests:
        inputs.append({"name": g.replace("-", "_") + "_cut", "party": g, "dtype": "float32",
                       "shape": [-1, *manifest["guest_shapes"][g]],
                       "meaning": f"{g}'s released cut-layer output as it arrives (after {g}'s mechanism); the "
                                  f"host's denoising is inside this module"})
    if scale is None:
        k = int(manifest["num_outputs"])
        classes = task.get("classes") or list(range(k))
        output = {"name": "probabilities", "dtype": "float32", "shape": [-1, k],
                  "columns": [f"p_{i}" for i in range(k)], "classes": classes,
                  "meaning": "softmax of the top's output; column p_i is the probability of classes[i], the "
                             "predicted class its argmax (as fl-split predict)"}
    else:
        output = {"name": "prediction", "dtype": "float32", "shape": [-1, 1],
                  "meaning": "the regression value in the label's units (the host's training mean and sd are "
                             "applied inside the module)"}
    schema = {"inputs": inputs, "output": output, "task": task["task"], "merge": manifest["merge"],
              "merge_order": ["host", *guests] if bottom is not None else guests,
              "denoise": post.describe()}
    return module, schema


def _example(shapes: list[list[int]], batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random inputs of ``shapes`` (no data of anyone's: the export traces and checks on these)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn((batch, *s[1:]), generator=gen) for s in shapes)


def _write_torchscript(module: nn.Module, example: tuple[torch.Tensor, ...]) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        traced = torch.jit.trace(module, example, check_trace=False)
        buf = io.BytesIO()
        torch.jit.save(traced, buf)
    return buf.getvalue()


def _write_onnx(module: nn.Module, example: tuple[torch.Tensor, ...], names: list[str], output: str,
                where: str) -> bytes:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        raise ConfigError("format", "onnx", "torchscript, or onnx with the export extra installed",
                          reason="the onnx and onnxscript packages are missing (pip install 'fl-split[export]')") \
            from None
    import contextlib
    import os
    import tempfile

    batch = torch.export.Dim("batch", min=1)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), \
            contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        path = os.path.join(tmp, "m.onnx")
        try:
            # dynamic_shapes: one entry, forward's *inputs, each with a dynamic batch axis
            torch.onnx.export(module, example, path, input_names=names, output_names=[output],
                              dynamic_shapes=(tuple({0: batch} for _ in example),), opset_version=ONNX_OPSET,
                              dynamo=True, external_data=False, verbose=False)
        except Exception as exc:  # noqa: BLE001 - the exporter raises many kinds; one line names it
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            raise DataError(f"{where}: torch.onnx could not export the module ({exc.__class__.__name__}: {first}); "
                            f"try --format torchscript") from None
        return _strip_onnx(Path(path).read_bytes())


def _strip_onnx(data: bytes) -> bytes:
    """The exported graph without the exporter's per-node debugging metadata: its stack traces name
    the exporting machine's file paths (a user architecture's source file included)."""
    import onnx

    model = onnx.load_from_string(data)
    graphs = [model.graph, *(a.g for n in model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)]
    for graph in graphs:
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
    for fn in model.functions:
        for node in fn.node:
            del node.metadata_props[:]
    return model.SerializeToString()


def run_exported(fmt: str, data: bytes, inputs: tuple[torch.Tensor, ...], names: list[str]) -> np.ndarray:
    """The exported module's output on ``inputs``: TorchScript through ``torch.jit.load``, ONNX
    through onnxruntime (CPU)."""
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            m = torch.jit.load(io.BytesIO(data), map_location="cpu")
        with torch.no_grad():
            return m(*inputs).numpy()
    try:
        import onnxruntime as ort
    except ImportError:
        raise ConfigError("format", "onnx", "torchscript, or onnx with the export extra installed",
                          reason="onnxruntime is missing, needed to check the export "
                                 "(pip install 'fl-split[export]')") from None
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)})[0]


def build_part(model_dir: str, party: str, manifest: dict, files: dict[str, bytes],
               fmt: str) -> tuple[str, bytes, dict[str, Any]]:
    """``party``'s exported module (file name and bytes) and schema, checked against the fl_split
    module; nothing is written."""
    where = f"export-model --party {party}"
    try:
        module, schema = (host_module if party == "host" else guest_module)(manifest, files)
    except (RuntimeError, KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, (ConfigError, DataError)):
            raise
        text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise DataError(f"--model {model_dir}: {party}'s saved weights do not fit its manifest "
                        f"({exc.__class__.__name__}: {text}); refused") from None
    names = [i["name"] for i in schema["inputs"]]
    shapes = [i["shape"] for i in schema["inputs"]]
    example = _example(shapes, 4, 20240)  # batch 4: no axis of size 1 for the tracer to specialise on
    with torch.no_grad():
        if fmt == "torchscript":
            data = _write_torchscript(module, example)
        else:
            data = _write_onnx(module, example, names, schema["output"]["name"], where)
        # the export's own check: another batch size, other values, against the fl_split module
        check = _example(shapes, 7, 70921)
        want = module(*check).numpy()
    if list(want.shape[1:]) != list(schema["output"]["shape"][1:]):
        raise DataError(f"--model {model_dir}: {party}'s module gives outputs of shape {list(want.shape[1:])}, its "
                        f"manifest says {schema['output']['shape'][1:]}; refused")
    got = run_exported(fmt, data, check, names)
    if got.shape != want.shape or not np.allclose(got, want, atol=CHECK_ATOL, rtol=CHECK_RTOL):
        diff = float(np.abs(got - want).max()) if got.shape == want.shape else math.inf
        raise DataError(f"{where}: the exported {fmt} module's output differs from fl_split's by {diff:.3g} "
                        f"(shapes {list(got.shape)} vs {list(want.shape)}); nothing written")
    import fl_split

    file = f"{party}{SUFFIX[fmt]}"
    manifest_bytes = (Path(model_dir).expanduser() / party / "manifest.json").read_bytes()
    full = {"format": SCHEMA_FORMAT, "party": party, "role": "host" if party == "host" else "guest",
            "module_format": fmt, "file": file, "file_sha256": _sha(data), **schema,
            "model": {"arch": manifest["arch"], "cut": manifest["cut"],
                      "guest_cut_activation": manifest["guest_cut_activation"],
                      "saved_part_manifest_sha256": _sha(manifest_bytes)},
            "check": {"inputs": "7 random rows (N(0,1) per input element)",
                      "max_abs_diff": float(np.abs(got - want).max()), "atol": CHECK_ATOL, "rtol": CHECK_RTOL},
            "versions": {"fl_split": fl_split.__version__, "torch": torch.__version__,
                         **({"onnx_opset": ONNX_OPSET} if fmt == "onnx" else {})}}
    return file, data, full


def export_model(model_dir: str, party: str, fmt: str, out_dir: str) -> dict[str, Path]:
    """``fl-split export-model``: export ``party`` (a party name or ``all``) of the saved model."""
    if fmt not in FORMATS:
        raise ConfigError("format", fmt, " or ".join(FORMATS))
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError("out", out_dir, "a directory (created if missing)", reason="it is a file")
    if party == "all":
        from fl_split.serving import load_part

        listed = load_part(model_dir, "host")[0]["parties"]
    else:
        if party != "host" and not re.fullmatch(r"guest-[1-9][0-9]*", party):
            raise ConfigError("party", party, "host, guest-N or all")
        listed = [party]
    parts = load_checked(model_dir, listed)
    built = {p: build_part(model_dir, p, m, f, fmt) for p, (m, f) in parts.items()}  # all, before any write
    from fl_split.secure_files import private_dir, write_private

    paths = {}
    for p, (file, data, schema) in built.items():
        folder = private_dir(private_dir(out) / p)
        write_private(folder / file, data)
        paths[p] = write_private(folder / "schema.json", json.dumps(schema, indent=1, default=str).encode())
    return paths
