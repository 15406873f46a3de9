"""Exact resume of the GRPO loop, including a trainer process killed with SIGKILL.

The toy task of ``turnrl.grpo_core.testing.golden`` samples from a generator seeded by
``(seed, step, prompt)``, so an uninterrupted run and a resumed one must agree exactly:
tolerance 0 on CPU (same prompts, same sample digest, bitwise-equal loss, grad norm and
weights) — both runs use deterministic algorithms and one thread.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from turnrl.grpo_core.loop import (
    CheckpointError,
    GRPOLoop,
    PromptIterator,
    latest_checkpoint,
    read_loop_state,
)
from turnrl.grpo_core.testing.golden import ToyRunConfig, build_toy_loop, deterministic_torch
from turnrl.grpo_core.training.checkpoint import TRAINER_STATE
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model

WORKER = Path(__file__).resolve().parent / "loop_resume_worker.py"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelConfig(seed=0))


@pytest.fixture(scope="module")
def checkpoint(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``step_1`` of a one-step toy run (copy it before changing it)."""
    root = tmp_path_factory.mktemp("ckpt")
    with deterministic_torch():
        loop = build_toy_loop(model, ToyRunConfig(steps=1), checkpoint_dir=root, save_interval=1)
        asyncio.run(loop.run())
    return root / "step_1"


def params(loop: GRPOLoop) -> list[torch.Tensor]:
    return [p.detach().clone() for p in loop.trainer.module.parameters()]


# -- finding checkpoints ---------------------------------------------------------------


def test_latest_checkpoint_picks_the_highest_complete_step(tmp_path: Path) -> None:
    for name, complete in [("step_2", True), ("step_10", True), ("step_11", False)]:
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "trainer_state.json").write_text("{}")
    (tmp_path / "step_12").mkdir()  # killed while writing trainer_state.json
    (tmp_path / "step_12" / "trainer_state.json").write_text('{"step": 12, "data_st')
    (tmp_path / "step_x").mkdir()
    (tmp_path / "step_12.tmp").mkdir()
    (tmp_path / "step_13.tmp" / "trainer_state.json").parent.mkdir()
    (tmp_path / "step_13.tmp" / "trainer_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"  # numeric, not 'step_2' > ...
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step_10"


def test_latest_checkpoint_is_none_without_a_complete_one(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "step_3").mkdir()  # a save cut short: no trainer_state.json
    assert latest_checkpoint(tmp_path) is None


# -- prompt position -------------------------------------------------------------------


@given(
    num_prompts=st.integers(1, 7),
    batch=st.integers(1, 5),
    consumed=st.integers(0, 6),
    shuffle=st.booleans(),
)
def test_prompt_iterator_continues_from_its_state(
    num_prompts: int, batch: int, consumed: int, shuffle: bool
) -> None:
    prompts = [f"p{i}" for i in range(num_prompts)]
    straight = PromptIterator(prompts, shuffle, seed=5)
    for _ in range(consumed):
        straight.next(batch)
    state = json.loads(json.dumps(straight.state_dict()))  # as a checkpoint stores it
    resumed = PromptIterator(prompts, shuffle, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.next(batch) for _ in range(4)] == [straight.next(batch) for _ in range(4)]


def test_prompt_iterator_rejects_another_runs_position() -> None:
    it = PromptIterator(["a", "b", "c"], shuffle=True, seed=1)
    good = it.state_dict()
    with pytest.raises(CheckpointError, match="num_prompts=4"):
        it.load_state_dict({**good, "num_prompts": 4})
    with pytest.raises(CheckpointError, match="seed=2"):
        it.load_state_dict({**good, "seed": 2})
    with pytest.raises(CheckpointError, match="shuffle=False"):
        it.load_state_dict({**good, "shuffle": False})
    with pytest.raises(CheckpointError, match="out of range"):
        it.load_state_dict({**good, "index": 4})
    with pytest.raises(CheckpointError, match="integers"):
        it.load_state_dict({**good, "epoch": "1"})
    with pytest.raises(CheckpointError, match=r"lacks \['index'\]"):
        it.load_state_dict({k: v for k, v in good.items() if k != "index"})
    with pytest.raises(CheckpointError, match="must be a dict"):
        it.load_state_dict([1, 2])  # type: ignore[arg-type]
    assert it.state_dict() == good  # nothing was changed by the failed loads


# -- resume in this process ------------------------------------------------------------


class DiskSync:
    """Weight sync through an exported Hugging Face folder (the CPU path to engines)."""

    def __init__(self, root: Path) -> None:
        self.root, self.versions = root, []  # type: ignore[var-annotated]

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        trainer.export_hf(self.root / f"v{version}")
        self.versions.append(version)
        return {"total_s": 0.0}


@pytest.mark.slow
async def test_resume_continues_exactly_in_process(model: Path, tmp_path: Path) -> None:
    config = ToyRunConfig(steps=3)  # 6 prompts, 4 per step: step 2 crosses an epoch
    with deterministic_torch():
        straight = build_toy_loop(model, config, checkpoint_dir=tmp_path / "a", save_interval=1)
        await straight.run()
        resumed = build_toy_loop(model, config, checkpoint_dir=tmp_path / "b", save_interval=1)
        sync = DiskSync(tmp_path / "sync")
        resumed.weight_sync = sync
        assert await resumed.resume(tmp_path / "a" / "step_2") == 2
        assert resumed.history == straight.history[:2]
        assert resumed.data.state_dict() == read_loop_state(tmp_path / "a" / "step_2")["data"]
        assert resumed.trainer.step == 4  # two optimizer updates per step
        assert sync.versions == [2]  # the engines got the restored weights as version 2
        history = await resumed.run()  # the remaining step
    assert len(history) == 3 and sync.versions == [2, 3]
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/kl_loss"):
        if key in straight.history[2]:
            assert history[2][key] == straight.history[2][key], key
    for a, b in zip(params(straight), params(resumed), strict=True):
        assert torch.equal(a, b)
    assert latest_checkpoint(tmp_path / "b") == tmp_path / "b" / "step_3"


async def test_resume_sends_the_checkpoint_weights_to_the_engines(
    model: Path, checkpoint: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    loop = build_toy_loop(model, ToyRunConfig(steps=2))
    loop.weight_sync = DiskSync(tmp_path / "sync")
    before = load_file(str(model / "model.safetensors"))
    await loop.resume(checkpoint)
    synced = load_file(str(tmp_path / "sync" / "v1" / "model.safetensors"))
    state = loop.trainer.module.state_dict()
    trained = {k.removeprefix("model."): v.cpu() for k, v in state.items()}
    assert synced.keys() == before.keys()
    assert all(torch.equal(synced[k], trained[k]) for k in synced)
    assert not all(torch.equal(synced[k], before[k]) for k in synced)  # one step was trained
    other = build_toy_loop(model, ToyRunConfig(steps=2))
    other.weight_sync = DiskSync(tmp_path / "sync2")
    await other.resume(checkpoint, sync_weights=False)
    assert other.weight_sync.versions == []  # type: ignore[union-attr]


# -- clear errors ----------------------------------------------------------------------


def _broken(checkpoint: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "step_1"
    shutil.copytree(checkpoint, folder)
    return folder


async def test_resume_from_a_missing_or_incomplete_folder(
    model: Path, checkpoint: Path, tmp_path: Path
) -> None:
    loop = build_toy_loop(model, ToyRunConfig(steps=2))
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        await loop.resume(tmp_path / "nope")
    folder = _broken(checkpoint, tmp_path)
    (folder / "trainer_state.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        await loop.resume(folder)
    assert loop.step == 0


async def test_resume_from_a_corrupt_folder(model: Path, checkpoint: Path, tmp_path: Path) -> None:
    loop = build_toy_loop(model, ToyRunConfig(steps=2))
    before = params(loop)
    folder = _broken(checkpoint, tmp_path)
    meta = folder / "trainer_state.json"
    good = meta.read_text()
    meta.write_text(good[: len(good) // 2])  # a torn write
    with pytest.raises(CheckpointError, match=r"corrupt checkpoint .*trainer_state\.json"):
        await loop.resume(folder)
    meta.write_text(json.dumps({**json.loads(good), "data_state": {}}))
    with pytest.raises(CheckpointError, match="holds no loop state"):
        await loop.resume(folder)
    bad_step = json.loads(good)
    bad_step["data_state"]["loop"]["step"] = -1
    meta.write_text(json.dumps(bad_step))
    with pytest.raises(CheckpointError, match="loop step must be an integer >= 0"):
        await loop.resume(folder)
    meta.write_text(good)
    # One flipped byte in the middle of a shard (DCP keeps no checksum of its own), and a
    # truncated RNG file: named by the digests saved with the checkpoint, nothing loaded.
    (shard,) = (folder / "state").glob("__0_*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    rng = folder / "rng_rank0.pt"
    rng.write_bytes(rng.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="corrupt checkpoint") as info:
        await loop.resume(folder)
    assert f"state/{shard.name} does not hold the bytes that were saved" in str(info.value)
    assert "rng_rank0.pt does not hold" in str(info.value)
    assert loop.trainer.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, params(loop), strict=True))
    shutil.rmtree(folder / "state")  # the model and optimizer shards are gone
    with pytest.raises(CheckpointError, match="cannot restore the trainer"):
        await loop.resume(folder)
    assert loop.step == 0 and loop.history == []
    assert all(torch.equal(a, b) for a, b in zip(before, params(loop), strict=True))


async def test_resume_into_a_loop_over_other_prompts(
    model: Path, checkpoint: Path, tmp_path: Path
) -> None:
    loop = build_toy_loop(model, ToyRunConfig(steps=2, num_prompts=5))
    with pytest.raises(CheckpointError, match="num_prompts=6, this run has num_prompts=5"):
        await loop.resume(checkpoint)
    assert loop.trainer.step == 0  # refused before the trainer was touched


async def test_trainer_only_checkpoint_is_not_a_loop_checkpoint(
    model: Path, tmp_path: Path
) -> None:
    loop = build_toy_loop(model, ToyRunConfig(steps=2))
    loop.trainer.save_checkpoint(tmp_path / "step_0", {"epoch": 0})
    with pytest.raises(CheckpointError, match="holds no loop state"):
        await loop.resume(tmp_path / "step_0")


def test_save_checkpoint_needs_a_checkpoint_dir(model: Path) -> None:
    loop = build_toy_loop(model, ToyRunConfig(steps=1))
    with pytest.raises(ValueError, match="no checkpoint_dir"):
        loop.save_checkpoint()
    with pytest.raises(ValueError, match="no checkpoint_dir"):
        loop.ensure_checkpoint()


async def test_the_last_step_is_checkpointed_once_and_resumed_from_the_newest(
    model: Path, tmp_path: Path
) -> None:
    """What both apps do after their last step and at a resumed start."""
    ckpt = tmp_path / "ckpt"
    loop = build_toy_loop(model, ToyRunConfig(steps=3), checkpoint_dir=ckpt, save_interval=2)
    assert await loop.resume_latest() is None and loop.step == 0  # a fresh folder
    await loop.run(2)  # save_interval wrote step_2
    saved = (ckpt / "step_2" / TRAINER_STATE).stat().st_mtime_ns
    assert loop.ensure_checkpoint() == ckpt / "step_2"
    assert (ckpt / "step_2" / TRAINER_STATE).stat().st_mtime_ns == saved  # not written again
    await loop.run(1)
    assert (
        loop.ensure_checkpoint() == ckpt / "step_3" and latest_checkpoint(ckpt) == ckpt / "step_3"
    )
    again = build_toy_loop(model, ToyRunConfig(steps=3), checkpoint_dir=ckpt, save_interval=2)
    assert await again.resume_latest() == ckpt / "step_3" and again.step == 3


# -- kill the trainer process ----------------------------------------------------------


def _worker(model: Path, records: Path, steps: int, ckpt: Path, *extra: str) -> Any:
    cmd = [sys.executable, str(WORKER), "--model", str(model), "--steps", str(steps)]
    cmd += ["--records", str(records), "--checkpoint-dir", str(ckpt), *extra]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)  # TURNRL_DEVICE=cpu


def _load_worker_module() -> Any:
    spec = importlib.util.spec_from_file_location("loop_resume_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _done_steps(ckpt: Path) -> int:
    latest = latest_checkpoint(ckpt)
    return -1 if latest is None else int(latest.name.removeprefix("step_"))


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_killed_trainer_resumes_exactly(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL a training process after its step-2 checkpoint; a fresh process resumes.

    The uninterrupted reference runs in this process (in a thread) while the victim runs;
    the resuming process starts at the same time and waits for a go file, so its start-up
    overlaps the others.
    """
    monkeypatch.setenv("TURNRL_DEVICE", "cpu")  # the reference here and the workers alike
    steps, kill_after = 5, 2
    ckpt, go = tmp_path / "ckpt", tmp_path / "go"
    victim = _worker(model, tmp_path / "killed.jsonl", steps, ckpt)
    resumed = _worker(
        model, tmp_path / "resumed.jsonl", steps, ckpt, "--resume", "--wait-for", str(go)
    )
    worker = _load_worker_module()
    codes: list[int] = []
    reference = threading.Thread(
        target=lambda: codes.append(
            asyncio.run(worker.run_worker(model, steps, tmp_path / "reference.jsonl"))
        )
    )
    reference.start()
    try:
        deadline = time.monotonic() + 300
        while _done_steps(ckpt) < kill_after:
            assert victim.poll() is None, f"worker exited early: {victim.stderr.read()}"
            assert time.monotonic() < deadline, f"no checkpoint of step {kill_after} in 300 s"
            time.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(30) == -signal.SIGKILL  # killed, not finished
        resumed_from = _done_steps(ckpt)
        assert kill_after <= resumed_from < steps  # there is something left to resume
        go.touch()
        _, err = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, err
        reference.join(300)
        assert codes == [0]
    finally:
        go.touch()
        for proc in (victim, resumed):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reference.join(300)
    got = _records(tmp_path / "resumed.jsonl")
    want = _records(tmp_path / "reference.jsonl")
    assert got[0] == {"resumed_from": resumed_from}
    assert [r["step"] for r in got[1:]] == list(range(resumed_from + 1, steps + 1))
    # Exact: same prompts, samples, loss, grad norm and weights after every later step.
    assert got[1:] == want[resumed_from:]
    assert len({r["weights"] for r in want}) == steps  # the digests do track training
