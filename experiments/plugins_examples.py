"""The worked plug-in examples of docs/plugins.md against each other (issue 28): the clustering label
inference attack (examples/plugins/cluster_label.py, Liu & Lyu 2022) and the built-in direction
scoring (Li et al. 2022), mounted by the guest on credit, under no defence, the gradient
sparsification plug-in (examples/plugins/gradient_sparsification.py, rates 0.75 and 0.95) and the
built-in Laplace mechanism at epsilon 8, all protecting the host's backward releases.

    .venv/bin/python experiments/plugins_examples.py

One private seed, 800 records, 2 epochs: a smoke-sized comparison, not a benchmark (no seeds, no
spread). Prints one row per run and writes experiments/results/plugins_examples.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "plugins"))

from fl_split.attacks.options import AttackOptions  # noqa: E402
from fl_split.attacks.runner import run_attack  # noqa: E402
from fl_split.config import RunConfig  # noqa: E402
from fl_split.seeding import PrivateSeed  # noqa: E402

SEED = PrivateSeed.parse("9f3c2a71e8b4d05c6a1f7e92b3d84c10")  # the one of tests/test_plugins.py
GS = "gradient_sparsification:GradientSparsification"
DEFENCES = (("none", ""), (GS, "rate=0.75"), (GS, "rate=0.95"), ("laplace", ""))
ATTACKS = ("cluster_label:ClusterLabelInference", "label-direction")


def main() -> None:
    rows = []
    for defense, options in DEFENCES:
        for attack in ATTACKS:
            kw = dict(dataset="credit", guests=1, limit=800, epochs=2, progress=False, defense=defense, protect="host")
            if options:
                kw["defense_options"] = options
            if defense == "laplace":
                kw["epsilon"] = 8.0
            r = run_attack(RunConfig(**kw), AttackOptions(attack=attack), SEED)
            row = dict(defense=defense, options=options, attack=attack, metric=r["metric"], value=r["value"],
                       baseline=r["baseline"], test_accuracy=r["final"]["value"],
                       host_epsilon=r["privacy"]["host"]["epsilon"],
                       host_privacy_claim=r["privacy"]["host"].get("privacy_claim", "dp" if defense != "none" else "-"))
            print(row, flush=True)
            rows.append(row)
    out = ROOT / "experiments" / "results" / "plugins_examples.json"
    out.write_text(json.dumps({"command": "python experiments/plugins_examples.py", "rows": rows}, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
