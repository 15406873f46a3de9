"""The GRPO loop end to end on CPU without vLLM: a learnable toy task.

The "inference engine" here is a second copy of the tiny Qwen3 model that samples with
torch and is updated only through the disk weight-sync path (``export_hf`` then a reload
of the exported folder), so the test also shows the policy that generates is the one the
loop synced. Task: the engine samples among eight candidate tokens (constrained decoding,
ids 100-107) and every even id earns reward; the probability the engine gives the even
candidates after four seeded steps must rise by at least 0.15 (from about 0.5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.loop import GRPOLoop, LoopConfig
from turnrl.grpo_core.testing.golden import ToySample
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig

RESPONSE_LEN = 4
STEPS = 4
CANDIDATES = torch.arange(100, 108)


class TorchSampler:
    """Samples from its own model copy; new weights arrive only via ``reload``."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self._load = AutoModelForCausalLM.from_pretrained
        self.model = self._load(folder).eval()
        self.version = 0
        self.gen = torch.Generator().manual_seed(0)

    def reload(self, folder: Path, version: int) -> None:
        self.model = self._load(folder).eval()
        self.version = version

    @torch.no_grad()
    def sample(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        ids, logps = list(prompt), []
        for _ in range(RESPONSE_LEN):
            probs = self._candidate_probs(ids)
            pick = int(torch.multinomial(probs, 1, generator=self.gen))
            ids.append(int(CANDIDATES[pick]))
            logps.append(float(torch.log(probs[pick])))
        return ids[len(prompt) :], logps

    def _candidate_probs(self, ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        return torch.softmax(logits[CANDIDATES], -1)

    @torch.no_grad()
    def even_mass(self, prompts: list[list[int]]) -> float:
        total = 0.0
        for prompt in prompts:
            total += float(self._candidate_probs(prompt)[0::2].sum())
        return total / len(prompts)


class LocalSync:
    """Disk weight sync into the TorchSampler (the same export path vLLM engines reload)."""

    def __init__(self, sampler: TorchSampler, root: Path) -> None:
        self.sampler, self.root = sampler, root

    async def sync(self, trainer: Any, version: int) -> dict[str, float]:
        folder = trainer.export_hf(self.root / f"v{version}")
        self.sampler.reload(folder, version)
        return {"total_s": 0.0}


@pytest.mark.slow
async def test_loop_raises_reward_on_toy_task(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=0))
    prompts = [[1 + i, 40 + i, 90 + i] for i in range(4)]
    sampler = TorchSampler(folder)
    trainer = TorchEngine(
        TorchEngineConfig(
            model_path=str(folder),
            optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
            loss=ActorLossConfig(eps_clip=0.2, eps_clip_high=0.28),
            micro_batch_size=8,
            seed=0,
        )
    )
    versions_seen: list[int] = []

    async def generate(batch: list[list[int]], n: int) -> list[ToySample]:
        versions_seen.append(sampler.version)
        out = []
        for p in batch:
            for _ in range(n):
                ids, logps = sampler.sample(p)
                out.append(ToySample(p, ids, [1] * len(ids), logps, group_id=str(p)))
        return out

    async def reward(samples: list[ToySample]) -> list[float]:
        return [sum(t % 2 == 0 for t in s.response_ids) / RESPONSE_LEN for s in samples]

    config = LoopConfig(
        num_rollout=STEPS,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        global_batch_size=8,
        rollout_shuffle=True,
        seed=0,
    )
    logged: list[int] = []
    loop = GRPOLoop(
        config,
        trainer,
        prompts,
        generate,
        reward,
        weight_sync=LocalSync(sampler, tmp_path / "sync"),
        pad_id=0,
        on_metrics=lambda step, m: logged.append(step),
    )
    before = sampler.even_mass(prompts)
    history = await loop.run()
    after = sampler.even_mass(prompts)
    # Each step generated with the weights synced by the previous one.
    assert versions_seen == list(range(STEPS))
    assert logged == list(range(1, STEPS + 1)) and len(history) == STEPS
    assert all(m["train/skipped"] == 0.0 for m in history)
    assert history[0]["train/num_tokens"] > 0
    print(f"even-token mass {before:.3f} -> {after:.3f}")
    assert after > before + 0.15, f"even-token mass {before:.3f} -> {after:.3f}"


def test_token_budget_micro_batches_train_the_same_steps(tmp_path: Path) -> None:
    """``max_tokens_per_micro_batch`` cuts each mini-batch by tokens (7-token samples, a
    budget of 20: two per micro-batch instead of the toy's 8 rows) and trains the same
    steps: the loss is normalised by the whole mini-batch's token count either way."""
    import asyncio
    from dataclasses import replace

    from turnrl.grpo_core.testing.golden import ToyRunConfig, build_toy_loop, deterministic_torch

    folder = build_tiny_model(tmp_path / "model", TinyModelConfig(seed=0))
    toy = ToyRunConfig(steps=2)
    with deterministic_torch():
        by_rows = asyncio.run(build_toy_loop(folder, toy).run())
        loop = build_toy_loop(folder, toy)
        loop.config = replace(loop.config, max_tokens_per_micro_batch=20)
        calls: list[Any] = []
        train_step = loop.trainer.train_step
        loop.trainer.train_step = lambda batch, **kw: calls.append(batch) or train_step(batch, **kw)  # type: ignore[method-assign]
        by_tokens = asyncio.run(loop.run())
    assert calls and all(isinstance(c, list) for c in calls)
    for micro in calls:
        assert all(int(mb.attention_mask.sum()) <= 20 for mb in micro)
        assert sum(mb.num_sequences for mb in micro) == toy.global_batch_size
    for step, (ours, theirs) in enumerate(zip(by_tokens, by_rows, strict=True)):
        # Packing is reported: the step's tokens over its micro-batches' budgets.
        tokens = sum(int(mb.attention_mask.sum()) for mb in calls[step])
        assert ours["train/micro_batches_per_rank"] == len(calls[step])
        assert ours["train/packing_utilisation"] == pytest.approx(tokens / (20 * len(calls[step])))
        assert "train/packing_utilisation" not in theirs
        assert ours["rollout/reward_mean"] == theirs["rollout/reward_mean"]
        for key in ("train/loss", "train/grad_norm", "train/num_tokens"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
        assert ours["train/over_budget_samples"] == 0
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1"):
        LoopConfig(max_tokens_per_micro_batch=0)
