"""tau2-bench's episode reward: the product of the components a task's ``reward_basis`` names.

Each component is 0 or 1 (``shared/tau2-bench/README.md``, "Reward components"):

- ``DB``: the agent database (and the user database, where the user has tools) equals the
  one the task's gold actions produce; the environment compares the hashes and passes
  the verdict in (``db_match``).
- ``ENV_ASSERTION``: every assertion the task makes on the final state held (results
  passed in by the environment).
- ``COMMUNICATE``: every ``communicate_info`` string appears in some agent message (the
  same test as tau-bench's outputs: lower-cased, commas removed from the message).
- ``NL_ASSERTION``: every natural-language assertion was judged met by an LLM judge
  (prompt :func:`nl_judge_messages`, answer :func:`parse_nl_verdicts`); verdicts passed in.
- ``ACTION``: every gold action matches some tool call of the trajectory (agent or user):
  same name and equal arguments on ``compare_args`` (``None``: the call's own keys; ``[]``:
  the name alone).

An episode that did not end by the user or the agent stopping scores 0 and is not
evaluated; a task without evaluation criteria scores 1. A component outside the basis is
still computed when its inputs are there, for the breakdown only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnrl.rewards.result import Reward
from turnrl.rewards.tau import output_found

COMPONENTS = ("DB", "ENV_ASSERTION", "COMMUNICATE", "NL_ASSERTION", "ACTION")
"""The reward components tau2 defines, as they are named in ``reward_basis``."""
DEFAULT_BASIS = ("DB", "COMMUNICATE")
"""The basis of a task whose ``evaluation_criteria`` has no ``reward_basis``."""
EVALUATED_ENDINGS = ("user_stop", "agent_stop")
"""Episode endings that are scored; any other ending (limits, errors) scores 0."""


@dataclass(frozen=True)
class GoldAction:
    """One action of a task's reference solution."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    compare_args: tuple[str, ...] | None = None
    """The argument names compared; ``None``: those of the tool call; ``()``: none."""

    def matches(self, name: str, arguments: Mapping[str, Any]) -> bool:
        """tau2's ``compare_with_tool_call``."""
        if name != self.name:
            return False
        keys = set(arguments) if self.compare_args is None else set(self.compare_args)
        if not keys:
            return True
        mine = {k: v for k, v in self.arguments.items() if k in keys}
        theirs = {k: v for k, v in arguments.items() if k in keys}
        return mine == theirs


@dataclass(frozen=True)
class Tau2RewardInput:
    """What the tau2 reward needs from one finished episode."""

    ending: str
    """How the episode ended: ``user_stop``, ``agent_stop``, ``max_steps``, ``too_many_errors``, ..."""
    has_criteria: bool = True
    """False when the task has no ``evaluation_criteria`` (it then scores 1)."""
    reward_basis: tuple[str, ...] = DEFAULT_BASIS
    db_match: bool | None = None
    """Agent and user databases equal the gold ones; ``None`` when not compared (scores 1)."""
    env_assertions: tuple[bool, ...] = ()
    """Whether each environment assertion of the task held on the final state."""
    communicate_info: tuple[str, ...] = ()
    agent_messages: tuple[str, ...] = ()
    """The agent's text messages to the user."""
    nl_assertions: tuple[str, ...] = ()
    nl_verdicts: tuple[bool, ...] | None = None
    """The judge's verdicts, one per returned result; ``None`` when not judged."""
    gold_actions: tuple[GoldAction, ...] = ()
    tool_calls: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    """``(name, arguments)`` of every tool call of the trajectory, agent's and user's."""

    def __post_init__(self) -> None:
        unknown = [b for b in self.reward_basis if b not in COMPONENTS]
        if unknown:
            raise ValueError(f"unknown reward basis {unknown}; expected some of {list(COMPONENTS)}")
        if "NL_ASSERTION" in self.reward_basis and self.nl_assertions and self.nl_verdicts is None:
            raise ValueError(
                "NL_ASSERTION is in the reward basis and the task has nl_assertions, "
                "but no judge verdicts were given"
            )


def tau2_reward(episode: Tau2RewardInput) -> Reward:
    """The 0/1 reward of one episode, with every component in the breakdown.

    The breakdown has ``basis``, one ``r_<component>`` per component that could be
    computed, the partial checks (``communicate``: {info: found}, ``actions``: [matched],
    ``env_assertions``, ``nl_verdicts``) and ``ending``.
    """
    breakdown: dict[str, Any] = {"ending": episode.ending, "basis": list(episode.reward_basis)}
    if episode.ending not in EVALUATED_ENDINGS:
        breakdown["note"] = f"not evaluated: the episode ended by {episode.ending}"
        return Reward(0.0, breakdown)
    if not episode.has_criteria:
        breakdown["note"] = "the task has no evaluation criteria"
        return Reward(1.0, breakdown)
    parts = _components(episode, breakdown)
    reward = 1.0
    for name in episode.reward_basis:
        reward *= parts[name]
    return Reward(reward, breakdown)


def _components(episode: Tau2RewardInput, breakdown: dict[str, Any]) -> dict[str, float]:
    parts: dict[str, float] = {}
    parts["DB"] = 1.0 if episode.db_match in (None, True) else 0.0
    parts["ENV_ASSERTION"] = 1.0 if all(episode.env_assertions) else 0.0
    found = {s: output_found(s, episode.agent_messages) for s in episode.communicate_info}
    parts["COMMUNICATE"] = 1.0 if all(found.values()) else 0.0
    matched = [
        any(g.matches(name, args) for name, args in episode.tool_calls)
        for g in episode.gold_actions
    ]
    parts["ACTION"] = 1.0 if all(matched) else 0.0
    verdicts = episode.nl_verdicts
    if episode.nl_assertions and verdicts is not None:
        parts["NL_ASSERTION"] = 1.0 if all(verdicts) else 0.0
    elif not episode.nl_assertions:
        parts["NL_ASSERTION"] = 1.0
    breakdown.update({f"r_{name.lower()}": value for name, value in parts.items()})
    breakdown.update(
        db_match=episode.db_match,
        env_assertions=list(episode.env_assertions),
        communicate=found,
        actions=matched,
        nl_verdicts=None if verdicts is None else list(verdicts),
    )
    return parts


def parse_gold_actions(actions: Sequence[Mapping[str, Any]] | None) -> tuple[GoldAction, ...]:
    """Gold actions from a task's ``evaluation_criteria.actions`` records."""
    out = []
    for record in actions or ():
        compare = record.get("compare_args")
        out.append(
            GoldAction(
                name=str(record["name"]),
                arguments=dict(record.get("arguments") or {}),
                compare_args=None if compare is None else tuple(compare),
            )
        )
    return tuple(out)


NL_JUDGE_SYSTEM = """You grade a customer-service conversation against a list of expected \
outcomes. The conversation, recorded in a test, is between an agent and a customer; tool \
calls and results may appear in it. For each expected outcome decide on its own whether the \
agent's behaviour satisfies it.

Answer with one JSON object and nothing else:
{"results": [{"expectedOutcome": "<the outcome, repeated>", "reasoning": "<a short \
explanation>", "metExpectation": true or false}, ...]}
with one entry per expected outcome, in the order given."""


def nl_judge_messages(
    conversation: Sequence[Mapping[str, Any]], assertions: Sequence[str]
) -> list[dict[str, str]]:
    """The chat sent to the NL-assertion judge: the conversation as ``role: content`` lines
    (tool messages included, as tau2 renders it) and the expected outcomes."""
    lines = "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in conversation)
    outcomes = "\n".join(f"- {a}" for a in assertions)
    user = f"conversation:\n{lines}\n\nexpectedOutcomes:\n{outcomes}"
    return [{"role": "system", "content": NL_JUDGE_SYSTEM}, {"role": "user", "content": user}]


class JudgeFormatError(ValueError):
    """The judge's answer is not the JSON the prompt asks for."""


def parse_nl_verdicts(text: str, assertions: Sequence[str]) -> tuple[bool, ...]:
    """The judge's verdicts, one per assertion, from its JSON answer.

    Fenced code (```json ... ```) around the object is accepted. An answer with fewer
    results than assertions, or a result without a boolean ``metExpectation``, is a
    :class:`JudgeFormatError` (tau2 would count only the results returned; a missing
    verdict is not a pass here).
    """
    body = text.strip()
    if body.startswith("```"):
        body = body.strip("`")
        body = body[4:] if body.startswith("json") else body
    start, end = body.find("{"), body.rfind("}")
    try:
        data = json.loads(body[start : end + 1]) if start >= 0 else None
    except json.JSONDecodeError as exc:
        raise JudgeFormatError(f"the judge's answer is not JSON: {exc}") from exc
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise JudgeFormatError("the judge's answer has no 'results' list")
    verdicts = []
    for index, result in enumerate(results):
        met = result.get("metExpectation") if isinstance(result, dict) else None
        if not isinstance(met, bool):
            raise JudgeFormatError(f"result {index} has no boolean 'metExpectation'")
        verdicts.append(met)
    if len(verdicts) < len(assertions):
        raise JudgeFormatError(
            f"the judge returned {len(verdicts)} results for {len(assertions)} assertions"
        )
    return tuple(verdicts[: len(assertions)])
