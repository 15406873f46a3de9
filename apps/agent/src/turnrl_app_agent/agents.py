"""The user's agent and tasks: loading them, and running the agent once against an endpoint.

An agent is ``async def run(task: dict, endpoint: Endpoint) -> float`` (``--agent
module:function`` or ``path/file.py:function``) or a command (``--agent-command``) run once
per episode with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``,
``ANTHROPIC_API_KEY``, ``TURNRL_MODEL`` and ``TURNRL_TASK`` (the task as JSON) set; its
reward is the last stdout line, ``{"reward": x}``. Anything else raises :class:`AgentError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import random
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl_app_agent.config import APP_DIR, AgentSettings


class AgentError(RuntimeError):
    """The agent failed an episode (raised, exited non-zero, gave no reward, timed out)."""


@dataclass(frozen=True)
class Endpoint:
    """Where an agent's model calls go: one gateway session."""

    base_url: str
    """OpenAI base URL (``.../sessions/<id>/v1``)."""
    api_key: str
    """The session's key (also accepted as the Anthropic ``x-api-key``)."""
    anthropic_base_url: str
    """Anthropic base URL (``.../sessions/<id>``)."""
    model: str
    """The model name to send."""


Agent = Callable[[dict[str, Any], Endpoint], Awaitable[float]]


def locate(path: str, what: str) -> Path:
    """``path`` as given, or under apps/agent (the presets name the examples so)."""
    for candidate in (Path(path), APP_DIR / path):
        if candidate.exists():
            return candidate
    raise ValueError(f"{what} {path}: no such file")


def load_callable(spec: str, flag: str) -> Callable[..., Any]:
    """The function ``module:function`` or ``path/file.py:function`` names."""
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(f"{flag} {spec!r}: expected module:function or path/file.py:function")
    try:
        if module.endswith(".py"):
            found = importlib.util.spec_from_file_location("agent", locate(module, flag))
            assert found is not None and found.loader is not None
            loaded = importlib.util.module_from_spec(found)
            found.loader.exec_module(loaded)
        else:
            loaded = importlib.import_module(module)
        function = getattr(loaded, name)
    except (ImportError, AttributeError, OSError, SyntaxError) as exc:
        raise ValueError(f"{flag} {spec}: cannot load it ({type(exc).__name__}: {exc})") from None
    if not callable(function):
        raise ValueError(f"{flag} {spec}: a {type(function).__name__}, not a function")
    return function


def load_agent(settings: AgentSettings) -> Agent:
    """The agent the settings name, as a coroutine function (a command wrapped in one).

    Raises:
        ValueError: neither or both given, or an ``--agent`` that is not a coroutine function.
    """
    if settings.agent_command:
        command, timeout = settings.agent_command, settings.agent_timeout
        return lambda task, endpoint: run_command(command, task, endpoint, timeout)
    if not settings.agent:
        raise ValueError("no agent: give --agent module:function or --agent-command 'cmd ...'")
    function = load_callable(settings.agent, "--agent")
    if not inspect.iscoroutinefunction(function):
        raise ValueError(
            f"--agent {settings.agent}: must be `async def run(task, endpoint) -> float`"
        )
    return function


async def run_command(
    command: str, task: dict[str, Any], endpoint: Endpoint, timeout: float
) -> float:
    """Run ``command`` for one episode; its reward from the last stdout line."""
    env = {
        **os.environ,
        "OPENAI_BASE_URL": endpoint.base_url,
        "OPENAI_API_KEY": endpoint.api_key,
        "ANTHROPIC_BASE_URL": endpoint.anthropic_base_url,
        "ANTHROPIC_API_KEY": endpoint.api_key,
        "TURNRL_MODEL": endpoint.model,
        "TURNRL_TASK": json.dumps(task),
    }
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_shell(
        command, env=env, stdout=pipe, stderr=pipe, start_new_session=True
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:  # timed out or cancelled: the command and its children go
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-500:]
        raise AgentError(f"agent command exited with {proc.returncode}: {tail}")
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        reward = json.loads(lines[-1])["reward"] if lines else None
    except (ValueError, TypeError, KeyError):
        reward = None
    if not isinstance(reward, int | float) or isinstance(reward, bool):
        last = lines[-1][:200] if lines else "(no output)"
        raise AgentError(f'agent command printed no {{"reward": <number>}} last line: {last}')
    return float(reward)


def load_tasks(
    settings: AgentSettings, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) tasks: ``"split": "heldout"`` marks held-out ones; without any, the
    last ``heldout_fraction`` of a seeded shuffle is held out.

    Raises:
        ValueError: no ``--tasks``, a line that is not a JSON object, or no task to train on.
    """
    if not settings.tasks:
        raise ValueError("no tasks: give --tasks file.jsonl (one JSON object a line)")
    path = locate(settings.tasks, "--tasks")
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(tasks[-1], dict):
                raise ValueError(f"{path}:{number}: a task must be a JSON object")
    heldout = [t for t in tasks if t.get("split") == "heldout"]
    train = [t for t in tasks if t.get("split") != "heldout"]
    if not heldout and settings.heldout_fraction:
        random.Random(seed).shuffle(train)
        cut = len(train) - max(1, round(len(train) * settings.heldout_fraction))
        train, heldout = train[:cut], train[cut:]
    if not train:
        raise ValueError(f"{path}: no tasks to train on ({len(heldout)} held out)")
    return train, heldout
