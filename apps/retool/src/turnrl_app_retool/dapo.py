"""DAPO in the ReTool app's RL stage: the dynamic sampling filter and overlong reward shaping.

Both are DAPO's (and verl's ``recipe/dapo``) and both are switched by the RL config:

- **Overlong shaping** (``rl.overlong_buffer_len > 0``): every training sample's reward gets
  :func:`turnrl.rewards.overlong.overlong_penalty_from_mask` added — zero up to
  ``max_response_length - overlong_buffer_len`` model tokens, then a linear ramp to
  ``-overlong_penalty_factor`` at ``max_response_length``. Only tokens the policy wrote count
  (the interpreter's output does not).
- **Dynamic sampling** (``rl.dynamic_sampling``): :func:`collect_informative` generates rounds
  of ``gen_batch_size`` prompts x ``n`` samples through ``GRPOLoop.collect`` and feeds them to
  :class:`turnrl.grpo_core.algos.dynamic_sampling.DynamicSampler`, which drops every group
  whose filter metric (``acc``: correctness, or ``reward``) is the same for all its samples —
  such a group has zero GRPO advantage — until ``rollout_batch_size`` informative groups are
  kept; the first of them are trained on. verl stops the run when
  ``max_num_gen_batches`` rounds are not enough; a CPU run should not die at step 20 for an
  unlucky batch, so here the step trains on the informative groups it has (all groups when
  none) and the metrics say ``rollout/dynamic_sampling/exhausted = 1``.

Every step logs how many groups were generated, kept and filtered (:func:`group_stats`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from turnrl.grpo_core.algos.dynamic_sampling import DynamicSampler
from turnrl.rewards.overlong import OverlongConfig, overlong_penalty_from_mask
from turnrl_app_retool.config import FILTER_METRICS, RLStageConfig


def overlong_config(rl: RLStageConfig) -> OverlongConfig | None:
    """The overlong penalty settings of ``rl``; None when shaping is off (buffer 0)."""
    if rl.overlong_buffer_len <= 0:
        return None
    return OverlongConfig(
        max_len=rl.max_response_length,
        buffer_len=rl.overlong_buffer_len,
        penalty_factor=rl.overlong_penalty_factor,
    )


def shaped_rewards(samples: Sequence[Any], config: OverlongConfig | None) -> list[float]:
    """Each sample's reward plus its overlong penalty (recorded as ``reward_breakdown["overlong"]``).

    Args:
        samples: Scored trajectories (``reward``, ``loss_mask``, ``reward_breakdown``).
        config: Overlong settings; None returns the rewards unchanged.
    """
    out = []
    for sample in samples:
        penalty = (
            0.0 if config is None else overlong_penalty_from_mask(sample.loss_mask, config).reward
        )
        sample.reward_breakdown["overlong"] = penalty
        out.append(float(sample.reward) + penalty)
    return out


def filter_values(samples: Sequence[Any], metric: str) -> list[float]:
    """The per-sample values the filter compares: correctness (``acc``) or the reward.

    Raises:
        ValueError: unknown ``metric``.
    """
    if metric == "acc":
        return [float(s.reward_breakdown.get("correct", 0.0)) for s in samples]
    if metric == "reward":
        return [float(s.reward) for s in samples]
    raise ValueError(f"filter metric must be one of {FILTER_METRICS}, got {metric!r}")


def group_stats(samples: Sequence[Any], metric: str) -> dict[str, float]:
    """Step scalars over every generated sample: groups generated, informative groups, accuracy."""
    values: dict[Any, list[float]] = {}
    for sample, value in zip(samples, filter_values(samples, metric), strict=True):
        values.setdefault(sample.group_id, []).append(value)
    varied = sum(1 for v in values.values() if len(v) > 1 and max(v) > min(v))
    correct = [float(s.reward_breakdown.get("correct", 0.0)) for s in samples]
    return {
        "rollout/dynamic_sampling/generated_groups": float(len(values)),
        "rollout/dynamic_sampling/informative_groups": float(varied),
        "rollout/dynamic_sampling/filtered_groups": float(len(values) - varied),
        "rollout/acc_mean_all": sum(correct) / len(correct) if correct else 0.0,
        "rollout/reward_mean_all": sum(float(s.reward) for s in samples) / max(1, len(samples)),
        "rollout/overlong_frac": sum(
            float(s.reward_breakdown.get("overlong", 0.0) < 0) for s in samples
        )
        / max(1, len(samples)),
    }


async def collect_informative(
    loop: Any, rl: RLStageConfig
) -> tuple[list[Any], float, dict[str, float]]:
    """One step's training samples with DAPO's dynamic sampling.

    Args:
        loop: A ``GRPOLoop`` (its ``data.next`` and ``collect`` are used); its generate hook
            must give every call's groups fresh ids.
        rl: The RL config (batch sizes, filter metric, ``max_num_gen_batches``).

    Returns:
        The kept samples (``rollout_batch_size`` groups when enough were found), the rollout
        seconds of every round together, and the step's filter scalars.
    """
    target, gen_batch = rl.rollout_batch_size, rl.gen_batch_size or rl.rollout_batch_size
    sampler = DynamicSampler(
        target, max_tries=rl.max_num_gen_batches, group_size=rl.n_samples_per_prompt
    )
    pool: list[Any] = []
    exhausted = False
    start = time.perf_counter()
    while True:
        samples, _ = await loop.collect(loop.data.next(gen_batch))
        pool.extend(samples)
        try:
            if not sampler.add(
                filter_values(samples, rl.filter_metric), [s.group_id for s in samples]
            ).need_more:
                break
        except RuntimeError:  # max_num_gen_batches rounds and still short of the target
            exhausted = True
            break
    seconds = time.perf_counter() - start
    keep = set(sampler.selected_groups())
    if not keep:  # nothing informative at all: train on the first groups (zero advantage)
        keep = set(list(dict.fromkeys(s.group_id for s in pool))[:target])
    kept = [s for s in pool if s.group_id in keep]
    stats = group_stats(pool, rl.filter_metric)
    stats.update(
        {
            "rollout/dynamic_sampling/gen_batches": float(sampler.tries),
            "rollout/dynamic_sampling/kept_groups": float(len(keep)),
            "rollout/dynamic_sampling/exhausted": float(exhausted),
        }
    )
    return kept, seconds, stats
