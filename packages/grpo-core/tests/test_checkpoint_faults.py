"""Faults while a checkpoint is written: a full disk and a kill mid-write leave the previous
checkpoint complete and loadable (real file systems and processes; the tmpfs needs root)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from turnrl.grpo_core.loop import latest_checkpoint
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.checkpoint import CheckpointWriteError
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _engine(tiny: Path) -> TorchEngine:
    return TorchEngine(TorchEngineConfig(model_path=str(tiny), optimizer=OptimizerConfig(lr=1e-3)))


def make_batch(seed: int) -> TrainBatch:
    ids = torch.randint(0, 700, (2, 16), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    return TrainBatch(ids, torch.ones_like(ids), mask, advantages=torch.tensor([1.0, -1.0]))


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest):
    """A tmpfs of a given size (bytes, by indirect parametrisation) mounted on a folder."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    libc = ctypes.CDLL(None, use_errno=True)
    disk = tmp_path / "disk"
    disk.mkdir()

    def mount(size: int) -> Path:
        if libc.mount(b"tmpfs", str(disk).encode(), b"tmpfs", 0, f"size={size}".encode()) != 0:
            pytest.skip(f"cannot mount a tmpfs here: {os.strerror(ctypes.get_errno())}")
        return disk

    yield mount
    libc.umount2(str(disk).encode(), 2)  # MNT_DETACH


def test_disk_full_during_a_save_leaves_the_previous_checkpoint(tiny, tmp_path, small_disk):
    engine = _engine(tiny)
    engine.train_step(make_batch(seed=1))
    engine.save_checkpoint(tmp_path / "probe", data_state={})
    disk = small_disk(int(_size(tmp_path / "probe") * 1.5))  # room for one, not two
    engine.save_checkpoint(disk / "step_1", data_state={"step": 1})
    engine.train_step(make_batch(seed=2))
    with pytest.raises(CheckpointWriteError, match="step_2 failed: no space left"):
        engine.save_checkpoint(disk / "step_2", data_state={"step": 2})
    assert latest_checkpoint(disk) == disk / "step_1"
    assert _engine(tiny).load_checkpoint(disk / "step_1") == {"step": 1}


_SAVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig

    tiny, root = sys.argv[1], Path(sys.argv[2])
    engine = TorchEngine(TorchEngineConfig(model_path=tiny, optimizer=OptimizerConfig(lr=1e-3)))
    engine.save_checkpoint(root / "step_1", data_state={"step": 1})
    print("saved", flush=True)
    for step in range(2, 10_000):  # save until killed
        engine.save_checkpoint(root / f"step_{step}", data_state={"step": step})
    """
)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tiny, tmp_path):
    root = tmp_path / "ckpts"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tiny), str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 120
        # Kill while a later save is half written: its folder exists, its state file not yet.
        while time.monotonic() < deadline:
            partial = [p for p in root.glob("step_*") if not (p / "trainer_state.json").exists()]
            if partial and any(p.name != "step_1" for p in partial):
                break
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    newest = latest_checkpoint(root)
    assert newest is not None
    step = int(newest.name.split("_")[1])
    assert _engine(tiny).load_checkpoint(newest) == {"step": step}
    incomplete = [p for p in root.glob("step_*") if not (p / "trainer_state.json").exists()]
    assert incomplete, "the kill did not land mid-save; the test proved nothing"
    assert all(int(p.name.split("_")[1]) > step for p in incomplete)
