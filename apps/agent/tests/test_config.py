"""Presets, flags and what the app refuses at start (no engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLE
from turnrl_app_agent.agents import load_agent, load_tasks
from turnrl_app_agent.cli import resolve
from turnrl_app_agent.config import AgentSettings, preset
from turnrl_app_agent.main import check_supported


def test_presets_name_the_example_agent_and_its_committed_tasks() -> None:
    for name in ("cpu-default", "smoke"):
        config = preset(name)
        assert config.agent.agent == "examples/mini_retail_agent.py:run"
        train, heldout = load_tasks(config.agent, config.seed)  # found under apps/agent
        check_supported(config)
    assert (len(train), len(heldout)) == (8, 4)  # smoke
    assert preset("cpu-default").agent.eval_trials == 16


def test_committed_task_files_are_what_the_example_writes(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import mini_retail_agent
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    for store, name in (("cpu-default", "mini_retail_tasks"), ("smoke", "mini_retail_smoke")):
        mini_retail_agent.write_tasks(tmp_path / "t.jsonl", store)
        assert (tmp_path / "t.jsonl").read_text() == (EXAMPLE.parent / f"{name}.jsonl").read_text()


def test_a_flag_agent_replaces_the_preset_agent_of_the_other_kind() -> None:
    config = resolve(["--agent-command", "python a.py"]).config
    assert config.agent.agent is None and config.agent.agent_command == "python a.py"
    config = resolve(["--agent", "pkg.mod:run", "--preset", "smoke"]).config
    assert config.agent.agent == "pkg.mod:run" and config.agent.agent_command is None
    with pytest.raises(ValueError, match="not both"):
        resolve(["--agent", "pkg.mod:run", "--agent-command", "python a.py"])
    assert resolve(["eval", "--num-trials", "3"]).config.agent.eval_trials == 3


def sync_agent(task: dict, endpoint: object) -> float:
    return 1.0


@pytest.mark.parametrize(
    ("agent", "message"),
    [
        ("no_colon", "expected module:function"),
        ("no_such_module_xyz:run", "cannot load it .*ModuleNotFoundError"),
        (f"{EXAMPLE}:missing", "cannot load it .*AttributeError"),
        ("missing/file.py:run", "no such file"),
        ("test_config:sync_agent", r"must be `async def run\(task, endpoint\) -> float`"),
        ("json:__doc__", "not a function"),
    ],
)
def test_bad_agent_values_are_refused_with_the_reason(agent: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_supported(resolve(["--agent", agent]).config)


def test_no_agent_or_no_tasks_is_refused() -> None:
    with pytest.raises(ValueError, match="no agent"):
        load_agent(AgentSettings())
    with pytest.raises(ValueError, match="no tasks"):
        check_supported(resolve(["--agent-command", "true", "--tasks", ""]).config)
    with pytest.raises(ValueError, match="heldout_fraction"):
        AgentSettings(heldout_fraction=1.0)


def test_tasks_split_by_marks_else_by_fraction(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"q": i}) for i in range(10)) + "\n\n")
    train, heldout = load_tasks(AgentSettings(tasks=str(path), heldout_fraction=0.2), seed=1)
    assert (len(train), len(heldout)) == (8, 2)
    assert sorted(t["q"] for t in train + heldout) == list(range(10))
    assert load_tasks(AgentSettings(tasks=str(path), heldout_fraction=0.2), 1) == (train, heldout)
    path.write_text('{"q": 1}\n{"q": 2, "split": "heldout"}\n')
    assert load_tasks(AgentSettings(tasks=str(path)), 1) == (
        [{"q": 1}],
        [{"q": 2, "split": "heldout"}],
    )
    path.write_text('{"q": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: a task must be a JSON object"):
        load_tasks(AgentSettings(tasks=str(path)), 1)
    path.write_text('{"q": 1, "split": "heldout"}\n')
    with pytest.raises(ValueError, match="no tasks to train on"):
        load_tasks(AgentSettings(tasks=str(path)), 1)
