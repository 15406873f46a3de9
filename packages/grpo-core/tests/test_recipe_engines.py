"""The local runner's engine specs (turnrl.grpo_core.recipe.engines): ports, and devices
of their own per engine. Starting them for real is the engine-cpu session's smoke runs;
the device cases here only build specs (no GPU or NPU is needed to read them)."""

from __future__ import annotations

import pytest

from turnrl.grpo_core.placement.actors import node_slots
from turnrl.grpo_core.recipe.engines import local_engine_specs
from turnrl.rollout_router.engine import EngineSpec, cpu_layout


def test_cpu_engines_share_the_host_on_ports_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    spec = EngineSpec(model="m", device="cpu")
    specs = local_engine_specs(spec, 2)
    assert len({s.port for s in specs}) == 2
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs)
    assert [s.cpu_slot for s in specs] == [(0, 2), (1, 2)]
    # What EngineServer launches them with on a host of 5 cores: the API servers share
    # the first core; each engine's workers get two of their own.
    laid_out = [cpu_layout(s, cores=range(5))[0] for s in specs]
    assert [(s.api_server_cores, s.cpu_threads_bind) for s in laid_out] == [
        ("0", "1,2"),
        ("0", "3,4"),
    ]
    # Five engines on five cores: the servers keep core 0, the engines share the others.
    five = [cpu_layout(s, cores=range(5))[0] for s in local_engine_specs(spec, 5)]
    assert [s.cpu_threads_bind for s in five] == ["1", "2", "3", "4", "1"]
    assert {s.api_server_cores for s in five} == {"0"}


def test_engines_are_numbered_per_node_for_their_cores() -> None:
    assert node_slots(["a", "b", "a", "a"]) == [(0, 3), (0, 1), (1, 3), (2, 3)]
    assert node_slots([]) == []


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
