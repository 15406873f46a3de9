"""Log-probs and entropy of labels from hidden states, in token chunks, with exact gradients.

The output layer of a 150k-vocabulary model turns N hidden states into an `[N, V]` logit
matrix; in fp32 at N = 16k that is ~10 GB, and the naive log-softmax + gather keeps
several such buffers alive for backward. `chunked_logprobs` never builds it: a custom
autograd function walks over chunks of `chunk_size` tokens, computes each chunk's logits
in fp32, keeps only the per-token log-normaliser and entropy (`[N]`), and recomputes the
chunk's logits in backward. Gradients are exact (same formulas as autograd through the
naive computation):

    z = h W^T / T,  log p = z - logsumexp(z),  H = -sum p log p
    d log p_y / dz = onehot(y) - p,   dH / dz = -p * (log p + H)

so dL/dz = g_logp * onehot(y) - p * (g_logp + g_ent * (log p + H)), then
dL/dh = (dL/dz / T) W and dL/dW = (dL/dz / T)^T h (accumulated in fp32 across chunks).

Peak extra memory is about two fp32 `[chunk_size, V]` buffers plus one in the input dtype.

Top-k / top-p: an engine that samples with them draws from the renormalised truncated
distribution, and (launched with ``--logprobs-mode processed_logprobs``) reports that
distribution's log-probs. `chunked_logprobs(..., top_p=, top_k=)` computes the same: the
tokens outside the sampler's set (`sampling_keep_mask`, vLLM's rule on `z`) get logit
-inf, and the formulas above hold over the kept tokens (the set itself is piecewise
constant, so it carries no gradient). The scored label is always kept, so a token the
engine drew at the set's edge (a rounding difference) gets a finite log-prob.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100
"""Label value that gets log-prob 0 and no gradient (padding)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_sampling(temperature: float, top_p: float = 1.0, top_k: int = -1) -> None:
    """Raise ValueError unless the sampling settings can be scored (T > 0, p in (0, 1], k)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k}")


def sampling_keep_mask(z: torch.Tensor, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor | None:
    """`[N, V]` True on the tokens a top-k / top-p sampler may draw from logits `z`.

    vLLM's rule, on temperature-scaled logits: top-k keeps every logit >= the k-th largest
    (ties kept); top-p then sorts the kept tokens by probability, ascending, and drops
    those whose cumulative probability is <= 1 - p, always keeping the most likely one.
    Returns None when neither is active (every token may be drawn).
    """
    vocab = z.shape[-1]
    use_k = 0 < top_k < vocab
    if not use_k and top_p >= 1.0:
        return None
    keep = torch.ones_like(z, dtype=torch.bool)
    if use_k:
        keep &= z >= z.topk(top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        sorted_z, order = z.masked_fill(~keep, float("-inf")).sort(dim=-1)
        drop = sorted_z.softmax(dim=-1).cumsum_(dim=-1) <= 1 - top_p
        drop[..., -1] = False
        keep &= ~torch.zeros_like(keep).scatter_(-1, order, drop)
    return keep


def _chunk_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = -1,
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled logits `[c, V]` with the tokens outside the sampler's set at -inf, and that set."""
    z = (h @ weight.T).to(_compute_dtype(h.dtype))  # [c, V] fp32 (fp64 for fp64 inputs)
    if temperature != 1.0:
        z.div_(temperature)
    keep = sampling_keep_mask(z, top_p, top_k)
    if keep is not None:
        if labels is not None:
            keep.scatter_(1, labels[:, None], True)
        z.masked_fill_(~keep, float("-inf"))
    return z, keep


class _ChunkedLogProbs(torch.autograd.Function):
    """Autograd function behind `chunked_logprobs` (2-D hidden, 1-D labels)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
        top_p: float,
        top_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.zeros(n, dtype=_compute_dtype(hidden.dtype), device=hidden.device)
        lse = torch.zeros_like(logp)
        entropy = torch.zeros_like(logp)
        valid = labels != IGNORE_INDEX
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            z, keep = _chunk_logits(hidden[sl], weight, temperature, top_p, top_k, safe[sl])
            picked_z = z.gather(1, safe[sl, None]).squeeze(1)
            logp_all = torch.log_softmax(z, dim=-1)
            del z  # at most two [chunk, V] fp32 buffers live at once
            picked = logp_all.gather(1, safe[sl, None]).squeeze(1)
            logp[sl] = torch.where(valid[sl], picked, torch.zeros_like(picked))
            lse[sl] = picked_z - picked  # log-normaliser: z_y - log p_y
            if with_entropy:
                p = logp_all.exp()
                if keep is not None:  # p is 0 there; keep -inf out of the product
                    logp_all.masked_fill_(~keep, 0.0)
                entropy[sl] = -p.mul_(logp_all).sum(dim=-1)
                del p
            del logp_all
        ctx.save_for_backward(hidden, weight, safe, valid, lse, entropy)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.top_p, ctx.top_k = top_p, top_k
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None]:
        hidden, weight, labels, valid, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        cdt = _compute_dtype(hidden.dtype)
        g_lp = (
            torch.zeros(n, dtype=cdt, device=hidden.device)
            if grad_logp is None
            else grad_logp.to(cdt)
        )
        g_lp = torch.where(valid, g_lp, torch.zeros_like(g_lp))
        g_ent = (
            torch.zeros(n, dtype=cdt, device=hidden.device)
            if grad_entropy is None
            else grad_entropy.to(cdt)
        )
        use_entropy = ctx.with_entropy and grad_entropy is not None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        for start in range(0, n, ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            h = hidden[sl]
            z, keep = _chunk_logits(h, weight, ctx.temperature, ctx.top_p, ctx.top_k, labels[sl])
            logp_all = z.sub_(lse[sl, None])
            if use_entropy:
                # dz = -p * (g_lp + g_ent * (log p + H)), then + g_lp on the label.
                p = logp_all.exp()
                if keep is not None:  # p is 0 there; keep -inf out of the product
                    logp_all.masked_fill_(~keep, 0.0)
                dz = logp_all.add_(entropy[sl, None]).mul_(g_ent[sl, None]).add_(g_lp[sl, None])
                dz.mul_(p).neg_()
                del p
            else:  # dz = -p * g_lp, computed in the logits buffer
                dz = logp_all.exp_().mul_(-g_lp[sl, None])
            dz.scatter_add_(1, labels[sl, None], g_lp[sl, None])
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if grad_h is not None:
                grad_h[sl] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(dz.T, h.to(cdt))
            del dz
        grad_w_out = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_h, grad_w_out, None, None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 256,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    top_p: float = 1.0,
    top_k: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` (and optionally the entropy) under logits `hidden @ weight.T / T`,
    restricted to the top-k / top-p set when those are set (the distribution sampled).

    Args:
        hidden: `[..., H]` final hidden states (any float dtype; bf16 keeps the matmuls bf16).
        weight: `[V, H]` output-layer (LM head) weight, same dtype as `hidden`.
        labels: `[...]` int64 token ids to score; `IGNORE_INDEX` (-100) gives 0, no gradient.
        chunk_size: Tokens per chunk; memory grows with `chunk_size * V`.
        temperature: Sampling temperature (> 0) the logits are divided by.
        return_entropy: Also return the per-token entropy (differentiable).
        top_p: Nucleus mass the sampler kept (1 = off).
        top_k: Tokens the sampler kept (-1 = off).

    Returns:
        `(logp, entropy)`: fp32 (fp64 for fp64 inputs) tensors shaped like `labels`; `entropy` is None unless asked.

    Raises:
        ValueError: On mismatched shapes or dtypes, a non-positive chunk size or temperature,
            a top-p / top-k out of range, or labels outside [0, V).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    check_sampling(temperature, top_p, top_k)
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"need hidden [..., H] and weight [V, H]; got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match hidden[..., :-1] {tuple(hidden.shape[:-1])}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) dtypes differ")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    flat_labels = labels.reshape(-1).long()
    bad = (flat_labels != IGNORE_INDEX) & ((flat_labels < 0) | (flat_labels >= weight.shape[0]))
    if bad.any():
        raise ValueError(f"labels outside [0, {weight.shape[0]}) (and not {IGNORE_INDEX})")
    logp, entropy = _ChunkedLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        flat_labels,
        chunk_size,
        temperature,
        return_entropy,
        top_p,
        top_k,
    )
    logp = logp.reshape(labels.shape)
    return logp, entropy.reshape(labels.shape) if return_entropy else None


def naive_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: full logits, fp32 (fp64 for fp64 inputs) log-softmax and gather (materialises `[N, V]`).

    Args:
        hidden: `[..., H]` hidden states.
        weight: `[V, H]` output weight.
        labels: `[...]` token ids (no ignore index).
        temperature: Logit temperature.
        top_p: Nucleus mass (1 = off); the label is always kept, as in `chunked_logprobs`.
        top_k: Kept tokens (-1 = off).

    Returns:
        `(logp, entropy)` fp32 (fp64 for fp64 inputs), shaped like `labels`.
    """
    logits = hidden @ weight.T
    logits = logits.to(_compute_dtype(logits.dtype)) / temperature
    index = labels.long().unsqueeze(-1)
    keep = sampling_keep_mask(logits, top_p, top_k)
    if keep is not None:
        logits = logits.masked_fill(~keep.scatter(-1, index, True), float("-inf"))
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, index).squeeze(-1)
    finite = torch.where(torch.isfinite(logp_all), logp_all, torch.zeros_like(logp_all))
    entropy = -(logp_all.exp() * finite).sum(dim=-1)
    return logp, entropy
