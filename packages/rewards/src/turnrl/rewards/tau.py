"""tau-bench's episode reward, with the optional shaping and group normalisation of vime.

The rule (tau-bench `calculate_reward`, see `shared/tau-bench/SPEC.md` §6.2): the reward is
1.0 when the database hash after the agent's episode equals the hash after replaying the
task's gold actions on a fresh database, **and** every required output string `o` appears
in at least one of the agent's messages to the user, tested as `o.lower()` being a substring
of `message.lower()` with every `,` removed from the message (never from `o`, and no other
normalisation). Otherwise 0.0. The hashes come from the environment (turnrl-tool-envs); this
module only compares them.

Shaping (vime's tau-bench example, off by default): the 0/1 reward plus 0.1 per successful
tool call plus 0.05 per well-formed tool call, capped at 1.5; `normalize_by_group_max` then
divides each reward of a GRPO group by the group's maximum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from turnrl.rewards.result import Reward


@dataclass(frozen=True)
class TauRewardInput:
    """What the tau-bench reward needs from one finished episode (plain values only)."""

    final_data_hash: str
    """`data_hash` of the database as the agent left it."""
    gt_data_hash: str
    """`data_hash` of a fresh database after replaying the task's gold actions."""
    outputs: Sequence[str] = ()
    """The task's required outputs (strings the agent must say to the user); may be empty."""
    agent_messages: Sequence[str] = ()
    """The contents of the agent's `respond` actions, i.e. its messages to the user."""
    num_successful_tool_calls: int = 0
    """Tool calls that executed without an error observation (used only by shaping)."""
    num_well_formed_tool_calls: int = 0
    """Tool calls that parsed into a valid name and JSON arguments (used only by shaping)."""

    def __post_init__(self) -> None:
        for name in ("final_data_hash", "gt_data_hash"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        for name in ("outputs", "agent_messages"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"{name} must be a sequence of str, got {value!r}")
        successful, well_formed = self.num_successful_tool_calls, self.num_well_formed_tool_calls
        if successful < 0 or well_formed < 0:
            raise ValueError(f"tool-call counts must be >= 0, got {successful}, {well_formed}")
        if successful > well_formed:
            raise ValueError(
                f"num_successful_tool_calls ({successful}) cannot exceed "
                f"num_well_formed_tool_calls ({well_formed}): a call that ran was well formed"
            )


@dataclass(frozen=True)
class TauShapingConfig:
    """vime's shaped tau-bench reward."""

    per_successful_call: float = 0.1
    """Added per tool call that executed without error."""
    per_well_formed_call: float = 0.05
    """Added per tool call that parsed correctly."""
    cap: float = 1.5
    """Upper bound of the shaped reward."""


def output_found(output: str, agent_messages: Sequence[str]) -> bool:
    """tau-bench's output check: `output.lower()` in some `message.lower()` with commas removed."""
    needle = output.lower()
    return any(needle in message.lower().replace(",", "") for message in agent_messages)


def tau_reward(episode: TauRewardInput, shaping: TauShapingConfig | None = None) -> Reward:
    """The tau-bench reward of one episode, optionally shaped.

    Args:
        episode: Hashes, required outputs, the agent's messages and tool-call counts.
        shaping: When given, add vime's per-call bonuses (capped); None gives exactly
            tau-bench's 0/1 reward.

    Returns:
        The reward and a breakdown: `r_actions` (hash match), `gt_data_hash`, and when the
        task has outputs `r_outputs` and `outputs` ({output: found}); with shaping also
        `task_reward` (the 0/1 part) and `shaping_bonus`.
    """
    r_actions = 1.0 if episode.final_data_hash == episode.gt_data_hash else 0.0
    breakdown: dict[str, object] = {"r_actions": r_actions, "gt_data_hash": episode.gt_data_hash}
    reward = r_actions
    if episode.outputs:
        found = {o: output_found(o, episode.agent_messages) for o in episode.outputs}
        r_outputs = 1.0 if all(found.values()) else 0.0
        breakdown.update(r_outputs=r_outputs, outputs=found)
        reward = min(reward, r_outputs)
    if shaping is None:
        return Reward(reward, breakdown)
    bonus = (
        shaping.per_successful_call * episode.num_successful_tool_calls
        + shaping.per_well_formed_call * episode.num_well_formed_tool_calls
    )
    breakdown.update(task_reward=reward, shaping_bonus=bonus)
    return Reward(min(reward + bonus, shaping.cap), breakdown)


def normalize_by_group_max(rewards: Sequence[float]) -> list[float]:
    """Divide each reward of one GRPO group by the group's maximum (vime's normalisation).

    Args:
        rewards: The (non-negative, e.g. shaped tau-bench) rewards of one group.

    Returns:
        `r / max(rewards)` for each reward; unchanged when the maximum is 0 (nothing to
        scale by).

    Raises:
        ValueError: on an empty group or a negative reward (a maximum would not normalise).
    """
    if not rewards:
        raise ValueError("a group needs at least one reward")
    if min(rewards) < 0:
        raise ValueError(f"rewards must be >= 0 for max-normalisation, got {min(rewards)}")
    top = max(rewards)
    if top == 0:
        return [float(r) for r in rewards]
    return [r / top for r in rewards]
