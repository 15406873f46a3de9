"""Advantage estimators: hand-computed cases, group invariants, and bad inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.grpo_core.algos import (
    compute_advantages,
    discounted_returns,
    group_index,
    masked_whiten,
)

REWARDS = torch.tensor([1.0, 0.0, 1.0, 5.0])
GROUPS = ["a", "a", "a", "b"]


def test_grpo_hand_computed_with_singleton_group_zero():
    adv = compute_advantages(REWARDS, GROUPS, "grpo")
    mean, std = 2 / 3, math.sqrt(1 / 3)  # unbiased std of [1, 0, 1]
    expected = [
        (1 - mean) / (std + 1e-6),
        (0 - mean) / (std + 1e-6),
        (1 - mean) / (std + 1e-6),
        0.0,
    ]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_grpo_without_std_and_dr_grpo_are_group_centred():
    expected = torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.0])
    torch.testing.assert_close(compute_advantages(REWARDS, GROUPS, "dr_grpo"), expected)
    torch.testing.assert_close(
        compute_advantages(REWARDS, GROUPS, "grpo", norm_by_std=False), expected
    )


def test_gspo_advantage_equals_grpo():
    torch.testing.assert_close(
        compute_advantages(REWARDS, GROUPS, "gspo"), compute_advantages(REWARDS, GROUPS, "grpo")
    )


def test_rloo_subtracts_mean_of_the_others():
    adv = compute_advantages(REWARDS, GROUPS, "rloo")
    # sample 0: 1 - mean(0, 1) = 0.5; sample 1: 0 - mean(1, 1) = -1; singleton: 0
    torch.testing.assert_close(adv, torch.tensor([0.5, -1.0, 0.5, 0.0]))


def test_constant_group_gets_zero_not_nan():
    adv = compute_advantages(torch.tensor([2.0, 2.0, 2.0]), [0, 0, 0], "grpo")
    torch.testing.assert_close(adv, torch.zeros(3))


def test_broadcast_to_tokens_by_loss_mask():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0], [1, 1, 1]])
    adv = compute_advantages(REWARDS, GROUPS, "dr_grpo", mask)
    seq = compute_advantages(REWARDS, GROUPS, "dr_grpo")
    torch.testing.assert_close(adv, seq[:, None] * mask.float())


def test_order_does_not_matter_and_ids_may_be_tensors():
    perm = torch.tensor([3, 1, 0, 2])
    ids = torch.tensor([7, 7, 7, 9])
    shuffled = compute_advantages(REWARDS[perm], ids[perm], "grpo")
    torch.testing.assert_close(shuffled, compute_advantages(REWARDS, GROUPS, "grpo")[perm])


def test_never_a_global_baseline_other_groups_do_not_leak():
    base = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 4.0, 8.0]), [0, 0, 1, 1, 1], "grpo")
    moved = compute_advantages(torch.tensor([100.0, 50.0, 3.0, 4.0, 8.0]), [0, 0, 1, 1, 1], "grpo")
    torch.testing.assert_close(base[2:], moved[2:])


def test_discounted_returns_skip_masked_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])  # tool tokens at 2, 3; padding at 5
    ret = discounted_returns(torch.tensor([2.0]), mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0, 0.0, 0.0, 2.0, 0.0]]))


def test_reinforce_plus_plus_is_whitened_discounted_return():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([1.0, -1.0])
    adv = compute_advantages(rewards, [0, 1], "reinforce_plus_plus", mask, gamma=0.9)
    returns = torch.tensor([0.81, 0.9, 1.0, -0.9, -1.0])  # masked-in returns in order
    expected = (returns - returns.mean()) / torch.sqrt(returns.var() + 1e-8)
    torch.testing.assert_close(adv[mask.bool()], expected)
    assert adv[1, 2] == 0


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    rewards = torch.tensor([3.0, 1.0, 10.0, 10.0])
    adv = compute_advantages(rewards, ["x", "x", "y", "y"], "reinforce_plus_plus_baseline", mask)
    tokens = torch.tensor([1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    expected = (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    torch.testing.assert_close(adv[mask.bool()], expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "ppo"}, "unknown advantage method"),
        ({"group_ids": ["a"]}, "group ids"),
        ({"rewards": torch.tensor([1.0, float("nan"), 0.0, 1.0])}, "NaN"),
        ({"rewards": torch.ones(2, 2)}, "1-D"),
        ({"group_ids": torch.tensor([0.0, 0.0, 1.0, 1.0])}, "integer tensor"),
        ({"expected_group_size": 3}, "size"),
        ({"method": "reinforce_plus_plus"}, "needs loss_mask"),
        ({"loss_mask": torch.ones(3, 2)}, "loss_mask must be"),
        ({"method": "reinforce_plus_plus", "loss_mask": torch.ones(4, 2), "gamma": 1.5}, "gamma"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, message):
    args = {"rewards": REWARDS, "group_ids": GROUPS, "method": "grpo"} | kwargs
    with pytest.raises(ValueError, match=message):
        compute_advantages(**args)


def test_whitening_needs_two_tokens():
    with pytest.raises(ValueError, match="two loss-mask tokens"):
        masked_whiten(torch.ones(1, 3), torch.tensor([[0.0, 1.0, 0.0]]))


def test_group_index_is_dense_and_consistent():
    index, n = group_index(["b", "a", "b", ("c", 1)], 4)
    assert n == 3
    assert index[0] == index[2] and len({int(i) for i in index}) == 3


group_batches = st.lists(
    st.tuples(st.integers(0, 5), st.floats(-10, 10, allow_nan=False, width=32)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(group_batches, st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_property_advantages_zero_mean_in_every_group(batch, method):
    ids = [g for g, _ in batch]
    rewards = torch.tensor([r for _, r in batch], dtype=torch.float64)
    adv = compute_advantages(rewards, ids, method)
    for g in set(ids):
        members = adv[torch.tensor([i == g for i in ids])]
        assert abs(float(members.mean())) < 1e-6
        if len(members) == 1:
            assert float(members[0]) == 0.0


def test_group_index_rejects_bad_tensor_shape():
    with pytest.raises(ValueError, match="1-D tensor of 4 ids"):
        group_index(torch.zeros(2, 2, dtype=torch.long), 4)
