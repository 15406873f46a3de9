"""Supervised fine-tuning on multi-turn chat data, with loss only on assistant tokens.

A conversation (OpenAI-style messages, optional tools) is rendered once with the
tokenizer's chat template and tokenised with character offsets. The characters each
assistant message contributes are found by rendering prefixes of the conversation:
assistant message `i` spans from the end of `render(messages[:i], add_generation_prompt)`
to the end of `render(messages[:i + 1])` (trailing whitespace excluded, so the
end-of-turn token is trained on and the newline after it is not). Tokens that start
inside such a span get loss mask 1; system, user, tool and template tokens get 0.

A template whose prefix renders are not prefixes of the full render (e.g. one that drops
earlier reasoning) cannot be masked this way, and is refused with a clear error.

`run_sft` trains a `TorchEngine` on such examples for a number of steps, in a seeded
shuffled order whose position is saved with checkpoints.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from turnrl.grpo_core.training.batch import TrainBatch, pad_sequences

LR_DECAYS = ("constant", "cosine")
"""Learning-rate schedules :func:`scheduled_lr` knows."""


def scheduled_lr(
    lr: float,
    step: int,
    total: int,
    decay: str = "constant",
    *,
    warmup_steps: int = 0,
    min_ratio: float = 0.1,
) -> float:
    """Learning rate of step ``step`` (0-based) of ``total``: a linear warm-up over
    ``warmup_steps`` (lr x (step + 1) / warmup_steps), times ``constant`` (1) or ``cosine``
    (from 1 at step 0 down to ``min_ratio`` at step ``total - 1``).

    Raises:
        ValueError: an unknown ``decay``.
    """
    if decay not in LR_DECAYS:
        raise ValueError(f"lr decay must be one of {', '.join(LR_DECAYS)}, got {decay!r}")
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if decay == "constant":
        return lr * warm
    progress = min(1.0, step / max(1, total - 1))
    return lr * warm * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class SFTExample:
    """One tokenised conversation."""

    input_ids: list[int]
    """Token ids of the whole rendered conversation."""
    loss_mask: list[int]
    """1 on assistant tokens (content, tool calls, end-of-turn token), else 0."""


def _render(tokenizer: Any, messages: Sequence[dict], tools: Any, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def assistant_char_spans(
    tokenizer: Any, messages: Sequence[dict], tools: Any = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant messages.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: OpenAI-style messages.
        tools: tool schemas passed to the template, if any.

    Returns:
        `(text, spans)` with `[start, end)` character spans.

    Raises:
        ValueError: no messages, no assistant message, or a template whose prefixes are not
            stable.
    """
    if not messages:
        raise ValueError("empty conversation")
    text = _render(tokenizer, messages, tools, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if not (text.startswith(before) and text.startswith(upto) and upto.startswith(before)):
            raise ValueError(
                f"chat template is not prefix-stable at message {i}: rendering the first "
                f"{i} messages is not a prefix of the whole conversation, so assistant "
                "tokens cannot be located"
            )
        end = len(upto.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    if not spans:
        raise ValueError("conversation has no assistant message to train on")
    return text, spans


def build_sft_example(
    tokenizer: Any, messages: Sequence[dict], tools: Any = None, max_length: int | None = None
) -> SFTExample:
    """Token ids and assistant-only loss mask of one conversation.

    Args:
        tokenizer: a fast tokenizer (offsets needed) with a chat template.
        messages: OpenAI-style messages (system / user / assistant / tool).
        tools: tool schemas for the template.
        max_length: truncate to this many tokens (None: no limit).

    Returns:
        The example; its loss mask may be all 0 if truncation cut every assistant token.
    """
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    text, spans = assistant_char_spans(tokenizer, messages, tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    mask = [0] * len(ids)
    span_index = 0
    for t, (start, _end) in enumerate(enc["offset_mapping"]):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= start:
            mask[t] = 1
    mask[0] = 0
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return SFTExample(input_ids=ids, loss_mask=mask)


def collate_sft(examples: Sequence[SFTExample], pad_id: int) -> TrainBatch:
    """Right-pad examples into a `TrainBatch` (no advantages)."""
    ids, attn, mask = pad_sequences(
        [e.input_ids for e in examples], [e.loss_mask for e in examples], pad_id
    )
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=mask)


@dataclass(frozen=True)
class SFTConfig:
    """Settings of an SFT run."""

    num_steps: int = 10
    """Optimizer steps to run."""
    global_batch_size: int = 8
    """Conversations per optimizer step [--global-batch-size]."""
    seed: int = 0
    """Seed of the data order (reshuffled every epoch)."""

    def __post_init__(self) -> None:
        if self.num_steps < 0 or self.global_batch_size < 1:
            raise ValueError("num_steps must be >= 0 and global_batch_size >= 1")


class SFTDataIterator:
    """Seeded, resumable order over examples: epoch-wise shuffles, a position to save."""

    def __init__(
        self,
        num_examples: int,
        seed: int,
        state: dict[str, int] | None = None,
        shuffle: bool = True,
    ):
        """Start at the beginning, or at `state` (from `state_dict`).

        Args:
            num_examples: dataset size.
            seed: seed of the per-epoch shuffles.
            state: a position from `state_dict`, to resume.
            shuffle: False keeps the dataset order in every epoch.
        """
        if num_examples < 1:
            raise ValueError("no examples to iterate over")
        self.num_examples = num_examples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = int(state["epoch"]) if state else 0
        self.index = int(state["index"]) if state else 0
        self._order = self._shuffle(self.epoch)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_indices(self, count: int) -> list[int]:
        """The next `count` example indices, crossing epochs as needed."""
        out: list[int] = []
        while len(out) < count:
            if self.index >= self.num_examples:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self._order[self.index])
            self.index += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The position, to store with a checkpoint."""
        return {"epoch": self.epoch, "index": self.index}


def run_sft(
    engine: Any,
    examples: Sequence[SFTExample],
    config: SFTConfig,
    pad_id: int,
    data: SFTDataIterator | None = None,
) -> list[dict[str, float]]:
    """Train `engine` (a `TorchEngine`) with the assistant-token NLL.

    Args:
        engine: the training engine.
        examples: tokenised conversations (those without loss tokens are dropped).
        config: steps, batch size and data seed.
        pad_id: padding token id.
        data: a resumed data iterator (default: a fresh one over the kept examples).

    Returns:
        The metrics of every step.
    """
    kept = [e for e in examples if any(e.loss_mask)]
    if not kept:
        raise ValueError("no example has an assistant token to train on")
    data = data or SFTDataIterator(len(kept), config.seed)
    history = []
    for _ in range(config.num_steps):
        batch = collate_sft([kept[i] for i in data.next_indices(config.global_batch_size)], pad_id)
        history.append(engine.train_step(batch, objective="sft"))
    return history


def loss_mask_text(tokenizer: Any, example: SFTExample) -> str:
    """The decoded text of the loss-masked tokens (for inspection and tests)."""
    ids = torch.tensor(example.input_ids)[torch.tensor(example.loss_mask, dtype=torch.bool)]
    return str(tokenizer.decode(ids.tolist()))


@torch.no_grad()
def greedy_match_rate(
    model: torch.nn.Module, examples: Sequence[SFTExample], pad_id: int, batch_size: int = 8
) -> float:
    """Fraction of examples whose every loss-masked token is the model's greedy choice.

    Teacher-forced: each assistant token is predicted from the gold conversation before it,
    so an example counts when greedy decoding of each of its assistant turns, given the gold
    context, would reproduce the turn exactly (one forward pass per batch, no generation).
    A probe of SFT progress that loss alone does not give: a conversation is only as right
    as its least likely token (a wrong digit of an order id ends the task).

    Args:
        model: a Hugging Face causal LM (e.g. ``TorchEngine.hf_model``).
        examples: probe conversations (from ``build_sft_example``), ideally not trained on.
        pad_id: padding token id.
        batch_size: rows per forward pass.

    Returns:
        The rate in [0, 1] over the examples that have an assistant token (0.0 if none has).
    """
    scored = [e for e in examples if any(e.loss_mask[1:])]
    if not scored:
        return 0.0
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits = 0
    try:
        for start in range(0, len(scored), batch_size):
            batch = collate_sft(scored[start : start + batch_size], pad_id).to(device)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            wrong = (logits[:, :-1].argmax(-1) != batch.input_ids[:, 1:]) & batch.loss_mask[
                :, 1:
            ].bool()
            hits += int((~wrong.any(dim=1)).sum())
    finally:
        model.train(was_training)
    return hits / len(scored)


@dataclass
class SFTStop:
    """When an SFT stage ends before its step count: a probe target or a time bound.

    Call :meth:`start` when the stage begins and :meth:`check` after every step; with
    neither a target nor a bound set it never stops a stage (a fixed step count).
    """

    probe: Sequence[SFTExample] = ()
    """Probe conversations for :func:`greedy_match_rate` (not trained on)."""
    pad_id: int = 0
    """Padding id of the tokenizer."""
    target: float = 0.0
    """Stop once the probe rate reaches this (0: never probe)."""
    interval: int = 25
    """Steps between probes."""
    max_seconds: float = 0.0
    """Stop after this many seconds of the stage (0: no bound)."""
    history: list[tuple[int, float]] = field(default_factory=list)
    """``(step, rate)`` of every probe so far."""
    last_probe: float | None = None
    """The rate the latest :meth:`check` measured, None when it did not probe."""
    _start: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.target <= 1:
            raise ValueError(f"target must be in [0, 1], got {self.target}")
        if self.target and not self.probe:
            raise ValueError("a probe target needs probe examples")
        if self.interval < 1 or self.max_seconds < 0:
            raise ValueError("interval must be >= 1 and max_seconds >= 0")

    def start(self) -> None:
        """Begin the time bound."""
        self._start = time.perf_counter()

    def check(self, model: torch.nn.Module, step: int, probe: bool = True) -> str | None:
        """The reason to stop after ``step`` (1-based, within the stage), or None.

        ``probe=False`` checks only the time bound (e.g. in a curriculum's first stage).
        """
        self.last_probe = None
        if self.max_seconds and time.perf_counter() - self._start > self.max_seconds:
            return f"time bound {self.max_seconds:g} s"
        if probe and self.target and step % self.interval == 0:
            rate = self.last_probe = greedy_match_rate(model, self.probe, self.pad_id)
            self.history.append((step, rate))
            if rate >= self.target:
                return f"probe {rate:.2f} >= {self.target:g}"
        return None
