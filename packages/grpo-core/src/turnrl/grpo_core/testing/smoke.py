"""Device smoke run: a few real GRPO steps with a tiny model on this machine's device.

``python -m turnrl.grpo_core.testing.smoke`` (what ``ci/device_smoke.sh`` runs): detects the
device (``TURNRL_DEVICE`` forces one), finds or creates the pinned engine environment,
writes a tiny random Qwen3 model, starts one vLLM engine server on it, and runs
``--steps`` GRPO steps with the torch trainer on the device. Task: every response token
with an even id earns reward (mean = fraction of even ids), learnable from random init;
``--candidates 8`` (the default) samples among ids 100-107 so a few steps show it rising.

Weight sync: :class:`CollectiveWeightSync` when the device has at least two cards -- NCCL on
CUDA, HCCL (vllm-ascend's transfer engine) on Ascend -- with the engine on card 1 and the
trainer on card 0 (neither collective puts two ranks on one card); otherwise
:class:`DiskWeightSync` (the CPU path, and any single-card machine). Prints one JSON object with the device, the sync kind and
every step's numbers; exits 1 if any step fails or a number is not finite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from turnrl.grpo_core.loop import GRPOLoop, LoopConfig
from turnrl.grpo_core.testing.golden import ToySample
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig
from turnrl.grpo_core.weight_sync import DiskWeightSync, WeightSync
from turnrl.grpo_core.weight_sync.collective import CollectiveSyncConfig, CollectiveWeightSync
from turnrl.npu_runtime.device import DeviceType, detect_device, device_count
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.engine import EngineServer, EngineSpec
from turnrl.rollout_router.engine_env import ensure_engine_env
from turnrl.rollout_router.protocol import SamplingParams

ENGINE_DEVICE = {DeviceType.CPU: "cpu", DeviceType.CUDA: "gpu", DeviceType.NPU: "npu"}
COLLECTIVE = {DeviceType.CUDA: ("nccl", "cuda:0"), DeviceType.NPU: ("hccl", "npu:0")}
"""Collective weight-transfer backend and trainer card of each device with two cards or more."""
STEP_KEYS = {
    "step_s": "perf/step_s",
    "rollout_s": "perf/rollout_s",
    "train_s": "perf/train_s",
    "sync_s": "perf/sync_s",
    "sync_total_s": "perf/sync_total_s",
    "sync_gb_per_s": "perf/sync_gb_per_s",
    "sync_bytes": "perf/sync_bytes",
    "sync_buckets": "perf/sync_buckets",
    "reward": "rollout/reward_mean",
    "loss": "train/loss",
}


def even_reward(sample: ToySample) -> float:
    """Fraction of the response's token ids that are even."""
    return sum(t % 2 == 0 for t in sample.response_ids) / max(1, len(sample.response_ids))


def make_sync(kind: DeviceType, url: str, root: Path) -> tuple[WeightSync, str]:
    """The weight sync for ``kind`` and a word saying which one it is."""
    if kind in COLLECTIVE and device_count(kind) >= 2:
        backend, device = COLLECTIVE[kind]
        cfg = CollectiveSyncConfig(
            engine_urls=[url], backend=backend, device=device, dtype="bfloat16"
        )
        return CollectiveWeightSync(cfg), f"collective-{backend}"
    return DiskWeightSync([url], root), "disk"


def engine_spec(
    kind: DeviceType, model: Path, python: Path, sync_kind: str, port: int
) -> EngineSpec:
    """One small engine; on a multi-GPU machine it gets device 1 and NCCL weight transfer."""
    spec = EngineSpec(
        model=str(model),
        device=ENGINE_DEVICE[kind],
        port=port,
        python=str(python),
        max_model_len=256,
        gpu_memory_utilization=0.3,
        dtype="float32" if kind is DeviceType.CPU else "bfloat16",
    )
    if sync_kind.startswith("collective-"):
        backend = sync_kind.removeprefix("collective-")
        spec.env[str(kind.visible_devices_env)] = "1"  # an accelerator here
        spec.extra_args += ["--weight-transfer-config", json.dumps({"backend": backend})]
    return spec


async def run_steps(loop: GRPOLoop, steps: int) -> list[dict[str, float]]:
    """Run ``steps`` GRPO steps; returns each step's selected numbers."""
    rows = []
    for _ in range(steps):
        metrics = await loop.run_step()
        rows.append({k: float(metrics[m]) for k, m in STEP_KEYS.items() if m in metrics})
    return rows


def build_loop(
    trainer: TorchEngine, url: str, sync: WeightSync, args: argparse.Namespace
) -> GRPOLoop:
    """A GRPO loop whose generate hook samples from the engine at ``url``."""
    allowed = list(range(100, 100 + args.candidates)) if args.candidates else []
    sampling = SamplingParams(
        temperature=1.0, max_tokens=args.response_len, ignore_eos=True, allowed_token_ids=allowed
    )
    prompts = [[1 + i, 40 + i, 90 + i, 7] for i in range(args.prompts)]

    async def generate(batch: list[list[int]], n: int) -> list[ToySample]:
        async with EngineClient(url) as client:
            outs = await asyncio.gather(
                *(client.generate(p, sampling) for p in batch for _ in range(n))
            )
        pairs = [p for p in batch for _ in range(n)]
        return [
            ToySample(p, g.token_ids, [1] * len(g.token_ids), g.logprobs, str(p))
            for p, g in zip(pairs, outs, strict=True)
        ]

    async def reward(samples: list[ToySample]) -> list[float]:
        return [even_reward(s) for s in samples]

    config = LoopConfig(
        num_rollout=args.steps,
        rollout_batch_size=args.prompts,
        n_samples_per_prompt=args.n,
        global_batch_size=args.prompts * args.n,
        seed=0,
    )
    return GRPOLoop(config, trainer, prompts, generate, reward, weight_sync=sync, pad_id=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole smoke run; returns the report (raises on any failure)."""
    kind = detect_device()
    start = time.perf_counter()
    python = ensure_engine_env(ENGINE_DEVICE[kind])
    with tempfile.TemporaryDirectory(prefix="turnrl-smoke-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", TinyModelConfig(seed=0))
        trainer = TorchEngine(
            TorchEngineConfig(model_path=str(model), seed=0, optimizer=OptimizerConfig(lr=args.lr))
        )
        port = free_port()
        sync, sync_kind = make_sync(kind, f"http://127.0.0.1:{port}", root / "sync")
        spec = engine_spec(kind, model, python, sync_kind, port)
        with EngineServer(spec, log_dir=root / "logs") as server:
            ready = time.perf_counter()
            loop = build_loop(trainer, server.url, sync, args)
            rows = asyncio.run(run_steps(loop, args.steps))
            if isinstance(sync, CollectiveWeightSync):
                asyncio.run(sync.close())
    report = {
        "device": kind.value,
        "trainer_device": str(trainer.device),
        "sync": sync_kind,
        "setup_s": ready - start,
        "steps": rows,
        "total_s": time.perf_counter() - start,
    }
    bad = [k for row in rows for k, v in row.items() if not math.isfinite(v)]
    if len(rows) != args.steps or bad:
        raise RuntimeError(f"smoke run incomplete or non-finite metrics: {bad}")
    return report


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print the JSON report; 0 on success, 1 on failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (default 3)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--response-len", type=int, default=8, help="tokens per response")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    parser.add_argument(
        "--candidates",
        type=int,
        default=8,
        help="sample among token ids 100..100+N-1 (0: the whole vocabulary)",
    )
    args = parser.parse_args(argv)
    for flag in ("steps", "prompts", "n", "response_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.candidates < 0 or args.candidates == 1:
        parser.error("--candidates must be 0 (whole vocabulary) or >= 2")
    try:
        report = run(args)
    except Exception as exc:  # reported as JSON, non-zero exit
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"ok": True, **report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
