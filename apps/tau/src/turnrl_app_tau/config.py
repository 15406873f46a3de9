"""The tau app's configuration: typed dataclasses, and presets as Python functions.

:class:`TauAppConfig` nests the packages' own configs where they exist (the loop's
:class:`LoopConfig`, the actor loss, the optimizer; the model, cluster and parallelism
sections every app shares, ``turnrl.grpo_core.recipe.schema``) and adds the app's sections. Presets
(``presets/*.toml``) set what differs from these defaults; command-line flags (``cli.py``)
override them. ``qwen3-4b-npu`` is the vime tau-bench NPU script value for value;
``qwen3-4b-gpu`` the same colocated on GPUs; ``cpu-default`` and ``smoke`` run on a laptop
CPU with a tiny model and the synthetic mini-retail domain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.grpo_core.recipe.presets import load_preset, preset_names
from turnrl.grpo_core.recipe.run_folder import config_from_dict
from turnrl.grpo_core.recipe.schema import AppConfig
from turnrl.grpo_core.recipe.sft import SFTStageConfig
from turnrl.grpo_core.settings import OFF, ON, setting
from turnrl.tool_envs.tau.data import TauTaskConfig

TAU_REWARDS = ("shaped-group-max", "task")
"""The app's reward hooks by ``--tau-reward`` name (``episodes.REWARDS``)."""


@dataclass
class RolloutSettings:
    """Sampling and episodes (the engines' own settings: the ``engine`` section)."""

    rollout_max_response_len: int = setting(2048, "--rollout-max-response-len")
    """Most tokens the model generates per turn."""
    rollout_max_context_len: int = setting(16384, "--rollout-max-context-len")
    """Most tokens in a whole episode."""
    rollout_temperature: float = setting(0.7, "--rollout-temperature")
    """Sampling temperature of rollouts."""
    max_turns: int = setting(10, "--max-turns", env="TAU_MAX_TURNS")
    """Model turns per episode (vime's TAU_MAX_TURNS)."""
    max_inflight: int = setting(8, "--max-inflight", env="TAU_MAX_INFLIGHT")
    """Episodes in flight at once (TAU_MAX_INFLIGHT)."""
    short_tools: bool = setting(False, "--short-tools", kind=ON, env="TAU_SHORT_TOOLS")
    """Tool schemas without descriptions in the prompt (TAU_SHORT_TOOLS)."""
    tools_in_prompt: bool = setting(True, "--no-tools-in-prompt", kind=OFF)
    """Render the tool schemas into the system prompt; False leaves them out (a tiny model
    trained from scratch learns the tools from SFT, and the prompt is ~600 tokens shorter)."""
    custom_generate_function_path: str | None = setting(
        None, "--custom-generate-function-path", kind=str
    )
    """Rollout hook ``(prompts, n) -> samples`` by dotted path;
    None uses the app's tau rollout (episodes under grpo-core's RolloutManager)."""
    custom_rm_path: str | None = setting(None, "--custom-rm-path", kind=str)
    """Reward hook ``(samples) -> rewards`` by dotted path, called once per
    GRPO group as groups finish (the whole batch with a custom rollout hook); None uses the
    app's tau reward (``tau_reward``)."""
    tau_reward: str = setting("shaped-group-max", "--tau-reward")
    """The app's reward: ``shaped-group-max`` (vime's: task reward plus tool-call
    bonuses, over the group maximum; the script pairs it with raw-reward advantages) or
    ``task`` (tau-bench's 0/1 task reward, for group-normalised GRPO advantages)."""

    def __post_init__(self) -> None:
        if self.tau_reward not in TAU_REWARDS:
            raise ValueError(
                f"tau_reward must be one of {list(TAU_REWARDS)}, got {self.tau_reward!r}"
            )


@dataclass
class TauSettings(TauTaskConfig):
    """The task data and the user simulator (``turnrl.tool_envs.tau.data``), the SFT
    warm-up's data, and evaluation."""

    sft_extra_stores: int = setting(0, "--sft-extra-stores")
    """Synthetic domain: gold conversations of this many other generated stores (other seeds:
    other customers and orders, none of the held-out ones) join the SFT data, so the model
    learns to copy ids from the conversation instead of memorising the training tasks."""
    sft_train_tasks: bool = setting(True, ("--no-sft-train-tasks", OFF), ("--sft-train-tasks", ON))
    """The training tasks' own gold conversations join the SFT data; False (synthetic, with
    ``sft_extra_stores``): SFT sees only other stores, so RL's tasks are new to the model and
    it cannot lean on ids it memorised from them."""
    eval_trials: int = setting(1, "--num-trials")
    """Trials per held-out task (pass^k for k up to this)."""
    eval_concurrency: int = setting(8, "--max-concurrency")
    """Evaluation episodes in flight at once."""
    eval_temperature: float = setting(0.0, "--eval-temperature")
    """Sampling temperature during evaluation (0: greedy)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sft_extra_stores < 0:
            raise ValueError(f"sft_extra_stores must be >= 0, got {self.sft_extra_stores}")
        if self.sft_extra_stores and self.domain != "synthetic":
            raise ValueError(
                f"sft_extra_stores={self.sft_extra_stores} (--sft-extra-stores): other stores "
                f"are generated for the synthetic domain only, not {self.domain!r}"
            )
        if not self.sft_train_tasks and not self.sft_extra_stores:  # (synthetic: checked above)
            raise ValueError(
                "sft_train_tasks off needs other stores to train on: the synthetic domain "
                "and sft_extra_stores >= 1"
            )


@dataclass
class TauAppConfig(AppConfig):
    """Everything one run of the tau app needs (the shared sections: ``AppConfig``)."""

    seed: int = 1234
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    """Sampling, episodes."""
    tau: TauSettings = field(default_factory=TauSettings)
    """Data, user, SFT data, evaluation."""
    sft: SFTStageConfig = field(
        default_factory=lambda: SFTStageConfig(
            num_steps=0, global_batch_size=8, micro_batch_size=4, probe_size=32
        )
    )
    """The SFT warm-up on gold conversations (0 steps: none)."""


def from_dict(data: dict[str, Any]) -> TauAppConfig:
    """Rebuild a config from :meth:`TauAppConfig.to_dict` output (validating every section).

    Raises:
        ValueError: an unknown key, or a value a section rejects.
    """
    return config_from_dict(TauAppConfig, data)


PRESET_DIR = Path(__file__).parent / "presets"
"""The app's presets, one TOML file each (``turnrl.grpo_core.recipe.presets``)."""
PRESETS: list[str] = preset_names(PRESET_DIR)
"""Their names."""


def preset(name: str) -> TauAppConfig:
    """A fresh config of preset ``name`` (or of a user's ``.toml`` file).

    Raises:
        ValueError: unknown preset (the message lists the known ones), or a file the
            config rejects.
    """
    return load_preset(TauAppConfig, PRESET_DIR, name)
