"""megatron-core backend on NVIDIA GPUs: one-GPU forward, and TP 2 + sequence parallel + recompute.

Marked `gpu` and `megatron`: they need the `megatron` extra and CUDA GPUs (one, resp. two),
and are skipped otherwise. Sequence parallelism needs Transformer Engine or apex norms, so
the TP test uses the `te` layer spec when Transformer Engine is installed and skips otherwise.
The reference is the Hugging Face model with the same weights, run on the CPU in fp32.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: uv sync --extra megatron")

from transformers import Qwen3Config, Qwen3ForCausalLM

from turnrl.grpo_core.megatron import QwenArchitecture, parse_megatron_args
from turnrl.grpo_core.megatron.model import build_gpt_model, gpt_logprobs, load_hf_weights
from turnrl.grpo_core.megatron.parallel import model_parallel
from turnrl.npu_runtime import device_count
from turnrl.npu_runtime.net import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]

ATOL = 2e-3
"""Largest |log p| difference GPU (fp32, TF32 matmuls allowed) vs CPU Hugging Face."""
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def _gpus() -> int:
    try:
        return device_count("cuda")
    except Exception:  # no CUDA build / driver: no GPU
        return 0


def hf_model() -> tuple[torch.nn.Module, QwenArchitecture]:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.15)
    return model.eval(), QwenArchitecture.from_hf_config(config)


def _run(rank: int, world: int, port: int, flags: list[str], out: Path) -> None:
    hf, arch = hf_model()
    parallel, _ = parse_megatron_args(flags)
    spec = "te" if HAVE_TE else "local"
    with model_parallel(
        parallel, device="cuda", rank=rank, world_size=world, master_port=port
    ) as device:
        model = build_gpt_model(arch, parallel, spec=spec)
        load_hf_weights(model, hf.state_dict(), arch, layout=spec)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 512, (2, 64), generator=gen)
        labels = torch.roll(ids, -1, dims=1)
        logp, _ = gpt_logprobs(model, ids.to(device), labels.to(device))
        logp.sum().backward()
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits, -1).gather(-1, labels[..., None]).squeeze(-1)
        result = {
            "err": (logp.cpu() - ref).abs().max().item(),
            "finite": all(torch.isfinite(p.grad).all().item() for p in model.parameters()),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def _launch(world: int, flags: list[str], out: Path) -> list[dict]:
    from rank_processes import run_rank_processes

    port = free_port()
    cmd = [sys.executable, __file__, "--worker", str(world), str(port), str(out), *flags]
    run_rank_processes([[*cmd[:3], str(rank), *cmd[3:]] for rank in range(world)], timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.skipif(_gpus() < 1, reason="needs one NVIDIA GPU")
def test_one_gpu_logprobs_match_hugging_face(tmp_path: Path) -> None:
    (result,) = _launch(1, [], tmp_path)
    assert result["err"] < ATOL and result["finite"]


@pytest.mark.skipif(_gpus() < 2, reason="needs two NVIDIA GPUs")
@pytest.mark.skipif(not HAVE_TE, reason="sequence parallelism needs Transformer Engine norms")
def test_tp2_sequence_parallel_full_recompute_matches_hugging_face(tmp_path: Path) -> None:
    flags = [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]
    for result in _launch(2, flags, tmp_path):
        assert result["err"] < ATOL and result["finite"]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _rank, _world, _port, _out, *_flags = sys.argv[2:]
    _run(int(_rank), int(_world), int(_port), _flags, Path(_out))
