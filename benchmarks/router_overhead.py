"""Router overhead: direct vs in-process router vs HTTP router vs sglang-router (JSON out).

Fake engines (``turnrl.rollout_router.testing``, answering instantly) run in their own
processes on loopback. Measured side by side in one run, at concurrency 1, 16 and 64:

- ``direct_client``: :class:`EngineClient` straight to one engine (token-in/out, streamed);
- ``inproc_router``: :class:`Router` over two engines (same client underneath, no hop);
- ``direct_http``: plain HTTP ``POST /v1/completions`` straight to an engine;
- ``turnrl_http``: the same through ``turnrl-router serve`` (own process);
- ``sglang_http``: the same through ``sglang-router`` when ``--sglang-python`` names an
  interpreter that has it (e.g. a throwaway venv with ``sglang-router==0.3.2``);
- ``inproc_router_bookkeeping``: CPU per request of the router's own work alone (engine
  choice, caps, circuit, metrics) with a no-op request, free of HTTP and scheduling noise.

For each: requests/s, p50/p99 latency, the added p50/p99 over its direct baseline, and CPU
seconds per request (router process for the HTTP routers, this process's extra over the
direct client for the in-process router). Then a failover run per router: 16 concurrent
workers, one engine SIGKILLed after 1 s; failed requests and how long until the router
stops sending to the dead engine.

Usage: python benchmarks/router_overhead.py [--seconds 3] [--sglang-python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import SamplingParams
from turnrl.rollout_router.router import Router, RouterConfig

ONE = SamplingParams(max_tokens=1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


async def wait_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not come up")
            await asyncio.sleep(0.1)


async def measure(
    fn: Callable[[], Awaitable[object]], concurrency: int, seconds: float
) -> dict[str, float]:
    """Run ``fn`` from ``concurrency`` workers for ``seconds``; latency stats in µs."""
    lat: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            try:
                await fn()
            except Exception:
                errors += 1
                continue
            lat.append(time.perf_counter() - t)

    for _ in range(20):  # warm-up (connections)
        await fn()
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    lat.sort()
    n = max(len(lat), 1)
    return {
        "requests": len(lat),
        "errors": errors,
        "rps": len(lat) / wall,
        "p50_us": lat[n // 2] * 1e6 if lat else 0.0,
        "p99_us": lat[min(n - 1, int(n * 0.99))] * 1e6 if lat else 0.0,
        "client_cpu_us_per_req": cpu / n * 1e6,
    }


def http_post(http: aiohttp.ClientSession, url: str) -> Callable[[], Awaitable[object]]:
    async def call() -> object:
        async with http.post(url, json={"model": "tiny", "prompt": "x", "max_tokens": 1}) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}")
            return await r.read()

    return call


async def overhead(
    args: argparse.Namespace,
    engines: list[str],
    routers: dict[str, tuple[str, int]],
) -> dict[str, object]:
    out: dict[str, object] = {}
    for c in (1, 16, 64):
        row: dict[str, object] = {}
        async with EngineClient(engines[0]) as client:
            row["direct_client"] = await measure(lambda: client.generate([1], ONE), c, args.seconds)
        cfg = RouterConfig(max_concurrency_per_engine=1024, health_interval=0)
        async with Router(engines, cfg) as router:
            row["inproc_router"] = await measure(lambda: router.generate([1], ONE), c, args.seconds)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            row["direct_http"] = await measure(
                http_post(http, engines[0] + "/v1/completions"), c, args.seconds
            )
            for name, (url, pid) in routers.items():
                cpu0 = cpu_seconds(pid)
                m = await measure(http_post(http, url + "/v1/completions"), c, args.seconds)
                m["router_cpu_us_per_req"] = (cpu_seconds(pid) - cpu0) / max(m["requests"], 1) * 1e6
                row[name] = m
        base_c, base_h = row["direct_client"], row["direct_http"]
        inproc = row["inproc_router"]
        assert isinstance(base_c, dict) and isinstance(base_h, dict) and isinstance(inproc, dict)
        inproc["added_p50_us"] = inproc["p50_us"] - base_c["p50_us"]
        inproc["added_p99_us"] = inproc["p99_us"] - base_c["p99_us"]
        inproc["added_cpu_us_per_req"] = (
            inproc["client_cpu_us_per_req"] - base_c["client_cpu_us_per_req"]
        )
        for name in routers:
            via = row[name]
            assert isinstance(via, dict)
            via["added_p50_us"] = via["p50_us"] - base_h["p50_us"]
            via["added_p99_us"] = via["p99_us"] - base_h["p99_us"]
        out[f"concurrency_{c}"] = row
    return out


async def bookkeeping(engines: list[str], n: int = 50_000) -> dict[str, float]:
    """CPU of the router's own work per request (choice, caps, circuit, metrics), no I/O."""

    async def noop(_: object) -> None:
        return None

    out: dict[str, float] = {}
    async with Router(engines, RouterConfig(health_interval=0)) as router:
        for label, session in (("no_session", None), ("sticky_session", "s")):
            cpu0 = time.process_time()
            for _ in range(n):
                await router.call(session, noop)
            out[f"{label}_cpu_us_per_req"] = (time.process_time() - cpu0) / n * 1e6
    return out


async def failover_run(
    send: Callable[[], Awaitable[object]],
    victim: subprocess.Popen[bytes],
    out_of_rotation: Callable[[], Awaitable[bool]],
) -> dict[str, object]:
    """16 workers for 3 s; SIGKILL ``victim`` after 1 s; count failures, time to eviction."""
    ok, failed, errors = 0, 0, set()
    stop_at = time.perf_counter() + 3.0

    async def worker() -> None:
        nonlocal ok, failed
        while time.perf_counter() < stop_at:
            try:
                await send()
                ok += 1
            except Exception as exc:
                failed += 1
                errors.add(type(exc).__name__ + ": " + str(exc)[:120])

    async def killer() -> float | None:
        await asyncio.sleep(1.0)
        killed = time.perf_counter()
        os.killpg(victim.pid, signal.SIGKILL)
        while time.perf_counter() < killed + 10:
            if await out_of_rotation():
                return time.perf_counter() - killed
            await asyncio.sleep(0.02)
        return None

    *_, evicted = await asyncio.gather(*(worker() for _ in range(16)), killer())
    return {"ok": ok, "failed": failed, "evicted_after_s": evicted, "errors": sorted(errors)[:5]}


async def failover(args: argparse.Namespace, py: str) -> dict[str, object]:
    results: dict[str, object] = {}
    kinds = ["inproc_router", "turnrl_http"] + (["sglang_http"] if args.sglang_python else [])
    for kind in kinds:
        ports = [free_port(), free_port()]
        engs = [spawn([py, "-m", "turnrl.rollout_router.testing", "--port", str(p)]) for p in ports]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        router_proc = None
        try:
            for u in urls:
                await wait_up(u + "/health")
            if kind == "inproc_router":
                async with Router(urls, RouterConfig(max_concurrency_per_engine=64)) as router:

                    async def evicted(dead: str = urls[1]) -> bool:
                        return router.engine(dead).circuit != "closed"

                    results[kind] = await failover_run(
                        lambda: router.generate([1], ONE), engs[1], evicted
                    )
                continue
            router_proc, rurl = await start_http_router(kind, args, py, urls)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

                async def evicted_http(
                    kind: str = kind, rurl: str = rurl, dead: str = urls[1]
                ) -> bool:
                    if kind != "turnrl_http":
                        return False  # sglang-router exposes no per-engine circuit state
                    async with http.get(rurl + "/engines") as r:
                        return bool((await r.json())[dead]["circuit"] != "closed")

                results[kind] = await failover_run(
                    http_post(http, rurl + "/v1/completions"), engs[1], evicted_http
                )
        finally:
            for p in [*engs, *([router_proc] if router_proc else [])]:
                stop(p)
    return results


async def start_http_router(
    kind: str, args: argparse.Namespace, py: str, urls: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    if kind == "turnrl_http":
        cmd = [
            py,
            "-m",
            "turnrl.rollout_router.http_router",
            "serve",
            "--port",
            str(port),
            "--max-concurrency-per-engine",
            "1024",
        ]
        for u in urls:
            cmd += ["--engine", u]
    else:
        cmd = [
            args.sglang_python,
            "-m",
            "sglang_router.launch_router",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--log-level",
            "error",
            "--worker-urls",
            *urls,
        ]
    proc = spawn(cmd)
    await wait_up(f"http://127.0.0.1:{port}/health", timeout=60)
    return proc, f"http://127.0.0.1:{port}"


async def run(args: argparse.Namespace) -> dict[str, object]:
    py = sys.executable
    ports = [free_port(), free_port()]
    engines = [spawn([py, "-m", "turnrl.rollout_router.testing", "--port", str(p)]) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen[bytes]] = list(engines)
    try:
        for u in urls:
            await wait_up(u + "/health")
        routers: dict[str, tuple[str, int]] = {}
        kinds = ["turnrl_http"] + (["sglang_http"] if args.sglang_python else [])
        for kind in kinds:
            proc, url = await start_http_router(kind, args, py, urls)
            procs.append(proc)
            routers[kind] = (url, proc.pid)
        result = {
            "overhead": await overhead(args, urls, routers),
            "inproc_router_bookkeeping": await bookkeeping(urls),
        }
    finally:
        for p in procs:
            stop(p)
    result["failover"] = await failover(args, py)
    result["config"] = {
        "seconds_per_point": args.seconds,
        "cpus": os.cpu_count(),
        "sglang_router": bool(args.sglang_python),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement point")
    parser.add_argument(
        "--sglang-python", default=None, help="python of an env with sglang-router installed"
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2, default=float))


if __name__ == "__main__":
    main()
