"""Megatron-core training backend for the Qwen family (Qwen2, Qwen2.5, Qwen3).

- `config`: `QwenArchitecture` (from a Hugging Face config), `MegatronParallelConfig`
  (TP / PP / CP / sequence parallel / recompute, parsed from Megatron's flag names) and
  the `TransformerConfig` keyword mapping. No megatron-core needed.
- `convert`: Hugging Face <-> Megatron state dicts (fused QKV and gate/up layouts, `local`
  and Transformer Engine names), tensor- and pipeline-parallel split/merge; bit-exact.
  No megatron-core needed.
- `model`: `GPTModel` construction, weight load/export, vocab-parallel log-probs
  (needs the `megatron` extra).
- `cpu`: gloo group + the CPU shims to run a model forward/backward without an accelerator.
"""

from turnrl.grpo_core.megatron.config import (
    INSTALL_HINT,
    SUPPORTED_MODEL_TYPES,
    MegatronParallelConfig,
    QwenArchitecture,
    add_megatron_args,
    megatron_available,
    parallel_config_from_args,
    parse_megatron_args,
    require_megatron,
    transformer_config_kwargs,
)
from turnrl.grpo_core.megatron.convert import (
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    merge_pipeline,
    merge_tensor_parallel,
    pipeline_layer_ranges,
    split_pipeline,
    split_qkv,
    split_tensor_parallel,
)

__all__ = [
    "INSTALL_HINT",
    "SUPPORTED_MODEL_TYPES",
    "MegatronParallelConfig",
    "QwenArchitecture",
    "add_megatron_args",
    "fuse_qkv",
    "hf_to_megatron",
    "megatron_available",
    "megatron_to_hf",
    "merge_pipeline",
    "merge_tensor_parallel",
    "parallel_config_from_args",
    "parse_megatron_args",
    "pipeline_layer_ranges",
    "require_megatron",
    "split_pipeline",
    "split_qkv",
    "split_tensor_parallel",
    "transformer_config_kwargs",
]
