"""Hugging Face <-> Megatron weight conversion for Qwen2/Qwen3: layouts, exact round trips, shards.

Real `Qwen3ForCausalLM` / `Qwen2ForCausalLM` state dicts built by transformers from seeded
configs; no megatron-core needed (the conversion is pure torch).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from turnrl.grpo_core.megatron import (
    QwenArchitecture,
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    merge_pipeline,
    merge_tensor_parallel,
    split_pipeline,
    split_qkv,
    split_tensor_parallel,
)

SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
}


def hf_model(kind: str, tied: bool, seed: int = 0) -> tuple[torch.nn.Module, QwenArchitecture]:
    """A seeded tiny Qwen model with every weight (norms and biases too) random."""
    torch.manual_seed(seed)
    if kind == "qwen3":
        config = Qwen3Config(head_dim=16, tie_word_embeddings=tied, **SHAPE)
        model = Qwen3ForCausalLM(config)
    else:
        config = Qwen2Config(tie_word_embeddings=tied, **SHAPE)
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    return model, QwenArchitecture.from_hf_config(config)


CASES = [("qwen3", False), ("qwen3", True), ("qwen2", False), ("qwen2", True)]


@pytest.mark.parametrize(("kind", "tied"), CASES)
@pytest.mark.parametrize("layout", ["local", "te"])
def test_hf_megatron_hf_round_trip_is_exact(kind: str, tied: bool, layout: str) -> None:
    model, arch = hf_model(kind, tied)
    hf = model.state_dict()
    mg = hf_to_megatron(hf, arch, layout)  # type: ignore[arg-type]
    back = megatron_to_hf(mg, arch, layout)  # type: ignore[arg-type]
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # Megatron holds the same number of values (fused, not duplicated).
    distinct_hf = sum(t.numel() for k, t in hf.items() if not (tied and k == "lm_head.weight"))
    assert sum(t.numel() for t in mg.values()) == distinct_hf
    assert ("output_layer.weight" in mg) is not tied
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) is (kind == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mg) is (kind == "qwen3")


def test_te_layout_fuses_the_norms_into_the_next_linear() -> None:
    model, arch = hf_model("qwen3", False)
    hf = model.state_dict()
    te = hf_to_megatron(hf, arch, "te")
    key = "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"
    assert torch.equal(te[key], hf["model.layers.2.input_layernorm.weight"])
    key = "decoder.layers.2.mlp.linear_fc1.layer_norm_weight"
    assert torch.equal(te[key], hf["model.layers.2.post_attention_layernorm.weight"])
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)


def test_fused_qkv_rows_are_grouped_as_megatron_reads_them() -> None:
    """Project with the fused weight and split the output the way Megatron's attention does."""
    model, arch = hf_model("qwen2", False)
    hf = model.state_dict()
    mg = hf_to_megatron(hf, arch)
    x = torch.randn(5, arch.hidden_size)
    attn = "model.layers.1.self_attn."
    fused = x @ mg["decoder.layers.1.self_attention.linear_qkv.weight"].T
    fused = fused + mg["decoder.layers.1.self_attention.linear_qkv.bias"]
    # Megatron: [s, ng, (np/ng + 2) * hn] -> split into np/ng query heads, 1 key, 1 value.
    d, per = arch.head_dim, arch.heads_per_group
    groups = fused.view(5, arch.num_query_groups, (per + 2) * d)
    q, k, v = groups.split([per * d, d, d], dim=-1)
    for name, got in (("q", q), ("k", k), ("v", v)):
        expected = x @ hf[f"{attn}{name}_proj.weight"].T + hf[f"{attn}{name}_proj.bias"]
        torch.testing.assert_close(got.reshape(5, -1), expected)


def test_fc1_is_gate_then_up_for_swiglu() -> None:
    model, arch = hf_model("qwen3", False)
    hf, mg = model.state_dict(), hf_to_megatron(model.state_dict(), arch)
    x = torch.randn(3, arch.hidden_size)
    gate, up = (x @ mg["decoder.layers.0.mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
    layer = model.model.layers[0].mlp
    with torch.no_grad():
        torch.testing.assert_close(
            torch.nn.functional.silu(gate) * up, layer.act_fn(layer.gate_proj(x)) * layer.up_proj(x)
        )
    assert torch.equal(
        mg["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.0.mlp.down_proj.weight"]
    )


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 4),
    per_group=st.integers(1, 4),
    head_dim=st.integers(1, 8),
    hidden=st.integers(1, 6),
    bias=st.booleans(),
)
def test_fuse_then_split_qkv_is_identity(
    groups: int, per_group: int, head_dim: int, hidden: int, bias: bool
) -> None:
    arch = QwenArchitecture.from_hf_config(
        {
            "model_type": "qwen3",
            "vocab_size": 8,
            "hidden_size": hidden,
            "intermediate_size": 4,
            "num_hidden_layers": 1,
            "num_attention_heads": groups * per_group,
            "num_key_value_heads": groups,
            "head_dim": head_dim,
            "rope_theta": 1e4,
            "max_position_embeddings": 8,
        }
    )
    rest = () if bias else (hidden,)
    q = torch.randn(groups * per_group * head_dim, *rest)
    k, v = torch.randn(groups * head_dim, *rest), torch.randn(groups * head_dim, *rest)
    fused = fuse_qkv(q, k, v, arch)
    assert fused.shape[0] == (groups * per_group + 2 * groups) * head_dim
    for got, want in zip(split_qkv(fused, arch), (q, k, v), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_split_and_merge_are_exact(tp: int) -> None:
    model, arch = hf_model("qwen2", False)
    mg = hf_to_megatron(model.state_dict(), arch)
    shards = split_tensor_parallel(mg, arch, tp)
    assert len(shards) == tp
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape[0] == mg[qkv].shape[0] // tp
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert shards[-1][proj].shape[1] == arch.hidden_size // tp
    # Each rank's fc1 shard is [its gate rows; its up rows].
    fc1 = "decoder.layers.3.mlp.linear_fc1.weight"
    gate, up = mg[fc1].chunk(2)
    rows = arch.ffn_hidden_size // tp
    assert torch.equal(shards[-1][fc1][:rows], gate[-rows:]) and torch.equal(
        shards[-1][fc1][rows:], up[-rows:]
    )
    merged = merge_tensor_parallel(shards, arch)
    assert sorted(merged) == sorted(mg) and all(torch.equal(merged[k], mg[k]) for k in mg)


def test_tensor_parallel_rank_holds_whole_query_groups() -> None:
    """Rank r's qkv rows are exactly groups [r*G/tp, (r+1)*G/tp) of the HF heads."""
    model, arch = hf_model("qwen3", False)
    hf = model.state_dict()
    shard = split_tensor_parallel(hf_to_megatron(hf, arch), arch, 2)[1]
    half = arch.num_query_groups // 2
    local = dataclasses.replace(
        arch, num_attention_heads=arch.num_attention_heads // 2, num_query_groups=half
    )
    q, k, _ = split_qkv(shard["decoder.layers.0.self_attention.linear_qkv.weight"], local)
    rows_q, rows_k = q.shape[0], k.shape[0]
    assert torch.equal(q, hf["model.layers.0.self_attn.q_proj.weight"][rows_q:])
    assert torch.equal(k, hf["model.layers.0.self_attn.k_proj.weight"][rows_k:])


@pytest.mark.parametrize(("tied", "pp"), [(False, 2), (True, 2), (True, 4), (False, 1)])
def test_pipeline_split_and_merge_are_exact(tied: bool, pp: int) -> None:
    model, arch = hf_model("qwen3", tied)
    mg = hf_to_megatron(model.state_dict(), arch)
    stages = split_pipeline(mg, arch, pp)
    per = arch.num_layers // pp
    for stage in stages:
        layers = {int(k.split(".")[2]) for k in stage if k.startswith("decoder.layers.")}
        assert layers == set(range(per))
    assert "embedding.word_embeddings.weight" in stages[0]
    assert "output_layer.weight" in stages[-1] or (tied and pp == 1)
    last_layer = f"decoder.layers.{per - 1}.mlp.linear_fc2.weight"
    assert torch.equal(
        stages[-1][last_layer], mg[f"decoder.layers.{arch.num_layers - 1}.mlp.linear_fc2.weight"]
    )
    merged = merge_pipeline(stages, arch)
    assert sorted(merged) == sorted(mg) and all(torch.equal(merged[k], mg[k]) for k in mg)


def test_missing_and_unknown_weights_are_errors() -> None:
    model, arch = hf_model("qwen3", False)
    hf = dict(model.state_dict())
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        hf_to_megatron(
            {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_norm.weight"}, arch
        )
    with pytest.raises(KeyError, match="lm_head"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, arch)
    with pytest.raises(KeyError, match="not converted"):
        hf_to_megatron({**hf, "model.layers.0.mlp.experts.0.weight": torch.zeros(1)}, arch)
    mg = hf_to_megatron(hf, arch)
    with pytest.raises(KeyError, match="not converted"):
        megatron_to_hf({**mg, "decoder.layers.9.extra.weight": torch.zeros(1)}, arch)
    with pytest.raises(ValueError, match="layout"):
        hf_to_megatron(hf, arch, "apex")  # type: ignore[arg-type]


def test_a_qkv_of_the_wrong_shape_is_an_error() -> None:
    model, arch = hf_model("qwen3", False)
    mg = hf_to_megatron(model.state_dict(), arch)
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    with pytest.raises(ValueError, match="linear_qkv"):
        megatron_to_hf({**mg, key: mg[key][:-1]}, arch)


def test_indivisible_shards_and_inconsistent_replicas_are_errors() -> None:
    model, arch = hf_model("qwen3", False)
    mg = hf_to_megatron(model.state_dict(), arch)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        split_tensor_parallel(mg, arch, 8)
    with pytest.raises(ValueError, match="pipeline"):
        split_pipeline(mg, arch, 3)
    shards = split_tensor_parallel(mg, arch, 2)
    shards[1] = {
        **shards[1],
        "decoder.final_layernorm.weight": shards[1]["decoder.final_layernorm.weight"] + 1,
    }
    with pytest.raises(ValueError, match="differs"):
        merge_tensor_parallel(shards, arch)
