"""Token-budget batching: pack variable-length samples into micro-batches per rank.

Dynamic batching (slime's `--use-dynamic-batch-size --max-tokens-per-gpu`, verl's
`use_dynamic_bsz`) replaces a fixed micro-batch size by a token budget: each micro-batch
holds as many samples as fit under `max_tokens`. With data parallelism every rank must run
the same number of micro-batches (each one ends in a collective), so the plan is made for
all ranks at once:

1. k = ceil(total tokens / max_tokens), rounded up to a multiple of `dp_size`;
2. try to place the samples, longest first, into k bins: worst-fit (least-loaded bin,
   which balances the bins), then best-fit (tightest bin, which packs best); if neither
   fits everything, k += dp_size and retry;
3. deal the bins to ranks, heaviest first, each to the rank with the fewest tokens among
   those that still need bins, so every rank gets k / dp_size micro-batches.

A sample longer than `max_tokens` is an error by default (it would not fit in the memory
the budget was chosen for); with `allow_oversize=True` it gets a micro-batch of its own
and a warning. When the samples cannot fill every micro-batch (15 samples of 4,000 tokens
under a budget of 6,144 on 2 ranks need 15 micro-batches, rounded up to 16) some are
empty: the training step must still run them, with zero loss, to keep ranks in step (the
loop runs a filler row with an all-zero loss mask, ``loop.loop.filler_micro_batch``).
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class PackingPlan:
    """Micro-batches per data-parallel rank, as indices into the input lengths."""

    micro_batches: list[list[list[int]]]
    """`micro_batches[rank][m]` lists the sample indices of micro-batch m on that rank."""
    max_tokens: int
    """The per-micro-batch token budget the plan was made for."""
    total_tokens: int
    """Sum of all sample lengths."""

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.micro_batches[0])

    @property
    def utilisation(self) -> float:
        """Tokens used / tokens budgeted over all micro-batches (1.0 is perfect packing)."""
        slots = self.num_micro_batches * len(self.micro_batches) * self.max_tokens
        return self.total_tokens / slots if slots else 0.0

    def rank_tokens(self, lengths: Sequence[int]) -> list[int]:
        """Tokens per rank for the `lengths` the plan was made from."""
        return [sum(lengths[i] for mb in rank for i in mb) for rank in self.micro_batches]


def _validate(lengths: Sequence[int], max_tokens: int, dp_size: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if len(lengths) < dp_size:
        raise ValueError(f"{len(lengths)} samples cannot feed {dp_size} data-parallel ranks")
    bad = [i for i, n in enumerate(lengths) if int(n) != n or n < 1]
    if bad:
        raise ValueError(f"sample lengths must be positive integers; bad at indices {bad[:10]}")


def _fit(
    order: list[int], lengths: Sequence[int], num_bins: int, max_tokens: int, worst: bool
) -> list[list[int]] | None:
    """Place samples (longest first) into `num_bins` bins; None if one does not fit."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    if worst:
        heap = [(0, b) for b in range(num_bins)]
        for i in order:
            load, b = heapq.heappop(heap)
            if load + lengths[i] > max_tokens:
                return None
            bins[b].append(i)
            heapq.heappush(heap, (load + lengths[i], b))
        return bins
    loads = [0] * num_bins
    for i in order:
        room = [(max_tokens - loads[b] - lengths[i], b) for b in range(num_bins)]
        fitting = [r for r in room if r[0] >= 0]
        if not fitting:
            return None
        _, b = min(fitting)
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def _deal_to_ranks(
    bins: list[list[int]], lengths: Sequence[int], dp_size: int
) -> list[list[list[int]]]:
    per_rank = len(bins) // dp_size
    ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for mb in sorted(bins, key=lambda b: -sum(lengths[i] for i in b)):
        r = min((r for r in range(dp_size) if len(ranks[r]) < per_rank), key=lambda r: loads[r])
        ranks[r].append(mb)
        loads[r] += sum(lengths[i] for i in mb)
    return ranks


def pack_micro_batches(
    lengths: Sequence[int], max_tokens: int, dp_size: int = 1, *, allow_oversize: bool = False
) -> PackingPlan:
    """Plan micro-batches under a token budget, the same number on every rank.

    Args:
        lengths: Token count of each sample (prompt + response).
        max_tokens: Token budget of one micro-batch on one device.
        dp_size: Number of data-parallel ranks.
        allow_oversize: Give a sample longer than `max_tokens` its own micro-batch (with a
            warning) instead of raising.

    Returns:
        A `PackingPlan` (every input index appears in exactly one micro-batch).

    Raises:
        ValueError: On non-positive lengths/budget/ranks, fewer samples than ranks, or an
            oversize sample when `allow_oversize` is False.
    """
    _validate(lengths, max_tokens, dp_size)
    lengths = [int(n) for n in lengths]
    oversize = [i for i, n in enumerate(lengths) if n > max_tokens]
    if oversize and not allow_oversize:
        raise ValueError(
            f"samples {oversize[:10]} are longer than max_tokens={max_tokens} "
            f"(longest {max(lengths)}); raise the budget or pass allow_oversize=True"
        )
    if oversize:
        warnings.warn(
            f"{len(oversize)} samples exceed max_tokens={max_tokens}; each gets its own "
            "micro-batch",
            stacklevel=2,
        )
    rest = sorted(
        (i for i in range(len(lengths)) if lengths[i] <= max_tokens), key=lambda i: -lengths[i]
    )
    need = math.ceil(sum(lengths[i] for i in rest) / max_tokens)
    num_bins = math.ceil((need + len(oversize)) / dp_size) * dp_size
    while True:
        packable = num_bins - len(oversize)
        bins = _fit(rest, lengths, packable, max_tokens, worst=True)
        if bins is None:
            bins = _fit(rest, lengths, packable, max_tokens, worst=False)
        if bins is not None:
            break
        num_bins += dp_size
    bins += [[i] for i in oversize]
    return PackingPlan(
        micro_batches=_deal_to_ranks(bins, lengths, dp_size),
        max_tokens=max_tokens,
        total_tokens=sum(lengths),
    )
