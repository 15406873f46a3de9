"""The stages of a run, the same in every app: model, SFT, engines, evaluation, RL, evaluation.

:func:`run_stages` drives one opened :class:`~turnrl.grpo_core.recipe.driver.Run` through

1. **model**: ``--hf-checkpoint``, or the tiny seeded Qwen3 built in ``model/base``; a
   Megatron layout the model cannot take is refused here;
2. **engines**, started in a worker thread while **SFT** trains in this one (the app's
   conversations, :func:`~turnrl.grpo_core.recipe.sft.train_sft_on_chats`, exported to
   ``model/sft``; reused when ``--resume`` finds it complete); the engines are Ray actors
   placed by one Ray run (a local Ray unless ``RAY_ADDRESS`` names a cluster), whose
   trainer ranks start from the SFT model, and the engines reload it;
3. **evaluation before RL** (reused from ``progress.json`` on ``--resume``), the **RL** stage
   (:func:`~turnrl.grpo_core.recipe.driver.build_rl` over the app's rollout, evaluated every
   ``--eval-interval`` steps, the trained model exported to ``model/rl``), the **evaluation
   after RL**,

with every phase timed (``run.phases``). What differs between apps is an :class:`App`: its
SFT conversations, its engines' settings, and, while the engines serve, its evaluation and
rollout (:class:`Serving`). ``recipe.report.report_run`` then reports :class:`StagesResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from turnrl.grpo_core.recipe.sft import SFT_DONE, Chat

if TYPE_CHECKING:
    from turnrl.grpo_core.loop.loop import GRPOLoop
    from turnrl.grpo_core.recipe.driver import Run
    from turnrl.rollout_router.engine import EngineSpec
    from turnrl.rollout_router.router import Router


@dataclass
class SFTData:
    """The conversations the SFT stage trains on (``recipe.sft.train_sft_on_chats``)."""

    chats: Sequence[Chat]
    """Whole conversations."""
    probe: Sequence[Chat] = ()
    """Conversations SFT never trains on, for its probe stop."""
    tools: list[dict[str, Any]] | None = None
    """Tool schemas in the prompt."""


@dataclass
class Rollout:
    """The RL stage's rollout, as ``GRPOLoop`` takes it."""

    prompts: Sequence[Any]
    """What the loop draws each step's prompts from."""
    generate: Any
    """``(prompts, n) -> samples``."""
    reward: Any
    """``(samples) -> rewards``."""
    on_step: Callable[[int, dict[str, float]], None] | None = None
    """Called with every step's metrics before they are logged (it may add the app's own)."""
    on_loop: Callable[[GRPOLoop], None] | None = None
    """Called with the built loop before it runs (e.g. DAPO's extra rounds draw from it)."""


class Serving(Protocol):
    """What an app does while the engines serve."""

    async def evaluate(self, step: int) -> dict[str, Any]:
        """Evaluate the held-out set at RL step ``step``: a record of
        ``recipe.evaluation.evaluation_record`` (what the summary keeps, the curves' points,
        and ``progress.json``'s evaluation before RL)."""

    def rollout(self) -> Rollout:
        """The RL stage's rollout."""


class App(Protocol):
    """What an app gives :func:`run_stages`."""

    max_positions: int
    """Positions of the tiny model built when no ``--hf-checkpoint`` is given."""
    sampling: dict[str, float]
    """The rollouts' sampling the trainer computes log-probs under (``temperature``, and
    ``top_p`` where set)."""
    rl_enabled: bool
    """Whether the RL stage runs (False: the evaluation before RL is also the one after)."""

    def sft_data(self) -> SFTData | None:
        """SFT's conversations; None when the app has none to train on."""

    def engine_spec(self, model: Path) -> EngineSpec:
        """One engine serving ``model`` (``schema.engine_spec`` with the app's settings)."""

    def serving(
        self, policy: Path, urls: list[str], router: Router
    ) -> contextlib.AbstractAsyncContextManager[Serving]:
        """Evaluation and rollout over ``router`` (the engines at ``urls``), serving
        ``policy``; what it starts (a sandbox, users) stops at exit."""


@dataclass
class StagesResult:
    """What :func:`run_stages` did."""

    policy: Path
    """The model RL started from (the SFT model, or the base)."""
    urls: list[str]
    """The engines."""
    before: dict[str, Any] | None = None
    """The evaluation before RL (``train``), or None."""
    after: dict[str, Any] | None = None
    """The evaluation after RL (that before RL when no RL step ran); the only one of
    ``evaluate`` runs."""
    history: list[dict[str, float]] = field(default_factory=list)
    """Every RL step's metrics."""
    sft: dict[str, Any] | None = None
    """What SFT did (``sft.json``), when it ran or was reused."""


def sft_stage(run: Run[Any], app: App, base: Path) -> tuple[Path, dict[str, Any] | None]:
    """The SFT model (``model/sft``) and its record; ``base`` and None when there is nothing
    to train. A resumed run reuses a complete SFT model of its folder."""
    from turnrl.grpo_core.recipe.sft import train_sft_on_chats

    done = run.folder / "model" / "sft" / SFT_DONE
    if run.resumed and done.is_file():
        run.console.print(f"SFT: reusing {done.parent} (resumed run)")
        return done.parent, json.loads(done.read_text())
    data = app.sft_data() if run.config.sft.runs else None
    if data is None or not data.chats:
        run.console.print("SFT skipped")
        return base, None
    record = train_sft_on_chats(
        run.config,
        base,
        data.chats,
        data.probe,
        done.parent,
        tools=data.tools,
        console=run.console,
        on_step=lambda step, metrics: run.logger(step, metrics, phase="sft"),
    )
    return done.parent, record


async def run_stages(run: Run[Any], app: App, *, train: bool = True) -> StagesResult:
    """The run's stages (module docstring); ``train=False`` only evaluates the starting
    model (``result.after``)."""
    from turnrl.grpo_core.recipe import schema
    from turnrl.grpo_core.recipe.model import policy_start

    config, phases = run.config, run.phases
    with contextlib.ExitStack() as stack:
        with phases("model"):
            base = policy_start(
                config,
                run.folder / "model" / "base",
                max_positions=app.max_positions,
                reuse=run.resumed,
                console=run.console,
            )
            schema.check_model_split(config, base)
        # Submitted now, so the engines start while SFT trains (SFT blocks this thread).
        cancel = threading.Event()
        logs = run.folder / "logs"
        fleet = schema.engines(config, app.engine_spec(base), logs, cancel)
        started = asyncio.get_running_loop().run_in_executor(None, stack.enter_context, fleet)
        policy, sft = base, None
        try:
            if train:
                with phases("sft"):
                    policy, sft = sft_stage(run, app, base)
            with phases("engine start (rest)"):
                urls, job, restart = await asyncio.shield(started)
        except BaseException:
            # Ctrl-C, or an error in SFT: engines still starting are stopped, not waited for
            # until healthy (those already serving stop with the stack).
            cancel.set()
            with contextlib.suppress(Exception):
                await started
            raise
        trainer = schema.trainer_config(config, policy, **app.sampling) if train else None
        if train:  # the trainer ranks, from the SFT policy, as Ray actors
            with phases("trainers start"):
                await asyncio.to_thread(job.start_trainers, trainer)
        if policy != base:
            from turnrl.grpo_core.weight_sync.disk import reload_engines

            await reload_engines(urls, policy, "0")
        result = StagesResult(policy, urls, sft=sft)
        await _serve(run, app, result, trainer, job, train, restart)
    return result


@contextlib.asynccontextmanager
async def _recovery_scope() -> AsyncIterator[None]:
    """The evaluations' ``engine_recovery`` set inside, as it was at exit."""
    from turnrl.grpo_core.recipe.evaluation import engine_recovery

    token = engine_recovery.set(None)
    try:
        yield
    finally:
        engine_recovery.reset(token)


def _for_evaluations(heal: Callable[..., Any] | None) -> Callable[[], Any] | None:
    """``heal_engines``' recovery as the evaluations use it: it names the evaluation and
    restarts engines only when none serves."""
    if heal is None:
        return None
    return functools.partial(heal, "the evaluation", while_others_serve=False)


async def _serve(
    run: Run[Any],
    app: App,
    result: StagesResult,
    trainer: Any,
    job: Any,
    train: bool,
    restart: Any,
) -> None:
    """Evaluation, RL, evaluation over the running engines (filled into ``result``)."""
    from turnrl.grpo_core.recipe import schema
    from turnrl.grpo_core.recipe.driver import build_rl, heal_engines
    from turnrl.grpo_core.recipe.evaluation import engine_recovery, record_scalars
    from turnrl.grpo_core.weight_sync.disk import DiskWeightSync
    from turnrl.rollout_router.router import Router

    config, phases = run.config, run.phases
    async with (
        _recovery_scope(),
        Router(result.urls, schema.router_config(config)) as router,
        app.serving(result.policy, result.urls, router) as serving,
    ):
        restarts: dict[str, int] = {}  # each engine's, over the run
        if restart is not None:  # every engine dead in an evaluation before RL: started
            # again with the policy (a sync that synced nothing reloads it as version 0)
            unsynced = DiskWeightSync(result.urls, run.folder / "weights")
            heal = heal_engines(run.console, unsynced, router, restart, result.policy, restarts)
            engine_recovery.set(_for_evaluations(heal))

        async def evaluated(label: str, step: int) -> dict[str, Any]:
            with phases(label):
                record = await serving.evaluate(step)
            run.logger(step, record_scalars(record), phase="val")
            return record

        if not train:
            result.after = await evaluated("eval", 0)
            return
        before = functools.partial(evaluated, "eval before RL", 0)
        result.before = await run.once("before", "evaluation before RL", before)
        if not app.rl_enabled:
            result.after = result.before
            return
        num_rollout = config.loop.num_rollout

        async def during_rl(step: int) -> dict[str, float]:
            """The loop's hook every --eval-interval steps (the last: the evaluation after
            RL); logged as its own ``val`` line, as every evaluation is."""
            if step < num_rollout:
                await evaluated("eval during RL", step)
            return {}

        with phases("rl"):
            rollout = serving.rollout()
            loop, stage = await build_rl(
                run,
                result.policy,
                rollout.prompts,
                rollout.generate,
                rollout.reward,
                trainer=trainer,
                router=router,
                job=job,
                evaluate=during_rl,
                on_step=rollout.on_step,
                restart=restart,
                restarts=restarts,
            )
            if rollout.on_loop is not None:
                rollout.on_loop(loop)
            # From now on a restarted engine gets the synced weights (a collective sync
            # cannot take one back: the evaluation's re-runs then find it dead and stop).
            engine_recovery.set(_for_evaluations(stage.recover))
            result.history = await stage.run(loop)
            loop.trainer.export_hf(run.folder / "model" / "rl")
        result.after = await evaluated("eval after RL", loop.step)
