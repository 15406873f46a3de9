"""Benchmark of the tau2 environments against tau2-bench's own code, in the same run.

For the first ``--tasks`` tasks of airline and retail, medians of:

- **reset**: ``Tau2Domain.start(task)`` (copy-on-write over data parsed once) vs. tau2's
  ``get_environment()`` (reads and validates ``db.json`` for every simulation) plus
  ``set_state``;
- **step**: one gold tool call (``Toolkit.call`` and the sync) vs. ``Environment.get_response``;
- **reward**: the DB component of a finished episode (its hash against the gold actions'
  hash; turnrl cold = gold replayed now, cached = every later episode of the task) vs.
  tau2's ``EnvironmentEvaluator.calculate_reward`` (rebuilds two environments and replays).

Also checks that both sides give the same database hash after the gold actions.

    uv run --only-group dev nox -s tau2-speed            # installs tau2-bench's code
    # or, in an environment that has it: python benchmarks/tau2_env.py --tasks 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau2.domain import load_domain
from turnrl.tool_envs.tau2.env import Tau2Env
from turnrl.tool_envs.tau2.tasks import load_tasks
from turnrl.tool_envs.user_sim import ScriptedUser

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("TURNRL_TAU2_DATA") or ROOT / ".." / "shared" / "tau2-bench")


def _median_ms(func: Callable[[], Any], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        func()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _upstream(name: str) -> tuple[Any, Any, Any]:
    from loguru import logger

    logger.remove()  # tau2 logs every tool response at DEBUG; measure its code, not its logs
    logger.add(sys.stderr, level="WARNING")
    from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage
    from tau2.data_model.tasks import Task
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    if name == "airline":
        from tau2.domains.airline.data_model import FlightDB as Db
        from tau2.domains.airline.environment import get_environment
    else:
        from tau2.domains.retail.data_model import RetailDB as Db
        from tau2.domains.retail.environment import get_environment

    def make_env(**kwargs: Any) -> Any:
        return get_environment(db=Db.load(str(DATA / name / "db.json")), **kwargs)

    def trajectory(actions: list[dict[str, Any]]) -> list[Any]:
        env, out = make_env(), []
        for i, action in enumerate(actions):
            call = ToolCall(id=f"c{i}", name=action["name"], arguments=action["arguments"])
            out.append(AssistantMessage(role="assistant", tool_calls=[call]))
            response = env.get_response(call)
            out.append(ToolMessage(id=f"c{i}", role="tool", content=response.content))
        return out

    def evaluate(record: dict[str, Any], messages: list[Any]) -> float:
        task = Task.model_validate(record)
        info = EnvironmentEvaluator.calculate_reward(make_env, task, messages)
        return float(info.reward)

    return make_env, trajectory, evaluate


def _domain(name: str, count: int) -> dict[str, Any]:
    from tau2.data_model.message import ToolCall

    domain = load_domain(name, DATA / name)
    tasks = load_tasks(DATA / name, "base")[:count]
    records = {r["id"]: r for r in json.loads((DATA / name / "tasks.json").read_text())}
    make_env, trajectory, evaluate = _upstream(name)
    rows: dict[str, list[float]] = {k: [] for k in ("reset", "step", "cold", "cached", "tau2")}
    ups: dict[str, list[float]] = {"reset": [], "step": []}
    same_hash = True
    for task in tasks:
        actions = [{"name": a.name, "arguments": dict(a.arguments)} for a in task.gold_actions]
        rows["reset"].append(_median_ms(lambda task=task: domain.start(task)))
        ups["reset"].append(_median_ms(lambda: make_env().set_state(None, None, [])))
        agent, _ = domain.start(task)
        env = make_env()
        for action in actions:
            start = time.perf_counter()
            agent.call(action["name"], dict(action["arguments"]))
            rows["step"].append((time.perf_counter() - start) * 1e3)
            call = ToolCall(id="c", name=action["name"], arguments=dict(action["arguments"]))
            start = time.perf_counter()
            env.get_response(call)
            ups["step"].append((time.perf_counter() - start) * 1e3)
        same_hash &= agent.db_hash() == env.get_db_hash()
        episode = Tau2Env(domain, ScriptedUser(["hi"]))
        asyncio.run(episode.reset(task))
        episode.agent = agent  # the episode's state: the gold actions played

        def db_verdict(episode: Tau2Env = episode, task: Any = task) -> None:
            assert episode.reward_inputs((True,) * len(task.nl_assertions)).db_match

        rows["cold"].append(_median_ms(lambda: (domain.gold_cache.clear(), db_verdict()), 3))
        rows["cached"].append(_median_ms(db_verdict))
        messages = trajectory(actions)
        rows["tau2"].append(_median_ms(lambda r=records[task.id], m=messages: evaluate(r, m), 3))
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    up = {k: statistics.median(v) for k, v in ups.items() if v}
    return {
        "tasks": len(tasks),
        "reset_ms": {
            "turnrl": med["reset"],
            "tau2": up["reset"],
            "speedup": up["reset"] / med["reset"],
        },
        "step_ms": {"turnrl": med["step"], "tau2": up["step"], "speedup": up["step"] / med["step"]},
        "reward_db_ms": {
            "turnrl_cold": med["cold"],
            "turnrl_cached": med["cached"],
            "tau2": med["tau2"],
            "speedup_cold": med["tau2"] / med["cold"],
            "speedup_cached": med["tau2"] / med["cached"],
        },
        "hashes_equal_to_tau2": same_hash,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20, help="tasks per domain")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    result = {name: _domain(name, args.tasks) for name in ("airline", "retail")}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
