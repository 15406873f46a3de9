"""TauEnv: a tau-bench retail/airline episode behind turnrl's :class:`Environment` protocol.

``reset(task)`` starts a fresh copy-on-write database and returns the policy (system)
and the simulated user's first message. ``step(assistant)`` takes the model's turn in
OpenAI format: every entry of ``tool_calls`` (``arguments`` as JSON strings) runs with
tau-bench's semantics and answers with a ``tool`` message; a turn without tool calls is
a message to the user (tau-bench's ``respond``) and is answered by the user simulator.
The episode ends when the user says ``###STOP###``, the agent calls
``transfer_to_human_agents`` or the user simulator fails.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.rewards.result import Reward
from turnrl.rewards.tau import TauRewardInput, tau_reward
from turnrl.tool_envs.protocol import Message, StepResult, UserSimulator
from turnrl.tool_envs.tau.domain import TauDomain
from turnrl.tool_envs.tau.tasks import Task
from turnrl.tool_envs.tau.toolkit import RESPOND_ACTION, TRANSFER_TOOL
from turnrl.tool_envs.tool_calls import ToolCall, from_openai_tool_calls
from turnrl.tool_envs.tools import ToolSet

STOP_MARKER = "###STOP###"
"""Text in a user reply that ends the episode."""


@dataclass
class TauEnvConfig:
    """How a :class:`TauEnv` treats the model's turns."""

    execute_all_tool_calls: bool = True
    """Run every tool call of a turn (True) or only the first, like tau-bench's own agent
    (False; the others are answered with an error and not run)."""
    include_reward_inputs: bool = True
    """Put :meth:`TauEnv.reward_inputs` into ``info`` of the final step (costs one hash)."""


class TauEnv:
    """One tau-bench episode at a time; create one per concurrent episode."""

    def __init__(
        self,
        domain: TauDomain,
        user: UserSimulator,
        tasks: Sequence[Task] = (),
        config: TauEnvConfig | None = None,
    ) -> None:
        """Args:
        domain: The shared domain (data, tools, policy).
        user: The user simulator for this episode.
        tasks: Tasks that ``reset`` may address by index.
        config: Episode options.
        """
        self.domain = domain
        self.user = user
        self.tasks = list(tasks)
        self.config = config or TauEnvConfig()
        self.tools: list[dict[str, Any]] = domain.schemas
        self._checker = domain.toolset(domain.new_database())
        self.task: Task | None = None
        self.db = domain.new_database()
        self.actions: list[dict[str, Any]] = []
        self.agent_messages: list[str] = []
        self.done = False
        self.user_error: str | None = None
        self._counts = _zero_counts()
        self._user_s = 0.0
        """Seconds the current step spent in the user simulator (``info["user_s"]``)."""

    async def reset(self, task: Task | int) -> list[Message]:
        """Start an episode: fresh database, the policy as system prompt, the user's opening."""
        if isinstance(task, int):
            if not 0 <= task < len(self.tasks):
                raise IndexError(f"task index {task} out of range (have {len(self.tasks)} tasks)")
            task = self.tasks[task]
        if not isinstance(task, Task):
            raise TypeError(f"reset() takes a Task or a task index, got {type(task).__name__}")
        self.task = task
        self.db = self.domain.new_database()
        self.actions, self.agent_messages, self.done = [], [], False
        self.user_error = None
        self._counts = _zero_counts()
        first = await self.user.reset(task.instruction)
        return [{"role": "system", "content": self.domain.wiki}, {"role": "user", "content": first}]

    @property
    def toolset(self) -> ToolSet:
        """The tools as a :class:`ToolSet` acting on this episode's database."""
        return self.domain.toolset(self.db)

    async def step(self, assistant: Message) -> StepResult:
        """Apply the model's turn; see the module docstring for the rules."""
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("the episode is over; call reset() to start another")
        parsed = from_openai_tool_calls(list(assistant.get("tool_calls") or []))
        errors = [str(e) for e in assistant.get("tool_call_errors") or []] + parsed.errors
        counts = _zero_counts()
        self._user_s = 0.0
        counts["malformed"] = len(errors)
        counts["failed"] = len(errors)
        observations: list[Message] = [{"role": "tool", "content": f"Error: {e}"} for e in errors]
        reason = None
        for index, call in enumerate(parsed.tool_calls):
            skip = "the episode already ended" if reason else None
            if index > 0 and not self.config.execute_all_tool_calls:
                skip = "only the first tool call of a turn is executed"
            if skip:
                observations.append(_tool_message(call, f"Error: not executed: {skip}"))
                counts["failed"] += 1
                continue
            observations.append(_tool_message(call, self._run(call, counts)))
            if call.name == TRANSFER_TOOL:
                reason = "transfer"
        if not parsed.tool_calls and not errors:
            reason = await self._respond(str(assistant.get("content") or ""), observations)
        for key, value in counts.items():
            self._counts[key] += value
        self.done = reason is not None
        info: dict[str, Any] = {
            "tool_calls": counts,
            "episode_tool_calls": dict(self._counts),
            "agent_messages": list(self.agent_messages),
            "done_reason": reason,
            "user_s": self._user_s,
        }
        if self.user_error is not None:
            info["user_error"] = self.user_error
        if self.done and self.config.include_reward_inputs and reason != "user_error":
            info["reward_inputs"] = self.reward_inputs()
        return StepResult(observations=observations, done=self.done, info=info)

    def _run(self, call: ToolCall, counts: dict[str, int]) -> str:
        self.actions.append({"name": call.name, "kwargs": call.arguments})
        well_formed = not self._checker.check(call)
        observation = self.domain.invoke(self.db, call.name, call.arguments)
        ok = call.name in self.domain.tools and not observation.startswith("Error:")
        counts["well_formed" if well_formed else "malformed"] += 1
        counts["ok" if ok else "failed"] += 1
        return observation

    async def _respond(self, content: str, observations: list[Message]) -> str | None:
        """Send the agent's message to the user; returns the done reason or ``None``."""
        self.actions.append({"name": RESPOND_ACTION, "kwargs": {"content": content}})
        self.agent_messages.append(content)
        start = time.perf_counter()
        try:
            reply = await self.user.respond(content)
        except Exception as exc:  # a user-simulator failure ends the episode, not the run
            observations.append({"role": "user", "content": ""})
            self.user_error = f"{type(exc).__name__}: {exc}"
            return "user_error"
        finally:
            self._user_s += time.perf_counter() - start
        observations.append({"role": "user", "content": reply})
        return "user_stop" if STOP_MARKER in reply else None

    def data_hash(self) -> str:
        """tau-bench data hash of the episode's current database."""
        return self.db.data_hash()

    def gt_hash(self) -> str:
        """Ground-truth hash of the current task (gold actions on a fresh copy; cached)."""
        if self.task is None:
            raise RuntimeError("no task: call reset() first")
        return self.domain.gt_hash(self.task)

    def reward_inputs(self) -> TauRewardInput:
        """What the tau reward needs from the episode so far (turnrl-rewards' typed input)."""
        if self.task is None:
            raise RuntimeError("no task: call reset() first")
        well_formed = self._counts["well_formed"]
        return TauRewardInput(
            final_data_hash=self.data_hash(),
            gt_data_hash=self.gt_hash(),
            outputs=tuple(self.task.outputs),
            agent_messages=tuple(self.agent_messages),
            num_well_formed_tool_calls=well_formed,
            num_successful_tool_calls=min(self._counts["ok"], well_formed),
        )

    def reward(self) -> Reward:
        """tau-bench's 0/1 reward of the episode so far (``turnrl.rewards.tau_reward``)."""
        return tau_reward(self.reward_inputs())


def _zero_counts() -> dict[str, int]:
    return {"ok": 0, "failed": 0, "well_formed": 0, "malformed": 0}


def _tool_message(call: ToolCall, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
