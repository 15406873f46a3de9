"""tau-bench tasks: the dataclasses and safe readers for JSONL and ``tasks_*.py`` files.

A task is ``{user_id, actions: [{name, kwargs}], instruction, outputs}``. JSONL files hold
one task per line. A tau-bench checkout keeps them as Python source
(``TASKS = [Task(user_id=..., actions=[Action(name=..., kwargs={...})], ...)]``); those
files are read with :mod:`ast` and only literals plus ``Task``/``Action`` calls are
accepted, so nothing in the file is ever executed.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TaskFormatError(ValueError):
    """A task file or task record does not have tau-bench's task shape."""


@dataclass(frozen=True)
class Action:
    """One gold action: a tool name and its keyword arguments."""

    name: str
    """Tool name (``respond`` is a message to the user; gold actions never use it)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments exactly as they should be passed to the tool."""


@dataclass(frozen=True)
class Task:
    """One tau-bench task."""

    user_id: str
    """The customer the task is about."""
    actions: tuple[Action, ...]
    """Gold actions; replaying them on a fresh database gives the ground-truth hash."""
    instruction: str
    """What the simulated user wants (given to the user simulator only)."""
    outputs: tuple[str, ...] = ()
    """Strings the agent must say to the user for the task to count as solved."""

    @classmethod
    def from_dict(cls, data: Any, where: str = "task") -> Task:
        """Validate and convert a task record (extra keys such as ``annotator`` are ignored)."""
        if not isinstance(data, dict):
            raise TaskFormatError(f"{where}: a task must be an object, got {type(data).__name__}")
        for key, kind in (("user_id", str), ("instruction", str), ("actions", list)):
            if not isinstance(data.get(key), kind):
                raise TaskFormatError(f"{where}: field {key!r} must be a {kind.__name__}")
        outputs = data.get("outputs", [])
        if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
            raise TaskFormatError(f"{where}: field 'outputs' must be a list of strings")
        actions = []
        for i, action in enumerate(data["actions"]):
            if not isinstance(action, dict) or not isinstance(action.get("name"), str):
                raise TaskFormatError(f"{where}: action {i} must be an object with a 'name' string")
            kwargs = action.get("kwargs", {})
            if not isinstance(kwargs, dict):
                raise TaskFormatError(f"{where}: action {i} 'kwargs' must be an object")
            actions.append(Action(action["name"], kwargs))
        return cls(data["user_id"], tuple(actions), data["instruction"], tuple(outputs))

    def to_dict(self) -> dict[str, Any]:
        """The task as a JSON-ready record (tau-bench's line format)."""
        return {
            "user_id": self.user_id,
            "actions": [{"name": a.name, "kwargs": a.kwargs} for a in self.actions],
            "instruction": self.instruction,
            "outputs": list(self.outputs),
        }


def load_tasks_jsonl(path: str | Path) -> list[Task]:
    """Read tasks from a JSONL file (blank lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise TaskFormatError(f"task file {path} does not exist")
    tasks = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFormatError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
        tasks.append(Task.from_dict(record, where=f"{path}:{number}"))
    return tasks


def load_tasks_py(path: str | Path, variable: str | None = None) -> list[Task]:
    """Read the task list of a tau-bench ``tasks_*.py`` file without executing it.

    Args:
        path: The Python file.
        variable: Name of the list (e.g. ``TASKS_TRAIN``); by default the first
            module-level assignment whose value is a list of ``Task(...)`` calls.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskFormatError(f"task file {path} does not exist")
    try:
        module = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        raise TaskFormatError(f"{path}: not valid Python ({exc})") from exc
    for node in module.body:
        target, value = _assignment(node)
        if target is None or not isinstance(value, ast.List):
            continue
        if variable is not None and target != variable:
            continue
        if variable is None and not (value.elts and _call_name(value.elts[0]) == "Task"):
            continue
        records = [_literal(elt, path) for elt in value.elts]
        return [Task.from_dict(r, where=f"{path}: {target}[{i}]") for i, r in enumerate(records)]
    wanted = f"a list named {variable!r}" if variable else "a list of Task(...) calls"
    raise TaskFormatError(f"{path}: no module-level assignment of {wanted}")


def load_tasks(path: str | Path) -> list[Task]:
    """Read tasks from ``.jsonl`` or ``.py`` (by suffix)."""
    suffix = Path(path).suffix
    if suffix == ".py":
        return load_tasks_py(path)
    if suffix in (".jsonl", ".json"):
        return load_tasks_jsonl(path)
    raise TaskFormatError(f"{path}: unknown task file type {suffix!r} (expected .jsonl or .py)")


def _assignment(node: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        return (target.id if isinstance(target, ast.Name) else None), node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
        return node.target.id, node.value
    return None, None


def _call_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id
    return None


def _literal(node: ast.expr, path: Path) -> Any:
    """Turn ``Task(...)``/``Action(...)`` calls into dicts and everything else into literals."""
    name = _call_name(node)
    if name in ("Task", "Action"):
        call = node
        assert isinstance(call, ast.Call)
        if call.args or any(k.arg is None for k in call.keywords):
            raise TaskFormatError(
                f"{path}:{node.lineno}: {name}(...) must use keyword arguments only"
            )
        return {k.arg: _literal(k.value, path) for k in call.keywords}
    if isinstance(node, ast.List):
        return [_literal(e, path) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise TaskFormatError(
                f"{path}:{node.lineno}: '**' inside a task literal is not allowed"
            )
        return {
            _literal(k, path): _literal(v, path)
            for k, v in zip(node.keys, node.values, strict=True)
            if k
        }
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "long " + "text"
        left, right = _literal(node.left, path), _literal(node.right, path)
        if isinstance(left, str) and isinstance(right, str):
            return left + right
    try:
        return ast.literal_eval(node)
    except ValueError as exc:
        raise TaskFormatError(
            f"{path}:{getattr(node, 'lineno', '?')}: only literals and Task/Action calls are "
            f"allowed in a task file, found {ast.dump(node)[:80]}"
        ) from exc
