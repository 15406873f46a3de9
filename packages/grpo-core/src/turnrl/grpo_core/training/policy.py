"""A Hugging Face causal LM wrapped to return per-token log-probs, never full logits.

`CausalLMLogProbs.forward` runs the decoder to its final (normed) hidden states and scores
the next token at the requested positions through the algorithms' `chunked_logprobs`
with the output layer's weight, so the `[tokens x vocab]` logit matrix is never built in
full. Everything happens inside this module's `forward`, which matters under FSDP2: the
wrapper is the root module whose pre-forward hook gathers the output layer's weight.

Loading helpers read a local Hugging Face folder (safetensors) and never touch a hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from turnrl.grpo_core.algos.logprobs import check_sampling, chunked_logprobs

DType = Literal["float32", "bfloat16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for `"float32"` or `"bfloat16"` (ValueError otherwise)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a causal LM from a local Hugging Face folder (no network).

    Args:
        path: folder with `config.json` and safetensors weights.
        dtype: dtype of the loaded parameters.

    Returns:
        The `transformers` model, in train mode.

    Raises:
        FileNotFoundError: when the folder or its `config.json` is missing.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face model folder (config.json) at {folder}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    model.train()
    return model


class CausalLMLogProbs(nn.Module):
    """Wraps an HF causal LM; `forward` returns log-probs (and entropy) of chosen tokens."""

    def __init__(
        self,
        model: nn.Module,
        chunk_size: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ):
        """Wrap `model`.

        Args:
            model: a `transformers` causal LM (has `base_model` and output embeddings).
            chunk_size: tokens per chunk of the log-prob computation.
            temperature: logits are divided by this (the rollout's sampling temperature).
            top_p: the rollout's nucleus mass; log-probs are those of the truncated,
                renormalised distribution the engine sampled from (1 = off).
            top_k: the rollout's top-k (-1 = off), likewise.
        """
        super().__init__()
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        check_sampling(temperature, top_p, top_k)
        self.model = model
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        score_mask: torch.Tensor,
        return_entropy: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of `input_ids[:, t]` given `< t`, at positions where `score_mask` is 1.

        Args:
            input_ids: `[B, L]` token ids.
            attention_mask: `[B, L]` 1 on real tokens.
            score_mask: `[B, L]` positions to score (column 0 is ignored).
            return_entropy: also return the entropy of the next-token distribution.
            compute_dtype: dtype of the output-layer matmuls (default: the weight's).

        Returns:
            `(logp, entropy)`, fp32 `[B, L]`, zero where `score_mask` is 0; entropy is None
            unless asked.
        """
        model: Any = self.model  # an HF PreTrainedModel; nn.Module's typing hides its API
        hidden = model.base_model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state  # [B, L, H]
        weight = model.get_output_embeddings().weight  # [V, H]
        dtype = compute_dtype or weight.dtype
        select = score_mask[:, 1:].bool()  # [B, L-1]
        picked_hidden = hidden[:, :-1][select].to(dtype)  # [N, H]
        labels = input_ids[:, 1:][select]  # [N]
        logp, entropy = chunked_logprobs(
            picked_hidden,
            weight.to(dtype),
            labels,
            self.chunk_size,
            self.temperature,
            return_entropy=return_entropy,
            top_p=self.top_p,
            top_k=self.top_k,
        )
        return scatter_scores(logp, select), None if entropy is None else scatter_scores(
            entropy, select
        )


def scatter_scores(values: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """Place `[N]` values at the True positions of `[B, L-1]` and prepend a zero column."""
    out = values.new_zeros(select.shape).masked_scatter(select, values)
    return torch.cat([out.new_zeros(select.shape[0], 1), out], dim=1)
