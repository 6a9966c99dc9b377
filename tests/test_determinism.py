"""``--deterministic`` (issue 18): deterministic cuDNN/cuBLAS kernels in every process that builds a
party (``fl_split.devices.apply_deterministic``, called where parties are built). On the CPU runs are
deterministic anyway; the CUDA test (skipped without a GPU) is the one that shows the flag's point."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_split.config import RunConfig
from fl_split.devices import CUBLAS_DETERMINISTIC, apply_deterministic
from fl_split.seeding import PrivateSeed
from tests.helpers import run_cli


@pytest.fixture
def restore_determinism():
    """The flag is process-wide by design (docs/flower.md, "Devices"): tests put torch back."""
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    state = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(state[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = state[1], state[2]
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = env


@pytest.mark.parametrize("flag", [True, False])
def test_deterministic_flag_reaches_torch_where_parties_are_built(flag, monkeypatch, capsys, restore_determinism):
    import fl_split.engine as engine_mod

    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = []
    real = engine_mod.LocalEngine.run

    def run(self):  # the parties are built by now: what does torch say during training?
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                     torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return real(self)

    monkeypatch.setattr(engine_mod.LocalEngine, "run", run)
    argv = ["train", "--epochs", "1", "--limit", "100", "--no-progress", "--device", "cpu"]
    code, out, err = run_cli(argv + (["--deterministic"] if flag else []), capsys)
    assert code == 0, err
    if flag:
        assert seen == [(True, True, False, ":4096:8")]
    else:  # without the flag nothing is touched (a caller's own settings stay)
        assert seen == [(False, torch.backends.cudnn.deterministic, True, None)]


def test_apply_deterministic_keeps_a_deterministic_cublas_setting(monkeypatch, restore_determinism):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other setting NVIDIA documents as deterministic
    assert apply_deterministic(True) and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # not deterministic: replaced
    apply_deterministic(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC[0]
    assert torch.are_deterministic_algorithms_enabled()
    assert RunConfig().deterministic is False  # off by default


def _write_mnist_standin(root: Path, n_train: int, n_test: int) -> None:
    """Random 28x28 images in the MNIST idx format (what ``--dataset mnist`` reads): enough for
    convolutions on cuDNN, which is what the flag is about."""
    rng = np.random.default_rng(0)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x, y = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 0x0803, n, 28, 28) + x.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">ii", 0x0801, n) + y.tobytes())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("model", ["cnn-mnist", "mnist-mlp-bn"])
def test_deterministic_local_runs_on_cuda_repeat_exactly(model, tmp_path, restore_determinism):
    """Two local runs with --deterministic on the GPU: identical per-epoch losses (to the bit), as on
    a CPU. Without the flag cuDNN may pick other convolution algorithms and atomics-based kernels
    may sum in another order, so the runs may differ in the last bits and drift apart."""
    from fl_split.engine import run_experiment

    _write_mnist_standin(tmp_path, 600, 200)
    cfg = RunConfig(dataset="mnist", data_root=str(tmp_path), model=model, guests=3, epochs=2, batch_size=64,
                    device="cuda", deterministic=True, progress=False)
    runs = [run_experiment(cfg, private_seed=PrivateSeed.legacy(1)) for _ in range(2)]
    losses = [[(h["train_loss"], h["test_loss"]) for h in r["history"]] for r in runs]
    assert losses[0] == losses[1]
    assert torch.are_deterministic_algorithms_enabled()
    assert runs[0]["parties"]["host"]["device"].startswith("cuda")
