"""How an app's run is driven, the same in both apps: the run, its RL stage, its command
line (its engines: :mod:`~turnrl.grpo_core.recipe.fleet`).

- :func:`open_run`: the run folder claimed (a fresh one, or the one ``--resume``
  continues), its ``config.json``, what an earlier run of it finished (``progress.json``),
  torch's thread count, the step logger with the ``--logger`` trackers and the phase
  timer, as one :class:`Run`; :meth:`Run.once` reuses a phase an earlier run finished and
  :meth:`Run.finish` leaves ``summary.json`` and the PNG curves.
- :func:`build_rl` and :class:`RLStage`: the RL stage's loop from the config's sections,
  and the stage on it: resumed from the folder's latest checkpoint, a progress bar over the
  steps, every step logged, a checkpoint after the last.
- :func:`run_main`: an app's ``main``: ``error:`` and exit code 2 on bad input, Ctrl-C's
  exit code and ``--resume`` hint.

Example::

    with open_run("retool", config, resume=resume, console=console) as run:
        with engine_fleet(spec, run.folder / "logs", placement) as (urls, job, _):
            before = await run.once("before", "evaluation before RL", evaluate)
            stage = RLStage(console, total, on_metrics)
            loop = build_loop(..., on_metrics=stage.on_metrics)
            await stage.run(loop)
        run.finish(summary)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnrl.grpo_core.recipe.evaluation import Phases, render_run_curves, write_summary
from turnrl.grpo_core.recipe.run_folder import (
    claim_run_dir,
    default_run_dir,
    interrupted,
    load_progress,
    save_progress,
)

if TYPE_CHECKING:
    from turnrl.grpo_core.loop.loop import GRPOLoop
    from turnrl.grpo_core.observe.logger import StepLogger

T = TypeVar("T")


class RunConfig(Protocol):
    """What :func:`open_run` reads of an app's config (a dataclass)."""

    @property
    def run_dir(self) -> str | None:
        """The run folder (None: ``runs/<app>-<timestamp>``)."""

    @property
    def logger(self) -> list[str]:
        """The ``--logger`` trackers (``make_trackers`` names)."""

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready dicts (what ``config.json`` holds)."""


C = TypeVar("C", bound=RunConfig)


@dataclass
class Run(Generic[C]):
    """One run of an app, opened by :func:`open_run`."""

    folder: Path
    """The run folder."""
    config: C
    """The app's config, its ``run_dir`` the folder (as ``config.json`` holds it)."""
    progress: dict[str, Any]
    """Results of the phases an earlier run of the folder finished (``{}`` on a fresh run)."""
    logger: StepLogger
    """``metrics.jsonl``, TensorBoard and the trackers."""
    phases: Phases
    """Seconds per phase, announced on the console."""
    console: Console
    """Where the run's lines go."""
    started: float = dataclasses.field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when the run was opened."""
    resumed: bool = False
    """Whether the run continues an earlier one of its folder (``--resume``)."""

    def seconds(self) -> float:
        """Wall-clock seconds since the run was opened."""
        return time.perf_counter() - self.started

    def remember(self, key: str, value: Any) -> None:
        """Keep ``value`` (JSON) as phase ``key``'s result in ``progress.json``."""
        self.progress[key] = value
        save_progress(self.folder, self.progress)

    async def once(self, key: str, what: str, compute: Callable[[], Awaitable[T]]) -> T:
        """Phase ``key``'s result: read from ``progress.json`` when an earlier run of the
        folder finished it (saying so, ``what`` naming the phase), else ``await compute()``,
        remembered for a later resume."""
        if key in self.progress:
            self.console.print(f"{what}: from progress.json (resumed run)")
            value: T = self.progress[key]
            return value
        value = await compute()
        self.remember(key, value)
        return value

    def finish(self, summary: dict[str, Any]) -> list[Path]:
        """Close the logger, draw the run's PNG curves (a warning and none when they cannot
        be drawn) and write ``summary.json`` once, naming them under ``curves``; returns the
        curves' paths."""
        self.logger.close()  # flushed: the curves are read from metrics.jsonl
        paths = render_run_curves(self.folder, self.console)
        summary["curves"] = [str(p) for p in paths]
        write_summary(self.folder / "summary.json", summary)
        return paths


@contextlib.contextmanager
def open_run(
    app: str, config: C, *, resume: bool, console: Console, torch_threads: int = 0
) -> Iterator[Run[C]]:
    """Open a run of ``app`` (the logger is closed at exit).

    Claims ``config.run_dir`` (see :func:`~turnrl.grpo_core.recipe.run_folder.claim_run_dir`),
    writes the config with that folder to ``config.json``, reads ``progress.json`` when
    ``resume``, sets torch's CPU threads when ``torch_threads`` > 0, and opens the step
    logger (``metrics.jsonl``, TensorBoard, the trackers ``config.logger`` names, as
    project ``turnrl-<app>``).

    Raises:
        ValueError: a fresh run names a folder that holds a run; a corrupt progress file.
    """
    from turnrl.grpo_core.observe.logger import StepLogger
    from turnrl.grpo_core.observe.trackers import make_trackers

    started = time.perf_counter()
    folder = claim_run_dir(config.run_dir, app, resume=resume)
    config = dataclasses.replace(config, run_dir=str(folder))  # type: ignore[type-var]
    data = config.to_dict()
    (folder / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    progress = load_progress(folder) if resume else {}
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    trackers = make_trackers(config.logger, folder, f"turnrl-{app}", folder.name, data)
    logger = StepLogger(folder, console=False, trackers=trackers)
    try:
        yield Run(folder, config, progress, logger, Phases(console), console, started, resume)
    finally:
        logger.close()


class RLStage:
    """The RL stage over a built loop: resumed from the run folder's latest checkpoint, a
    progress bar of the steps (the last step's reward), a checkpoint after the last step.

    Hand :meth:`on_metrics` to the loop (``build_loop(..., on_metrics=stage.on_metrics)``),
    then :meth:`run` it.
    """

    def __init__(
        self,
        console: Console,
        total: int,
        on_metrics: Callable[[int, dict[str, float]], None] | None = None,
        label: str = "GRPO",
    ) -> None:
        """``total`` steps in all (those a resumed run did included); ``on_metrics`` gets
        every step's metrics before the bar advances."""
        self.console, self.total, self.label = console, total, label
        self.user_on_metrics = on_metrics
        self.bar: Progress | None = None
        self.recover: Callable[..., Awaitable[bool]] | None = None
        """Set by :func:`build_rl` where lost engines are started again: the engine
        recovery of the stage's weight sync (``recipe.evaluation.engine_recovery``)."""

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The loop's metrics hook: the caller's, then one step on the bar."""
        if self.user_on_metrics is not None:
            self.user_on_metrics(step, metrics)
        if self.bar is not None:
            reward = metrics.get("rollout/reward_mean")
            shown = self.label if reward is None else f"{self.label} reward {reward:+.2f}"
            self.bar.update(self.bar.task_ids[0], advance=1, description=shown)

    async def run(self, loop: GRPOLoop) -> list[dict[str, float]]:
        """Run the steps the folder's checkpoints have not done yet with ``loop.run`` (which
        an asynchronous loop overlaps); returns every step's metrics (``loop.history``).

        Args:
            loop: Built with this stage's :meth:`on_metrics` and a ``checkpoint_dir``.
        """
        if (checkpoint := await loop.resume_latest()) is not None:  # a resumed run's folder
            self.console.print(
                f"resumed {self.label} from {checkpoint} ({loop.step}/{self.total} steps done)"
            )
        left = self.total - loop.step
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
        with Progress(*columns, TimeElapsedColumn(), console=self.console, transient=True) as bar:
            bar.add_task(self.label, total=self.total, completed=loop.step)
            self.bar = bar
            try:
                await loop.run(left)
            finally:
                self.bar = None
        loop.ensure_checkpoint()  # the last step's state, whatever --save-interval
        return loop.history


VERL_NAMES = {
    "rollout/reward_mean": "critic/rewards/mean",
    "rollout/response_len_mean": "response_length/mean",
    "rollout/num_turns_mean": "num_turns/mean",
}
"""A loop metric -> the verl name it is also logged under, so curves line up with a verl run."""


async def build_rl(
    run: Run[Any],
    policy: Path,
    prompts: Sequence[Any],
    generate: Any,
    reward: Any,
    *,
    trainer: Any,
    router: Any,
    job: Any,
    evaluate: Any = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    restart: Callable[[str], None] | None = None,
    restarts: dict[str, int] | None = None,
) -> tuple[GRPOLoop, RLStage]:
    """The RL stage of ``run``, ready to ``await stage.run(loop)``: the loop the config's
    ``loop`` section describes (seeded by ``--seed``, token-budget micro-batches under
    ``--use-dynamic-batch-size``, the reference policy ``--ref-load`` or ``policy`` when the
    KL loss is on) training ``trainer`` on the Ray run's ranks (``job``, started here
    unless they are), rolling out through ``generate`` over ``router``'s engines (their busy time,
    and as ``rollout/engine_errors`` the requests and health checks that failed on them
    since the previous step, are logged), weights synced to them
    (an engine the sync cannot reach leaves the router), checkpoints in the
    run folder. Every step's metrics (first handed to ``on_step``, which may add the app's
    own; the main ones also under verl's names, :data:`VERL_NAMES`) go to the run's logger
    (phase ``rl``) and, as ``format_step_line``, to the console.

    Args:
        run: The run (its config has the ``loop``, ``loss``, ``model`` and ``parallel``
            sections of ``turnrl.grpo_core.recipe.schema``, and ``seed``).
        policy: The model RL starts from (its tokenizer gives the padding id).
        prompts, generate, reward: As for ``GRPOLoop``.
        trainer: Every trainer's engine config (``schema.trainer_config``); the reference
            policy follows its sampling and dtype.
        evaluate: The loop's ``--eval-interval`` hook.
        restart: Starts a lost engine again where it was (``fleet.Fleet.restart``); it rejoins
            the router at the weight sync after it is healthy, at most
            :data:`MAX_ENGINE_RESTARTS` times per engine. None: lost engines stay out.
        restarts: Each engine's restarts so far (updated; shared with the run's other
            recoveries, e.g. its evaluation's).
    """
    from transformers import AutoTokenizer

    from turnrl.grpo_core.observe.logger import format_step_line
    from turnrl.grpo_core.recipe.loop import build_loop
    from turnrl.grpo_core.recipe.schema import loop_config as settings
    from turnrl.grpo_core.recipe.schema import reference_settings
    from turnrl.grpo_core.weight_sync.disk import DiskWeightSync

    loop_config = settings(run.config)
    errors = [0]  # the engines' failed requests and health checks up to the last step

    def on_metrics(step: int, metrics: dict[str, float]) -> None:
        now = router.errors_total()  # an engine that left the run included
        metrics["rollout/engine_errors"], errors[0] = float(now - errors[0]), now
        if on_step is not None:
            on_step(step, metrics)  # the same dict lands in the loop's history
        metrics.update({v: metrics[k] for k, v in VERL_NAMES.items() if k in metrics})
        run.logger(step, metrics, phase="rl")
        run.console.print(format_step_line(step, metrics, loop_config.num_rollout))

    stage = RLStage(run.console, loop_config.num_rollout, on_metrics)
    if job.trainers is None:  # off the event loop: the router serves on
        await asyncio.to_thread(job.start_trainers, trainer)
    pad_id = AutoTokenizer.from_pretrained(policy).pad_token_id
    loop = build_loop(
        loop_config,
        trainer,
        prompts,
        generate,
        reward,
        pad_id=int(pad_id if pad_id is not None else 0),
        sync_root=run.folder / "weights",
        job=job,
        reference=reference_settings(run.config, policy, trainer),
        on_metrics=stage.on_metrics,
        evaluate=evaluate,
        checkpoint_dir=str(run.folder / "checkpoints"),
        engine_busy=router.busy_seconds,
        weight_updates=router,
    )
    if isinstance(loop.weight_sync, DiskWeightSync):
        # An engine silent past the read timeout at a reload is hung: it leaves the run.
        loop.weight_sync.reload_timeout = run.config.engine.read_timeout
        recover = heal_engines(run.console, loop.weight_sync, router, restart, policy, restarts)
        if restart is not None:
            loop.generate = _rerun_after(recover, loop.generate, run.console)
            stage.recover = recover
    return loop, stage


def _rerun_after(
    recover: Callable[[], Awaitable[bool]], generate: Any, console: Console
) -> Callable[[Sequence[Any], int], Awaitable[Any]]:
    """``generate`` run once more when it failed for want of an engine (its episodes'
    re-runs spent: every engine dead) and ``recover`` brought one back."""

    async def run(prompts: Sequence[Any], n: int) -> Any:
        from turnrl.grpo_core.loop.rollout_manager import EpisodeFailedError
        from turnrl.rollout_router.protocol import NoEngineAvailableError

        try:
            return await generate(prompts, n)
        except (EpisodeFailedError, NoEngineAvailableError) as exc:
            if not await recover():
                raise
            console.print(f"[yellow]the rollout failed on its engines ({exc}); running it again")
        return await generate(prompts, n)

    return run


MAX_ENGINE_RESTARTS = 3
"""How many times a run starts one lost engine again."""


def heal_engines(
    console: Console,
    sync: Any,
    router: Any,
    restart: Callable[[str], None] | None,
    policy: str | Path,
    restarts: dict[str, int] | None = None,
) -> Callable[..., Awaitable[bool]]:
    """An engine the disk sync cannot reach leaves the router; with ``restart``, it is
    started again in the background and rejoins at the sync after it is healthy, or, when
    the sync reached no engine at all (e.g. the only one died), started again while the
    run waits, and given that sync's weights (each engine at most
    :data:`MAX_ENGINE_RESTARTS` times in all, counted in ``restarts``, which callers may
    share).

    Returns:
        ``recover(what="the rollout", while_others_serve=True)``, for a rollout (or
        ``what`` else) that failed on its engines: the sync's engines that do not answer
        their health check are started again the same way (with ``while_others_serve``
        False, only when none answers) and given the weights they served (the last synced
        version, else ``policy`` as version 0); True when some engine serves (all answered,
        or one came back), else False.
    """
    from turnrl.rollout_router.client import EngineClient

    restarts = {} if restarts is None else restarts
    tasks: set[asyncio.Task[None]] = set()
    lock = asyncio.Lock()  # concurrent rollouts (the async loop's groups) recover once

    def count(url: str) -> bool:
        """Count one more restart of ``url``; False when it has had them all."""
        if restart is None or restarts.get(url, 0) >= MAX_ENGINE_RESTARTS:
            return False
        restarts[url] = restarts.get(url, 0) + 1
        return True

    async def restore(urls: list[str], why: str = "no engine took the weights") -> list[str]:
        assert restart is not None
        todo = [url for url in urls if count(url)]
        for url in todo:
            console.print(
                f"[yellow]{why}: starting {url} again (restart {restarts[url]}); "
                "the run waits for it"
            )
        started = await asyncio.gather(
            *(asyncio.to_thread(restart, url) for url in todo), return_exceptions=True
        )
        for url, result in zip(todo, started, strict=True):
            if isinstance(result, Exception):
                console.print(f"[yellow]engine {url} did not start again: {result}")
        return [url for url, result in zip(todo, started, strict=True) if result is None]

    async def start_again(url: str, restart: Callable[[str], None]) -> None:
        try:
            await asyncio.to_thread(restart, url)
        except Exception as exc:  # the engine's own error (its log tail inside)
            console.print(f"[yellow]engine {url} did not start again: {exc}")
            return
        sync.rejoin(url)
        console.print(f"engine {url} is serving again: it rejoins at the next weight sync")

    async def engine_lost(url: str) -> None:
        with contextlib.suppress(KeyError):  # the router may have dropped it already
            await router.remove_engine(url)
        console.print(
            f"[yellow]engine {url} could not be reached at the weight sync: it is left out "
            f"of the run ({len(sync.engine_urls)} engine(s) go on; its log says why)"
        )
        if restart is None or not count(url):
            return
        console.print(f"engine {url}: starting it again (restart {restarts[url]})")
        task = asyncio.create_task(start_again(url, restart))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def engine_back(url: str) -> None:
        router.add_engine(url)
        console.print(f"engine {url} is back in the run, serving the trained weights")

    async def healthy(url: str) -> bool:
        async with EngineClient(url) as client:
            return await client.health(5.0)

    async def recover(what: str = "the rollout", while_others_serve: bool = True) -> bool:
        async with lock:
            answers = await asyncio.gather(*(healthy(url) for url in sync.engine_urls))
            dead = [url for url, ok in zip(sync.engine_urls, answers, strict=True) if not ok]
            if not dead or restart is None:
                return not dead
            if not while_others_serve and len(dead) < len(sync.engine_urls):
                return True  # re-runs go to those that answer; the sync handles the others
            back = await restore(dead, f"{what} failed with this engine down")
            failed = await sync.reload_last(back, policy)
            serving = len(sync.engine_urls) - len(dead) + len(back) - len(failed)
            return serving > 0  # the dead ones left out leave the run at the next sync

    sync.on_engine_lost, sync.on_engine_back = engine_lost, engine_back
    sync.restore = restore if restart is not None else None
    return recover


def run_main(
    app: str, prepare: Callable[[str], tuple[str, Coroutine[Any, Any, Any]] | None]
) -> int:
    """An app's ``main``; returns the process exit code.

    Runs ``prepare(default_run_dir)``: it reads the command line and returns the run folder
    (the default when none was named, so Ctrl-C's hint can name it) and the run to await,
    or None when there is nothing to run (e.g. ``--print-config``). The run's engines and
    sandbox stop on the way out of their context managers; an app that starts engines
    from a worker thread installs ``turnrl.npu_runtime.supervise.install_signal_handlers``
    before calling this (only the main thread may set signal handlers).

    A run that seems stuck can be asked where it is: ``kill -USR1 <pid>`` prints every
    thread's Python stack to stderr (``faulthandler``), and the run goes on.

    Returns:
        0; 2 after ``error: ...`` on stderr for bad input (``ValueError``,
        ``FileNotFoundError``); 130 after Ctrl-C, with the ``--resume`` hint.
    """
    run_dir = None
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:  # the process's fd 2
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    try:
        prepared = prepare(default_run_dir(app))
        if prepared is None:
            return 0
        run_dir, work = prepared
        if asyncio.run(_cancelled_by_ctrl_c(work)):
            return interrupted(app, run_dir)
    except (ValueError, FileNotFoundError) as exc:  # bad input found at start: nothing lost
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the run started
        return interrupted(app, run_dir)
    return 0


CTRL_C_REPEAT_S = 1.0
"""A second SIGINT sooner than this after the first is the same Ctrl-C arriving twice (the
terminal sends it to the whole foreground group, and a wrapper such as the supervisor
passes it on too); a later one stops the run at once."""


async def _cancelled_by_ctrl_c(work: Coroutine[Any, Any, Any]) -> bool:
    """Await ``work``; a first Ctrl-C ends it in order, a second raises KeyboardInterrupt.

    The first Ctrl-C must unwind the run itself, so that each ``with`` stops its engines,
    sandbox or Ray while the others still run. Where the run is busy in code of its own
    (SFT, a local train step) the KeyboardInterrupt is raised there, as Python does, and
    goes up through the run. Anywhere else (another task, such as a rollout's, or the event
    loop between tasks) it would leave the loop with the run's exits not run, to the
    interpreter's exit after Ray's own; there the run is cancelled instead.

    Returns:
        Whether Ctrl-C ended it.
    """
    from turnrl.npu_runtime.supervise import stop_requested

    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    assert main is not None
    pressed: list[float] = []
    stop_requested.clear()

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if pressed and now - pressed[0] < CTRL_C_REPEAT_S:
            return
        pressed.append(now)
        stop_requested.set()  # for loops that check it (a raise below can be swallowed)
        if len(pressed) > 1:
            raise KeyboardInterrupt
        print("Ctrl-C: stopping the run (Ctrl-C again to stop at once)", file=sys.stderr)
        if asyncio.current_task(loop) is main:
            raise KeyboardInterrupt
        loop.call_soon_threadsafe(main.cancel)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        await work
    except asyncio.CancelledError:
        if not pressed:
            raise
        main.uncancel()
        return True
    except KeyboardInterrupt:
        if len(pressed) != 1:
            raise
        return True
    finally:
        signal.signal(signal.SIGINT, previous)
        stop_requested.clear()  # answered: the run is over
    return False
