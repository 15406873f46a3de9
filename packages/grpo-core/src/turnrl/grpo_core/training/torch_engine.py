"""The torch training engine: a Hugging Face causal LM trained with GRPO or SFT losses.

One `TorchEngine` per process. It loads the model from a local folder (safetensors),
keeps fp32 master weights (bf16 compute through autocast when `dtype="bfloat16"`), shards
it with FSDP2 (`fully_shard` per decoder layer, then the root) when `torch.distributed`
runs with more than one rank, and optimises with AdamW. A train step takes a mini-batch,
splits it into micro-batches (gradient accumulation), scores tokens with the chunked
log-prob (never the full logit matrix), computes the loss of `loss.py` normalised by the
counts of the whole mini-batch across ranks, clips the gradient norm and steps.

Checkpoints (`checkpoint.py`) hold model, optimizer, RNG states, step and the caller's
data position, and resume exactly; `export_hf` writes a Hugging Face folder that vLLM
loads (on CPU that is also the weight-sync path: export, then the engine reloads it).

Device placement goes through `turnrl.npu_runtime.device` only.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.algos.logprobs import check_sampling
from turnrl.grpo_core.settings import setting
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.loss import (
    SHARE_METRICS,
    BatchCounts,
    check_loss_config,
    rl_loss,
    sft_loss,
)
from turnrl.grpo_core.training.policy import (
    CausalLMLogProbs,
    DType,
    load_causal_lm,
    resolve_dtype,
)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings (slime flag names in brackets)."""

    lr: float = setting(1e-6, "--lr")
    """Learning rate, constant."""
    adam_beta1: float = setting(0.9, "--adam-beta1")
    """AdamW beta1."""
    adam_beta2: float = setting(0.98, "--adam-beta2")
    """AdamW beta2."""
    adam_eps: float = setting(1e-8, "--adam-eps")
    """AdamW epsilon."""
    weight_decay: float = setting(0.1, "--weight-decay")
    """Decoupled weight decay of the weight matrices (not of biases and norms)."""
    clip_grad: float = 1.0
    """Max global gradient norm; <= 0 only measures the norm [--clip-grad]."""
    lr_warmup_steps: int = setting(0, "--lr-warmup-iters")
    """Optimizer steps over which the lr rises linearly to ``lr``; a fresh
    AdamW moves every weight by about ``lr`` on its first steps (sign-like updates), which a
    small, sharply trained model may not survive at full lr."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.adam_eps <= 0:
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(
                f"adam betas must be in [0, 1), got {self.adam_beta1}, {self.adam_beta2}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True)
class TorchEngineConfig:
    """Everything the torch engine needs."""

    model_path: str
    """Local Hugging Face folder (config.json + safetensors) to start from [--hf-checkpoint]."""
    dtype: DType = "float32"
    """Compute dtype: float32, or bfloat16 through autocast with fp32 master weights."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW settings."""
    loss: ActorLossConfig = field(default_factory=ActorLossConfig)
    """Actor-loss settings of the algorithms (clip, KL, entropy, aggregation, TIS)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch when a train step gets one batch (gradient accumulation)."""
    gradient_checkpointing: bool = False
    """Recompute decoder layers in backward to save activation memory [--recompute-*]."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the log-prob computation (memory ~ chunk x vocab)."""
    temperature: float = 1.0
    """Rollout sampling temperature; logits are divided by it [--rollout-temperature]."""
    top_p: float = 1.0
    """Rollout nucleus mass: log-probs are over the top-p set the engine sampled from
    (1 = off) [--rollout-top-p]."""
    top_k: int = -1
    """Rollout top-k, likewise (-1 = off) [--rollout-top-k]."""
    seed: int = 1234
    """Seed of torch and Python RNGs at start-up [--seed]."""
    memory_margin_bytes: int = 0
    """Device memory that must be free when a train step starts, else the step stops with
    an error naming the flag instead of running out of memory inside a kernel (colocated
    engines hold the rest); 0 checks nothing. Devices only [--train-memory-margin-bytes]."""

    def __post_init__(self) -> None:
        if self.memory_margin_bytes < 0:
            raise ValueError(f"memory_margin_bytes must be >= 0, got {self.memory_margin_bytes}")
        resolve_dtype(self.dtype)
        check_loss_config(self.loss)
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        check_sampling(self.temperature, self.top_p, self.top_k)


def world_size() -> int:
    """Ranks in the default process group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def training_device() -> torch.device:
    """The device this rank trains on, from `turnrl.npu_runtime` (npu / cuda / cpu)."""
    from turnrl.npu_runtime.device import DeviceType, detect_device, set_device, torch_device

    kind = detect_device()
    if kind is DeviceType.CPU:
        return torch.device("cpu")
    local = rank() % max(1, _local_world_size())
    set_device(local, kind)
    return torch.device(torch_device(local, kind))


def _local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


@dataclass
class LossTally:
    """The metrics of a train step's micro-batches as they are computed: mini-batch shares
    (summed) and per-token means (weighted by each micro-batch's loss tokens)."""

    shares: dict[str, float] = field(default_factory=lambda: {"loss": 0.0})
    weighted: dict[str, float] = field(default_factory=dict)


class TrainStep:
    """The optimizer step both trainers compose (:class:`TorchEngine`, and ``MegatronEngine``
    with its pipeline schedule and model-parallel clipping): micro-batch accumulation of the
    GRPO-family or SFT loss normalised by the whole mini-batch's counts across data-parallel
    ranks, metric reduction, learning-rate warm-up, gradient clipping and the optimizer step.

    ``accumulate`` / ``clip_and_step`` replace how the micro-batches run and how gradients
    are finished (the defaults: :meth:`accumulate`, :meth:`clip_and_step`)."""

    def __init__(
        self,
        config: TorchEngineConfig,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        dp_size: int = 1,
        dp_group: Any = None,
        *,
        accumulate: Callable[[list[TrainBatch], str, BatchCounts], dict[str, float]] | None = None,
        clip_and_step: Callable[[], float] | None = None,
    ):
        self.config = config
        self.module = module
        self.optimizer = optimizer
        self.device = device
        self.compute_dtype = resolve_dtype(config.dtype)
        self.dp_size = dp_size
        self.dp_group = dp_group  # the ranks that split the data (None: all of them)
        self._accumulate = accumulate or self.accumulate
        self._clip_and_step = clip_and_step or self.clip_and_step
        self.step = 0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def run(self, batch: TrainBatch | Sequence[TrainBatch], objective: str) -> dict[str, float]:
        """One optimizer step (see :meth:`TorchEngine.train_step`)."""
        if objective not in ("rl", "sft"):
            raise ValueError(f"objective must be 'rl' or 'sft', got {objective!r}")
        self.check_memory_margin()
        start = time.perf_counter()
        if isinstance(batch, TrainBatch):
            micro = list(batch.micro_batches(self.config.micro_batch_size))
        else:
            micro = list(batch)
        if not micro:
            raise ValueError("train_step got no micro-batches")
        counts = self.global_counts(micro)
        self.module.train()
        warmup = self.config.optimizer.lr_warmup_steps
        if warmup and self.step <= warmup:
            # Only through the warm-up: a caller's own schedule (param_groups) rules after it.
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        out = self._accumulate(equalise_micro_batches(micro, self.device), objective, counts)
        out["grad_norm"] = self._clip_and_step()
        self.step += 1
        out.update(
            lr=self.optimizer.param_groups[0]["lr"],
            num_tokens=counts.num_tokens,
            step_time_s=time.perf_counter() - start,
        )
        return out

    def check_memory_margin(self) -> None:
        """Raise MemoryError when less than ``memory_margin_bytes`` of the device is free.

        Raises:
            ValueError: a margin on the CPU, which has no device memory to keep free.
        """
        margin = self.config.memory_margin_bytes
        if not margin:
            return
        if self.device.type == "cpu":
            raise ValueError(
                f"--train-memory-margin-bytes {margin}: the CPU has no device memory to keep "
                "free (use 0)"
            )
        free, _ = getattr(torch, self.device.type).mem_get_info(self.device)
        if free < margin:
            raise MemoryError(
                f"--train-memory-margin-bytes {margin}: only {free} bytes of {self.device} are "
                "free before the train step (are colocated engines asleep?)"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): linear warm-up, then flat."""
        opt = self.config.optimizer
        if step >= opt.lr_warmup_steps:
            return opt.lr
        return opt.lr * (step + 1) / opt.lr_warmup_steps

    def forward(
        self, batch: TrainBatch, return_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.autocast():
            return self.module(
                batch.input_ids,
                batch.attention_mask,
                batch.loss_mask,
                return_entropy=return_entropy,
                compute_dtype=self.compute_dtype,
            )

    def accumulate(
        self, micro: list[TrainBatch], objective: str, counts: BatchCounts
    ) -> dict[str, float]:
        """Forward + backward every micro-batch (gradients add up); reduce the metrics."""
        tally = LossTally()
        want_entropy = self.wants_entropy(objective)
        for mb in micro:
            mb = mb.to(self.device)
            logp, entropy = self.forward(mb, return_entropy=want_entropy)
            self.micro_loss(logp, entropy, mb, objective, counts, tally).backward()
        return self.reduce_metrics(tally, micro)

    def wants_entropy(self, objective: str) -> bool:
        return objective == "rl" and self.config.loss.entropy_coef > 0

    def micro_loss(
        self,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        mb: TrainBatch,
        objective: str,
        counts: BatchCounts,
        tally: LossTally,
    ) -> torch.Tensor:
        """One micro-batch's share of the mini-batch loss (to backward); its metrics go to
        ``tally``."""
        if objective == "rl":
            loss, metrics = rl_loss(logp, entropy, mb, self.config.loss, counts)
        else:
            loss, metrics = sft_loss(logp, mb, counts, self.config.loss.loss_agg_mode)
        tally.shares["loss"] += float(loss.detach())
        for key, value in metrics.items():
            if key in SHARE_METRICS:
                tally.shares[key] = tally.shares.get(key, 0.0) + value
            else:
                tally.weighted[key] = tally.weighted.get(key, 0.0) + value * mb.num_loss_tokens
        return loss

    def reduce_metrics(self, tally: LossTally, micro: list[TrainBatch]) -> dict[str, float]:
        """The step's metrics from this rank's micro-batches (shares summed over DP)."""
        local_tokens = max(1, sum(mb.num_loss_tokens for mb in micro))
        out = {key: value / local_tokens for key, value in tally.weighted.items()}
        for key, value in tally.shares.items():  # each rank's share is scaled by dp_size
            out[key] = self.dp_sum(value / self.dp_size)
        return out

    def dp_sum(self, value: float) -> float:
        """Sum a float over the data-parallel ranks."""
        if self.dp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return float(t[0])

    def global_counts(self, micro: list[TrainBatch]) -> BatchCounts:
        tokens = sum(mb.num_loss_tokens for mb in micro)
        seqs = sum(int((mb.loss_mask.sum(dim=-1) > 0).sum()) for mb in micro)
        if self.dp_size > 1:
            both = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
            dist.all_reduce(both, group=self.dp_group)
            tokens, seqs = int(both[0]), int(both[1])
        if tokens == 0:
            raise ValueError("the mini-batch has no loss tokens (loss_mask is all 0)")
        return BatchCounts(num_tokens=tokens, num_seqs=seqs, dp_size=self.dp_size)

    def clip_and_step(self) -> float:
        max_norm = self.config.optimizer.clip_grad
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        self.optimizer.step()
        return float(norm)


class TorchEngine:
    """Trains a Hugging Face causal LM; one instance per rank."""

    def __init__(self, config: TorchEngineConfig):
        """Load the model, shard it when distributed, and build the optimizer.

        Args:
            config: engine settings.
        """
        self.config = config
        self.device = training_device()
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.hf_model = load_causal_lm(config.model_path, torch.float32)
        if config.gradient_checkpointing:
            _enable_activation_checkpointing(self.hf_model)
        self.hf_model.to(self.device)
        self.module: nn.Module = CausalLMLogProbs(
            self.hf_model, config.logprob_chunk_size, config.temperature, config.top_p, config.top_k
        )
        self.dp_size = world_size()
        self.model_parallel_size, self.model_parallel_rank = 1, 0  # ranks per model copy
        if self.dp_size > 1:
            shard_fsdp2(self.module, self.hf_model, self.device)
        self.optimizer = make_optimizer(self.module, config.optimizer)
        self.steps = TrainStep(config, self.module, self.optimizer, self.device, self.dp_size)

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by :meth:`load_checkpoint`)."""
        return self.steps.step

    @step.setter
    def step(self, value: int) -> None:
        self.steps.step = value

    def parallel_layout(self) -> tuple[int, int]:
        """``(data-parallel size, model-parallel size)``: rank ``r`` trains on data share
        ``r // model-parallel size`` (the ranks of one model copy are adjacent)."""
        return self.dp_size, self.model_parallel_size

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """Log-probs of the loss-masked tokens under the current weights (no gradient).

        Use it for `old_logprobs` before several updates on one rollout batch.

        Args:
            batch: the sequences to score.
            micro_batch_size: rows per forward (default: the config's).

        Returns:
            `[B, L]` fp32 log-probs on the CPU, 0 where the loss mask is 0.
        """
        return score_batch(
            lambda mb: self.steps.forward(mb)[0],
            batch,
            micro_batch_size or self.config.micro_batch_size,
            self.device,
        )

    def train_step(
        self, batch: TrainBatch | Sequence[TrainBatch], objective: str = "rl"
    ) -> dict[str, float]:
        """One optimizer step over a mini-batch, accumulating gradients over micro-batches.

        Args:
            batch: a mini-batch (split into `micro_batch_size` rows) or its micro-batches
                (e.g. from token-budget packing); on several ranks, this rank's share.
            objective: `rl` (GRPO loss, needs advantages) or `sft` (masked NLL).

        Returns:
            Metrics: `loss` (the mini-batch loss, all ranks), `grad_norm`, `lr`,
            `num_tokens`, `step_time_s`; the mini-batch `pg_loss` / `kl_loss`; and this
            rank's token-weighted means of the other loss metrics (`clip_frac`, ...).
        """
        return self.steps.run(batch, objective)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): linear warm-up, then flat."""
        return self.steps.lr_at(step)

    def hf_snapshot(self) -> nn.Module:
        """A transformers model with the current weights: here the trained model itself."""
        return self.hf_model

    # -- state -------------------------------------------------------------------------

    def save_checkpoint(self, folder: str | Path, data_state: dict[str, Any] | None = None) -> Path:
        """Save model, optimizer, RNG states, step and `data_state` (see `checkpoint.py`)."""
        from turnrl.grpo_core.training.checkpoint import save_checkpoint

        return save_checkpoint(self, Path(folder), data_state or {})

    def load_checkpoint(self, folder: str | Path) -> dict[str, Any]:
        """Restore a checkpoint saved by `save_checkpoint`; returns its `data_state`."""
        from turnrl.grpo_core.training.checkpoint import load_checkpoint

        return load_checkpoint(self, Path(folder))

    def export_hf(self, folder: str | Path, dtype: DType | None = None) -> Path:
        """Write the current weights as a Hugging Face folder (see `checkpoint.export_hf`)."""
        from turnrl.grpo_core.training.checkpoint import export_hf

        return export_hf(self, Path(folder), dtype or self.config.dtype)

    def close(self) -> None:
        """Nothing to tear down (the process group belongs to whoever started it)."""


def make_optimizer(module: nn.Module, opt: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay) over every parameter of ``module``, with weight decay
    only on the matrices: biases and 1-D parameters (the norms' weights) are not decayed, as
    in Megatron's ``get_param_groups`` (the megatron engine builds its AdamW here too)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in module.named_parameters():
        (no_decay if param.ndim == 1 or name.endswith(".bias") else decay).append(param)
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [group for group in groups if group["params"]],
        lr=opt.lr,
        betas=(opt.adam_beta1, opt.adam_beta2),
        eps=opt.adam_eps,
        weight_decay=opt.weight_decay,
    )


def score_batch(
    forward: Any, batch: TrainBatch, micro_batch_size: int, device: torch.device
) -> torch.Tensor:
    """Run `forward(micro_batch) -> [b, l] logp` over row chunks; return `[B, L]` on CPU."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    micro = list(batch.micro_batches(micro_batch_size))
    for index, mb in enumerate(equalise_micro_batches(micro, device)):
        logp = forward(mb.to(device)).float().cpu()
        if index < len(micro):
            start = index * micro_batch_size
            out[start : start + logp.shape[0], : logp.shape[1]] = logp
    return out


def equalise_micro_batches(micro: list[TrainBatch], device: torch.device) -> list[TrainBatch]:
    """Pad this rank's micro-batches to the largest count over ranks.

    FSDP2 runs collectives in every forward and backward, so every rank must run the same
    number of them. Padding micro-batches repeat this rank's first one with an all-zero
    loss mask: they contribute no loss and no gradient.
    """
    if world_size() == 1:
        return micro
    count = torch.tensor([len(micro)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    filler = replace(micro[0], loss_mask=torch.zeros_like(micro[0].loss_mask))
    return micro + [filler] * (int(count) - len(micro))


def _enable_activation_checkpointing(hf_model: Any) -> None:
    """Recompute each decoder layer in backward (non-reentrant torch checkpoint)."""
    kwargs = {"use_reentrant": False}
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5 name
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def decoder_layers(hf_model: nn.Module) -> Iterator[nn.Module]:
    """The decoder layers of an HF causal LM (`base_model.layers`), the FSDP2 units."""
    layers = getattr(hf_model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(hf_model).__name__} has no base_model.layers to shard")
    yield from layers


def shard_fsdp2(root: nn.Module, hf_model: nn.Module, device: torch.device) -> None:
    """Shard each decoder layer, then the root (embeddings, norm, output layer), over a
    1-D mesh of every rank on ``device``'s type.

    The mesh is explicit: FSDP2's default one takes the machine's accelerator whatever the
    training device is, so CPU ranks on a one-GPU machine all asked for ``cuda:<rank>``.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in decoder_layers(hf_model):
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
