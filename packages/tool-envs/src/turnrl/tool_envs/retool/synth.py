"""Generated CPU data: problems whose answers need computation, and ReTool-style SFT chats.

Each problem is an arithmetic expression over two to three operands (plain, or dressed as a
short word problem: boxes of apples, a shop's prices, a runner's laps) with an integer
answer too large to guess. Its SFT trajectory is what ReTool teaches:

    user:       the problem + "put your final answer within \\boxed{}"
    assistant:  one line of reasoning, then a <tool_call> to code_interpreter with Python
    tool:       the interpreter's output (computed here exactly as the sandbox prints it)
    assistant:  "The result is \\boxed{<answer>}."

Everything is deterministic given the seed; training and held-out problems come from
disjoint seeds and never share an expression.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from turnrl.tool_envs.retool.data import CODE_TOOL, MathTask

DATA_SOURCE = "synth_arith"

_ITEMS = ("apples", "books", "coins", "cards", "stones", "pens", "boxes", "shells")
_NAMES = ("Ana", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gia", "Hugo")


@dataclass(frozen=True)
class SynthProblem:
    """One generated problem: its statement, the code that solves it and the answer."""

    problem: str
    """The problem as the user states it."""
    expression: str
    """The Python expression computing the answer (what the tool call prints)."""
    answer: int
    """The exact answer."""

    def task(self, index: int) -> MathTask:
        """As a :class:`MathTask` (data source ``synth_arith``)."""
        return MathTask(self.problem, str(self.answer), DATA_SOURCE, index)


def _operands(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(11, 99) for _ in range(count)]


def make_problem(rng: random.Random) -> SynthProblem:
    """One problem drawn from ``rng`` (five templates, two of them plain arithmetic)."""
    kind = rng.randrange(5)
    a, b, c = _operands(rng, 3)
    item, name = rng.choice(_ITEMS), rng.choice(_NAMES)
    if kind == 0:
        expr = f"{a} * {b}"
        text = f"What is {a} * {b}?"
    elif kind == 1:
        expr = f"{a} * {b} + {c}"
        text = f"Compute {a} * {b} + {c}."
    elif kind == 2:
        expr = f"{a} * {b}"
        text = f"{name} has {a} bags with {b} {item} in each bag. How many {item} in total?"
    elif kind == 3:
        expr = f"{a} * {b} - {c}"
        text = f"A shop sells {a} {item} at {b} coins each and gives {c} coins back. How many coins does it keep?"
    else:
        expr = f"{a} * {b} + {a} * {c}"
        text = f"{name} runs {a} laps of {b} meters and {a} laps of {c} meters. How many meters in total?"
    return SynthProblem(text, expr, int(eval(expr, {"__builtins__": {}})))  # only our own digits


def make_problems(num: int, seed: int, exclude: set[str] | None = None) -> list[SynthProblem]:
    """``num`` distinct problems from ``seed``, none whose expression is in ``exclude``."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    rng = random.Random(seed)
    seen: set[str] = set(exclude or ())
    out: list[SynthProblem] = []
    for _ in range(num * 50 + 100):
        if len(out) == num:
            return out
        p = make_problem(rng)
        if p.expression not in seen:
            seen.add(p.expression)
            out.append(p)
    raise RuntimeError(f"could not draw {num} distinct problems")  # not reachable for sane num


def train_and_heldout(
    num_train: int, num_heldout: int, seed: int
) -> tuple[list[SynthProblem], list[SynthProblem]]:
    """Training and held-out problems from disjoint seeds with no expression in common."""
    train = make_problems(num_train, seed * 2 + 1)
    heldout = make_problems(num_heldout, seed * 2 + 2, exclude={p.expression for p in train})
    return train, heldout


def sft_chat(
    problem: SynthProblem, instruction: str, call_id: str = "call-0"
) -> list[dict[str, Any]]:
    """The ReTool-style SFT conversation of one problem (user, assistant+tool call, tool, answer)."""
    code = f"print({problem.expression})"
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": CODE_TOOL, "arguments": {"code": code}},
    }
    return [
        {"role": "user", "content": f"{problem.problem}\n\n{instruction}"},
        {"role": "assistant", "content": "I will compute it with code.", "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": call_id,
            "name": CODE_TOOL,
            "content": f"{problem.answer}",
        },
        {"role": "assistant", "content": f"The result is \\boxed{{{problem.answer}}}."},
    ]


def iter_sft_chats(
    problems: list[SynthProblem], instruction: str
) -> Iterator[list[dict[str, Any]]]:
    """SFT chats of ``problems``, in order."""
    for i, p in enumerate(problems):
        yield sft_chat(p, instruction, call_id=f"call-{i}")
