"""Run megatron-core models on the CPU: gloo process group plus small shims.

megatron-core 0.16 assumes CUDA in a few places that a CPU forward/backward reaches:

1. `RotaryEmbedding.get_emb` moves its CPU frequencies to the current CUDA device;
   the shim computes the embedding on the frequencies' own device instead.
2. The model-parallel RNG tracker (`get_cuda_rng_tracker`) stores and swaps CUDA
   generator states (attention dropout and full recompute use it); the shim installs a
   tracker whose states are CPU generator states.
3. The attention core's scratch buffer (`GlobalMemoryBuffer`) is allocated on the current
   CUDA device; the shim allocates it on the CPU.
4. Full recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA generator
   state around the replayed forward; the shim points those two helpers
   (`_get_cuda_rng_state` / `_set_cuda_rng_state`) at the CPU generator.
5. Sequence parallelism's gathers and reduce-scatters (`tensor_parallel.mappings`) allocate
   their outputs on the current CUDA device; the shim gathers CPU tensors with
   `all_gather` and reduce-scatters them as an `all_reduce` and a slice (gloo has no
   reduce-scatter); the tensor-parallel linear layers' fused function
   (`linear_with_grad_accumulation_and_async_allreduce`), whose sequence-parallel backward
   allocates on CUDA too, becomes that gather followed by a plain `F.linear` for CPU
   inputs under sequence parallelism (same forward and gradients, no overlap).
6. With tied embeddings and pipeline parallelism, `GPTModel` moves the last stage's copy
   of the embedding to CUDA to all-reduce it with the first stage's
   (`LanguageModule.setup_embeddings_and_output_layer`); the shim all-reduces it where it is.

Megatron's own pipeline schedule (`get_forward_backward_func`, 1F1B without interleaving)
runs on the CPU with two more pieces, which `MegatronEngine` passes to it explicitly
rather than patching:

7. `cpu_p2p_communicator`: Megatron's `P2PCommunicator` whose one transport method
   (`_communicate`) sends and receives CPU tensors with gloo `isend` / `irecv`, their
   shapes and dtypes first (Megatron's allocates receive buffers on the current CUDA
   device and synchronises CUDA).
8. `cuda_factories_on_cpu`: a `TorchFunctionMode` under which a tensor factory asked for a
   CUDA tensor makes a CPU one (the schedule counts tokens in a `device="cuda"` tensor).

The attention mask is not shimmed: Megatron's default causal mask is built on CUDA, so
callers pass an explicit mask (`model.causal_attention_mask`, as `gpt_logprobs` does).

`turnrl.grpo_core.megatron.parallel.model_parallel(device="cpu")` starts a gloo group,
installs shims 1-6 and seeds the tracker; on exit it undoes all of it. Megatron's
optimizer and DDP wrapper stay CUDA-only, so the CPU trains (TP, sequence parallel,
pipeline parallel, recompute, DP) for correctness tests, not at scale.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from turnrl.grpo_core.megatron.config import require_megatron


class CpuRNGStatesTracker:
    """Megatron's named RNG-state tracker, holding CPU generator states.

    Same interface as `megatron.core.tensor_parallel.random.CudaRNGStatesTracker`:
    `fork(name)` runs a block under the named state and saves where it left off.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        """Whether any state was added or set."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_, self.seeds_, self._is_initialized = {}, set(), False

    def get_states(self) -> dict[str, torch.Tensor]:
        """A shallow copy of the name -> state mapping."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (used by recompute to replay a forward)."""
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state `name` seeded with `seed` (both must be new)."""
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block with the CPU RNG at state `name`, then restore the previous state."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_get_emb(original: Any) -> Any:
    def get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.inv_freq.device.type != "cpu":
            return original(self, max_seq_len, offset)
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, d/2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [s, 1, 1, d]

    return get_emb


def _cpu_memory_buffer_class(base: type) -> type:
    class CpuMemoryBuffer(base):  # type: ignore[valid-type, misc]
        """Megatron's global scratch buffer, allocated on the CPU."""

        def get_tensor(
            self, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
        ) -> torch.Tensor:
            numel = 1
            for size in tensor_shape:
                numel *= size
            buffer = self.buffer.get((name, dtype))
            if buffer is None or buffer.numel() < numel:
                buffer = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
            return buffer[:numel].view(*tensor_shape)

    return CpuMemoryBuffer


def _cpu_get_rng_state(*_args: Any, clone: bool = False, **_kwargs: Any) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_gather_first(original: Any) -> Any:
    def gather(
        input_: torch.Tensor,
        group: Any,
        output_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        if input_.device.type != "cpu" or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = output_split_sizes or [input_.shape[0]] * group.size()
        parts = [input_.new_empty((n, *input_.shape[1:])) for n in sizes]
        torch.distributed.all_gather(parts, input_.contiguous(), group=group)
        return torch.cat(parts)

    return gather


def _cpu_reduce_scatter_first(original: Any) -> Any:
    def reduce_scatter(
        input_: torch.Tensor,
        group: Any,
        input_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        if input_.device.type != "cpu" or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        sizes = input_split_sizes or [input_.shape[0] // group.size()] * group.size()
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return torch.split(total, sizes)[group.rank()].contiguous()

    return reduce_scatter


def _cpu_gather_last(original: Any) -> Any:
    def gather(input_: torch.Tensor, group: Any) -> torch.Tensor:
        if input_.device.type != "cpu" or group.size() == 1:
            return original(input_, group)
        parts = [torch.empty_like(input_) for _ in range(group.size())]
        torch.distributed.all_gather(parts, input_.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    return gather


def _cpu_linear(original: Any) -> Any:
    @functools.wraps(original)  # with its `warned` flag, which the original reads by name
    def linear(
        input: torch.Tensor, weight: torch.Tensor, bias: Any, *args: Any, **kwargs: Any
    ) -> Any:
        sequence_parallel = kwargs.get("sequence_parallel", False)
        if (
            input.device.type != "cpu"
            or not sequence_parallel
            or args
            or kwargs.get("gradient_accumulation_fusion")
        ):
            return original(input, weight, bias, *args, **kwargs)
        from megatron.core.tensor_parallel import mappings

        group = kwargs.get("tp_group")
        full = mappings.gather_from_sequence_parallel_region(input, True, group)
        return torch.nn.functional.linear(full, weight, bias)

    return linear


def _cpu_setup_embeddings(original: Any) -> Any:
    @functools.wraps(original)
    def setup(self: Any) -> None:
        in_group = self._is_in_embd_group
        self._is_in_embd_group = lambda: False  # skips the original's `.cuda()` + all-reduce
        try:
            original(self)
        finally:
            del self._is_in_embd_group
        copies = self.share_embeddings_and_output_weights and (
            self.config.pipeline_model_parallel_size > 1
        )
        if copies and torch.distributed.is_initialized() and in_group():
            weight = self.shared_embedding_or_output_weight()
            torch.distributed.all_reduce(weight.data, group=self.embd_group)

    return setup


_MAPPINGS = {
    "_gather_along_first_dim": _cpu_gather_first,
    "_reduce_scatter_along_first_dim": _cpu_reduce_scatter_first,
    "_gather_along_last_dim": _cpu_gather_last,
}


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Install the six CPU shims (RoPE, RNG tracker, scratch buffer, RNG state, SP
    communication, tied-embedding copy); undo on exit.

    Use after `parallel_state.initialize_model_parallel` (the buffer is replaced then).
    """
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.tensor_parallel import random as mpu_random
    from megatron.core.utils import GlobalMemoryBuffer

    rope = rotary_pos_embedding.RotaryEmbedding
    saved = (
        rope.get_emb,
        mpu_random._CUDA_RNG_STATE_TRACKER,
        mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        parallel_state._GLOBAL_MEMORY_BUFFER,
        mpu_random._get_cuda_rng_state,
        mpu_random._set_cuda_rng_state,
    )
    rope.get_emb = _cpu_get_emb(rope.get_emb)  # type: ignore[method-assign]
    mpu_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_memory_buffer_class(GlobalMemoryBuffer)()
    mpu_random._get_cuda_rng_state = _cpu_get_rng_state
    mpu_random._set_cuda_rng_state = _cpu_set_rng_state
    saved_mappings = {name: getattr(mappings, name) for name in _MAPPINGS}
    for name, shim in _MAPPINGS.items():
        setattr(mappings, name, shim(saved_mappings[name]))
    fused = layers.linear_with_grad_accumulation_and_async_allreduce
    layers.linear_with_grad_accumulation_and_async_allreduce = _cpu_linear(fused)
    setup_embeddings = LanguageModule.setup_embeddings_and_output_layer
    LanguageModule.setup_embeddings_and_output_layer = _cpu_setup_embeddings(setup_embeddings)  # type: ignore[method-assign]
    try:
        yield
    finally:
        LanguageModule.setup_embeddings_and_output_layer = setup_embeddings  # type: ignore[method-assign]
        layers.linear_with_grad_accumulation_and_async_allreduce = fused
        for name, original in saved_mappings.items():
            setattr(mappings, name, original)
        (
            rope.get_emb,
            mpu_random._CUDA_RNG_STATE_TRACKER,
            mpu_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
            parallel_state._GLOBAL_MEMORY_BUFFER,
            mpu_random._get_cuda_rng_state,
            mpu_random._set_cuda_rng_state,
        ) = saved


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def cpu_p2p_communicator(pp_group: Any, config: Any) -> Any:
    """Megatron's ``P2PCommunicator`` for CPU tensors over gloo (pass it to the schedule).

    Only the transport (``_communicate``) is replaced; the schedule's calls
    (``recv_forward``, ``send_forward_recv_backward``, ...) are Megatron's. Every message is
    preceded by its shape and dtype, so micro-batches may differ in shape (what Megatron
    does under ``variable_seq_lengths``). Receive buffers require grad, as Megatron's do.
    """
    return _cpu_p2p_class()(pp_group, config)


@functools.cache
def _cpu_p2p_class() -> type:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    class CpuP2PCommunicator(P2PCommunicator):  # type: ignore[misc]
        """Megatron's pipeline p2p communicator with a gloo transport for CPU tensors."""

        def _communicate(
            self,
            *,
            tensor_send_next: torch.Tensor | None,
            tensor_send_prev: torch.Tensor | None,
            recv_prev: bool,
            recv_next: bool,
            tensor_shape: Any = None,
            wait_on_reqs: bool = True,
        ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
            dist = torch.distributed
            sends = {}
            if tensor_send_prev is not None:
                sends["prev"] = (self.prev_rank, tensor_send_prev.detach().contiguous())
            if tensor_send_next is not None:
                sends["next"] = (self.next_rank, tensor_send_next.detach().contiguous())
            peers = {"prev": self.prev_rank, "next": self.next_rank}
            wanted = [d for d, flag in (("prev", recv_prev), ("next", recv_next)) if flag]
            # Headers first: [ndim, dims (up to 4), dtype index].
            headers = {d: torch.zeros(6, dtype=torch.int64) for d in wanted}
            outgoing = [(peer, _header(t)) for peer, t in sends.values()]  # alive until sent
            reqs = [dist.isend(h, peer, group=self.pp_group) for peer, h in outgoing]
            reqs += [dist.irecv(h, peers[d], group=self.pp_group) for d, h in headers.items()]
            _wait(reqs)
            received = {}
            for d, h in headers.items():
                ndim = int(h[0])
                shape = [int(x) for x in h[1 : 1 + ndim]]
                received[d] = torch.empty(shape, dtype=_DTYPES[int(h[5])], requires_grad=True)
            reqs = [dist.isend(t, peer, group=self.pp_group) for peer, t in sends.values()]
            reqs += [dist.irecv(b, peers[d], group=self.pp_group) for d, b in received.items()]
            _wait(reqs)
            return received.get("prev"), received.get("next"), None

    return CpuP2PCommunicator


def _wait(requests: list[Any]) -> None:
    for request in requests:
        if request is not None:  # None: this rank is not in the group (never here)
            request.wait()


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > 4 or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
    dims = list(tensor.shape) + [0] * (4 - tensor.dim())
    return torch.tensor([tensor.dim(), *dims, _DTYPES.index(tensor.dtype)], dtype=torch.int64)


class _CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_factories_on_cpu() -> Iterator[None]:
    """Within the block, a torch call asked for a CUDA tensor (``device="cuda"``) makes a
    CPU tensor: for Megatron's pipeline schedule, which counts tokens in a CUDA tensor."""
    with _CudaFactoriesOnCpu():
        yield
