"""Benchmark of the tau2 environments against tau2-bench's own code, in the same run.

For the first ``--tasks`` tasks of the ``base`` split of airline, retail and telecom, medians
of:

- **reset**: ``Tau2Domain.start(task)`` (copy-on-write over data parsed once, then the task's
  initial state) vs. tau2's ``get_environment()`` (reads and validates the databases for every
  simulation) plus ``set_state`` with the same initial state;
- **step**: one gold tool call of either side (``Toolkit.call`` and the sync) vs.
  ``Environment.get_response``;
- **reward**: the environment components of a finished episode (database hashes against the
  gold actions' hashes, environment assertions; turnrl cold = gold replayed now, cached = every
  later episode of the task) vs. tau2's ``EnvironmentEvaluator.calculate_reward`` (rebuilds two
  environments and replays).

Also checks that both sides give the same database hashes (agent's and, in telecom, the
user's phone) after the gold actions, and that tau2 scores every gold trajectory 1.

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

from turnrl.tool_envs.tau.tau2.domain import load_domain
from turnrl.tool_envs.tau.tau2.env import Tau2Env
from turnrl.tool_envs.tau.tau2.tasks import load_tasks
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
    from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage
    from tau2.data_model.tasks import Task
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    folder = DATA / name
    if name == "telecom":
        from tau2.domains.telecom import environment as module
        from tau2.domains.telecom.data_model import TelecomDB
        from tau2.domains.telecom.user_data_model import TelecomUserDB

        # The installed package has no data folder: its policy files are read from ours.
        module.TELECOM_MAIN_POLICY_PATH = folder / "main_policy.md"
        module.TELECOM_TECH_SUPPORT_POLICY_MANUAL_PATH = folder / "tech_support_manual.md"

        def make_env(**kwargs: Any) -> Any:
            db = TelecomDB.load(str(folder / "db.toml"))
            user_db = TelecomUserDB.load(str(folder / "user_db.toml"))
            return module.get_environment(db=db, user_db=user_db, **kwargs)

    else:
        if name == "airline":
            from tau2.domains.airline.data_model import FlightDB as Db
            from tau2.domains.airline.environment import get_environment
        else:
            from tau2.domains.retail.data_model import RetailDB as Db
            from tau2.domains.retail.environment import get_environment

        def make_env(**kwargs: Any) -> Any:
            return get_environment(db=Db.load(str(folder / "db.json")), **kwargs)

    def start(record: dict[str, Any]) -> Any:
        """An environment in the task's initial state, as tau2's orchestrator sets it."""
        state = Task.model_validate(record).initial_state
        env = make_env()
        if state is None:
            env.set_state(None, None, [])
        else:
            env.set_state(state.initialization_data, state.initialization_actions, [])
        return env

    def trajectory(record: dict[str, Any], actions: list[dict[str, Any]]) -> list[Any]:
        env, out = start(record), []
        for i, action in enumerate(actions):
            call = ToolCall(id=f"c{i}", **action)
            role = UserMessage if action["requestor"] == "user" else AssistantMessage
            out.append(role(role=action["requestor"], tool_calls=[call]))
            response = env.get_response(call)
            out.append(
                ToolMessage(
                    id=f"c{i}",
                    role="tool",
                    content=response.content,
                    requestor=action["requestor"],
                    error=response.error,
                )
            )
        return out

    def evaluate(record: dict[str, Any], messages: list[Any]) -> float:
        task = Task.model_validate(record)
        info = EnvironmentEvaluator.calculate_reward(make_env, task, messages)
        return float(info.reward)

    return start, trajectory, evaluate


def _domain(name: str, count: int) -> dict[str, Any]:
    from tau2.data_model.message import ToolCall

    domain = load_domain(name, DATA / name)
    tasks = load_tasks(DATA / name, "base")[:count]
    records = {r["id"]: r for r in json.loads((DATA / name / "tasks.json").read_text())}
    start, trajectory, evaluate = _upstream(name)
    rows: dict[str, list[float]] = {k: [] for k in ("reset", "step", "cold", "cached", "tau2")}
    ups: dict[str, list[float]] = {"reset": [], "step": []}
    same_hash, tau2_rewards = True, []
    for task in tasks:
        record = records[task.id]
        actions = [
            {"name": a.name, "arguments": dict(a.arguments), "requestor": who}
            for a, who in zip(task.gold_actions, task.gold_requestors, strict=True)
        ]
        rows["reset"].append(_median_ms(lambda task=task: domain.start(task)))
        ups["reset"].append(_median_ms(lambda record=record: start(record)))
        agent, phone = domain.start(task)
        env = start(record)
        for action in actions:
            mine = phone if action["requestor"] == "user" else agent
            begin = time.perf_counter()
            _, error = mine.call(action["name"], dict(action["arguments"]))  # type: ignore[union-attr]
            if not error:
                domain.sync(agent, phone)
            rows["step"].append((time.perf_counter() - begin) * 1e3)
            call = ToolCall(id="c", **{**action, "arguments": dict(action["arguments"])})
            begin = time.perf_counter()
            env.get_response(call)
            ups["step"].append((time.perf_counter() - begin) * 1e3)
        same_hash &= agent.db_hash() == env.get_db_hash()
        if phone is not None:
            same_hash &= phone.db_hash() == env.get_user_db_hash()
        episode = Tau2Env(domain, ScriptedUser(["hi"]))
        asyncio.run(episode.reset(task))
        episode.agent, episode.phone = agent, phone  # the episode's state: the gold actions played

        def verdict(episode: Tau2Env = episode, task: Any = task) -> None:
            inputs = episode.reward_inputs((True,) * len(task.nl_assertions))
            # What the task's reward basis reads (a telecom refuel bill has a random id, so
            # its database never matches the gold one; tau2's basis leaves DB out there).
            assert "DB" not in task.reward_basis or inputs.db_match, task.id
            assert "ENV_ASSERTION" not in task.reward_basis or all(inputs.env_assertions), task.id

        rows["cold"].append(_median_ms(lambda: (domain.gold_cache.clear(), verdict()), 3))
        rows["cached"].append(_median_ms(verdict))
        messages = trajectory(record, actions)
        tau2_rewards.append(evaluate(record, messages))
        rows["tau2"].append(_median_ms(lambda r=record, m=messages: evaluate(r, m), 3))
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
        "reward_env_ms": {
            "turnrl_cold": med["cold"],
            "turnrl_cached": med["cached"],
            "tau2": med["tau2"],
            "speedup_cold": med["tau2"] / med["cold"],
            "speedup_cached": med["tau2"] / med["cached"],
        },
        "hashes_equal_to_tau2": same_hash,
        "tau2_scores_gold_1": all(r == 1.0 for r in tau2_rewards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20, help="tasks per domain")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    result = {name: _domain(name, args.tasks) for name in ("airline", "retail", "telecom")}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
