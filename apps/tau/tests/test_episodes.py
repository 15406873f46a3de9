"""The app's tau path without an engine: gold conversations, scripted user, rewards, pass^k."""

from __future__ import annotations

import pytest
from tau_replay import ReplayEngine
from turnrl_app_tau.cli import resolve
from turnrl_app_tau.config import TAU_REWARDS, TauSettings, preset
from turnrl_app_tau.stages import TauStages, evaluate, rollout_config

from turnrl.grpo_core.recipe.sft import chat_prefix as prefix
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.tau.data import load_tasks_and_domain, tool_schemas
from turnrl.tool_envs.tau.episodes import REWARDS, TauEpisodes, batched_tau_rm
from turnrl.tool_envs.tau.gold import TaskUser, gold_conversation


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer.from_dir(build_tiny_model(tmp_path_factory.mktemp("tiny")))


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
    record = await evaluate(episodes, tasks, trials=2, config=rollout_config(config, 0.0, 4))
    assert record["score"] == 1.0 and record["score_se"] == 0.0 and record["failed"] == 0.0
    metrics = record["metrics"]
    assert metrics["pass^1"] == metrics["pass^2"] == 1.0
    assert metrics["tool_calls"] >= 2 and metrics["invalid_tool_calls"] == 0
    # Shaped reward: 1 + 0.15 per call (successful and well formed), capped at 1.5.
    assert 1.3 <= metrics["shaped_reward"] <= 1.5
    assert record["per_item"] == {"tau": [1.0] * len(tasks)}
    trajs = await episodes.generate(tasks[:2], 2)
    assert trajs[0].group_id == trajs[1].group_id != trajs[2].group_id
    assert all(t.status == "completed" for t in trajs)
    rewards = await batched_tau_rm(trajs)
    assert rewards == [1.0, 1.0, 1.0, 1.0]  # divided by the group maximum


def test_every_reward_name_the_config_accepts_has_a_hook() -> None:
    assert tuple(REWARDS) == TAU_REWARDS


async def test_gold_replay_without_tool_schemas_still_earns_reward(chat: ChatTokenizer) -> None:
    """The tools are called by name whether or not their schemas are in the prompt."""
    config = preset("smoke")
    data = load_tasks_and_domain(config.tau)
    tasks = data.heldout
    engine = ReplayEngine(
        chat, [gold_conversation(data.domain, t, data.domain.wiki) for t in tasks]
    )
    episodes = TauEpisodes(engine, chat, data.domain, [], rollout_config(config), TaskUser)
    record = await evaluate(episodes, tasks, trials=1, config=rollout_config(config, 0.0, 4))
    assert record["score"] == 1.0 and record["metrics"]["invalid_tool_calls"] == 0


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
    # The curriculum is grpo-core's sft section's: the CPU default runs it, the flags set it.
    assert preset("cpu-default").sft.prefix_steps > 0 and preset("cpu-default").sft.prefix_loss
    sft = resolve(["--sft-prefix-steps", "7", "--sft-prefix-loss", "0.5"], {}).config.sft
    assert (sft.prefix_steps, sft.prefix_loss) == (7, 0.5)


def test_the_default_sft_on_other_stores_is_for_the_synthetic_domain_only() -> None:
    """The CPU default trains SFT on other generated stores only; with real data (no other
    stores) it trains on the training tasks, unless those flags are given, then refused."""
    default = resolve([], {}).config.tau
    assert (default.sft_extra_stores, default.sft_train_tasks) == (2, False)
    real = ["--domain", "retail", "--tau-bench-dir", "data"]
    tau = resolve(real, {}).config.tau
    assert (tau.sft_extra_stores, tau.sft_train_tasks) == (0, True)
    for flags in (["--no-sft-train-tasks"], ["--sft-extra-stores", "1"]):
        with pytest.raises(ValueError, match="synthetic domain"):  # refused, not ignored
            resolve([*real, *flags], {})


def test_sft_without_the_training_tasks_sees_only_other_stores() -> None:
    """``--no-sft-train-tasks``: no conversation of a training task (no order id of the
    run's store) is in the SFT data; without other stores to train on it is refused."""
    config = resolve(["--smoke", "--sft-extra-stores", "1", "--no-sft-train-tasks"], {}).config
    data = load_tasks_and_domain(config.tau)
    chats = TauStages(config, data, [], None).sft_data()
    with_tasks = resolve(["--smoke", "--sft-extra-stores", "1", "--sft-train-tasks"], {}).config
    both = TauStages(with_tasks, data, [], None).sft_data()
    assert chats is not None and both is not None
    assert len(both.chats) == len(chats.chats) + len(data.train)
    own = {str(data.conversation(task)) for task in data.train}
    assert own & {str(c) for c in both.chats} and not own & {str(c) for c in chats.chats}
    with pytest.raises(ValueError, match="sft_train_tasks off needs other stores"):
        TauSettings(domain="synthetic", sft_train_tasks=False)
