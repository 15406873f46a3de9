"""megatron-core GPTModel on the CPU (gloo) against the Hugging Face model with the same weights.

Tiny seeded `Qwen3ForCausalLM` (untied) and `Qwen2ForCausalLM` (q/k/v bias, tied embeddings)
built by transformers, converted to Megatron and loaded into a real `GPTModel` built with
`build_gpt_model`; log-probs and entropy must match the Hugging Face forward within
`ATOL` (fp32: both compute the same math, differences are summation order only).
Tensor parallelism (TP 2) runs as two real processes over gloo.

Needs the `megatron` extra (nox session `megatron`); skipped without megatron-core.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: uv sync --extra megatron")

from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from turnrl.grpo_core.megatron import MegatronParallelConfig, QwenArchitecture, parse_megatron_args
from turnrl.grpo_core.megatron.cpu import CpuRNGStatesTracker
from turnrl.grpo_core.megatron.model import (
    build_gpt_model,
    export_hf_weights,
    gpt_logprobs,
    load_hf_weights,
)
from turnrl.grpo_core.megatron.parallel import model_parallel
from turnrl.npu_runtime.net import free_port

pytestmark = pytest.mark.megatron

ATOL = 1e-5
"""Largest |log p_megatron - log p_hf| allowed (fp32; observed ~5e-7)."""
SHAPE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 1e6,
}


def hf_model(kind: str, seed: int = 0) -> tuple[torch.nn.Module, QwenArchitecture]:
    """Seeded tiny model; weights re-drawn larger than HF's init so logits are far from uniform."""
    torch.manual_seed(seed)
    if kind == "qwen3":
        config = Qwen3Config(head_dim=32, tie_word_embeddings=False, **SHAPE)
        model = Qwen3ForCausalLM(config)
    else:
        config = Qwen2Config(tie_word_embeddings=True, **SHAPE)
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.15)
    return model.eval(), QwenArchitecture.from_hf_config(config)


def hf_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logp_all = torch.log_softmax(model(ids).logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def batch(seed: int = 1, size: tuple[int, int] = (3, 17)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SHAPE["vocab_size"], size, generator=gen)
    return ids, torch.roll(ids, -1, dims=1)


@pytest.fixture(scope="module")
def groups() -> object:
    """One gloo process group + Megatron groups (TP 1) + the CPU shims for this module."""
    with model_parallel(MegatronParallelConfig(), device="cpu") as device:
        yield device


def megatron_model(
    arch: QwenArchitecture, hf: torch.nn.Module, parallel: MegatronParallelConfig | None = None
) -> torch.nn.Module:
    model = build_gpt_model(arch, parallel or MegatronParallelConfig(), cpu_initialization=True)
    load_hf_weights(model, hf.state_dict(), arch)
    return model


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_hugging_face(
    groups: str, kind: str, temperature: float
) -> None:
    hf, arch = hf_model(kind)
    model = megatron_model(arch, hf)
    ids, labels = batch()
    logp, entropy = gpt_logprobs(model, ids, labels, temperature=temperature, return_entropy=True)
    ref_logp, ref_entropy = hf_logprobs(hf, ids, labels, temperature)
    assert logp.shape == entropy.shape == ids.shape and logp.dtype == torch.float32
    assert ref_logp.std() > 0.5  # far from uniform: a wrong weight mapping could not pass
    torch.testing.assert_close(logp, ref_logp, atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=ATOL, rtol=0)


def test_a_mismapped_weight_breaks_the_match(groups: str) -> None:
    """The comparison is sensitive: swapping the q/k norms of one layer moves the log-probs."""
    hf, arch = hf_model("qwen3")
    model = megatron_model(arch, hf)
    attn = model.decoder.layers[1].self_attention
    with torch.no_grad():
        q_norm = attn.q_layernorm.weight.clone()
        attn.q_layernorm.weight.copy_(attn.k_layernorm.weight)
        attn.k_layernorm.weight.copy_(q_norm)
    ids, labels = batch()
    logp, _ = gpt_logprobs(model, ids, labels)
    assert (logp - hf_logprobs(hf, ids, labels, 1.0)[0]).abs().max() > 100 * ATOL


def test_backward_gives_finite_gradients_on_every_parameter(groups: str) -> None:
    hf, arch = hf_model("qwen3")
    model = megatron_model(arch, hf)
    ids, labels = batch()
    logp, entropy = gpt_logprobs(model, ids, labels, return_entropy=True)
    (-(logp.mean()) - 0.01 * entropy.mean()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


def test_gradients_match_hugging_face(groups: str) -> None:
    hf, arch = hf_model("qwen2")  # tied: the embedding's gradient sums both uses
    model = megatron_model(arch, hf)
    ids, labels = batch()
    gpt_logprobs(model, ids, labels)[0].sum().backward()
    logits = hf(ids).logits.float()
    torch.log_softmax(logits, -1).gather(-1, labels[..., None]).sum().backward()
    ours = export_hf_weights_grads(model, arch)
    for name, param in hf.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, atol=1e-4, rtol=1e-4, msg=name)


def export_hf_weights_grads(
    model: torch.nn.Module, arch: QwenArchitecture
) -> dict[str, torch.Tensor]:
    """Megatron gradients under Hugging Face names (the weight converter applied to .grad)."""
    from turnrl.grpo_core.megatron import megatron_to_hf

    return megatron_to_hf({n: p.grad for n, p in model.named_parameters()}, arch)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_hf_to_megatron_model_to_hf_is_exact(groups: str, kind: str) -> None:
    hf, arch = hf_model(kind)
    back = export_hf_weights(megatron_model(arch, hf), arch)
    expected = hf.state_dict()
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_full_recompute_gives_the_same_logprobs_and_gradients(groups: str) -> None:
    hf, arch = hf_model("qwen3")
    parallel, _ = parse_megatron_args(
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    )
    plain, recomputed = megatron_model(arch, hf), megatron_model(arch, hf, parallel)
    assert recomputed.config.recompute_granularity == "full"
    ids, labels = batch()
    results = []
    for model in (plain, recomputed):
        logp, _ = gpt_logprobs(model, ids, labels)
        logp.sum().backward()
        results.append((logp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_model_is_built_from_the_architecture(groups: str) -> None:
    _, arch = hf_model("qwen3")
    model = build_gpt_model(arch, MegatronParallelConfig(), cpu_initialization=True)
    assert model.config.num_query_groups == 2 and model.config.kv_channels == 32
    assert model.config.qk_layernorm and not model.config.add_qkv_bias
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(1e6 ** (-2 / 32))
    tied = build_gpt_model(hf_model("qwen2")[1], MegatronParallelConfig(), cpu_initialization=True)
    assert tied.share_embeddings_and_output_weights and tied.config.add_qkv_bias


def test_bad_inputs_are_errors(groups: str) -> None:
    hf, arch = hf_model("qwen3")
    model = megatron_model(arch, hf)
    ids, labels = batch()
    with pytest.raises(ValueError, match="temperature"):
        gpt_logprobs(model, ids, labels, temperature=0.0)
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        gpt_logprobs(model, ids, labels[:, :-1])
    with pytest.raises(ValueError, match="pipeline"):
        gpt_logprobs(types.SimpleNamespace(pre_process=False, post_process=True), ids, labels)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TP 1"):
        build_gpt_model(
            arch, MegatronParallelConfig(tensor_model_parallel_size=2), cpu_initialization=True
        )
    with pytest.raises(KeyError, match="missing"):
        load_hf_weights(
            model, {k: v for k, v in hf.state_dict().items() if "layers.1." not in k}, arch
        )


def test_cpu_rng_tracker_forks_and_restores() -> None:
    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    with pytest.raises(ValueError, match="seed"):
        tracker.add("other", 7)
    with pytest.raises(KeyError, match="not added"), tracker.fork("missing"):
        pass
    torch.manual_seed(0)
    outside = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), outside)  # the outer stream is untouched
    with tracker.fork():
        second = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert not torch.equal(first, second)  # the tracked stream advanced


def test_shims_are_removed_after_the_block() -> None:
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from turnrl.grpo_core.megatron.cpu import cpu_shims

    before = (RotaryEmbedding.get_emb, parallel_state._GLOBAL_MEMORY_BUFFER)
    with cpu_shims():
        assert RotaryEmbedding.get_emb is not before[0]
    assert (RotaryEmbedding.get_emb, parallel_state._GLOBAL_MEMORY_BUFFER) == before


# --- tensor parallelism: two real processes over gloo -------------------------------------------


def _tp_worker(rank: int, world_size: int, port: int, out: Path) -> None:
    """One TP rank: load the HF weights' shard, score a batch, backward, export, write results."""
    from megatron.core import parallel_state

    hf, arch = hf_model("qwen2")
    parallel = MegatronParallelConfig(tensor_model_parallel_size=world_size)
    with model_parallel(parallel, device="cpu", rank=rank, world_size=world_size, master_port=port):
        model = megatron_model(arch, hf, parallel)
        ids, labels = batch()
        logp, entropy = gpt_logprobs(model, ids, labels, return_entropy=True)
        logp.sum().backward()
        back = export_hf_weights(model, arch)
        ref_logp, ref_entropy = hf_logprobs(hf, ids, labels, 1.0)
        expected = hf.state_dict()
        # Sequence parallel: the sequence (17 tokens, padded to 18) split over the TP ranks,
        # the norms on each shard; their weights' partial gradients summed over TP must be
        # the gradients without it.
        sp = MegatronParallelConfig(tensor_model_parallel_size=world_size, sequence_parallel=True)
        sp_model = megatron_model(arch, hf, sp)
        sp_logp, sp_entropy = gpt_logprobs(sp_model, ids, labels, return_entropy=True)
        sp_logp.sum().backward()
        grads = dict(model.named_parameters())
        sp_grad_err = 0.0
        for name, param in sp_model.named_parameters():
            grad = param.grad.clone()
            if getattr(param, "sequence_parallel", False):
                torch.distributed.all_reduce(
                    grad, group=parallel_state.get_tensor_model_parallel_group()
                )
            sp_grad_err = max(sp_grad_err, (grad - grads[name].grad).abs().max().item())
        result = {
            "sp_marked": sum(getattr(p, "sequence_parallel", False) for p in sp_model.parameters()),
            "sp_logp_err": (sp_logp - ref_logp).abs().max().item(),
            "sp_entropy_err": (sp_entropy - ref_entropy).abs().max().item(),
            "sp_grad_err": sp_grad_err,
            "rank": rank,
            "qkv_rows": model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0],
            "logp_err": (logp - ref_logp).abs().max().item(),
            "entropy_err": (entropy - ref_entropy).abs().max().item(),
            "grads_finite": all(torch.isfinite(p.grad).all().item() for p in model.parameters()),
            "export_exact": sorted(back) == sorted(expected)
            and all(torch.equal(back[k], v) for k, v in expected.items()),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_tensor_parallel_2_over_gloo_matches_hugging_face(tmp_path: Path) -> None:
    from rank_processes import run_rank_processes

    port, world = free_port(), 2
    cmd = [sys.executable, __file__, "--tp-worker", str(world), str(port), str(tmp_path)]
    run_rank_processes([[*cmd, str(rank)] for rank in range(world)], timeout=420)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for result in results:
        assert result["qkv_rows"] == (4 + 2 * 2) * 16 // world  # each rank: one query group
        assert result["logp_err"] < ATOL and result["entropy_err"] < ATOL
        assert result["grads_finite"] and result["export_exact"]
        assert result["sp_marked"] == 2 * 2 + 1  # two norms per layer and the final norm
        assert result["sp_logp_err"] < ATOL and result["sp_entropy_err"] < ATOL
        assert result["sp_grad_err"] < ATOL


if __name__ == "__main__" and sys.argv[1:2] == ["--tp-worker"]:
    _world, _port, _out, _rank = sys.argv[2:6]
    _tp_worker(int(_rank), int(_world), int(_port), Path(_out))
