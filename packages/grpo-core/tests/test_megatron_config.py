"""Qwen architecture from Hugging Face configs, Megatron flags, and the TransformerConfig mapping.

No megatron-core needed: these run in every test session.
"""

from __future__ import annotations

import argparse
import re

import pytest
from transformers import Qwen2Config, Qwen3Config

from turnrl.grpo_core.megatron import (
    MegatronParallelConfig,
    QwenArchitecture,
    add_megatron_args,
    parallel_config_from_args,
    parse_megatron_args,
    transformer_config_kwargs,
)

# The model block of the tau-bench NPU script: Qwen3-4B-Instruct-2507.
QWEN3_4B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_act": "silu",
}
# The same script's Megatron flags (TP 2, sequence parallel, full recompute).
SCRIPT_FLAGS = [
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--pipeline-model-parallel-size",
    "1",
    "--context-parallel-size",
    "1",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
    "--bf16",
]


def test_qwen3_4b_config_json_maps_every_field() -> None:
    arch = QwenArchitecture.from_hf_config(QWEN3_4B)
    assert arch.num_layers == 36 and arch.hidden_size == 2560 and arch.ffn_hidden_size == 9728
    assert (arch.num_attention_heads, arch.num_query_groups, arch.heads_per_group) == (32, 8, 4)
    assert arch.head_dim == 128 != arch.hidden_size // arch.num_attention_heads  # Qwen3 sets it
    assert arch.rope_theta == 5e6 and arch.rms_norm_eps == 1e-6
    assert arch.qk_layernorm and not arch.qkv_bias and arch.tie_word_embeddings


def test_transformers_config_objects_qwen2_has_bias_and_derived_head_dim() -> None:
    qwen2 = QwenArchitecture.from_hf_config(
        Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6)
    )
    assert qwen2.model_type == "qwen2" and qwen2.qkv_bias and not qwen2.qk_layernorm
    assert qwen2.head_dim == 64 and qwen2.rope_theta == 1e6
    qwen3 = QwenArchitecture.from_hf_config(Qwen3Config(attention_bias=True, rope_theta=123.0))
    assert qwen3.qkv_bias and qwen3.qk_layernorm and qwen3.rope_theta == 123.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "not supported"),
        ({"model_type": "qwen3_moe"}, "not supported"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"num_key_value_heads": 5}, "multiple"),
        ({"rope_theta": None}, "rope_theta"),
    ],
)
def test_unsupported_configs_are_rejected(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QwenArchitecture.from_hf_config({**QWEN3_4B, **change})


def test_script_flags_parse_to_the_parallel_config_and_leave_others() -> None:
    parallel, rest = parse_megatron_args([*SCRIPT_FLAGS, "--lr", "1e-6"])
    assert rest == ["--lr", "1e-6"]
    assert parallel == MegatronParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        bf16=True,
    )
    assert parallel.effective_sequence_parallel and parallel.model_parallel_size == 2


def test_flags_on_an_existing_parser() -> None:
    parser = add_megatron_args(argparse.ArgumentParser())
    parser.add_argument("--eps-clip", type=float)
    args = parser.parse_args(["--context-parallel-size", "2", "--eps-clip", "0.2"])
    assert parallel_config_from_args(args).context_parallel_size == 2


def test_transformer_config_kwargs_for_the_script() -> None:
    parallel, _ = parse_megatron_args(SCRIPT_FLAGS)
    kw = transformer_config_kwargs(QwenArchitecture.from_hf_config(QWEN3_4B), parallel)
    assert kw["num_query_groups"] == 8 and kw["kv_channels"] == 128
    assert (
        kw["normalization"] == "RMSNorm"
        and kw["gated_linear_unit"]
        and kw["activation_func"] == "silu"
    )
    assert kw["qk_layernorm"] and not kw["add_qkv_bias"] and not kw["add_bias_linear"]
    assert kw["tensor_model_parallel_size"] == 2 and kw["sequence_parallel"]
    assert (kw["recompute_granularity"], kw["recompute_method"], kw["recompute_num_layers"]) == (
        "full",
        "uniform",
        1,
    )
    assert kw["params_dtype"] == "bfloat16" and kw["bf16"]
    assert not kw["masked_softmax_fusion"] and not kw["use_cpu_initialization"]


def test_sequence_parallel_is_off_without_tensor_parallelism() -> None:
    parallel = MegatronParallelConfig(sequence_parallel=True)
    assert not parallel.effective_sequence_parallel
    kw = transformer_config_kwargs(QwenArchitecture.from_hf_config(QWEN3_4B), parallel)
    assert kw["sequence_parallel"] is False


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            {"tensor_model_parallel_size": 3},
            "num_attention_heads (32) is not divisible by --tensor-model-parallel-size (3)",
        ),
        (
            {"tensor_model_parallel_size": 16},
            "num_key_value_heads (8) is not divisible by --tensor-model-parallel-size (16)",
        ),
        (
            {"pipeline_model_parallel_size": 72},
            "--pipeline-model-parallel-size (72) is larger than num_hidden_layers (36)",
        ),
        (
            {"pipeline_model_parallel_size": 5},
            "num_hidden_layers (36) is not divisible by --pipeline-model-parallel-size (5)",
        ),
    ],
)
def test_a_split_the_model_cannot_take_is_refused_by_name(
    sizes: dict[str, int], message: str
) -> None:
    """Qwen3-4B's shape under sizes that do not divide it: heads, KV heads, layers (a
    pipeline larger than the model's layers included)."""
    arch = QwenArchitecture.from_hf_config(QWEN3_4B)
    MegatronParallelConfig(
        tensor_model_parallel_size=8, pipeline_model_parallel_size=4
    ).check_model(arch)
    with pytest.raises(ValueError, match=re.escape(message)):
        MegatronParallelConfig(**sizes).check_model(arch)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size"),
        ({"context_parallel_size": -1}, "context_parallel_size"),
        ({"recompute_granularity": "full"}, "needs --recompute-method"),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 0,
            },
            ">= 1",
        ),
        ({"recompute_method": "uniform", "recompute_num_layers": 1}, "only apply"),
        ({"recompute_granularity": "some"}, "full or selective"),
        ({"attention_dropout": 1.0}, "attention_dropout"),
    ],
)
def test_bad_parallel_settings_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MegatronParallelConfig(**kwargs)


def test_bad_flag_values_are_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        parse_megatron_args(["--recompute-granularity", "partial"])


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (MegatronParallelConfig(tensor_model_parallel_size=16), "num_key_value_heads"),
        (MegatronParallelConfig(tensor_model_parallel_size=3), "num_attention_heads"),
        (MegatronParallelConfig(pipeline_model_parallel_size=5), "num_hidden_layers"),
    ],
)
def test_sizes_that_do_not_divide_the_model_are_rejected(
    parallel: MegatronParallelConfig, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        transformer_config_kwargs(QwenArchitecture.from_hf_config(QWEN3_4B), parallel)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (
            {"parallel": MegatronParallelConfig(context_parallel_size=2)},
            "--context-parallel-size 2: megatron-core's context-parallel attention needs "
            "Transformer Engine on CUDA",
        ),
        ({"parallel": MegatronParallelConfig(bf16=True)}, "--bf16"),
        (  # no Transformer Engine on CUDA here
            {"parallel": MegatronParallelConfig(attention_backend="flash")},
            "--attention-backend flash: Transformer Engine's attention needs",
        ),
        ({"top_p": 0.9}, "--rollout-top-p"),
        ({"gradient_checkpointing": True}, "--recompute-granularity"),
    ],
)
def test_the_megatron_engine_refuses_what_it_cannot_honour_at_start(
    settings: dict[str, object], named: str
) -> None:
    """Refused when the config is made, before megatron-core is imported or a model loads."""
    from turnrl.grpo_core.megatron.engine import MegatronEngineConfig

    with pytest.raises(ValueError, match=f"train backend megatron: .*{re.escape(named)}"):
        MegatronEngineConfig(model_path="unused", **settings)  # type: ignore[arg-type]
    MegatronEngineConfig(model_path="unused")  # the defaults are honoured, TP with SP, PP
    MegatronEngineConfig(
        model_path="unused",
        parallel=MegatronParallelConfig(
            tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2
        ),
    )


def test_megatron_available_answers_without_importing_or_raising() -> None:
    """A plain False where no `megatron` package exists (find_spec of a submodule raises)."""
    import importlib.util
    import sys

    from turnrl.grpo_core.megatron.config import megatron_available

    before = set(sys.modules)
    try:
        installed = importlib.util.find_spec("megatron") is not None
    except ValueError:
        installed = True
    assert megatron_available() is installed
    assert not {m for m in set(sys.modules) - before if m.startswith("megatron.core")}


def test_the_attention_settings_choose_the_layer_spec_and_reach_megatron() -> None:
    arch = QwenArchitecture.from_hf_config(QWEN3_4B)
    local = MegatronParallelConfig()
    assert local.layer_spec == "local" and not local.attention_softmax_in_fp32
    te = MegatronParallelConfig(attention_backend="fused", attention_softmax_in_fp32=True)
    assert te.layer_spec == "te"
    assert transformer_config_kwargs(arch, te)["attention_softmax_in_fp32"] is True
    parsed, rest = parse_megatron_args(
        ["--attention-backend", "flash", "--attention-softmax-in-fp32", "--x"]
    )
    assert (parsed.attention_backend, parsed.attention_softmax_in_fp32, rest) == (
        "flash",
        True,
        ["--x"],
    )
    assert not parse_megatron_args(["--no-attention-softmax-in-fp32"])[0].attention_softmax_in_fp32
    # the flags' defaults are the config's: no flag given is the default config
    assert parse_megatron_args([]) == (MegatronParallelConfig(), [])
    with pytest.raises(ValueError, match="--attention-backend must be one of local, flash"):
        MegatronParallelConfig(attention_backend="sdpa")


def test_the_scripts_architecture_flags_match_qwen3_4b_and_a_wrong_one_is_named() -> None:
    arch = QwenArchitecture.from_hf_config(QWEN3_4B)
    script = {  # slime's scripts/models/qwen3-4B.sh (tied embeddings: no --untie flag)
        "num_layers": 36,
        "hidden_size": 2560,
        "ffn_hidden_size": 9728,
        "num_attention_heads": 32,
        "group_query_attention": True,
        "num_query_groups": 8,
        "kv_channels": 128,
        "vocab_size": 151936,
        "normalization": "RMSNorm",
        "norm_epsilon": 1e-6,
        "rotary_base": 5000000,
        "swiglu": True,
        "disable_bias_linear": True,
        "qk_layernorm": True,
        "use_rotary_position_embeddings": True,
    }
    arch.check_flags(script, "Qwen3-4B")
    with pytest.raises(ValueError, match=r"--num-layers 28 \(the model has 36\)"):
        arch.check_flags({**script, "num_layers": 28}, "Qwen3-4B")
    with pytest.raises(ValueError, match="unknown architecture flags: seq_len"):
        arch.check_flags({"seq_len": 1}, "Qwen3-4B")


def test_a_run_this_machine_cannot_train_is_refused_by_flag() -> None:
    from turnrl.grpo_core.megatron.config import check_run, megatron_available

    tp2 = MegatronParallelConfig(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="--dtype bfloat16 with --train-backend megatron on"):
        check_run(tp2, 2, "cpu", "bfloat16", "--trainer-ranks")
    with pytest.raises(ValueError, match=r"3 trainer rank\(s\) are not a multiple .* = 2 \(--x\)"):
        check_run(tp2, 3, "gpu", "bfloat16", "--x")
    if megatron_available():
        check_run(tp2, 4, "cpu", "float32", "--trainer-ranks")
    else:
        with pytest.raises(ValueError, match="needs megatron-core: pip install"):
            check_run(tp2, 4, "cpu", "float32", "--trainer-ranks")
