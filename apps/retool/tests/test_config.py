"""Preset resolution, command-line overrides and validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from turnrl_app_retool.cli import resolve
from turnrl_app_retool.config import PRESETS, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_and_named(name: str) -> None:
    config = preset(name).validate()
    assert config.preset == name
    loop = config.loop
    assert (loop.rollout_batch_size * loop.n_samples_per_prompt) % loop.global_batch_size == 0


def test_real_scale_presets_follow_the_recipe() -> None:
    npu4b, npu7b, gpu = preset("qwen3-4b-npu"), preset("qwen2.5-7b-npu"), preset("qwen3-4b-gpu")
    for c in (npu4b, npu7b, gpu):
        assert (c.loss.eps_clip, c.loss.eps_clip_high, c.loss.dual_clip_c) == (0.2, 0.28, 10.0)
        assert not c.loss.use_kl_loss and c.loss.kl_loss_coef == 0.0
        assert c.loop.n_samples_per_prompt == 16 and c.optimizer.lr == 1e-6
        assert c.loss.loss_agg_mode == "token-mean" and c.rl.max_turns == 16
        assert (c.eval.n, c.eval.temperature, c.eval.top_p) == (30, 1.0, 0.6)
        assert c.rl.max_prompt_length == 2048
        e = c.cluster  # verl's layout: 8 trainer ranks, the engines on the same cards
        assert (e.trainer_ranks, e.colocate) == (8, True)
        assert e.num_engines * e.rollout_num_gpus_per_engine == 8
        assert c.parallel.micro_batch_size == 4 and c.engine.gpu_memory_utilization == 0.9
    assert (
        npu4b.model.hf_checkpoint == "Qwen/Qwen3-4B-Instruct-2507" and npu4b.cluster.device == "npu"
    )
    assert npu4b.sft.enabled and npu4b.sft.lr == 1e-5 and npu4b.parallel.seq_length == 16384
    assert npu4b.env["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert "aime_2025" in npu4b.data.val_paths[0]
    assert npu7b.model.hf_checkpoint == "Qwen/Qwen2.5-7B-Instruct" and not npu7b.sft.enabled
    assert npu7b.loop.rollout_batch_size == 32 and npu7b.rl.max_response_length == 20480
    assert "AIME_2024" in npu7b.data.val_paths[0]
    assert gpu.cluster.device == "gpu" and gpu.cluster.rollout_num_gpus_per_engine == 4
    assert gpu.cluster.num_engines == 2 and not gpu.env


def test_default_and_smoke() -> None:
    config, _ = resolve([])
    assert config.preset == "cpu-default" and config.sandbox.url is None
    assert config.model.hf_checkpoint is None and config.cluster.device == "cpu"
    # The app's own section defaults hold under a preset that sets part of the section.
    assert (config.model.tiny_hidden_size, config.model.torch_threads) == (128, 1)
    assert (config.parallel.micro_batch_size, config.parallel.seq_length) == (16, 1024)
    smoke, _ = resolve(["--smoke"])
    assert smoke.preset == "smoke"
    assert smoke.loop.num_rollout < config.loop.num_rollout
    assert smoke.sft.num_steps < config.sft.num_steps


def test_flags_override_the_preset() -> None:
    config, _ = resolve(
        [
            "--preset",
            "qwen3-4b-gpu",
            "--num-rollout",
            "3",
            "--lr",
            "2e-6",
            "--sandbox-url",
            "http://sandbox:8080",
            "--val-data",
            "a.parquet",
            "--val-data",
            "b.jsonl",
            "--no-sft",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.001",
            "--run-dir",
            "out",
            "--seed",
            "7",
        ]
    )
    assert config.loop.num_rollout == 3 and config.optimizer.lr == 2e-6
    assert config.sandbox.url == "http://sandbox:8080"
    assert config.data.val_paths == ["a.parquet", "b.jsonl"]
    assert not config.sft.enabled and config.loss.use_kl_loss and config.loss.kl_loss_coef == 0.001
    assert config.run_dir == "out" and config.seed == 7
    assert config.loop.n_samples_per_prompt == 16  # untouched fields keep the preset's value


def test_presets_are_fresh_objects() -> None:
    a = preset("cpu-default")
    a.loop.num_rollout = 999
    a.data.val_paths.append("x")
    assert preset("cpu-default").loop.num_rollout != 999
    assert preset("cpu-default").data.val_paths == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--global-batch-size", "7"], "multiple of global_batch_size"),
        (["--sandbox-url", "sandbox:8080"], "http"),
        (["--sandbox-url", "http://sandbox:8080", "--sandbox-insecure"], "embedded sandbox"),
        (["--device", "tpu"], "cpu, gpu or npu"),
        (["--device", "npu"], "--hf-checkpoint"),
        (["--n-val-samples", "0"], "eval.n"),
        (["--smoke", "--preset", "qwen3-4b-gpu"], "conflicts with --preset"),
        (["--preset", "nope"], "invalid choice"),
        (["--num-rollout", "many"], "invalid int"),
        (["--runner", "local"], "unrecognized arguments: --runner"),
        (["--use-dynamic-batch-size"], "dynamic batching needs both"),
        (["--optimizer", "sgd"], "AdamW (adam) is the only optimizer"),
        (["--actor-num-gpus-per-node", "0"], ">= 1"),
        (["--eval-interval", "-1"], "eval_interval and save_interval must be >= 0"),
        (["--colocate", "--rollout-num-gpus", "2"], "do not fit on 1 rank"),
    ],
)
def test_bad_flags_are_clear_errors(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        resolve(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="cpu-default"):
        preset("qwen9")


def test_resolved_config_is_saved(tmp_path: Path) -> None:
    config, _ = resolve(["--smoke", "--seed", "3"])
    path = config.save(tmp_path / "run")
    saved = json.loads(path.read_text())
    assert saved["preset"] == "smoke" and saved["seed"] == 3
    assert saved["loop"]["num_rollout"] == config.loop.num_rollout
    assert saved["sandbox"]["url"] is None


def test_eval_interval_reaches_the_rl_stage() -> None:
    assert resolve(["--eval-interval", "3"])[0].loop.eval_interval == 3
    assert resolve(["--eval-interval", "0"])[0].loop.eval_interval == 0
    default = resolve([])[0].loop  # a curve of >= 5 points: before RL, then every interval
    assert 1 + default.num_rollout // default.eval_interval >= 5


def test_placement_flags_reach_the_config() -> None:
    config, _ = resolve(["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--colocate"])
    e = config.cluster
    assert (e.trainer_ranks, e.num_engines, e.colocate) == (2, 2, True)


def test_logger_flag_names_the_trackers() -> None:
    config, _ = resolve(["--logger", "wandb, mlflow"])
    assert config.logger == ["wandb", "mlflow"] and resolve([])[0].logger == []


def test_an_unknown_tracker_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        resolve(["--logger", "wandb,neptune"])
    assert "--logger neptune: known trackers are" in capsys.readouterr().err


def test_the_megatron_backend_flags_reach_the_rl_trainer() -> None:
    """--train-backend megatron --tensor-model-parallel-size 2 on 4 Ray ranks: the RL
    trainer config is a MegatronEngineConfig with TP 2 and the recipe's settings. Where
    megatron-core is not installed the run is refused at start with the install line."""
    from turnrl_app_retool.stages import sampling

    from turnrl.grpo_core.megatron.config import megatron_available
    from turnrl.grpo_core.megatron.engine import MegatronEngineConfig
    from turnrl.grpo_core.recipe.schema import trainer_config

    argv = [
        "--train-backend",
        "megatron",
        "--tensor-model-parallel-size",
        "2",
        "--actor-num-gpus-per-node",
        "4",
    ]
    if not megatron_available():
        refused(argv, "needs megatron-core: pip install")
        return
    config, _ = resolve(argv)
    rl = trainer_config(config, Path("m"), **sampling(config))  # as run_stages builds it
    assert isinstance(rl, MegatronEngineConfig) and rl.parallel.tensor_model_parallel_size == 2
    assert rl.optimizer.lr == config.optimizer.lr and rl.top_p == config.rl.top_p


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--train-backend", "jax"], "--train-backend must be torch or megatron"),
        (["--tensor-model-parallel-size", "2"], "the torch backend does not act on it"),
        (
            [
                "--train-backend",
                "megatron",
                "--tensor-model-parallel-size",
                "2",
                "--actor-num-gpus-per-node",
                "3",
            ],
            "3 trainer rank(s) are not a multiple",
        ),
        (
            [
                "--train-backend",
                "megatron",
                "--tensor-model-parallel-size",
                "2",
            ],
            "1 trainer rank(s) are not a multiple",
        ),
        (
            ["--preset", "qwen3-4b-gpu", "--device", "cpu", "--train-backend", "megatron"],
            "--dtype bfloat16 with --train-backend megatron on --device cpu",
        ),
    ],
)
def test_train_backend_settings_it_cannot_run_are_refused_at_start(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(argv, named)
    assert named in capsys.readouterr().err


def refused(argv: list[str], named: str) -> None:
    """``resolve`` stops with exit code 2 (argparse's error, the reason on stderr)."""
    with pytest.raises(SystemExit) as stop:
        resolve(argv)
    assert stop.value.code == 2, named


def test_slimes_loss_flags_act_on_the_recipes_loss() -> None:
    """The recipe's loss (token-mean, dual clip 10) is the app's default; slime's loss flags
    change it as in slime, and a TIS clip without --use-tis is refused."""
    for name in ("cpu-default", "smoke"):
        loss = resolve(["--preset", name])[0].loss
        assert (loss.loss_agg_mode, loss.dual_clip_c, loss.use_tis) == ("token-mean", 10.0, False)
    words = ["--no-calculate-per-token-loss", "--eps-clip-c", "4", "--use-tis", "--tis-clip", "3"]
    loss = resolve(words)[0].loss
    assert (loss.loss_agg_mode, loss.dual_clip_c, loss.tis_cap) == ("seq-mean-token-mean", 4.0, 3.0)
    with pytest.raises(SystemExit):
        resolve(["--tis-clip", "3"])
