"""Build megatron-core `GPTModel`s for the Qwen family, load Hugging Face weights, score tokens.

- `build_transformer_config(arch, parallel)`: megatron-core `TransformerConfig` from
  `config.transformer_config_kwargs`.
- `build_layer_spec(arch, spec)`: the decoder layer spec, Megatron's `local` modules or
  Transformer Engine's (`te`, on GPUs with TE installed); RMSNorm and q/k layernorm as the
  architecture says. Under sequence parallelism the `local` spec's norms are
  `SequenceParallelRMSNorm` (megatron-core's torch norm refuses it).
- `build_gpt_model(arch, parallel)`: the `GPTModel` for this rank (RoPE with the model's
  theta, tied or untied output layer, pre/post-process from the pipeline stage).
- `load_hf_weights(model, hf_state, arch)` / `export_hf_weights(model, arch)`: Hugging Face
  weights into this rank's shard, and the whole model back as a Hugging Face state dict.
- `gpt_logprobs(model, input_ids, labels, ...)`: per-token log-probs (and entropy) of
  `labels` with the logits split over tensor-parallel ranks (vocab-parallel, exact).
- `gpt_stage_forward(...)`: the same for one pipeline stage (hidden states out of a stage
  before the last), for Megatron's pipeline schedule.

megatron-core is an optional extra: `pip install "turnrl-grpo-core[megatron]"`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from turnrl.grpo_core.megatron.config import (
    MegatronParallelConfig,
    QwenArchitecture,
    require_megatron,
    transformer_config_kwargs,
)
from turnrl.grpo_core.megatron.convert import (
    SpecLayout,
    StateDict,
    hf_to_megatron,
    megatron_to_hf,
    merge_pipeline,
    merge_tensor_parallel,
    split_pipeline,
    split_tensor_parallel,
)


def build_transformer_config(
    arch: QwenArchitecture, parallel: MegatronParallelConfig, *, cpu_initialization: bool = False
) -> Any:
    """megatron-core `TransformerConfig` for `arch` under `parallel` (see `config`)."""
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = transformer_config_kwargs(arch, parallel, cpu_initialization=cpu_initialization)
    kwargs["activation_func"] = torch.nn.functional.silu
    kwargs["params_dtype"] = getattr(torch, kwargs["params_dtype"])
    kwargs["pipeline_dtype"] = getattr(torch, kwargs["pipeline_dtype"])
    if parallel.layer_spec == "te":  # Transformer Engine's kernel choice
        from megatron.core.transformer.enums import AttnBackend

        kwargs["attention_backend"] = AttnBackend[parallel.attention_backend]
    return TransformerConfig(**kwargs)


class SequenceParallelRMSNorm:
    """megatron-core's ``WrappedTorchNorm`` for RMSNorm, allowed under sequence parallelism.

    A norm acts on each token alone, so it is right on a sequence shard as on the whole;
    only its weight's gradient is partial (this rank's tokens). As Megatron's own fused
    norms do, the weight is marked ``sequence_parallel`` so that the gradients are summed
    over the tensor-parallel group before the step (``MegatronEngine._clip_and_step``).
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def _swap_module(spec: Any, old: type, new: type) -> Any:
    """``spec`` (a ``ModuleSpec`` tree of dataclasses) with every ``old`` module now ``new``."""
    import dataclasses

    if spec is old:
        return new
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {
            f.name: _swap_module(getattr(spec, f.name), old, new)
            for f in dataclasses.fields(spec)
            if f.init
        }
        return dataclasses.replace(spec, **changes)
    return spec


def build_layer_spec(
    arch: QwenArchitecture, spec: SpecLayout = "local", *, sequence_parallel: bool = False
) -> Any:
    """The decoder layer `ModuleSpec`: `local` (megatron-core modules) or `te` (Transformer Engine)."""
    require_megatron()
    from megatron.core.models.gpt import gpt_layer_specs

    if spec == "local":
        layer = gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=arch.qk_layernorm, normalization="RMSNorm"
        )
        if not sequence_parallel:
            return layer
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return _swap_module(layer, WrappedTorchNorm, SequenceParallelRMSNorm)
    if spec == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=arch.qk_layernorm
        )
    raise ValueError(f"spec must be 'local' or 'te', got {spec!r}")


def build_gpt_model(
    arch: QwenArchitecture,
    parallel: MegatronParallelConfig,
    *,
    spec: SpecLayout | None = None,
    cpu_initialization: bool = False,
) -> Any:
    """A megatron-core `GPTModel` for this rank; model-parallel groups must be initialised.

    Args:
        arch: The architecture (`QwenArchitecture.from_hf_config`).
        parallel: Sizes, recompute and precision; must match the initialised groups.
        spec: Layer implementation: `local` or `te` (default: what
            `parallel.attention_backend` needs).
        cpu_initialization: Create the parameters on the CPU (needed on a CPU-only machine).

    Returns:
        `megatron.core.models.gpt.GPTModel`, its parameters random until weights are loaded.

    Raises:
        ValueError: If the initialised tensor-parallel size differs from `parallel`'s.
    """
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp != parallel.tensor_model_parallel_size:
        raise ValueError(
            f"model-parallel groups have TP {tp}, the config says {parallel.tensor_model_parallel_size}"
        )
    layout: SpecLayout = spec or ("local" if parallel.layer_spec == "local" else "te")
    config = build_transformer_config(arch, parallel, cpu_initialization=cpu_initialization)
    layer = build_layer_spec(arch, layout, sequence_parallel=config.sequence_parallel)
    if layout == "local" and config.sequence_parallel:  # the final norm too (the block's default)
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        layers = [layer] * get_num_layers_to_build(config)
        layer = TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelRMSNorm)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # type: ignore[arg-type]  # float theta (1e6) is fine
    )


def _ranks() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def _load_shard(model: torch.nn.Module, shard: Mapping[str, torch.Tensor]) -> None:
    result = model.load_state_dict(dict(shard), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise KeyError(
            f"weights do not fit the model: missing {missing[:8]}, unexpected {result.unexpected_keys[:8]}"
        )


def load_hf_weights(
    model: torch.nn.Module,
    hf_state: Mapping[str, torch.Tensor],
    arch: QwenArchitecture,
    layout: SpecLayout = "local",
) -> None:
    """Copy a Hugging Face state dict into this rank's `GPTModel` (its TP shard and PP stage).

    Raises:
        KeyError: If the converted weights do not match the model's parameters exactly.
    """
    tp_rank, tp, pp_rank, pp = _ranks()
    full = hf_to_megatron(hf_state, arch, layout)
    stage = split_pipeline(full, arch, pp)[pp_rank]
    with torch.no_grad():
        _load_shard(model, split_tensor_parallel(stage, arch, tp)[tp_rank])


def export_hf_weights(
    model: torch.nn.Module, arch: QwenArchitecture, layout: SpecLayout = "local"
) -> StateDict:
    """The whole model as a Hugging Face state dict, gathered from every TP / PP rank (CPU tensors).

    Every rank of the model-parallel group must call it; every rank gets the full result.
    """
    from megatron.core import parallel_state

    tp_rank, tp, pp_rank, pp = _ranks()
    local = {
        k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")
    }
    if tp * pp == 1:
        return megatron_to_hf(local, arch, layout)
    group = parallel_state.get_model_parallel_group()
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, (tp_rank, pp_rank, local), group=group)
    by_rank = {(t, p): s for t, p, s in gathered}  # context-parallel ranks hold copies
    stages = [merge_tensor_parallel([by_rank[t, p] for t in range(tp)], arch) for p in range(pp)]
    return megatron_to_hf(merge_pipeline(stages, arch), arch, layout)


def _vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) where the last dim is split over the tensor-parallel ranks."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    peak = logits.detach().max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    # H = log Z - E_p[z] = peak + log S - T / S, with S = sum exp(z - peak) and
    # T = sum exp(z - peak) z over the whole vocabulary. Every global quantity is one of the
    # two sums, each all-reduced from this rank's part (identity backward): so every rank's
    # gradient is exact. (Writing E_p[z] with p = exp(z - log Z) would let autograd see only
    # this rank's share of dE/d(log Z).)
    shifted = (logits - peak).exp()
    total = reduce_from_tensor_model_parallel_region(shifted.sum(-1))
    weighted = reduce_from_tensor_model_parallel_region((shifted * logits).sum(-1))
    return peak.squeeze(-1) + total.log() - weighted / total


def causal_attention_mask(seq_len: int, device: torch.device | str) -> torch.Tensor:
    """`[1, 1, s, s]` boolean mask, True where attention is blocked (future positions)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def gpt_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of `labels` under a whole `GPTModel` (one pipeline stage), fp32.

    Works under tensor parallelism (with or without sequence parallelism): the logits stay
    split over the vocabulary and Megatron's vocab-parallel cross entropy combines them.

    Args:
        model: The model (its tensor-parallel output stays split over the vocabulary).
        input_ids: `[B, S]` token ids.
        labels: `[B, S]` the token to score at every position (usually `input_ids` shifted).
        temperature: The logits are divided by it (> 0), as the sampler did.
        return_entropy: Also return the per-token entropy (differentiable).
        position_ids: `[B, S]` RoPE positions; default `0..S-1`.

    Returns:
        `(logp, entropy)`, each `[B, S]` fp32; `entropy` is None unless asked for.

    Raises:
        ValueError: On mismatched shapes, a non-positive temperature, or a model that is one
            pipeline stage of several (run those through `gpt_stage_forward` under a
            pipeline schedule, as `MegatronEngine` does).
        NotImplementedError: Under context parallelism (CP > 1).
    """
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError(
            "gpt_logprobs runs a whole model in one stage; with pipeline parallelism run "
            "gpt_stage_forward under Megatron's pipeline schedule (MegatronEngine does)"
        )
    scores = gpt_stage_forward(
        model,
        input_ids,
        labels,
        temperature=temperature,
        return_entropy=return_entropy,
        position_ids=position_ids,
    )
    assert isinstance(scores, tuple)  # the last stage scores
    return scores


def gpt_stage_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor:
    """This pipeline stage's part of `gpt_logprobs` (same arguments).

    The first stage embeds `input_ids`; a later stage takes the hidden states the previous
    stage sent, set beforehand with `model.set_input_tensor` (Megatron's schedules do).
    The last stage returns `(logp, entropy)` as `gpt_logprobs` does; a stage before it
    returns its hidden states `[S, B, H]` (`[S / TP, B, H]` under sequence parallelism),
    the next stage's input. Every stage needs the same `input_ids` (their length sets the
    mask and the RoPE positions); only the last reads `labels`.
    """
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if parallel_state.get_context_parallel_world_size() > 1:
        raise NotImplementedError(
            "gpt_logprobs does not split sequences over context-parallel ranks yet (CP > 1)"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"need input_ids and labels both [B, S]; got {tuple(input_ids.shape)}, {tuple(labels.shape)}"
        )
    batch, seq = input_ids.shape
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pad = -seq % tp if getattr(model.config, "sequence_parallel", False) else 0
    if pad:  # sequence parallel splits the sequence over TP ranks; padding after is unseen
        input_ids, labels = (torch.nn.functional.pad(t, (0, pad)) for t in (input_ids, labels))
        if position_ids is not None:
            position_ids = torch.nn.functional.pad(position_ids, (0, pad))
    padded = seq + pad
    if position_ids is None:
        position_ids = torch.arange(padded, device=input_ids.device).expand(batch, padded)
    mask = causal_attention_mask(padded, input_ids.device)
    output = model(input_ids, position_ids, mask)
    if not getattr(model, "post_process", True):
        return output  # hidden states for the next stage
    logits = output.float() / temperature  # [B, S, V / TP]
    entropy = _vocab_parallel_entropy(logits) if return_entropy else None
    # Megatron's cross entropy takes [S, B, V/TP] and [S, B], returns -log p, and shifts its
    # input in place: give it a copy so `logits` stays intact for the entropy's backward.
    sbv = logits.transpose(0, 1).clone(memory_format=torch.contiguous_format)
    logp = -vocab_parallel_cross_entropy(sbv, labels.t().contiguous()).t()
    return logp[:, :seq], None if entropy is None else entropy[:, :seq]
