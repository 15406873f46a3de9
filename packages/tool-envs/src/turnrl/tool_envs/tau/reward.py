"""tau-bench's reward from plain inputs (SPEC §6.2), for gold replay and quick checks.

The training reward lives in ``turnrl-rewards``; this is the small reference rule the
replay command and tests need: 1.0 when the agent's final data hash equals the
ground-truth hash *and* every required output appears (case-insensitively, commas
removed from the agent's text) in some message the agent sent to the user.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def output_found(output: str, agent_messages: Sequence[str]) -> bool:
    """Whether ``output`` occurs in one of the agent's messages, as tau-bench matches it."""
    wanted = output.lower()
    return any(wanted in message.lower().replace(",", "") for message in agent_messages)


def tau_reward(
    data_hash: str, gt_data_hash: str, outputs: Sequence[str], agent_messages: Sequence[str]
) -> dict[str, Any]:
    """The tau-bench reward and its parts.

    Returns:
        ``{"reward", "r_actions", "r_outputs", "outputs"}``: floats in {0.0, 1.0} and the
        per-output match map (``r_outputs`` is 1.0 when there are no outputs).
    """
    r_actions = 1.0 if data_hash == gt_data_hash else 0.0
    found = {o: output_found(o, agent_messages) for o in outputs}
    r_outputs = 1.0 if all(found.values()) else 0.0
    return {
        "reward": r_actions * r_outputs,
        "r_actions": r_actions,
        "r_outputs": r_outputs,
        "outputs": found,
    }
