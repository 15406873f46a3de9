"""Clipped policy-gradient losses (PPO/GRPO, dual clip, GSPO) and off-policy correction.

PPO clip with token ratio r = exp(logp - old_logp) (log-ratio clamped to ±20 before exp):

    loss = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high))

asymmetric clipping as DAPO ("clip-higher", 0.2 / 0.28). Dual clip (Ye et al. 2020) bounds
the loss of negative-advantage tokens by -A * c for a constant c > 1: for A < 0 the loss is
min(loss, -A * c). GSPO (Zheng et al. 2025) replaces the token ratio with the sequence's
length-normalised (geometric-mean) ratio s = exp(mean_t(logp - old_logp)) and keeps a
token-level gradient: s_t = sg(s) * exp(logp_t - sg(logp_t)), so every token of a
sequence is clipped together. Sequence ratios sit much closer to 1 than token ratios, so
GSPO uses far smaller clip ranges (the paper: 3e-4 / 4e-4); pass them explicitly.

Truncated importance sampling (TIS, as verl / slime) corrects for the rollout engine's
log-probs differing from the trainer's: each token's loss is multiplied by the constant
clip(exp(old_logp - rollout_logp), tis_low, tis_cap).

All functions return the per-token loss matrix `[B, L]` (reduce it with `aggregate_loss`)
and a dict of detached scalar metrics (local masked means over this micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from turnrl.grpo_core.algos.aggregation import masked_mean

PolicyLossVariant = Literal["ppo", "gspo"]

LOG_RATIO_CLAMP = 20.0
"""Default bound on the token log-ratio before `exp`."""
GSPO_LOG_RATIO_MAX = 10.0
"""Upper bound on the GSPO sequence log-ratio before `exp` (as verl)."""


@dataclass
class PolicyLossOutput:
    """Per-token policy loss and its metrics."""

    loss_mat: torch.Tensor
    """`[B, L]` per-token loss, not yet masked or reduced (use `aggregate_loss`)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached 0-dim tensors: `clip_frac`, `clip_frac_lower` (dual clip), `approx_kl`,
    `ratio_mean`, and `tis_weight_mean` / `tis_clip_frac` when TIS is on."""


def _check(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp and mask must all be [B, L]; got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if adv.dim() == 1 and adv.shape[0] == logp.shape[0]:
        adv = adv[:, None].expand_as(logp)
    if adv.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, L]; got {tuple(adv.shape)}")
    return adv.detach()


def _check_clip(eps_clip: float, eps_clip_high: float, dual_clip_c: float | None) -> None:
    if not 0 <= eps_clip < 1 or eps_clip_high < 0:
        raise ValueError(
            f"need 0 <= eps_clip < 1 and eps_clip_high >= 0, got {eps_clip}, {eps_clip_high}"
        )
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    variant: PolicyLossVariant = "ppo",
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    dual_clip_c: float | None = 3.0,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    tis_low: float = 0.0,
) -> PolicyLossOutput:
    """Clipped surrogate policy loss per token.

    Args:
        logp: `[B, L]` log-probs of the sampled tokens under the policy being trained.
        old_logp: `[B, L]` log-probs under the policy that the advantages belong to (the
            trainer's recompute of the rollout policy; `logp.detach()` when on-policy).
        advantages: `[B]` or `[B, L]` advantages (treated as constants).
        mask: `[B, L]` 0/1 loss mask (used for metrics; the loss matrix is unmasked).
        variant: `ppo` (token ratio) or `gspo` (sequence ratio, see module docstring).
        eps_clip: Lower clip range: the ratio is clipped below at 1 - eps_clip.
        eps_clip_high: Upper clip range: the ratio is clipped above at 1 + eps_clip_high.
        dual_clip_c: Dual-clip constant (> 1) for negative advantages; `None` disables it.
            Ignored by `gspo`.
        log_ratio_clamp: The token log-ratio is clamped to ±this before `exp`.
        rollout_logp: `[B, L]` log-probs from the rollout engine; with `tis_cap`, turns on
            truncated importance sampling.
        tis_cap: TIS weight cap (e.g. 2.0); `None` disables TIS.
        tis_low: Lower clip of the TIS weight (0: none).

    Returns:
        `PolicyLossOutput` with the `[B, L]` loss matrix and metrics.

    Raises:
        ValueError: On bad shapes, clip ranges, an unknown variant, or `tis_cap` without
            `rollout_logp`.
    """
    adv = _check(logp, old_logp, advantages, mask)
    _check_clip(eps_clip, eps_clip_high, dual_clip_c)
    mask = mask.to(logp.dtype)
    raw_log_ratio = logp - old_logp.detach()
    log_ratio = raw_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    metrics = {"approx_kl": masked_mean(-log_ratio, mask).detach()}
    if variant == "ppo":
        ratio = log_ratio.exp()
    elif variant == "gspo":
        lengths = mask.sum(dim=-1).clamp(min=1)
        seq_log_ratio = (raw_log_ratio * mask).sum(dim=-1) / lengths  # [B], clamped below
        token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]
        ratio = token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX).exp()
        dual_clip_c = None
    else:
        raise ValueError(f"unknown policy loss variant {variant!r}; choose 'ppo' or 'gspo'")
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics["clip_frac"] = masked_mean((clipped > unclipped).to(mask.dtype), mask).detach()
    metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c
        lower = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        metrics["clip_frac_lower"] = masked_mean(lower.to(mask.dtype), mask).detach()
    if tis_cap is not None:
        if rollout_logp is None:
            raise ValueError("tis_cap needs rollout_logp (the engine's log-probs)")
        weight, tis_metrics = truncated_is_weights(old_logp, rollout_logp, mask, tis_cap, tis_low)
        loss = loss * weight
        metrics.update(tis_metrics)
    return PolicyLossOutput(loss_mat=loss, metrics=metrics)


def truncated_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
    low: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance-sampling weights clip(pi_train / pi_rollout, low, cap), detached
    (slime's `vanilla_tis_function`).

    Args:
        old_logp: `[B, L]` trainer log-probs of the rollout policy's tokens.
        rollout_logp: `[B, L]` rollout-engine log-probs of the same tokens.
        mask: `[B, L]` 0/1 loss mask (metrics only).
        cap: Upper bound on the weight (> 0).
        low: Lower bound on the weight (0 <= low <= cap).

    Returns:
        `(weights [B, L], metrics)` with `tis_weight_mean` and `tis_clip_frac`.

    Raises:
        ValueError: On a non-positive cap, a lower bound outside [0, cap] or mismatched
            shapes.
    """
    if cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {cap}")
    if not 0 <= low <= cap:
        raise ValueError(f"the TIS lower clip must be in [0, {cap}], got {low}")
    if rollout_logp.shape != old_logp.shape:
        raise ValueError(
            f"rollout_logp {tuple(rollout_logp.shape)} != old_logp {tuple(old_logp.shape)}"
        )
    with torch.no_grad():
        log_w = (old_logp - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        raw = log_w.exp()
        weight = raw.clamp(min=low, max=cap)
        mask = mask.to(weight.dtype)
        metrics = {
            "tis_weight_mean": masked_mean(weight, mask),
            "tis_clip_frac": masked_mean((weight != raw).to(weight.dtype), mask),
        }
    return weight, metrics


def rollout_mismatch_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the rollout engine's, on the loss tokens.

    Args:
        train_logp: `[B, L]` trainer log-probs of the sampled tokens.
        rollout_logp: `[B, L]` rollout-engine log-probs of the same tokens.
        mask: `[B, L]` 0/1 loss mask.

    Returns:
        Detached scalars: `mismatch_abs_diff` (mean |train - rollout|), `mismatch_kl_k1`
        and `mismatch_kl_k3` (estimates of KL(rollout || train) from the rollout's samples),
        `mismatch_ratio_mean` / `_min` / `_max` / `_std` of pi_train / pi_rollout.

    Raises:
        ValueError: On mismatched shapes.
    """
    if train_logp.shape != rollout_logp.shape or mask.shape != train_logp.shape:
        raise ValueError("train_logp, rollout_logp and mask must have the same [B, L] shape")
    with torch.no_grad():
        mask = mask.to(torch.float32)
        delta = (train_logp.float() - rollout_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = delta.exp()
        on = mask > 0
        picked = ratio[on] if on.any() else ratio.new_ones(1)
        return {
            "mismatch_abs_diff": masked_mean(delta.abs(), mask),
            "mismatch_kl_k1": masked_mean(-delta, mask),
            "mismatch_kl_k3": masked_mean(ratio - 1 - delta, mask),
            "mismatch_ratio_mean": picked.mean(),
            "mismatch_ratio_min": picked.min(),
            "mismatch_ratio_max": picked.max(),
            "mismatch_ratio_std": picked.std() if picked.numel() > 1 else picked.new_zeros(()),
        }
