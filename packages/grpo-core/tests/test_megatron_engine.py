"""The megatron train engine against the torch backend on the same tiny Qwen3 (CPU, fp32).

Both engines start from one Hugging Face folder whose weights are re-drawn larger than
the initialiser's, so log-probs are far from uniform and a mis-mapped weight or gradient
could not pass. One GRPO step on the same batch (clipped ratios, entropy bonus) must give
the same loss and gradient norm within 1e-5 relative and the same updated weights (exported
back to Hugging Face names) within 1e-5. Needs the `megatron` extra (nox session
`megatron`); skipped without megatron-core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: uv sync --extra megatron")

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.backends import make_engine
from turnrl.grpo_core.loop.loop import GRPOLoop
from turnrl.grpo_core.megatron import megatron_to_hf
from turnrl.grpo_core.megatron.config import parse_megatron_args
from turnrl.grpo_core.megatron.engine import MegatronEngine, MegatronEngineConfig
from turnrl.grpo_core.testing.golden import ToyRunConfig, build_toy_loop, deterministic_torch
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import (
    OptimizerConfig,
    TorchEngine,
    TorchEngineConfig,
    TrainStep,
)
from turnrl.grpo_core.training.trainer import Trainer

pytestmark = pytest.mark.megatron

RTOL = 1e-5
LOSS = ActorLossConfig(eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01)


def spread_model(folder: Path, tie_word_embeddings: bool = False) -> Path:
    """A tiny Qwen3 folder whose weights are re-drawn larger, so log-probs are far from
    uniform and a mis-mapped weight or gradient could not pass."""
    config = TinyModelConfig(
        vocab_size=768, hidden_size=64, tie_word_embeddings=tie_word_embeddings
    )
    folder = build_tiny_model(folder, config)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return spread_model(tmp_path_factory.mktemp("tiny"))


def settings(model_dir: Path, **extra: object) -> dict[str, object]:
    return {
        "model_path": str(model_dir),
        "optimizer": OptimizerConfig(lr=1e-2, adam_eps=1.0),
        "micro_batch_size": 2,
        "loss": LOSS,
        "temperature": 0.7,
        **extra,
    }


@pytest.fixture
def megatron(model_dir: Path) -> Iterator[MegatronEngine]:
    engine = make_engine(MegatronEngineConfig(**settings(model_dir)))  # type: ignore[arg-type]
    assert isinstance(engine, MegatronEngine)
    try:
        yield engine
    finally:
        engine.close()


def make_batch(seed: int, rows: int = 4, length: int = 20) -> TrainBatch:
    """Right-padded rows of uneven length; the last 2/3 of each row is the response."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 700, (rows, length), generator=g)
    attn = torch.ones_like(ids)
    for row in range(1, rows):
        attn[row, length - 3 * row :] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, length // 3 :] = 1
    loss_mask *= attn
    return TrainBatch(ids, attn, loss_mask, advantages=torch.linspace(1.0, -1.0, rows))


def test_one_grpo_step_equals_the_torch_backend(
    megatron: MegatronEngine, model_dir: Path, tmp_path: Path
) -> None:
    """Both backends meet the Trainer interface and compose the same TrainStep (Megatron no
    longer inherits the torch engine); one GRPO step gives the same loss, gradients and
    weights."""
    torch_engine = TorchEngine(TorchEngineConfig(**settings(model_dir)))  # type: ignore[arg-type]
    assert isinstance(megatron, Trainer) and isinstance(torch_engine, Trainer)
    assert not isinstance(megatron, TorchEngine)
    assert type(megatron.steps) is type(torch_engine.steps) is TrainStep
    batch = make_batch(seed=1)
    ours, theirs = megatron.compute_logprobs(batch), torch_engine.compute_logprobs(batch)
    assert theirs[batch.loss_mask.bool()].std() > 0.5  # far from uniform
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # Old log-probs off the current policy: ratios away from 1, some clipped.
    noise = 0.3 * torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(2))
    batch.old_logprobs = (theirs + noise) * batch.loss_mask
    ours_m, theirs_m = megatron.train_step(batch), torch_engine.train_step(batch)
    assert theirs_m["clip_frac"] > 0
    for key in ("loss", "pg_loss", "grad_norm", "clip_frac", "entropy"):
        assert ours_m[key] == pytest.approx(theirs_m[key], rel=RTOL, abs=1e-7), key
    # The gradients of the step, under Hugging Face names.
    grads = megatron_to_hf({n: p.grad for n, p in megatron.gpt.named_parameters()}, megatron.arch)
    reference = dict(torch_engine.hf_model.named_parameters())
    assert sorted(grads) == sorted(reference)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name].grad, rtol=1e-4, atol=1e-7, msg=name)
    # The updated weights: AdamW's first step is lr x sign(g) where |g| >> eps, which turns
    # float noise on near-zero gradients into whole steps; an eps above the gradients makes
    # the update linear in them, so equal gradients must give equal weights.
    exported = load_file(megatron.export_hf(tmp_path / "m") / "model.safetensors")
    start = load_file(f"{model_dir}/model.safetensors")
    assert sorted(exported) == sorted(reference)
    for name, value in exported.items():
        torch.testing.assert_close(value, reference[name].detach(), atol=1e-5, rtol=0, msg=name)
    assert max(float((start[n] - v).abs().max()) for n, v in exported.items()) > 1e-4


def test_checkpoint_resume_gives_the_same_next_steps(
    megatron: MegatronEngine, model_dir: Path, tmp_path: Path
) -> None:
    batches = [make_batch(seed=10 + i) for i in range(4)]
    for b in batches[:2]:
        megatron.train_step(b)
    megatron.save_checkpoint(tmp_path / "ckpt", data_state={"next": 2})
    straight = [megatron.train_step(b)["loss"] for b in batches[2:]]
    megatron.close()
    resumed = MegatronEngine(MegatronEngineConfig(**settings(model_dir)))  # type: ignore[arg-type]
    try:
        assert resumed.load_checkpoint(tmp_path / "ckpt") == {"next": 2} and resumed.step == 2
        assert [resumed.train_step(b)["loss"] for b in batches[2:]] == straight
    finally:
        resumed.close()
    # The fixture closes the first engine again: closing twice must be harmless.


def test_full_recompute_trains_the_same_step(model_dir: Path) -> None:
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
    batch = make_batch(seed=3)
    results = []
    for extra in ({}, {"parallel": parallel}):
        engine = MegatronEngine(MegatronEngineConfig(**settings(model_dir, **extra)))  # type: ignore[arg-type]
        try:
            results.append(engine.train_step(batch))
        finally:
            engine.close()
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-6)
    assert results[1]["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-5)


def toy_run(folder: Path, steps: int, backend: str, **kwargs: object) -> GRPOLoop:
    loop = build_toy_loop(folder, ToyRunConfig(steps=steps), backend=backend, **kwargs)  # type: ignore[arg-type]
    asyncio.run(loop.run())
    return loop


def test_the_toy_grpo_run_trains_on_megatron_and_resumes_exactly(tmp_path: Path) -> None:
    """The golden toy task (reward: even tokens) on the megatron backend: its first step is
    the torch backend's (same samples, same loss), reward rises over 5 steps, and a run
    stopped after step 2 and resumed from its checkpoint equals the uninterrupted one."""
    folder = build_tiny_model(tmp_path / "model", TinyModelConfig(seed=0))
    with deterministic_torch():
        torch_run = toy_run(folder, 1, "torch")
        straight = toy_run(folder, 5, "megatron")
        straight.trainer.close()
        first = toy_run(folder, 2, "megatron", checkpoint_dir=tmp_path / "ckpt", save_interval=2)
        first.trainer.close()
        resumed = build_toy_loop(folder, ToyRunConfig(steps=5), backend="megatron")
        try:
            asyncio.run(resumed.resume(tmp_path / "ckpt" / "step_2"))
            asyncio.run(resumed.run())
        finally:
            resumed.trainer.close()
    ours, theirs = straight.history[0], torch_run.history[0]
    assert ours["rollout/reward_mean"] == theirs["rollout/reward_mean"]
    assert ours["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-5, abs=1e-7)
    rewards = [m["rollout/reward_mean"] for m in straight.history]
    assert sum(rewards[-2:]) / 2 > rewards[0] + 0.05, rewards
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm")
    assert [[m[k] for k in keys] for m in resumed.history] == [
        [m[k] for k in keys] for m in straight.history
    ]


def test_weight_decay_skips_the_norms_as_megatron_does(model_dir: Path) -> None:
    """With zero gradients (zero advantages) AdamW's step is its decay alone: the matrices
    shrink by 1 - lr x wd, the norms' weights (1-D: input, pre-MLP, q / k and final
    layernorms) stay as they are, as under megatron-core's own ``get_param_groups``."""
    optimizer = OptimizerConfig(lr=0.1, weight_decay=0.5)
    engine = MegatronEngine(
        MegatronEngineConfig(**settings(model_dir, optimizer=optimizer, loss=ActorLossConfig()))  # type: ignore[arg-type]
    )
    try:
        before = {n: p.detach().clone() for n, p in engine.gpt.named_parameters()}
        batch = make_batch(seed=4)
        batch.advantages = torch.zeros(batch.input_ids.shape[0])
        engine.train_step(batch)
        after = dict(engine.gpt.named_parameters())
    finally:
        engine.close()
    assert sum("layernorm" in name for name in before) == 9
    for name, value in before.items():
        expected = value if value.ndim == 1 else value * (1 - 0.1 * 0.5)
        torch.testing.assert_close(after[name].detach(), expected, rtol=1e-6, atol=0, msg=name)
