"""A megatron-core train engine with the surface of :class:`TorchEngine`.

:class:`MegatronEngine` trains a megatron-core ``GPTModel`` built from a Hugging Face Qwen
folder (weights converted by ``convert``), with the same GRPO-family losses, micro-batch
accumulation, gradient clipping, AdamW, learning-rate warm-up and metrics as the torch
backend: it is a ``TorchEngine`` whose module scores tokens through Megatron
(``gpt_logprobs``) instead of a transformers model. So the loop, the weight sync (through
:meth:`export_hf`), the reference policy and the trainer group use it unchanged.

What is built: tensor parallel (the weights split over the TP group; with or without
sequence parallel, also on the CPU), data parallel over the
remaining ranks (a plain gradient all-reduce), full or selective activation recompute from
the Megatron flags, on any device megatron-core runs on (on the CPU through
``cpu.cpu_shims``, gloo, and a plain torch AdamW on each rank's shard). Checkpoints keep one
set of keys per TP shard. What is refused at start, naming the setting: pipeline and
context parallelism, ``--bf16`` and rollout top-p / top-k (the vocab-parallel log-probs are
those of temperature-scaled full softmax only). Not wired yet: Megatron's DDP (bucketed,
overlapped reduction) and distributed optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from turnrl.grpo_core.megatron.config import MegatronParallelConfig, QwenArchitecture
from turnrl.grpo_core.training.policy import load_causal_lm, resolve_dtype, scatter_scores
from turnrl.grpo_core.training.torch_engine import (
    TorchEngine,
    TorchEngineConfig,
    make_optimizer,
    rank,
)


@dataclass(frozen=True)
class MegatronEngineConfig(TorchEngineConfig):
    """:class:`TorchEngineConfig` plus Megatron's parallelism and recompute settings."""

    parallel: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)
    """Tensor / pipeline / context parallel sizes, sequence parallel and recompute, as
    parsed from the Megatron flags (``parse_megatron_args``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for reason in unsupported(self):
            raise ValueError(f"train backend megatron: {reason}")


def unsupported(config: MegatronEngineConfig) -> list[str]:
    """What this build of the megatron backend cannot honour in ``config``, one line each."""
    p = config.parallel
    reasons = []
    sizes = {
        "--pipeline-model-parallel-size": p.pipeline_model_parallel_size,
        "--context-parallel-size": p.context_parallel_size,
    }
    for flag, size in sizes.items():
        if size > 1:
            reasons.append(
                f"{flag} {size}: the megatron train engine runs one pipeline stage and no "
                "context parallelism for now (tensor and data parallel are built)"
            )
    if p.bf16:
        reasons.append(
            "--bf16 would train bfloat16 parameters with no fp32 master copy; set the "
            "engine's dtype bfloat16 (autocast over fp32 weights) instead"
        )
    if config.top_p < 1 or config.top_k > 0:
        reasons.append(
            "--rollout-top-p / --rollout-top-k: Megatron's log-probs are of the full "
            "softmax; use the torch backend for truncated sampling"
        )
    if config.gradient_checkpointing:
        reasons.append(
            "gradient_checkpointing is the torch backend's; give Megatron's "
            "--recompute-granularity / --recompute-method instead"
        )
    return reasons


class MegatronLogProbs(nn.Module):
    """Wraps a ``GPTModel``; ``forward`` has ``CausalLMLogProbs``' signature and result."""

    def __init__(self, model: nn.Module, temperature: float = 1.0):
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        score_mask: torch.Tensor,
        return_entropy: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of ``input_ids[:, t]`` given ``< t`` where ``score_mask`` is 1 (column 0
        ignored), fp32 ``[B, L]``, zero elsewhere; entropy likewise when asked.

        Sequences are right-padded: under the causal mask a real token never sees the
        padding after it, so ``attention_mask`` needs no further use.
        """
        from turnrl.grpo_core.megatron.model import gpt_logprobs

        labels = torch.roll(input_ids, -1, dims=1)  # position t predicts token t + 1
        logp, entropy = gpt_logprobs(
            self.model,
            input_ids,
            labels,
            temperature=self.temperature,
            return_entropy=return_entropy,
        )
        select = score_mask[:, 1:].bool()
        logp = scatter_scores(logp[:, :-1][select], select)
        return logp, None if entropy is None else scatter_scores(entropy[:, :-1][select], select)


class MegatronEngine(TorchEngine):
    """Trains a megatron-core ``GPTModel``; one instance per rank. Ranks are ordered as
    Megatron orders them: the ranks of one TP group are adjacent, so rank ``r`` trains on
    data-parallel share ``r // TP``."""

    config: MegatronEngineConfig

    def __init__(self, config: MegatronEngineConfig):
        """Start Megatron's groups, build the model from ``config.model_path``'s weights,
        and build the optimizer.

        Raises:
            ImportError: megatron-core is not installed (the ``megatron`` extra).
            ValueError: a setting this engine cannot honour (see :func:`unsupported`), or a
                world size the model-parallel size does not divide.
        """
        from turnrl.grpo_core.megatron.model import build_gpt_model, load_hf_weights
        from turnrl.grpo_core.megatron.parallel import model_parallel

        self.config = config
        self.compute_dtype = resolve_dtype(config.dtype)
        self.step = 0
        self._groups = contextlib.ExitStack()
        device = self._groups.enter_context(model_parallel(config.parallel, seed=config.seed))
        self.device = torch.device(device)
        from megatron.core import parallel_state as ps

        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group() if self.dp_size > 1 else None
        self.model_parallel_size = ps.get_tensor_model_parallel_world_size()
        self.model_parallel_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        torch.manual_seed(config.seed)
        hf = load_causal_lm(config.model_path, torch.float32)
        self.hf_config: Any = hf.config
        self.arch = QwenArchitecture.from_hf_config(hf.config)
        config.parallel.check_model(self.arch)
        model = build_gpt_model(self.arch, config.parallel, cpu_initialization=True)
        load_hf_weights(model, hf.state_dict(), self.arch)
        self._hf: nn.Module | None = None  # built again on first use of hf_model
        del hf
        self.gpt = model.to(self.device)
        self.module = MegatronLogProbs(self.gpt, config.temperature)
        self.optimizer = make_optimizer(self.module, config.optimizer)

    def _clip_and_step(self) -> float:
        """Finish the gradients as Megatron's ``finalize_model_grads`` does, clip them by
        their global norm and step.

        Data parallel: a plain all-reduce (mean) of every gradient over the data-parallel
        group, on any device (Megatron's DDP with its bucketed, overlapped reduction and
        the distributed optimizer are not wired). Tensor parallel: the weights every TP rank
        holds whole but sees only part of the work for (the per-head query / key norms;
        the norms under sequence parallelism) are summed over the TP group. The norm counts
        each TP shard once and each replicated weight once (``torch``'s clip formula)."""
        import torch.distributed as dist
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        named = [(n, p) for n, p in self.gpt.named_parameters() if p.requires_grad]
        for _, p in named:
            if p.grad is None:  # every rank must reduce the same tensors
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:
            _all_reduce([p.grad for _, p in named], self.dp_group, mean=True)
        if self.model_parallel_size > 1:
            sp = self.config.parallel.sequence_parallel
            partial = [
                p.grad
                for n, p in named
                if "q_layernorm" in n
                or "k_layernorm" in n
                or (sp and getattr(p, "sequence_parallel", False))
            ]
            _all_reduce(partial, self.tp_group, mean=False)
        counted = [p.grad for _, p in named if param_is_not_tensor_parallel_duplicate(p)]
        square = torch.stack([torch.linalg.vector_norm(g) ** 2 for g in counted]).sum()
        if self.model_parallel_size > 1:
            dist.all_reduce(square, group=self.tp_group)
        norm = square.sqrt()
        max_norm = self.config.optimizer.clip_grad
        if max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_([p.grad for _, p in named], scale)
        self.optimizer.step()
        return float(norm)

    def hf_snapshot(self) -> nn.Module:
        """A transformers model holding the current weights, copied from Megatron's on every
        call: for code that samples from the trained policy in this process (the toy run).
        Costs a second copy of the model; the weight sync goes through :meth:`hf_weights`."""
        if self._hf is None:
            self._hf = load_causal_lm(self.config.model_path, torch.float32).to(self.device)
        with torch.no_grad():
            weights = dict(self.hf_weights())
            result = self._hf.load_state_dict(weights, strict=False)
        tied = getattr(self.hf_config, "tie_word_embeddings", False)
        if result.unexpected_keys or set(result.missing_keys) - (
            {"lm_head.weight"} if tied else set()
        ):
            raise KeyError(f"Megatron weights do not fit the Hugging Face model: {result}")
        return self._hf

    def hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under Hugging Face names (``megatron_to_hf``; every model-parallel
        rank must call it), as the collective weight sync sends them."""
        from turnrl.grpo_core.megatron.model import export_hf_weights

        for name, tensor in export_hf_weights(self.gpt, self.arch).items():
            yield name, tensor.to(dtype) if dtype is not None else tensor

    def export_hf(self, folder: str | Path, dtype: Any = None) -> Path:
        """Write the current weights as a Hugging Face folder (Megatron -> HF names)."""
        import torch.distributed as dist

        from turnrl.grpo_core.training.checkpoint import write_hf_folder

        weights = dict(self.hf_weights())
        if rank() == 0:
            source = Path(self.config.model_path)
            write_hf_folder(
                weights, self.hf_config, source, Path(folder), dtype or self.config.dtype
            )
        if dist.is_initialized():
            dist.barrier()
        return Path(folder)

    def close(self) -> None:
        """Tear down Megatron's groups (and the process group this engine started)."""
        self._groups.close()


def _all_reduce(grads: list[torch.Tensor], group: Any, *, mean: bool) -> None:
    """Sum (or average) ``grads`` in place over ``group``, as one flat buffer."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    if mean:
        flat /= dist.get_world_size(group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)
