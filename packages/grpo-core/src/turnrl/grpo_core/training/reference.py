"""Frozen reference policy: log-probs of rollout tokens for the KL term.

GRPO with `--use-kl-loss` penalises the policy's divergence from a fixed reference model
(usually the starting checkpoint, `--ref-load`). `ReferencePolicy` loads that model from
a local Hugging Face folder, freezes it, shards it with FSDP2 when several ranks run, and
scores batches without gradients through the same chunked log-prob as the trainer, so
the two sets of log-probs are directly comparable. It scores the distribution the
trainer's log-probs are of: the rollout's temperature, top-p and top-k, and the trainer's
compute dtype (fp32 weights, bf16 compute through autocast as `TorchEngine` does), so with
the policy's weights it gives the trainer's log-probs exactly and the KL is 0
(`recipe.schema.reference_settings` reads all of these from the trainer's config).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.policy import CausalLMLogProbs, DType, load_causal_lm, resolve_dtype
from turnrl.grpo_core.training.torch_engine import (
    score_batch,
    shard_fsdp2,
    training_device,
    world_size,
)


class ReferencePolicy:
    """A frozen causal LM that returns log-probs of the loss-masked tokens."""

    def __init__(
        self,
        model_path: str | Path,
        dtype: DType = "float32",
        micro_batch_size: int = 4,
        logprob_chunk_size: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ):
        """Load the reference model.

        Args:
            model_path: local Hugging Face folder [--ref-load].
            dtype: the trained policy's compute dtype: float32, or bfloat16 through
                autocast over fp32 weights (as the torch and megatron engines compute).
            micro_batch_size: rows per forward.
            logprob_chunk_size: tokens per chunk of the log-prob computation.
            temperature: the rollout temperature, as for the trained policy.
            top_p: the rollout's nucleus mass (1 = off), as for the trained policy.
            top_k: the rollout's top-k (-1 = off), as for the trained policy.
        """
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.device = training_device()
        self.dtype = resolve_dtype(dtype)
        self.micro_batch_size = micro_batch_size
        model = load_causal_lm(model_path, torch.float32).to(self.device)
        model.eval()
        model.requires_grad_(False)
        self.module = CausalLMLogProbs(model, logprob_chunk_size, temperature, top_p, top_k)
        if world_size() > 1:
            shard_fsdp2(self.module, model, self.device)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """`[B, L]` fp32 reference log-probs (CPU), 0 where the loss mask is 0."""

        def forward(mb: TrainBatch) -> torch.Tensor:
            with self._autocast():
                return self.module(
                    mb.input_ids, mb.attention_mask, mb.loss_mask, compute_dtype=self.dtype
                )[0]

        return score_batch(forward, batch, self.micro_batch_size, self.device)

    def attach(self, batch: TrainBatch) -> TrainBatch:
        """`batch` with its `ref_logprobs` filled in."""
        from dataclasses import replace

        return replace(batch, ref_logprobs=self.compute_logprobs(batch))
