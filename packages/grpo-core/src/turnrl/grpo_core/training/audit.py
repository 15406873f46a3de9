"""Audit of exported trajectories: the trainer's log-probs of the ids a rollout sampled,
against the behaviour log-probs the engine reported, and the ids at turn boundaries.

:func:`audit` takes :class:`AuditSequence` records (ids, loss mask and behaviour log-probs
aligned with the ids: position ``t`` holds log pi(ids[t] | ids[<t]), ignored where the mask
is 0) and a trainer holding the weights that sampled them, built with the rollout's
temperature / top-p / top-k (``compute_logprobs``). It returns an :class:`AuditReport`:

- **gap**: |trainer - behaviour| log-prob of every loss-mask-1 token (p50/p90/p99/max, mean);
- **turn boundaries**: positions where the loss mask changes (0->1: a sampled turn starts,
  1->0: it ends); ``boundary gap``: the gap over the ``window`` sampled tokens next to each;
- **boundary mismatches** (with ``retokenize``: ids -> the ids of a fresh tokenisation of
  their text, what a pipeline that re-renders the history would train on): a boundary is a
  mismatch when the exported and the fresh ids differ within ``window`` tokens of it, the two
  aligned by their longest common runs (``difflib``); ``token mismatches`` counts the exported
  tokens in every run that differs, anywhere.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from turnrl.grpo_core.training.batch import TrainBatch, pad_sequences

Retokenize = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class AuditSequence:
    """One exported sequence (a gateway chain, or a trajectory's prompt + response)."""

    ids: list[int]
    loss_mask: list[int]
    """1 on sampled tokens, aligned with ``ids``."""
    logprobs: list[float]
    """Behaviour log-probs aligned with ``ids`` (what the engine reported; 0 off the mask)."""

    def __post_init__(self) -> None:
        if not len(self.ids) == len(self.loss_mask) == len(self.logprobs):
            raise ValueError(
                f"ids, loss_mask and logprobs differ in length: {len(self.ids)}, "
                f"{len(self.loss_mask)}, {len(self.logprobs)}"
            )
        if self.loss_mask and self.loss_mask[0]:
            raise ValueError("loss_mask[0] must be 0: the first token has no prediction")


@dataclass
class AuditReport:
    """What :func:`audit` found; :meth:`merge` adds another's, :meth:`summary` reports."""

    sequences: int = 0
    gaps: list[float] = field(default_factory=list)
    """|trainer - behaviour| of every sampled token."""
    boundaries: int = 0
    boundary_gaps: list[float] = field(default_factory=list)
    """The gaps of the ``window`` sampled tokens next to each boundary."""
    retokenized: bool = False
    """Whether boundaries were compared with a fresh tokenisation."""
    boundary_mismatches: int = 0
    token_mismatches: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    """The first few mismatches: sequence, position, exported and fresh ids."""

    def merge(self, other: AuditReport) -> AuditReport:
        """Both reports' counts and gaps, together."""
        return AuditReport(
            self.sequences + other.sequences,
            self.gaps + other.gaps,
            self.boundaries + other.boundaries,
            self.boundary_gaps + other.boundary_gaps,
            self.retokenized or other.retokenized,
            self.boundary_mismatches + other.boundary_mismatches,
            self.token_mismatches + other.token_mismatches,
            (self.examples + other.examples)[:MAX_EXAMPLES],
        )

    def summary(self) -> dict[str, Any]:
        """JSON-ready: counts, and the gaps' quantiles (None with no token)."""
        out: dict[str, Any] = {
            "sequences": self.sequences,
            "tokens": len(self.gaps),
            "gap": quantiles(self.gaps),
            "boundaries": self.boundaries,
            "boundary_gap": quantiles(self.boundary_gaps),
            "boundary_mismatches": self.boundary_mismatches if self.retokenized else None,
            "token_mismatches": self.token_mismatches if self.retokenized else None,
        }
        if self.examples:
            out["examples"] = self.examples
        return out


MAX_EXAMPLES = 5


def quantiles(values: Sequence[float]) -> dict[str, float] | None:
    """``p50``, ``p90``, ``p99`` (linear interpolation), ``max`` and ``mean`` of ``values``."""
    if not values:
        return None
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"p50": q[0], "p90": q[1], "p99": q[2], "max": float(t.max()), "mean": float(t.mean())}


def turn_boundaries(loss_mask: Sequence[int]) -> list[int]:
    """Positions ``t`` where ``loss_mask[t] != loss_mask[t - 1]``."""
    return [t for t in range(1, len(loss_mask)) if loss_mask[t] != loss_mask[t - 1]]


def differing_runs(exported: list[int], fresh: list[int]) -> list[tuple[int, int, int, int]]:
    """``(i1, i2, j1, j2)``: the runs where ``exported[i1:i2]`` and ``fresh[j1:j2]`` differ."""
    if exported == fresh:
        return []
    matcher = difflib.SequenceMatcher(None, exported, fresh, autojunk=False)
    return [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def audit(
    trainer: Any,
    sequences: Sequence[AuditSequence],
    *,
    retokenize: Retokenize | None = None,
    window: int = 2,
    pad_id: int = 0,
) -> AuditReport:
    """Score ``sequences`` with ``trainer.compute_logprobs`` and compare (module docstring).

    Raises:
        ValueError: a malformed sequence, or ``window`` < 1.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    report = AuditReport(retokenized=retokenize is not None)
    kept = [(i, s) for i, s in enumerate(sequences) if len(s.ids) >= 2 and any(s.loss_mask)]
    if not kept:
        return report
    ids, attention, mask = pad_sequences(
        [s.ids for _, s in kept], [s.loss_mask for _, s in kept], pad_id
    )
    trainer_logp = trainer.compute_logprobs(TrainBatch(ids, attention, mask))
    for row, (index, seq) in enumerate(kept):
        gap = [
            abs(float(trainer_logp[row, t]) - seq.logprobs[t]) if m else None
            for t, m in enumerate(seq.loss_mask)
        ]
        report.sequences += 1
        report.gaps += [g for g in gap if g is not None]
        bounds = turn_boundaries(seq.loss_mask)
        report.boundaries += len(bounds)
        for b in bounds:  # the sampled tokens on the boundary's sampled side
            near = range(b, b + window) if seq.loss_mask[b] else range(b - window, b)
            report.boundary_gaps += [
                g for t in near if 0 <= t < len(gap) and (g := gap[t]) is not None
            ]
        if retokenize is not None:
            _compare(report, index, seq.ids, retokenize(list(seq.ids)), bounds, window)
    return report


def _compare(
    report: AuditReport,
    index: int,
    exported: list[int],
    fresh: list[int],
    bounds: list[int],
    window: int,
) -> None:
    runs = differing_runs(exported, fresh)
    report.token_mismatches += sum(i2 - i1 for i1, i2, _, _ in runs)
    for b in bounds:
        hit = next(
            (r for r in runs if r[0] < b + window and max(r[1], r[0] + 1) > b - window), None
        )
        if hit is None:
            continue
        report.boundary_mismatches += 1
        if len(report.examples) < MAX_EXAMPLES:
            i1, i2, j1, j2 = hit
            report.examples.append(
                {
                    "sequence": index,
                    "boundary": b,
                    "exported": exported[i1:i2],
                    "fresh": fresh[j1:j2],
                }
            )
