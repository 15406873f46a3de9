"""Units of the device smoke driver (the full run is ``ci/device_smoke.sh``; it needs an engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnrl.grpo_core.loop import DiskWeightSync
from turnrl.grpo_core.smoke import ToySample, engine_spec, even_reward, main, make_sync
from turnrl.npu_runtime.device import DeviceType


def sample(response: list[int]) -> ToySample:
    return ToySample([1, 2], response, [1] * len(response), [0.0] * len(response), "g")


def test_even_reward_is_fraction_of_even_ids() -> None:
    assert even_reward(sample([2, 4, 5, 7])) == 0.5
    assert even_reward(sample([1, 3])) == 0.0
    assert even_reward(sample([])) == 0.0


def test_cpu_and_npu_use_disk_sync(tmp_path: Path) -> None:
    for kind in (DeviceType.CPU, DeviceType.NPU):
        sync, name = make_sync(kind, "http://127.0.0.1:1", tmp_path)
        assert isinstance(sync, DiskWeightSync) and name == "disk"


def test_engine_spec_for_collective_pins_engine_to_device_one(tmp_path: Path) -> None:
    spec = engine_spec(DeviceType.CUDA, tmp_path, tmp_path / "py", "collective-nccl", 1234)
    assert spec.device == "gpu" and spec.port == 1234
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert spec.extra_args == ["--weight-transfer-config", '{"backend": "nccl"}']
    cpu = engine_spec(DeviceType.CPU, tmp_path, tmp_path / "py", "disk", 1234)
    assert cpu.dtype == "float32" and not cpu.extra_args


def test_main_rejects_bad_flags() -> None:
    with pytest.raises(SystemExit):
        main(["--steps", "three"])
    with pytest.raises(SystemExit):
        main(["--n", "0"])
