"""The local runner's engine specs (turnrl.grpo_core.recipe.engines): ports, and devices
of their own per engine. Starting them for real is the engine-cpu session's smoke runs;
the device cases here only build specs (no GPU or NPU is needed to read them)."""

from __future__ import annotations

import pytest

from turnrl.grpo_core.recipe.engines import local_engine_specs
from turnrl.rollout_router.engine import EngineSpec


def test_cpu_engines_share_the_host_on_ports_of_their_own() -> None:
    specs = local_engine_specs(EngineSpec(model="m", device="cpu"), 3)
    assert len({s.port for s in specs}) == 3
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs)


@pytest.mark.parametrize(
    ("device", "variable"), [("gpu", "CUDA_VISIBLE_DEVICES"), ("npu", "ASCEND_RT_VISIBLE_DEVICES")]
)
def test_device_engines_get_their_own_cards_past_the_trainers(device: str, variable: str) -> None:
    spec = EngineSpec(model="m", device=device, tensor_parallel_size=2, env={"KEEP": "1"})
    specs = local_engine_specs(spec, 2, first_device=1, visible=5)
    assert [s.env[variable] for s in specs] == ["1,2", "3,4"]
    assert all(s.env["KEEP"] == "1" for s in specs) and spec.env == {"KEEP": "1"}
    assert specs[0].port != specs[1].port


def test_more_engines_than_devices_or_none_at_all_are_refused() -> None:
    spec = EngineSpec(model="m", device="gpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="need 5 cuda devices; this process sees 4"):
        local_engine_specs(spec, 2, first_device=1, visible=4)
    with pytest.raises(ValueError, match="at least one engine"):
        local_engine_specs(spec, 0, visible=8)
