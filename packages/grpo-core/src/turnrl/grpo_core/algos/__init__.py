"""GRPO-family algorithms as pure torch functions (no device code).

- advantages: `compute_advantages` (grpo, dr_grpo, gspo, rloo, reinforce_plus_plus[_baseline])
- policy loss: `policy_loss` (PPO clip, asymmetric + dual clip, GSPO, TIS),
  `rollout_mismatch_metrics`, `truncated_is_weights`
- KL and entropy: `kl_penalty`, `kl_in_reward`, `entropy_from_logits`
- aggregation: `aggregate_loss` (token-mean exact across micro-batches and ranks, seq-mean-*)
- combined actor loss: `actor_loss` with `ActorLossConfig`
- `chunked_logprobs`: log-probs/entropy from hidden states without `[N, V]` logits
- `pack_micro_batches`: token-budget micro-batches balanced across data-parallel ranks
"""

from turnrl.grpo_core.algos.actor_loss import ActorLossConfig, ActorLossOutput, actor_loss
from turnrl.grpo_core.algos.advantages import (
    ADVANTAGE_METHODS,
    AdvantageMethod,
    compute_advantages,
    discounted_returns,
    group_index,
    masked_whiten,
)
from turnrl.grpo_core.algos.aggregation import (
    AGGREGATION_MODES,
    AggregationMode,
    aggregate_loss,
    count_loss_tokens_and_seqs,
    masked_mean,
    masked_sum,
)
from turnrl.grpo_core.algos.kl import (
    KL_KINDS,
    KLKind,
    entropy_from_logits,
    kl_in_reward,
    kl_penalty,
)
from turnrl.grpo_core.algos.logprobs import IGNORE_INDEX, chunked_logprobs, naive_logprobs
from turnrl.grpo_core.algos.packing import PackingPlan, pack_micro_batches
from turnrl.grpo_core.algos.policy_loss import (
    PolicyLossOutput,
    PolicyLossVariant,
    policy_loss,
    rollout_mismatch_metrics,
    truncated_is_weights,
)

__all__ = [
    "ADVANTAGE_METHODS",
    "AGGREGATION_MODES",
    "IGNORE_INDEX",
    "KL_KINDS",
    "ActorLossConfig",
    "ActorLossOutput",
    "AdvantageMethod",
    "AggregationMode",
    "KLKind",
    "PackingPlan",
    "PolicyLossOutput",
    "PolicyLossVariant",
    "actor_loss",
    "aggregate_loss",
    "chunked_logprobs",
    "compute_advantages",
    "count_loss_tokens_and_seqs",
    "discounted_returns",
    "entropy_from_logits",
    "group_index",
    "kl_in_reward",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "naive_logprobs",
    "pack_micro_batches",
    "policy_loss",
    "rollout_mismatch_metrics",
    "truncated_is_weights",
]
