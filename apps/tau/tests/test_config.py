"""Presets, the vime NPU script's full flag list, overrides and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from turnrl_app_tau.cli import build_parser, resolve
from turnrl_app_tau.config import PRESETS, TauAppConfig, from_dict, preset
from turnrl_app_tau.main import check_supported

from turnrl.grpo_core.loop import load_function

# The training command of the vime tau-bench NPU example (../shared/reference/tau-npu-script.md),
# flag for flag, with slime's Qwen3-4B model-architecture arguments.
SCRIPT_ARGV = [
    "--train-backend",
    "megatron",
    "--actor-num-nodes",
    "1",
    "--actor-num-gpus-per-node",
    "4",
    "--rollout-num-gpus",
    "4",
    "--rollout-num-gpus-per-engine",
    "1",
    "--swiglu",
    "--num-layers",
    "36",
    "--hidden-size",
    "2560",
    "--ffn-hidden-size",
    "9728",
    "--num-attention-heads",
    "32",
    "--group-query-attention",
    "--num-query-groups",
    "8",
    "--use-rotary-position-embeddings",
    "--disable-bias-linear",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-6",
    "--rotary-base",
    "1000000",
    "--vocab-size",
    "151936",
    "--kv-channels",
    "128",
    "--qk-layernorm",
    "--hf-checkpoint",
    "/models/Qwen3-4B-Instruct-2507",
    "--ref-load",
    "/models/Qwen3-4B-Instruct-2507",
    "--load",
    "/models/Qwen3-4B-Instruct-2507",
    "--megatron-to-hf-mode",
    "bridge",
    "--custom-generate-function-path",
    "generate_with_tau.generate",
    "--custom-rm-path",
    "generate_with_tau.batched_tau_bench_rm",
    "--prompt-data",
    "retail_train_tasks.jsonl",
    "--input-key",
    "index",
    "--rollout-shuffle",
    "--num-rollout",
    "200",
    "--rollout-batch-size",
    "8",
    "--n-samples-per-prompt",
    "2",
    "--rollout-max-response-len",
    "2048",
    "--rollout-max-context-len",
    "16384",
    "--rollout-temperature",
    "0.7",
    "--seq-length",
    "16384",
    "--global-batch-size",
    "16",
    "--disable-rewards-normalization",
    "--advantage-estimator",
    "grpo",
    "--use-kl-loss",
    "--kl-loss-coef",
    "0.001",
    "--kl-loss-type",
    "low_var_kl",
    "--entropy-coef",
    "0.01",
    "--eps-clip",
    "0.2",
    "--eps-clip-high",
    "0.28",
    "--optimizer",
    "adam",
    "--lr",
    "1e-6",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0.1",
    "--adam-beta1",
    "0.9",
    "--adam-beta2",
    "0.98",
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--pipeline-model-parallel-size",
    "1",
    "--context-parallel-size",
    "1",
    "--expert-model-parallel-size",
    "1",
    "--expert-tensor-parallel-size",
    "1",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
    "--use-dynamic-batch-size",
    "--max-tokens-per-gpu",
    "6144",
    "--vllm-gpu-memory-utilization",
    "0.60",
    "--vllm-server-concurrency",
    "8",
    "--router-disable-circuit-breaker",
    "--vllm-max-model-len",
    "16384",
    "--train-memory-margin-bytes",
    "4294967296",
    "--attention-dropout",
    "0.0",
    "--hidden-dropout",
    "0.0",
    "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32",
    "--attention-backend",
    "flash",
    "--use-flash-attn",
]
SCRIPT_ENV = {
    "TAU_MAX_TURNS": "3",
    "TAU_SHORT_TOOLS": "0",
    "TAU_MAX_INFLIGHT": "8",
    "TAU_USER_LITELLM_RETRIES": "30",
    "TAU_USER_LITELLM_RETRY_DELAY": "2",
}


def test_every_script_flag_above_is_a_flag_of_the_app() -> None:
    # Each flag of the reference script is one the parser knows (the tests below check
    # what it sets).
    known = {o for a in build_parser()._actions for o in a.option_strings}
    assert {word for word in SCRIPT_ARGV if word.startswith("--")} <= known


def test_script_flags_on_the_cpu_preset_give_the_npu_preset() -> None:
    """Starting from cpu-default, the script's flags set every field the script sets."""
    cfg = resolve([*SCRIPT_ARGV, "--device", "npu"], SCRIPT_ENV).config
    c, p, lp, loss, opt, r = (
        cfg.cluster,
        cfg.parallel,
        cfg.loop,
        cfg.loss,
        cfg.optimizer,
        cfg.rollout,
    )
    assert (p.train_backend, c.actor_num_nodes, c.actor_num_gpus_per_node) == ("megatron", 1, 4)
    assert (c.rollout_num_gpus, c.rollout_num_gpus_per_engine, c.num_engines) == (4, 1, 4)
    assert cfg.model.hf_checkpoint == cfg.model.ref_load == cfg.model.load
    assert cfg.model.megatron_to_hf_mode == "bridge"
    assert cfg.model.arch["num_layers"] == 36 and cfg.model.arch["qk_layernorm"] is True
    assert cfg.model.arch["normalization"] == "RMSNorm" and cfg.model.arch["rotary_base"] == 1e6
    assert r.custom_generate_function_path == "generate_with_tau.generate"
    assert r.custom_rm_path == "generate_with_tau.batched_tau_bench_rm"
    # vime's own module is not here: refused at start, naming this app's equivalents.
    with pytest.raises(ValueError, match=r"--custom-generate-function-path generate_with_tau"):
        check_supported(cfg)
    assert (cfg.tau.prompt_data, cfg.tau.input_key) == ("retail_train_tasks.jsonl", "index")
    assert lp.rollout_shuffle and not lp.rewards_normalization
    assert (lp.num_rollout, lp.rollout_batch_size, lp.n_samples_per_prompt) == (200, 8, 2)
    assert (lp.global_batch_size, lp.advantage_estimator) == (16, "grpo")
    assert (r.rollout_max_response_len, r.rollout_max_context_len) == (2048, 16384)
    assert r.rollout_temperature == 0.7 and p.seq_length == 16384
    assert loss.use_kl_loss and (loss.kl_loss_coef, loss.kl_loss_type) == (0.001, "low_var_kl")
    assert (loss.entropy_coef, loss.eps_clip, loss.eps_clip_high) == (0.01, 0.2, 0.28)
    assert (p.optimizer_name, opt.lr, p.lr_decay_style, opt.weight_decay) == (
        "adam",
        1e-6,
        "constant",
        0.1,
    )
    assert (opt.adam_beta1, opt.adam_beta2) == (0.9, 0.98)
    assert (p.tensor_model_parallel_size, p.sequence_parallel) == (2, True)
    assert (p.pipeline_model_parallel_size, p.context_parallel_size) == (1, 1)
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size) == (1, 1)
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    assert p.use_dynamic_batch_size and p.max_tokens_per_gpu == 6144
    e = cfg.engine
    assert (e.gpu_memory_utilization, e.server_concurrency) == (0.6, 8)
    assert e.disable_circuit_breaker and e.max_model_len == 16384
    assert c.train_memory_margin_bytes == 4294967296
    assert (p.attention_dropout, p.hidden_dropout) == (0.0, 0.0)
    assert p.accumulate_allreduce_grads_in_fp32 and p.attention_softmax_in_fp32
    assert p.attention_backend == "flash" and p.use_flash_attn and not c.colocate
    assert (r.max_turns, r.short_tools, r.max_inflight) == (3, False, 8)
    assert (cfg.tau.user_retries, cfg.tau.user_retry_delay) == (30, 2.0)


def test_npu_preset_matches_the_script() -> None:
    """The preset alone equals the script's flags on top of it (the preset reproduces it),
    but for the script's hooks into vime's own module, which name this app's equivalents."""
    npu = preset("qwen3-4b-npu")
    hooks = ("generate_with_tau.generate", "generate_with_tau.batched_tau_bench_rm")
    argv = [a for a in SCRIPT_ARGV if not a.startswith("/models") and a not in hooks]
    skip = (
        "--hf-checkpoint",
        "--ref-load",
        "--load",
        *(f"--custom-{x}" for x in ("generate-function-path", "rm-path")),
    )
    argv = [a for a in argv if a not in skip]
    # --attention-backend flash / --use-flash-attn: MindSpeed's NPU kernels, not here.
    at = argv.index("--attention-backend")
    assert argv[at + 1] == "flash" and "--use-flash-attn" in argv
    argv = [a for i, a in enumerate(argv) if i not in (at, at + 1) and a != "--use-flash-attn"]
    assert (npu.parallel.attention_backend, npu.parallel.use_flash_attn) == ("local", False)
    assert npu.rollout.custom_generate_function_path is None  # the app's episode loop
    assert npu.rollout.custom_rm_path == "turnrl.tool_envs.tau.episodes.batched_tau_rm"
    assert load_function(npu.rollout.custom_rm_path).__name__ == "batched_tau_rm"  # loadable
    flagged = resolve(["--preset", "qwen3-4b-npu", *argv], SCRIPT_ENV).config
    flagged.model.arch = {}
    assert flagged.to_dict() == npu.to_dict()


def test_the_real_presets_take_slimes_loss_and_the_cpu_ones_keep_theirs() -> None:
    """The script passes none of slime's loss flags: a per-sample mean of token means, no
    dual clip, no TIS. The CPU presets keep what they were measured with."""
    for name in ("qwen3-4b-npu", "qwen3-4b-gpu"):
        loss = preset(name).loss
        assert (loss.loss_agg_mode, loss.dual_clip_c, loss.use_tis) == (
            "seq-mean-token-mean",
            None,
            False,
        )
    for name in ("cpu-default", "smoke"):
        loss = preset(name).loss
        assert (loss.loss_agg_mode, loss.dual_clip_c, loss.use_tis) == ("token-mean", 3.0, False)


def test_gpu_preset_is_the_npu_run_colocated() -> None:
    gpu, npu = preset("qwen3-4b-gpu").to_dict(), preset("qwen3-4b-npu").to_dict()
    assert gpu["cluster"]["colocate"] and gpu["cluster"]["device"] == "gpu"
    for section in ("loop", "loss", "optimizer", "rollout"):
        assert gpu[section] == npu[section]
    flash = {"attention_backend": "flash", "use_flash_attn": True}  # Transformer Engine's
    assert gpu["parallel"] == {**npu["parallel"], **flash}
    assert resolve(["--preset", "qwen3-4b-gpu"], {}).config.cluster.colocate


def test_presets_resolve_and_round_trip(tmp_path: Path) -> None:
    for name in PRESETS:
        config = preset(name)
        assert config.preset == name
        saved = json.loads(config.save(tmp_path / name).read_text())
        assert from_dict(saved) == config
    default = resolve([], {}).config
    assert default.preset == "cpu-default" and default.model.hf_checkpoint is None
    assert default.tau.domain == "synthetic" and default.cluster.device == "cpu"
    loop = default.loop  # a held-out curve of >= 5 points: before RL, then every interval
    assert loop.eval_interval and 1 + loop.num_rollout // loop.eval_interval >= 5
    smoke = resolve(["--smoke"], {}).config
    assert smoke.preset == "smoke"
    assert smoke.loop.num_rollout < default.loop.num_rollout


def test_flags_override_presets_and_env_sits_between() -> None:
    inv = resolve(
        ["eval", "--smoke", "--num-trials", "3", "--max-concurrency", "2", "--lr", "0.5"],
        {"TAU_MAX_TURNS": "5"},
    )
    assert inv.command == "eval"
    assert (inv.config.tau.eval_trials, inv.config.tau.eval_concurrency) == (3, 2)
    assert inv.config.optimizer.lr == 0.5 and inv.config.rollout.max_turns == 5
    assert resolve(["--max-turns", "7"], {"TAU_MAX_TURNS": "5"}).config.rollout.max_turns == 7
    npu = resolve(["--preset", "qwen3-4b-npu", "--rewards-normalization", "--tau-reward", "task"])
    assert npu.config.loop.rewards_normalization and npu.config.rollout.tau_reward == "task"
    assert resolve([], {"TAU_SHORT_TOOLS": "1"}).config.rollout.short_tools
    assert not resolve(
        ["--preset", "qwen3-4b-npu"], {"TAU_SHORT_TOOLS": "0"}
    ).config.rollout.short_tools


def test_bad_input_is_refused() -> None:
    with pytest.raises(SystemExit):
        resolve(["--preset", "nope"], {})
    with pytest.raises(SystemExit):
        resolve(["--lr", "fast"], {})
    with pytest.raises(ValueError, match="--smoke conflicts"):
        resolve(["--smoke", "--preset", "qwen3-4b-npu"], {})
    with pytest.raises(ValueError, match="TAU_MAX_TURNS"):
        resolve([], {"TAU_MAX_TURNS": "many"})
    with pytest.raises(ValueError, match="advantage_estimator"):
        resolve(["--advantage-estimator", "magic"], {})
    with pytest.raises(ValueError, match="multiple of global_batch_size"):
        resolve(
            [
                "--rollout-batch-size",
                "3",
                "--n-samples-per-prompt",
                "1",
                "--global-batch-size",
                "2",
            ],
            {},
        )
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        resolve(["--loss-agg-mode", "sum"], {})
    with pytest.raises(ValueError, match="tau_reward must be"):
        resolve(["--tau-reward", "bonus"], {})
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")
    with pytest.raises(ValueError, match="unknown config keys"):
        from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="unknown config keys in LoopConfig"):
        from_dict({"loop": {"bogus": 1}})
    assert isinstance(TauAppConfig(), TauAppConfig)


def test_main_refuses_unsupported_backends(tmp_path: Path) -> None:
    from turnrl_app_tau.main import main

    run_dir = tmp_path / "run"
    megatron = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2"]
    assert main([*megatron, "--run-dir", str(run_dir)]) == 2  # 2 does not divide 1 rank
    assert main(["--device", "tpu", "--run-dir", str(run_dir)]) == 2
    assert main(["--torch-threads", "-1", "--run-dir", str(run_dir)]) == 2
    assert main(["--domain", "retail", "--run-dir", str(run_dir)]) != 0
    assert not (run_dir / "summary.json").exists()


def test_a_users_preset_file_starts_from_a_shipped_one(tmp_path: Path) -> None:
    mine = tmp_path / "mine.toml"
    mine.write_text(
        'base = "qwen3-4b-gpu"\n[optimizer]\nlr = 2e-6\n[cluster]\nrollout_num_gpus = 2\n'
    )
    config = resolve(["--preset", str(mine), "--num-rollout", "5"], {}).config
    gpu = preset("qwen3-4b-gpu")
    assert config.preset == str(mine)
    assert (config.optimizer.lr, config.cluster.rollout_num_gpus, config.loop.num_rollout) == (
        2e-6,
        2,
        5,
    )
    assert config.parallel == gpu.parallel and config.cluster.colocate
    mine.write_text("[optimizer]\nlearning_rate = 1\n")
    with pytest.raises(ValueError, match="unknown config keys in OptimizerConfig"):
        resolve(["--preset", str(mine)], {})
