"""``fl-split export-model`` (issue 24): the subcommand's flags and its command; the work is in
:mod:`fl_split.export` (imported only when the command runs: building the parser loads no torch)."""

from __future__ import annotations

import json

#: as fl_split.export.FORMATS / ONNX_OPSET (not imported here: that module loads torch)
FORMATS = ("torchscript", "onnx")
ONNX_OPSET = 18


def add_parser(sub) -> None:
    """Register ``export-model`` on ``sub`` (the ``fl-split`` subparsers)."""
    ex = sub.add_parser(
        "export-model", help="export each party's saved part as TorchScript or ONNX with its input/output schema",
        description="Write OUT/<party>/<party>.pt (TorchScript) or .onnx and schema.json, owner-only, from the "
                    "parts --model holds (each checked against its manifest). A guest's module is its bottom only: "
                    "its output is the RAW cut-layer activation, to be released through the mechanism its schema "
                    "names (docs/serving.md, 'Serving outside fl_split').")
    ex.add_argument("--model", required=True, metavar="DIR", help="the saved model (DIR/host, DIR/guest-1, …)")
    ex.add_argument("--party", required=True, metavar="PARTY", help="host, guest-N or all")
    ex.add_argument("--format", dest="export_format", choices=FORMATS, default="onnx",
                    help="torchscript (torch.jit) or onnx (torch.onnx, opset %d) [default: onnx]" % ONNX_OPSET)
    ex.add_argument("--out", dest="export_out", required=True, metavar="OUTDIR", help="directory to write into")


def cmd_export_model(ns) -> int:
    from fl_split.export import export_model

    paths = export_model(ns.model, ns.party, ns.export_format, ns.export_out)
    for party, path in paths.items():
        schema = json.loads(path.read_text())
        print(f"{party}: {path.parent / schema['file']} + schema.json (max |exported - fl_split| "
              f"{schema['check']['max_abs_diff']:.2g})")
        if schema["role"] == "guest" and schema["release"]["mechanism"].get("name", "none") != "none":
            print(f"{party}: WARNING: the module outputs RAW activations; release them only through "
                  f"{schema['release']['mechanism']['name']} (schema.json 'release')")
    return 0
