"""DAPO on scored episodes: overlong reward shaping, and what the dynamic sampling filter
compares (DAPO's, and verl's ``recipe/dapo``).

- **Overlong shaping** (an :class:`~turnrl.rewards.overlong.OverlongConfig`): every sample's
  reward gets :func:`turnrl.rewards.overlong.overlong_penalty_from_mask` added — zero up to
  ``max_len - buffer_len`` model tokens, then a linear ramp to ``-penalty_factor`` at
  ``max_len``. Only tokens the policy wrote count (tool output does not).
- **Dynamic sampling** is grpo-core's ``RolloutManager`` filter:
  groups whose :func:`filter_value` (``acc``: correctness, or ``reward``) is the same for
  every sample carry zero GRPO advantage and are dropped, and rounds of ``gen_batch_size``
  more prompts run until ``rollout_batch_size`` groups vary. verl stops the run when
  ``max_num_gen_batches`` rounds are not enough; a CPU run should not die at step 20 for an
  unlucky batch, so here the step trains on the groups that vary (the first groups when
  none does) and logs ``rollout/filter_exhausted = 1``.

:class:`StepStats` counts every generated sample of a step, the filtered groups' included
(the manager counts the groups: ``rollout/groups_uniform``, ``groups_filtered``).

It lives with ReTool, not beside the manager's filter in grpo-core: ``acc`` is the
``reward_breakdown["correct"]`` that :mod:`.episodes` writes, and the shaping is
``turnrl.rewards``', which grpo-core may not import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.rewards.overlong import OverlongConfig, overlong_penalty_from_mask

FILTER_METRICS = ("acc", "reward")
"""What the dynamic sampling filter may compare inside a group (verl: ``filter_groups.metric``)."""


@dataclass
class DapoConfig:
    """DAPO's switches (verl's ``algorithm.filter_groups`` and ``reward_model.overlong_buffer``)."""

    dynamic_sampling: bool = field(
        default=False, metadata={"flags": (("--dynamic-sampling", "bool"),)}
    )
    """Drop groups whose ``filter_metric`` is equal for every sample and generate more until
    ``rollout_batch_size`` groups are kept."""
    filter_metric: str = field(default="acc", metadata={"flags": (("--filter-metric", str),)})
    """What the filter compares in a group: ``acc`` (correct or not) or ``reward``."""
    gen_batch_size: int | None = field(
        default=None, metadata={"flags": (("--gen-batch-size", int),)}
    )
    """Prompts per generation round under dynamic sampling; None: ``rollout_batch_size``
    (verl's ``data.gen_batch_size``)."""
    max_num_gen_batches: int = field(
        default=10, metadata={"flags": (("--max-num-gen-batches", int),)}
    )
    """Most generation rounds per step under dynamic sampling; after them the step trains on
    the informative groups it found."""
    overlong_buffer_len: int = field(
        default=0, metadata={"flags": (("--overlong-buffer-len", int),)}
    )
    """Overlong shaping: penalise model tokens past the longest response minus this, linearly
    to ``-overlong_penalty_factor``; 0 turns it off."""
    overlong_penalty_factor: float = field(
        default=1.0, metadata={"flags": (("--overlong-penalty-factor", float),)}
    )
    """Overlong penalty at the longest response."""

    def __post_init__(self) -> None:
        if self.filter_metric not in FILTER_METRICS:
            raise ValueError(
                f"rl.filter_metric must be one of {FILTER_METRICS}, got {self.filter_metric!r}"
            )
        if self.gen_batch_size is not None and self.gen_batch_size < 1:
            raise ValueError(f"rl.gen_batch_size must be >= 1, got {self.gen_batch_size}")
        if self.max_num_gen_batches < 1:
            raise ValueError(f"rl.max_num_gen_batches must be >= 1, got {self.max_num_gen_batches}")
        if self.overlong_buffer_len < 0 or self.overlong_penalty_factor < 0:
            raise ValueError(
                "rl.overlong_buffer_len and rl.overlong_penalty_factor must be >= 0, got "
                f"{self.overlong_buffer_len} and {self.overlong_penalty_factor}"
            )

    def check_loop(self, n_samples_per_prompt: int, asynchronous: bool, max_response: int) -> None:
        """Check the switches against the RL loop they run in (its group size, whether it is
        asynchronous) and the longest response (``max_response`` tokens).

        Raises:
            ValueError: a switch the loop cannot honour, naming the flag to change.
        """
        if self.dynamic_sampling and asynchronous:
            raise ValueError(
                "--async with --dynamic-sampling: the asynchronous loop generates one group "
                "at a time, so DAPO's filter cannot draw more groups within a step; add "
                "--no-dynamic-sampling"
            )
        if self.dynamic_sampling and n_samples_per_prompt < 2:
            raise ValueError(
                "dynamic sampling needs n_samples_per_prompt >= 2 (a group's variance)"
            )
        if self.overlong_buffer_len > max_response:
            raise ValueError(
                f"rl.overlong_buffer_len must be in [0, max_response_length={max_response}], "
                f"got {self.overlong_buffer_len}"
            )


def overlong_config(max_len: int, buffer_len: int, penalty_factor: float) -> OverlongConfig | None:
    """The overlong penalty settings; None when shaping is off (``buffer_len`` 0)."""
    if buffer_len <= 0:
        return None
    return OverlongConfig(max_len=max_len, buffer_len=buffer_len, penalty_factor=penalty_factor)


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


def group_reward(overlong: OverlongConfig | None, stats: StepStats) -> Callable[[list[Any]], Any]:
    """A ``RolloutManager`` group reward: the reward each episode was scored with plus the
    overlong penalty, each group's samples counted in ``stats``."""

    async def reward(group: list[Any]) -> list[float]:
        for sample, value in zip(group, shaped_rewards(group, overlong), strict=True):
            sample.reward = value
        stats.add(group)
        return [sample.reward for sample in group]

    return reward


def filter_value(metric: str) -> Callable[[Any], float]:
    """What the filter compares per sample: correctness (``acc``) or the reward.

    Raises:
        ValueError: unknown ``metric``.
    """
    if metric == "acc":
        return lambda sample: float(sample.reward_breakdown.get("correct", 0.0))
    if metric == "reward":
        return lambda sample: float(sample.reward)
    raise ValueError(f"filter metric must be one of {FILTER_METRICS}, got {metric!r}")


class StepStats:
    """Every scored sample of a step, those of groups the filter drops included: accuracy,
    reward and overlong fraction."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.overlong = 0
        self.correct: list[float] = []
        self.rewards: list[float] = []

    def add(self, group: Sequence[Any]) -> None:
        """Count one group's samples, their rewards set."""
        self.correct += [float(s.reward_breakdown.get("correct", 0.0)) for s in group]
        self.rewards += [float(s.reward) for s in group]
        self.overlong += sum(s.reward_breakdown.get("overlong", 0.0) < 0 for s in group)

    def take(self) -> dict[str, float]:
        """The step's scalars; the count starts again for the next step."""
        n = max(1, len(self.rewards))
        out = {
            "rollout/acc_mean_all": sum(self.correct) / n,
            "rollout/reward_mean_all": sum(self.rewards) / n,
            "rollout/overlong_frac": self.overlong / n,
        }
        self._reset()
        return out
