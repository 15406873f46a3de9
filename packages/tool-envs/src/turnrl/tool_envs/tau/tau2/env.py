"""Tau2Env: a tau2-bench episode behind turnrl's :class:`Environment` protocol.

``reset(task)`` builds fresh toolkits, applies the task's ``initial_state`` (data merged in,
initialisation functions run, ``sync_tools`` after each) and returns the system prompt,
tau2's opening agent message ("Hi! How can I help you today?") and the user's first reply.
``step(assistant)`` routes the model's turn as tau2's orchestrator does: every tool call
runs on the agent's toolkit (a user tool, an unknown tool or bad arguments come back as an
``Error: ...`` tool message, and the episode goes on) with ``sync_tools`` after each; a
turn without tool calls is a message to the user.

Dual control (telecom): a user reply may itself be a message with ``tool_calls`` (OpenAI
format); they run on the user's toolkit (limited to the task's ``user_tools``) and their
results go back to the user through ``user.tool_results(messages)`` until it answers in
text. The agent never sees the user's tool calls, the user never sees the agent's.

Endings (tau2's termination reasons): ``user_stop`` (``###STOP###``, ``###TRANSFER###`` or
``###OUT-OF-SCOPE###`` in a user text), ``max_steps`` (routing steps, each agent message,
user message or batch of tool results counting one) and ``too_many_errors`` (error tool
results summed over the episode). Only ``user_stop`` is evaluated; the others score 0. A
user simulator that fails raises out of ``step`` (the rollout marks the episode
``failed``: an infrastructure fault, never scored).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from turnrl.rewards.result import Reward
from turnrl.rewards.tau2 import Tau2RewardInput, tau2_reward
from turnrl.tool_envs.protocol import Message, StepResult, UserSimulator
from turnrl.tool_envs.tau.tau2.domain import Tau2Domain, side
from turnrl.tool_envs.tau.tau2.tasks import Tau2Task
from turnrl.tool_envs.tau.tau2.toolkit import state_hash
from turnrl.tool_envs.tool_calls import ToolCall, from_openai_tool_calls

GREETING = "Hi! How can I help you today?"
STOP_MARKERS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")


@dataclass
class Tau2EnvConfig:
    """tau2's episode limits."""

    max_steps: int = 200
    """Routing steps before the episode ends as ``max_steps`` (tau2's CLI default)."""
    max_errors: int = 10
    """Error tool results (summed, never reset) before it ends as ``too_many_errors``."""
    max_user_tool_rounds: int = 20
    """Rounds of user tool calls in a row before the user's turn counts as failed."""


class Tau2Env:
    """One tau2 episode at a time; create one per concurrent episode."""

    def __init__(
        self, domain: Tau2Domain, user: UserSimulator, config: Tau2EnvConfig | None = None
    ) -> None:
        self.domain = domain
        self.user = user
        self.config = config or Tau2EnvConfig()
        self.tools: list[dict[str, Any]] = domain.new_tools().schemas()
        self.task: Tau2Task | None = None
        self.done = False

    async def reset(self, task: Tau2Task) -> list[Message]:
        """Start an episode of ``task``; returns [system, opening agent message, user reply]."""
        if not isinstance(task, Tau2Task):
            raise TypeError(f"reset() takes a Tau2Task, got {type(task).__name__}")
        self.task = task
        self.agent, self.phone = self.domain.start(task)
        self.tool_calls: list[tuple[str, dict[str, Any]]] = []
        self.agent_messages: list[str] = []
        self.conversation: list[Message] = [{"role": "assistant", "content": GREETING}]
        self.steps, self.errors, self.done = 1, 0, False
        self.ending: str | None = None
        self._user_s = 0.0
        if hasattr(self.user, "use_tools"):
            self.user.use_tools(self._user_schemas())
        first = await self.user.reset(task.scenario)
        opening: list[Message] = [
            {"role": "system", "content": self.domain.system_prompt},
            {"role": "assistant", "content": GREETING},
        ]
        reply = await self._user_turn(first, [])
        return opening + reply

    def _user_schemas(self) -> list[dict[str, Any]]:
        if self.phone is None:
            return []
        allowed = self.task.user_tools if self.task else None
        return [
            s for s in self.phone.schemas() if allowed is None or s["function"]["name"] in allowed
        ]

    async def step(self, assistant: Message) -> StepResult:
        """Apply the model's turn; see the module docstring for the routing."""
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("the episode is over; call reset() to start another")
        parsed = from_openai_tool_calls(list(assistant.get("tool_calls") or []))
        errors = [str(e) for e in assistant.get("tool_call_errors") or []] + parsed.errors
        self._user_s = 0.0
        observations: list[Message]
        if parsed.tool_calls or errors:
            observations = [{"role": "tool", "content": f"Error: {e}"} for e in errors]
            self.errors += len(errors)
            for call in parsed.tool_calls:
                observations.append(self._agent_call(call))
            self.conversation += [dict(assistant), *observations]
            self.steps += 2
        else:
            content = str(assistant.get("content") or "")
            self.agent_messages.append(content)
            self.conversation.append({"role": "assistant", "content": content})
            self.steps += 1
            observations = await self._user_turn(None, [content])
        if self.ending is None and self.errors >= self.config.max_errors:
            self.ending = "too_many_errors"
        if self.ending is None and self.steps >= self.config.max_steps:
            self.ending = "max_steps"
        self.done = self.ending is not None
        info: dict[str, Any] = {
            "done_reason": self.ending,
            "errors": self.errors,
            "user_s": self._user_s,
        }
        return StepResult(observations=observations, done=self.done, info=info)

    def _agent_call(self, call: ToolCall) -> Message:
        self.tool_calls.append((call.name, call.arguments))
        text, error = self._synced(self.agent.call(call.name, call.arguments))
        self.errors += int(error)
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}

    async def _user_turn(self, reply: Any, agent_text: list[str]) -> list[Message]:
        """Get the user's text answer (running its tool calls); returns it as observations."""
        start = time.perf_counter()
        try:  # a user-simulator failure propagates: the episode fails, unscored
            if reply is None:
                reply = await self.user.respond(agent_text[0])
            for _ in range(self.config.max_user_tool_rounds):
                if isinstance(reply, str):
                    break
                results = self._user_calls(reply)
                user_call = {
                    "role": "user",
                    "content": reply.get("content"),
                    "tool_calls": reply.get("tool_calls"),
                }
                self.conversation += [user_call, *results]  # the judge sees them, as in tau2
                reply = await self.user.tool_results(results)  # type: ignore[attr-defined]
        finally:
            self._user_s = time.perf_counter() - start
        if not isinstance(reply, str):
            raise RuntimeError(
                f"the user made tool calls {self.config.max_user_tool_rounds} times in a row"
            )
        self.conversation.append({"role": "user", "content": reply})
        self.steps += 1
        if any(marker in reply for marker in STOP_MARKERS):
            self.ending = "user_stop"
        return [{"role": "user", "content": reply}]

    def _user_calls(self, message: Any) -> list[Message]:
        """Run a user turn's tool calls on the phone; their results, for the user only."""
        parsed = from_openai_tool_calls(list(message.get("tool_calls") or []))
        allowed = {s["function"]["name"] for s in self._user_schemas()}
        results: list[Message] = [{"role": "tool", "content": f"Error: {e}"} for e in parsed.errors]
        self.errors += len(parsed.errors)
        for call in parsed.tool_calls:
            self.tool_calls.append((call.name, call.arguments))
            if self.phone is None or call.name not in allowed:
                text, error = f"Error: Tool '{call.name}' not found.", True
            else:
                text, error = self._synced(self.phone.call(call.name, call.arguments))
            self.errors += int(error)
            results.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}
            )
        self.steps += 2
        return results

    def _synced(self, result: tuple[str, bool]) -> tuple[str, bool]:
        """tau2 syncs after a call that succeeded; a sync that raises is the call's error."""
        if result[1]:
            return result
        try:
            self.domain.sync(self.agent, self.phone)
        except Exception as exc:
            return f"Error: {exc}", True
        return result

    def gold_hashes(self) -> tuple[str, str | None]:
        """The agent and user database hashes the task's gold actions produce (cached per task)."""
        task = self._require_task()
        cached = self.domain.gold_cache.get(task.id)
        if cached is None:
            agent, phone = self.domain.start(task)
            for action, side in zip(task.gold_actions, task.gold_requestors, strict=True):
                kit = phone if side == "user" else agent
                try:
                    if kit is None:
                        raise ValueError("no user tools")
                    kit.use(action.name, dict(action.arguments))
                except Exception:  # tau2 logs and skips a failing gold action
                    continue
            cached = (agent.db_hash(), None if phone is None else phone.db_hash())
            self.domain.gold_cache[task.id] = cached
        return cached

    def assertions(self) -> tuple[bool, ...]:
        """Whether each of the task's environment assertions holds on the current state."""
        task = self._require_task()
        results = []
        for check in task.env_assertions or ():
            value = side(self.agent, self.phone, check).run_function(check.name, check.arguments)
            self.domain.sync(self.agent, self.phone)
            if not isinstance(value, bool):
                raise TypeError(f"assertion {check.name} returned {type(value).__name__}, not bool")
            results.append(value == check.assert_value)
        return tuple(results)

    def reward_inputs(self, nl_verdicts: tuple[bool, ...] | None = None) -> Tau2RewardInput:
        """What the tau2 reward needs from the episode so far (``nl_verdicts``: the judge's)."""
        task = self._require_task()
        db_match = None
        if task.compares_db:
            agent_hash, user_hash = self.gold_hashes()
            mine = None if self.phone is None else state_hash(self.phone.state())
            db_match = self.agent.db_hash() == agent_hash and mine == user_hash
        return Tau2RewardInput(
            ending=self.ending or "truncated",
            has_criteria=task.has_criteria,
            reward_basis=task.reward_basis,
            db_match=db_match,
            env_assertions=self.assertions(),
            communicate_info=task.communicate_info,
            agent_messages=tuple(self.agent_messages),
            nl_assertions=task.nl_assertions,
            nl_verdicts=nl_verdicts,
            gold_actions=task.gold_actions,
            tool_calls=tuple(self.tool_calls),
        )

    def reward(self, nl_verdicts: tuple[bool, ...] | None = None) -> Reward:
        """tau2's 0/1 reward of the episode so far."""
        return tau2_reward(self.reward_inputs(nl_verdicts))

    def _require_task(self) -> Tau2Task:
        if self.task is None:
            raise RuntimeError("no task: call reset() first")
        return self.task
