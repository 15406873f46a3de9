"""The app's tau path without an engine: gold conversations, scripted user, rewards, pass^k."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tau_replay import ReplayEngine
from turnrl_app_tau.cli import resolve
from turnrl_app_tau.config import TAU_REWARDS, TauSettings, preset
from turnrl_app_tau.data import (
    SHORT_SYSTEM_PROMPT,
    extra_store_conversations,
    load_tasks_and_domain,
)
from turnrl_app_tau.episodes import evaluate
from turnrl_app_tau.main import rollout_config, tool_schemas
from turnrl_app_tau.training import prefix

from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.tau.gold import TaskUser, gold_conversation
from turnrl.tool_envs.tau_episodes import REWARDS, TauEpisodes, batched_tau_rm


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer.from_dir(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="domain"):
        load_tasks_and_domain(TauSettings(domain="bank"))
    with pytest.raises(ValueError, match="--tau-bench-dir"):
        load_tasks_and_domain(TauSettings(domain="retail"))
    with pytest.raises(FileNotFoundError):
        load_tasks_and_domain(TauSettings(domain="retail", tau_bench_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="num_heldout"):
        load_tasks_and_domain(TauSettings(domain="synthetic", synthetic_num_tasks=4, num_heldout=4))


async def test_gold_replay_earns_full_reward(chat: ChatTokenizer) -> None:
    """Every synthetic task, played by its gold conversation, completes with task reward 1."""
    config = preset("smoke")
    data = load_tasks_and_domain(config.tau)
    tools = tool_schemas(data, short=True)
    tasks = data.train + data.heldout
    engine = ReplayEngine(
        chat, [gold_conversation(data.domain, t, data.domain.wiki) for t in tasks]
    )
    episodes = TauEpisodes(engine, chat, data.domain, tools, rollout_config(config), TaskUser)
    metrics = await evaluate(episodes, tasks, trials=2, config=rollout_config(config, 0.0, 4))
    assert metrics["success"] == 1.0 and metrics["pass^2"] == 1.0
    assert metrics["tool_calls"] >= 2 and metrics["invalid_tool_calls"] == 0
    # Shaped reward: 1 + 0.15 per call (successful and well formed), capped at 1.5.
    assert 1.3 <= metrics["shaped_reward"] <= 1.5
    assert metrics["reward"] == 1.0 and metrics["reward_stderr"] == 0.0
    trajs = await episodes.generate(tasks[:2], 2)
    assert trajs[0].group_id == trajs[1].group_id != trajs[2].group_id
    assert all(t.status == "completed" for t in trajs)
    rewards = await batched_tau_rm(trajs)
    assert rewards == [1.0, 1.0, 1.0, 1.0]  # divided by the group maximum


def test_every_reward_name_the_config_accepts_has_a_hook() -> None:
    assert tuple(REWARDS) == TAU_REWARDS


def test_short_prompt_and_no_tool_schemas() -> None:
    config = preset("smoke")
    policy = load_tasks_and_domain(dataclasses.replace(config.tau, policy_in_prompt=True))
    short = load_tasks_and_domain(dataclasses.replace(config.tau, policy_in_prompt=False))
    assert short.domain.wiki == SHORT_SYSTEM_PROMPT != policy.domain.wiki
    assert len(policy.domain.wiki) > 10 * len(SHORT_SYSTEM_PROMPT)
    assert tool_schemas(short, short=True, in_prompt=False) == []
    assert tool_schemas(short, short=True, in_prompt=True)


async def test_gold_replay_without_tool_schemas_still_earns_reward(chat: ChatTokenizer) -> None:
    """The tools are called by name whether or not their schemas are in the prompt."""
    config = preset("smoke")
    data = load_tasks_and_domain(config.tau)
    tasks = data.heldout
    engine = ReplayEngine(
        chat, [gold_conversation(data.domain, t, data.domain.wiki) for t in tasks]
    )
    episodes = TauEpisodes(engine, chat, data.domain, [], rollout_config(config), TaskUser)
    metrics = await evaluate(episodes, tasks, trials=1, config=rollout_config(config, 0.0, 4))
    assert metrics["success"] == 1.0 and metrics["invalid_tool_calls"] == 0


def test_extra_stores_hold_none_of_the_heldout_orders() -> None:
    settings = dataclasses.replace(preset("smoke").tau, synthetic_kinds=["status", "cancel"])
    data = load_tasks_and_domain(settings)
    extra = extra_store_conversations(settings, 2)
    assert len(extra) == 2 * settings.synthetic_num_tasks
    assert all(c[0] == {"role": "system", "content": data.domain.wiki} for c in extra)
    heldout = {t.actions[1].kwargs["order_id"] for t in data.heldout}
    mentioned = {
        json.loads(m["tool_calls"][0]["function"]["arguments"]).get("order_id")
        for c in extra
        for m in c
        if m.get("tool_calls")
    }
    assert mentioned and not heldout & mentioned
    assert extra_store_conversations(settings, 0) == []


_DATA_DIGEST = """
import dataclasses, hashlib, json
from turnrl_app_tau.config import preset
from turnrl_app_tau.data import load_tasks_and_domain
from turnrl.tool_envs.tau.gold import gold_conversation
settings = dataclasses.replace(preset("smoke").tau, synthetic_kinds=["status", "cancel"])
data = load_tasks_and_domain(settings)
train = [gold_conversation(data.domain, t, data.domain.wiki) for t in data.train]
heldout = [t.instruction for t in data.heldout]
print(hashlib.sha256(json.dumps([train, heldout], default=str).encode()).hexdigest())
"""


def test_synthetic_tasks_do_not_depend_on_the_hash_seed() -> None:
    """The split and the SFT data order are the same in every process (a set of kinds once
    made them follow PYTHONHASHSEED, so one seed gave different SFT models)."""
    digests = set()
    for hash_seed in ("0", "1", "2", "3", "4", "5"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run(
            [sys.executable, "-c", _DATA_DIGEST], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        digests.add(run.stdout.strip())
    assert len(digests) == 1


def test_sft_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="sft_extra_stores"):
        TauSettings(sft_extra_stores=-1)
    with pytest.raises(ValueError, match="--sft-lr-decay"):
        resolve(["--sft-lr-decay", "linear"], {})


def test_prefix_cuts_after_the_nth_assistant_turn() -> None:
    config = preset("smoke")
    data = load_tasks_and_domain(config.tau)
    conversation = gold_conversation(data.domain, data.train[0], data.domain.wiki)
    two = prefix(conversation, 2)
    assert two == conversation[: len(two)] and two[-1]["role"] == "assistant"
    assert sum(m["role"] == "assistant" for m in two) == 2
    assert prefix(conversation, 99) == conversation
    with pytest.raises(ValueError, match="sft_prefix"):
        TauSettings(sft_prefix_turns=0)
    with pytest.raises(ValueError, match="sft_prefix"):
        TauSettings(sft_prefix_steps=-1)
