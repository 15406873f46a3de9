"""Wall time of K GRPO steps: synchronous loop (baseline) vs asynchronous loop, on CPU.

Prints one JSON object. Both loops train the same tiny Qwen3 model with the real torch
engine on a toy task (sample 16 tokens among eight candidates, even ones earn reward);
generation is a stand-in engine whose every group takes ``--delay`` seconds
(``asyncio.sleep``), so rollout time is known and training time is real. Two rollout
profiles: ``uniform`` (every group takes the delay) and ``long_tail`` (one group in
eight takes ``--tail`` times the delay, the others the delay). The synchronous loop
generates a step's groups concurrently and waits for all of them; the asynchronous loop
(``max_off_policy_steps`` = ``--off``) overlaps them with training and fills each step
with the first groups to finish. The stand-in engine serves ``--slots`` groups at once
(default 4, one step's worth), so the asynchronous loop gains from overlapping training
and from not waiting for long tails, not from extra engine capacity. Each run is repeated (interleaved); the JSON has the
best run of each loop (least disturbed by other load) and the ratio of medians.

    uv run --package turnrl-grpo-core python benchmarks/async_loop.py [--steps 6] [--delay 0.25] [--slots 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.loop import AsyncGRPOLoop, GRPOLoop, LoopConfig
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig

RESPONSE_LEN = 16


@dataclass
class BenchSample:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    group_id: str | None
    reward: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)


class SleepEngine:
    """Each group takes a fixed delay (times ``tail`` for every eighth group when set),
    at most ``slots`` groups at a time (an engine's concurrency)."""

    def __init__(self, delay: float, tail: float, slots: int) -> None:
        self.delay, self.tail, self.calls = delay, tail, 0
        self.slots = asyncio.Semaphore(slots)
        self.rng = random.Random(0)

    async def _group(self, prompt: list[int], n: int) -> list[BenchSample]:
        self.calls += 1
        slow = self.tail > 1 and self.calls % 8 == 0
        async with self.slots:
            await asyncio.sleep(self.delay * (self.tail if slow else 1.0))
        out = []
        for _ in range(n):
            ids = [100 + self.rng.randrange(8) for _ in range(RESPONSE_LEN)]
            lp = [math.log(1 / 8)] * RESPONSE_LEN
            out.append(BenchSample(prompt, ids, [1] * RESPONSE_LEN, lp, str(prompt)))
        return out

    async def generate(self, prompts: list[list[int]], n: int) -> list[BenchSample]:
        groups = await asyncio.gather(*(self._group(p, n) for p in prompts))
        return [s for g in groups for s in g]


async def reward(samples: list[BenchSample]) -> list[float]:
    return [sum(t % 2 == 0 for t in s.response_ids) / RESPONSE_LEN for s in samples]


async def timed_run(
    loop_cls: type[GRPOLoop], folder: Path, args: argparse.Namespace, tail: float
) -> dict[str, float]:
    config = LoopConfig(
        num_rollout=args.steps,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        global_batch_size=8,
        max_off_policy_steps=args.off,
        seed=0,
    )
    trainer = TorchEngine(
        TorchEngineConfig(
            model_path=str(folder),
            optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
            loss=ActorLossConfig(use_tis=True),
            micro_batch_size=8,
            seed=0,
        )
    )
    engine = SleepEngine(args.delay, tail, args.slots)
    prompts = [[1 + i, 40 + i, 90 + i] for i in range(16)]
    loop = loop_cls(config, trainer, prompts, engine.generate, reward, weight_sync=None, pad_id=0)
    start = time.perf_counter()
    history = await loop.run()
    wall = time.perf_counter() - start
    return {
        "wall_s": round(wall, 3),
        "train_s_mean": round(sum(m["perf/train_s"] for m in history) / len(history), 3),
        "reward_mean": round(sum(m["rollout/reward_mean"] for m in history) / len(history), 3),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per run (K)")
    parser.add_argument("--delay", type=float, default=0.25, help="seconds per rollout group")
    parser.add_argument("--tail", type=float, default=4.0, help="long-tail group delay factor")
    parser.add_argument("--off", type=int, default=1, help="max_off_policy_steps (async)")
    parser.add_argument(
        "--slots", type=int, default=4, help="groups the engine serves at once (4 = one step)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per loop; best and median")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "tiny", TinyModelConfig(seed=0))
        warm = argparse.Namespace(**{**vars(args), "steps": 2})
        for loop_cls in (GRPOLoop, AsyncGRPOLoop):  # first-use costs out of the timings
            await timed_run(loop_cls, folder, warm, 1.0)
        result: dict[str, Any] = {"args": vars(args)}
        for name, tail in (("uniform", 1.0), ("long_tail", args.tail)):
            runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
            for _ in range(args.repeat):  # interleaved, so load changes hit both alike
                runs["sync"].append(await timed_run(GRPOLoop, folder, args, tail))
                runs["async"].append(await timed_run(AsyncGRPOLoop, folder, args, tail))
            best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
            result[name] = {
                **best,
                "wall_s_all": {k: [r["wall_s"] for r in v] for k, v in runs.items()},
                "speedup_best": round(best["sync"]["wall_s"] / best["async"]["wall_s"], 2),
                "speedup_median": round(
                    statistics.median(r["wall_s"] for r in runs["sync"])
                    / statistics.median(r["wall_s"] for r in runs["async"]),
                    2,
                ),
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
