"""Qwen-family architecture and Megatron parallelism settings, as typed dataclasses.

`QwenArchitecture.from_hf_config` reads a Hugging Face `config.json` (or a
`transformers` config object) of a dense Qwen2 / Qwen2.5 / Qwen3 model: RMSNorm, SwiGLU,
RoPE with the config's theta, grouped-query attention, Qwen2's q/k/v bias, Qwen3's per-head
q/k RMSNorm, tied or untied embeddings. `MegatronParallelConfig` holds the settings a slime
/ vime launch script passes with Megatron's flag names (`--tensor-model-parallel-size 2
--sequence-parallel --recompute-granularity full ...`); `parse_megatron_args` maps those
flags. `transformer_config_kwargs` combines both into the keyword arguments of
megatron-core's `TransformerConfig`; it needs no megatron-core, so the mapping is tested
everywhere, and `turnrl.grpo_core.megatron.model` builds the real config from it.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
"""Hugging Face `model_type` values this backend builds (Qwen2.5 checkpoints say `qwen2`)."""

RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]


INSTALL_HINT = 'pip install "turnrl-grpo-core[megatron]"  (or: uv sync --extra megatron)'


def megatron_available() -> bool:
    """Whether megatron-core is installed (without importing it)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no `megatron` package at all
        return False


def require_megatron() -> None:
    """Raise an `ImportError` naming the extra to install if megatron-core is missing."""
    if not megatron_available():
        raise ImportError(f"the megatron backend needs megatron-core: {INSTALL_HINT}")


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _rope_theta(config: Any) -> float:
    """RoPE base from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`."""
    params = _get(config, "rope_parameters") or {}
    scaling = _get(config, "rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(
            f"RoPE scaling {rope_type!r} is not supported by the megatron backend "
            "(only plain RoPE; remove rope_scaling from the config to train at native length)"
        )
    theta = params.get("rope_theta", _get(config, "rope_theta"))
    if theta is None:
        raise ValueError("the config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


@dataclass(frozen=True)
class QwenArchitecture:
    """Shape and variant of a dense Qwen2/Qwen2.5/Qwen3 decoder, as Megatron needs it."""

    model_type: str
    """Hugging Face model type: `qwen2` (also Qwen2.5) or `qwen3`."""
    vocab_size: int
    """Rows of the embedding and the output layer (may exceed the tokenizer's size)."""
    hidden_size: int
    """Width of the residual stream."""
    ffn_hidden_size: int
    """Width of the SwiGLU MLP (Hugging Face `intermediate_size`)."""
    num_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_query_groups: int
    """Key/value heads per layer (grouped-query attention; Hugging Face `num_key_value_heads`)."""
    head_dim: int
    """Dimension of one attention head (Megatron `kv_channels`)."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """RoPE base frequency."""
    max_position_embeddings: int
    """Longest sequence the model supports."""
    qkv_bias: bool
    """Bias on the q/k/v projections (always on in Qwen2, `attention_bias` in Qwen3)."""
    qk_layernorm: bool
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    tie_word_embeddings: bool
    """The output layer shares the input embedding's weight."""

    @property
    def heads_per_group(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_hf_config(cls, config: Any) -> QwenArchitecture:
        """Read a Hugging Face Qwen2/Qwen3 config (`config.json` as a dict, or a config object).

        Raises:
            ValueError: For another model type, a non-SiLU activation, sliding-window
                attention, RoPE scaling, or inconsistent head counts.
        """
        model_type = _get(config, "model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported by the megatron backend; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (dense Qwen2/Qwen2.5/Qwen3)"
            )
        if _get(config, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act must be 'silu' (SwiGLU), got {_get(config, 'hidden_act')!r}"
            )
        if _get(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the megatron backend")
        hidden = int(_get(config, "hidden_size"))
        heads = int(_get(config, "num_attention_heads"))
        groups = int(_get(config, "num_key_value_heads") or heads)
        head_dim = _get(config, "head_dim") or hidden // heads
        if heads % groups:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({groups})"
            )
        qwen3 = model_type == "qwen3"
        return cls(
            model_type=model_type,
            vocab_size=int(_get(config, "vocab_size")),
            hidden_size=hidden,
            ffn_hidden_size=int(_get(config, "intermediate_size")),
            num_layers=int(_get(config, "num_hidden_layers")),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(head_dim),
            rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(config),
            max_position_embeddings=int(_get(config, "max_position_embeddings")),
            qkv_bias=bool(_get(config, "attention_bias", False)) if qwen3 else True,
            qk_layernorm=qwen3,
            tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        )

    def megatron_flags(self) -> dict[str, Any]:
        """The model-architecture flags of slime's Megatron model scripts (``--num-layers``,
        ``--swiglu``, ...) that describe this model, by flag name without dashes."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.head_dim,
            "vocab_size": self.vocab_size,
            "rotary_base": self.rope_theta,
            "norm_epsilon": self.rms_norm_eps,
            "normalization": "RMSNorm",
            "swiglu": True,
            "group_query_attention": self.num_query_groups < self.num_attention_heads,
            "use_rotary_position_embeddings": True,
            "disable_bias_linear": True,
            "qk_layernorm": self.qk_layernorm,
            "untie_embeddings_and_output_weights": not self.tie_word_embeddings,
        }

    def check_flags(self, flags: dict[str, Any], where: str) -> None:
        """Refuse architecture flags (as :meth:`megatron_flags` names them) that do not
        describe this model, read from ``where``: the bridge loads the model's own shape.

        Raises:
            ValueError: each wrong flag with the model's value, or an unknown flag.
        """
        expected = self.megatron_flags()
        if unknown := sorted(set(flags) - set(expected)):
            raise ValueError(f"unknown architecture flags: {', '.join(unknown)}")
        wrong = [
            f"--{key.replace('_', '-')} {value} (the model has {expected[key]})"
            for key, value in flags.items()
            if value != expected[key]
        ]
        if wrong:
            raise ValueError(f"architecture flags that do not match {where}: " + "; ".join(wrong))


ATTENTION_BACKENDS = ("local", "flash", "fused", "unfused", "auto")
"""``--attention-backend`` values: megatron-core's ``local`` spec, or Transformer Engine's."""


@dataclass(frozen=True)
class MegatronParallelConfig:
    """Model parallelism, recompute and precision; field names follow Megatron's flags."""

    tensor_model_parallel_size: int = 1
    """`--tensor-model-parallel-size`: ranks that split every layer's matrices."""
    pipeline_model_parallel_size: int = 1
    """`--pipeline-model-parallel-size`: stages the layers are split into."""
    context_parallel_size: int = 1
    """`--context-parallel-size`: ranks that split each sequence (ring attention)."""
    sequence_parallel: bool = False
    """`--sequence-parallel`: shard norms/dropout activations over the tensor-parallel ranks
    (only meaningful with tensor parallelism; ignored at TP 1, as Megatron does)."""
    recompute_granularity: RecomputeGranularity | None = None
    """`--recompute-granularity`: `full` recomputes whole layers in backward, `selective`
    only the attention core."""
    recompute_method: RecomputeMethod | None = None
    """`--recompute-method`: with `full`, `uniform` checkpoints every chunk of
    `recompute_num_layers` layers, `block` the first `recompute_num_layers` of each stage."""
    recompute_num_layers: int | None = None
    """`--recompute-num-layers`: layers per recompute chunk (uniform) or per stage (block)."""
    bf16: bool = False
    """`--bf16`: parameters and activations in bfloat16 (else float32)."""
    attention_dropout: float = 0.0
    """`--attention-dropout`: dropout on attention probabilities (RL uses 0)."""
    hidden_dropout: float = 0.0
    """`--hidden-dropout`: dropout on the residual branches (RL uses 0)."""
    fused_kernels: bool = False
    """Megatron's fused CUDA kernels (bias-activation, RoPE, masked softmax, gradient
    accumulation); needs a GPU with apex / Transformer Engine, so off on CPU and NPU."""
    attention_backend: str = "local"
    """`--attention-backend`: `local` (megatron-core's own attention modules, the layer
    spec that runs anywhere, also on the CPU), or Transformer Engine's `flash`, `fused`,
    `unfused` or `auto` kernels (the TE layer spec; CUDA with transformer-engine only)."""
    attention_softmax_in_fp32: bool = False
    """`--attention-softmax-in-fp32`: masking and softmax of the attention scores in fp32.
    Off unless given, as in Megatron-LM and slime (the tau NPU script passes it; megatron-core's
    own `TransformerConfig` default is on); the one default, which the run config's
    `recipe.schema.ParallelConfig` and the flag below read."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        self._check_recompute()

    def _check_recompute(self) -> None:
        granularity, method, num = (
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
        )
        if granularity not in (None, "full", "selective"):
            raise ValueError(
                f"recompute_granularity must be full or selective, got {granularity!r}"
            )
        if method not in (None, "uniform", "block"):
            raise ValueError(f"recompute_method must be uniform or block, got {method!r}")
        if granularity == "full":
            if method is None or num is None:
                raise ValueError(
                    "--recompute-granularity full needs --recompute-method (uniform|block) "
                    "and --recompute-num-layers"
                )
            if num < 1:
                raise ValueError(f"recompute_num_layers must be >= 1, got {num}")
        elif method is not None or num is not None:
            raise ValueError(
                "--recompute-method / --recompute-num-layers only apply with "
                "--recompute-granularity full"
            )

    @property
    def layer_spec(self) -> str:
        """The layer implementation the attention backend needs: ``local`` or ``te``."""
        return "local" if self.attention_backend == "local" else "te"

    @property
    def effective_sequence_parallel(self) -> bool:
        """Sequence parallelism as Megatron applies it (off at tensor-parallel size 1)."""
        return self.sequence_parallel and self.tensor_model_parallel_size > 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica (TP x PP x CP)."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def check_model(self, arch: QwenArchitecture) -> None:
        """Check that `arch` splits evenly under these sizes (Megatron's divisibility rules).

        Raises:
            ValueError: Naming the first size that does not divide.
        """
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if pp > arch.num_layers:
            raise ValueError(
                f"--pipeline-model-parallel-size ({pp}) is larger than num_hidden_layers "
                f"({arch.num_layers}): every pipeline stage needs at least one layer"
            )
        for what, value, size, flag in (
            ("num_attention_heads", arch.num_attention_heads, tp, "tensor"),
            ("num_key_value_heads", arch.num_query_groups, tp, "tensor"),
            ("intermediate_size", arch.ffn_hidden_size, tp, "tensor"),
            ("vocab_size", arch.vocab_size, tp, "tensor"),
            ("num_hidden_layers", arch.num_layers, pp, "pipeline"),
        ):
            if value % size:
                raise ValueError(
                    f"{what} ({value}) is not divisible by --{flag}-model-parallel-size ({size})"
                )


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron's parallelism / recompute / precision flags (slime and vime names); their
    defaults are :class:`MegatronParallelConfig`'s."""
    d = MegatronParallelConfig()
    group = parser.add_argument_group("megatron")
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        group.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    group.add_argument("--sequence-parallel", action="store_true", default=d.sequence_parallel)
    group.add_argument(
        "--recompute-granularity", choices=["full", "selective"], default=d.recompute_granularity
    )
    group.add_argument(
        "--recompute-method", choices=["uniform", "block"], default=d.recompute_method
    )
    group.add_argument("--recompute-num-layers", type=int, default=d.recompute_num_layers)
    group.add_argument("--bf16", action="store_true", default=d.bf16)
    group.add_argument("--attention-dropout", type=float, default=d.attention_dropout)
    group.add_argument("--hidden-dropout", type=float, default=d.hidden_dropout)
    group.add_argument(
        "--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend
    )
    group.add_argument(
        "--attention-softmax-in-fp32",
        action=argparse.BooleanOptionalAction,
        default=d.attention_softmax_in_fp32,
    )
    return parser


def parallel_config_from_args(args: argparse.Namespace) -> MegatronParallelConfig:
    """Build the config from a namespace parsed with `add_megatron_args`' flags."""
    names = {f.name for f in fields(MegatronParallelConfig)}
    return MegatronParallelConfig(**{k: v for k, v in vars(args).items() if k in names})


def parse_megatron_args(argv: Sequence[str]) -> tuple[MegatronParallelConfig, list[str]]:
    """Parse Megatron flags out of a command line; other flags are returned untouched.

    Args:
        argv: e.g. `["--tensor-model-parallel-size", "2", "--sequence-parallel", ...]`.

    Returns:
        The config and the arguments that are not Megatron flags.
    """
    parser = add_megatron_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    args, rest = parser.parse_known_args(list(argv))
    return parallel_config_from_args(args), rest


def transformer_config_kwargs(
    arch: QwenArchitecture, parallel: MegatronParallelConfig, *, cpu_initialization: bool = False
) -> dict[str, Any]:
    """Keyword arguments of megatron-core's `TransformerConfig` for this model and layout.

    `activation_func` and `params_dtype` are given as the names `"silu"` and
    `"bfloat16"`/`"float32"`; `model.build_transformer_config` turns them into objects.

    Args:
        arch: The model's architecture.
        parallel: Parallelism, recompute and precision.
        cpu_initialization: Initialise parameters on the CPU (Megatron's
            `--use-cpu-initialization`; required when running on the CPU).

    Raises:
        ValueError: If the model does not split evenly under `parallel`.
    """
    parallel.check_model(arch)
    fused = parallel.fused_kernels
    return {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_layernorm,
        "hidden_dropout": parallel.hidden_dropout,
        "attention_dropout": parallel.attention_dropout,
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "context_parallel_size": parallel.context_parallel_size,
        "sequence_parallel": parallel.effective_sequence_parallel,
        "recompute_granularity": parallel.recompute_granularity,
        "recompute_method": parallel.recompute_method,
        "recompute_num_layers": parallel.recompute_num_layers,
        "params_dtype": "bfloat16" if parallel.bf16 else "float32",
        "attention_softmax_in_fp32": parallel.attention_softmax_in_fp32,
        # Pipeline schedules: the dtype of the activations sent between stages; micro-batches
        # of different shapes (their shapes are sent ahead); and the loss handed back is
        # turnrl's share of the mini-batch loss already, which the schedule must not divide
        # by the micro-batch count again.
        "pipeline_dtype": "bfloat16" if parallel.bf16 else "float32",
        "variable_seq_lengths": parallel.pipeline_model_parallel_size > 1,
        "moe_token_dispatcher_type": "alltoall",  # no experts; the default refuses the above
        "calculate_per_token_loss": True,
        "bf16": parallel.bf16,
        "use_cpu_initialization": cpu_initialization,
        "bias_activation_fusion": fused,
        "bias_dropout_fusion": fused,
        "masked_softmax_fusion": fused,
        "apply_rope_fusion": fused,
        "gradient_accumulation_fusion": fused,
        "persist_layer_norm": fused,
    }


def check_run(
    parallel: MegatronParallelConfig, ranks: int, device: str, dtype: str, ranks_flag: str
) -> None:
    """Refuse at start, naming the flag, a megatron training run this machine cannot run:
    bfloat16 on the CPU, ``ranks`` trainer ranks that TP x PP x CP does not divide (their
    flag is ``ranks_flag``), or megatron-core not installed.

    Raises:
        ValueError: the first of these that applies.
    """
    if device == "cpu" and dtype == "bfloat16":
        raise ValueError(
            "--dtype bfloat16 with --train-backend megatron on --device cpu: megatron-core's "
            "layers mix bfloat16 and float32 in the backward under CPU autocast (their "
            "autocast hooks are CUDA's); use --dtype float32 on the CPU"
        )
    p, split = parallel, parallel.model_parallel_size
    if ranks % split:
        raise ValueError(
            f"--tensor-model-parallel-size {p.tensor_model_parallel_size}: {ranks} trainer "
            f"rank(s) are not a multiple of TP x PP x CP = {split} ({ranks_flag})"
        )
    if not megatron_available():
        raise ValueError(f"--train-backend megatron needs megatron-core: {INSTALL_HINT}")
