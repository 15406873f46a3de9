"""Process groups for megatron-core on any device: torch.distributed + model-parallel groups.

`model_parallel(parallel, device=...)` is a context manager that

1. starts `torch.distributed` through `turnrl.npu_runtime.init_distributed` (hccl on
   Ascend NPUs, nccl on NVIDIA GPUs, gloo on the CPU) unless a group already exists,
2. initialises Megatron's tensor / pipeline / context-parallel groups,
3. seeds Megatron's model-parallel RNG tracker (on the CPU after installing
   `cpu.cpu_shims`, which replace the CUDA-only pieces),

and tears all of it down on exit (the process group only if it started it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from turnrl.grpo_core.megatron.config import MegatronParallelConfig, require_megatron
from turnrl.npu_runtime.net import free_port


@contextlib.contextmanager
def model_parallel(
    parallel: MegatronParallelConfig | None = None,
    *,
    device: str | None = None,
    seed: int = 1234,
    rank: int | None = None,
    world_size: int | None = None,
    master_port: int | None = None,
) -> Iterator[str]:
    """Megatron's model-parallel groups (and the process group) for the duration of a block.

    Args:
        parallel: Sizes to initialise (default: all 1).
        device: `cpu`, `cuda` or `npu` (default: detected by `turnrl.npu_runtime`).
        seed: Seed of the model-parallel RNG state (dropout, recompute).
        rank: This process's rank. With `rank` and `world_size` None: the launcher variables
            (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, as torchrun sets) when
            `WORLD_SIZE` is set, else one process (rank 0 of 1).
        world_size: Processes in the group (a multiple of TP x PP x CP).
        master_port: Rendezvous port on 127.0.0.1 when `rank` / `world_size` are given
            (default: a free port, fine for one process; give every rank the same port).

    Yields:
        The torch device string of this rank (`cpu`, `cuda:0`, `npu:3`).

    Ranks are ordered TP fastest, then CP, then PP, then DP (Megatron's ``order``
    ``tp-cp-ep-pp-dp``): the ranks of one model replica are adjacent, so rank ``r`` holds
    data-parallel share ``r // (TP x CP x PP)`` (what ``MegatronEngine.parallel_layout``
    tells the trainer group).

    Raises:
        ValueError: A world size the model-parallel size does not divide.
    """
    require_megatron()
    import torch
    from megatron.core import parallel_state, tensor_parallel

    from turnrl.grpo_core.megatron.cpu import cpu_shims
    from turnrl.npu_runtime import destroy_distributed, init_distributed, resolve_device

    parallel = parallel or MegatronParallelConfig()
    kind = str(resolve_device(device))
    started = not torch.distributed.is_initialized()
    if rank is None and world_size is None and os.environ.get("WORLD_SIZE"):
        ctx = init_distributed(device=kind)  # torchrun / Ray set the launcher variables
    else:
        port = master_port if master_port is not None else free_port()
        ctx = init_distributed(
            rank=rank if rank is not None else 0,
            world_size=world_size if world_size is not None else 1,
            master_addr="127.0.0.1",
            master_port=port,
            device=kind,
        )
    try:
        if ctx.world_size % parallel.model_parallel_size:
            raise ValueError(
                f"world size {ctx.world_size} is not a multiple of TP x PP x CP = "
                f"{parallel.model_parallel_size}"
            )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            order="tp-cp-ep-pp-dp",  # one replica's ranks adjacent (default: ...-dp-pp)
        )
        shims = cpu_shims() if kind == "cpu" else contextlib.nullcontext()
        with shims:
            if kind == "cpu":  # Megatron's offset: a TP-rank-dependent state for TP regions
                tp_rank = parallel_state.get_tensor_model_parallel_rank()
                tensor_parallel.get_cuda_rng_tracker().add(
                    "model-parallel-rng", seed + 2718 + tp_rank
                )
            else:
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
            yield ctx.torch_device
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            destroy_distributed()
