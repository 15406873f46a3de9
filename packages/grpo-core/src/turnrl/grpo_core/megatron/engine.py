"""A megatron-core train engine with the surface of :class:`TorchEngine`.

:class:`MegatronEngine` trains a megatron-core ``GPTModel`` built from a Hugging Face Qwen
folder (weights converted by ``convert``), with the same GRPO-family losses, micro-batch
accumulation, gradient clipping, AdamW, learning-rate warm-up and metrics as the torch
backend: it is a ``TorchEngine`` whose module scores tokens through Megatron
(``gpt_logprobs``) instead of a transformers model. So the loop, the weight sync (through
:meth:`export_hf`), the reference policy and the trainer group use it unchanged.

What is built: one rank, tensor parallel 1 (the model's weights whole on this rank), full
or selective activation recompute from the Megatron flags, on any device megatron-core runs
on (on the CPU through ``cpu.cpu_shims``, with a plain torch AdamW). What is refused at
start, naming the setting: tensor / pipeline / context parallelism and several
data-parallel ranks (Megatron's DDP and distributed optimizer are not wired yet), and
rollout top-p / top-k (the vocab-parallel log-probs are those of temperature-scaled full
softmax only).
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
    world_size,
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
        "--tensor-model-parallel-size": p.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": p.pipeline_model_parallel_size,
        "--context-parallel-size": p.context_parallel_size,
    }
    for flag, size in sizes.items():
        if size > 1:
            reasons.append(
                f"{flag} {size}: the megatron train engine runs tensor parallel 1, one stage, "
                "for now (Megatron's model-parallel training step is not built)"
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
    """Trains a megatron-core ``GPTModel``; one instance per rank (one rank for now)."""

    def __init__(self, config: MegatronEngineConfig):
        """Start Megatron's groups, build the model from ``config.model_path``'s weights,
        and build the optimizer.

        Raises:
            ImportError: megatron-core is not installed (the ``megatron`` extra).
            ValueError: a setting this engine cannot honour (see :func:`unsupported`), or
                more than one rank (data parallel is not built).
        """
        from turnrl.grpo_core.megatron.model import build_gpt_model, load_hf_weights
        from turnrl.grpo_core.megatron.parallel import model_parallel

        if world_size() > 1:
            raise ValueError(
                "train backend megatron: one trainer rank for now (data parallel over "
                f"{world_size()} ranks needs Megatron's DDP, not built)"
            )
        self.config = config
        self.compute_dtype = resolve_dtype(config.dtype)
        self.step = 0
        self.dp_size = 1
        self._groups = contextlib.ExitStack()
        device = self._groups.enter_context(model_parallel(config.parallel, seed=config.seed))
        self.device = torch.device(device)
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
        from turnrl.grpo_core.training.checkpoint import write_hf_folder

        weights = dict(self.hf_weights())
        source = Path(self.config.model_path)
        return write_hf_folder(
            weights, self.hf_config, source, Path(folder), dtype or self.config.dtype
        )

    def close(self) -> None:
        """Tear down Megatron's groups (and the process group this engine started)."""
        self._groups.close()
