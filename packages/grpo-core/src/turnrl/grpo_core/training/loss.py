"""The per-micro-batch training loss: the algorithms' actor loss for RL, masked NLL for SFT.

RL uses `turnrl.grpo_core.algos.actor_loss` (policy loss + KL - entropy) with the counts of
the whole mini-batch, so summing micro-batches (and averaging ranks) gives the loss of one
batch. SFT is the negative log-likelihood of the loss-masked tokens, aggregated the same
way. This module only adapts a `TrainBatch` to those functions and checks the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnrl.grpo_core.algos import (
    AGGREGATION_MODES,
    KL_KINDS,
    ActorLossConfig,
    actor_loss,
    aggregate_loss,
    masked_mean,
)
from turnrl.grpo_core.training.batch import TrainBatch

SHARE_METRICS = ("pg_loss", "kl_loss")
"""Metrics that are this micro-batch's share of a mini-batch total (summed, not averaged)."""


def check_loss_config(config: ActorLossConfig) -> None:
    """Raise ValueError on a loss setting the algorithms would only reject at the first step."""
    if config.kl_loss_type not in KL_KINDS:
        raise ValueError(f"unknown kl_loss_type {config.kl_loss_type!r}; choose one of {KL_KINDS}")
    if config.loss_agg_mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {config.loss_agg_mode!r}; choose one of {AGGREGATION_MODES}"
        )
    if config.policy_loss not in ("ppo", "gspo"):
        raise ValueError(f"unknown policy_loss {config.policy_loss!r}; choose ppo or gspo")
    if config.kl_loss_coef < 0 or config.entropy_coef < 0:
        raise ValueError("kl_loss_coef and entropy_coef must be >= 0")


@dataclass(frozen=True)
class BatchCounts:
    """Loss tokens and sequences of a whole mini-batch (all micro-batches, all ranks)."""

    num_tokens: float
    """Tokens with loss mask 1."""
    num_seqs: float
    """Sequences with at least one loss token."""
    dp_size: int = 1
    """Data-parallel ranks whose gradients are averaged."""


def rl_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    batch: TrainBatch,
    config: ActorLossConfig,
    counts: BatchCounts,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the GRPO loss, and its metrics.

    Args:
        logp: `[B, L]` current log-probs (with gradient).
        entropy: `[B, L]` entropy, or None (needed when `entropy_coef > 0`).
        batch: the micro-batch (advantages required; `ref_logprobs` when the KL loss is on).
        config: the algorithms' actor-loss settings.
        counts: token/sequence counts of the whole mini-batch.

    Returns:
        `(loss, metrics)`: the scalar to backpropagate and float metrics (`SHARE_METRICS`
        are shares of the mini-batch value; the rest are local masked means).
    """
    if batch.advantages is None:
        raise ValueError("an RL train step needs advantages in the batch")
    if config.use_kl_loss and batch.ref_logprobs is None:
        raise ValueError(
            "use_kl_loss is on but the batch has no ref_logprobs (fill them with "
            "ReferencePolicy.attach)"
        )
    old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
    out = actor_loss(
        config,
        logp,
        old,
        batch.advantages.to(logp.dtype),
        batch.loss_mask.to(logp.dtype),
        ref_logp=batch.ref_logprobs,
        entropy=entropy,
        rollout_logp=batch.rollout_logprobs,
        global_num_tokens=counts.num_tokens,
        global_num_seqs=counts.num_seqs,
        dp_size=counts.dp_size,
    )
    metrics = {key: float(value) for key, value in out.metrics.items()}
    if "entropy" in metrics and entropy is not None and config.entropy_coef != 0:
        # actor_loss reports the aggregated share here; report the local mean like the rest.
        metrics["entropy"] = float(masked_mean(entropy.detach(), batch.loss_mask.to(entropy.dtype)))
    return out.loss, metrics


def sft_loss(
    logp: torch.Tensor, batch: TrainBatch, counts: BatchCounts, mode: str = "token-mean"
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the SFT negative log-likelihood on loss-masked tokens.

    Args:
        logp: `[B, L]` log-probs of the batch's tokens.
        batch: the micro-batch.
        counts: token/sequence counts of the whole mini-batch.
        mode: loss aggregation mode.

    Returns:
        `(loss, metrics)` with `nll` (the local token-mean negative log-likelihood).
    """
    mask = batch.loss_mask.to(logp.dtype)
    loss = aggregate_loss(
        -logp,
        mask,
        mode,  # type: ignore[arg-type]
        global_num_tokens=counts.num_tokens,
        global_num_seqs=counts.num_seqs,
        dp_size=counts.dp_size,
    )
    return loss, {"nll": float(masked_mean(-logp.detach(), mask))}
