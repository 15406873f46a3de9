"""DAPO dynamic sampling: the filter, the stateful sampler, split groups, max tries."""

import pytest
import torch

from turnrl.grpo_core.algos import DynamicSampler, dynamic_sampling_filter


def test_filter_keeps_varying_groups_drops_constant_and_singletons():
    res = dynamic_sampling_filter([1.0, 0.0, 1.0, 1.0, 0.5], ["a", "b", "a", "b", "c"])
    assert res.kept_groups == ["b"] and res.dropped_groups == ["a", "c"]
    assert res.keep.tolist() == [False, True, False, True, False]


def test_filter_min_std_and_tensor_ids():
    res = dynamic_sampling_filter(
        torch.tensor([0.0, 0.1, 0.0, 2.0]), torch.tensor([1, 1, 2, 2]), min_std=0.5
    )
    assert res.kept_groups == [2]


def test_filter_bad_inputs():
    with pytest.raises(ValueError, match="group ids"):
        dynamic_sampling_filter([1.0, 0.0], ["a"])
    with pytest.raises(ValueError, match="finite"):
        dynamic_sampling_filter([float("nan"), 0.0], ["a", "a"])
    with pytest.raises(ValueError, match="min_std"):
        dynamic_sampling_filter([1.0, 0.0], ["a", "a"], min_std=-1)


def test_sampler_accumulates_until_target():
    sampler = DynamicSampler(target_num_groups=2, max_tries=3)
    first = sampler.add([1.0, 1.0, 0.0, 1.0], ["p0", "p0", "p1", "p1"])
    assert first.need_more and first.newly_kept == ["p1"] and first.newly_dropped == ["p0"]
    second = sampler.add([0.0, 0.0, 1.0, 0.0, 0.0, 1.0], ["p2", "p2", "p3", "p3", "p4", "p4"])
    assert not second.need_more and second.num_kept_groups == 2
    assert sampler.selected_groups() == ["p1", "p3"]


def test_sampler_waits_for_groups_split_across_batches():
    sampler = DynamicSampler(target_num_groups=1, max_tries=5, group_size=3)
    status = sampler.add([1.0, 0.0], ["g", "g"])  # incomplete: not judged yet
    assert status.need_more and status.newly_kept == [] and status.newly_dropped == []
    status = sampler.add([1.0], ["g"])
    assert not status.need_more and status.newly_kept == ["g"]


def test_sampler_raises_after_max_tries():
    sampler = DynamicSampler(target_num_groups=1, max_tries=2)
    sampler.add([1.0, 1.0], ["a", "a"])
    with pytest.raises(RuntimeError, match="after 2 tries"):
        sampler.add([0.0, 0.0], ["b", "b"])


def test_sampler_bad_config_and_duplicate_groups():
    with pytest.raises(ValueError, match="must be >= 1"):
        DynamicSampler(target_num_groups=0)
    with pytest.raises(ValueError, match="group_size"):
        DynamicSampler(target_num_groups=1, group_size=1)
    sampler = DynamicSampler(target_num_groups=3)
    sampler.add([1.0, 0.0], ["a", "a"])
    with pytest.raises(ValueError, match="already judged"):
        sampler.add([1.0], ["a"])
    over = DynamicSampler(target_num_groups=3, group_size=2)
    with pytest.raises(ValueError, match="more than group_size"):
        over.add([1.0, 0.0, 1.0], ["a", "a", "a"])
