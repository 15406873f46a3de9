"""The synthetic mini-retail customer-service agent as a plain ``openai`` SDK tool loop.

It knows nothing of training: it talks to whatever OpenAI-compatible endpoint it is given
(turnrl's gateway during a run). Its *environment* is turnrl's synthetic retail store
(``turnrl.tool_envs.tau``): the store's tools run the agent's tool calls, a scripted customer
answers its messages, and the reward is tau-bench's 0/1 task reward.

    uv run apps/agent --agent apps/agent/examples/mini_retail_agent.py:run \\
        --tasks tasks.jsonl --sft-data apps/agent/examples/mini_retail_agent.py:sft_data

    python apps/agent/examples/mini_retail_agent.py --write-tasks tasks.jsonl [--store smoke]

A task is ``{"store": {...}, "index": i, "split": "train" | "heldout"}``: the store's
settings (seed, customers, tasks, kinds, held-out count, tools in the request or not) and the
task's place in it. ``sft_data(tasks)`` gives gold conversations of other generated stores
(never the tasks' own), as the tau app's CPU default trains on.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import openai

from turnrl.tool_envs.tau import TauEnv
from turnrl.tool_envs.tau.data import (
    TaskData,
    TauTaskConfig,
    extra_store_conversations,
    load_tasks_and_domain,
    store_conversations,
    tool_schemas,
)
from turnrl.tool_envs.tau.gold import TaskUser

STORES: dict[str, dict[str, Any]] = {
    # The tau app's cpu-default store: status look-ups and cancellations, 40 held out; SFT on
    # two other stores; no tool schemas in the request (the tiny model learns them in SFT).
    "cpu-default": {"seed": 0, "users": 320, "tasks": 320, "heldout": 40,
                    "kinds": ["status", "cancel"], "sft_stores": 2, "tools": False},
    "smoke": {"seed": 0, "users": 24, "tasks": 12, "heldout": 4,
              "kinds": ["status", "cancel"], "sft_stores": 1, "tools": False},
}  # fmt: skip
MAX_TURNS = 8


def _settings(store: dict[str, Any]) -> TauTaskConfig:
    return TauTaskConfig(
        domain="synthetic",
        synthetic_seed=store["seed"],
        synthetic_num_users=store["users"],
        synthetic_num_tasks=store["tasks"],
        synthetic_kinds=list(store["kinds"]),
        num_heldout=store["heldout"],
        policy_in_prompt=False,
    )


@functools.cache
def _store(key: str) -> TaskData:
    return load_tasks_and_domain(_settings(json.loads(key)))


def _tools(store: dict[str, Any], always: bool = False) -> list[dict[str, Any]]:
    """The store's tool schemas when it sends them (or ``always``: a framework runs them)."""
    return (
        tool_schemas(_store(json.dumps(store, sort_keys=True)), short=True)
        if store["tools"] or always
        else []
    )


async def run(task: dict[str, Any], endpoint: Any) -> float:
    """Serve the task's customer; returns the task reward (1.0 solved, else 0.0)."""
    store = task["store"]
    data = _store(json.dumps(store, sort_keys=True))
    env = TauEnv(data.domain, TaskUser())
    messages: list[Any] = await env.reset((data.train + data.heldout)[task["index"]])
    tools = _tools(store)
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
    try:
        for _ in range(MAX_TURNS):
            try:
                response = await client.chat.completions.create(
                    model=endpoint.model, messages=messages, **({"tools": tools} if tools else {})
                )
            except openai.APIStatusError as exc:
                if exc.status_code == 413:  # the conversation outgrew the context: it ends here
                    break
                raise
            message = response.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            step = await env.step(message)
            messages += step.observations
            if step.done:
                break
    finally:
        await client.close()
    return float(env.reward().reward)


def sft_data(tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """Gold conversations of ``sft_stores`` other stores to train on; a further store's to probe."""
    store = tasks[0]["store"]
    settings = _settings(store)
    return {
        "chats": extra_store_conversations(settings, store["sft_stores"]),
        "probe": store_conversations(settings, store["sft_stores"] + 1),
        "tools": _tools(store) or None,
    }


def write_tasks(path: Path, store_name: str) -> int:
    """Write the store's tasks, one JSON line each; returns how many."""
    store = STORES[store_name]
    data = _store(json.dumps(store, sort_keys=True))
    lines = [
        json.dumps(
            {"store": store, "index": i, "split": "train" if i < len(data.train) else "heldout"}
        )
        for i in range(len(data.train) + len(data.heldout))
    ]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-tasks", type=Path, required=True, help="the JSONL file to write")
    parser.add_argument("--store", choices=sorted(STORES), default="cpu-default")
    args = parser.parse_args()
    print(f"{write_tasks(args.write_tasks, args.store)} tasks written to {args.write_tasks}")
