"""`uv run apps/retool`: SFT, evaluate, GRPO with the code sandbox, evaluate again.

data   -> problems (generated, or DAPO-Math-17k) and SFT chats (generated, or ReTool-SFT)
model  -> a tiny Qwen3 built here, or --hf-checkpoint
SFT    -> TorchEngine, loss on assistant tokens only; exported as a Hugging Face folder
eval   -> vLLM engine + sandbox: accuracy mean@k and turns on held-out problems / AIME
GRPO   -> turnrl.grpo_core.loop.GRPOLoop: rollouts with the sandbox in the loop, ReTool
          reward, weights pushed to the engine through disk after every step
eval   -> again; table + run folder (config.json, metrics.jsonl, tensorboard/, summary.json)
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from turnrl.grpo_core.recipe.driver import Run, open_run, run_main
from turnrl.grpo_core.recipe.evaluation import paired_errors, verdict
from turnrl.grpo_core.recipe.schema import check_model_split, engine_spec, engines, router_config
from turnrl.tool_envs.math_data import MathTask, load_aime, load_dapo_math, load_retool_sft
from turnrl.tool_envs.math_synth import (
    DATA_SOURCE,
    iter_sft_chats,
    make_problems,
    train_and_heldout,
)
from turnrl.tool_envs.retool_episodes import generations_text, per_problem_accuracy, run_tasks
from turnrl_app_retool.cli import resolve
from turnrl_app_retool.config import RetoolAppConfig
from turnrl_app_retool.episodes import episode_settings, summarize
from turnrl_app_retool.rl import run_rl_stage

if TYPE_CHECKING:
    from turnrl.grpo_core.observe.logger import StepLogger


class Datasets:
    """The run's SFT chats, RL prompts and validation sets."""

    def __init__(self, config: RetoolAppConfig, instruction: str) -> None:
        d = config.data
        train, heldout = train_and_heldout(
            max(d.num_train_problems, d.num_sft_chats), d.num_val_problems, config.seed
        )
        # Probe chats for SFT's stop (SFTStop), never trained on: the file's last chats, or
        # generated problems of their own seed, in no other set.
        self.probe_chats: list[list[dict[str, Any]]] = []
        if d.sft_path:
            self.sft_chats = load_retool_sft(d.sft_path)
            if config.sft.probe_target:
                cut = len(self.sft_chats) - config.sft.probe_size
                self.sft_chats, self.probe_chats = self.sft_chats[:cut], self.sft_chats[cut:]
        else:  # SFT and RL share the generated training problems, never the held-out ones
            self.sft_chats = list(iter_sft_chats(train[: d.num_sft_chats], instruction))
            seen = {p.expression for p in train + heldout}
            probe = make_problems(config.sft.probe_size, config.seed * 2 + 3, exclude=seen)
            self.probe_chats = list(iter_sft_chats(probe, instruction))
        if d.train_path:
            self.train = load_dapo_math(d.train_path, d.max_train_prompts)
        else:
            self.train = [p.task(i) for i, p in enumerate(train[: d.num_train_problems])]
        self.val: dict[str, list[MathTask]] = {}
        for path in d.val_paths:
            tasks = load_aime(path)
            self.val.setdefault(tasks[0].data_source if tasks else Path(path).stem, []).extend(
                tasks
            )
        if not d.val_paths:
            self.val[DATA_SOURCE] = [p.task(i) for i, p in enumerate(heldout)]
        if config.eval.max_problems is not None:
            self.val = {k: v[: config.eval.max_problems] for k, v in self.val.items()}


def build_base_model(config: RetoolAppConfig, folder: Path, reuse: bool = False) -> Path:
    """The starting model: ``--hf-checkpoint``, or a tiny seeded Qwen3 written to ``folder``
    (with ``reuse``, the one an earlier run of the folder built)."""
    from turnrl.grpo_core.recipe.model import policy_start

    return policy_start(config, folder, reuse=reuse, console=Console(quiet=True))


def run_sft_stage(
    config: RetoolAppConfig,
    base: Path,
    datasets: Datasets,
    out: Path,
    console: Console,
    logger: StepLogger,
) -> tuple[Path, dict[str, Any]]:
    """Stage 1 (``grpo_core.recipe.sft``); returns the exported model folder and what SFT
    did (steps, first and last loss, why it stopped, ``[step, rate]`` of every probe). Every
    step also goes to ``metrics.jsonl`` (``sft/loss``, ``sft/probe``)."""
    from turnrl.grpo_core.recipe.sft import train_sft_on_chats
    from turnrl.tool_envs.retool import CODE_INTERPRETER

    record = train_sft_on_chats(
        config,
        base,
        datasets.sft_chats,
        datasets.probe_chats,
        out,
        tools=[CODE_INTERPRETER] if config.data.tool_schema_in_prompt else None,
        console=console,
        on_step=lambda step, metrics: logger(step, metrics, phase="sft"),
    )
    return out, record


@contextlib.contextmanager
def sandbox_url(config: RetoolAppConfig) -> Iterator[str]:
    """The external ``--sandbox-url``, or an embedded ``turnrl-sandbox serve`` for the run."""
    if config.sandbox.url:
        yield config.sandbox.url
        return
    from turnrl.tool_envs.sandbox.embedded import EmbeddedSandbox

    with EmbeddedSandbox(*(["--insecure"] if config.sandbox.insecure else [])) as sandbox:
        yield sandbox.url


class Evaluator:
    """Validation over every dataset; keeps what the summary table needs."""

    def __init__(
        self, config: RetoolAppConfig, settings: Any, datasets: Datasets, logger: StepLogger
    ) -> None:
        self.config, self.settings, self.datasets, self.logger = config, settings, datasets, logger
        self.per_problem: dict[int, dict[str, list[float]]] = {}
        """Step -> dataset -> each problem's accuracy (for standard errors and paired deltas)."""

    async def __call__(self, engine: Any, step: int) -> dict[str, float]:
        n = self.config.eval.n
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        turns, tokens = [], 0.0
        for source, tasks in self.datasets.val.items():
            trajs = await run_tasks(engine, self.settings, tasks, n, group_prefix=f"val-{source}")
            m = summarize(trajs, source, n)
            self.per_problem.setdefault(step, {})[source] = per_problem_accuracy(trajs)
            turns.append(m["val-aux/num_turns/mean"])
            tokens += m["val-aux/generated_tokens"]
            metrics.update(m)
            self.logger.log_samples(
                step, [generations_text(trajs, self.settings.chat)], f"val/{source}/generations"
            )
        seconds = time.perf_counter() - start
        metrics["val-aux/num_turns/mean"] = sum(turns) / len(turns)
        metrics["val-aux/seconds"] = seconds
        metrics["val-aux/tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
        self.logger(step, metrics, phase="val")
        return metrics


def accuracy(metrics: dict[str, float]) -> float:
    """Mean of every dataset's ``val-core/.../acc/mean@k``."""
    values = [v for k, v in metrics.items() if k.startswith("val-core/") and "/acc/" in k]
    return sum(values) / len(values)


async def run(
    config: RetoolAppConfig, console: Console | None = None, resume: bool = False
) -> dict[str, Any]:
    """One full run; returns the summary (also written to ``<run_dir>/summary.json``).

    With ``resume``, what an earlier run of the same folder finished is not redone: the base
    and SFT models are reused, the evaluation before RL is read from ``progress.json`` and
    GRPO continues from the latest checkpoint.
    """
    from turnrl.tool_envs.retool import DEFAULT_INSTRUCTION

    console = console or Console()
    os.environ.update(config.env)
    threads = config.model.torch_threads
    with open_run("retool", config, resume=resume, console=console, torch_threads=threads) as this:
        config, run_dir, progress, phases = this.config, this.folder, this.progress, this.phases
        if resume:
            console.print(f"resuming {run_dir} (finished: {', '.join(progress) or 'nothing'})")
        datasets = Datasets(config, DEFAULT_INSTRUCTION)
        with phases("sft"):
            policy = build_base_model(config, run_dir / "model" / "base", reuse=resume)
            check_model_split(config, policy)  # a Megatron layout the model cannot take
            if "sft" in progress:
                policy = run_dir / "model" / "sft"
                console.print(f"SFT: reusing {policy} (from progress.json)")
            elif config.sft.runs:
                sft_dir = run_dir / "model" / "sft"
                policy, record = run_sft_stage(
                    config, policy, datasets, sft_dir, console, this.logger
                )
                this.remember("sft", record)
        sft_cpu = time.process_time()
        console.print(f"SFT done (last loss {progress.get('sft', {}).get('loss_last')})")
        rl, on_ray = config.rl, config.cluster.runner == "ray"
        length, seed = rl.max_prompt_length + rl.max_response_length, ["--seed", str(config.seed)]
        spec = engine_spec(config, policy, length, seed)
        fleet = engines(config, spec, run_dir / "logs", on_ray)
        with sandbox_url(config) as url, fleet as (urls, job):
            evaluate, before, after, history = await _evaluate_and_train(
                this, policy, datasets, url, urls, job
            )
        per_problem = (evaluate.per_problem[0], evaluate.per_problem[len(history)])
        seconds = {f"{name}_s": value for name, value in phases.seconds.items()}
        seconds["sft_cpu_s"] = sft_cpu
        seconds["app_cpu_s"] = time.process_time()  # this process: data, SFT, RL training
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # engines and sandbox, stopped
        seconds["children_cpu_s"] = children.ru_utime + children.ru_stime
        summary = make_summary(config, before, after, history, seconds, this.seconds(), per_problem)
        summary.update(runner=config.cluster.runner, engine_urls=urls, train_history=history)
        summary["sft"] = progress.get("sft")  # steps, why it stopped, its probes
        this.finish(summary)
    console.print(results_table(summary))
    if "verdict" in summary:
        console.print(f"[bold]{summary['verdict']}[/bold]")
    console.print(f"run folder: {run_dir}")
    return summary


async def _evaluate_and_train(
    run: Run[RetoolAppConfig],
    policy: Path,
    datasets: Datasets,
    sandbox: str,
    urls: list[str],
    job: Any,
) -> tuple[Evaluator, dict[str, float], dict[str, float], list[dict[str, float]]]:
    """Evaluation before RL, the RL stage, evaluation after it, on the engines at ``urls``
    with the sandbox at ``sandbox``; returns the evaluator (its per-problem accuracies), the
    metrics before and after RL, and every RL step's metrics."""
    from turnrl.rollout_router.router import Router
    from turnrl.tool_envs.chat import ChatTokenizer
    from turnrl.tool_envs.sandbox import SandboxClient, SandboxClientConfig

    config, console, phases = run.config, run.console, run.phases
    box = SandboxClient(
        SandboxClientConfig(
            url=sandbox,
            run_timeout=config.sandbox.run_timeout,
            memory_limit_mb=config.sandbox.memory_limit_mb,
            max_concurrency=config.sandbox.max_concurrency,
        )
    )
    chat = ChatTokenizer.from_dir(policy)
    settings = episode_settings(config, chat, box, config.eval.temperature, config.eval.top_p)
    evaluate = Evaluator(config, settings, datasets, run.logger)
    async with Router(urls, router_config(config)) as router:

        async def evaluate_before() -> dict[str, Any]:
            metrics = await evaluate(router, 0)
            return {"metrics": metrics, "per_problem": evaluate.per_problem[0]}

        with phases("eval_before"):
            record = await run.once("before", "evaluation before RL", evaluate_before)
        before, evaluate.per_problem[0] = record["metrics"], record["per_problem"]
        console.print(
            f"before RL: acc {accuracy(before):.3f}, turns {before['val-aux/num_turns/mean']:.2f}"
        )
        history: list[dict[str, float]] = []
        with phases("rl"):
            if config.rl.enabled:
                history = await run_rl_stage(
                    run,
                    policy,
                    urls,
                    router,
                    settings,
                    datasets.train,
                    job,
                    lambda step: evaluate(router, step),
                )
        with phases("eval_after"):
            after = await evaluate(router, len(history)) if history else before
    return evaluate, before, after, history


PerProblem = dict[str, list[float]]
"""Dataset -> each held-out problem's accuracy (fraction of its k samples correct)."""


def standard_errors(before: PerProblem, after: PerProblem) -> dict[str, float]:
    """Accuracy's standard errors before / after RL and of the paired delta, over problems
    (``recipe.evaluation.paired_errors``), under the summary's names."""
    e = paired_errors(before, after)
    return {
        "acc_before_se": e["before_se"],
        "acc_after_se": e["after_se"],
        "acc_delta_se": e["delta_se"],
        "num_val_problems": e["num_items"],
    }


def make_summary(
    config: RetoolAppConfig,
    before: dict[str, float],
    after: dict[str, float],
    history: Sequence[dict[str, float]],
    phases: dict[str, float],
    wall: float,
    per_problem: tuple[PerProblem, PerProblem] | None = None,
) -> dict[str, Any]:
    """summary.json: accuracy (± s.e. when ``per_problem`` is given) and turns before/after
    RL, the delta, steps, timings, and how many groups dynamic sampling filtered."""
    acc_before, acc_after = accuracy(before), accuracy(after)
    rewards = [h.get("rollout/reward_mean", 0.0) for h in history]
    errors: dict[str, Any] = dict(standard_errors(*per_problem)) if per_problem else {}
    if errors and history:
        errors["verdict"] = verdict(
            f"accuracy mean@{config.eval.n}",
            (acc_before, errors["acc_before_se"]),
            (acc_after, errors["acc_after_se"]),
            errors["acc_delta_se"],
            f"paired over {errors['num_val_problems']:.0f} problems",
        )
    return {
        **errors,
        "dynamic_sampling": config.rl.dynamic_sampling,
        "filtered_groups_total": sum(h.get("rollout/groups_filtered", 0.0) for h in history),
        "gen_batches_total": sum(h.get("rollout/sampling_rounds", 1.0) for h in history),
        "preset": config.preset,
        "n": config.eval.n,
        "val_datasets": sorted({k.split("/")[1] for k in before if k.startswith("val-core/")}),
        "acc_before": acc_before,
        "acc_after": acc_after,
        "acc_delta": acc_after - acc_before,
        "num_turns_before": before["val-aux/num_turns/mean"],
        "num_turns_after": after["val-aux/num_turns/mean"],
        "tokens_per_s_before": before["val-aux/tokens_per_s"],
        "tokens_per_s_after": after["val-aux/tokens_per_s"],
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
        "steps": len(history),
        "phases_s": phases,
        "wall_seconds": wall,
        "metrics_before": before,
        "metrics_after": after,
    }


def results_table(summary: dict[str, Any]) -> Table:
    """The rich table printed at the end."""
    n, phases = summary["n"], summary["phases_s"]
    table = Table(title=f"ReTool ({summary['preset']}), {', '.join(summary['val_datasets'])}")
    for column in ("", f"acc mean@{n}", "mean turns", "tokens/s", "time"):
        table.add_column(column)

    def acc(key: str) -> str:
        sign = "+" if key == "acc_delta" else ""
        se = summary.get(f"{key}_se")
        return f"{summary[key]:{sign}.3f}" + ("" if se is None else f" ± {se:.3f}")

    table.add_row(
        "after SFT",
        acc("acc_before"),
        f"{summary['num_turns_before']:.2f}",
        f"{summary['tokens_per_s_before']:.0f}",
        f"SFT {phases['sft_s']:.0f}s + eval {phases['eval_before_s']:.0f}s",
    )
    table.add_row(
        f"after RL ({summary['steps']} steps)",
        acc("acc_after"),
        f"{summary['num_turns_after']:.2f}",
        f"{summary['tokens_per_s_after']:.0f}",
        f"RL {phases['rl_s']:.0f}s + eval {phases['eval_after_s']:.0f}s",
    )
    table.add_row(
        "delta",
        acc("acc_delta"),
        f"{summary['num_turns_after'] - summary['num_turns_before']:+.2f}",
        "",
        f"total {summary['wall_seconds']:.0f}s",
    )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``uv run apps/retool``; returns the process exit code."""

    def prepare(default_dir: str) -> tuple[str, Coroutine[Any, Any, Any]] | None:
        config, args = resolve(argv)
        if args.print_config:
            print(json.dumps(config.to_dict(), indent=2))
            return None
        config.run_dir = run_dir = config.run_dir or default_dir  # named in the Ctrl-C hint
        return run_dir, run(config, resume=args.resume)

    return run_main("retool", prepare)


if __name__ == "__main__":
    sys.exit(main())
