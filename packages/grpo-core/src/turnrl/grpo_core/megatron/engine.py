"""A megatron-core train engine with the surface of :class:`TorchEngine`.

:class:`MegatronEngine` trains a megatron-core ``GPTModel`` built from a Hugging Face Qwen
folder (weights converted by ``convert``), with the same GRPO-family losses, micro-batch
accumulation, gradient clipping, AdamW, learning-rate warm-up and metrics as the torch
backend: it composes the same :class:`~turnrl.grpo_core.training.torch_engine.TrainStep`,
its module scoring tokens through Megatron (``gpt_logprobs``) instead of a transformers
model, with Megatron's pipeline schedule and model-parallel clipping plugged in. It meets
the :class:`~turnrl.grpo_core.training.trainer.Trainer` interface, so the loop, the weight
sync (through :meth:`export_hf`), the reference policy and the trainer group use it
unchanged.

What is built: tensor parallel (the weights split over the TP group; with or without
sequence parallel, also on the CPU), pipeline parallel (the layers split into stages run
by megatron-core's own 1F1B schedule, ``get_forward_backward_func``; on the CPU with the
gloo p2p transport of ``cpu.cpu_p2p_communicator``; tied embeddings keep a copy on the
last stage whose gradient is summed with the first stage's), data parallel over the
remaining ranks (a plain gradient all-reduce), full or selective activation recompute from
the Megatron flags, on any device megatron-core runs on (on the CPU through
``cpu.cpu_shims``, gloo, and a plain torch AdamW on each rank's shard). Under PP every
rank calls ``compute_logprobs`` / ``train_step``; the last stage's log-probs and metrics
are broadcast to every stage, so each rank returns the same. Checkpoints keep one set of
keys per TP x PP shard. What is refused at start, naming the setting: context parallelism
(megatron-core's CP attention needs Transformer Engine on CUDA), ``--bf16`` and rollout
top-p / top-k (the vocab-parallel log-probs are those of temperature-scaled full softmax
only); a pipeline larger than the layers or not dividing them. Not wired yet: Megatron's
DDP (bucketed, overlapped reduction), distributed optimizer and interleaved (virtual)
pipeline stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from turnrl.grpo_core.megatron.config import MegatronParallelConfig, QwenArchitecture
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.loss import BatchCounts
from turnrl.grpo_core.training.policy import load_causal_lm, scatter_scores
from turnrl.grpo_core.training.torch_engine import (
    LossTally,
    TorchEngineConfig,
    TrainStep,
    equalise_micro_batches,
    make_optimizer,
    rank,
    score_batch,
)


@dataclass(frozen=True)
class MegatronEngineConfig(TorchEngineConfig):
    """:class:`TorchEngineConfig` plus Megatron's parallelism and recompute settings."""

    parallel: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)
    """Tensor / pipeline / context parallel sizes, sequence parallel and recompute, as
    parsed from the Megatron flags (``parse_megatron_args``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for reason in unsupported(self):
            raise ValueError(f"train backend megatron: {reason}")


def unsupported(config: MegatronEngineConfig) -> list[str]:
    """What this build of the megatron backend cannot honour in ``config``, one line each."""
    p = config.parallel
    reasons = []
    if p.context_parallel_size > 1:
        reasons.append(
            f"--context-parallel-size {p.context_parallel_size}: megatron-core's "
            "context-parallel attention needs Transformer Engine on CUDA (so not on the CPU "
            "or the local spec), and this engine does not split sequences over CP ranks; "
            "tensor, pipeline and data parallel are built"
        )
    if p.layer_spec == "te" and not _transformer_engine_on_cuda():
        reasons.append(
            f"--attention-backend {p.attention_backend}: Transformer Engine's attention "
            "needs transformer-engine on a CUDA device (not installed here, or no CUDA); "
            "--attention-backend local runs megatron-core's own attention"
        )
    if p.bf16:
        reasons.append(
            "--bf16 would train bfloat16 parameters with no fp32 master copy; set the "
            "engine's dtype bfloat16 (autocast over fp32 weights) instead"
        )
    if config.top_p < 1 or config.top_k > 0:
        reasons.append(
            "--rollout-top-p / --rollout-top-k: Megatron's log-probs are of the full "
            "softmax; use the torch backend for truncated sampling"
        )
    if config.gradient_checkpointing:
        reasons.append(
            "gradient_checkpointing is the torch backend's; give Megatron's "
            "--recompute-granularity / --recompute-method instead"
        )
    return reasons


def _transformer_engine_on_cuda() -> bool:
    import importlib.util

    from turnrl.npu_runtime.device import DeviceType, detect_device

    te = importlib.util.find_spec("transformer_engine") is not None
    return te and detect_device() is DeviceType.CUDA


class MegatronLogProbs(nn.Module):
    """Wraps a ``GPTModel``; ``forward`` has ``CausalLMLogProbs``' signature and result."""

    def __init__(self, model: nn.Module, temperature: float = 1.0):
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        score_mask: torch.Tensor,
        return_entropy: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of ``input_ids[:, t]`` given ``< t`` where ``score_mask`` is 1 (column 0
        ignored), fp32 ``[B, L]``, zero elsewhere; entropy likewise when asked.

        Sequences are right-padded: under the causal mask a real token never sees the
        padding after it, so ``attention_mask`` needs no further use.

        Under pipeline parallelism this runs one stage (a later stage's input set by the
        schedule with ``set_input_tensor``); a stage before the last returns its hidden
        states instead, the next stage's input.
        """
        from turnrl.grpo_core.megatron.model import gpt_stage_forward

        labels = torch.roll(input_ids, -1, dims=1)  # position t predicts token t + 1
        scores = gpt_stage_forward(
            self.model,
            input_ids,
            labels,
            temperature=self.temperature,
            return_entropy=return_entropy,
        )
        if not isinstance(scores, tuple):  # a pipeline stage before the last
            return scores  # type: ignore[return-value]  # its hidden states, for the next
        logp, entropy = scores
        select = score_mask[:, 1:].bool()
        logp = scatter_scores(logp[:, :-1][select], select)
        return logp, None if entropy is None else scatter_scores(entropy[:, :-1][select], select)


class MegatronEngine:
    """Trains a megatron-core ``GPTModel``; one instance per rank. The ranks of one model
    replica (its TP x PP ranks, TP fastest) are adjacent, so rank ``r`` trains on
    data-parallel share ``r // (TP x PP)`` (``parallel_layout``)."""

    config: MegatronEngineConfig

    def __init__(self, config: MegatronEngineConfig):
        """Start Megatron's groups, build the model from ``config.model_path``'s weights,
        and build the optimizer.

        Raises:
            ImportError: megatron-core is not installed (the ``megatron`` extra).
            ValueError: a setting this engine cannot honour (see :func:`unsupported`), or a
                world size the model-parallel size does not divide.
        """
        from transformers import AutoConfig

        from turnrl.grpo_core.megatron.model import build_gpt_model, load_hf_weights
        from turnrl.grpo_core.megatron.parallel import model_parallel

        self.config = config
        self.arch = QwenArchitecture.from_hf_config(AutoConfig.from_pretrained(config.model_path))
        config.parallel.check_model(self.arch)  # before any process group starts
        self._groups = contextlib.ExitStack()
        device = self._groups.enter_context(model_parallel(config.parallel, seed=config.seed))
        self.device = torch.device(device)
        from megatron.core import parallel_state as ps

        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group() if self.dp_size > 1 else None
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.last_stage_rank = ps.get_pipeline_model_parallel_last_rank()  # global rank
        self.is_last_stage = ps.is_pipeline_last_stage()
        # One replica's shards (checkpoint keys, layout): TP x PP, the TP rank fastest.
        self.model_parallel_size = self.tp_size * self.pp_size
        self.model_parallel_rank = (
            ps.get_pipeline_model_parallel_rank() * self.tp_size
            + ps.get_tensor_model_parallel_rank()
        )
        self.mp_group = ps.get_model_parallel_group()
        torch.manual_seed(config.seed)
        hf = load_causal_lm(config.model_path, torch.float32)
        self.hf_config: Any = hf.config
        model = build_gpt_model(self.arch, config.parallel, cpu_initialization=True)
        load_hf_weights(model, hf.state_dict(), self.arch, config.parallel.layer_spec)  # type: ignore[arg-type]
        self._hf: nn.Module | None = None  # built again on first use of hf_model
        del hf
        self.gpt = model.to(self.device)
        self.module = MegatronLogProbs(self.gpt, config.temperature)
        self.optimizer = make_optimizer(self.module, config.optimizer)
        self.steps = TrainStep(
            config,
            self.module,
            self.optimizer,
            self.device,
            self.dp_size,
            self.dp_group,
            accumulate=self._accumulate,
            clip_and_step=self._clip_and_step,
        )

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by :meth:`load_checkpoint`)."""
        return self.steps.step

    @step.setter
    def step(self, value: int) -> None:
        self.steps.step = value

    def parallel_layout(self) -> tuple[int, int]:
        """``(data-parallel size, model-parallel size)``: rank ``r`` trains on data share
        ``r // model-parallel size`` (a replica's TP x PP ranks are adjacent)."""
        return self.dp_size, self.model_parallel_size

    def train_step(
        self, batch: TrainBatch | Sequence[TrainBatch], objective: str = "rl"
    ) -> dict[str, float]:
        """One optimizer step (see ``TorchEngine.train_step``); every rank of a pipeline
        returns the last stage's metrics."""
        return self.steps.run(batch, objective)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        return self.steps.lr_at(step)

    def save_checkpoint(self, folder: str | Path, data_state: dict[str, Any] | None = None) -> Path:
        """Save this rank's shard of model and optimizer, RNG states, step and ``data_state``."""
        from turnrl.grpo_core.training.checkpoint import save_checkpoint

        return save_checkpoint(self, Path(folder), data_state or {})

    def load_checkpoint(self, folder: str | Path) -> dict[str, Any]:
        """Restore a checkpoint saved by :meth:`save_checkpoint`; returns its ``data_state``."""
        from turnrl.grpo_core.training.checkpoint import load_checkpoint

        return load_checkpoint(self, Path(folder))

    # -- pipeline parallel: Megatron's schedule over this rank's stage ---------------------

    def _pipeline(self, micro: list[TrainBatch], want_entropy: bool, loss: Any = None) -> list[Any]:
        """Run Megatron's pipeline schedule (``get_forward_backward_func``: 1F1B without
        interleaving) over ``micro``, this rank's stage of every micro-batch.

        Each stage runs :class:`MegatronLogProbs` on its part; the schedule sends the
        hidden states forward and their gradients back. ``loss(mb, (logp, entropy))`` gives
        the last stage's loss of micro-batch ``mb`` (backward then runs through every
        stage); with ``loss`` None the schedule only runs forward and the last stage
        returns each micro-batch's ``(logp, entropy)``. Other stages return ``[]``.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data: Iterator[TrainBatch], model: Any) -> tuple[Any, Any]:
            mb = next(data)
            with self.steps.autocast():
                output = self.module(
                    mb.input_ids, mb.attention_mask, mb.loss_mask, return_entropy=want_entropy
                )
            if loss is None:
                return output, None  # the last stage keeps the output itself
            return output, lambda scores: loss(mb, scores)

        kwargs: dict[str, Any] = {}
        cuda_on_cpu: Any = contextlib.nullcontext()
        if self.device.type == "cpu":
            from megatron.core.process_groups_config import ProcessGroupCollection

            from turnrl.grpo_core.megatron.cpu import cpu_p2p_communicator, cuda_factories_on_cpu

            kwargs["p2p_communicator"] = cpu_p2p_communicator(self.pp_group, self.gpt.config)
            kwargs["pg_collection"] = ProcessGroupCollection.use_mpu_process_groups(
                ["tp", "pp", "cp", "embd", "pos_embd", "dp_cp"]
            )
            cuda_on_cpu = cuda_factories_on_cpu()
        first = micro[0].input_ids.shape
        with cuda_on_cpu:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([mb.to(self.device) for mb in micro]),
                model=self.gpt,
                num_microbatches=len(micro),
                seq_length=first[1],  # each micro-batch's shape is sent ahead of it
                micro_batch_size=first[0],
                forward_only=loss is None,
                **kwargs,
            )

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` as the last pipeline stage has it, on every stage."""
        import torch.distributed as dist

        if self.pp_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.pp_group)
        return box[0]

    def _accumulate(
        self, micro: list[TrainBatch], objective: str, counts: BatchCounts
    ) -> dict[str, float]:
        """Without pipeline parallelism, :meth:`TrainStep.accumulate`. With it, the same
        loss of each micro-batch (``TrainStep.micro_loss``) on the last stage, through
        Megatron's schedule; the metrics are the last stage's, sent to every stage."""
        if self.pp_size == 1:
            return self.steps.accumulate(micro, objective, counts)
        tally = LossTally()

        def loss(mb: TrainBatch, scores: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
            logp, entropy = scores
            value = self.steps.micro_loss(logp, entropy, mb, objective, counts, tally)
            # (loss, tokens, reported): with calculate_per_token_loss the schedule takes
            # the loss as it is (it is this micro-batch's share of the mini-batch loss).
            return value, torch.tensor(mb.num_loss_tokens, dtype=torch.int), {}

        self._pipeline(micro, self.steps.wants_entropy(objective), loss)
        out = self.steps.reduce_metrics(tally, micro) if self.is_last_stage else None
        return self._from_last_stage(out)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """``TorchEngine.compute_logprobs``; under pipeline parallelism scored on the last
        stage and broadcast to every stage (each rank of the group gets the result)."""
        import torch.distributed as dist

        size = micro_batch_size or self.config.micro_batch_size
        if self.pp_size == 1:
            return score_batch(lambda mb: self.steps.forward(mb)[0], batch, size, self.device)
        micro = equalise_micro_batches(list(batch.micro_batches(size)), self.device)
        scores = iter(self._pipeline(micro, want_entropy=False))

        def scored(mb: TrainBatch) -> torch.Tensor:
            if self.is_last_stage:
                return next(scores)[0]
            return torch.zeros(mb.input_ids.shape)

        out = score_batch(scored, batch, size, self.device)
        dist.broadcast(out, src=self.last_stage_rank, group=self.pp_group)
        return out

    def _clip_and_step(self) -> float:
        """Finish the gradients as Megatron's ``finalize_model_grads`` does, clip them by
        their global norm and step.

        Data parallel: a plain all-reduce (mean) of every gradient over the data-parallel
        group, on any device (Megatron's DDP with its bucketed, overlapped reduction and
        the distributed optimizer are not wired). Tensor parallel: the weights every TP rank
        holds whole but sees only part of the work for (the per-head query / key norms;
        the norms under sequence parallelism) are summed over the TP group. Pipeline
        parallel with tied embeddings: the first stage's embedding and the last stage's
        copy (the output layer) sum their gradients over the embedding group. The norm
        counts each TP shard once, each replicated weight once and the tied copy once
        (``torch``'s clip formula), summed over the TP x PP ranks of the replica."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        named = [(n, p) for n, p in self.gpt.named_parameters() if p.requires_grad]
        for _, p in named:
            if p.grad is None:  # every rank must reduce the same tensors
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:
            _all_reduce([p.grad for _, p in named], self.dp_group, mean=True)
        if self.tp_size > 1:
            sp = self.config.parallel.sequence_parallel
            partial = [
                p.grad
                for n, p in named
                if "q_layernorm" in n
                or "k_layernorm" in n
                or (sp and getattr(p, "sequence_parallel", False))
            ]
            _all_reduce(partial, self.tp_group, mean=False)
        if self.pp_size > 1 and self.arch.tie_word_embeddings and ps.is_rank_in_embedding_group():
            tied = self.gpt.shared_embedding_or_output_weight()
            dist.all_reduce(tied.grad, group=ps.get_embedding_group())
        counted = [
            p.grad
            for _, p in named
            if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)
        ]
        square = torch.stack([torch.linalg.vector_norm(g) ** 2 for g in counted]).sum()
        if self.model_parallel_size > 1:
            dist.all_reduce(square, group=self.mp_group)
        norm = square.sqrt()
        max_norm = self.config.optimizer.clip_grad
        if max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_([p.grad for _, p in named], scale)
        self.optimizer.step()
        return float(norm)

    def hf_snapshot(self) -> nn.Module:
        """A transformers model holding the current weights, copied from Megatron's on every
        call: for code that samples from the trained policy in this process (the toy run).
        Costs a second copy of the model; the weight sync goes through :meth:`hf_weights`."""
        if self._hf is None:
            self._hf = load_causal_lm(self.config.model_path, torch.float32).to(self.device)
        with torch.no_grad():
            weights = dict(self.hf_weights())
            result = self._hf.load_state_dict(weights, strict=False)
        tied = getattr(self.hf_config, "tie_word_embeddings", False)
        if result.unexpected_keys or set(result.missing_keys) - (
            {"lm_head.weight"} if tied else set()
        ):
            raise KeyError(f"Megatron weights do not fit the Hugging Face model: {result}")
        return self._hf

    def hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under Hugging Face names (``megatron_to_hf``; every model-parallel
        rank must call it), as the collective weight sync sends them."""
        from turnrl.grpo_core.megatron.model import export_hf_weights

        layout = self.config.parallel.layer_spec
        for name, tensor in export_hf_weights(self.gpt, self.arch, layout).items():  # type: ignore[arg-type]
            yield name, tensor.to(dtype) if dtype is not None else tensor

    def export_hf(self, folder: str | Path, dtype: Any = None) -> Path:
        """Write the current weights as a Hugging Face folder (Megatron -> HF names)."""
        import torch.distributed as dist

        from turnrl.grpo_core.training.checkpoint import write_hf_folder

        weights = dict(self.hf_weights())
        if rank() == 0:
            source = Path(self.config.model_path)
            write_hf_folder(
                weights, self.hf_config, source, Path(folder), dtype or self.config.dtype
            )
        if dist.is_initialized():
            dist.barrier()
        return Path(folder)

    def close(self) -> None:
        """Tear down Megatron's groups (and the process group this engine started)."""
        self._groups.close()


def _all_reduce(grads: list[torch.Tensor], group: Any, *, mean: bool) -> None:
    """Sum (or average) ``grads`` in place over ``group``, as one flat buffer."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    if mean:
        flat /= dist.get_world_size(group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)
