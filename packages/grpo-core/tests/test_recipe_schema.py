"""The shared model / cluster / parallel sections: flags, placement, trainer configs and the
refusal of settings a run does not act on (``turnrl.grpo_core.recipe.schema``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.loop import LoopConfig
from turnrl.grpo_core.recipe.run_folder import config_from_dict
from turnrl.grpo_core.recipe.schema import (
    NOT_HONOURED,
    SCHEMA_FLAG_OF,
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    add_schema_flags,
    check_schema,
    engine_spec,
    loop_config,
    placement_config,
    reference_settings,
    refusals,
    router_config,
    trainer_config,
)
from turnrl.grpo_core.training.torch_engine import TorchEngineConfig
from turnrl.rollout_router.router import Router


@dataclass
class AppConfig:
    """A stand-in app: the shared sections with app defaults of its own."""

    seed: int = 5
    logger: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=lambda: ClusterConfig(runner="ray"))
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(micro_batch_size=16))
    loop: LoopConfig = field(default_factory=LoopConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    loss: ActorLossConfig = field(default_factory=ActorLossConfig)


def _refused(config: AppConfig) -> str:
    return "\n".join(refusals(config, NOT_HONOURED, SCHEMA_FLAG_OF))


def test_the_defaults_are_refused_nothing() -> None:
    assert _refused(AppConfig()) == ""
    check_schema(AppConfig(), [])


def test_megatron_flags_are_refused_on_the_torch_backend_naming_the_flag() -> None:
    config = AppConfig(parallel=ParallelConfig(sequence_parallel=True, recompute_num_layers=2))
    refused = _refused(config)
    assert "--sequence-parallel True: a Megatron setting" in refused
    assert "--recompute-num-layers 2: a Megatron setting" in refused
    with pytest.raises(ValueError, match="cannot honour") as error:
        check_schema(config, refusals(config, NOT_HONOURED, SCHEMA_FLAG_OF))
    assert "--sequence-parallel" in str(error.value) and "--recompute-num-layers" in str(
        error.value
    )


def test_placement_flags_act_on_ray_and_are_refused_on_the_local_runner() -> None:
    ray = AppConfig(cluster=ClusterConfig(runner="ray", actor_num_gpus_per_node=2, colocate=True))
    assert _refused(ray) == ""
    local = AppConfig(cluster=ClusterConfig(runner="local", actor_num_gpus_per_node=2))
    assert "--actor-num-gpus-per-node 2: the local runner trains in one process" in _refused(local)
    crowded = AppConfig(
        cluster=ClusterConfig(runner="ray", colocate=True, rollout_num_gpus=2)
    )  # 2 engines on 1 rank's device
    assert "do not fit on 1 rank(s)" in _refused(crowded)


def test_half_of_dynamic_batching_and_a_cpu_memory_margin_are_refused() -> None:
    half = AppConfig(parallel=ParallelConfig(use_dynamic_batch_size=True))
    assert "dynamic batching needs both" in _refused(half)
    both = AppConfig(parallel=ParallelConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=512))
    assert _refused(both) == ""
    margin = AppConfig(cluster=ClusterConfig(train_memory_margin_bytes=1 << 30))
    assert "on --device cpu there is no device memory" in _refused(margin)


def test_the_loops_off_policy_bound_acts_only_asynchronously_and_not_colocated() -> None:
    assert "only the asynchronous loop" in _refused(
        AppConfig(loop=LoopConfig(max_off_policy_steps=2))
    )
    assert _refused(AppConfig(loop=LoopConfig(asynchronous=True, max_off_policy_steps=2))) == ""
    colocated = AppConfig(
        cluster=ClusterConfig(runner="ray", colocate=True), loop=LoopConfig(asynchronous=True)
    )
    assert "--async with --colocate" in _refused(colocated)


def test_bad_values_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="--device must be cpu, gpu or npu"):
        ClusterConfig(device="tpu")
    with pytest.raises(ValueError, match="--runner must be local or ray"):
        ClusterConfig(runner="slurm")
    with pytest.raises(ValueError, match="--actor-num-gpus-per-node must be >= 1"):
        ClusterConfig(actor_num_gpus_per_node=0)
    with pytest.raises(ValueError, match="--train-backend must be torch or megatron"):
        ParallelConfig(train_backend="jax")
    with pytest.raises(ValueError, match="--logger neptune"):
        check_schema(AppConfig(logger=["neptune"]), [])
    with pytest.raises(ValueError, match="needs --hf-checkpoint"):
        check_schema(AppConfig(cluster=ClusterConfig(device="gpu")), [])
    with pytest.raises(ValueError, match="--router-read-timeout must be > 0, got 0"):
        check_schema(AppConfig(engine=EngineConfig(read_timeout=0)), [])
    with pytest.raises(ValueError, match="--vllm-server-concurrency must be >= 1, got 0"):
        check_schema(AppConfig(engine=EngineConfig(server_concurrency=0)), [])


def test_a_partial_section_keeps_the_apps_own_defaults() -> None:
    config = config_from_dict(AppConfig, {"cluster": {"colocate": True}, "parallel": {}})
    assert config.cluster.runner == "ray" and config.cluster.colocate
    assert config.parallel.micro_batch_size == 16
    with pytest.raises(ValueError, match="unknown config keys in ClusterConfig"):
        config_from_dict(AppConfig, {"cluster": {"num_engines": 2}})


def test_the_flags_set_the_sections() -> None:
    parser = argparse.ArgumentParser()
    add_schema_flags(parser)
    placement = ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--colocate"]
    args = parser.parse_args(
        [*placement, "--num-layers", "36", "--qk-layernorm", "--use-dynamic-batch-size"]
    )
    assert vars(args) == {
        "cluster.actor_num_gpus_per_node": 4,
        "cluster.rollout_num_gpus": 4,
        "cluster.colocate": True,
        "model.arch.num_layers": 36,
        "model.arch.qk_layernorm": True,
        "parallel.use_dynamic_batch_size": True,
    }


def test_placement_and_trainer_configs_come_from_the_sections() -> None:
    cluster = ClusterConfig(
        device="gpu", actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=8
    )
    cluster.rollout_num_gpus_per_engine = 2
    placement = placement_config(cluster)
    assert (placement.actor_num_nodes, placement.actor_num_gpus_per_node) == (2, 4)
    assert (placement.rollout_num_gpus, placement.rollout_num_gpus_per_engine) == (8, 2)
    assert placement.accelerator == "GPU" and cluster.num_engines == 4
    config = AppConfig(cluster=ClusterConfig(train_memory_margin_bytes=7))
    trainer = trainer_config(config, Path("m"), temperature=0.7)
    assert type(trainer) is TorchEngineConfig
    assert (trainer.model_path, trainer.micro_batch_size, trainer.seed) == ("m", 16, 5)
    assert (trainer.temperature, trainer.memory_margin_bytes) == (0.7, 7)


def test_engines_router_loop_and_reference_come_from_the_sections() -> None:
    config = AppConfig(
        cluster=ClusterConfig(device="gpu", rollout_num_gpus_per_engine=2),
        engine=EngineConfig(max_num_seqs=64, server_concurrency=16, extra_args=["--x"]),
        parallel=ParallelConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=512),
        loss=ActorLossConfig(use_kl_loss=True),
    )
    spec = engine_spec(config, Path("m"), 4096, ["--seed", "5"])
    assert (spec.device, spec.tensor_parallel_size, spec.max_model_len) == ("gpu", 2, 4096)
    assert spec.extra_args == ["--x", "--seed", "5", "--max-num-seqs", "64"]
    config.engine.max_model_len = 1024  # --vllm-max-model-len overrides the app's length
    assert engine_spec(config, Path("m"), 4096).max_model_len == 1024
    router = router_config(config)
    assert router.max_concurrency_per_engine == 16 and router.failure_threshold == 3
    assert router.read_timeout == 300.0
    config.engine.read_timeout = 7.5  # --router-read-timeout reaches every engine's client
    (engine,) = Router(["http://127.0.0.1:1"], router_config(config)).engines
    assert engine.client.read_timeout == 7.5
    config.engine.disable_circuit_breaker = True
    assert router_config(config).failure_threshold > 10**6
    loop = loop_config(config)
    assert (loop.seed, loop.max_tokens_per_micro_batch) == (5, 512)
    reference = reference_settings(config, Path("sft"), 0.7)
    assert reference == {"model_path": Path("sft"), "micro_batch_size": 4, "temperature": 0.7}
    config.model.ref_load = "ref"
    assert reference_settings(config, Path("sft"), 0.7)["model_path"] == "ref"  # type: ignore[index]
    assert reference_settings(AppConfig(), Path("sft"), 0.7) is None  # no KL loss


def test_a_device_memory_share_on_the_cpu_is_refused() -> None:
    assert "--vllm-gpu-memory-utilization 0.9: on --device cpu" in _refused(
        AppConfig(engine=EngineConfig(gpu_memory_utilization=0.9))
    )
