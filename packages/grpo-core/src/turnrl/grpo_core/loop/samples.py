"""From rollout samples to a training batch: rewards -> advantages -> padded tensors.

A sample is anything with the token-exact fields of a trajectory (``prompt_ids``,
``response_ids``, ``loss_mask``, ``rollout_logprobs``, ``reward``, ``group_id``);
``turnrl.tool_envs.trajectory.Trajectory`` meets :class:`Sample` structurally, and this
package never imports it. Advantages are computed over the whole step (every sample of
every group) before samples without a single policy token are dropped.

Sequence-level estimators give one advantage per sample (``[N]``); the REINFORCE++ ones
(``TOKEN_ESTIMATORS``) give one per token (``[N, L]``), laid out like the training batch:
column ``t`` is token ``t`` of ``prompt_ids + response_ids``, 0 off the policy tokens
(prompt, tool results, user turns), so whitening and discounting see only what the policy
generated.
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


TOKEN_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""Estimators whose advantages are per token (whitened over the step's policy tokens)."""


def policy_token_mask(samples: Sequence[Sample]) -> torch.Tensor:
    """``[N, L]`` float mask, 1 on the policy tokens of ``prompt_ids + response_ids``."""
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    mask = torch.zeros(len(samples), length)
    for row, s in enumerate(samples):
        if len(s.loss_mask) != len(s.response_ids):
            raise ValueError(f"sample {row}: response_ids and loss_mask differ in length")
        start = len(s.prompt_ids)
        mask[row, start : start + len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    return mask


def sample_advantages(samples: Sequence[Sample], config: LoopConfig) -> torch.Tensor:
    """Advantages of one step's samples: ``[N]``, or ``[N, L]`` for ``TOKEN_ESTIMATORS``.

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
    mask = None
    if config.advantage_estimator in TOKEN_ESTIMATORS:
        mask = policy_token_mask(samples)
        if mask.sum() < 2:  # nothing to whiten, and nothing to train on either
            return torch.zeros_like(mask)
    return compute_advantages(
        rewards,
        groups,
        config.advantage_estimator,  # type: ignore[arg-type]
        mask,
        norm_by_std=config.grpo_std_normalization,
    )


def advantage_abs_mean(advantages: torch.Tensor, samples: Sequence[Sample]) -> float:
    """Mean ``|advantage|`` per sample, or per policy token for token-level advantages."""
    if advantages.dim() == 1:
        return float(advantages.abs().mean())
    mask = policy_token_mask(samples)
    return float((advantages.abs() * mask).sum() / mask.sum().clamp(min=1))


def build_train_batch(
    samples: Sequence[Sample], advantages: torch.Tensor, pad_id: int
) -> TrainBatch | None:
    """Right-padded batch of the samples that have policy tokens; None when none has.

    Position ``t`` of every tensor is token ``t`` of ``prompt_ids + response_ids``;
    ``loss_mask`` and ``rollout_logprobs`` are 0 over the prompt. ``advantages`` is ``[N]``
    or ``[N, L]`` as :func:`sample_advantages` returns it (``L`` >= the longest sample).
    ``versions`` (-1 over the prompt) when every sample has per-token ``versions``.
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
        advantages=_rows(advantages, keep, ids.shape[1]),
        rollout_logprobs=rollout_logp * mask,
        versions=_versions([samples[i] for i in keep], ids.shape, mask),
    )


def _versions(
    samples: Sequence[Sample], shape: torch.Size, mask: torch.Tensor
) -> torch.Tensor | None:
    """``[N, L]`` token versions (-1 off the policy tokens), or None unless every sample
    has one per response token."""
    rows = [getattr(s, "versions", None) for s in samples]
    if not all(
        r is not None and len(r) == len(s.response_ids) for r, s in zip(rows, samples, strict=True)
    ):
        return None
    out = torch.full(shape, -1, dtype=torch.int64)
    for row, (s, versions) in enumerate(zip(samples, rows, strict=True)):
        start = len(s.prompt_ids)
        out[row, start : start + len(s.response_ids)] = torch.tensor(versions, dtype=torch.int64)
    return torch.where(mask.bool(), out, torch.full_like(out, -1))


def _rows(advantages: torch.Tensor, keep: list[int], length: int) -> torch.Tensor:
    picked = advantages[keep].to(torch.float32)
    if picked.dim() == 1:
        return picked
    if picked.shape[1] < length:
        raise ValueError(f"token advantages cover {picked.shape[1]} positions, need {length}")
    return picked[:, :length]


def split_batch(batch: TrainBatch, num_parts: int) -> list[TrainBatch]:
    """Split a batch into ``num_parts`` mini-batches of nearly equal row counts (in order)."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    rows = batch.num_sequences
    parts = min(num_parts, rows)
    bounds = [round(k * rows / parts) for k in range(parts + 1)]
    return [batch.select(slice(a, b)) for a, b in itertools.pairwise(bounds) if b > a]
