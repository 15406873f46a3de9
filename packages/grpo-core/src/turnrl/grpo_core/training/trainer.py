"""The trainer interface: what the loop, the weight syncs, the reference policy, the
checkpoints and the trainer group use of a train engine, one instance per rank.

:class:`~turnrl.grpo_core.training.torch_engine.TorchEngine` (a Hugging Face model, FSDP2
over data-parallel ranks) and ``turnrl.grpo_core.megatron.engine.MegatronEngine``
(megatron-core, TP x PP x DP) implement it; both compose the same optimizer step,
:class:`~turnrl.grpo_core.training.torch_engine.TrainStep`. Which one a config builds is
``turnrl.grpo_core.backends.make_engine``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.torch_engine import TorchEngineConfig, TrainStep


@runtime_checkable
class Trainer(Protocol):
    """One rank of a train engine (attributes read-only to its users, ``step`` aside)."""

    @property
    def config(self) -> TorchEngineConfig: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def module(self) -> nn.Module:
        """Scores tokens: ``module(input_ids, attention_mask, loss_mask, ...) -> (logp, entropy)``."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def steps(self) -> TrainStep:
        """The optimizer step the engine composes."""
        ...

    @property
    def dp_size(self) -> int: ...

    @property
    def model_parallel_size(self) -> int: ...

    @property
    def model_parallel_rank(self) -> int: ...

    step: int
    """Optimizer steps taken (set when a checkpoint is restored)."""

    def parallel_layout(self) -> tuple[int, int]:
        """``(data-parallel size, model-parallel size)``."""
        ...

    def compute_logprobs(
        self, batch: TrainBatch, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """``[B, L]`` fp32 log-probs of the loss-masked tokens, no gradient."""
        ...

    def train_step(
        self, batch: TrainBatch | Sequence[TrainBatch], objective: str = "rl"
    ) -> dict[str, float]:
        """One optimizer step over a mini-batch (``rl`` or ``sft``); its metrics."""
        ...

    def lr_at(self, step: int) -> float: ...

    def hf_snapshot(self) -> nn.Module:
        """A transformers model holding the current weights."""
        ...

    def save_checkpoint(
        self, folder: str | Path, data_state: dict[str, Any] | None = None
    ) -> Path: ...

    def load_checkpoint(self, folder: str | Path) -> dict[str, Any]: ...

    def export_hf(self, folder: str | Path, dtype: Any = None) -> Path:
        """The current weights as a Hugging Face folder an engine loads."""
        ...

    def close(self) -> None: ...
