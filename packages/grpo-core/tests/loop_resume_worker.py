"""Run the seeded toy GRPO loop as its own process (for the kill-and-resume test).

Writes one JSON line per finished step to ``--records``: the step's prompts, a digest of
its samples (prompt and response ids, rollout log-probs, rewards), its loss, grad norm,
reward mean and a digest of the trained weights after it. With ``--checkpoint-dir`` it
checkpoints every step; with ``--resume`` it first continues from the latest complete
checkpoint there (and records ``{"resumed_from": step}``); with ``--wait-for FILE`` it
builds everything, then waits for FILE before it resumes and runs.

    python loop_resume_worker.py --model M --steps 5 --records r.jsonl \
        [--checkpoint-dir D] [--resume] [--wait-for FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from turnrl.grpo_core.loop import latest_checkpoint
from turnrl.grpo_core.testing.golden import (
    ToyRunConfig,
    ToySample,
    build_toy_loop,
    deterministic_torch,
)


def weights_digest(trainer: Any) -> str:
    """sha256 over every parameter's bytes, in module order."""
    digest = hashlib.sha256()
    for name, param in trainer.module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def samples_digest(samples: list[ToySample]) -> str:
    """sha256 of what the loop trains on."""
    rows = [[s.prompt_ids, s.response_ids, s.rollout_logprobs, s.reward] for s in samples]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


async def run_worker(
    model: Path,
    steps: int,
    records: Path,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    wait_for: Path | None = None,
) -> int:
    """Run (or resume) the toy loop to ``steps``, writing one record per step; exit code."""
    out = records.open("a")
    pending: dict[int, list[ToySample]] = {}

    def write(record: dict[str, Any]) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    def on_samples(step: int, samples: list[ToySample]) -> None:
        pending[step + 1] = samples  # generated during step `step + 1`

    def on_metrics(step: int, metrics: dict[str, float]) -> None:
        samples = pending.pop(step)
        prompts = list(dict.fromkeys(tuple(s.prompt_ids) for s in samples))
        write(
            {
                "step": step,
                "prompts": [list(p) for p in prompts],
                "samples": samples_digest(samples),
                "loss": metrics["train/loss"],
                "grad_norm": metrics["train/grad_norm"],
                "reward_mean": metrics["rollout/reward_mean"],
                "weights": weights_digest(loop.trainer),
            }
        )

    with deterministic_torch(), out:
        loop = build_toy_loop(
            model,
            ToyRunConfig(steps=steps),
            checkpoint_dir=checkpoint_dir,
            save_interval=1 if checkpoint_dir else 0,
            on_metrics=on_metrics,
            on_samples=on_samples,
        )
        if wait_for is not None:  # started early so imports overlap the other run
            deadline = time.monotonic() + 600
            while not wait_for.exists():
                if time.monotonic() > deadline:
                    print(f"{wait_for} did not appear", file=sys.stderr)
                    return 3
                await asyncio.sleep(0.05)
        if resume:
            folder = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
            if folder is None:
                print(f"nothing to resume under {checkpoint_dir}", file=sys.stderr)
                return 2
            write({"resumed_from": await loop.resume(folder)})
        await loop.run()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--records", type=Path, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--wait-for", type=Path, default=None, help="start once this exists")
    args = parser.parse_args()
    return asyncio.run(
        run_worker(
            args.model, args.steps, args.records, args.checkpoint_dir, args.resume, args.wait_for
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
