"""Loaders on small fixture files written in the real datasets' schemas."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from turnrl.tool_envs.retool.data import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    DatasetError,
    convert_retool_chat,
    dapo_problem,
    load_aime,
    load_aime2024,
    load_aime2025,
    load_dapo_math,
    load_retool_sft,
    split_assistant,
)

RETOOL_ASSISTANT = (
    "Let me compute the sum first.\n<code>\n```python\nprint(sum(range(10)))\n```\n</code>\n"
    "<interpreter>\n45\n</interpreter>\nNow the square.\n<code>\n```python\nprint(45**2)\n```\n"
    "</code>\n<interpreter>2025</interpreter>\nSo the answer is \\boxed{2025}."
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dapo_rows() -> list[dict]:
    def prompt(problem: str) -> list[dict]:
        return [
            {
                "role": "user",
                "content": f"{DAPO_PREFIX} The last line of your response "
                "should be of the form Answer: $Answer (without quotes) where $Answer is the "
                f"answer to the problem.\n\n{problem}\n\n{DAPO_SUFFIX}",
            }
        ]

    return [
        {
            "data_source": "math_dapo",
            "prompt": prompt("What is 2+3?"),
            "ability": "MATH",
            "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": "a1"},
        },
        {
            "data_source": "math_dapo",
            "prompt": prompt("Find x if 2x = 14."),
            "ability": "MATH",
            "reward_model": {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": "7"},
        },
    ]


def test_dapo_parquet_schema_loads_problem_and_ground_truth(tmp_path: Path) -> None:
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(dapo_rows()), path)
    tasks = load_dapo_math(path)
    assert [t.problem for t in tasks] == ["What is 2+3?", "Find x if 2x = 14."]
    assert [t.answer for t in tasks] == ["5", "7"]
    assert tasks[0].data_source == "math_dapo"
    assert tasks[1].index == 7  # numeric extra_info.index kept, others fall back to the row
    assert tasks[0].as_task()["problem"] == "What is 2+3?"
    assert len(load_dapo_math(path, limit=1)) == 1


def test_dapo_problem_leaves_plain_text_alone() -> None:
    assert dapo_problem("  Just a problem.  ") == "Just a problem."


def test_dapo_missing_ground_truth_is_an_error(tmp_path: Path) -> None:
    rows = dapo_rows()
    rows[1]["reward_model"] = {"style": "rule"}
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match="ground_truth"):
        load_dapo_math(path)


def test_aime_2024_and_2025_schemas(tmp_path: Path) -> None:
    a24 = tmp_path / "aime24.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"ID": "2024-I-1", "Problem": "P one", "Solution": "...", "Answer": 204},
                {"ID": "2024-I-2", "Problem": "P two", "Solution": "...", "Answer": 25},
            ]
        ),
        a24,
    )
    a25 = write_jsonl(tmp_path / "aime25.jsonl", [{"id": 0, "problem": "Q", "answer": "70"}])
    tasks24, tasks25 = load_aime2024(a24), load_aime2025(a25)
    assert [(t.problem, t.answer, t.data_source) for t in tasks24] == [
        ("P one", "204", "aime_2024"),
        ("P two", "25", "aime_2024"),
    ]
    assert [(t.problem, t.answer, t.data_source) for t in tasks25] == [("Q", "70", "aime_2025")]
    assert load_aime(a24)[0].data_source == "aime_2024"  # schema detected
    assert load_aime(a25, data_source="aime25")[0].data_source == "aime25"


def test_missing_columns_are_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "Q", "solution": "1"}])
    with pytest.raises(DatasetError, match=r"missing column\(s\) \['Problem', 'Answer'\]"):
        load_aime2024(path)
    with pytest.raises(DatasetError, match="Problem/Answer"):
        load_aime(path)
    with pytest.raises(DatasetError, match="prompt"):
        load_dapo_math(path)
    with pytest.raises(DatasetError, match="messages"):
        load_retool_sft(path)


def test_corrupt_missing_and_unknown_files(tmp_path: Path) -> None:
    corrupt = tmp_path / "broken.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match="cannot read as parquet"):
        load_dapo_math(corrupt)
    with pytest.raises(DatasetError, match="no such file"):
        load_aime2025(tmp_path / "absent.parquet")
    other = tmp_path / "data.csv"
    other.write_text("problem,answer\nQ,1\n")
    with pytest.raises(DatasetError, match="unknown format"):
        load_aime2025(other)


def test_split_assistant_makes_tool_calls_and_tool_messages() -> None:
    messages = split_assistant(RETOOL_ASSISTANT)
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    first = messages[0]
    assert first["content"] == "Let me compute the sum first."
    assert first["tool_calls"][0]["function"] == {
        "name": "code_interpreter",
        "arguments": {"code": "print(sum(range(10)))"},
    }
    assert messages[1]["content"] == "45"
    assert messages[1]["tool_call_id"] == first["tool_calls"][0]["id"]
    assert messages[2]["content"] == "Now the square."
    assert messages[2]["tool_calls"][0]["function"]["arguments"]["code"] == "print(45**2)"
    assert messages[4] == {"role": "assistant", "content": "So the answer is \\boxed{2025}."}


def test_interpreter_without_code_is_an_error() -> None:
    with pytest.raises(DatasetError, match="no <code> block"):
        split_assistant("text <interpreter>1</interpreter> more")
    with pytest.raises(DatasetError, match="role"):
        convert_retool_chat([{"role": "robot", "content": "x"}])


def test_retool_sft_jsonl_and_parquet(tmp_path: Path) -> None:
    chat = {
        "messages": [
            {"role": "user", "content": "Compute 45 squared."},
            {"role": "assistant", "content": RETOOL_ASSISTANT},
        ]
    }
    plain = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "\\boxed{1}"},
        ]
    }
    for path in (tmp_path / "sft.jsonl", tmp_path / "sft.parquet"):
        if path.suffix == ".jsonl":
            write_jsonl(path, [chat, plain])
        else:
            pq.write_table(pa.Table.from_pylist([chat, plain]), path)
        chats = load_retool_sft(path)
        assert len(chats) == 2
        assert [m["role"] for m in chats[0]] == [
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
        ]
        assert chats[1] == [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "\\boxed{1}"},
        ]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DatasetError, match="row 0: chat has no assistant"):
        load_retool_sft(bad)
