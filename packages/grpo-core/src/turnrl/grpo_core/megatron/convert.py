"""Hugging Face <-> Megatron-core weights for dense Qwen2/Qwen2.5/Qwen3 models.

Pure tensor reshapes and concatenations (no arithmetic), so every conversion is bit-exact
and `megatron_to_hf(hf_to_megatron(sd)) == sd`. Megatron fuses two pairs of matrices:

- `linear_qkv`: per key/value group g, the group's query heads, then its key head, then its
  value head: rows `[q_g1 .. q_gk, k_g, v_g]` for g = 1..G (`k = heads / G`), so that
  tensor parallelism can hand every rank whole groups by cutting the rows in TP pieces.
- `linear_fc1`: `[gate; up]` (SwiGLU computes `silu(gate) * up`); under tensor parallelism
  each rank holds `[gate_r; up_r]`.

Layer names follow Megatron's `local` spec (separate `input_layernorm` /
`pre_mlp_layernorm`) or its Transformer Engine spec (`te`: the norms fused into the next
linear as `layer_norm_weight`). `split_tensor_parallel` / `merge_tensor_parallel` and
`split_pipeline` / `merge_pipeline` cut a full Megatron state dict into the shards that
TP / PP ranks hold, and join them back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from turnrl.grpo_core.megatron.config import QwenArchitecture

SpecLayout = Literal["local", "te"]
StateDict = dict[str, torch.Tensor]

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_IGNORED = ("rotary_emb.inv_freq",)
# Per-layer one-to-one names: Hugging Face suffix -> Megatron suffix, per spec layout.
_NORM_NAMES: dict[SpecLayout, dict[str, str]] = {
    "local": {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    },
    "te": {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    },
}
_PLAIN_NAMES = {
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


def _layer_map(arch: QwenArchitecture, layout: SpecLayout) -> dict[str, str]:
    names = {**_NORM_NAMES[layout], **_PLAIN_NAMES}
    if not arch.qk_layernorm:
        del names["self_attn.q_norm.weight"], names["self_attn.k_norm.weight"]
    return names


def _check_layout(layout: str) -> None:
    if layout not in _NORM_NAMES:
        raise ValueError(f"layout must be 'local' or 'te', got {layout!r}")


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: QwenArchitecture
) -> torch.Tensor:
    """Megatron's grouped `linear_qkv` weight (`[(H + 2G) d, hidden]`) or bias from q, k, v."""
    groups, d = arch.num_query_groups, arch.head_dim
    rest = q.shape[1:]
    per_group = [
        q.reshape(groups, arch.heads_per_group * d, *rest),
        k.reshape(groups, d, *rest),
        v.reshape(groups, d, *rest),
    ]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, arch: QwenArchitecture
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: q `[H d, ...]`, k `[G d, ...]`, v `[G d, ...]`."""
    groups, d = arch.num_query_groups, arch.head_dim
    rows = (arch.heads_per_group + 2) * d
    if qkv.shape[0] != groups * rows:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows, expected {groups * rows} for {arch}")
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, rows, *rest).split([arch.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _take(sd: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return sd.pop(key)
    except KeyError:
        raise KeyError(f"missing weight {key!r}") from None


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor], arch: QwenArchitecture, layout: SpecLayout = "local"
) -> StateDict:
    """Convert a Hugging Face Qwen2/Qwen3 state dict to a full (unsharded) Megatron one.

    Args:
        hf_state: `Qwen2ForCausalLM` / `Qwen3ForCausalLM` weights (`model.state_dict()` or
            the tensors of the safetensors files).
        arch: The model's architecture (`QwenArchitecture.from_hf_config`).
        layout: Megatron layer spec the names are for: `local` or `te`.

    Returns:
        Megatron `GPTModel` weights (no `_extra_state` entries; load with `strict=False`).

    Raises:
        KeyError: A weight the architecture needs is missing, or an unknown weight is left over.
    """
    _check_layout(layout)
    sd = {k: v for k, v in hf_state.items() if not k.endswith(_HF_IGNORED)}
    out: StateDict = {"embedding.word_embeddings.weight": _take(sd, "model.embed_tokens.weight")}
    out["decoder.final_layernorm.weight"] = _take(sd, "model.norm.weight")
    lm_head = sd.pop("lm_head.weight", None)
    if not arch.tie_word_embeddings:
        if lm_head is None:
            raise KeyError("missing weight 'lm_head.weight' (the config does not tie embeddings)")
        out["output_layer.weight"] = lm_head
    names = _layer_map(arch, layout)
    for i in range(arch.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in names.items():
            out[mg + mg_name] = _take(sd, hf + hf_name)
        attn = hf + "self_attn."
        q, k, v = (_take(sd, f"{attn}{p}_proj.weight") for p in "qkv")
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, arch)
        if arch.qkv_bias:
            qb, kb, vb = (_take(sd, f"{attn}{p}_proj.bias") for p in "qkv")
            out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(qb, kb, vb, arch)
        gate, up = _take(sd, hf + "mlp.gate_proj.weight"), _take(sd, hf + "mlp.up_proj.weight")
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    if sd:
        raise KeyError(
            f"weights not converted (not a dense {arch.model_type} model?): {sorted(sd)[:8]}"
        )
    return out


def megatron_to_hf(
    mg_state: Mapping[str, torch.Tensor], arch: QwenArchitecture, layout: SpecLayout = "local"
) -> StateDict:
    """Convert a full (unsharded) Megatron state dict back to Hugging Face names and layouts.

    `_extra_state` entries are skipped. With tied embeddings `lm_head.weight` is the same
    tensor as `model.embed_tokens.weight` (as in a tied `*ForCausalLM.state_dict()`).

    Raises:
        KeyError: A weight is missing or an unknown weight is left over.
    """
    _check_layout(layout)
    sd = {k: v for k, v in mg_state.items() if not k.endswith("_extra_state")}
    out: StateDict = {"model.embed_tokens.weight": _take(sd, "embedding.word_embeddings.weight")}
    out["model.norm.weight"] = _take(sd, "decoder.final_layernorm.weight")
    if arch.tie_word_embeddings:
        sd.pop("output_layer.weight", None)  # a last pipeline stage's copy of the embedding
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    else:
        out["lm_head.weight"] = _take(sd, "output_layer.weight")
    names = _layer_map(arch, layout)
    for i in range(arch.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in names.items():
            out[hf + hf_name] = _take(sd, mg + mg_name)
        q, k, v = split_qkv(_take(sd, mg + "self_attention.linear_qkv.weight"), arch)
        out.update(
            {f"{hf}self_attn.{p}_proj.weight": t for p, t in zip("qkv", (q, k, v), strict=True)}
        )
        if arch.qkv_bias:
            biases = split_qkv(_take(sd, mg + "self_attention.linear_qkv.bias"), arch)
            out.update(
                {f"{hf}self_attn.{p}_proj.bias": t for p, t in zip("qkv", biases, strict=True)}
            )
        gate, up = _take(sd, mg + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
    if sd:
        raise KeyError(f"Megatron weights not converted: {sorted(sd)[:8]}")
    return out


# Tensor parallelism: which dimension each weight is cut along (None: replicated).
def _tp_dim(name: str) -> int | None:
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def _check_tp(arch: QwenArchitecture, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    for what, value in (
        ("num_key_value_heads", arch.num_query_groups),
        ("intermediate_size", arch.ffn_hidden_size),
        ("vocab_size", arch.vocab_size),
    ):
        if value % tp:
            raise ValueError(f"{what} ({value}) is not divisible by tensor-parallel size {tp}")


def split_tensor_parallel(
    mg_state: Mapping[str, torch.Tensor], arch: QwenArchitecture, tp: int
) -> list[StateDict]:
    """Cut a full Megatron state dict into the `tp` shards tensor-parallel ranks hold.

    Column-parallel weights (`linear_qkv`, `linear_fc1`, embedding, output layer) are cut
    along rows (`linear_fc1`'s gate and up halves separately), row-parallel ones
    (`linear_proj`, `linear_fc2`) along columns; norms are replicated.
    """
    _check_tp(arch, tp)
    shards: list[StateDict] = [{} for _ in range(tp)]
    for name, tensor in mg_state.items():
        if name.endswith("_extra_state"):
            continue
        dim = _tp_dim(name)
        if name.endswith("linear_fc1.weight"):
            gate, up = tensor.chunk(2, dim=0)
            pieces = [
                torch.cat(pair, dim=0) for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True)
            ]
        elif dim is None:
            pieces = [tensor] * tp
        else:
            pieces = list(tensor.chunk(tp, dim=dim))
        for shard, piece in zip(shards, pieces, strict=True):
            shard[name] = piece.contiguous() if dim is not None else piece
    return shards


def merge_tensor_parallel(
    shards: Sequence[Mapping[str, torch.Tensor]], arch: QwenArchitecture
) -> StateDict:
    """Inverse of `split_tensor_parallel`: join the TP ranks' shards into one state dict.

    Raises:
        ValueError: If the shards do not hold the same weights or replicated weights differ.
    """
    tp = len(shards)
    _check_tp(arch, tp)
    names = [k for k in shards[0] if not k.endswith("_extra_state")]
    out: StateDict = {}
    for name in names:
        if any(name not in shard for shard in shards):
            raise ValueError(f"weight {name!r} is missing from some tensor-parallel shards")
        pieces = [shard[name] for shard in shards]
        dim = _tp_dim(name)
        if name.endswith("linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in pieces]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif dim is None:
            if any(not torch.equal(pieces[0], p) for p in pieces[1:]):
                raise ValueError(
                    f"replicated weight {name!r} differs between tensor-parallel ranks"
                )
            out[name] = pieces[0]
        else:
            out[name] = torch.cat(pieces, dim=dim)
    return out


def pipeline_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Global layer indices of each pipeline stage (even split, as Megatron's default)."""
    if pp < 1 or num_layers % pp:
        raise ValueError(f"num_hidden_layers ({num_layers}) is not divisible by pipeline size {pp}")
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def split_pipeline(
    mg_state: Mapping[str, torch.Tensor], arch: QwenArchitecture, pp: int
) -> list[StateDict]:
    """Cut a Megatron state dict into pipeline stages, renumbering layers from 0 per stage.

    The embedding goes to the first stage, the final norm and output layer to the last;
    with tied embeddings and `pp > 1` the last stage holds a copy of the embedding as
    `output_layer.weight`, as Megatron does.
    """
    ranges = pipeline_layer_ranges(arch.num_layers, pp)
    stage_of = {layer: s for s, r in enumerate(ranges) for layer in r}
    stages: list[StateDict] = [{} for _ in range(pp)]
    for name, tensor in mg_state.items():
        if name.endswith("_extra_state"):
            continue
        match = _MG_LAYER.match(name)
        if match:
            layer = int(match.group(1))
            stage = stage_of[layer]
            stages[stage][f"decoder.layers.{layer - ranges[stage].start}.{match.group(2)}"] = tensor
        elif name.startswith("embedding."):
            stages[0][name] = tensor
        else:
            stages[-1][name] = tensor
    if arch.tie_word_embeddings and pp > 1:
        stages[-1]["output_layer.weight"] = mg_state["embedding.word_embeddings.weight"]
    return stages


def merge_pipeline(
    stages: Sequence[Mapping[str, torch.Tensor]], arch: QwenArchitecture
) -> StateDict:
    """Inverse of `split_pipeline`."""
    ranges = pipeline_layer_ranges(arch.num_layers, len(stages))
    out: StateDict = {}
    for stage, state in enumerate(stages):
        for name, tensor in state.items():
            match = _MG_LAYER.match(name)
            if match:
                layer = int(match.group(1)) + ranges[stage].start
                out[f"decoder.layers.{layer}.{match.group(2)}"] = tensor
            elif not (arch.tie_word_embeddings and name == "output_layer.weight"):
                out[name] = tensor
    return out
