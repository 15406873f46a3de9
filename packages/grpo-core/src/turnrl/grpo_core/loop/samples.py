"""From rollout samples to a training batch: rewards -> advantages -> padded tensors.

A sample is anything with the token-exact fields of a trajectory (``prompt_ids``,
``response_ids``, ``loss_mask``, ``rollout_logprobs``, ``reward``, ``group_id``);
``turnrl.tool_envs.trajectory.Trajectory`` meets :class:`Sample` structurally, and this
package never imports it. Advantages are computed over the whole step (every sample of
every group) before samples without a single policy token are dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from turnrl.grpo_core.algos.advantages import compute_advantages
from turnrl.grpo_core.loop.config import LoopConfig
from turnrl.grpo_core.training.batch import TrainBatch, pad_sequences


@runtime_checkable
class Sample(Protocol):
    """One rollout sample, token-exact (what the loop trains on)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    group_id: str | None


def sample_advantages(samples: Sequence[Sample], config: LoopConfig) -> torch.Tensor:
    """``[N]`` per-sample advantages of one step's samples.

    With ``rewards_normalization`` the configured estimator runs over the groups; without it
    the raw reward is the advantage (slime's ``--disable-rewards-normalization``, used with
    rewards the reward hook already normalised, e.g. by the group maximum).
    """
    if not samples:
        raise ValueError("no samples to compute advantages for")
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards must be finite, got {rewards.tolist()}")
    if not config.rewards_normalization:
        return rewards
    groups = [
        s.group_id if s.group_id is not None else f"sample-{i}" for i, s in enumerate(samples)
    ]
    return compute_advantages(
        rewards,
        groups,
        config.advantage_estimator,  # type: ignore[arg-type]
        norm_by_std=config.grpo_std_normalization,
    )


def build_train_batch(
    samples: Sequence[Sample], advantages: torch.Tensor, pad_id: int
) -> TrainBatch | None:
    """Right-padded batch of the samples that have policy tokens; None when none has.

    Position ``t`` of every tensor is token ``t`` of ``prompt_ids + response_ids``;
    ``loss_mask`` and ``rollout_logprobs`` are 0 over the prompt.
    """
    if len(samples) != advantages.shape[0]:
        raise ValueError(f"{len(samples)} samples but {advantages.shape[0]} advantages")
    keep = [i for i, s in enumerate(samples) if any(s.loss_mask) and s.prompt_ids]
    if not keep:
        return None
    seqs, masks, logps = [], [], []
    for i in keep:
        s = samples[i]
        if not len(s.response_ids) == len(s.loss_mask) == len(s.rollout_logprobs):
            raise ValueError(
                f"sample {i}: response_ids, loss_mask, rollout_logprobs differ in length"
            )
        seqs.append(list(s.prompt_ids) + list(s.response_ids))
        masks.append([0] * len(s.prompt_ids) + [int(m) for m in s.loss_mask])
        logps.append([0.0] * len(s.prompt_ids) + [float(x) for x in s.rollout_logprobs])
    ids, attn, mask = pad_sequences(seqs, masks, pad_id)
    rollout_logp = torch.zeros(ids.shape, dtype=torch.float32)
    for row, lp in enumerate(logps):
        rollout_logp[row, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask,
        advantages=advantages[keep].to(torch.float32),
        rollout_logprobs=rollout_logp * mask,
    )


def split_batch(batch: TrainBatch, num_parts: int) -> list[TrainBatch]:
    """Split a batch into ``num_parts`` mini-batches of nearly equal row counts (in order)."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    rows = batch.num_sequences
    parts = min(num_parts, rows)
    bounds = [round(k * rows / parts) for k in range(parts + 1)]
    return [batch.select(slice(a, b)) for a, b in itertools.pairwise(bounds) if b > a]
