"""The ReTool app's configuration: typed dataclasses, presets, command-line overrides.

:class:`RetoolAppConfig` nests one section per stage. Presets (``presets/*.toml``) set
what differs from these defaults: ``cpu-default`` (what ``uv run apps/retool`` runs: a tiny model on
generated arithmetic, minutes on a laptop CPU), ``smoke`` (the same, seconds per stage,
for CI), and the source documents' real-scale recipes — ``qwen3-4b-npu`` (A3, 8 cards:
SFT on ReTool-SFT, then DAPO on DAPO-Math-17k, AIME 2025 validation), ``qwen2.5-7b-npu``
(A2, 8 cards: GRPO with the rule reward, AIME 2024 validation) and ``qwen3-4b-gpu``.
Their numbers are the recipe's (``../shared/reference/retool-recipe.md`` in the workspace):
no KL, clip 0.2 / 0.28, dual clip 10, token-mean, n = 16, lr 1e-6, validation n = 30 at
temperature 1.0 / top-p 0.6.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.loop import LoopConfig
from turnrl.grpo_core.recipe.presets import load_preset, preset_names
from turnrl.grpo_core.recipe.schema import (
    AppConfig,
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
)
from turnrl.grpo_core.settings import APPEND, OFF, setting
from turnrl.grpo_core.training.torch_engine import OptimizerConfig
from turnrl.tool_envs.retool.dapo import DapoConfig
from turnrl.tool_envs.sandbox.embedded import SandboxSettings


@dataclass
class DataConfig:
    """Where problems and SFT chats come from (generated when no file is given)."""

    sft_path: str | None = setting(None, "--sft-data", kind=str)
    """ReTool-SFT file (parquet/jsonl); None generates SFT chats."""
    train_path: str | None = setting(None, "--train-data", kind=str)
    """DAPO-Math-17k file; None generates arithmetic problems."""
    val_paths: list[str] = setting("--val-data", kind=APPEND, default_factory=list)
    """AIME 2024/2025 files (the flag repeats, and replaces the preset's); empty: generated
    held-out problems."""
    num_sft_chats: int = setting(2000, "--num-sft-chats")
    """Generated SFT chats (when ``sft_path`` is None)."""
    num_train_problems: int = setting(2000, "--num-train-problems")
    """Generated RL training problems (when ``train_path`` is None)."""
    num_val_problems: int = setting(32, "--num-val-problems")
    """Generated held-out problems (when ``val_paths`` is empty)."""
    max_train_prompts: int | None = None
    """Use at most this many training prompts from ``train_path``."""
    tool_schema_in_prompt: bool = setting(True, "--tool-schema-in-prompt")
    """Render the ``code_interpreter`` schema into every prompt (the chat template's tools
    block: ~300 of a generated chat's ~475 tokens). The tiny CPU model learns the tool from SFT
    alone, so ``cpu-default`` leaves it out: ~3x less SFT and prefill work, shorter attention."""


@dataclass
class RLStageConfig(DapoConfig):
    """Stage 2: GRPO/DAPO with the code sandbox in the loop (its steps, batches, loss and
    optimizer: the ``loop``, ``loss`` and ``optimizer`` sections; DAPO's switches:
    ``turnrl.tool_envs.retool.dapo.DapoConfig``)."""

    enabled: bool = setting(True, "--no-rl", kind=OFF)
    """Run the RL stage [--no-rl skips it]."""
    temperature: float = setting(1.0, "--rollout-temperature")
    """Rollout sampling temperature."""
    top_p: float = 1.0
    """Rollout nucleus mass."""
    max_turns: int = setting(4, "--max-turns")
    """Most assistant turns per episode."""
    max_prompt_length: int = 512
    """Longest prompt in tokens."""
    max_response_length: int = setting(256, "--max-response-length")
    """Most response tokens (model turns plus tool results)."""
    max_turn_tokens: int = 96
    """Most tokens one model turn may generate."""
    max_inflight: int = 32
    """Episodes in flight at once."""


@dataclass
class EvalConfig:
    """Validation: accuracy mean@k and mean turns."""

    n: int = setting(4, "--n-val-samples")
    """Samples per problem; accuracy is mean@n."""
    temperature: float = 1.0
    """Validation temperature."""
    top_p: float = 0.6
    """Validation nucleus mass."""
    max_problems: int | None = setting(None, "--max-val-problems", kind=int)
    """Evaluate at most this many problems per dataset."""


@dataclass
class RetoolAppConfig(AppConfig):
    """Everything one ReTool run needs (the shared sections: ``AppConfig``; the RL loss's
    defaults are the recipe's: clip 0.2 / 0.28, dual clip 10, token-mean, no KL)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(tiny_hidden_size=128))
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(
        default_factory=lambda: ParallelConfig(micro_batch_size=16, seq_length=1024)
    )
    loop: LoopConfig = field(
        default_factory=lambda: LoopConfig(
            num_rollout=30,
            rollout_batch_size=8,
            n_samples_per_prompt=8,
            global_batch_size=64,
            rollout_shuffle=True,
        )
    )
    loss: ActorLossConfig = field(default_factory=lambda: ActorLossConfig(dual_clip_c=10.0))
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=2e-4, weight_decay=0.0)
    )
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets."""
    rl: RLStageConfig = field(default_factory=RLStageConfig)
    """GRPO/DAPO with the sandbox (steps and batches: ``loop``)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation."""
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    """Code interpreter (an external SandboxFusion server, or turnrl's, started for the run)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables the recipe sets (the NPU ones), applied before engines start."""

    def validate(self) -> RetoolAppConfig:
        """Check cross-field rules of the app's sections (the shared ones:
        ``turnrl.grpo_core.recipe.schema.check_schema``); returns self.

        Raises:
            ValueError: a setting is out of range or inconsistent with another.
        """
        rl = self.rl
        if rl.max_turns < 1:
            raise ValueError(f"rl.max_turns must be >= 1, got {rl.max_turns}")
        rl.check_loop(
            self.loop.n_samples_per_prompt, self.loop.asynchronous, rl.max_response_length
        )
        if self.eval.n < 1:
            raise ValueError(f"eval.n must be >= 1, got {self.eval.n}")
        return self


PRESET_DIR = Path(__file__).parent / "presets"
"""The app's presets, one TOML file each (``turnrl.grpo_core.recipe.presets``); files
named ``_*.toml`` are bases that presets start from."""
PRESETS: list[str] = preset_names(PRESET_DIR)
"""Their names."""


def preset(name: str) -> RetoolAppConfig:
    """A fresh config of preset ``name`` (or of a user's ``.toml`` file).

    Raises:
        ValueError: unknown preset (the message lists the known ones), or a file the
            config rejects.
    """
    return load_preset(RetoolAppConfig, PRESET_DIR, name)
