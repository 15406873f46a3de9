"""Policy loss (PPO clip, dual clip, GSPO, TIS), KL, entropy, aggregation, actor loss."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.grpo_core.algos import (
    ActorLossConfig,
    actor_loss,
    aggregate_loss,
    count_loss_tokens_and_seqs,
    entropy_from_logits,
    kl_in_reward,
    kl_penalty,
    policy_loss,
    rollout_mismatch_metrics,
    truncated_is_weights,
)

ONE = torch.ones(1, 1)


def _loss(log_ratio: float, adv: float, **kw) -> float:
    logp = torch.tensor([[log_ratio]])
    return float(policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), ONE, **kw).loss_mat)


@pytest.mark.parametrize(
    ("ratio", "adv", "expected"),
    [
        (1.1, 1.0, -1.1),  # inside the clip range: -A r
        (1.5, 1.0, -1.28),  # above 1 + eps_clip_high, positive A: clipped at 1.28
        (0.5, 1.0, -0.5),  # below 1 - eps, positive A: pessimistic max keeps -A r
        (0.5, -1.0, 0.8),  # negative A, low ratio: clipped at 1 - 0.2
        (2.0, -1.0, 2.0),  # negative A, high ratio: unclipped -A r
        (5.0, -1.0, 3.0),  # dual clip bounds at -A c = 3
    ],
)
def test_ppo_clip_hand_values(ratio, adv, expected):
    assert _loss(math.log(ratio), adv) == pytest.approx(expected, rel=1e-5)


def test_dual_clip_disabled_and_log_ratio_clamp():
    assert _loss(math.log(5.0), -1.0, dual_clip_c=None) == pytest.approx(5.0, rel=1e-5)
    huge = _loss(100.0, -1.0, dual_clip_c=None)
    assert huge == pytest.approx(math.exp(20.0), rel=1e-4)


def test_metrics_clip_fractions_and_approx_kl():
    logp = torch.tensor([[math.log(1.5), math.log(1.1), math.log(5.0), 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = policy_loss(logp, torch.zeros(1, 4), adv, mask)
    assert float(out.metrics["clip_frac"]) == pytest.approx(1 / 3)
    assert float(out.metrics["clip_frac_lower"]) == pytest.approx(1 / 3)
    expected_kl = -(math.log(1.5) + math.log(1.1) + math.log(5.0)) / 3
    assert float(out.metrics["approx_kl"]) == pytest.approx(expected_kl, rel=1e-5)


def test_gspo_uses_sequence_geometric_mean_ratio_with_token_gradient():
    logp = torch.tensor([[0.1, 0.3, 9.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = policy_loss(
        logp, old, torch.tensor([1.0]), mask, variant="gspo", eps_clip=0.5, eps_clip_high=0.5
    )
    s = math.exp(0.2)  # exp(mean(0.1, 0.3)) over the masked tokens
    torch.testing.assert_close(out.loss_mat[0, :2], torch.tensor([-s, -s]))
    (out.loss_mat * mask).sum().backward()
    # d(-A * s_t)/d logp_t = -A * s for each masked token (token-level gradient, sg on s).
    torch.testing.assert_close(logp.grad, torch.tensor([[-s, -s, 0.0]]))


def test_gspo_clips_whole_sequence_together():
    logp = torch.tensor([[0.5, 0.5]])
    out = policy_loss(
        logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), variant="gspo"
    )
    torch.testing.assert_close(out.loss_mat, torch.full((1, 2), -1.28))
    assert float(out.metrics["clip_frac"]) == 1.0


@settings(max_examples=80, deadline=None)
@given(st.floats(-3, 3), st.floats(0.05, 5.0), st.sampled_from(["ppo", "gspo"]))
def test_property_zero_gradient_inside_clipped_region(log_ratio, adv_mag, variant):
    for adv in (adv_mag, -adv_mag):
        logp = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
        out = policy_loss(
            logp,
            torch.zeros(1, 1, dtype=torch.float64),
            torch.tensor([adv], dtype=torch.float64),
            torch.ones(1, 1, dtype=torch.float64),
            variant=variant,
            dual_clip_c=None,
        )
        out.loss_mat.sum().backward()
        r = math.exp(log_ratio)
        clipped = (adv > 0 and r > 1.28) or (adv < 0 and r < 0.8)
        if clipped:
            assert float(logp.grad) == 0.0
        else:
            assert float(logp.grad) == pytest.approx(-adv * r, rel=1e-9)


def test_truncated_importance_sampling_weights_and_loss():
    old = torch.tensor([[0.0, 0.0]])
    rollout = torch.tensor([[math.log(0.5), math.log(2.0)]])  # raw weights 2.0 and 0.5
    w, metrics = truncated_is_weights(old, rollout, torch.ones(1, 2), cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5]]))
    assert float(metrics["tis_clip_frac"]) == 0.5
    out = policy_loss(
        old, old, torch.tensor([1.0]), torch.ones(1, 2), rollout_logp=rollout, tis_cap=1.5
    )
    torch.testing.assert_close(out.loss_mat, torch.tensor([[-1.5, -0.5]]))
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(old, old, torch.tensor([1.0]), torch.ones(1, 2), tis_cap=2.0)


def test_rollout_mismatch_metrics_hand_values():
    train = torch.tensor([[0.0, math.log(2.0), 5.0]])
    rollout = torch.tensor([[0.0, 0.0, 0.0]])
    m = rollout_mismatch_metrics(train, rollout, torch.tensor([[1.0, 1.0, 0.0]]))
    assert float(m["mismatch_abs_diff"]) == pytest.approx(math.log(2) / 2)
    assert float(m["mismatch_ratio_max"]) == pytest.approx(2.0)
    assert float(m["mismatch_ratio_min"]) == pytest.approx(1.0)
    assert float(m["mismatch_kl_k3"]) == pytest.approx((2 - 1 - math.log(2)) / 2)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", 0.5),
        ("abs", 0.5),
        ("k2", 0.125),
        ("low_var_kl", math.exp(-0.5) - 1 + 0.5),
    ],
)
def test_kl_estimators_hand_values(kind, expected):
    kl = kl_penalty(torch.tensor([[0.5]]), torch.tensor([[0.0]]), kind)
    assert float(kl) == pytest.approx(expected, rel=1e-6)


def test_low_var_kl_is_clamped_to_ten():
    kl = kl_penalty(torch.tensor([[-50.0, 50.0]]), torch.zeros(1, 2), "k3")
    assert float(kl[0, 0]) == 10.0 and 0 < float(kl[0, 1]) <= 10.0


def test_kl_in_reward_subtracts_masked_sum():
    logp = torch.tensor([[0.5, 0.2, 7.0]])
    out = kl_in_reward(
        torch.tensor([1.0]), logp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), 0.1
    )
    assert float(out) == pytest.approx(1.0 - 0.1 * 0.7)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_in_reward(torch.tensor([1.0]), logp, logp, torch.ones(1, 3), -1.0)


def test_entropy_from_logits_hand_values():
    uniform = entropy_from_logits(torch.zeros(2, 8))
    torch.testing.assert_close(uniform, torch.full((2,), math.log(8)))
    p = torch.tensor([0.7, 0.2, 0.1])
    expected = -(p * p.log()).sum()
    torch.testing.assert_close(entropy_from_logits(p.log()[None]), expected[None])


LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 21 / 6),
        ("seq-mean-token-sum", {}, (10 + 11) / 2),
        ("seq-mean-token-mean", {}, (2.5 + 5.5) / 2),
        ("seq-mean-token-sum-norm", {"norm_length": 8}, 21 / (2 * 8)),
    ],
)
def test_aggregation_hand_values(mode, kwargs, expected):
    assert float(aggregate_loss(LOSS, MASK, mode, **kwargs)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "mean"}, "unknown loss aggregation"),
        ({"mask": torch.ones(3, 3)}, r"\[B, L\]"),
        ({"dp_size": 2}, "global_num_tokens"),
        ({"global_num_tokens": 0}, "must be > 0"),
        ({"mode": "seq-mean-token-sum-norm"}, "norm_length"),
    ],
)
def test_aggregation_bad_inputs(kwargs, message):
    args = {"loss_mat": LOSS, "mask": MASK, "mode": "token-mean"} | kwargs
    with pytest.raises(ValueError, match=message):
        aggregate_loss(**args)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from(
        ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    ),
    st.integers(0, 10_000),
)
def test_property_micro_batches_and_ranks_sum_to_one_batch_gradient(k, dp, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    n = k * dp * 2
    weights = torch.randn(n, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(n, 6, generator=gen) > 0.4).to(torch.float64)
    mask[:, 0] = 1
    loss = weights.square()  # any per-token loss with a parameter gradient
    full = aggregate_loss(loss, mask, mode, norm_length=6)
    (g_full,) = torch.autograd.grad(full, weights, retain_graph=True)
    tokens, seqs = count_loss_tokens_and_seqs(mask)
    rank_grads = []
    for rank_rows in torch.arange(n).chunk(dp):
        g = torch.zeros_like(weights)
        for rows in rank_rows.chunk(k):  # micro-batches accumulate on a rank
            part = aggregate_loss(
                loss[rows],
                mask[rows],
                mode,
                global_num_tokens=tokens,
                global_num_seqs=seqs,
                dp_size=dp,
                norm_length=6,
            )
            g += torch.autograd.grad(part, weights, retain_graph=True)[0]
        rank_grads.append(g)
    averaged = torch.stack(rank_grads).mean(0)  # what DDP/FSDP all-reduce does
    torch.testing.assert_close(averaged, g_full)


def test_actor_loss_combines_terms():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    ent = torch.tensor([[0.4, 0.6]], requires_grad=True)
    mask = torch.ones(1, 2)
    cfg = ActorLossConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    out = actor_loss(cfg, logp, logp.detach(), torch.tensor([2.0]), mask, ref_logp=ref, entropy=ent)
    kl = (math.exp(-0.5) - 1 + 0.5) / 2
    assert float(out.loss.detach()) == pytest.approx(-2.0 + 0.1 * kl - 0.01 * 0.5, rel=1e-5)
    assert set(out.metrics) >= {"pg_loss", "kl_loss", "entropy", "clip_frac", "approx_kl"}
    with pytest.raises(ValueError, match="ref_logp"):
        actor_loss(cfg, logp, logp.detach(), torch.tensor([2.0]), mask, entropy=ent)
    with pytest.raises(ValueError, match="entropy"):
        actor_loss(
            ActorLossConfig(entropy_coef=0.1), logp, logp.detach(), torch.tensor([2.0]), mask
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "trpo"}, "unknown policy loss variant"),
        ({"eps_clip": 1.5}, "eps_clip"),
        ({"dual_clip_c": 0.5}, "dual_clip_c"),
        ({"advantages": torch.ones(3)}, "advantages"),
        ({"mask": torch.ones(2, 2)}, r"\[B, L\]"),
    ],
)
def test_policy_loss_bad_inputs(kwargs, message):
    args = {
        "logp": torch.zeros(1, 2),
        "old_logp": torch.zeros(1, 2),
        "advantages": torch.ones(1),
        "mask": torch.ones(1, 2),
    } | kwargs
    with pytest.raises(ValueError, match=message):
        policy_loss(**args)


def test_kl_bad_kind_and_shapes():
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="differ"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 1))


def test_bf16_loss_is_aggregated_in_fp32_with_exact_counts():
    loss = torch.ones(3, 4000, dtype=torch.bfloat16)
    mask = torch.ones(3, 4000)
    mask[0, :1] = 0  # 11,999 tokens: not representable in bf16
    out = aggregate_loss(loss, mask, "token-mean")
    assert out.dtype == torch.float32
    assert float(out) == 1.0
    assert float(aggregate_loss(loss, mask, "token-mean", global_num_tokens=11_999 * 2)) == 0.5


def test_off_policy_helpers_reject_bad_inputs():
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        truncated_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), cap=0.0)
    with pytest.raises(ValueError, match="rollout_logp"):
        truncated_is_weights(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
    with pytest.raises(ValueError, match="same"):
        rollout_mismatch_metrics(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"expected rewards \[B\]"):
        kl_in_reward(torch.ones(2), torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), 0.1)


def test_actor_loss_config_refuses_unknown_names():
    for field, value in (("policy_loss", "ppo2"), ("kl_loss_type", "k4"), ("loss_agg_mode", "sum")):
        with pytest.raises(ValueError, match=f"{field} must be one of"):
            ActorLossConfig(**{field: value})
    assert (
        ActorLossConfig(loss_agg_mode="seq-mean-token-mean").loss_agg_mode == "seq-mean-token-mean"
    )


def test_use_tis_weights_the_actor_loss_between_its_two_clips():
    """slime's --use-tis / --tis-clip / --tis-clip-low: each token's loss times
    clip(pi_train / pi_rollout, low, clip); without --use-tis the clips do nothing."""
    old = torch.zeros(1, 3)
    rollout = torch.log(torch.tensor([[0.25, 1.0, 4.0]]))  # raw weights 4, 1, 0.25
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3)
    config = ActorLossConfig(
        dual_clip_c=None, use_tis=True, tis_clip=2.0, tis_clip_low=0.5, loss_agg_mode="token-mean"
    )
    out = actor_loss(config, old, old, adv, mask, rollout_logp=rollout)
    assert float(out.loss) == pytest.approx(-(2.0 + 1.0 + 0.5) / 3)
    assert float(out.metrics["tis_clip_frac"]) == pytest.approx(2 / 3)
    off = ActorLossConfig(tis_clip=2.0, tis_clip_low=0.5)
    assert off.tis_cap is None
    assert float(actor_loss(off, old, old, adv, mask, rollout_logp=rollout).loss) == -1.0
    for bad, message in (
        ({"dual_clip_c": 1.0}, "--eps-clip-c"),
        ({"tis_clip_low": 3.0}, "--tis-clip-low"),
        ({"tis_clip": 0.0, "tis_clip_low": 0.0}, "--tis-clip"),
    ):
        with pytest.raises(ValueError, match=message):
            ActorLossConfig(**bad)
