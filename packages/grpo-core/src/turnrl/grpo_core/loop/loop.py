"""The synchronous GRPO loop: rollout -> reward -> advantages -> train -> weight sync.

One step (slime's ``train.py`` without Ray, everything in this process)::

    prompts  = next rollout_batch_size prompts (shuffled per epoch with --rollout-shuffle)
    samples  = await generate(prompts, n_samples_per_prompt)      # the app's rollout hook
    rewards  = await reward(samples)                               # the app's reward hook
    adv      = group advantages over the step's samples
    batch    = padded tensors of the samples with policy tokens
    old_logp = trainer log-probs (and ref_logp for the KL loss)
    for each of samples_per_step / global_batch_size mini-batches: trainer.train_step
    await weight_sync.sync(trainer, version=step)                  # engines serve the new policy

With ``weight_updates`` (the engines' router) the sync runs inside
``begin_weight_update(config.update_weights_mode)`` / ``end_weight_update(step)``: what is
in flight then drains, is aborted and resumed, or is kept, and tokens sampled from then on
carry the new version. Each step logs the staleness of its trained tokens
(``rollout/staleness_max``, ``rollout/staleness_mean``: the trainer's version minus the
version each was sampled with) when its samples carry per-token ``versions``.

The hooks carry every task-specific decision (which environment, which user, which
reward), so the same loop serves every app; :func:`load_function` resolves a hook from a
dotted path as slime's ``--custom-generate-function-path`` / ``--custom-rm-path`` do.
Samples whose response has no policy token (e.g. a prompt too long for the context)
still count for group statistics but are not trained on. Samples with status ``failed``
(an infrastructure failure the rollout did not recover from: a user simulator that gave
up, an unreachable sandbox, an environment exception) are not the policy's outcome: they
are left out of training, of group statistics and of the reward mean, and counted per
reason as ``rollout/failed/<reason>`` (each reason logged once with its message).

Checkpoints (every ``save_interval`` steps, in ``<checkpoint_dir>/step_<n>``) hold the
trainer's state (model, optimizer, RNG, see ``training/checkpoint.py``) and the loop's own
(step, prompt position, history) under the ``loop`` key of the trainer's ``data_state``.
:meth:`GRPOLoop.resume` restores both and pushes the restored weights to the engines, so
the next step sees the same prompts and trains on the same batch as an uninterrupted run
would, provided the generate hook is deterministic given ``(loop.step, prompt)``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import random
import re
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException

from turnrl.grpo_core.algos import PackingPlan, pack_micro_batches, rollout_mismatch_metrics
from turnrl.grpo_core.loop.config import LoopConfig
from turnrl.grpo_core.loop.samples import (
    Sample,
    advantage_abs_mean,
    build_train_batch,
    sample_advantages,
    split_batch,
)
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.checkpoint import TRAINER_STATE
from turnrl.grpo_core.weight_sync.disk import WeightSync
from turnrl.grpo_core.weight_sync.sleep import EngineSleep

GenerateFn = Callable[[list[Any], int], Awaitable[list[Any]]]
"""``(prompts, n_samples_per_prompt) -> samples`` (group ids set by the hook)."""
RewardFn = Callable[[list[Any]], Awaitable[list[float]]]
"""``(samples) -> one reward per sample`` (batched, like vime's ``batched_tau_bench_rm``)."""
EvalFn = Callable[[int], Awaitable[dict[str, float]]]
"""``(step) -> metrics`` run every ``eval_interval`` steps."""
MetricsFn = Callable[[int, dict[str, float]], None]
"""``(step, metrics)`` called after every step (console line, TensorBoard, ...)."""
BusyFn = Callable[[], Mapping[str, float]]
"""``() -> {engine: busy seconds so far}``, cumulative (e.g. ``Router.busy_seconds``)."""


class WeightUpdates(Protocol):
    """Settles the generations in flight around a weight update (the engines' router)."""

    def check_update_mode(self, mode: str) -> None:
        """Raise ValueError unless the engines take updates in ``mode``."""
        ...

    def set_weight_version(self, version: int) -> None:
        """The engines serve ``version``: tokens from now on carry it."""
        ...

    async def begin_weight_update(self, mode: str) -> float:
        """Settle what is in flight as ``mode`` says; returns the seconds it took."""
        ...

    async def end_weight_update(self, version: int | None) -> None:
        """The update is over (``version`` served; None: it failed); admit work again."""
        ...


LOOP_STATE_VERSION = 1
"""Format version of the loop state stored in checkpoints."""
_STEP_FOLDER = re.compile(r"step_(\d+)")
_log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint folder exists but cannot be resumed from (corrupt or from another run)."""


def load_function(path: str) -> Callable[..., Any]:
    """Import ``package.module.function`` (or ``module:function``) and return the function.

    Raises:
        ValueError: the path has no module part, or names something not callable.
        ImportError / AttributeError: the module or the attribute does not exist.
    """
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected a dotted path 'module.function', got {path!r}")
    func = getattr(importlib.import_module(module_name), attr)
    if not callable(func):
        raise ValueError(f"{path} is a {type(func).__name__}, not a function")
    return func  # type: ignore[no-any-return]


class PromptIterator:
    """Endless, seeded walk over the prompts, ``batch`` at a time, reshuffled per epoch."""

    def __init__(self, prompts: Sequence[Any], shuffle: bool, seed: int) -> None:
        if not prompts:
            raise ValueError("no prompts to train on")
        self.prompts, self.shuffle, self.seed = list(prompts), shuffle, seed
        self.epoch, self.index = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self, count: int) -> list[Any]:
        """The next ``count`` prompts, crossing epochs as needed."""
        out: list[Any] = []
        while len(out) < count:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, index) and what the order depends on, JSON-serialisable."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "num_prompts": len(self.prompts),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state_dict`.

        Raises:
            CheckpointError: the state is malformed, or was saved over another number of
                prompts, another seed or shuffle setting (the order would differ).
        """
        self.check_state(state)
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._make_order()

    def check_state(self, state: Any) -> None:
        """Raise :class:`CheckpointError` unless ``state`` can be loaded into this iterator."""
        if not isinstance(state, dict):
            raise CheckpointError(f"prompt position must be a dict, got {state!r}")
        missing = {"epoch", "index", "num_prompts", "shuffle", "seed"} - state.keys()
        if missing:
            raise CheckpointError(f"prompt position lacks {sorted(missing)}")
        mine = self.state_dict()
        for key in ("num_prompts", "shuffle", "seed"):
            if state[key] != mine[key]:
                raise CheckpointError(
                    f"the checkpoint's prompt order was made with {key}={state[key]!r}, this "
                    f"run has {key}={mine[key]!r}; resuming would see other prompts"
                )
        epoch, index = state["epoch"], state["index"]
        if not (isinstance(epoch, int) and isinstance(index, int)):
            raise CheckpointError(f"epoch and index must be integers, got {epoch!r}, {index!r}")
        if epoch < 0 or not 0 <= index <= len(self.prompts):
            raise CheckpointError(
                f"prompt position out of range: epoch {epoch}, index {index} "
                f"of {len(self.prompts)} prompts"
            )


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete ``step_<n>`` folder with the largest ``n`` under ``checkpoint_dir``.

    A save cut short leaves no ``trainer_state.json`` (it is written last) or, killed
    while writing it, one that does not parse; such folders are skipped. Returns None
    when the folder does not exist or holds no complete checkpoint.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _STEP_FOLDER.fullmatch(path.name)) and (path / TRAINER_STATE).is_file()
    ]
    for _, path in sorted(found, reverse=True):
        try:
            json.loads((path / TRAINER_STATE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        return path
    return None


def read_loop_state(folder: str | Path) -> dict[str, Any]:
    """The loop state stored in a checkpoint folder (not validated against a loop).

    Raises:
        FileNotFoundError: no such folder, or no ``trainer_state.json`` in it.
        CheckpointError: ``trainer_state.json`` is not valid JSON or has no loop state.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {folder}")
    meta_path = folder / TRAINER_STATE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a complete checkpoint (no {TRAINER_STATE}; was the save interrupted?)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"corrupt checkpoint {folder}: {TRAINER_STATE}: {exc}") from exc
    data_state = meta.get("data_state") if isinstance(meta, dict) else None
    loop_state = data_state.get("loop") if isinstance(data_state, dict) else None
    if not isinstance(loop_state, dict):
        raise CheckpointError(
            f"{folder} holds no loop state (a trainer-only checkpoint, not saved by GRPOLoop?)"
        )
    return loop_state


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def failure_reason(sample: Any) -> str | None:
    """Why a sample failed for a reason outside the policy (status ``failed``), else None.

    The reason is the exception's type name at the start of ``metadata["error"]`` (as the
    tool-envs rollout records it, e.g. ``UserSimulatorError``), or ``unknown``.
    """
    if getattr(sample, "status", "completed") != "failed":
        return None
    error = str((getattr(sample, "metadata", None) or {}).get("error") or "")
    name = error.split(":", 1)[0].strip()
    return name if name.isidentifier() else "unknown"


def rollout_metrics(samples: Sequence[Sample], seconds: float) -> dict[str, float]:
    """``rollout/...`` scalars of one step's samples (the reward mean without failed ones)."""
    generated = [sum(s.loss_mask) for s in samples]
    scored = [s for s in samples if failure_reason(s) is None]
    metrics = {
        "rollout/reward_mean": _mean([float(s.reward) for s in scored]),
        "rollout/response_len_mean": _mean([float(len(s.response_ids)) for s in samples]),
        "rollout/generated_tokens": float(sum(generated)),
        "rollout/num_samples": float(len(samples)),
        "rollout/tokens_per_s": sum(generated) / seconds if seconds > 0 else 0.0,
    }
    turns = [getattr(s, "num_turns", None) for s in samples]
    if all(isinstance(t, int) for t in turns):
        metrics["rollout/num_turns_mean"] = _mean([float(t) for t in turns if t is not None])
    metrics.update(episode_time_metrics(samples))
    reasons = [failure_reason(s) for s in samples]
    metrics["rollout/failed_frac"] = _mean([float(r is not None) for r in reasons])
    for reason in sorted({r for r in reasons if r is not None}):
        metrics[f"rollout/failed/{reason}"] = float(reasons.count(reason))
    return metrics


TIME_PARTS = ("generate", "env", "user", "agent")
"""Parts of an episode's wall time in ``timings`` (as ``turnrl.tool_envs.rollout`` records
them): awaiting the engine (queue and HTTP included), the environment (tools and the
user simulator), the user simulator alone, and the agent loop's own work (render,
tokenize, parse: the rest of ``total``)."""


def episode_time_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Where episodes spent their time: per-episode means of each of :data:`TIME_PARTS`
    (``rollout/time_<part>_s``) and the share of episode time spent outside the engine
    (``rollout/outside_engine_frac``). Empty when samples carry no ``timings``."""
    timings = [t for t in (getattr(s, "timings", None) for s in samples) if t and "total" in t]
    if not timings:
        return {}
    metrics = {
        f"rollout/time_{part}_s": _mean([float(t.get(part, 0.0)) for t in timings])
        for part in TIME_PARTS
    }
    total = sum(float(t["total"]) for t in timings)
    outside = sum(float(t["total"]) - float(t.get("generate", 0.0)) for t in timings)
    metrics["rollout/outside_engine_frac"] = outside / total if total > 0 else 0.0
    return metrics


def busy_fractions(
    before: Mapping[str, float], after: Mapping[str, float], seconds: float, prefix: str
) -> dict[str, float]:
    """Mean and lowest busy fraction of the engines over ``seconds`` between two readings
    of a :data:`BusyFn` (``<prefix>/engine_busy_frac`` and ``..._min``)."""
    if seconds <= 0 or not after:
        return {}
    fracs = [min(1.0, (after[url] - before.get(url, 0.0)) / seconds) for url in after]
    return {
        f"{prefix}/engine_busy_frac": _mean(fracs),
        f"{prefix}/engine_busy_frac_min": min(fracs),
    }


def check_estimator_loss(config: LoopConfig, trainer: Any) -> None:
    """Refuse an estimator whose algorithm the trainer's loss does not implement.

    GSPO is the GRPO advantage with a sequence-level ratio: ``advantage_estimator="gspo"``
    with the token-ratio (``ppo``) loss would train GRPO under GSPO's name.
    """
    loss = getattr(getattr(trainer, "config", None), "loss", None)
    policy = getattr(loss, "policy_loss", None)
    if config.advantage_estimator == "gspo" and policy not in (None, "gspo"):
        raise ValueError(
            f"advantage_estimator='gspo' needs the sequence-ratio loss (policy_loss='gspo'), "
            f"but the trainer's policy_loss is {policy!r}"
        )


class GRPOLoop:
    """Runs synchronous GRPO steps with a trainer, hooks and a weight sync.

    Args:
        config: Batch sizes, estimator, intervals.
        trainer: A training engine (``compute_logprobs``, ``train_step``, ``export_hf``,
            ``save_checkpoint``): a :class:`~turnrl.grpo_core.training.trainer.Trainer`.
        prompts: The training prompts (tasks) the generate hook understands.
        generate: Rollout hook, see :data:`GenerateFn`.
        reward: Reward hook, see :data:`RewardFn`.
        weight_sync: Pushes new weights to the engines after each step (None: no engines).
        pad_id: Padding token id of the policy's tokenizer.
        reference: Reference policy with ``attach(batch)`` for the KL loss (None: no KL).
        evaluate: Evaluation hook run every ``config.eval_interval`` steps.
        on_metrics: Called with each step's metrics.
        checkpoint_dir: Where ``save_interval`` checkpoints go (``step_<n>`` folders,
            written at the end of a step; see :meth:`resume` and :func:`latest_checkpoint`).
        engine_busy: Reads the engines' cumulative busy seconds (e.g. the rollout
            router's ``busy_seconds``): each step then logs the engines' busy fraction
            during its rollout (``rollout/engine_busy_frac``; not in the async loop, whose
            rollouts overlap) and over the whole step (``perf/engine_busy_frac``).
        engine_sleep: Engines colocated with the trainer
            (:class:`~turnrl.grpo_core.weight_sync.sleep.EngineSleep`): they sleep while it
            trains, wake their weights for the sync and their KV cache after it
            (``perf/sleep_s``, ``perf/wake_s``).
        weight_updates: The engines' router, told of every weight update
            (:class:`WeightUpdates`, ``perf/update_settle_s``); required unless
            ``config.update_weights_mode`` is ``drain``.
    """

    def __init__(
        self,
        config: LoopConfig,
        trainer: Any,
        prompts: Sequence[Any],
        generate: GenerateFn,
        reward: RewardFn,
        *,
        weight_sync: WeightSync | None,
        pad_id: int,
        reference: Any = None,
        evaluate: EvalFn | None = None,
        on_metrics: MetricsFn | None = None,
        checkpoint_dir: str | Path | None = None,
        engine_busy: BusyFn | None = None,
        engine_sleep: EngineSleep | None = None,
        weight_updates: WeightUpdates | None = None,
    ) -> None:
        if config.save_interval and checkpoint_dir is None:
            raise ValueError("save_interval is set but no checkpoint_dir was given")
        if weight_updates is not None:
            weight_updates.check_update_mode(config.update_weights_mode)
            weight_updates.set_weight_version(0)  # the engines start with the initial policy
        elif config.update_weights_mode != "drain":
            raise ValueError(
                f"--update-weights-mode {config.update_weights_mode} needs the engines' router "
                "(weight_updates) to act on the generations in flight"
            )
        self.weight_updates = weight_updates
        check_estimator_loss(config, trainer)
        self.config, self.trainer = config, trainer
        self.data = PromptIterator(prompts, config.rollout_shuffle, config.seed)
        self.generate, self.reward = generate, reward
        self.weight_sync, self.pad_id, self.reference = weight_sync, pad_id, reference
        self.evaluate, self.on_metrics = evaluate, on_metrics
        self.checkpoint_dir = checkpoint_dir
        self.engine_busy, self.engine_sleep = engine_busy, engine_sleep
        self._busy_mark: tuple[float, Mapping[str, float]] | None = None
        """(time, busy seconds) at the end of the last step (``perf/engine_busy_frac``)."""
        self._rollout_busy: dict[str, float] = {}
        """``rollout/engine_busy_frac`` of the rollout :meth:`collect` last gathered."""
        self.step = 0
        self.history: list[dict[str, float]] = []
        self._failure_reasons_logged: set[str] = set()
        """Every finished step's metrics."""

    async def run_step(self) -> dict[str, float]:
        """One full step; returns its metrics (``rollout/``, ``train/``, ``perf/``)."""
        prompts = self.data.next(self.config.rollout_batch_size)
        samples, rollout_s = await self.collect(prompts)
        return await self.learn(samples, rollout_s)

    def _read_busy(self) -> Mapping[str, float] | None:
        return None if self.engine_busy is None else dict(self.engine_busy())

    async def collect(self, prompts: list[Any]) -> tuple[list[Any], float]:
        """Generate and score one step's samples; returns them and the seconds it took."""
        start = time.perf_counter()
        before = self._read_busy()
        if self._busy_mark is None and before is not None:  # the run's first rollout
            self._busy_mark = (start, before)
        samples = await self.generate(prompts, self.config.n_samples_per_prompt)
        if not samples:
            raise RuntimeError("the generate hook returned no samples")
        rewards = await self.reward(samples)
        if len(rewards) != len(samples):
            raise RuntimeError(
                f"the reward hook gave {len(rewards)} rewards for {len(samples)} samples"
            )
        for sample, value in zip(samples, rewards, strict=True):
            sample.reward = float(value)
        seconds = time.perf_counter() - start
        if before is not None:
            after = self._read_busy() or {}
            self._rollout_busy = busy_fractions(before, after, seconds, "rollout")
        return samples, seconds

    async def learn(self, samples: list[Any], rollout_s: float) -> dict[str, float]:
        """Train on scored samples, sync, checkpoint, evaluate; returns the step's metrics."""
        cfg = self.config
        start = time.perf_counter()
        metrics = rollout_metrics(samples, rollout_s)
        metrics.update(getattr(samples, "metrics", {}))  # a RolloutManager's Rollout
        metrics.update(self._rollout_busy)
        self._rollout_busy = {}
        if self.engine_sleep is not None:  # colocated: the trainer gets the devices
            metrics["perf/sleep_s"] = await self.engine_sleep.sleep()
        metrics.update(self._train(samples))
        trained = time.perf_counter()
        self.step += 1
        if self.engine_sleep is not None:
            metrics["perf/wake_s"] = await self.engine_sleep.wake(["weights"])
        if self.weight_sync is not None:
            sync = await self._sync_weights()
            metrics.update({f"perf/sync_{k}": v for k, v in sync.items()})
        if self.engine_sleep is not None:
            metrics["perf/wake_s"] += await self.engine_sleep.wake(["kv_cache"])
        synced = time.perf_counter()
        metrics.update(
            {
                "perf/rollout_s": rollout_s,
                "perf/train_s": trained - start,
                "perf/sync_s": synced - trained,
                "perf/step_s": rollout_s + synced - start,
            }
        )
        busy = self._read_busy()
        if busy is not None and self._busy_mark is not None:
            metrics.update(
                busy_fractions(self._busy_mark[1], busy, synced - self._busy_mark[0], "perf")
            )
            self._busy_mark = (synced, busy)
        if self.evaluate is not None and cfg.eval_interval and self.step % cfg.eval_interval == 0:
            metrics.update(await self.evaluate(self.step))
        self.history.append(metrics)
        if self.on_metrics is not None:
            self.on_metrics(self.step, metrics)
        # Last, so the checkpoint holds everything the step changed (RNG used by the
        # evaluation included); a crash before it redoes the whole step on resume.
        if self.checkpoint_dir and cfg.save_interval and self.step % cfg.save_interval == 0:
            self.save_checkpoint()
        return metrics

    async def _sync_weights(self) -> dict[str, float]:
        """Push the weights as version ``step``, inside the router's weight update."""
        assert self.weight_sync is not None
        updates = self.weight_updates
        if updates is None:
            return await self.weight_sync.sync(self.trainer, self.step)
        settle = await updates.begin_weight_update(self.config.update_weights_mode)
        done = False
        try:
            sync = await self.weight_sync.sync(self.trainer, self.step)
            done = True
        finally:
            await updates.end_weight_update(self.step if done else None)
        return {**sync, "update_settle_s": settle}

    def _train(self, samples: list[Any]) -> dict[str, float]:
        samples = self._without_failures(samples)
        if not samples:
            return {"train/skipped": 1.0}
        advantages = sample_advantages(samples, self.config)
        batch = build_train_batch(samples, advantages, self.pad_id)
        if batch is None:
            return {"train/skipped": 1.0}
        if self.reference is not None:
            batch = self.reference.attach(batch)
        batch = dataclasses.replace(batch, old_logprobs=self.trainer.compute_logprobs(batch))
        steps, plans = [], []
        for mini_batch in split_batch(batch, self.config.updates_per_step):
            micro, plan = self._micro_batches(mini_batch)
            steps.append(self.trainer.train_step(micro))
            plans += [plan] if plan is not None else []
        out = {
            "train/skipped": 0.0,
            "train/advantage_abs_mean": advantage_abs_mean(advantages, samples),
        }
        out.update(logprob_mismatch(batch))
        out.update(staleness_metrics(batch, self.step))
        if (budget := self.config.max_tokens_per_micro_batch) is not None:
            out["train/over_budget_samples"] = float((batch.attention_mask.sum(-1) > budget).sum())
        if plans:  # tokens / (micro-batches x budget) over every rank: 1.0 packs perfectly
            out["train/packing_utilisation"] = _mean([p.utilisation for p in plans])
            out["train/micro_batches_per_rank"] = _mean([p.num_micro_batches for p in plans])
        for key in steps[0]:
            out[f"train/{key}"] = _mean([float(m[key]) for m in steps if key in m])
        return out

    def _micro_batches(
        self, batch: TrainBatch
    ) -> tuple[TrainBatch | list[TrainBatch], PackingPlan | None]:
        """``batch`` whole (the trainer cuts it by rows), or its token-budget micro-batches
        in rank order (the trainer group hands each data-parallel rank a contiguous run),
        with the packing plan they follow."""
        budget = self.config.max_tokens_per_micro_batch
        if budget is None:
            return batch, None
        dp_size = getattr(self.trainer, "dp_size", 1)
        if batch.num_sequences < dp_size:
            return batch, None  # fewer rows than ranks: the trainer group pads with filler rows
        return token_budget_micro_batches(batch, budget, dp_size)

    def _without_failures(self, samples: list[Any]) -> list[Any]:
        """The samples that are the policy's own outcomes; each new failure reason logged."""
        kept = []
        for sample in samples:
            reason = failure_reason(sample)
            if reason is None:
                kept.append(sample)
            elif reason not in self._failure_reasons_logged:
                self._failure_reasons_logged.add(reason)
                error = (getattr(sample, "metadata", None) or {}).get("error")
                message = "left out of training (infrastructure, not the policy): %s: %s"
                _log.warning(message, reason, str(error)[:500])
        return kept

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loop's own state (JSON-serialisable): step, prompt position, history."""
        return {
            "version": LOOP_STATE_VERSION,
            "step": self.step,
            "data": self.data.state_dict(),
            "history": self.history,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the trainer is not touched).

        Raises:
            CheckpointError: the state is malformed or belongs to another run's prompts.
        """
        self.check_state(state)
        self.data.load_state_dict(state["data"])
        self.step = int(state["step"])
        self.history = [dict(m) for m in state["history"]]

    def check_state(self, state: Any) -> None:
        """Raise :class:`CheckpointError` unless ``state`` can be loaded into this loop."""
        if not isinstance(state, dict) or state.get("version") != LOOP_STATE_VERSION:
            raise CheckpointError(
                f"expected loop state version {LOOP_STATE_VERSION}, got "
                f"{state.get('version') if isinstance(state, dict) else state!r}"
            )
        step, history = state.get("step"), state.get("history")
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"loop step must be an integer >= 0, got {step!r}")
        if not isinstance(history, list) or not all(isinstance(m, dict) for m in history):
            raise CheckpointError("loop history must be a list of metric dicts")
        self.data.check_state(state.get("data"))

    def save_checkpoint(self) -> Path:
        """Save trainer and loop state to ``<checkpoint_dir>/step_<step>``; returns the folder."""
        if self.checkpoint_dir is None:
            raise ValueError("this loop has no checkpoint_dir")
        folder = Path(self.checkpoint_dir) / f"step_{self.step}"
        self.trainer.save_checkpoint(folder, {"loop": self.state_dict()})
        return folder

    def ensure_checkpoint(self) -> Path:
        """The checkpoint of the current step: saved now unless ``save_interval`` already
        wrote it (an app calls this after its last step, whatever the interval)."""
        if self.checkpoint_dir is None:
            raise ValueError("this loop has no checkpoint_dir")
        folder = Path(self.checkpoint_dir) / f"step_{self.step}"
        if latest_checkpoint(self.checkpoint_dir) == folder:
            return folder
        return self.save_checkpoint()

    async def resume_latest(self) -> Path | None:
        """Continue from the newest complete checkpoint in ``checkpoint_dir`` (see
        :meth:`resume`); returns it, or None when there is none (a fresh run folder)."""
        if self.checkpoint_dir is None:
            return None
        folder = latest_checkpoint(self.checkpoint_dir)
        if folder is not None:
            await self.resume(folder)
        return folder

    async def resume(self, path: str | Path, *, sync_weights: bool = True) -> int:
        """Continue from a checkpoint folder written by this loop (``.../step_<n>``).

        Restores the trainer (model, optimizer, RNG states, optimizer step) and the loop
        (step, prompt position, history), then, with ``sync_weights`` and a weight sync,
        pushes the restored weights to the engines as version ``step`` so the next rollout
        uses the policy the interrupted run would have used.

        Args:
            path: the checkpoint folder, e.g. ``latest_checkpoint(checkpoint_dir)``.
            sync_weights: push the restored weights to the engines.

        Returns:
            The restored step (the number of steps already done).

        Raises:
            FileNotFoundError: no such folder, or an incomplete checkpoint (the save was
                interrupted before its ``trainer_state.json`` was written).
            CheckpointError: the folder is corrupt, holds no loop state, or was saved over
                other prompts / seed; the trainer may be partly restored when it fails
                while loading its own state.
        """
        folder = Path(path)
        state = read_loop_state(folder)
        self.check_state(state)  # before touching the trainer
        try:
            self.trainer.load_checkpoint(folder)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise CheckpointError(f"cannot restore the trainer from {folder}: {exc}") from exc
        self.load_state_dict(state)
        if sync_weights and self.weight_sync is not None:
            await self._sync_weights()
        return self.step

    async def run(self, num_steps: int | None = None) -> list[dict[str, float]]:
        """Run ``num_steps`` steps (default: ``config.num_rollout`` minus those done)."""
        todo = self.config.num_rollout - self.step if num_steps is None else num_steps
        if todo < 0:
            raise ValueError(f"num_steps must be >= 0, got {todo}")
        for _ in range(todo):
            await self.run_step()
        return self.history


def token_budget_micro_batches(
    batch: TrainBatch, budget: int, dp_size: int
) -> tuple[list[TrainBatch], PackingPlan]:
    """``batch`` packed into micro-batches of at most ``budget`` tokens, the same number per
    data-parallel rank, in rank order (rank r's are the r-th contiguous run), with the plan.

    A micro-batch the plan leaves empty (more micro-batches than samples can fill, e.g. 15
    samples of 4,000 tokens under a budget of 6,144 on 2 ranks: 16 micro-batches) becomes
    :func:`filler_micro_batch`, so every rank still runs its share of the collectives; it
    adds no loss, no gradient and no token or sequence to the mini-batch's counts, so every
    aggregation mode gives the loss of the batch without it.
    """
    lengths = batch.attention_mask.sum(dim=-1).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an over-budget sample is counted by the caller
        plan = pack_micro_batches(lengths, budget, dp_size, allow_oversize=True)
    micro = [
        batch.select(torch.tensor(rows, dtype=torch.long)) if rows else filler_micro_batch(batch)
        for rank in plan.micro_batches
        for rows in rank
    ]
    return micro, plan


def filler_micro_batch(batch: TrainBatch) -> TrainBatch:
    """The shortest row of ``batch`` with an all-zero loss mask: run like any micro-batch,
    it adds no loss, no gradient, no token and no sequence (one with no loss token)."""
    row = batch.select(batch.attention_mask.sum(dim=-1).argmin().reshape(1))
    return dataclasses.replace(row, loss_mask=torch.zeros_like(row.loss_mask))


def logprob_mismatch(batch: TrainBatch) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's on the same tokens.

    ``algos.rollout_mismatch_metrics`` under ``train/``: ``train/mismatch_abs_diff`` is the
    mean ``|log pi_trainer - log pi_engine|`` over the policy tokens, near 0 when the engine
    serves the trainer's weights; a large value means the two disagree (a stale or wrong
    weight sync, or mismatched tokens) and the step is off-policy. With a reference policy,
    ``train/ref_abs_diff`` is the same mean against the reference's log-probs: how far
    training has moved the policy from the reference (the start weights unless
    ``--ref-load`` names others), the gap an engine still serving those would show.
    """
    if batch.old_logprobs is None or batch.rollout_logprobs is None:
        return {}
    metrics = rollout_mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask)
    out = {f"train/{key}": float(value) for key, value in metrics.items()}
    if batch.ref_logprobs is not None:
        mask = batch.loss_mask.float()
        drift = (batch.old_logprobs.float() - batch.ref_logprobs.float()).abs()
        out["train/ref_abs_diff"] = float((drift * mask).sum() / mask.sum().clamp(min=1))
    return out


def staleness_metrics(batch: TrainBatch, version: int) -> dict[str, float]:
    """``rollout/staleness_max`` and ``_mean`` over the trained tokens of known version:
    ``version`` (the trainer's) minus the version each token was sampled with; empty when
    the batch has no token versions."""
    if batch.versions is None:
        return {}
    known = batch.versions[batch.loss_mask.bool() & (batch.versions >= 0)]
    if known.numel() == 0:
        return {}
    lag = (version - known).float()
    return {"rollout/staleness_max": float(lag.max()), "rollout/staleness_mean": float(lag.mean())}
