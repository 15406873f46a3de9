"""The tensor batch a training engine consumes, and its split into micro-batches.

Every per-token tensor is aligned with `input_ids` (prompt and response concatenated,
right-padded): position `t` holds the value *for token t*, predicted from tokens `< t`.
So `loss_mask[:, 0]` is always 0, and `old_logprobs[:, t]` is log pi_old(input_ids[t] | <t).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch


@dataclass
class TrainBatch:
    """One batch of token sequences with their loss mask and RL quantities."""

    input_ids: torch.Tensor
    """`[B, L]` int64 token ids (prompt + response), right-padded."""
    attention_mask: torch.Tensor
    """`[B, L]` 1 on real tokens, 0 on right padding."""
    loss_mask: torch.Tensor
    """`[B, L]` 1 on tokens to train on (policy-generated), 0 elsewhere; column 0 is 0."""
    advantages: torch.Tensor | None = None
    """`[B]` per-sequence or `[B, L]` per-token advantages (RL); `None` for SFT."""
    old_logprobs: torch.Tensor | None = None
    """`[B, L]` log-probs under the policy that sampled the batch (trainer recompute);
    `None` means on-policy (the current log-probs, detached)."""
    ref_logprobs: torch.Tensor | None = None
    """`[B, L]` log-probs under the reference model, for the KL loss."""
    rollout_logprobs: torch.Tensor | None = None
    """`[B, L]` log-probs reported by the rollout engine, for truncated importance sampling."""
    versions: torch.Tensor | None = None
    """`[B, L]` int64 weight version each token was sampled with (-1 off the policy tokens
    or where unknown), for staleness metrics and off-policy corrections."""

    def __post_init__(self) -> None:
        ids = self.input_ids
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids must be an integer [B, L] tensor, got {ids.dtype} {tuple(ids.shape)}"
            )
        if ids.shape[0] == 0 or ids.shape[1] < 2:
            raise ValueError(f"need at least one sequence of >= 2 tokens, got {tuple(ids.shape)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("input_ids", "advantages"):
                continue
            if value.shape != ids.shape:
                raise ValueError(
                    f"{f.name} has shape {tuple(value.shape)}, expected {tuple(ids.shape)}"
                )
        adv = self.advantages
        if adv is not None and adv.shape not in (ids.shape[:1], ids.shape):
            raise ValueError(f"advantages must be [B] or [B, L], got {tuple(adv.shape)}")
        if bool(self.loss_mask[:, 0].any()):
            raise ValueError("loss_mask[:, 0] must be 0: the first token has no prediction")
        if bool((self.loss_mask.bool() & ~self.attention_mask.bool()).any()):
            raise ValueError("loss_mask is 1 on a padding position (attention_mask 0)")

    @property
    def num_sequences(self) -> int:
        """Rows in the batch."""
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Tokens with loss mask 1."""
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device) -> TrainBatch:
        """A copy with every tensor moved to `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if getattr(self, f.name) is not None
        }
        return replace(self, **moved)

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        """The sub-batch of the given rows, trimmed to its longest real sequence."""
        length = int(self.attention_mask[rows].sum(dim=-1).max().item())
        length = max(length, 2)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            value = value[rows]
            out[f.name] = value if value.dim() == 1 else value[:, :length]
        return TrainBatch(**out)

    def micro_batches(self, micro_batch_size: int) -> Iterator[TrainBatch]:
        """Consecutive row chunks of at most `micro_batch_size` sequences."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        for start in range(0, self.num_sequences, micro_batch_size):
            yield self.select(slice(start, start + micro_batch_size))


def pad_sequences(
    sequences: list[list[int]], loss_masks: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad token lists into `input_ids`, `attention_mask`, `loss_mask` tensors.

    Args:
        sequences: token ids per sequence (non-empty).
        loss_masks: 0/1 per token, same lengths as `sequences`.
        pad_id: id written on padding positions.

    Returns:
        `[B, L]` input_ids (int64), attention_mask and loss_mask (int64).
    """
    if not sequences:
        raise ValueError("no sequences to pad")
    if len(sequences) != len(loss_masks):
        raise ValueError(f"{len(sequences)} sequences but {len(loss_masks)} loss masks")
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.int64)
    attn = torch.zeros((len(sequences), length), dtype=torch.int64)
    mask = torch.zeros((len(sequences), length), dtype=torch.int64)
    for row, (seq, m) in enumerate(zip(sequences, loss_masks, strict=True)):
        if len(seq) != len(m):
            raise ValueError(f"sequence {row}: {len(seq)} tokens but {len(m)} loss-mask entries")
        if not seq:
            raise ValueError(f"sequence {row} is empty")
        ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
        attn[row, : len(seq)] = 1
        mask[row, : len(seq)] = torch.as_tensor(m, dtype=torch.int64)
    return ids, attn, mask
