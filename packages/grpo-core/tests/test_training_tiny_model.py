"""The tiny Qwen3 model builder: loadable by transformers, seeded, with a ChatML tokenizer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnrl.grpo_core.training.tiny_model import (
    ADDED_TOKENS,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    TinyModelConfig,
    build_tiny_model,
    build_tiny_tokenizer,
    sample_chat,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_folder_loads_with_auto_classes(tiny: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 128
    assert model.config.vocab_size == 2048 >= len(tok)
    assert tok.eos_token == IM_END and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    generation = json.loads((tiny / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids(IM_END) in generation["eos_token_id"]
    ids = torch.tensor([tok("hello there, customer")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 2048)
    assert torch.isfinite(logits).all()


def test_special_and_added_tokens_are_single_ids(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    for token in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, token
        assert tok.convert_ids_to_tokens(ids) == [token]


def test_chat_template_renders_chatml_with_tools_and_round_trips(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    messages = sample_chat(seed=1, num_turns=2)
    tools = [{"type": "function", "function": {"name": "find_order", "parameters": {}}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith(f"{IM_START}system\nYou are a helpful assistant.\n\n# Tools")
    assert '"name": "find_order"' in text
    assert '<tool_call>\n{"name": "find_order", "arguments": {"order_id": "#' in text
    assert f"{IM_START}user\n<tool_response>\n" in text
    assert text.count(f"{IM_START}assistant\n") == 3
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(f"{IM_START}assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", TinyModelConfig(seed=3))
    b = build_tiny_model(tmp_path / "b", TinyModelConfig(seed=3))
    c = build_tiny_model(tmp_path / "c", TinyModelConfig(seed=4))
    bytes_a = (a / "model.safetensors").read_bytes()
    assert bytes_a == (b / "model.safetensors").read_bytes()
    assert bytes_a != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_build_does_not_disturb_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    build_tiny_model(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_trains_fast_to_requested_size() -> None:
    start = time.perf_counter()
    tok = build_tiny_tokenizer(vocab_size=1024)
    elapsed = time.perf_counter() - start
    assert len(tok) == 1024
    assert elapsed < 5.0  # ~0.1 s on the 2-core CI machine; generous for slow runners


def test_tied_embeddings_option(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "tied", TinyModelConfig(tie_word_embeddings=True))
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 100}, "vocab_size"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_attention_heads": 3, "num_key_value_heads": 2}, "multiple"),
        ({"num_key_value_heads": 0}, "positive"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyModelConfig(**kwargs)


def test_sample_chat_rejects_zero_turns() -> None:
    with pytest.raises(ValueError, match="num_turns"):
        sample_chat(num_turns=0)
