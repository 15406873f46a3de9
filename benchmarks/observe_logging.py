"""Cost of run logging per GRPO step, and of drawing the curves afterwards; prints JSON.

A step of the tau-bench job reports ~40 scalars (rollout/, train/, perf/, perf/sync_*)
and takes ~42 s (200 steps in 2 h 21 min), so logging must stay far below a second. Three
StepLogger settings log the same 200 seeded steps into fresh folders:

* baseline: ``metrics.jsonl`` only (no console, no TensorBoard);
* ``+tensorboard``: jsonl + TensorBoard scalars (flushed every step);
* ``+tensorboard+samples``: the same plus 16 sample trajectories of ~6 kB as text per step.

Then ``load_scalars`` (from jsonl, and from the event files alone) and ``render_curves``.

    uv run --package turnrl-grpo-core --group test python benchmarks/observe_logging.py
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from turnrl.grpo_core.observe.logger import StepLogger
from turnrl.grpo_core.observe.report import load_scalars, render_curves

NUM_STEPS = 200
NUM_METRICS = 40
GROUPS = ("rollout", "train", "perf", "val-core")


def step_metrics(rng: random.Random) -> dict[str, float]:
    """NUM_METRICS seeded scalars spread over the loop's metric groups."""
    return {f"{GROUPS[i % 4]}/metric_{i}": rng.gauss(0.0, 1.0) for i in range(NUM_METRICS)}


def log_run(folder: Path, tensorboard: bool, samples: bool) -> float:
    """Log NUM_STEPS steps; returns the median milliseconds per step."""
    rng = random.Random(0)
    texts = ["".join(rng.choices("abcdefgh \n", k=6000)) for _ in range(16)]
    times = []
    with StepLogger(folder, console=False, tensorboard=tensorboard) as logger:
        for step in range(1, NUM_STEPS + 1):
            metrics = step_metrics(rng)
            start = time.perf_counter()
            logger(step, metrics)
            if samples:
                logger.log_samples(step, texts)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def timed(fn: object, *args: object) -> float:
    start = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = log_run(root / "base", tensorboard=False, samples=False)
        tb = log_run(root / "tb", tensorboard=True, samples=False)
        tb_samples = log_run(root / "tbs", tensorboard=True, samples=True)
        load_jsonl_s = timed(load_scalars, root / "tb")
        (root / "tb" / "metrics.jsonl").unlink()
        load_events_s = timed(load_scalars, root / "tb")
        render_s = timed(render_curves, root / "tbs")
    result = {
        "steps": NUM_STEPS,
        "metrics_per_step": NUM_METRICS,
        "ms_per_step": {
            "jsonl_only (baseline)": round(base, 3),
            "+tensorboard": round(tb, 3),
            "+tensorboard+samples": round(tb_samples, 3),
        },
        "ratio_vs_baseline": {
            "+tensorboard": round(tb / base, 2),
            "+tensorboard+samples": round(tb_samples / base, 2),
        },
        "share_of_a_42s_step": round(tb_samples / 1000 / 42.0, 6),
        "load_scalars_s": {"jsonl": round(load_jsonl_s, 3), "events": round(load_events_s, 3)},
        "render_curves_s (4 PNGs, 10 panels each)": round(render_s, 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
