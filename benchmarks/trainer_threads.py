"""Trainer step time on a small CPU machine, quiet and beside one busy process, by torch
threads and OpenMP wait policy (issue #18, "two cores shared well").

Each configuration runs in a fresh process, since the OpenMP runtime reads
``OMP_WAIT_POLICY`` once, when torch loads it: the tau CPU default's model (tiny Qwen3,
hidden 128, 2 layers, vocabulary 2,048), AdamW steps on a 4 x 1,400-token batch (the shape of
its SFT batches), the median of 10 steps after 2 warm-up steps. The busy process is a Python
loop this script starts and stops. Every ratio is against the baseline of the same run: all
cores, OpenMP's default wait policy, quiet machine.

    uv run --package turnrl-grpo-core python benchmarks/trainer_threads.py \\
        --out docs/benchmarks/trainer_threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = [("all cores", 0, None), ("all cores, passive", 0, "passive"), ("1 thread", 1, None)]


def worker(model: Path, threads: int) -> float:
    """Median seconds of one AdamW step (run in a fresh process per configuration)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    policy = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    ids = torch.randint(0, 2048, (4, 1400), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(12):
        start = time.perf_counter()
        policy(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def measure(model: Path, threads: int, wait_policy: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    cmd = [sys.executable, __file__, "--worker", str(model), str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="rounds over every configuration")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(worker(Path(args.worker[0]), int(args.worker[1])))
        return
    from turnrl.grpo_core.recipe.model import starting_model

    # The tau CPU default's model, built as the app builds it (ModelConfig's tiny sizes).
    model = starting_model(None, Path(tempfile.mkdtemp()) / "tiny", hidden_size=128, num_layers=2)
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for name, threads, policy in CONFIGS:
                    key = f"{name}, {'busy' if busy else 'quiet'}"
                    runs.setdefault(key, []).append(measure(model, threads, policy))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    base = statistics.median(runs["all cores, quiet"])
    result = {
        "cores": os.cpu_count(),
        "step_s": {k: statistics.median(v) for k, v in runs.items()},
        "vs_all_cores_quiet": {k: statistics.median(v) / base for k, v in runs.items()},
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
