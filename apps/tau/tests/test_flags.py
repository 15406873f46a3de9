"""Every flag of the tau app acts or is refused at start (``main.check_supported``)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
from turnrl_app_tau import cli
from turnrl_app_tau.cli import resolve
from turnrl_app_tau.config import TauAppConfig
from turnrl_app_tau.main import check_supported, not_honoured
from turnrl_app_tau.stages import sampling

from turnrl.grpo_core.recipe import schema
from turnrl.grpo_core.recipe.flags import flag_of
from turnrl.grpo_core.settings import settings

SETTINGS = {s.dotted: s for s in settings(TauAppConfig)}
FLAG_OF = flag_of(TauAppConfig)
KIND_OF = {dotted: s.flags[0][1] for dotted, s in SETTINGS.items() if s.flags}
NOT_HONOURED = {d: s.meta["refused"] for d, s in SETTINGS.items() if s.meta.get("refused")}
"""The settings a field says are refused (unless the backend it names acts)."""


def _attributes_read_by_the_app() -> set[str]:
    """Attribute names loaded by the app (outside config.py and cli.py), by grpo-core, which
    reads the loop / loss / optimizer sections whole, or by tool-envs' ``tau.data``, which
    reads the task data settings. A name check, so a field that shares its name with
    another attribute passes; a field nothing reads at all fails."""
    import turnrl.grpo_core
    import turnrl.tool_envs.tau.data

    paths = [
        p for p in Path(cli.__file__).parent.glob("*.py") if p.name not in ("config.py", "cli.py")
    ]
    paths += [p for root in turnrl.grpo_core.__path__ for p in Path(root).rglob("*.py")]
    paths.append(Path(turnrl.tool_envs.tau.data.__file__))
    names: set[str] = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        names |= {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
        }
    return names


def trainer_config(config: TauAppConfig, model: Path) -> Any:
    """Each GRPO trainer's config, as ``recipe.stages.run_stages`` builds it."""
    return schema.trainer_config(config, model, **sampling(config))


def _other_value(dotted: str) -> list[str]:
    """Command-line words that set ``dotted`` to something other than its default."""
    if dotted == "model.arch":
        return ["--num-layers", "4"]
    kind = KIND_OF[dotted]
    flag = FLAG_OF[dotted]
    if kind in ("on", "off", "bool"):
        return [flag]
    return [flag, {int: "3", float: "0.25"}.get(kind, "other")]


def test_every_flag_is_read_by_the_app_or_refused() -> None:
    read = _attributes_read_by_the_app()
    fields = set(FLAG_OF) | {"model.arch"}
    silent = sorted(
        d
        for d in fields
        if d not in NOT_HONOURED and d.split(".")[-1] not in read and d != "run_dir"
    )
    assert not silent, f"flags that set a field nothing reads and nothing refuses: {silent}"
    assert set(NOT_HONOURED) <= fields
    assert "tau.input_key" in NOT_HONOURED


@pytest.mark.parametrize("dotted", sorted(NOT_HONOURED))
def test_a_setting_the_torch_path_cannot_honour_stops_the_run_naming_its_flag(dotted: str) -> None:
    words = _other_value(dotted)
    config = resolve(words, {}).config
    with pytest.raises(ValueError, match="cannot honour") as refused:
        check_supported(config)
    assert words[0] in str(refused.value)
    assert NOT_HONOURED[dotted] in str(refused.value)


def test_the_cpu_presets_ask_for_nothing_unhonoured_and_the_real_ones_say_all_at_once() -> None:
    for argv in ([], ["--smoke"]):
        check_supported(resolve(argv, {}).config)
    config = resolve(["--preset", "qwen3-4b-gpu", "--train-backend", "torch"], {}).config
    refused = "\n".join(not_honoured(config))
    for flag in ("--tensor-model-parallel-size 2", "--attention-backend", "--use-flash-attn"):
        assert flag in refused
    with pytest.raises(ValueError, match="cannot honour"):
        check_supported(config)
    # As the presets are (megatron backend), every setting acts: nothing is refused.
    for name in ("qwen3-4b-gpu", "qwen3-4b-npu"):
        assert not_honoured(resolve(["--preset", name], {}).config) == []


def test_the_memory_margin_reaches_the_trainer_and_is_refused_on_the_cpu() -> None:
    words = ["--train-memory-margin-bytes", "1024"]
    on_gpu = resolve([*words, "--device", "gpu"], {}).config
    assert not not_honoured(on_gpu)
    assert trainer_config(on_gpu, Path("m")).memory_margin_bytes == 1024
    with pytest.raises(ValueError, match="--train-memory-margin-bytes 1024: on --device cpu"):
        check_supported(resolve(words, {}).config)


def test_use_flash_attn_is_the_flash_backend_and_auto_is_local_without_te() -> None:
    from turnrl.grpo_core.recipe.schema import attention_backend

    def backend(*words: str) -> str:
        return attention_backend(resolve(list(words), {}).config.parallel)

    assert backend("--use-flash-attn") == "flash"
    assert backend("--attention-backend", "flash", "--use-flash-attn") == "flash"
    assert backend("--attention-backend", "local") == "local"
    assert backend() == "local"  # auto, and no Transformer Engine on CUDA here
    with pytest.raises(ValueError, match="--use-flash-attn contradicts --attention-backend"):
        backend("--attention-backend", "local", "--use-flash-attn")


def test_a_device_setting_is_refused_only_where_the_device_cannot_honour_it() -> None:
    on_cpu = resolve(["--vllm-gpu-memory-utilization", "0.9"], {}).config
    with pytest.raises(ValueError, match=r"--vllm-gpu-memory-utilization 0\.9: on --device cpu"):
        check_supported(on_cpu)
    assert not not_honoured(
        resolve(["--vllm-gpu-memory-utilization", "0.9", "--device", "gpu"], {}).config
    )


@pytest.mark.parametrize("flag", ["--actor-num-gpus-per-node", "--actor-num-nodes"])
def test_placement_flags_act(flag: str) -> None:
    assert not not_honoured(resolve([flag, "2"], {}).config)


def test_max_off_policy_steps_needs_the_async_loop() -> None:
    with pytest.raises(ValueError, match=r"--max-off-policy-steps 2: only the asynchronous loop"):
        check_supported(resolve(["--max-off-policy-steps", "2"], {}).config)
    config = resolve(["--async", "--max-off-policy-steps", "2"], {}).config
    check_supported(config)
    assert config.loop.asynchronous and config.loop.max_off_policy_steps == 2


def test_async_with_colocated_engines_is_refused() -> None:
    """Colocated engines sleep while the ranks train; the async loop generates meanwhile."""
    argv = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    check_supported(resolve([*argv, "--colocate"], {}).config)
    with pytest.raises(ValueError, match="--async with --colocate"):
        check_supported(resolve([*argv, "--colocate", "--async"], {}).config)


def test_logger_names_the_trackers_and_an_unknown_one_is_refused() -> None:
    config = resolve(["--logger", "wandb,mlflow"], {}).config
    check_supported(config)
    assert config.logger == ["wandb", "mlflow"]
    with pytest.raises(ValueError, match="--logger neptune: known trackers are"):
        check_supported(resolve(["--logger", "neptune"], {}).config)


MEGATRON_RAY = ["--train-backend", "megatron", "--actor-num-gpus-per-node"]


def test_the_megatron_backend_acts_on_the_megatron_flags() -> None:
    """Under --train-backend megatron the parallelism / recompute flags reach the engine's
    config (refused by the torch backend, as above)."""
    from turnrl.grpo_core.megatron.engine import MegatronEngineConfig

    words = [
        "--tensor-model-parallel-size",
        "2",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        "--hidden-dropout",
        "0.1",
    ]
    config = resolve([*MEGATRON_RAY, "4", *words], {}).config
    assert not not_honoured(config)
    trainer = trainer_config(config, Path("model"))
    assert isinstance(trainer, MegatronEngineConfig)
    p = trainer.parallel
    assert (p.tensor_model_parallel_size, p.recompute_granularity, p.recompute_method) == (
        2,
        "full",
        "uniform",
    )
    assert (p.recompute_num_layers, p.hidden_dropout) == (1, 0.1)
    on_torch = "\n".join(not_honoured(resolve(words, {}).config))
    assert "--tensor-model-parallel-size 2" in on_torch and "--hidden-dropout" in on_torch


@pytest.mark.parametrize(
    ("words", "named"),
    [
        (
            ["--tensor-model-parallel-size", "2"],
            "1 trainer rank(s) are not a multiple",
        ),
        (
            [*MEGATRON_RAY[2:], "3", "--tensor-model-parallel-size", "2"],
            "3 trainer rank(s) are not a multiple",
        ),
        (
            [*MEGATRON_RAY[2:], "2", "--context-parallel-size", "2"],
            "--context-parallel-size 2: megatron-core's context-parallel attention",
        ),
    ],
)
def test_what_the_megatron_backend_cannot_run_is_refused_at_start(
    words: list[str], named: str
) -> None:
    config = resolve(["--train-backend", "megatron", *words], {}).config
    with pytest.raises(ValueError, match=re.escape(named)):
        check_supported(config)


def test_sequence_parallel_reaches_the_megatron_engine_on_the_cpu() -> None:
    """The CPU trains TP with sequence parallelism too (grpo-core's CPU shims)."""
    words = [*MEGATRON_RAY, "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    config = resolve(words, {}).config
    assert not not_honoured(config)
    parallel = trainer_config(config, Path("model")).parallel  # type: ignore[attr-defined]
    assert parallel.effective_sequence_parallel


def test_a_layout_the_model_cannot_split_is_refused_before_training(tmp_path: Path) -> None:
    """The model's config.json is read at start: TP 4 on a model with 2 KV heads stops the
    run naming the flag; TP 2 passes; the torch backend does not look."""
    from turnrl.grpo_core.recipe.schema import check_model_split

    shape = {
        "model_type": "qwen3",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(shape))
    for tp, refused in (("4", True), ("2", False)):
        words = [*MEGATRON_RAY, "4", "--tensor-model-parallel-size", tp]
        config = resolve(words, {}).config
        if refused:
            with pytest.raises(
                ValueError,
                match=r"num_key_value_heads \(2\) is not divisible by --tensor-model-parallel-size \(4\)",
            ):
                check_model_split(config, tmp_path)
        else:
            check_model_split(config, tmp_path)
    check_model_split(resolve(["--tensor-model-parallel-size", "4"], {}).config, tmp_path)


def test_an_unknown_train_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="--train-backend must be torch or megatron"):
        check_supported(resolve(["--train-backend", "jax"], {}).config)


def test_dynamic_batching_flags_reach_the_loop_and_need_each_other() -> None:
    from turnrl.grpo_core.recipe.schema import loop_config

    words = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "6144"]
    config = resolve(words, {}).config
    check_supported(config)
    assert loop_config(config).max_tokens_per_micro_batch == 6144
    assert loop_config(resolve([], {}).config).max_tokens_per_micro_batch is None
    for half in (words[:1], words[1:]):
        with pytest.raises(ValueError, match="dynamic batching needs both"):
            check_supported(resolve(half, {}).config)


def test_load_naming_the_start_folder_acts_and_another_is_refused() -> None:
    """The vime script gives --load the --hf-checkpoint folder (Megatron-Bridge mode): the
    actor starts from it. Another folder would be a checkpoint turnrl does not load."""
    same = ["--hf-checkpoint", "models/q", "--load", "models/q"]
    assert not not_honoured(resolve(same, {}).config)
    refused = not_honoured(resolve(["--hf-checkpoint", "models/q", "--load", "ckpt"], {}).config)
    assert len(refused) == 1 and refused[0].startswith("--load ckpt: a checkpoint other than")


def test_megatron_architecture_flags_must_match_the_model(tmp_path: Path) -> None:
    """The script's model flags act under the megatron backend as a check of the model the
    bridge reads: the tiny Qwen3's own values pass, another layer count stops the run."""
    from turnrl.grpo_core.recipe.schema import check_model_split
    from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model

    model = build_tiny_model(tmp_path / "m", TinyModelConfig(num_hidden_layers=2))
    same = ["--num-layers", "2", "--hidden-size", "128", "--qk-layernorm", "--swiglu"]
    config = resolve([*MEGATRON_RAY, "1", *same], {}).config
    assert not not_honoured(config)
    check_model_split(config, model)
    config = resolve([*MEGATRON_RAY, "1", "--num-layers", "36", "--qk-layernorm"], {}).config
    with pytest.raises(ValueError, match=r"--num-layers 36 \(the model has 2\)"):
        check_model_split(config, model)
    assert not_honoured(resolve(["--num-layers", "36"], {}).config)  # torch: refused


def test_megatron_in_bfloat16_on_the_cpu_is_refused_naming_the_dtype() -> None:
    config = resolve([*MEGATRON_RAY, "1", "--dtype", "bfloat16"], {}).config
    with pytest.raises(ValueError, match="--dtype bfloat16 with --train-backend megatron on"):
        check_supported(config)


def test_slimes_loss_flags_reach_the_trainers_loss() -> None:
    """--calculate-per-token-loss, --eps-clip-c and --use-tis with its clips set the
    ActorLossConfig each trainer gets; without them the loss is slime's."""
    plain = trainer_config(resolve(["--preset", "qwen3-4b-npu"], {}).config, Path("m")).loss
    assert (plain.loss_agg_mode, plain.dual_clip_c, plain.tis_cap) == (
        "seq-mean-token-mean",
        None,
        None,
    )
    words = ["--preset", "qwen3-4b-npu", "--calculate-per-token-loss", "--eps-clip-c", "3"]
    words += ["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5"]
    config = resolve(words, {}).config
    assert not_honoured(config) == []
    loss = trainer_config(config, Path("m")).loss
    assert (loss.loss_agg_mode, loss.dual_clip_c) == ("token-mean", 3.0)
    assert (loss.use_tis, loss.tis_cap, loss.tis_clip_low) == (True, 1.5, 0.5)
    off = resolve(["--no-calculate-per-token-loss", "--no-use-tis"], {}).config.loss
    assert (off.loss_agg_mode, off.use_tis) == ("seq-mean-token-mean", False)


def test_a_tis_clip_without_use_tis_or_a_clip_the_loss_cannot_take_is_refused() -> None:
    for words, flag in (
        (["--tis-clip", "3"], "--tis-clip 3.0"),
        (["--tis-clip-low", "0.5"], "--tis-clip-low 0.5"),
    ):
        with pytest.raises(ValueError, match=f"{flag}: only --use-tis reads it"):
            check_supported(resolve(words, {}).config)
    with pytest.raises(ValueError, match="--eps-clip-c"):
        resolve(["--eps-clip-c", "0.5"], {})
    with pytest.raises(ValueError, match="--tis-clip-low and --tis-clip"):
        resolve(["--use-tis", "--tis-clip-low", "3", "--tis-clip", "2"], {})
