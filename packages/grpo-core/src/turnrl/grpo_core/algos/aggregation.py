"""Reduce a per-token loss matrix to the scalar to backpropagate, exact under batching.

A mini-batch (one optimizer step) is split into micro-batches on each data-parallel rank.
The loss of one micro-batch must be normalised by the size of the *whole* mini-batch, not
of the micro-batch, or gradient accumulation weights tokens unevenly (the classic
token-mean bug). So the caller passes the global counts, and each micro-batch returns its
share; summing the micro-batches of every rank then gives exactly the loss of one batch.

Data-parallel gradient reductions (DDP, FSDP) *average* over ranks; `dp_size` multiplies
the share back so that the average equals the global sum. Pass `dp_size=1` when your
reduction sums instead.

Modes (verl's `loss_agg_mode` names):

- `token-mean`: sum of token losses / number of loss tokens in the mini-batch.
- `seq-mean-token-sum`: mean over sequences of each sequence's token sum.
- `seq-mean-token-mean`: mean over sequences of each sequence's token mean.
- `seq-mean-token-sum-norm` (Dr. GRPO): sum of token losses / (sequences * `norm_length`),
  with a constant `norm_length` (the generation budget), so long and short answers are
  weighted per token alike.

Sequences are counted only when they have at least one loss token.
"""

from __future__ import annotations

from typing import Literal

import torch

AggregationMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask` is 1 (all dims)."""
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def count_loss_tokens_and_seqs(mask: torch.Tensor) -> tuple[int, int]:
    """Loss tokens and sequences with at least one loss token in a `[B, L]` mask.

    Sum these over all micro-batches and ranks of a mini-batch to get the global counts.
    """
    return int(mask.sum().item()), int((mask.sum(dim=-1) > 0).sum().item())


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: AggregationMode = "token-mean",
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    dp_size: int = 1,
    norm_length: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss.

    Args:
        loss_mat: `[B, L]` per-token loss.
        mask: `[B, L]` 0/1 loss mask.
        mode: One of `AGGREGATION_MODES`.
        global_num_tokens: Loss tokens in the whole mini-batch (all micro-batches, all
            ranks); `token-mean` only. `None` means this micro-batch is the whole batch.
        global_num_seqs: Sequences (with >= 1 loss token) in the whole mini-batch; the
            `seq-*` modes. `None` means this micro-batch is the whole batch.
        dp_size: Ranks over which the gradient reduction averages (see module docstring).
        norm_length: `seq-mean-token-sum-norm` only: the constant length to divide by.

    Returns:
        Scalar loss (fp32 for 16-bit inputs). Summed over micro-batches (and averaged over `dp_size` ranks by the
        reduction) it equals the loss of the mini-batch computed in one piece.

    Raises:
        ValueError: On an unknown mode, mismatched shapes, `dp_size > 1` without global
            counts, non-positive counts, or a missing `norm_length`.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; choose one of {AGGREGATION_MODES}"
        )
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat and mask must both be [B, L]; got {tuple(loss_mat.shape)} and "
            f"{tuple(mask.shape)}"
        )
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if loss_mat.dtype in (torch.float16, torch.bfloat16):
        loss_mat = loss_mat.float()  # counts and sums above 256 are not exact in 16 bits
    mask = mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(dim=-1)  # [B]
    if mode == "token-mean":
        denom = _denominator(global_num_tokens, mask.sum(), dp_size, "global_num_tokens")
        return token_sums.sum() / denom * dp_size
    lengths = mask.sum(dim=-1)
    denom = _denominator(global_num_seqs, (lengths > 0).sum(), dp_size, "global_num_seqs")
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / denom * dp_size
    if mode == "seq-mean-token-mean":
        return (token_sums / lengths.clamp(min=1)).sum() / denom * dp_size
    if norm_length is None or norm_length <= 0:
        raise ValueError("seq-mean-token-sum-norm needs a positive constant norm_length")
    return token_sums.sum() / (denom * norm_length) * dp_size


def _denominator(given: float | None, local: torch.Tensor, dp_size: int, name: str) -> torch.Tensor:
    if given is None:
        if dp_size > 1:
            raise ValueError(f"dp_size={dp_size} needs {name} (the count over all ranks)")
        return local.clamp(min=1)
    if given <= 0:
        raise ValueError(f"{name} must be > 0, got {given}")
    return local.new_tensor(float(given))
