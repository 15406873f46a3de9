"""GRPO step time of apps/tau: the asynchronous loop against the synchronous one, in one run
(JSON out).

Both on the one runner (a local Ray, the trainer rank and the engine as Ray actors), from the
same starting weights (``--hf-checkpoint``, SFT off): the synchronous loop, then ``--async``
(AsyncGRPOLoop, staleness 1: the next step's rollouts overlap this step's training and
sync). Step times of the two loops are measured differently (the async step excludes the
rollout time it hid), so the figure to compare is the RL phase's wall time per step
(``phase rl`` / steps), reported as ``ratio ... rl seconds per step``. (Its earlier
``--compare runner`` mode measured the local runner, since removed: docs/benchmarks/ray_runner.md.)

Usage (an SFT model from any tau run, e.g. ``runs/tau-.../model/sft``)::

    python benchmarks/ray_runner.py --hf-checkpoint RUN/model/sft [--num-rollout 8] \\
        [--out docs/benchmarks/ray_runner.json] [-- more app flags]

Needs the engine environment (``python -m turnrl.rollout_router.engine_env --device cpu``).
Run it on a quiet machine: rollouts dominate a step and share the cores with everything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

APP = Path(__file__).resolve().parents[1] / "apps" / "tau"
PARTS = ("perf/step_s", "perf/rollout_s", "perf/train_s", "perf/sync_s")
STARTUP = ("engine start (rest)", "trainers start", "rl")
VARIANTS = {"async": {"sync": [], "async": ["--async"]}}
"""``--compare`` -> (baseline, variant) names and their app flags."""


def run_app(variant: list[str], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One app run; its summary.json, with the wall time of the whole process."""
    cmd = [
        sys.executable,
        str(APP),
        *variant,
        "--run-dir",
        str(run_dir),
        "--hf-checkpoint",
        args.hf_checkpoint,
        "--sft-steps",
        "0",
        "--num-rollout",
        str(args.num_rollout),
        "--seed",
        str(args.seed),
        *args.app_flags,
    ]
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if proc.returncode:
        sys.exit(
            f"{' '.join(variant)} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    summary["process_seconds"] = wall
    return summary


def step_figures(summary: dict[str, Any]) -> dict[str, float]:
    """Means over the steps after the first, and the start-up phases (seconds)."""
    steps = summary["train_history"][1:]
    out = {f"mean {key}": statistics.fmean(s[key] for s in steps) for key in PARTS}
    out["steps averaged"] = len(steps)
    for phase in STARTUP:
        out[f"phase {phase}"] = summary["phases_s"].get(phase, 0.0)
    out["process seconds"] = summary["process_seconds"]
    out["rl seconds per step"] = out["phase rl"] / len(summary["train_history"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-checkpoint", required=True, help="starting weights of both runs")
    parser.add_argument("--num-rollout", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--compare", choices=sorted(VARIANTS), default="async")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("app_flags", nargs="*", help="more flags for both runs (after --)")
    args = parser.parse_args()
    if args.num_rollout < 2:
        sys.exit("--num-rollout must be >= 2 (the first step is warm-up)")
    results: dict[str, Any] = {"num_rollout": args.num_rollout, "app_flags": args.app_flags}
    (base, variant) = VARIANTS[args.compare]
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in VARIANTS[args.compare].items():
            results[name] = step_figures(run_app(flags, args, Path(tmp) / name))
    for key in ("mean perf/step_s", "rl seconds per step"):
        results[f"ratio {variant}/{base} {key}"] = results[variant][key] / results[base][key]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
