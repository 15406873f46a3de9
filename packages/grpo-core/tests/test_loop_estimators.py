"""Every advantage estimator the loop offers, end to end on multi-turn samples (CPU).

Two parts:

- a hand-checked batch: five multi-turn samples in two groups (tool-result tokens masked)
  whose advantages under each estimator were worked out by hand (arithmetic in comments),
  computed through the loop's own entry point ``sample_advantages``;
- the matrix: each estimator, with truncated importance sampling on and off, runs three
  steps of the real ``GRPOLoop`` + ``TorchEngine`` on a tiny Qwen3 whose rollouts are
  two model turns around a tool result (mask 0), sampled from the trainer's own weights
  with their true log-probs.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.loop import GRPOLoop, LoopConfig
from turnrl.grpo_core.loop.config import ADVANTAGE_ESTIMATORS
from turnrl.grpo_core.loop.samples import build_train_batch, sample_advantages
from turnrl.grpo_core.testing.golden import ToySample
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig

TOOL_RESULT = [300, 301, 302]
"""Tokens of the tool's answer between the two model turns (never trained on)."""

# Prompt [1, 2]; responses mix policy tokens (mask 1) and tool tokens (mask 0).
#   group a: rewards 1, 0, 0.5 -> mean 0.5, unbiased std 0.5
#   group b: rewards 1, 1      -> mean 1,   std 0
HAND = [
    ("a", 1.0, [5, 6, 7, 8], [1, 0, 0, 1]),
    ("a", 0.0, [9, 10], [0, 1]),
    ("a", 0.5, [11, 12, 13], [1, 0, 0]),
    ("b", 1.0, [14], [1]),
    ("b", 1.0, [15, 16], [1, 0]),
]
SEQUENCE_LEVEL = {
    # (r - mean) / std: a -> 1, -1, 0; b has std 0 -> 0 (plus eps 1e-6: 0, not nan)
    "grpo": [1.0, -1.0, 0.0, 0.0, 0.0],
    "gspo": [1.0, -1.0, 0.0, 0.0, 0.0],
    # r - mean: a -> 0.5, -0.5, 0; b -> 0, 0
    "dr_grpo": [0.5, -0.5, 0.0, 0.0, 0.0],
    # r - mean(others): 1 - 0.25 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0; b -> 0, 0
    "rloo": [0.75, -0.75, 0.0, 0.0, 0.0],
}
# Per policy token, in order A, A, B, C, D, E (six policy tokens, gamma 1):
#   reinforce++: the reward on each token, 1 1 0 .5 1 1; mean .75, unbiased var
#     (4 * .0625 + .5625 + .0625) / 5 = .175 -> (x - .75) / sqrt(.175)
#   reinforce++-baseline: r - group mean, .5 .5 -.5 0 0 0; mean 1/12, var .141667
TOKEN_LEVEL = {
    "reinforce_plus_plus": [0.597614, 0.597614, -1.792843, -0.597614, 0.597614, 0.597614],
    "reinforce_plus_plus_baseline": [
        1.107019,
        1.107019,
        -1.549826,
        -0.221404,
        -0.221404,
        -0.221404,
    ],
}


def _hand_samples() -> list[ToySample]:
    return [
        ToySample([1, 2], ids, mask, [0.0] * len(ids), group, reward=reward)
        for group, reward, ids, mask in HAND
    ]


def test_the_table_covers_every_estimator_the_loop_accepts():
    assert set(SEQUENCE_LEVEL) | set(TOKEN_LEVEL) == set(ADVANTAGE_ESTIMATORS)


@pytest.mark.parametrize("estimator", sorted(SEQUENCE_LEVEL))
def test_sequence_advantages_match_the_hand_computed_values(estimator: str):
    adv = sample_advantages(_hand_samples(), LoopConfig(advantage_estimator=estimator))
    assert adv.tolist() == pytest.approx(SEQUENCE_LEVEL[estimator], abs=1e-5)


@pytest.mark.parametrize("estimator", sorted(TOKEN_LEVEL))
def test_token_advantages_match_by_hand_and_sit_on_policy_tokens_only(estimator: str):
    samples = _hand_samples()
    adv = sample_advantages(samples, LoopConfig(advantage_estimator=estimator))
    assert adv.shape == (5, 6)  # [samples, prompt 2 + longest response 4]
    on_policy = adv[
        torch.tensor([[0, 0] + s.loss_mask + [0] * (4 - len(s.loss_mask)) for s in samples]).bool()
    ]
    assert on_policy.tolist() == pytest.approx(TOKEN_LEVEL[estimator], abs=1e-5)
    assert adv.abs().sum() == pytest.approx(on_policy.abs().sum())  # 0 on prompt and tool tokens
    batch = build_train_batch(samples, adv, pad_id=0)
    assert batch is not None and batch.advantages is not None
    assert batch.advantages.shape == batch.input_ids.shape
    assert bool(((batch.advantages != 0) <= batch.loss_mask.bool()).all())


def test_gspo_advantages_with_the_token_ratio_loss_are_refused(tmp_path: Path):
    folder = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=0))
    trainer = TorchEngine(TorchEngineConfig(model_path=str(folder)))

    async def never(*_: object) -> list:
        raise AssertionError("not reached")

    with pytest.raises(ValueError, match="policy_loss='gspo'"):
        GRPOLoop(
            LoopConfig(advantage_estimator="gspo"),
            trainer,
            [[1]],
            never,
            never,
            weight_sync=None,
            pad_id=0,
        )


# -- the matrix: the real loop, three steps per estimator, TIS on and off ----------------

TURN_LEN = 3


@torch.no_grad()
def _sample_turn(
    model: torch.nn.Module, ids: list[int], gen: torch.Generator
) -> tuple[list[int], list[float]]:
    out, logps = [], []
    for _ in range(TURN_LEN):
        logp = torch.log_softmax(model(torch.tensor([ids + out])).logits[0, -1].float(), -1)
        token = int(torch.multinomial(logp.exp(), 1, generator=gen))
        out.append(token)
        logps.append(float(logp[token]))
    return out, logps


def _multi_turn_loop(folder: Path, estimator: str, tis: bool) -> tuple[GRPOLoop, TorchEngine]:
    loss = ActorLossConfig(
        policy_loss="gspo" if estimator == "gspo" else "ppo",
        loss_agg_mode="seq-mean-token-sum-norm" if estimator == "dr_grpo" else "token-mean",
        norm_length=2 * TURN_LEN,
        use_tis=tis,
    )
    trainer = TorchEngine(
        TorchEngineConfig(
            model_path=str(folder), loss=loss, seed=0, optimizer=OptimizerConfig(lr=1e-3)
        )
    )
    gen = torch.Generator().manual_seed(0)

    async def generate(prompts: list[list[int]], n: int) -> list[ToySample]:
        model = trainer.hf_model.eval()
        out = []
        for prompt in prompts:
            for _ in range(n):
                first, lp1 = _sample_turn(model, prompt, gen)
                second, lp2 = _sample_turn(model, prompt + first + TOOL_RESULT, gen)
                mask = [1] * TURN_LEN + [0] * len(TOOL_RESULT) + [1] * TURN_LEN
                logps = lp1 + [0.0] * len(TOOL_RESULT) + lp2
                out.append(
                    ToySample(
                        prompt, first + TOOL_RESULT + second, mask, logps, str(prompt), num_turns=2
                    )
                )
        model.train()
        return out

    async def reward(samples: list[ToySample]) -> list[float]:
        # Even ids among the policy's own tokens (the tool's tokens do not count).
        return [
            sum(t % 2 == 0 for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m)
            / (2 * TURN_LEN)
            for s in samples
        ]

    config = LoopConfig(
        num_rollout=3,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        global_batch_size=4,
        advantage_estimator=estimator,
        seed=0,
    )
    loop = GRPOLoop(
        config, trainer, [[1, 40, 90], [2, 41, 91]], generate, reward, weight_sync=None, pad_id=0
    )
    return loop, trainer


@pytest.mark.slow
@pytest.mark.parametrize("tis", [False, True], ids=["tis-off", "tis-on"])
@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
async def test_every_estimator_trains_three_steps_of_the_real_loop(
    tmp_path_factory: pytest.TempPathFactory, estimator: str, tis: bool
):
    folder = tmp_path_factory.getbasetemp() / "estimators-tiny"
    if not (folder / "config.json").is_file():
        build_tiny_model(folder, TinyModelConfig(seed=0))
    loop, trainer = _multi_turn_loop(folder, estimator, tis)
    before = {k: v.clone() for k, v in trainer.hf_model.state_dict().items()}
    history = await loop.run()
    assert len(history) == 3 and all(m["train/skipped"] == 0.0 for m in history)
    for m in history:
        for key in ("train/pg_loss", "train/grad_norm", "train/advantage_abs_mean"):
            assert math.isfinite(m[key]), (key, m[key])
        # Trainer and sampler are the same weights before the first update of a step.
        assert m["train/mismatch_abs_diff"] < 1e-4
    assert any(m["train/advantage_abs_mean"] > 0 for m in history)
    moved = sum(
        float((v - before[k]).abs().sum()) for k, v in trainer.hf_model.state_dict().items()
    )
    assert moved > 0
