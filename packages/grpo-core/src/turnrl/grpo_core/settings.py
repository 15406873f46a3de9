"""A setting's one definition: its dataclass field, which also names the flags that set it.

``setting(default, "--eps-clip")`` is a ``dataclasses.field`` whose metadata holds the
rest; the parser, the flag of a dotted setting, the environment variables and the refusals
of what a run does not act on are all derived from it (``recipe.flags``, ``recipe.schema``).
The metadata keys are plain, so a package that cannot import this module writes them as a
dict (``field(default=..., metadata={"flags": (("--domain", str),)})``):

- ``flags``: ``((flag, kind), ...)``; a kind is a type or converter, :data:`ON` /
  :data:`OFF` (a switch storing True / False), :data:`BOOL` (``--x`` / ``--no-x``),
  :data:`LIST` (comma-separated), :data:`APPEND` (repeatable) or a :class:`Switch`.
- ``keys``: for a dict field, ``((flag, kind), ...)`` each setting one key.
- ``help``: the flag's help; without it, the field's docstring.
- ``env``: an environment variable that sets the field (between preset and flags).
- ``refused``: why a value other than the default is not acted on; ``acts``: ``"megatron"``
  or ``"ray"``, the train backend or runner that does act on it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

ON, OFF, BOOL, LIST, APPEND = "on", "off", "bool", "list", "append"
"""Kinds of flags besides a type: store True, store False, ``--x`` / ``--no-x``,
comma-separated values, repeatable (each appends)."""


@dataclass(frozen=True)
class Switch:
    """The kind of a ``--x`` / ``--no-x`` flag that stores ``on`` / ``off`` (slime's
    ``--calculate-per-token-loss`` picks the loss aggregation)."""

    on: Any
    """What ``--x`` stores."""
    off: Any
    """What ``--no-x`` stores."""


def _kind_of(default: Any) -> Any:
    for kind in (bool, int, float, str):
        if type(default) is kind:
            return BOOL if kind is bool else kind
    raise TypeError(f"setting with default {default!r}: give its flag's kind")


def setting(
    default: Any = MISSING,
    *flags: str | tuple[str, Any],
    kind: Any = None,
    help: str | None = None,
    env: str | None = None,
    refused: str | None = None,
    acts: str | None = None,
    keys: tuple[tuple[str, Any], ...] = (),
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field with its flags (each a name, of ``kind`` or the default's type, or
    a ``(name, kind)`` pair) and rules as metadata (see the module). With a
    ``default_factory`` there is no default: the flags come first."""
    if default_factory is not MISSING and default is not MISSING:
        flags, default = (default, *flags), MISSING
    pairs = tuple(f if isinstance(f, tuple) else (f, kind or _kind_of(default)) for f in flags)
    meta = {"flags": pairs, "help": help, "env": env, "refused": refused, "acts": acts}
    meta["keys"] = keys
    return field(
        default=default,
        default_factory=default_factory,
        metadata={k: v for k, v in meta.items() if v},
    )


@dataclass(frozen=True)
class Setting:
    """One leaf field of a config tree."""

    dotted: str
    """Its path (``"loop.num_rollout"``)."""
    default: Any
    """Its value in the config's defaults."""
    meta: Mapping[str, Any]
    """Its metadata (see the module)."""
    doc: str
    """Its docstring, on one line ("" when it has none)."""

    @property
    def flags(self) -> tuple[tuple[str, Any], ...]:
        """``(flag, kind)`` of each flag that sets it."""
        return tuple(self.meta.get("flags", ()))

    @property
    def help(self) -> str:
        """The flags' help: the metadata's, else the docstring, else the path."""
        return str(self.meta.get("help") or self.doc or f"sets {self.dotted}")


def settings(config_cls: type) -> list[Setting]:
    """Every leaf field reachable from ``config_cls`` (built with its defaults), in order;
    a field a subclass redeclares keeps the metadata and docstring of the base's."""
    return list(_walk(config_cls(), ""))


def _walk(obj: Any, prefix: str) -> Iterator[Setting]:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            yield from _walk(value, f"{prefix}{f.name}.")
            continue
        meta: Mapping[str, Any] = {}
        doc = ""
        for klass in type(obj).__mro__:
            own = getattr(klass, "__dataclass_fields__", {}).get(f.name)
            meta = meta or (own.metadata if own is not None else {})
            doc = doc or _docs(klass).get(f.name, "")
        yield Setting(prefix + f.name, value, meta, doc)


@functools.cache
def _docs(klass: type) -> dict[str, str]:
    """A class's attribute docstrings by name (read from its source; none without one)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
