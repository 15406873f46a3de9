"""The SFT stage both apps run before RL, written once.

:class:`SFTStageConfig` is both apps' ``sft`` section (its fields name their flags);
:func:`train_sft` runs the stage it describes from a starting model and exports the result.

:func:`run_sft_stage` trains a ``TorchEngine`` through phases (e.g. a curriculum of short
conversation prefixes, then whole conversations), each a number of steps over its own
examples in a seeded order, with the learning rate a function of the step (a
:func:`~turnrl.grpo_core.training.sft.scheduled_lr` schedule). It may end early on
:class:`~turnrl.grpo_core.training.sft.SFTStop` (a probe target or a time bound), shows a
progress bar (a line every tenth of the steps when the console is not a terminal), and
hands every step's metrics to a callback (``metrics.jsonl`` in both apps).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.grpo_core.settings import OFF, setting
from turnrl.grpo_core.training.sft import (
    LR_DECAYS,
    SFTConfig,
    SFTDataIterator,
    SFTExample,
    SFTStop,
    run_sft,
    scheduled_lr,
)
from turnrl.npu_runtime.supervise import raise_if_stop_requested

SFT_DONE = "sft.json"
"""Written into the SFT model folder once it is complete (:meth:`SFTResult.record`)."""


@dataclass
class SFTStageConfig:
    """The SFT stage before RL (loss on assistant tokens only)."""

    enabled: bool = setting(True, "--no-sft", kind=OFF)
    """Run the SFT stage [--no-sft skips it]."""
    num_steps: int = setting(500, "--sft-steps")
    """Optimizer steps on whole conversations; 0 skips the stage."""
    global_batch_size: int = setting(16, "--sft-global-batch-size")
    """Conversations per optimizer step."""
    micro_batch_size: int = 16
    """Conversations per forward/backward (gradient accumulation above it)."""
    lr: float = setting(3e-3, "--sft-lr")
    """Learning rate (a 4B model's is ~1e-5; a tiny random one needs more)."""
    lr_decay: str = setting("constant", "--sft-lr-decay")
    """``constant``, or ``cosine``: decay to ``min_lr_ratio`` x lr over the stage's steps."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay's final learning rate as a fraction of ``lr``."""
    probe_target: float = setting(0.0, "--sft-probe-target")
    """Stop SFT once this fraction of ``probe_size`` conversations SFT never sees is
    reproduced exactly by greedy decoding given the gold context
    (``grpo_core.training.sft.SFTStop``); ``num_steps`` is then the most steps. 0 runs
    exactly ``num_steps``."""
    probe_interval: int = setting(25, "--sft-probe-interval")
    """Steps between probes."""
    probe_size: int = 64
    """Probe conversations."""
    max_seconds: float = setting(0.0, "--sft-max-seconds")
    """Stop SFT after this many seconds even if the probe target is not met (0: no bound)."""
    prefix_steps: int = setting(0, "--sft-prefix-steps")
    """Steps run first, without probes, on short prefixes of the conversations (each cut
    after its ``prefix_turns``-th assistant turn, :func:`chat_prefix`), ``prefix_batch_size``
    at a time: a cheap curriculum in which a model trained from scratch learns to copy ids
    from the conversation; with ``prefix_loss``, the most such steps."""
    prefix_loss: float = setting(0.0, "--sft-prefix-loss")
    """End the prefix steps once their mean loss over the last :data:`LOSS_WINDOW` steps is
    at or below this (0: run them all; when a small model learns to copy varies with its
    seed)."""
    prefix_turns: int = 2
    """Assistant turns kept in a prefix."""
    prefix_batch_size: int = 32
    """Prefixes per step."""

    def __post_init__(self) -> None:
        if self.lr_decay not in LR_DECAYS:
            raise ValueError(f"--sft-lr-decay must be constant or cosine, got {self.lr_decay!r}")
        if not 0 <= self.probe_target <= 1:
            raise ValueError(f"--sft-probe-target must be in [0, 1], got {self.probe_target}")
        if self.probe_interval < 1 or self.probe_size < 1 or self.max_seconds < 0:
            raise ValueError("sft.probe_interval, sft.probe_size >= 1, sft.max_seconds >= 0")
        if self.num_steps < 0 or self.warmup_steps < 0:
            raise ValueError("--sft-steps and sft.warmup_steps must be >= 0")
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("sft.global_batch_size and sft.micro_batch_size must be >= 1")
        if self.prefix_steps < 0 or self.prefix_loss < 0:
            raise ValueError("--sft-prefix-steps and --sft-prefix-loss must be >= 0")
        if self.prefix_turns < 1 or self.prefix_batch_size < 1:
            raise ValueError("sft.prefix_turns and sft.prefix_batch_size must be >= 1")

    @property
    def runs(self) -> bool:
        """Whether the stage trains at all."""
        return self.enabled and self.num_steps > 0


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
    stop_loss: float = 0.0
    """End the phase early, ``steps`` then being its most, once the mean loss of its last
    :data:`LOSS_WINDOW` steps is at or below this (0: run every step)."""


LOSS_WINDOW = 20
"""Steps a phase's ``stop_loss`` averages over."""


Chat = list[dict[str, Any]]
"""OpenAI-style messages of one conversation."""


def chat_prefix(chat: Chat, turns: int) -> Chat:
    """``chat`` cut right after its ``turns``-th assistant message (all of it if fewer): the
    short prefixes of the curriculum ``SFTStageConfig.prefix_steps`` describes."""
    seen = 0
    for index, message in enumerate(chat):
        seen += message["role"] == "assistant"
        if seen == turns:
            return chat[: index + 1]
    return list(chat)


@dataclass
class SFTResult:
    """What a stage did."""

    losses: list[float] = field(default_factory=list)
    """The loss of every step, in order."""
    stop: str = "all steps done"
    """Why the stage ended."""
    probes: list[tuple[int, float]] = field(default_factory=list)
    """``(step, rate)`` of every probe, the step counted over the whole stage."""
    phase_steps: list[int] = field(default_factory=list)
    """Steps each phase with steps trained, in order."""

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
            "phase_steps": self.phase_steps,
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
        stop: Ends the stage early; its probe step counts within a phase. A phase's
            ``stop_loss`` ends that phase early, and the next one starts.
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
            result.phase_steps.append(0)
            for step in range(1, phase.steps + 1):
                raise_if_stop_requested()  # a Ctrl-C the interpreter swallowed
                result.phase_steps[-1] = step
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
                mean = sum(result.losses[-LOSS_WINDOW:]) / LOSS_WINDOW
                if phase.stop_loss > 0 and step >= LOSS_WINDOW and mean <= phase.stop_loss:
                    console.print(
                        f"SFT phase {len(result.phase_steps)} ended after {step} of "
                        f"{phase.steps} steps: mean loss of the last {LOSS_WINDOW} "
                        f"{mean:.3f} <= {phase.stop_loss}"
                    )
                    total -= phase.steps - step
                    progress.update(bar, total=total)
                    break
            if reason:
                break
    result.stop = reason or result.stop
    console.print(f"SFT stopped after {result.steps} steps: {result.stop}")
    if result.losses:
        console.print(f"SFT loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
    return result


def sft_trainer(config: Any, model: Path, lr: float, micro_batch_size: int) -> Any:
    """The SFT stage's trainer, in this process: a ``TorchEngine`` whatever the RL backend,
    AdamW at ``lr`` without weight decay, the run's dtype and seed."""
    from turnrl.grpo_core.training.torch_engine import (
        OptimizerConfig,
        TorchEngine,
        TorchEngineConfig,
    )

    return TorchEngine(
        TorchEngineConfig(
            model_path=str(model),
            dtype=config.model.dtype,
            optimizer=OptimizerConfig(lr=lr, weight_decay=0.0),
            micro_batch_size=micro_batch_size,
            seed=config.seed,
        )
    )


def train_sft(
    config: Any,
    base: Path,
    examples: Sequence[SFTExample],
    probe: Sequence[SFTExample],
    out: Path,
    *,
    pad_id: int,
    first: Sequence[SFTPhase] = (),
    console: Console | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """The SFT stage ``config.sft`` describes, from ``base``: the ``first`` phases (e.g. a
    curriculum of prefixes), then ``sft.num_steps`` steps over ``examples``, the learning
    rate scheduled over all of them (each phase at its most steps), stopped early on
    ``probe`` or the time bound. The model is exported to ``out`` with :data:`SFT_DONE` in
    it; returns that record.

    Args:
        config: An app config with ``sft``, ``model`` and ``seed``.
    """
    sft = config.sft
    trainer = sft_trainer(config, base, sft.lr, sft.micro_batch_size)
    phases = [*first, SFTPhase(sft.num_steps, examples, sft.global_batch_size)]
    total = sum(max(0, p.steps) for p in phases)

    def lr(step: int) -> float:
        return scheduled_lr(
            sft.lr,
            step,
            total,
            sft.lr_decay,
            warmup_steps=sft.warmup_steps,
            min_ratio=sft.min_lr_ratio,
        )

    stop = SFTStop(probe, pad_id, sft.probe_target, sft.probe_interval, sft.max_seconds)
    result = run_sft_stage(
        trainer,
        phases,
        pad_id=pad_id,
        seed=config.seed,
        lr=lr,
        stop=stop,
        console=console,
        on_step=on_step,
    )
    folder = Path(trainer.export_hf(out))
    record = result.record()
    (folder / SFT_DONE).write_text(json.dumps(record) + "\n")
    return record


def _until(phase: SFTPhase) -> str:
    return f", until loss <= {phase.stop_loss}" if phase.stop_loss else ""


def train_sft_on_chats(
    config: Any,
    base: Path,
    chats: Sequence[Chat],
    probe_chats: Sequence[Chat],
    out: Path,
    *,
    tools: list[dict[str, Any]] | None = None,
    console: Console | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """:func:`train_sft` on conversations: each is rendered with ``base``'s chat template
    (``tools`` in its prompt), cut at ``config.parallel.seq_length`` tokens, loss on the
    assistant's tokens only. With ``config.sft.prefix_steps``, a phase on the conversations'
    short prefixes runs first, without probes (a curriculum, ended by its loss)."""
    from transformers import AutoTokenizer

    from turnrl.grpo_core.training.sft import build_sft_example

    tok = AutoTokenizer.from_pretrained(str(base))
    length = config.parallel.seq_length

    def examples(items: Sequence[Chat]) -> list[SFTExample]:
        return [build_sft_example(tok, chat, tools, max_length=length) for chat in items]

    sft, phases = config.sft, []
    if sft.prefix_steps:
        prefixes = examples([chat_prefix(chat, sft.prefix_turns) for chat in chats])
        phases.append(
            SFTPhase(sft.prefix_steps, prefixes, sft.prefix_batch_size, False, sft.prefix_loss)
        )
    main = examples(chats)
    if console is not None and main:
        tokens = sum(len(e.input_ids) for e in main) / len(main)
        console.print(
            f"SFT: {len(main)} conversations, {tokens:.0f} tokens on average, "
            + "".join(f"{p.steps} steps x {p.batch_size} (prefixes{_until(p)}) + " for p in phases)
            + f"{config.sft.num_steps} steps x {config.sft.global_batch_size}"
        )
    return train_sft(
        config,
        base,
        main,
        examples(probe_chats),
        out,
        pad_id=tok.pad_token_id,
        first=phases,
        console=console,
        on_step=on_step,
    )
