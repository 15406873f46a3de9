"""The agent app's configuration: the shared sections (``recipe.schema.AppConfig``) plus the
agent, its tasks and sampling. Presets (``presets/*.toml``) set what differs from these
defaults; flags (``cli.py``) override them. ``cpu-default`` and ``smoke`` train the example
mini-retail agent (``examples/``) with a tiny model on a laptop CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.grpo_core.recipe.presets import load_preset, preset_names
from turnrl.grpo_core.recipe.run_folder import config_from_dict
from turnrl.grpo_core.recipe.schema import AppConfig
from turnrl.grpo_core.recipe.sft import SFTStageConfig
from turnrl.grpo_core.settings import setting


@dataclass
class RolloutSettings:
    """What the run owns of sampling (the gateway enforces it) and episodes in flight."""

    rollout_max_response_len: int = setting(2048, "--rollout-max-response-len")
    """Most tokens the model generates per call."""
    rollout_max_context_len: int = setting(16384, "--rollout-max-context-len")
    """Most tokens of a call's prompt plus its generation."""
    rollout_temperature: float = setting(0.7, "--rollout-temperature")
    """Sampling temperature of rollouts."""
    max_inflight: int = setting(8, "--max-inflight")
    """Episodes (agent runs) in flight at once."""


@dataclass
class AgentSettings:
    """The agent, its tasks, SFT data and evaluation."""

    agent: str | None = setting(None, "--agent", kind=str)
    """``module:function`` or ``path/file.py:function``: ``async def run(task, endpoint) ->
    float``. Exactly one of this and ``agent_command``."""
    agent_command: str | None = setting(None, "--agent-command", kind=str)
    """A shell command run once per episode (README: the contract)."""
    tasks: str | None = setting(None, "--tasks", kind=str)
    """JSONL file, one JSON object (the agent's task) a line."""
    heldout_fraction: float = setting(0.1, "--heldout-fraction")
    """Share of the tasks held out when no task says ``"split": "heldout"``."""
    sft_data: str | None = setting(None, "--sft-data", kind=str)
    """``module:function``: ``(tasks) -> {"chats": [...], "probe": [...], "tools": [...]}``,
    the SFT warm-up's conversations; None: no SFT data."""
    agent_timeout: float = setting(600.0, "--agent-timeout")
    """Seconds one agent run may take; past it the episode fails."""
    eval_trials: int = setting(1, "--num-trials")
    """Trials per held-out task."""
    eval_concurrency: int = setting(8, "--max-concurrency")
    """Evaluation episodes in flight at once."""
    eval_temperature: float = setting(0.0, "--eval-temperature")
    """Sampling temperature during evaluation (0: greedy)."""
    save_trajectories: bool = setting(True, "--save-trajectories")
    """Append each rollout's gateway exports to ``run_dir/trajectories/step-<N>.jsonl``
    (what ``apps/agent audit`` replays)."""

    def __post_init__(self) -> None:
        if self.agent and self.agent_command:
            raise ValueError("give --agent or --agent-command, not both")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.agent_timeout <= 0 or self.eval_trials < 1 or self.eval_concurrency < 1:
            raise ValueError("agent_timeout, eval_trials and eval_concurrency must be positive")


@dataclass
class AgentAppConfig(AppConfig):
    """Everything one run of the agent app needs (the shared sections: ``AppConfig``)."""

    seed: int = 1234
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    """Sampling, episodes in flight."""
    agent: AgentSettings = field(default_factory=AgentSettings)
    """Agent, tasks, SFT data, evaluation."""
    sft: SFTStageConfig = field(
        default_factory=lambda: SFTStageConfig(
            num_steps=0, global_batch_size=8, micro_batch_size=4, probe_size=32
        )
    )
    """The SFT warm-up (0 steps: none)."""


def from_dict(data: dict[str, Any]) -> AgentAppConfig:
    """Rebuild a config from :meth:`AgentAppConfig.to_dict` output (validating every section).

    Raises:
        ValueError: an unknown key, or a value a section rejects.
    """
    return config_from_dict(AgentAppConfig, data)


APP_DIR = Path(__file__).resolve().parents[2]
"""apps/agent: relative paths in presets (the examples) are found here too."""
PRESET_DIR = Path(__file__).parent / "presets"
PRESETS: list[str] = preset_names(PRESET_DIR)


def preset(name: str) -> AgentAppConfig:
    """A fresh config of preset ``name`` (or of a user's ``.toml`` file).

    Raises:
        ValueError: unknown preset, or a file the config rejects.
    """
    return load_preset(AgentAppConfig, PRESET_DIR, name)
