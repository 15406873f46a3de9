"""The SFT stage both apps run before RL, written once.

:func:`run_sft_stage` trains a ``TorchEngine`` through phases (e.g. a curriculum of short
conversation prefixes, then whole conversations), each a number of steps over its own
examples in a seeded order, with the learning rate a function of the step (a
:func:`~turnrl.grpo_core.training.sft.scheduled_lr` schedule). It may end early on
:class:`~turnrl.grpo_core.training.sft.SFTStop` (a probe target or a time bound), shows a
progress bar (a line every tenth of the steps when the console is not a terminal), and
hands every step's metrics to a callback (``metrics.jsonl`` in both apps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.grpo_core.training.sft import (
    SFTConfig,
    SFTDataIterator,
    SFTExample,
    SFTStop,
    run_sft,
)


@dataclass
class SFTPhase:
    """Steps over one pool of examples."""

    steps: int
    """Optimizer steps of the phase (0 skips it)."""
    examples: Sequence[SFTExample]
    """Its examples; those without an assistant token to train on are left out."""
    batch_size: int
    """Conversations per step."""
    probe: bool = True
    """Whether the stop's probe runs in this phase (its time bound always does)."""


@dataclass
class SFTResult:
    """What a stage did."""

    losses: list[float] = field(default_factory=list)
    """The loss of every step, in order."""
    stop: str = "all steps done"
    """Why the stage ended."""
    probes: list[tuple[int, float]] = field(default_factory=list)
    """``(step, rate)`` of every probe, the step counted over the whole stage."""

    @property
    def steps(self) -> int:
        """Steps trained."""
        return len(self.losses)

    def record(self) -> dict[str, Any]:
        """The JSON-ready summary an app stores (``sft.json``, ``progress.json``)."""
        first, last = (self.losses[0], self.losses[-1]) if self.losses else (None, None)
        return {
            "steps": self.steps,
            "loss_first": first,
            "loss_last": last,
            "stop": self.stop,
            "probes": [list(p) for p in self.probes],
        }


def run_sft_stage(
    trainer: Any,
    phases: Sequence[SFTPhase],
    *,
    pad_id: int,
    seed: int,
    lr: Callable[[int], float],
    stop: SFTStop | None = None,
    console: Console | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> SFTResult:
    """Train ``trainer`` through ``phases``; returns what was done (the caller exports).

    Args:
        trainer: A ``TorchEngine`` (``train_step(batch, objective="sft")``, ``optimizer``,
            ``hf_model``).
        phases: Run in order.
        pad_id: The tokenizer's padding id.
        seed: Seeds each phase's data order.
        lr: Learning rate of a step (0-based over the whole stage).
        stop: Ends the stage early; its probe step counts within a phase.
        console: Where the progress bar and the stage's lines go.
        on_step: Called with the step (1-based over the stage) and its metrics, keys
            prefixed ``sft/`` (a probe's rate as ``sft/probe``).

    Raises:
        ValueError: a phase with steps has no example to train on.
    """
    console = console or Console()
    stop = stop or SFTStop()
    pools = [[e for e in p.examples if any(e.loss_mask)] for p in phases]
    for phase, pool in zip(phases, pools, strict=True):
        if phase.steps > 0 and not pool:
            raise ValueError("an SFT phase has no example with an assistant token to train on")
    total = sum(max(0, p.steps) for p in phases)
    result = SFTResult()
    reason: str | None = None
    columns = [
        TextColumn("SFT"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    ]
    stop.start()
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("", total=total)
        for phase, pool in zip(phases, pools, strict=True):
            if phase.steps <= 0:
                continue
            order = SFTDataIterator(len(pool), seed)
            config = SFTConfig(num_steps=1, global_batch_size=phase.batch_size, seed=seed)
            for step in range(1, phase.steps + 1):
                for group in trainer.optimizer.param_groups:
                    group["lr"] = lr(result.steps)
                metrics = run_sft(trainer, pool, config, pad_id, data=order)[0]
                result.losses.append(float(metrics["loss"]))
                done = result.steps
                progress.update(bar, advance=1, description=f"loss {result.losses[-1]:.3f}")
                if not console.is_terminal and done % max(1, total // 10) == 0:
                    console.print(f"SFT step {done}/{total}  loss {result.losses[-1]:.3f}")
                reason = stop.check(trainer.hf_model, step, probe=phase.probe)
                if (rate := stop.last_probe) is not None:
                    metrics["probe"] = rate
                    result.probes.append((done, rate))
                    console.print(
                        f"SFT step {done}: {rate:.2f} of {len(stop.probe)} probe "
                        "conversations reproduced"
                    )
                if on_step is not None:
                    on_step(done, {f"sft/{k}": float(v) for k, v in metrics.items()})
                if reason:
                    break
            if reason:
                break
    result.stop = reason or result.stop
    console.print(f"SFT stopped after {result.steps} steps: {result.stop}")
    if result.losses:
        console.print(f"SFT loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    return result
