"""The app on tau-bench's real retail data (a handful of tasks; skipped when the data is absent).

Loads the data the way ``--tau-bench-dir DIR --domain retail`` does, and plays each task's
gold actions as an agent conversation against the real retail environment and the
scripted user (the engine replays the gold turns; see ``tau_replay.py``): every episode must
complete with tau-bench reward 1, so what the app measures with a model is the model.
"""

from __future__ import annotations

import pytest
from tau_paths import TAU_BENCH_DIR
from tau_replay import ReplayEngine
from turnrl_app_tau.cli import resolve
from turnrl_app_tau.stages import evaluate, rollout_config

from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.tau.data import load_tasks_and_domain, tool_schemas
from turnrl.tool_envs.tau.episodes import TauEpisodes
from turnrl.tool_envs.tau.gold import TaskUser, gold_conversation

pytestmark = pytest.mark.skipif(
    not (TAU_BENCH_DIR / "retail").is_dir(), reason="tau-bench data not present"
)


async def test_gold_episodes_on_real_retail_tasks(tmp_path) -> None:
    config = resolve(
        [
            "--tau-bench-dir",
            str(TAU_BENCH_DIR),
            "--domain",
            "retail",
            "--task-start",
            "0",
            "--task-end",
            "5",
            "--num-heldout",
            "2",
            "--max-turns",
            "30",
            "--rollout-max-context-len",
            "32768",
        ],
        {},
    ).config
    data = load_tasks_and_domain(config.tau)
    assert (len(data.train), len(data.heldout)) == (3, 2)
    assert data.source.startswith("tau-bench retail")
    tools = tool_schemas(data, short=False)
    assert len(tools) == len(data.domain.schemas)  # real data: every tool is shown
    chat = ChatTokenizer.from_dir(build_tiny_model(tmp_path / "tiny"))
    tasks = data.train + data.heldout
    engine = ReplayEngine(
        chat, [gold_conversation(data.domain, t, data.domain.wiki) for t in tasks]
    )
    episodes = TauEpisodes(engine, chat, data.domain, tools, rollout_config(config), TaskUser)
    record = await evaluate(episodes, tasks, trials=1, config=rollout_config(config, 0.0, 5))
    assert record["failed"] == 0.0
    assert record["score"] == 1.0 and record["metrics"]["pass^1"] == 1.0
    # Each gold action is one tool call of the agent.
    assert record["metrics"]["tool_calls"] == pytest.approx(
        sum(len(t.actions) for t in tasks) / len(tasks)
    )
    assert record["metrics"]["tool_calls"] > 0
