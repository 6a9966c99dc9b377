"""experiments/bench_scale.py's pieces: the tables it writes, its memory reading and its summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import bench_scale  # noqa: E402


@pytest.mark.parametrize("guests", [1, 2])
def test_tables_hold_the_same_ids_shuffled_and_ten_columns_a_party(tmp_path, guests):
    flags = bench_scale.write_tables(tmp_path, 500, guests)
    paths = dict(f.split("=", 1) for f in flags[1::2])
    assert flags[::2] == ["--data"] * (guests + 1) and list(paths) == ["host"] + [f"guest-{g}" for g in range(1, guests + 1)]
    host = pd.read_parquet(paths["host"])
    assert list(host.columns) == ["id"] + [f"h{i}" for i in range(10)] + ["y"]
    assert set(host["y"].unique()) == {0, 1}
    for g in range(1, guests + 1):
        guest = pd.read_parquet(paths[f"guest-{g}"])
        assert guest.shape == (500, 11) and "y" not in guest.columns
        assert sorted(guest["id"]) == sorted(host["id"]) == list(range(500))
        assert not (guest["id"].to_numpy() == host["id"].to_numpy()).all()  # another row order


def test_peak_rss_sees_a_child_process(tmp_path):
    # a child of the command allocates 200 MiB and holds it for a second: its VmHWM is read
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time; b = bytearray(200 * 2**20); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(1.0)'])")
    proc = subprocess.Popen([sys.executable, "-c", code])
    rss = bench_scale.PeakRss(proc.pid, interval=0.05)
    assert proc.wait(timeout=60) == 0
    mem = rss.stop()
    assert mem["max_mib"] >= 200 and len(mem["processes"]) == 2
    assert mem["sum_mib"] >= mem["max_mib"]


def test_summary_medians_and_ratio_to_the_undefended_run_of_the_same_engine_and_size():
    def run(n, engine, defense, t):
        return {"rows": n, "engine": engine, "defense": defense, "time_s": t, "peak_rss": {"max_mib": 100.0}}

    rows = [run(10, "local", "none", 2.0), run(10, "local", "none", 4.0), run(10, "local", "none", 100.0),
            run(10, "local", "gaussian", 3.0), run(10, "flower", "none", 10.0), run(10, "flower", "gaussian", 12.0),
            {"rows": 10, "engine": "flower", "defense": "rr", "exit": 1, "peak_rss": {"max_mib": None}}]
    summ = {(s["engine"], s["defense"]): s for s in bench_scale.summarise(rows)}
    assert summ[("local", "none")]["median_time_s"] == 4.0 and summ[("local", "none")]["runs"] == 3
    assert summ[("local", "gaussian")]["ratio_to_none"] == 0.75
    assert summ[("flower", "gaussian")]["ratio_to_none"] == 1.2
    assert ("flower", "rr") not in summ  # a failed run has no time
    assert summ[("local", "none")]["rss_bytes_per_row"] == round(100 * 2**20 / 10, 1)
