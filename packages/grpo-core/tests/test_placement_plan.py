"""The placement planner (no Ray): bundle counts, rank/engine -> bundle maps, validation."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnrl.grpo_core.placement.plan import (
    COLOCATED_ENGINE_SHARE,
    COLOCATED_TRAINER_SHARE,
    PlacementConfig,
    plan_placement,
    resolve_accelerator,
)
from turnrl.rollout_router.testing import ThreadedFakeEngine


def test_disaggregated_plan_gives_engines_their_own_bundles() -> None:
    """The tau NPU script's layout: 4 trainer + 4 rollout devices, 2 devices per engine."""
    config = PlacementConfig(
        actor_num_nodes=1,
        actor_num_gpus_per_node=4,
        rollout_num_gpus=4,
        rollout_num_gpus_per_engine=2,
        accelerator="NPU",
        cpus_per_device=2,
    )
    plan = plan_placement(config)
    assert plan.num_bundles == 8
    assert plan.bundles == ({"CPU": 2.0, "NPU": 1.0},) * 8
    assert plan.trainer_bundles == (0, 1, 2, 3)
    assert plan.engine_bundles == ((4, 5), (6, 7))
    assert plan.trainer_share == plan.engine_share == 1.0
    assert plan.actor_resources(1.0) == {"num_cpus": 2.0, "resources": {"NPU": 1.0}}
    assert plan.strategy == "PACK"


def test_colocated_plan_reuses_trainer_bundles() -> None:
    config = PlacementConfig(
        actor_num_nodes=2,
        actor_num_gpus_per_node=4,
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=4,
        colocate=True,
        accelerator="GPU",
    )
    plan = plan_placement(config)
    assert plan.num_bundles == 8  # no devices beyond the trainers'
    assert plan.trainer_bundles == tuple(range(8))
    assert plan.engine_bundles == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (plan.trainer_share, plan.engine_share) == (
        COLOCATED_TRAINER_SHARE,
        COLOCATED_ENGINE_SHARE,
    )
    # Both actors fit in one bundle together.
    assert plan.trainer_share + plan.engine_share <= 1.0
    assert plan.actor_resources(plan.engine_share) == {"num_cpus": 0.2, "num_gpus": 0.2}


def test_cpu_plan_bundles_hold_only_cpus() -> None:
    plan = plan_placement(PlacementConfig(rollout_num_gpus=3, accelerator="CPU"))
    assert plan.bundles == ({"CPU": 1.0},) * 4
    assert plan.engine_bundles == ((1,), (2,), (3,))
    assert plan.actor_resources(0.5) == {"num_cpus": 0.5}


def test_accelerator_override_and_auto_resolution() -> None:
    config = PlacementConfig()
    assert plan_placement(config, accelerator="GPU").bundles[0] == {"CPU": 1.0, "GPU": 1.0}
    assert resolve_accelerator("NPU") == "NPU"
    # auto asks turnrl.npu_runtime; forced to the CPU it must say CPU.
    code = (
        "from turnrl.grpo_core.placement.plan import resolve_accelerator;"
        "print(resolve_accelerator('auto'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"TURNRL_DEVICE": "cpu", "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "CPU"
    with pytest.raises(ValueError, match="accelerator must be one of"):
        resolve_accelerator("TPU")


@given(
    nodes=st.integers(1, 4),
    per_node=st.integers(1, 8),
    per_engine=st.integers(1, 4),
    num_engines=st.integers(1, 6),
    colocate=st.booleans(),
)
def test_plan_invariants(
    nodes: int, per_node: int, per_engine: int, num_engines: int, colocate: bool
) -> None:
    """Every trainer and engine device gets a bundle; disaggregated ones never overlap."""
    rollout = per_engine * num_engines
    if colocate and rollout > nodes * per_node:
        return  # rejected by validation (tested below)
    config = PlacementConfig(
        actor_num_nodes=nodes,
        actor_num_gpus_per_node=per_node,
        rollout_num_gpus=rollout,
        rollout_num_gpus_per_engine=per_engine,
        colocate=colocate,
        accelerator="CPU",
    )
    plan = plan_placement(config)
    engine_devices = [b for group in plan.engine_bundles for b in group]
    assert len(plan.trainer_bundles) == config.num_trainers
    assert len(plan.engine_bundles) == config.num_engines == num_engines
    assert all(len(group) == per_engine for group in plan.engine_bundles)
    assert all(list(g) == list(range(g[0], g[0] + per_engine)) for g in plan.engine_bundles)
    assert len(set(engine_devices)) == rollout  # no device serves two engines
    used = set(plan.trainer_bundles) | set(engine_devices)
    assert used == set(range(plan.num_bundles))  # nothing reserved for nobody
    if colocate:
        assert set(engine_devices) <= set(plan.trainer_bundles)
    else:
        assert not set(engine_devices) & set(plan.trainer_bundles)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"actor_num_nodes": 0}, "actor_num_nodes must be an integer >= 1"),
        ({"actor_num_gpus_per_node": -2}, "actor_num_gpus_per_node must be an integer >= 1"),
        ({"rollout_num_gpus": 1.5}, "rollout_num_gpus must be an integer >= 1"),
        ({"rollout_num_gpus_per_engine": True}, "rollout_num_gpus_per_engine must be an integer"),
        (
            {"rollout_num_gpus": 3, "rollout_num_gpus_per_engine": 2},
            r"rollout_num_gpus \(3\) must be a multiple of rollout_num_gpus_per_engine \(2\)",
        ),
        (
            {"actor_num_gpus_per_node": 2, "rollout_num_gpus": 4, "colocate": True},
            "rollout_num_gpus must be <= 2",
        ),
        ({"accelerator": "TPU"}, "accelerator must be one of"),
        ({"cpus_per_device": 0}, "cpus_per_device must be > 0"),
        ({"strategy": "RANDOM"}, "strategy must be one of"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlacementConfig(**kwargs)


def test_loop_imports_without_ray_and_ray_part_names_the_extra() -> None:
    """With ray hidden, the loop and planner import; the Ray part says what to install."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import turnrl.grpo_core.loop, turnrl.grpo_core.placement.plan\n"
        "from turnrl.grpo_core.placement.plan import PlacementConfig\n"
        "from turnrl.grpo_core.placement.actors import RayPlacement\n"
        "try:\n"
        "    RayPlacement(PlacementConfig(accelerator='CPU')).start()\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "turnrl-grpo-core[ray]" in out.stdout


def test_engine_launch_needs_exactly_one_server_kind() -> None:
    ray_actors = importlib.import_module("turnrl.grpo_core.placement.actors")
    with pytest.raises(ValueError, match="exactly one of"):
        ray_actors.EngineLaunch()
    with pytest.raises(ValueError, match="exactly one of"):
        ray_actors.EngineLaunch(spec=object(), server=ThreadedFakeEngine)
    assert ray_actors.EngineLaunch(server=ThreadedFakeEngine).server is ThreadedFakeEngine


def test_ray_placement_rejects_bad_timeout() -> None:
    from turnrl.grpo_core.placement.actors import RayPlacement

    with pytest.raises(ValueError, match="ready_timeout_s must be > 0"):
        RayPlacement(PlacementConfig(accelerator="CPU"), ready_timeout_s=0)


def test_trainer_ranks_get_the_device_environment_megatron_and_the_npu_script_need() -> None:
    from turnrl.grpo_core.placement.actors import trainer_device_env

    npu = trainer_device_env("npu", {})
    assert npu["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert npu["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert trainer_device_env("cuda", {}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert trainer_device_env("cuda", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == {}  # the user's
    assert "DISABLE_L2_CACHE" not in trainer_device_env("npu", {"DISABLE_L2_CACHE": "0"})
    assert trainer_device_env("cpu", {}) == {}
