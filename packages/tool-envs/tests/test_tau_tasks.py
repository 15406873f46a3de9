"""Task files: JSONL and tau-bench's tasks_*.py (read with ast, never executed)."""

import json
import os
from pathlib import Path

import pytest

from turnrl.tool_envs.tau import Action, Task, TaskFormatError, load_tasks, load_tasks_py

TAU_DIR = Path(
    os.environ.get("TURNRL_TAU_BENCH_DIR")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau-bench"
)

TASKS_PY = """
from tau_bench.types import Action, Task

TASKS_TRAIN = [
    Task(
        annotator="synthetic",
        user_id="ada_berg_1234",
        instruction="Cancel #W1 " + "now.",
        actions=[
            Action(name="cancel_pending_order", kwargs={"order_id": "#W1", "reason": "ordered by mistake"}),
            Action(name="think", kwargs={"thought": "done", "n": -1.5, "ok": True, "none": None}),
        ],
        outputs=["10.5"],
    ),
    Task(user_id="b", instruction="x", actions=[]),
]
"""


def test_reads_tasks_py_without_executing_it(tmp_path):
    path = tmp_path / "tasks_train.py"
    path.write_text(TASKS_PY)
    tasks = load_tasks(path)
    assert tasks[0] == Task(
        "ada_berg_1234",
        (
            Action("cancel_pending_order", {"order_id": "#W1", "reason": "ordered by mistake"}),
            Action("think", {"thought": "done", "n": -1.5, "ok": True, "none": None}),
        ),
        "Cancel #W1 now.",
        ("10.5",),
    )
    assert tasks[1].outputs == () and tasks[1].actions == ()


def test_code_in_a_tasks_py_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "tasks_evil.py"
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    path.write_text(f"TASKS = [Task(user_id={code}, instruction='', actions=[])]")
    with pytest.raises(TaskFormatError, match="only literals"):
        load_tasks_py(path)
    assert not marker.exists()


def test_tasks_py_errors(tmp_path):
    path = tmp_path / "tasks.py"
    path.write_text("TASKS = [Task('positional')]")
    with pytest.raises(TaskFormatError, match="keyword arguments only"):
        load_tasks_py(path)
    path.write_text("X = 1\n")
    with pytest.raises(TaskFormatError, match="no module-level assignment"):
        load_tasks_py(path)
    path.write_text("TASKS = [")
    with pytest.raises(TaskFormatError, match="not valid Python"):
        load_tasks_py(path)
    path.write_text(TASKS_PY)
    assert len(load_tasks_py(path, variable="TASKS_TRAIN")) == 2
    with pytest.raises(TaskFormatError, match="'TASKS_TEST'"):
        load_tasks_py(path, variable="TASKS_TEST")


def test_jsonl_round_trip_and_errors(tmp_path):
    task = Task("u", (Action("think", {"thought": "t"}),), "do it", ("x",))
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(task.to_dict()) + "\n\n")
    assert load_tasks(path) == [task]
    bad_lines = {
        "{not json": "not valid JSON",
        "[1]": "a task must be an object",
        '{"user_id": 1, "instruction": "", "actions": []}': "'user_id' must be a str",
        '{"user_id": "u", "instruction": "", "actions": [{"kwargs": {}}]}': "action 0 must be",
        '{"user_id": "u", "instruction": "", "actions": [{"name": "a", "kwargs": []}]}': "'kwargs'",
        '{"user_id": "u", "instruction": "", "actions": [], "outputs": [1]}': "'outputs'",
    }
    for line, message in bad_lines.items():
        path.write_text(json.dumps(task.to_dict()) + "\n" + line + "\n")
        with pytest.raises(TaskFormatError, match=message) as info:
            load_tasks(path)
        assert ":2" in str(info.value)


def test_missing_or_unknown_task_files(tmp_path):
    with pytest.raises(TaskFormatError, match="does not exist"):
        load_tasks(tmp_path / "none.jsonl")
    (tmp_path / "t.csv").write_text("")
    with pytest.raises(TaskFormatError, match="unknown task file type"):
        load_tasks(tmp_path / "t.csv")


@pytest.mark.skipif(not TAU_DIR.is_dir(), reason="tau-bench data not present")
def test_reads_tau_bench_training_tasks():
    tasks = load_tasks(TAU_DIR / "retail" / "tasks_train.jsonl")
    assert len(tasks) == 500
    assert all(t.actions and t.instruction for t in tasks)
