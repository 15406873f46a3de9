"""tau2-bench's reward: components gated by the basis, endings, action matching, the NL judge's I/O."""

from __future__ import annotations

import json

import pytest

from turnrl.rewards.tau2 import (
    GoldAction,
    JudgeFormatError,
    Tau2RewardInput,
    nl_judge_messages,
    parse_gold_actions,
    parse_nl_verdicts,
    tau2_reward,
)


def test_the_reward_is_the_product_of_the_components_in_the_basis() -> None:
    base = dict(ending="user_stop", db_match=True, communicate_info=("$1200",))
    said = Tau2RewardInput(**base, agent_messages=("It costs $1,200 in total.",))
    silent = Tau2RewardInput(**base, agent_messages=("Done.",))
    assert tau2_reward(said).reward == 1.0
    assert tau2_reward(silent).reward == 0.0
    assert tau2_reward(silent).breakdown["communicate"] == {"$1200": False}
    db_only = Tau2RewardInput(**base, agent_messages=("Done.",), reward_basis=("DB",))
    assert tau2_reward(db_only).reward == 1.0  # COMMUNICATE computed, not gated
    assert tau2_reward(db_only).breakdown["r_communicate"] == 0.0
    wrong_db = Tau2RewardInput(ending="user_stop", db_match=False, reward_basis=("DB",))
    assert tau2_reward(wrong_db).reward == 0.0


def test_commas_are_removed_from_the_message_only() -> None:
    found = Tau2RewardInput(
        ending="user_stop", communicate_info=("1200",), agent_messages=("1,200",)
    )
    assert tau2_reward(found).reward == 1.0
    kept = Tau2RewardInput(
        ending="user_stop", communicate_info=("1,200",), agent_messages=("1,200",)
    )
    assert tau2_reward(kept).reward == 0.0


@pytest.mark.parametrize("ending", ["max_steps", "too_many_errors", "user_error", "truncated"])
def test_an_episode_that_did_not_stop_scores_zero(ending: str) -> None:
    result = tau2_reward(Tau2RewardInput(ending=ending, db_match=True))
    assert result.reward == 0.0
    assert ending in result.breakdown["note"]


def test_no_criteria_scores_one_and_no_comparison_passes_db() -> None:
    assert (
        tau2_reward(Tau2RewardInput(ending="user_stop", has_criteria=False, db_match=False)).reward
        == 1.0
    )
    assert tau2_reward(Tau2RewardInput(ending="agent_stop", db_match=None)).reward == 1.0


def test_env_assertions_all_must_hold() -> None:
    ok = Tau2RewardInput(
        ending="user_stop", reward_basis=("ENV_ASSERTION",), env_assertions=(True, True)
    )
    bad = Tau2RewardInput(
        ending="user_stop", reward_basis=("ENV_ASSERTION",), env_assertions=(True, False)
    )
    assert (tau2_reward(ok).reward, tau2_reward(bad).reward) == (1.0, 0.0)


def test_gold_actions_match_on_compare_args() -> None:
    gold = parse_gold_actions(
        [
            {
                "name": "refuel_data",
                "arguments": {"line_id": "L1", "gb": 2.0},
                "compare_args": None,
            },
            {"name": "toggle_data", "arguments": {}, "compare_args": []},
            {
                "name": "transfer_to_human_agents",
                "arguments": {"summary": "x"},
                "compare_args": ["x"],
            },
        ]
    )
    assert gold[0].matches("refuel_data", {"line_id": "L1", "gb": 2.0})
    assert gold[0].matches("refuel_data", {"line_id": "L1"})  # compared on the call's own keys
    assert not gold[0].matches("refuel_data", {"line_id": "L1", "gb": 1.0})
    assert gold[1].matches("toggle_data", {"anything": 1})
    assert gold[2].matches("transfer_to_human_agents", {"summary": "something else"})
    assert not GoldAction("a", {"k": 1}, ("k",)).matches("b", {"k": 1})
    episode = Tau2RewardInput(
        ending="user_stop",
        reward_basis=("ACTION",),
        gold_actions=gold,
        tool_calls=(("toggle_data", {}), ("refuel_data", {"line_id": "L1", "gb": 2.0})),
    )
    result = tau2_reward(episode)
    assert result.reward == 0.0 and result.breakdown["actions"] == [True, True, False]


def test_nl_assertions_need_verdicts_when_gated() -> None:
    with pytest.raises(ValueError, match="no judge verdicts"):
        Tau2RewardInput(ending="user_stop", reward_basis=("NL_ASSERTION",), nl_assertions=("a",))
    met = Tau2RewardInput(
        ending="user_stop",
        reward_basis=("NL_ASSERTION",),
        nl_assertions=("a", "b"),
        nl_verdicts=(True, True),
    )
    unmet = Tau2RewardInput(
        ending="user_stop",
        reward_basis=("NL_ASSERTION",),
        nl_assertions=("a", "b"),
        nl_verdicts=(True, False),
    )
    assert (tau2_reward(met).reward, tau2_reward(unmet).reward) == (1.0, 0.0)
    with pytest.raises(ValueError, match="unknown reward basis"):
        Tau2RewardInput(ending="user_stop", reward_basis=("DB", "VIBES"))


def test_the_judge_sees_every_message_and_its_answer_is_parsed() -> None:
    conversation = [
        {"role": "assistant", "content": "Hi!"},
        {"role": "tool", "content": '{"order": 1}'},
        {"role": "user", "content": "Cancel it."},
    ]
    messages = nl_judge_messages(conversation, ["Agent cancels the order."])
    assert messages[0]["role"] == "system" and "metExpectation" in messages[0]["content"]
    assert 'tool: {"order": 1}' in messages[1]["content"]
    assert "- Agent cancels the order." in messages[1]["content"]
    answer = {"results": [{"expectedOutcome": "a", "reasoning": "r", "metExpectation": True}]}
    assert parse_nl_verdicts(json.dumps(answer), ["a"]) == (True,)
    assert parse_nl_verdicts("```json\n" + json.dumps(answer) + "\n```", ["a"]) == (True,)
    for bad in ("not json", '{"results": [{"metExpectation": "yes"}]}', json.dumps(answer)):
        with pytest.raises(JudgeFormatError):
            parse_nl_verdicts(bad, ["a", "b"] if bad == json.dumps(answer) else ["a"])
