"""Loaders for the ReTool datasets, read through `datasets` from local files.

Schemas (as published on the Hugging Face hub, which is not reachable from a run: download
the files first and pass their paths):

- **ReTool-SFT** (`JoeYing/ReTool-SFT`): a `messages` column of `{role, content}` chats.
  The assistant's content interleaves reasoning with `<code>```python ...```</code>` blocks
  and the results in `<interpreter>...</interpreter>` blocks. :func:`load_retool_sft` turns
  each into OpenAI messages (an assistant turn with a `code_interpreter` tool call, then a
  `tool` message with the interpreter output), the format `build_sft_example` masks.
- **DAPO-Math-17k** (`BytedTsinghua-SIA/DAPO-Math-17k`, parquet): `data_source`, `prompt`
  (a list of `{role, content}`; the user content wraps the problem in DAPO's `Answer:`
  instruction), `ability`, `reward_model` (`{ground_truth, style}`), `extra_info`
  (`{index}`). The problem is taken out of the wrapper so the ReTool instruction
  (`\\boxed{}`) replaces it.
- **AIME 2024** (`Maxwell-Jia/AIME_2024`): `ID`, `Problem`, `Solution`, `Answer`.
- **AIME 2025** (`yentinglin/aime_2025` and alikes): `problem`, `answer`.

Files may be parquet, JSON lines or JSON. A missing file, an unknown suffix, a file
`datasets` cannot parse and a missing column each raise :class:`DatasetError` naming the
file and what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CODE_TOOL = "code_interpreter"
"""The name of the code tool (`turnrl.tool_envs.retool.env.CODE_INTERPRETER` is its schema)."""
DAPO_PREFIX = "Solve the following math problem step by step."
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'
_SEGMENT = re.compile(r"<code>(.*?)</code>|<interpreter>(.*?)</interpreter>", re.DOTALL)
_FENCED = re.compile(r"```(?:python|py)?\s*\n?(.*?)```", re.DOTALL)
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or lacks a required column."""


@dataclass(frozen=True)
class MathTask:
    """One math problem with its reference answer (a training prompt or a validation item)."""

    problem: str
    """The problem statement, without any answer-format instruction."""
    answer: str
    """The ground-truth answer, as text."""
    data_source: str
    """Dataset name, used in metric names (`val-core/<data_source>/acc/mean@k`)."""
    index: int = 0
    """Position (or id) of the item in its dataset."""

    def as_task(self) -> dict[str, Any]:
        """The dict `RetoolEnv.reset` takes (it reads `problem`)."""
        return {
            "problem": self.problem,
            "answer": self.answer,
            "data_source": self.data_source,
            "index": self.index,
        }


def read_table(path: str | Path, required: tuple[str, ...]) -> Any:
    """A `datasets.Dataset` from a local parquet / jsonl / json file with ``required`` columns.

    Raises:
        DatasetError: missing file, unknown format, unparsable file, or missing columns.
    """
    import datasets

    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"{file}: no such file")
    fmt = _FORMATS.get(file.suffix.lower())
    if fmt is None:
        raise DatasetError(f"{file}: unknown format {file.suffix!r}; use one of {sorted(_FORMATS)}")
    try:
        table = datasets.load_dataset(fmt, data_files=str(file), split="train", keep_in_memory=True)
    except Exception as exc:  # datasets wraps pyarrow/json errors in several types
        raise DatasetError(f"{file}: cannot read as {fmt}: {type(exc).__name__}: {exc}") from exc
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise DatasetError(f"{file}: missing column(s) {missing}; found {table.column_names}")
    return table


def _text(value: Any, where: str) -> str:
    if value is None:
        raise DatasetError(f"{where}: value is missing")
    return str(value).strip()


def _aime_tasks(table: Any, keys: tuple[str, str], source: str, file: Path) -> list[MathTask]:
    return [
        MathTask(
            _text(row[keys[0]], f"{file} row {i}"),
            _text(row[keys[1]], f"{file} row {i}"),
            source,
            i,
        )
        for i, row in enumerate(table)
    ]


def load_aime(path: str | Path, data_source: str | None = None) -> list[MathTask]:
    """AIME problems from either schema: `Problem`/`Answer` (2024) or `problem`/`answer` (2025).

    Args:
        path: Local parquet / jsonl / json file.
        data_source: Name for metrics; default `aime_2024` or `aime_2025` by schema.
    """
    file = Path(path)
    table = read_table(file, ())
    if {"Problem", "Answer"} <= set(table.column_names):
        keys, default = ("Problem", "Answer"), "aime_2024"
    elif {"problem", "answer"} <= set(table.column_names):
        keys, default = ("problem", "answer"), "aime_2025"
    else:
        raise DatasetError(
            f"{file}: missing column(s): need Problem/Answer (AIME 2024) or "
            f"problem/answer (AIME 2025); found {table.column_names}"
        )
    return _aime_tasks(table, keys, data_source or default, file)


def load_aime2024(path: str | Path) -> list[MathTask]:
    """AIME 2024 (`Problem`, `Answer` columns)."""
    return _aime_tasks(
        read_table(path, ("Problem", "Answer")), ("Problem", "Answer"), "aime_2024", Path(path)
    )


def load_aime2025(path: str | Path) -> list[MathTask]:
    """AIME 2025 (`problem`, `answer` columns)."""
    return _aime_tasks(
        read_table(path, ("problem", "answer")), ("problem", "answer"), "aime_2025", Path(path)
    )


def dapo_problem(prompt_text: str) -> str:
    """The bare problem inside DAPO-Math-17k's `Answer:`-format user prompt."""
    text = prompt_text.strip()
    if text.startswith(DAPO_PREFIX):
        _, sep, rest = text.partition("\n\n")
        text = rest if sep else text[len(DAPO_PREFIX) :]
    if text.endswith(DAPO_SUFFIX):
        text = text[: -len(DAPO_SUFFIX)]
    return text.strip()


def load_dapo_math(path: str | Path, limit: int | None = None) -> list[MathTask]:
    """DAPO-Math-17k training prompts (`prompt` messages, `reward_model.ground_truth`)."""
    file = Path(path)
    table = read_table(file, ("prompt", "reward_model"))
    tasks = []
    for i, row in enumerate(table):
        if limit is not None and i >= limit:
            break
        where = f"{file} row {i}"
        messages, reward_model = row["prompt"], row["reward_model"]
        users = [m for m in messages or [] if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise DatasetError(f"{where}: prompt has no user message")
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise DatasetError(f"{where}: reward_model has no ground_truth")
        extra = row.get("extra_info") or {}
        index = extra.get("index", i) if isinstance(extra, dict) else i
        tasks.append(
            MathTask(
                dapo_problem(_text(users[-1].get("content"), where)),
                _text(reward_model["ground_truth"], where),
                str(row.get("data_source") or "dapo_math_17k"),
                int(index) if str(index).isdigit() else i,
            )
        )
    return tasks


def _code_of(block: str) -> str:
    fenced = _FENCED.search(block)
    return (fenced.group(1) if fenced else block).strip()


def split_assistant(content: str, call_prefix: str = "call") -> list[dict[str, Any]]:
    """One ReTool-SFT assistant content -> assistant / tool messages (OpenAI format).

    Every `<code>` block becomes a `code_interpreter` tool call ending its assistant turn;
    every `<interpreter>` block becomes the `tool` message after it. Text after the last
    block is the final assistant turn.

    Raises:
        DatasetError: an `<interpreter>` block with no `<code>` block before it.
    """
    messages: list[dict[str, Any]] = []
    pending = ""  # assistant text not yet attached to a message
    cursor = 0
    for number, match in enumerate(_SEGMENT.finditer(content)):
        text = pending + content[cursor : match.start()]
        cursor = match.end()
        if match.group(1) is not None:
            call = {
                "id": f"{call_prefix}-{number}",
                "type": "function",
                "function": {
                    "name": CODE_TOOL,
                    "arguments": {"code": _code_of(match.group(1))},
                },
            }
            messages.append({"role": "assistant", "content": text.strip(), "tool_calls": [call]})
            pending = ""
        else:
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                raise DatasetError("an <interpreter> block has no <code> block before it")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": last["tool_calls"][0]["id"],
                    "name": CODE_TOOL,
                    "content": match.group(2).strip(),
                }
            )
            pending = text
    tail = (pending + content[cursor:]).strip()
    if tail or not messages:
        messages.append({"role": "assistant", "content": tail})
    return messages


def convert_retool_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ReTool-SFT chat with its assistant turns split into tool calls and tool messages."""
    out: list[dict[str, Any]] = []
    for k, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise DatasetError(
                f"message {k}: expected role system/user/assistant with text "
                f"content, got role={role!r}"
            )
        if role == "assistant":
            out.extend(split_assistant(content, call_prefix=f"call-{k}"))
        else:
            out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DatasetError("chat has no assistant message")
    return out


def load_retool_sft(path: str | Path, limit: int | None = None) -> list[list[dict[str, Any]]]:
    """ReTool-SFT chats as OpenAI messages with `code_interpreter` calls and tool results."""
    file = Path(path)
    table = read_table(file, ("messages",))
    chats = []
    for i, row in enumerate(table):
        if limit is not None and i >= limit:
            break
        try:
            chats.append(convert_retool_chat(list(row["messages"] or [])))
        except DatasetError as exc:
            raise DatasetError(f"{file} row {i}: {exc}") from None
    return chats
