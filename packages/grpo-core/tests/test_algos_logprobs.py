"""Chunked log-prob/entropy equals the naive full-logits computation, values and gradients."""

import pytest
import torch

from turnrl.grpo_core.algos import IGNORE_INDEX, chunked_logprobs, naive_logprobs
from turnrl.grpo_core.algos.logprobs import sampling_keep_mask


def _inputs(n=45, h=24, v=97, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=gen) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, labels


def _cotangents(n=45, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)


def test_gradcheck_float64_with_entropy_temperature_and_ragged_chunks():
    hidden, weight, labels = _inputs(n=13, h=6, v=11, dtype=torch.float64)

    def fn(h, w):
        return chunked_logprobs(h, w, labels, chunk_size=4, temperature=0.7, return_entropy=True)

    assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fp32_values_and_gradients_match_naive(chunk_size, temperature):
    hidden, weight, labels = _inputs()
    lp, ent = chunked_logprobs(hidden, weight, labels, chunk_size, temperature, return_entropy=True)
    g_lp, g_ent = _cotangents()
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
    lp_ref, ent_ref = naive_logprobs(hidden, weight, labels, temperature)
    grads_ref = torch.autograd.grad(
        (lp_ref * g_lp).sum() + (ent_ref * g_ent).sum(), (hidden, weight)
    )
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def test_bf16_matches_naive_within_bf16_tolerance():
    hidden, weight, labels = _inputs(dtype=torch.bfloat16)
    lp, ent = chunked_logprobs(hidden, weight, labels, 8, return_entropy=True)
    assert lp.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    lp_ref, ent_ref = naive_logprobs(hidden, weight, labels)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    lp_ref, ent_ref = naive_logprobs(h2, w2, labels)
    (lp_ref.sum() + ent_ref.sum()).backward()
    torch.testing.assert_close(lp, lp_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-3, atol=1e-3)
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=2e-2, atol=2e-2)


def test_batched_shape_and_ignore_index():
    hidden, weight, labels = _inputs(n=12)
    labels = labels.clone()
    labels[[2, 9]] = IGNORE_INDEX
    lp, _ = chunked_logprobs(hidden.reshape(3, 4, -1), weight, labels.reshape(3, 4), 5)
    assert lp.shape == (3, 4)
    flat = lp.reshape(-1)
    assert flat[2] == 0 and flat[9] == 0
    keep = labels != IGNORE_INDEX
    ref, _ = naive_logprobs(hidden[keep], weight, labels[keep])
    torch.testing.assert_close(flat[keep], ref, rtol=1e-5, atol=1e-5)
    (grad_h,) = torch.autograd.grad(lp.sum(), hidden)
    assert grad_h[2].abs().sum() == 0 and grad_h[9].abs().sum() == 0


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    hidden, weight, labels = _inputs()
    weight = weight.detach()
    lp, _ = chunked_logprobs(hidden, weight, labels, 16)
    lp.sum().backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"temperature": 0.0}, "temperature"),
        ({"weight": torch.randn(97, 5)}, r"weight \[V, H\]"),
        ({"labels": torch.zeros(44, dtype=torch.long)}, "must match"),
        ({"labels": torch.zeros(45)}, "integer token ids"),
        ({"labels": torch.full((45,), 97)}, "outside"),
        ({"weight": torch.randn(97, 24, dtype=torch.float64)}, "dtypes differ"),
    ],
)
def test_bad_inputs(kwargs, message):
    hidden, weight, labels = _inputs()
    args = {"hidden": hidden, "weight": weight, "labels": labels, "chunk_size": 8} | kwargs
    with pytest.raises(ValueError, match=message):
        chunked_logprobs(**args)


def test_logprob_only_gradients_match_naive():
    hidden, weight, labels = _inputs()
    lp, ent = chunked_logprobs(hidden, weight, labels, 10, 0.8)
    assert ent is None
    g, _ = _cotangents()
    grads = torch.autograd.grad((lp * g).sum(), (hidden, weight))
    lp_ref, _ = naive_logprobs(hidden, weight, labels, 0.8)
    grads_ref = torch.autograd.grad((lp_ref * g).sum(), (hidden, weight))
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("top_p", "top_k"), [(0.8, -1), (1.0, 5), (0.6, 20), (0.3, 3)])
def test_top_p_top_k_values_and_gradients_match_naive(top_p, top_k):
    # float64: the comparison is of the formula, not of fp32 summation order
    hidden, weight, labels = _inputs(dtype=torch.float64)
    hidden.data *= 4  # spread logits, so the nucleus is a small part of the vocabulary
    lp, ent = chunked_logprobs(
        hidden, weight, labels, 7, 0.7, return_entropy=True, top_p=top_p, top_k=top_k
    )
    g_lp, g_ent = _cotangents(dtype=torch.float64)
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
    lp_ref, ent_ref = naive_logprobs(hidden, weight, labels, 0.7, top_p, top_k)
    grads_ref = torch.autograd.grad(
        (lp_ref * g_lp).sum() + (ent_ref * g_ent).sum(), (hidden, weight)
    )
    full, _ = naive_logprobs(hidden, weight, labels, 0.7)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp >= full - 1e-9).all() and (lp - full).abs().max() > 0.05  # renormalised
    torch.testing.assert_close(lp, lp_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-9, atol=1e-9)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9)


def test_sampling_keep_mask_follows_the_top_k_then_top_p_rule():
    z = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    assert sampling_keep_mask(z) is None
    assert sampling_keep_mask(z, top_k=2).tolist() == [[True, True, False, False, False]]
    # ascending cumulative mass: 0.03, 0.10, 0.25, 0.50, 1.0; p=0.7 drops those <= 0.3
    assert sampling_keep_mask(z, top_p=0.7).tolist() == [[True, True, False, False, False]]
    assert sampling_keep_mask(z, top_p=0.1).tolist() == [[True, False, False, False, False]]
    # top-k 3 renormalises to 0.556, 0.278, 0.167 before top-p 0.8 drops the 0.167
    assert sampling_keep_mask(z, top_p=0.8, top_k=3).tolist() == [[True, True, False, False, False]]


def test_a_label_outside_the_nucleus_still_gets_a_finite_log_prob():
    z = torch.log(torch.tensor([[0.9, 0.05, 0.05]]))
    weight = torch.eye(3)
    lp, _ = chunked_logprobs(z, weight, torch.tensor([2]), top_p=0.5)
    # kept set {0, 2}: 0.05 / 0.95
    assert lp.item() == pytest.approx(float(torch.log(torch.tensor(0.05 / 0.95))), abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k")],
)
def test_bad_sampling_settings_are_refused(kwargs, message):
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match=message):
        chunked_logprobs(hidden, weight, labels, **kwargs)
