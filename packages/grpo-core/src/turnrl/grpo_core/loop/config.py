"""Typed configuration of the GRPO loops (synchronous and asynchronous), with slime's flag names.

:class:`LoopConfig` holds what the loop itself decides (how many prompts and samples per
step, how rewards become advantages, how samples are split into optimizer steps);
the training engine's own settings stay in
:class:`turnrl.grpo_core.training.torch_engine.TorchEngineConfig`. Each field's docstring
names the slime/vime command-line flag that sets it, so launch scripts translate line by line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from turnrl.grpo_core.algos.advantages import AdvantageMethod
from turnrl.grpo_core.settings import OFF, ON, setting
from turnrl.rollout_router.protocol import UPDATE_MODES

ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageMethod)


@dataclass
class LoopConfig:
    """How one synchronous rollout -> reward -> advantage -> train -> sync step runs."""

    num_rollout: int = setting(200, "--num-rollout")
    """Number of rollout/train steps of the run."""
    rollout_batch_size: int = setting(8, "--rollout-batch-size")
    """Prompts (tasks) per step."""
    n_samples_per_prompt: int = setting(2, "--n-samples-per-prompt")
    """Samples per prompt, i.e. the GRPO group size."""
    global_batch_size: int = setting(16, "--global-batch-size")
    """Samples per optimizer step; a step's samples are split into
    ``rollout_batch_size * n_samples_per_prompt / global_batch_size`` updates."""
    advantage_estimator: str = setting("grpo", "--advantage-estimator")
    """Advantage estimator (grpo, dr_grpo, gspo, rloo, reinforce_plus_plus...)."""
    rewards_normalization: bool = setting(
        True, ("--disable-rewards-normalization", OFF), ("--rewards-normalization", ON)
    )
    """Subtract the group mean (and divide by the std for grpo/gspo) before the estimator's
    broadcast; False uses the raw reward as every token's advantage, as slime does with
    ``--disable-rewards-normalization``."""
    grpo_std_normalization: bool = True
    """Divide by the group standard deviation in grpo [--disable-grpo-std-normalization turns off]."""
    rollout_shuffle: bool = setting(False, "--rollout-shuffle")
    """Shuffle the prompts every epoch."""
    eval_interval: int = setting(0, "--eval-interval")
    """Run the evaluation hook every this many steps; 0 never."""
    save_interval: int = setting(0, "--save-interval")
    """Save a training checkpoint every this many steps; 0 never."""
    seed: int = 1234
    """Seed of the prompt order [--seed]."""
    asynchronous: bool = setting(False, "--async", kind=ON)
    """Generate the next steps' rollouts while this one trains
    (:class:`~turnrl.grpo_core.loop.async_loop.AsyncGRPOLoop`, slime's ``train_async.py``)
    instead of one rollout -> train -> sync step after the other."""
    max_tokens_per_micro_batch: int | None = None
    """Dynamic batching: cut each mini-batch into micro-batches of at most this many tokens
    per data-parallel rank (``algos.pack_micro_batches``, the same count on every rank; a
    longer sample gets its own) instead of ``micro_batch_size`` rows; None: off. The loss is
    the same either way (token counts are global). slime's
    [--use-dynamic-batch-size --max-tokens-per-gpu]."""
    max_off_policy_steps: int = setting(1, "--max-off-policy-steps")
    """Asynchronous mode only (:class:`~turnrl.grpo_core.loop.async_loop.AsyncGRPOLoop`): a
    group generated with weights of version ``v`` may be trained at steps ``<= v + N``
    (at most N steps off-policy); staler groups are aborted or dropped. 0 trains on-policy
    only (no overlap). slime's ``train_async.py`` is fixed at 1; verl's fully-async
    ``staleness_threshold`` plays this role. Apps refuse a
    non-default value without ``asynchronous`` (the synchronous loop does not read it)."""

    update_weights_mode: str = setting("drain", "--update-weights-mode")
    """What generations in flight do at a weight update (the engines' router,
    ``Router.begin_weight_update``): ``drain`` (they finish, new ones wait), ``abort-resume``
    (aborted, then resumed with their tokens so far and the rest of their ``max_tokens``)
    or ``keep`` (paused on the engine with their state; refused where the engine lacks it).
    Tokens carry the version they were sampled with either way."""

    def __post_init__(self) -> None:
        if self.update_weights_mode not in UPDATE_MODES:
            raise ValueError(
                f"update_weights_mode must be one of {UPDATE_MODES}, got {self.update_weights_mode!r}"
            )
        for name in (
            "num_rollout",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "global_batch_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_off_policy_steps < 0:
            raise ValueError(f"max_off_policy_steps must be >= 0, got {self.max_off_policy_steps}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}"
            )
        if self.eval_interval < 0 or self.save_interval < 0:
            raise ValueError("eval_interval and save_interval must be >= 0")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, "
                f"got {self.advantage_estimator!r}"
            )
        if self.samples_per_step % self.global_batch_size:
            raise ValueError(
                f"rollout_batch_size * n_samples_per_prompt ({self.samples_per_step}) must be a "
                f"multiple of global_batch_size ({self.global_batch_size})"
            )

    @property
    def algorithm(self) -> str:
        """What the advantages are, by name (for summaries): the estimator, or the raw reward
        when normalisation is off (REINFORCE with no baseline, whatever the estimator says)."""
        if not self.rewards_normalization:
            return "raw reward (no baseline)"
        if self.advantage_estimator in ("grpo", "gspo") and not self.grpo_std_normalization:
            return f"{self.advantage_estimator} without std normalisation"
        return self.advantage_estimator

    @property
    def samples_per_step(self) -> int:
        """Samples generated per step (prompts x samples per prompt)."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per rollout step."""
        return self.samples_per_step // self.global_batch_size
