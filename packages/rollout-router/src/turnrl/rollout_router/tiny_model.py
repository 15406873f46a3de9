"""A tiny Qwen3-architecture model with random weights and a small BPE tokenizer.

Tests and benchmarks need a real model folder an engine can serve, and nothing can be
downloaded from a model hub. :func:`build_tiny_model` writes one in seconds:

- a byte-level BPE tokenizer (vocabulary ~2k) trained with ``tokenizers`` on text that
  ships with Python itself, with Qwen3's special tokens and a Qwen3-like chat template
  (system / user / assistant / tool turns, ``<tool_call>`` blocks, ``<think>``);
- a ``Qwen3ForCausalLM`` (2 layers, hidden 128) initialised from ``seed``.

The build needs torch and transformers, which the router's own environment does not
have, so it runs this file as a script with the engine environment's python (see
:mod:`turnrl.rollout_router.engine_env`). This module imports only the standard library
at the top; the script part imports the heavy packages.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# Qwen3-style ChatML template: optional tools block in the system turn, tool calls as JSON
# inside <tool_call> tags, tool results as user-side <tool_response> blocks.
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Function signatures in <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Return each call as <tool_call>{"name": <name>, "arguments": <args>}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


@dataclass
class TinyModelConfig:
    """Shape of the tiny model."""

    vocab_size: int = 2048
    """Target BPE vocabulary size (special tokens included)."""
    hidden_size: int = 128
    """Model width."""
    intermediate_size: int = 256
    """MLP width."""
    num_hidden_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 32
    """Per-head width."""
    max_position_embeddings: int = 32768
    """Longest context the config allows."""
    seed: int = 0
    """Seed of the random weights: different seeds give different greedy outputs."""
    dtype: str = "bfloat16"
    """Dtype the weights are saved in."""


def build_tiny_model(
    out_dir: Path, python: Path | str, config: TinyModelConfig | None = None, timeout: float = 300.0
) -> Path:
    """Write a tiny Qwen3 model + tokenizer to ``out_dir`` using ``python`` (engine env).

    Args:
        out_dir: Folder to create (parents too); existing files are overwritten.
        python: An interpreter with torch, transformers and tokenizers.
        config: Model shape and seed.
        timeout: Seconds before the build is abandoned.

    Returns:
        ``out_dir``.

    Raises:
        RuntimeError: the build script failed (its stderr is included).
    """
    config = config or TinyModelConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(python),
        "-P",
        str(Path(__file__).resolve()),
        str(out_dir),
        json.dumps(asdict(config)),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"tiny model build failed:\n{res.stderr[-4000:]}")
    return out_dir


def _training_text() -> list[str]:
    """Text to train the BPE on: sources of a few standard-library modules (always present)."""
    import argparse as a
    import inspect
    import json as j
    import textwrap as t

    lines: list[str] = []
    for mod in (a, j, t, inspect):
        lines.extend(inspect.getsource(mod).splitlines())
    return lines


def _build(out_dir: Path, cfg: TinyModelConfig) -> None:  # pragma: no cover - engine env only
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = cfg.max_position_embeddings
    fast.save_pretrained(out_dir)

    eos = fast.convert_tokens_to_ids("<|im_end|>")
    pad = fast.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(eos, int) and isinstance(pad, int)
    model_cfg = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(model_cfg).to(getattr(torch, cfg.dtype))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(out_dir, safe_serialization=True)


def _main() -> None:  # pragma: no cover - engine env only
    parser = argparse.ArgumentParser(description="build a tiny Qwen3 model folder")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("config_json")
    args = parser.parse_args()
    _build(args.out_dir, TinyModelConfig(**json.loads(args.config_json)))
    print(args.out_dir)


if __name__ == "__main__":
    _main()
