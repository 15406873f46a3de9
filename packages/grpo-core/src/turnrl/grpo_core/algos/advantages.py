"""Advantage estimators for outcome-rewarded samples organised in GRPO groups.

Every estimator takes one scalar reward per sample and a group id per sample (the prompt
the sample was drawn for). Samples may come in any order and groups may be uneven or
partial: statistics are always computed from the members of each group that are present,
never from the whole batch unless the estimator is defined that way
(`reinforce_plus_plus`). A group with a single sample has no baseline to compare with and
gets advantage 0 under every group estimator.

Estimators (names follow verl's `AdvantageEstimator` / slime's `--advantage-estimator`):

- `grpo`: (r - mean_g) / (std_g + eps), std unbiased; `norm_by_std=False` keeps r - mean_g.
- `dr_grpo`: r - mean_g (Dr. GRPO drops the std normalisation).
- `gspo`: the GRPO advantage; GSPO differs in the loss (sequence-level ratio), not here.
- `rloo`: r - mean of the *other* samples of the group (leave-one-out baseline).
- `reinforce_plus_plus`: discounted return of the outcome reward (placed on the last
  policy token, discounted by `gamma` per policy token) whitened over the batch's tokens.
- `reinforce_plus_plus_baseline`: r - mean_g broadcast to tokens, whitened over the batch.

Sequence-level estimators are broadcast to tokens by multiplying with the loss mask.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, TypeAlias

import torch

AdvantageMethod = Literal[
    "grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"
]
ADVANTAGE_METHODS: tuple[str, ...] = (
    "grpo",
    "dr_grpo",
    "gspo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)
GroupIds: TypeAlias = torch.Tensor | Sequence[Hashable]


def group_index(group_ids: GroupIds, num_samples: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to dense indices 0..G-1.

    Args:
        group_ids: One id per sample: an integer tensor or a sequence of hashables
            (strings, ints, tuples). Order is arbitrary.
        num_samples: Expected number of ids (the batch size).

    Returns:
        `(index, num_groups)`: `index[i]` is the dense group of sample i (int64 `[B]`).

    Raises:
        ValueError: If the number of ids does not match `num_samples`.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.numel() != num_samples:
            raise ValueError(
                f"group_ids must be a 1-D tensor of {num_samples} ids, got shape "
                f"{tuple(group_ids.shape)}"
            )
        if group_ids.is_floating_point():
            raise ValueError("group_ids must be an integer tensor (floats are ambiguous ids)")
        _, index = torch.unique(group_ids, return_inverse=True)
        return index.to(torch.long), int(index.max().item()) + 1 if num_samples else 0
    ids = list(group_ids)
    if len(ids) != num_samples:
        raise ValueError(f"got {len(ids)} group ids for {num_samples} rewards")
    dense: dict[Hashable, int] = {}
    index_list = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index_list, dtype=torch.long), len(dense)


def group_mean_std(
    rewards: torch.Tensor, index: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group count, group mean and unbiased group std (0 for singleton groups).

    Args:
        rewards: `[B]` float rewards.
        index: `[B]` dense group index from `group_index`.
        num_groups: Number of groups G.

    Returns:
        `(count, mean, std)`, each `[B]` gathered back to the samples.
    """
    dtype = rewards.dtype
    count = torch.zeros(num_groups, dtype=dtype).index_add_(0, index, torch.ones_like(rewards))
    total = torch.zeros(num_groups, dtype=dtype).index_add_(0, index, rewards)
    mean = total / count
    sq_dev = (rewards - mean[index]) ** 2
    ss = torch.zeros(num_groups, dtype=dtype).index_add_(0, index, sq_dev)
    var = torch.where(count > 1, ss / (count - 1).clamp(min=1), torch.zeros_like(ss))
    return count[index], mean[index], var.sqrt()[index]


def _check_inputs(
    rewards: torch.Tensor, loss_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B] (one per sample), got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    if loss_mask is not None:
        if loss_mask.dim() != 2 or loss_mask.shape[0] != rewards.shape[0]:
            raise ValueError(
                f"loss_mask must be [B, L] with B={rewards.shape[0]}, got {tuple(loss_mask.shape)}"
            )
        loss_mask = loss_mask.to(rewards.dtype)
    return rewards, loss_mask


def _check_group_sizes(count: torch.Tensor, expected_group_size: int | None) -> None:
    if expected_group_size is None:
        return
    bad = count != expected_group_size
    if bad.any():
        sizes = sorted({int(c) for c in count[bad].tolist()})
        raise ValueError(
            f"expected every group to have {expected_group_size} samples, found groups of "
            f"size {sizes}; pass expected_group_size=None to accept partial groups"
        )


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten `values` with the mean and unbiased variance of the masked entries.

    Args:
        values: `[B, L]` values.
        mask: `[B, L]` 0/1 mask; statistics use only entries where mask is 1.
        eps: Added to the variance before the square root.

    Returns:
        `[B, L]` whitened values, zeroed where mask is 0.

    Raises:
        ValueError: If fewer than two entries are masked in (variance undefined).
    """
    n = mask.sum()
    if n < 2:
        raise ValueError("whitening needs at least two loss-mask tokens in the batch")
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / (n - 1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def discounted_returns(
    rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted return of an outcome reward over the policy tokens of each sample.

    The reward sits on the last token with mask 1; each earlier policy token gets it
    discounted once per policy token between them. Tokens with mask 0 (tool and user
    turns) neither discount nor reset the return, so early turns of a multi-turn episode
    still see the final reward (verl resets the running return at masked tokens instead).

    Args:
        rewards: `[B]` outcome rewards.
        loss_mask: `[B, L]` 0/1 float mask.
        gamma: Discount factor in [0, 1].

    Returns:
        `[B, L]` returns, 0 where mask is 0.
    """
    # Number of policy tokens strictly after each token: total - inclusive cumsum.
    after = loss_mask.sum(dim=1, keepdim=True) - loss_mask.cumsum(dim=1)  # [B, L]
    return rewards[:, None] * torch.pow(torch.full_like(after, gamma), after) * loss_mask


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: GroupIds,
    method: AdvantageMethod = "grpo",
    loss_mask: torch.Tensor | None = None,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    gamma: float = 1.0,
    expected_group_size: int | None = None,
) -> torch.Tensor:
    """Advantages from per-sample rewards and group ids.

    Args:
        rewards: `[B]` one scalar reward per sample.
        group_ids: `[B]` group id per sample (int tensor or sequence of hashables), any order.
        method: One of `ADVANTAGE_METHODS` (see the module docstring).
        loss_mask: `[B, L]` 0/1 mask of policy tokens. When given the result is broadcast to
            tokens `[B, L]` (0 off the mask); required by the REINFORCE++ estimators.
        norm_by_std: `grpo` only: divide by the group std (`scale_rewards` in TRL).
        eps: Added to the std before dividing (1e-6 as verl).
        gamma: `reinforce_plus_plus` only: discount per policy token.
        expected_group_size: If set, raise when a group has a different number of samples;
            `None` accepts uneven/partial groups (statistics from the members present).

    Returns:
        `[B]` advantages, or `[B, L]` token advantages when `loss_mask` is given.

    Raises:
        ValueError: On an unknown method, bad shapes, non-finite rewards, a partial group
            when `expected_group_size` is set, or a REINFORCE++ call without `loss_mask`.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"unknown advantage method {method!r}; choose one of {ADVANTAGE_METHODS}")
    rewards, mask = _check_inputs(rewards, loss_mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    index, num_groups = group_index(group_ids, rewards.shape[0])
    if rewards.numel() == 0:
        return rewards.new_zeros(rewards.shape if mask is None else mask.shape)
    count, mean, std = group_mean_std(rewards, index, num_groups)
    _check_group_sizes(count, expected_group_size)
    single = count < 2

    if method in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        if mask is None:
            raise ValueError(f"{method} whitens over tokens and needs loss_mask [B, L]")
        if method == "reinforce_plus_plus":
            return masked_whiten(discounted_returns(rewards, mask, gamma), mask)
        centred = torch.where(single, torch.zeros_like(rewards), rewards - mean)
        return masked_whiten(centred[:, None] * mask, mask)

    if method == "rloo":
        # Mean of the others: (n * mean - r) / (n - 1); r minus that = n/(n-1) * (r - mean).
        adv = count / (count - 1).clamp(min=1) * (rewards - mean)
    elif method in ("grpo", "gspo") and norm_by_std:
        adv = (rewards - mean) / (std + eps)
    else:  # dr_grpo, or grpo/gspo without std
        adv = rewards - mean
    adv = torch.where(single, torch.zeros_like(adv), adv)
    return adv if mask is None else adv[:, None] * mask
