"""Tiny Qwen3-architecture model and BPE tokenizer for CPU tests and demos.

`build_tiny_model(folder)` writes a complete Hugging Face model folder that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` (and vLLM) load:

- a byte-level BPE tokenizer trained in well under a second with the `tokenizers` library on
  a small built-in corpus of chat and tool-call text, using Qwen2/Qwen3's pre-tokenizer
  pattern, the special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` and a
  Qwen-style ChatML chat template (system / user / assistant / tool roles, `tools`,
  `<tool_call>` and `<tool_response>` blocks);
- a `Qwen3ForCausalLM` with seeded random weights (2 layers, hidden 128 by default) saved as
  safetensors, with `generation_config.json` naming `<|im_end|>` as end of sequence.

Same seed and config give bit-identical weights and the same tokenizer.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Not special (they stay in decoded text) but kept as single tokens, as in Qwen3.
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen2/Qwen3 pre-tokenizer split pattern (contractions, letters, single digits, punctuation,
# newlines, spaces); the byte-level step after it maps bytes to printable characters.
_QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as Qwen renders it: tools listed in the system turn, assistant tool calls as JSON in
# <tool_call> blocks, tool results as a user turn of <tool_response> blocks.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{ raise_exception('system message must be first') }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls | default([]) %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{%- if loop.first and message.content %}{{- '\\n' }}{%- elif not loop.first %}"
    "{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ raise_exception('unknown role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape and seed of the tiny Qwen3 model and its tokenizer."""

    vocab_size: int = 2048
    """Target BPE vocabulary size (special and added tokens included)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 256
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int = 2
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Query heads per layer."""
    num_key_value_heads: int = 2
    """Key/value heads per layer (grouped-query attention as in Qwen3)."""
    head_dim: int = 32
    """Dimension of one attention head (vLLM's CPU attention rejects 16; 32 works)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model (and a vLLM engine serving it) accepts."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output layer (lm_head) weights."""
    seed: int = 0
    """Seed for the random weights and the tokenizer's training corpus."""

    def __post_init__(self) -> None:
        if self.vocab_size < 512:
            raise ValueError(
                f"vocab_size must be >= 512 (256 bytes + merges), got {self.vocab_size}"
            )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads <= 0 or self.num_key_value_heads <= 0:
            raise ValueError("num_attention_heads and num_key_value_heads must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


_WORDS_TEXT = (
    "the order customer user assistant tool call result item price refund return exchange "
    "flight booking reservation cancel payment card address name email status pending "
    "delivered shipped number product please thank you help with your my can I want to "
    "is are was be a an of for on in at by from and or not yes no find get update check "
    "answer question compute value total sum python code print import def return if else "
    "true false null error success think step first then finally boxed integer"
)
_WORDS = tuple(_WORDS_TEXT.split())


_SYLLABLES_TEXT = (
    "ba be bi bo bu da de di do du ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu "
    "pa pe pi po pu ra re ri ro ru sa se si so su ta te ti to tu va ve vi vo vu za ze zi zo zu "
    "an en in on un ar er ir or ur st tr pl gr ch sh th"
)
_SYLLABLES = tuple(_SYLLABLES_TEXT.split())


def _training_corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Deterministic small corpus of chat-like, JSON and code-like lines to train the BPE.

    Real words plus seeded pseudo-words (2-4 syllables) so the BPE has enough distinct
    merges to reach a vocabulary of a few thousand.
    """
    rng = random.Random(seed)
    pseudo = ["".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))) for _ in range(3000)]
    vocabulary = list(_WORDS) * 20 + pseudo
    lines = [CHAT_TEMPLATE]
    for i in range(num_lines):
        words = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(3, 12)))
        kind = i % 4
        if kind == 0:
            lines.append(words.capitalize() + rng.choice([".", "?", "!"]))
        elif kind == 1:
            args = {rng.choice(_WORDS): rng.randint(0, 999) for _ in range(rng.randint(1, 3))}
            lines.append('{"name": "' + rng.choice(_WORDS) + '", "arguments": ' + f"{args}}}")
        elif kind == 2:
            lines.append(f"{rng.choice(_WORDS)} = {rng.randint(0, 10**6)} + {rng.random():.3f}")
        else:
            lines.append(
                f"{IM_START}{rng.choice(['user', 'assistant', 'system'])}\n{words}{IM_END}\n"
            )
    return lines


def build_tiny_tokenizer(vocab_size: int = 2048, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a Qwen-style byte-level BPE tokenizer.

    Args:
        vocab_size: target vocabulary size, special and added tokens included.
        seed: seed of the built-in training corpus.

    Returns:
        A `transformers.PreTrainedTokenizerFast` with the ChatML template, `<|im_end|>` as
        eos and `<|endoftext|>` as pad.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.add_tokens(list(ADDED_TOKENS))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(folder: str | Path, config: TinyModelConfig | None = None) -> Path:
    """Write a tiny Qwen3 causal LM (safetensors) and its tokenizer to `folder`.

    Args:
        folder: output folder (created; existing files with the same names are overwritten).
        config: shape and seed; `TinyModelConfig()` by default.

    Returns:
        The folder, loadable with `AutoModelForCausalLM.from_pretrained` and
        `AutoTokenizer.from_pretrained`.
    """
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = config or TinyModelConfig()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(config.vocab_size, config.seed)
    eos_id = int(tokenizer.convert_tokens_to_ids(IM_END))  # type: ignore[arg-type]
    pad_id = int(tokenizer.convert_tokens_to_ids(ENDOFTEXT))  # type: ignore[arg-type]
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {config.vocab_size}")
    hf_config = Qwen3Config(
        # Like Qwen's 151,936, the embedding may be larger than the tokenizer (padding rows).
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    hf_config.architectures = ["Qwen3ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen3ForCausalLM(hf_config)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "tiny_model_config.json").write_text(_json_dumps(asdict(config)))
    return folder


def _json_dumps(obj: object) -> str:
    import json

    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def sample_chat(seed: int = 0, num_turns: int = 2) -> list[dict]:
    """A deterministic multi-turn chat with a tool call, for tests and examples.

    Args:
        seed: seed of the word choice.
        num_turns: number of user/assistant exchanges (>= 1).

    Returns:
        OpenAI-style messages: system, then per turn user, assistant (the first with a tool
        call followed by a tool result and a final assistant answer).
    """
    if num_turns < 1:
        raise ValueError(f"num_turns must be >= 1, got {num_turns}")
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(itertools.islice((rng.choice(_WORDS) for _ in itertools.count()), n))

    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(num_turns):
        messages.append({"role": "user", "content": words(6)})
        if turn == 0:
            call = {"name": "find_order", "arguments": {"order_id": f"#{rng.randint(100, 999)}"}}
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": [{"function": call}]}
            )
            messages.append({"role": "tool", "content": '{"status": "' + words(1) + '"}'})
        messages.append({"role": "assistant", "content": words(8)})
    return messages
