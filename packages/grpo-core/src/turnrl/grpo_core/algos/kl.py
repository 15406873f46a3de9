"""KL estimators between the policy and a reference policy, and the entropy of logits.

Per-token estimators of KL(pi || pi_ref) from the log-probs of the sampled tokens
(Schulman's "Approximating KL divergence"), with `delta = logp - ref_logp`:

- `k1` (alias `kl`): delta — unbiased, high variance, can be negative.
- `abs`: |delta|.
- `k2` (alias `mse`): 0.5 * delta**2.
- `k3` (alias `low_var_kl`): exp(-delta) - 1 + delta, with -delta clamped to [-20, 20] before
  the exp and the result clamped to [-10, 10] (as verl and slime do), unbiased, always >= 0.

They are used either as a loss term (`kl_loss_coef * aggregate_loss(kl, ...)`) or folded
into the reward (`kl_in_reward`).
"""

from __future__ import annotations

from typing import Literal

import torch

KLKind = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
KL_KINDS: tuple[str, ...] = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
"""Bound on the log-ratio before `exp` in k3."""
LOW_VAR_KL_CLAMP = 10.0
"""Bound on the k3 value itself."""


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    Args:
        logp: `[B, L]` log-probs of the sampled tokens under the current policy.
        ref_logp: `[B, L]` log-probs of the same tokens under the reference policy.
        kind: One of `KL_KINDS` (see the module docstring).

    Returns:
        `[B, L]` KL estimate per token (differentiable wrt `logp`).

    Raises:
        ValueError: On an unknown kind or mismatched shapes.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    if kind in ("k3", "low_var_kl"):
        return _low_var_kl(logp, ref_logp)
    delta = logp - ref_logp
    if kind in ("k1", "kl"):
        return delta
    if kind == "abs":
        return delta.abs()
    if kind in ("k2", "mse"):
        return 0.5 * delta.square()
    raise ValueError(f"unknown KL kind {kind!r}; choose one of {KL_KINDS}")


def _low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_logp - logp).clamp(-LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
    if torch.is_grad_enabled() and log_ratio.requires_grad:
        return (log_ratio.exp() - log_ratio - 1).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    # No autograd graph: reuse the buffers (same values, fewer allocations).
    out = log_ratio.exp()
    return out.sub_(log_ratio).sub_(1).clamp_(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def kl_in_reward(
    rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    kl_coef: float,
    kind: KLKind = "k1",
) -> torch.Tensor:
    """Fold a KL penalty into outcome rewards: r - kl_coef * sum of token KL over the mask.

    Args:
        rewards: `[B]` outcome rewards.
        logp: `[B, L]` rollout (or old-policy) log-probs of the sampled tokens.
        ref_logp: `[B, L]` reference log-probs.
        loss_mask: `[B, L]` 0/1 mask of policy tokens.
        kl_coef: Penalty coefficient (>= 0).
        kind: KL estimator (`k1` as verl's in-reward default).

    Returns:
        `[B]` penalised rewards (no gradient: rewards are constants for the loss).

    Raises:
        ValueError: On a negative coefficient or mismatched shapes.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if rewards.dim() != 1 or loss_mask.shape != logp.shape or rewards.shape[0] != logp.shape[0]:
        raise ValueError(
            f"expected rewards [B] and logp/ref_logp/loss_mask [B, L]; got {tuple(rewards.shape)}, "
            f"{tuple(logp.shape)}, {tuple(loss_mask.shape)}"
        )
    with torch.no_grad():
        kl = kl_penalty(logp, ref_logp, kind) * loss_mask
        return rewards - kl_coef * kl.sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by the last dimension of `logits`.

    Computed in fp32 as logsumexp(z) - sum(softmax(z) * z).

    Args:
        logits: `[..., V]` logits (any float dtype).

    Returns:
        `[...]` entropy in nats, fp32.
    """
    z = logits.float()
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)
