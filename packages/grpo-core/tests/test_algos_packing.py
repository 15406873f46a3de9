"""Token-budget packing: hand cases, budget/coverage/balance properties, bad inputs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.grpo_core.algos import pack_micro_batches


def _flat(plan):
    return sorted(i for rank in plan.micro_batches for mb in rank for i in mb)


def test_hand_case_two_ranks_perfectly_packed():
    lengths = [5, 3, 8, 2, 7, 1, 9, 5]  # 40 tokens = 4 budgets of 10
    plan = pack_micro_batches(lengths, max_tokens=10, dp_size=2)
    assert plan.num_micro_batches == 2
    assert plan.utilisation == pytest.approx(1.0)
    assert plan.rank_tokens(lengths) == [20, 20]
    assert _flat(plan) == list(range(8))


def test_more_bins_when_first_fit_fails_and_counts_equal_per_rank():
    lengths = [6, 6, 6, 6, 6]  # 30 tokens but no two fit in 10: needs 5 bins -> 6 for 2 ranks
    plan = pack_micro_batches(lengths, max_tokens=10, dp_size=2)
    assert [len(r) for r in plan.micro_batches] == [3, 3]
    assert sum(1 for r in plan.micro_batches for mb in r if not mb) == 1  # one empty filler
    assert plan.utilisation == pytest.approx(30 / 60)


def test_oversize_sample_errors_by_default_or_gets_its_own_micro_batch():
    with pytest.raises(ValueError, match="longer than max_tokens"):
        pack_micro_batches([3, 25, 4], max_tokens=10)
    with pytest.warns(UserWarning, match="exceed max_tokens"):
        plan = pack_micro_batches([3, 25, 4], max_tokens=10, allow_oversize=True)
    assert [1] in plan.micro_batches[0]
    assert _flat(plan) == [0, 1, 2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1, 2], 0, 1), "max_tokens"),
        (([1, 2], 10, 0), "dp_size"),
        (([1, 2], 10, 3), "cannot feed 3"),
        (([1, 0], 10, 1), "positive integers"),
        (([1, 2.5], 10, 1), "positive integers"),
    ],
)
def test_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        pack_micro_batches(*args)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=80),
    st.integers(300, 1000),
    st.integers(1, 4),
)
def test_property_never_over_budget_every_sample_once_same_count_per_rank(lengths, budget, dp):
    if len(lengths) < dp:
        lengths = lengths * dp
    plan = pack_micro_batches(lengths, budget, dp)
    assert _flat(plan) == list(range(len(lengths)))
    assert len({len(r) for r in plan.micro_batches}) == 1
    for rank in plan.micro_batches:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= budget
    assert 0 < plan.utilisation <= 1
