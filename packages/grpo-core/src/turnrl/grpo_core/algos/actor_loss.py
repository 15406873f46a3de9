"""The full actor loss of one micro-batch: policy loss + KL loss - entropy bonus.

    loss = agg(pg_loss) + kl_loss_coef * agg(kl(logp, ref_logp)) - entropy_coef * agg(entropy)

each term aggregated with the same mode and the same global counts, so micro-batches
and ranks add up exactly to the mini-batch loss (see `aggregation`). Flag names follow
slime; the defaults are verl's (clip 0.2 / 0.28, dual clip 3, low_var_kl, token-mean).
The apps' command line starts from slime's instead (`recipe.schema.AppConfig.loss`: no
dual clip unless `--eps-clip-c`, a per-sample mean unless `--calculate-per-token-loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import torch

from turnrl.grpo_core.algos.aggregation import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate_loss,
    masked_mean,
)
from turnrl.grpo_core.algos.kl import KL_KINDS, KLKind, kl_penalty
from turnrl.grpo_core.algos.policy_loss import PolicyLossVariant, policy_loss
from turnrl.grpo_core.settings import Switch, setting

PER_TOKEN_LOSS = Switch(on="token-mean", off="seq-mean-token-mean")
"""``--calculate-per-token-loss``: the mean over all loss tokens of the batch;
``--no-calculate-per-token-loss``: slime's default, the mean over samples of each one's
token mean."""


@dataclass
class ActorLossConfig:
    """Hyper-parameters of the actor loss (slime flag in brackets)."""

    policy_loss: PolicyLossVariant = "ppo"
    """`ppo` (token ratio) or `gspo` (sequence ratio)."""
    eps_clip: float = setting(0.2, "--eps-clip")
    """Lower clip range of the ratio."""
    eps_clip_high: float = setting(0.28, "--eps-clip-high")
    """Upper clip range of the ratio."""
    dual_clip_c: float | None = setting(3.0, "--eps-clip-c")
    """Dual-clip constant (> 1) for negative advantages; None disables."""
    use_kl_loss: bool = setting(False, "--use-kl-loss")
    """Add the KL-to-reference loss term; needs `ref_logp`."""
    kl_loss_coef: float = setting(0.0, "--kl-loss-coef")
    """Weight of the KL loss term."""
    kl_loss_type: KLKind = setting("low_var_kl", "--kl-loss-type")
    """KL estimator of the loss term."""
    entropy_coef: float = setting(0.0, "--entropy-coef")
    """Weight of the entropy bonus; needs `entropy`."""
    loss_agg_mode: AggregationMode = setting(
        "token-mean", ("--loss-agg-mode", str), ("--calculate-per-token-loss", PER_TOKEN_LOSS)
    )
    """How token losses are reduced (see `aggregate_loss`): `token-mean` is slime's
    `--calculate-per-token-loss`, `seq-mean-token-mean` slime's default."""
    norm_length: float | None = None
    """Constant length for `seq-mean-token-sum-norm`."""
    use_tis: bool = setting(False, "--use-tis")
    """Weight each token's policy loss by truncated importance sampling, the trainer's over
    the rollout engine's probability clipped to [`tis_clip_low`, `tis_clip`]."""
    tis_clip: float = setting(2.0, "--tis-clip")
    """Upper clip of the TIS weight."""
    tis_clip_low: float = setting(0.0, "--tis-clip-low")
    """Lower clip of the TIS weight; 0 leaves it unclipped below."""

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("policy_loss", self.policy_loss, get_args(PolicyLossVariant)),
            ("kl_loss_type", self.kl_loss_type, KL_KINDS),
            ("loss_agg_mode", self.loss_agg_mode, AGGREGATION_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"--eps-clip-c (dual_clip_c) must be > 1, got {self.dual_clip_c}")
        if not 0 <= self.tis_clip_low <= self.tis_clip or self.tis_clip <= 0:
            raise ValueError(
                "--tis-clip-low and --tis-clip must satisfy 0 <= low <= clip and clip > 0, got "
                f"{self.tis_clip_low} and {self.tis_clip}"
            )

    @property
    def tis_cap(self) -> float | None:
        """The TIS weight's upper clip in force: `tis_clip` under `use_tis`, else None."""
        return self.tis_clip if self.use_tis else None


@dataclass
class ActorLossOutput:
    """The scalar to backpropagate and detached metrics."""

    loss: torch.Tensor
    """This micro-batch's share of the mini-batch loss."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached scalars: `pg_loss`, `kl_loss`, `entropy`, plus the policy-loss metrics."""


def actor_loss(
    config: ActorLossConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    dp_size: int = 1,
) -> ActorLossOutput:
    """Combine policy, KL and entropy terms for one micro-batch.

    Args:
        config: Loss hyper-parameters.
        logp: `[B, L]` current log-probs (with grad).
        old_logp: `[B, L]` log-probs of the behaviour policy as recomputed by the trainer.
        advantages: `[B]` or `[B, L]` advantages.
        mask: `[B, L]` loss mask.
        ref_logp: `[B, L]` reference log-probs (required when `use_kl_loss`).
        entropy: `[B, L]` per-token entropy with grad (required when `entropy_coef != 0`).
        rollout_logp: `[B, L]` engine log-probs (required under `use_tis`).
        global_num_tokens: See `aggregate_loss`.
        global_num_seqs: See `aggregate_loss`.
        dp_size: See `aggregate_loss`.

    Returns:
        `ActorLossOutput`.

    Raises:
        ValueError: When a term is enabled without its input, or on any error of the parts.
    """

    def agg(mat: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(
            mat,
            mask,
            config.loss_agg_mode,
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
            dp_size=dp_size,
            norm_length=config.norm_length,
        )

    pg = policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        variant=config.policy_loss,
        eps_clip=config.eps_clip,
        eps_clip_high=config.eps_clip_high,
        dual_clip_c=config.dual_clip_c,
        rollout_logp=rollout_logp,
        tis_cap=config.tis_cap,
        tis_low=config.tis_clip_low,
    )
    loss = agg(pg.loss_mat)
    metrics = dict(pg.metrics)
    metrics["pg_loss"] = loss.detach()
    if config.use_kl_loss:
        if ref_logp is None:
            raise ValueError("use_kl_loss needs ref_logp (the reference model's log-probs)")
        kl = kl_penalty(logp, ref_logp, config.kl_loss_type)
        kl_loss = agg(kl)
        loss = loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if config.entropy_coef != 0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy")
        ent = agg(entropy)
        loss = loss - config.entropy_coef * ent
        metrics["entropy"] = ent.detach()
    elif entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), mask.to(entropy.dtype))
    return ActorLossOutput(loss=loss, metrics=metrics)
