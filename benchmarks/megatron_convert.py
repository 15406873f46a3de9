"""Hugging Face <-> Megatron weight conversion time on a Qwen2.5-0.5B-shaped model; prints JSON.

The state dict has Qwen2.5-0.5B's exact shapes (24 layers, hidden 896, 14 query / 2 KV
heads, SwiGLU 4864, vocab 151936, q/k/v bias, tied embeddings; 494M values) in bf16,
filled with random values (no model hub here). The baseline, measured in the same run, is
cloning every tensor once: the least a conversion that copies the weights can cost.
Conversion fuses QKV and gate/up (copies) and renames everything else (no copy).

    UV_PROJECT_ENVIRONMENT=/tmp/megatron-env uv sync --locked --no-default-groups \
        --package turnrl-grpo-core --extra megatron --group test
    /tmp/megatron-env/bin/python benchmarks/megatron_convert.py
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from turnrl.grpo_core.megatron import (
    QwenArchitecture,
    hf_to_megatron,
    megatron_to_hf,
    merge_tensor_parallel,
    split_tensor_parallel,
)

QWEN25_05B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def hf_state(arch: QwenArchitecture) -> dict[str, torch.Tensor]:
    """Random bf16 tensors with the Hugging Face names and shapes of `arch`."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items()}


def best_of(fn: Callable[[], object], repeats: int = 3) -> float:
    """Fastest of `repeats` wall-clock timings, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    arch = QwenArchitecture.from_hf_config(QWEN25_05B)
    hf = hf_state(arch)
    mg = hf_to_megatron(hf, arch)
    back = megatron_to_hf(mg, arch)
    exact = all(torch.equal(back[k], v) for k, v in hf.items())
    shards = split_tensor_parallel(mg, arch, 2)
    exact_tp = all(torch.equal(merge_tensor_parallel(shards, arch)[k], v) for k, v in mg.items())
    baseline = best_of(lambda: {k: v.clone() for k, v in hf.items()})
    results = {
        "model": "Qwen2.5-0.5B shapes, bf16",
        "values_millions": round(sum(t.numel() for t in hf.values()) / 1e6, 1),
        "baseline_clone_all_s": round(baseline, 3),
        "hf_to_megatron_s": round(t1 := best_of(lambda: hf_to_megatron(hf, arch)), 3),
        "megatron_to_hf_s": round(t2 := best_of(lambda: megatron_to_hf(mg, arch)), 3),
        "split_tp2_s": round(t3 := best_of(lambda: split_tensor_parallel(mg, arch, 2)), 3),
        "hf_to_megatron_vs_clone": round(t1 / baseline, 2),
        "megatron_to_hf_vs_clone": round(t2 / baseline, 2),
        "split_tp2_vs_clone": round(t3 / baseline, 2),
        "round_trip_exact": exact,
        "tp2_split_merge_exact": exact_tp,
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
