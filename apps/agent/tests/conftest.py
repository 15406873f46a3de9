"""Shared fixtures: the tiny model's chat tokenizer and the tau app's replay engine (the one
test double, standing where a vLLM engine would)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.tool_envs.chat import ChatTokenizer

APP = Path(__file__).resolve().parents[1]
EXAMPLE = APP / "examples" / "mini_retail_agent.py"


def _tau_replay() -> object:
    """apps/tau/tests/tau_replay.py (replays gold conversations as engine token ids)."""
    path = APP.parent / "tau" / "tests" / "tau_replay.py"
    spec = importlib.util.spec_from_file_location("tau_replay", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tau_replay"] = module
    spec.loader.exec_module(module)
    return module


tau_replay = _tau_replay()


@pytest.fixture(scope="session")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer.from_dir(build_tiny_model(tmp_path_factory.mktemp("tiny")))
