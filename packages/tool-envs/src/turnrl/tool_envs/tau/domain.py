"""A tau-bench domain: its data parsed once, its tools, schemas, policy and gold replay.

:class:`TauDomain` is shared by every episode of a domain (it is read-only after
loading). It gives new copy-on-write databases, runs actions with tau-bench's step
semantics, replays a task's gold actions and caches the resulting ground-truth hash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.tool_envs.tau.airline import AIRLINE_TOOLS
from turnrl.tool_envs.tau.db import DOMAIN_TABLES, Database, DataError, PristineData, copy_record
from turnrl.tool_envs.tau.retail import RETAIL_TOOLS
from turnrl.tool_envs.tau.schemas import builtin_schemas
from turnrl.tool_envs.tau.tasks import Task
from turnrl.tool_envs.tau.toolkit import TRANSFER_TOOL, TauTool, invoke
from turnrl.tool_envs.tools import ToolSet

_TOOLS: dict[str, dict[str, TauTool]] = {"retail": RETAIL_TOOLS, "airline": AIRLINE_TOOLS}


@dataclass
class Replay:
    """The result of replaying a list of actions on a fresh database."""

    database: Database
    """The database after the replay."""
    observations: list[str]
    """One observation per replayed action (transfer actions are skipped, as upstream)."""
    errors: list[str] = field(default_factory=list)
    """The observations that were ``Error: ...`` texts (failing calls change nothing)."""
    unknown_actions: list[str] = field(default_factory=list)
    """Names of actions that are not tools of the domain (upstream ignores them)."""

    @property
    def data_hash(self) -> str:
        """Data hash of the database after the replay."""
        return self.database.data_hash()


class TauDomain:
    """Everything about one domain that episodes share: data, tools, schemas, policy."""

    def __init__(
        self,
        name: str,
        pristine: PristineData,
        wiki: str,
        schemas: list[dict[str, Any]] | None = None,
    ) -> None:
        """Build a domain from already-loaded data.

        Args:
            name: ``retail`` or ``airline``.
            pristine: The parsed tables, in the domain's table order.
            wiki: The policy text (the agent's system prompt).
            schemas: OpenAI tool schemas; turnrl's built-in schemas when ``None``.
        """
        if name not in _TOOLS:
            raise ValueError(f"unknown tau domain {name!r}; expected one of {sorted(_TOOLS)}")
        missing = [t for t in DOMAIN_TABLES[name] if t not in pristine.tables]
        if missing:
            raise DataError(f"{name} data lacks tables {missing}")
        self.name = name
        self.pristine = pristine
        self.wiki = wiki
        self.tools = _TOOLS[name]
        self.schemas = schemas if schemas is not None else builtin_schemas(name)
        unknown = [
            s["function"]["name"] for s in self.schemas if s["function"]["name"] not in self.tools
        ]
        if unknown:
            raise DataError(f"{name} tool schemas name tools that do not exist: {unknown}")
        self._gt_cache: dict[str, str] = {}

    @classmethod
    def from_dir(cls, name: str, data_dir: str | Path) -> TauDomain:
        """Load a domain from a folder in tau-bench's layout.

        Tables come from ``<table>.json``, the policy from ``wiki.md`` (required) and the
        schemas from ``tools.json`` when present (turnrl's own schemas otherwise).
        """
        if name not in DOMAIN_TABLES:
            raise ValueError(
                f"unknown tau domain {name!r}; expected one of {sorted(DOMAIN_TABLES)}"
            )
        root = Path(data_dir)
        pristine = PristineData.from_dir(root, DOMAIN_TABLES[name])
        wiki_path = root / "wiki.md"
        if not wiki_path.is_file():
            raise DataError(f"missing policy file {wiki_path} (the agent's system prompt)")
        return cls(
            name,
            pristine,
            wiki_path.read_text(encoding="utf-8"),
            _read_schemas(root / "tools.json"),
        )

    def new_database(self) -> Database:
        """A fresh episode database (copy on write; microseconds)."""
        return self.pristine.new_database()

    def toolset(self, db: Database) -> ToolSet:
        """A :class:`ToolSet` whose callables act on ``db`` with tau-bench's error texts."""
        tools = ToolSet()
        for schema in self.schemas:
            name = schema["function"]["name"]
            tools.add(schema, _BoundTool(self, db, name))
        return tools

    def invoke(self, db: Database, name: str, kwargs: Any) -> str:
        """Run one action on ``db``; returns the observation string (never raises)."""
        return invoke(self.name, self.tools, db, name, kwargs)

    def replay(self, actions: Any) -> Replay:
        """Replay actions on a fresh database, skipping ``transfer_to_human_agents``.

        The arguments are copied first, so tools that store their arguments (airline
        booking) never alias the caller's task objects.
        """
        db = self.new_database()
        replay = Replay(db, [])
        for action in actions:
            name, kwargs = (
                (action.name, action.kwargs)
                if hasattr(action, "name")
                else (action["name"], action.get("kwargs", {}))
            )
            if name == TRANSFER_TOOL:
                continue
            observation = self.invoke(db, name, copy_record(kwargs))
            replay.observations.append(observation)
            if observation.startswith("Error:"):
                replay.errors.append(observation)
            elif name not in self.tools:
                replay.unknown_actions.append(str(name))
        return replay

    def gt_hash(self, task: Task) -> str:
        """Ground-truth data hash of ``task`` (its gold actions replayed on a fresh copy); cached."""
        key = json.dumps([[a.name, a.kwargs] for a in task.actions], sort_keys=True, default=repr)
        cached = self._gt_cache.get(key)
        if cached is None:
            cached = self.replay(task.actions).data_hash
            self._gt_cache[key] = cached
        return cached


class _BoundTool:
    """A tool bound to one database, callable with keyword arguments (for :class:`ToolSet`)."""

    def __init__(self, domain: TauDomain, db: Database, name: str) -> None:
        self.domain, self.db, self.name = domain, db, name

    def __call__(self, **kwargs: Any) -> str:
        return self.domain.invoke(self.db, self.name, kwargs)


def _read_schemas(path: Path) -> list[dict[str, Any]] | None:
    if not path.is_file():
        return None
    try:
        schemas = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(schemas, list) or not all(
        isinstance(s, dict) and isinstance(s.get("function"), dict) and "name" in s["function"]
        for s in schemas
    ):
        raise DataError(
            f"{path} must be a list of {{'type': 'function', 'function': {{...}}}} schemas"
        )
    return schemas
