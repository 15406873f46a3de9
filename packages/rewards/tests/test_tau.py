"""tau-bench's reward rule on crafted episodes and on the real task list when present."""

from __future__ import annotations

import json

import pytest

from turnrl.rewards import TauRewardInput, TauShapingConfig, normalize_by_group_max, tau_reward

H1, H2 = "a" * 64, "b" * 64


def test_hash_match_without_outputs_is_one():
    result = tau_reward(TauRewardInput(H1, H1))
    assert result.reward == 1.0
    assert result.breakdown == {"r_actions": 1.0, "gt_data_hash": H1}


def test_hash_mismatch_is_zero_even_when_outputs_are_said():
    result = tau_reward(TauRewardInput(H1, H2, outputs=["10"], agent_messages=["it is 10"]))
    assert result.reward == 0.0
    assert result.breakdown["r_actions"] == 0.0 and result.breakdown["r_outputs"] == 1.0


@pytest.mark.parametrize(
    ("output", "messages", "found"),
    [
        ("1093.34", ["Your refund is $1,093.34."], True),  # commas removed from the message
        ("Blue", ["the BLUE one"], True),  # case-insensitive
        ("1,093.34", ["Your refund is $1,093.34."], False),  # never removed from the output
        ("625.60", ["total 625.6"], False),  # no numeric normalisation
        ("20 hours", ["about 20  hours"], False),  # no whitespace normalisation
        ("42", [], False),
        ("42", ["no", "the answer: 42"], True),  # any message
    ],
)
def test_output_rule(output, messages, found):
    result = tau_reward(TauRewardInput(H1, H1, outputs=[output], agent_messages=messages))
    assert result.breakdown["outputs"] == {output: found}
    assert result.reward == (1.0 if found else 0.0)


def test_every_output_must_be_found():
    episode = TauRewardInput(H1, H1, outputs=["a1", "b2"], agent_messages=["a1 only"])
    result = tau_reward(episode)
    assert result.reward == 0.0 and result.breakdown["outputs"] == {"a1": True, "b2": False}


def test_shaping_adds_per_call_bonuses_and_caps():
    shaping = TauShapingConfig()
    failed = tau_reward(
        TauRewardInput(H1, H2, num_successful_tool_calls=2, num_well_formed_tool_calls=3), shaping
    )
    assert failed.reward == pytest.approx(0.1 * 2 + 0.05 * 3)
    assert failed.breakdown["task_reward"] == 0.0
    success = tau_reward(
        TauRewardInput(H1, H1, num_successful_tool_calls=3, num_well_formed_tool_calls=3), shaping
    )
    assert success.reward == pytest.approx(1.45)
    capped = tau_reward(
        TauRewardInput(H1, H1, num_successful_tool_calls=10, num_well_formed_tool_calls=10), shaping
    )
    assert capped.reward == 1.5
    assert (
        tau_reward(
            TauRewardInput(H1, H1, num_successful_tool_calls=10, num_well_formed_tool_calls=10)
        ).reward
        == 1.0
    )


def test_group_max_normalisation():
    assert normalize_by_group_max([0.3, 1.5, 0.75]) == pytest.approx([0.2, 1.0, 0.5])
    assert normalize_by_group_max([0.0, 0.0]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="at least one"):
        normalize_by_group_max([])
    with pytest.raises(ValueError, match=">= 0"):
        normalize_by_group_max([1.0, -0.5])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"final_data_hash": "", "gt_data_hash": H1}, ValueError, "final_data_hash"),
        ({"final_data_hash": H1, "gt_data_hash": None}, ValueError, "gt_data_hash"),
        ({"final_data_hash": H1, "gt_data_hash": H1, "outputs": "42"}, TypeError, "outputs"),
        (
            {"final_data_hash": H1, "gt_data_hash": H1, "agent_messages": [1]},
            TypeError,
            "agent_messages",
        ),
        (
            {"final_data_hash": H1, "gt_data_hash": H1, "num_successful_tool_calls": -1},
            ValueError,
            ">= 0",
        ),
        (
            {
                "final_data_hash": H1,
                "gt_data_hash": H1,
                "num_successful_tool_calls": 2,
                "num_well_formed_tool_calls": 1,
            },
            ValueError,
            "cannot exceed",
        ),
    ],
)
def test_bad_inputs_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        TauRewardInput(**kwargs)


def test_real_tasks(tau_bench_dir):
    """Every retail train task: the gold hash scores 1, the untouched database 0 if the task writes.

    (The train tasks require no outputs; the output rule is covered by the crafted tests.)
    """
    retail = tau_bench_dir / "retail"
    tasks = [json.loads(line) for line in (retail / "tasks_train.jsonl").read_text().splitlines()]
    hashes = json.loads((retail / "gt_data_hashes_train.json").read_text())
    initial = hashes["initial_data_hash"]
    checked = 0
    for task, entry in zip(tasks, hashes["tasks"], strict=True):
        gold = entry["gt_data_hash"]
        said = [f"Sure. {o.upper()} — done." for o in task["outputs"]]
        assert tau_reward(TauRewardInput(gold, gold, task["outputs"], said)).reward == 1.0
        if not entry["db_unchanged"]:
            assert tau_reward(TauRewardInput(initial, gold, task["outputs"], said)).reward == 0.0
            checked += 1
    assert checked > 400  # nearly every train task writes to the database
