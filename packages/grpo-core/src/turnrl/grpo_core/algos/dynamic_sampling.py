"""DAPO dynamic sampling: keep only groups whose rewards differ, sample more until enough.

A group whose samples all got the same reward has zero GRPO advantage everywhere and
contributes no gradient, only noise in the token normalisation. DAPO drops such groups
and keeps generating until the batch holds the target number of informative groups.

`dynamic_sampling_filter` is the pure filter for one batch. `DynamicSampler` is the small
stateful helper for the loop: feed it each generated batch, it accumulates kept groups,
says whether more sampling is needed, and raises after `max_tries` batches that still did
not reach the target. Samples of one group may arrive split across batches when
`group_size` is given: an incomplete group waits until its missing samples arrive.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from turnrl.grpo_core.algos.advantages import GroupIds


@dataclass
class FilterResult:
    """Outcome of filtering one batch of samples by group reward variance."""

    keep: torch.Tensor
    """`[B]` bool: sample i belongs to a kept group."""
    kept_groups: list[Hashable]
    """Ids of groups with at least two samples and rewards that are not all equal."""
    dropped_groups: list[Hashable]
    """Ids of the other groups (constant reward, or a single sample)."""


def _as_id_list(group_ids: GroupIds, n: int) -> list[Hashable]:
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != n:
        raise ValueError(f"got {len(ids)} group ids for {n} rewards")
    return ids


def dynamic_sampling_filter(
    rewards: torch.Tensor | Sequence[float], group_ids: GroupIds, *, min_std: float = 0.0
) -> FilterResult:
    """Keep the groups whose rewards vary (std > `min_std`); singleton groups are dropped.

    Args:
        rewards: `[B]` per-sample rewards (the metric DAPO filters on, usually the score).
        group_ids: `[B]` group id per sample, any order.
        min_std: Groups with unbiased reward std <= this are dropped (0: any variation).

    Returns:
        A `FilterResult`; group lists are in order of first appearance.

    Raises:
        ValueError: On mismatched lengths, a non-1-D or non-finite reward tensor, or a
            negative `min_std`.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 1 or not torch.isfinite(r).all():
        raise ValueError("rewards must be a finite 1-D sequence")
    if min_std < 0:
        raise ValueError(f"min_std must be >= 0, got {min_std}")
    ids = _as_id_list(group_ids, r.shape[0])
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(ids):
        members.setdefault(g, []).append(i)
    kept, dropped = [], []
    keep = torch.zeros(r.shape[0], dtype=torch.bool)
    for g, idx in members.items():
        if len(idx) > 1 and float(r[idx].std()) > min_std:
            kept.append(g)
            keep[idx] = True
        else:
            dropped.append(g)
    return FilterResult(keep=keep, kept_groups=kept, dropped_groups=dropped)


@dataclass
class SamplerStatus:
    """What `DynamicSampler.add` reports after each batch."""

    num_kept_groups: int
    """Informative groups accumulated so far (capped at the target when done)."""
    need_more: bool
    """True when fewer than `target_num_groups` groups are kept: generate another batch."""
    newly_kept: list[Hashable] = field(default_factory=list)
    """Groups this batch completed and kept."""
    newly_dropped: list[Hashable] = field(default_factory=list)
    """Groups this batch completed and dropped."""


class DynamicSampler:
    """Accumulate informative groups over generation rounds (DAPO's dynamic sampling).

    Args:
        target_num_groups: Groups needed for one training batch.
        max_tries: Batches to accept before giving up with an error (DAPO's
            `max_num_gen_batches`).
        group_size: Samples per group; when set, a group is judged only once complete
            (its samples may arrive across batches). `None`: judge each batch's groups as
            they are.
        min_std: See `dynamic_sampling_filter`.
    """

    def __init__(
        self,
        target_num_groups: int,
        max_tries: int = 10,
        group_size: int | None = None,
        min_std: float = 0.0,
    ) -> None:
        if target_num_groups < 1 or max_tries < 1:
            raise ValueError("target_num_groups and max_tries must be >= 1")
        if group_size is not None and group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (variance needs two samples), got {group_size}"
            )
        self.target_num_groups = target_num_groups
        self.max_tries = max_tries
        self.group_size = group_size
        self.min_std = min_std
        self.tries = 0
        self.kept: dict[Hashable, list[float]] = {}
        self._pending: dict[Hashable, list[float]] = {}

    def add(self, rewards: torch.Tensor | Sequence[float], group_ids: GroupIds) -> SamplerStatus:
        """Feed one generated batch; return whether more sampling is needed.

        Raises:
            RuntimeError: When this was try number `max_tries` and the target is not met.
            ValueError: On bad inputs, or a group with more than `group_size` samples.
        """
        self.tries += 1
        r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1).tolist()
        ids = _as_id_list(group_ids, len(r))
        for g, value in zip(ids, r, strict=True):
            if g in self.kept:
                raise ValueError(f"group {g!r} was already judged; got another sample for it")
            self._pending.setdefault(g, []).append(value)
        ready = {
            g: v
            for g, v in self._pending.items()
            if self.group_size is None or len(v) >= self.group_size
        }
        if self.group_size is not None and any(len(v) > self.group_size for v in ready.values()):
            raise ValueError(f"a group has more than group_size={self.group_size} samples")
        ready_ids = [g for g, v in ready.items() for _ in v]
        result = dynamic_sampling_filter(
            [x for v in ready.values() for x in v], ready_ids, min_std=self.min_std
        )
        for g in ready:
            del self._pending[g]
        for g in result.kept_groups:
            self.kept[g] = ready[g]
        need_more = len(self.kept) < self.target_num_groups
        if need_more and self.tries >= self.max_tries:
            raise RuntimeError(
                f"dynamic sampling kept {len(self.kept)} of {self.target_num_groups} groups "
                f"after {self.tries} tries (max_tries={self.max_tries}); rewards are too uniform "
                "(all right or all wrong): raise max_tries or change the data/difficulty"
            )
        return SamplerStatus(
            num_kept_groups=min(len(self.kept), self.target_num_groups),
            need_more=need_more,
            newly_kept=result.kept_groups,
            newly_dropped=result.dropped_groups,
        )

    def selected_groups(self) -> list[Hashable]:
        """The first `target_num_groups` kept groups, in the order they were kept."""
        return list(self.kept)[: self.target_num_groups]
