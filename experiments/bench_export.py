"""Exported parts for serving outside fl_split (issue 24, ``fl-split export-model``): what an export
costs and how fast each format serves (``fl_split/export.py``, docs/serving.md).

For two saved models — ``mlp`` on breast-cancer (tables; 1 guest) and ``cnn-stripe`` on digits
(images; 1 guest), each trained 1 epoch with ``--defense none`` — it times ``export_model(…, "all",
fmt)`` per format (the export's own check included) and, per party and batch size, the median
latency of one forward pass through: the eager fl_split module (``torch``), the TorchScript file
(``torch.jit.load``) and the ONNX file (onnxruntime, CPU), each on one thread (the machine is shared;
``torch.set_num_threads(1)``, onnxruntime ``intra_op_num_threads=1``), with the largest difference to
the eager output. Run: ``python experiments/bench_export.py [--batches 1 256 4096] [--repeats 30]``;
writes ``experiments/results/bench_export.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from fl_split.config import RunConfig
from fl_split.engine import run_experiment
from fl_split.export import export_model, guest_module, host_module
from fl_split.serving import load_part

MODELS = {"mlp/breast-cancer": {"dataset": "breast-cancer", "model": "mlp"},
          "cnn-stripe/digits": {"dataset": "digits", "model": "cnn-stripe"}}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (first-call allocation, onnxruntime's arena)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256, 4096])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_export.json"))
    args = ap.parse_args(argv)
    import onnxruntime as ort

    torch.set_num_threads(1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    out: dict = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                 "torch": torch.__version__, "onnxruntime": ort.__version__, "load_before": os.getloadavg()[0],
                 "repeats": args.repeats, "rows": []}
    seed = None  # fresh OS entropy per party: the benchmark's models need no reproducible secret
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            model = Path(tmp) / name.replace("/", "-")
            run_experiment(RunConfig(**spec, guests=1, epochs=1, progress=False, save_model=str(model)), seed)
            for fmt in ("torchscript", "onnx"):
                t = time.perf_counter()
                paths = export_model(str(model), "all", fmt, str(Path(tmp) / f"{model.name}-{fmt}"))
                export_s = time.perf_counter() - t
                for party, schema_path in paths.items():
                    schema = json.loads(schema_path.read_text())
                    data = (schema_path.parent / schema["file"]).read_bytes()
                    manifest, files = load_part(str(model), party)
                    eager = (host_module if party == "host" else guest_module)(manifest, files)[0]
                    if fmt == "torchscript":
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore", FutureWarning)
                            served = torch.jit.load(io.BytesIO(data))
                    else:
                        sess = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
                    names = [i["name"] for i in schema["inputs"]]
                    for b in args.batches:
                        gen = torch.Generator().manual_seed(b)
                        x = tuple(torch.randn((b, *i["shape"][1:]), generator=gen) for i in schema["inputs"])
                        with torch.no_grad():
                            want = eager(*x).numpy()
                            eager_ms = _median_ms(lambda: eager(*x), args.repeats)
                            if fmt == "torchscript":
                                got = served(*x).numpy()
                                ms = _median_ms(lambda: served(*x), args.repeats)
                            else:
                                feed = {n: t.numpy() for n, t in zip(names, x)}
                                got = sess.run(None, feed)[0]
                                ms = _median_ms(lambda: sess.run(None, feed), args.repeats)
                        out["rows"].append({"model": name, "format": fmt, "party": party, "batch": b,
                                            "export_s_all_parties": round(export_s, 2), "file_bytes": len(data),
                                            "eager_ms": eager_ms, "served_ms": ms,
                                            "max_abs_diff": float(np.abs(got - want).max())})
    out["load_after"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{'model':20} {'format':12} {'party':8} {'batch':>6} {'export s':>9} {'bytes':>8} {'eager ms':>9} "
          f"{'served ms':>10} {'max diff':>9}")
    for r in out["rows"]:
        print(f"{r['model']:20} {r['format']:12} {r['party']:8} {r['batch']:6d} {r['export_s_all_parties']:9.2f} "
              f"{r['file_bytes']:8d} {r['eager_ms']:9.3f} {r['served_ms']:10.3f} {r['max_abs_diff']:9.2g}")
    print(f"load average before/after: {out['load_before']:.1f} / {out['load_after']:.1f} ({out['cpus']} CPUs)")
    return out


if __name__ == "__main__":
    main()
