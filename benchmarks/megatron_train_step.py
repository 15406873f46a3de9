"""Megatron vs torch train engine: GRPO step time and peak memory on one model; prints JSON.

Both engines train the same Hugging Face folder (a tiny Qwen3 built here, by default
4 layers, hidden 256, vocab 8192) on the same GRPO mini-batches (clipped ratios, entropy
bonus) in one process, fp32 on the CPU (or the device ``turnrl.npu_runtime`` finds). The
torch backend is the baseline measured in the same run: each engine runs in its own
process (so one's memory cannot hide the other's); reported are each engine's median step
time over ``--steps`` after ``--warmup`` steps, the ratio megatron / torch, and the peak
memory of building and training the engine (peak RSS growth over the process before the
engine on the CPU, the allocator's peak on a device), plus the first step's loss of each
(they must agree).

    UV_PROJECT_ENVIRONMENT=/tmp/megatron-env uv sync --locked --no-default-groups \
        --package turnrl-grpo-core --extra megatron --group test
    /tmp/megatron-env/bin/python benchmarks/megatron_train_step.py [--layers 4 --hidden 256]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from turnrl.grpo_core.algos import ActorLossConfig
from turnrl.grpo_core.backends import make_engine
from turnrl.grpo_core.megatron.engine import MegatronEngineConfig
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngineConfig


def batches(count: int, rows: int, length: int, vocab: int) -> list[TrainBatch]:
    """GRPO mini-batches: right-padded rows, the last 2/3 of each the response."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (rows, length), generator=g)
        attn = torch.ones_like(ids)
        for row in range(1, rows):
            attn[row, length - 4 * row :] = 0
        mask = torch.zeros_like(ids)
        mask[:, length // 3 :] = 1
        mask *= attn
        old = -5.0 + 0.3 * torch.randn(ids.shape, generator=g)
        out.append(
            TrainBatch(
                ids,
                attn,
                mask,
                advantages=torch.linspace(1.0, -1.0, rows),
                old_logprobs=old * mask,
            )
        )
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(config: TorchEngineConfig, work: list[TrainBatch], warmup: int) -> dict[str, Any]:
    gc.collect()
    before = peak_rss_mb()
    engine = make_engine(config)
    device = engine.device
    if device.type != "cpu":
        torch.get_device_module(device.type).reset_peak_memory_stats()
    times, losses = [], []
    try:
        for i, batch in enumerate(work):
            start = time.perf_counter()
            losses.append(engine.train_step(batch)["loss"])
            if device.type != "cpu":
                torch.get_device_module(device.type).synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        if device.type != "cpu":
            peak = torch.get_device_module(device.type).max_memory_allocated() / 2**20
        else:
            peak = peak_rss_mb() - before
    finally:
        close = getattr(engine, "close", None)
        if close is not None and type(engine).__name__ == "MegatronEngine":
            close()
        del engine
    return {"median_step_s": statistics.median(times), "peak_mb": peak, "first_loss": losses[0]}


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model folder and measure one engine (``args.only``) in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            Path(tmp) / "model",
            TinyModelConfig(
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers,
            ),
        )
        settings: dict[str, Any] = {
            "model_path": str(model),
            "optimizer": OptimizerConfig(lr=1e-5),
            "loss": ActorLossConfig(eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01),
            "micro_batch_size": args.rows // 2,
        }
        config = MegatronEngineConfig if args.only == "megatron" else TorchEngineConfig
        work = batches(args.warmup + args.steps, args.rows, args.length, args.vocab)
        return measure(config(**settings), work, args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--only", choices=("torch", "megatron"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        print(json.dumps(run_one(args)))
        return
    results = {}
    for engine in ("torch", "megatron"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--only", engine],
            check=True,
            capture_output=True,
            text=True,
        )
        results[engine] = json.loads(out.stdout.strip().splitlines()[-1])
    torch_r, mega = results["torch"], results["megatron"]
    result = {
        "model": f"Qwen3, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}",
        "batch": f"{args.rows} rows x {args.length} tokens, 2 micro-batches",
        "threads": torch.get_num_threads(),
        "torch_median_step_s": round(torch_r["median_step_s"], 4),
        "megatron_median_step_s": round(mega["median_step_s"], 4),
        "megatron_vs_torch_step_time": round(mega["median_step_s"] / torch_r["median_step_s"], 3),
        "torch_peak_mb": round(torch_r["peak_mb"], 1),
        "megatron_peak_mb": round(mega["peak_mb"], 1),
        "megatron_vs_torch_peak_memory": round(mega["peak_mb"] / torch_r["peak_mb"], 3),
        "first_loss_rel_diff": abs(mega["first_loss"] - torch_r["first_loss"])
        / max(abs(torch_r["first_loss"]), 1e-12),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
