"""The run driver both apps' main.py compose (turnrl.grpo_core.recipe.driver): the run
folder and its resume, the engine fleet's stop at exit, the RL stage over a loop, the exit
codes of ``main``. Real engines and Ray are the apps' smoke runs (engine-cpu session)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from turnrl.grpo_core.recipe import driver
from turnrl.grpo_core.recipe.driver import RLStage, open_run, run_main


@dataclasses.dataclass
class AppConfig:
    run_dir: str | None = None
    logger: list[str] = dataclasses.field(default_factory=list)
    lr: float = 0.1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def quiet() -> Console:
    return Console(record=True, width=200)


def test_a_fresh_run_claims_its_folder_and_writes_the_config(tmp_path: Path) -> None:
    given = AppConfig(run_dir=f"{tmp_path}/run/")
    with open_run("demo", given, resume=False, console=quiet()) as run:
        assert run.folder == tmp_path / "run" and run.progress == {}
        assert run.config.run_dir == str(tmp_path / "run") and given.run_dir.endswith("/")
        run.logger(1, {"loss": 0.5})
        with run.phases("data"):
            pass
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved == {"run_dir": str(tmp_path / "run"), "logger": [], "lr": 0.1}
    assert set(run.phases.seconds) == {"data"} and run.seconds() > 0
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]  # the logger was closed at exit
    again = AppConfig(run_dir=str(tmp_path / "run"))
    with (
        pytest.raises(ValueError, match="already holds a run"),
        open_run(  # nothing written over
            "demo", again, resume=False, console=quiet()
        ),
    ):
        pass


def test_a_resumed_run_reuses_the_phases_it_finished(tmp_path: Path) -> None:
    calls: list[str] = []

    async def evaluate() -> dict[str, float]:
        calls.append("evaluate")
        return {"acc": 0.25}

    config = AppConfig(run_dir=str(tmp_path))
    with open_run("demo", config, resume=False, console=quiet()) as run:
        assert asyncio.run(run.once("before", "evaluation before RL", evaluate)) == {"acc": 0.25}
        run.remember("sft", {"steps": 3})
    console = quiet()
    with open_run("demo", config, resume=True, console=console) as run:
        assert run.progress == {"before": {"acc": 0.25}, "sft": {"steps": 3}}
        assert asyncio.run(run.once("before", "evaluation before RL", evaluate)) == {"acc": 0.25}
    assert calls == ["evaluate"]  # computed once, read back on resume
    assert "evaluation before RL: from progress.json (resumed run)" in console.export_text()
    with open_run(
        "demo", AppConfig(run_dir=str(tmp_path / "new")), resume=True, console=quiet()
    ) as run:
        assert run.progress == {}  # --resume of a folder that finished nothing


def test_finish_writes_the_summary_after_flushing_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with open_run("demo", AppConfig(run_dir=str(tmp_path)), resume=False, console=quiet()) as run:
        for step in (1, 2):
            run.logger(step, {"rollout/reward_mean": 0.1 * step})
        curves = run.finish({"steps": 2, "path": tmp_path})
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "path": str(tmp_path),
        "steps": 2,
        "curves": [str(p) for p in curves],  # written once, after the curves were drawn
    }
    assert curves and all(p.read_bytes()[:4] == b"\x89PNG" for p in curves)


def test_torch_threads_are_set_only_when_asked(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        with open_run(
            "demo", AppConfig(run_dir=str(tmp_path / "a")), resume=False, console=quiet()
        ):
            assert torch.get_num_threads() == before
        with open_run(
            "demo",
            AppConfig(run_dir=str(tmp_path / "b")),
            resume=False,
            console=quiet(),
            torch_threads=1,
        ):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


class FakeLoop:
    """What RLStage uses of a GRPOLoop: resume_latest, step, run, history, ensure_checkpoint."""

    def __init__(self, on_metrics: Any, done: int = 0, fail_at: int = 0) -> None:
        self.on_metrics, self.done, self.fail_at = on_metrics, done, fail_at
        self.step, self.history, self.checkpoints = 0, [], []

    async def resume_latest(self) -> Path | None:
        if not self.done:
            return None
        self.step, self.history = self.done, [{"rollout/reward_mean": 0.0}] * self.done
        return Path(f"checkpoints/step_{self.done}")

    async def run_step(self) -> None:
        if self.step + 1 == self.fail_at:
            raise RuntimeError("engine died")
        self.step += 1
        metrics = {"rollout/reward_mean": float(self.step)}
        self.history.append(metrics)
        self.on_metrics(self.step, metrics)

    async def run(self, num_steps: int) -> list[dict[str, float]]:
        for _ in range(num_steps):
            await self.run_step()
        return self.history

    def ensure_checkpoint(self) -> Path:
        self.checkpoints.append(self.step)
        return Path(f"checkpoints/step_{self.step}")


def test_the_rl_stage_runs_the_steps_a_resumed_folder_has_left() -> None:
    seen: list[int] = []
    console = quiet()
    stage = RLStage(console, 5, lambda step, metrics: seen.append(step))
    loop = FakeLoop(stage.on_metrics, done=2)
    history = asyncio.run(stage.run(loop))  # type: ignore[arg-type]
    assert seen == [3, 4, 5] and len(history) == 5 and loop.checkpoints == [5]
    assert "resumed GRPO from checkpoints/step_2 (2/5 steps done)" in console.export_text()
    stage.on_metrics(6, {})  # after the stage, the hook still reaches the caller (no bar)
    assert seen[-1] == 6


def test_a_failed_rl_stage_writes_no_extra_checkpoint() -> None:
    stage = RLStage(quiet(), 3)
    loop = FakeLoop(stage.on_metrics, fail_at=2)
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(stage.run(loop))  # type: ignore[arg-type]
    assert loop.step == 1 and loop.checkpoints == []  # the loop's own interval decides


def test_main_exit_codes_and_hints(capsys: pytest.CaptureFixture[str]) -> None:
    defaults: list[str] = []

    def nothing(default: str) -> None:
        defaults.append(default)
        return None

    assert run_main("demo", nothing) == 0
    assert defaults[0].startswith("runs/demo-")

    def bad_input(default: str) -> Any:
        raise ValueError("--lr must be > 0")

    assert run_main("demo", bad_input) == 2
    assert "error: --lr must be > 0" in capsys.readouterr().err

    async def interrupted_run() -> None:
        raise KeyboardInterrupt

    assert run_main("demo", lambda default: ("runs/x", interrupted_run())) == 130
    assert "continue with: uv run apps/demo --resume --run-dir runs/x" in capsys.readouterr().err

    finished: list[bool] = []

    async def finishing() -> None:
        finished.append(True)

    assert run_main("demo", lambda default: (default, finishing())) == 0 and finished == [True]


@pytest.fixture
def chained_sigint() -> Iterator[None]:
    """A SIGINT handler of the app's own that ends in Python's default one, as the
    supervisor's child-stopping handler does (asyncio then leaves SIGINT alone)."""
    previous = signal.signal(signal.SIGINT, lambda s, f: signal.default_int_handler(s, f))
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("chained_sigint")
def test_ctrl_c_cancels_the_run_so_every_exit_runs_in_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A real SIGINT to this process while tasks of the run are busy (twice at once, as a
    terminal's Ctrl-C and a wrapper passing it on deliver it): the run is cancelled where it
    waits, its ``finally`` blocks run inside the run (nested ones innermost first, then a
    busy side task's), and main says how to resume (130)."""

    exits: list[str] = []

    async def busy() -> None:
        try:
            while True:
                sum(range(20_000))  # the main thread busy in a task, as a rollout is
                await asyncio.sleep(0)
        finally:
            exits.append("side task")

    async def run() -> None:
        side = asyncio.create_task(busy())
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, os.kill, os.getpid(), signal.SIGINT)
        loop.call_later(0.21, os.kill, os.getpid(), signal.SIGINT)  # the same Ctrl-C, forwarded
        try:
            try:
                await asyncio.sleep(30)
            finally:
                exits.append("engines")
        finally:
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
            exits.append("ray")

    handler = signal.getsignal(signal.SIGINT)
    started = time.monotonic()
    assert run_main("demo", lambda default: ("runs/y", run())) == 130
    assert time.monotonic() - started < 10
    assert exits == ["engines", "side task", "ray"]
    err = capsys.readouterr().err
    assert err.count("Ctrl-C: stopping the run (Ctrl-C again to stop at once)") == 1, err
    assert "--resume --run-dir runs/y" in err
    assert signal.getsignal(signal.SIGINT) is handler  # put back after the run


@pytest.mark.usefixtures("chained_sigint")
def test_ctrl_c_stops_a_run_busy_in_its_own_code_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGINT while the run's own task computes without awaiting (as SFT does): it stops
    there, not when the computation ends, and its exits run (130)."""

    exits: list[str] = []

    async def run() -> None:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                sum(range(1000))
            exits.append("computed")
        finally:
            exits.append("engines")

    started = time.monotonic()
    assert run_main("demo", lambda default: ("runs/b", run())) == 130
    assert time.monotonic() - started < 10 and exits == ["engines"]
    assert "--resume --run-dir runs/b" in capsys.readouterr().err


@pytest.mark.usefixtures("chained_sigint")
def test_a_second_ctrl_c_stops_a_run_that_does_not_end_on_the_first(
    capsys: pytest.CaptureFixture[str],
) -> None:

    async def stubborn() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            loop.call_later(1.5, os.kill, os.getpid(), signal.SIGINT)
            await asyncio.sleep(30)  # an exit that hangs

    started = time.monotonic()
    assert run_main("demo", lambda default: ("runs/z", stubborn())) == 130
    assert time.monotonic() - started < 10
    assert "--resume --run-dir runs/z" in capsys.readouterr().err


@pytest.mark.usefixtures("chained_sigint")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_python_swallows_still_stops_a_loop_that_checks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGINT handled while a ``__del__`` runs: Python drops the KeyboardInterrupt the
    handler raises there (it only prints "Exception ignored in"), so the run's own loop
    would compute on; one that calls ``raise_if_stop_requested`` between steps (as SFT's
    does) stops at its next step (130)."""
    from turnrl.npu_runtime.supervise import raise_if_stop_requested

    class Dropped:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, inside __del__

    steps: list[int] = []

    async def run() -> None:
        deadline = time.monotonic() + 30
        Dropped()  # freed at once
        while time.monotonic() < deadline:
            raise_if_stop_requested()
            steps.append(1)

    started = time.monotonic()
    assert run_main("demo", lambda default: ("runs/d", run())) == 130
    assert time.monotonic() - started < 10, len(steps)
    assert "--resume --run-dir runs/d" in capsys.readouterr().err


def test_sigusr1_prints_every_threads_stack_and_the_run_goes_on(tmp_path: Path) -> None:
    """``kill -USR1`` of a run (e.g. one that seems stuck) prints where each thread is, on
    stderr, and the run then ends as it would have (exit 0)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import asyncio, sys
        from turnrl.grpo_core.recipe.driver import run_main

        async def waiting_here():
            print("ready", flush=True)
            await asyncio.sleep(2)

        sys.exit(run_main("demo", lambda default: (default, waiting_here())))
        """
    )
    run = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert run.stdout is not None and run.stdout.readline().strip() == "ready"
    os.kill(run.pid, signal.SIGUSR1)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    assert "most recent call first" in err and "asyncio" in err, err


def test_the_driver_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, turnrl.grpo_core.recipe.driver as d; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(d.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert driver.__name__ in out.stdout
