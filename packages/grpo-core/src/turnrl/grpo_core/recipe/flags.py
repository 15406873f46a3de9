"""An app's command line: a preset, then flags that each set one config field.

Both apps resolve their configuration the same way: the preset (``--preset``, ``--smoke``;
``cpu-default`` when neither is given) or, with ``--resume``, the interrupted run's
``config.json``; then the flags the user gave, each setting one field by its dotted path
(``"loop.num_rollout"``). A flag left out keeps the value below it (its argparse default
is ``SUPPRESS``), so what a user did not type never overrides a preset.

Each flag is declared once, on the config field it sets (``turnrl.grpo_core.settings``):
:func:`add_config_flags` adds every field's flags, :func:`flag_of` names the flag of a
dotted field and :func:`env_fields` reads the fields environment variables set.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from turnrl.grpo_core.recipe.presets import preset_argument, preset_names
from turnrl.grpo_core.recipe.run_folder import read_run_config
from turnrl.grpo_core.settings import APPEND, BOOL, LIST, OFF, ON, Switch, settings


class _SwitchAction(argparse.BooleanOptionalAction):
    def __init__(self, *args: Any, switch: Switch, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.switch = switch

    def __call__(
        self, parser: Any, namespace: Any, values: Any, option_string: str | None = None
    ) -> None:
        off = str(option_string).startswith("--no-")
        setattr(namespace, self.dest, self.switch.off if off else self.switch.on)


def comma_list(text: str) -> list[str]:
    """A flag's comma-separated values (``"a, b"`` -> ``["a", "b"]``)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    dest: str,
    kind: Any,
    help_: str,
) -> None:
    """Add ``flag`` of ``kind`` (``turnrl.grpo_core.settings``) with ``dest`` its dotted
    field and no default (see the module)."""
    common: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_}
    metavar = flag.lstrip("-").replace("-", "_").upper()
    if kind in (ON, OFF):
        parser.add_argument(flag, action="store_const", const=kind == ON, **common)
    elif kind == BOOL:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif isinstance(kind, Switch):
        parser.add_argument(flag, action=_SwitchAction, switch=kind, **common)
    elif kind == APPEND:
        parser.add_argument(flag, action="append", metavar=metavar, **common)
    else:
        kind = comma_list if kind == LIST else kind
        parser.add_argument(flag, type=kind, metavar=metavar, **common)


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Every flag the fields of ``config_cls`` declare: the top-level ones, then one group
    per section (titled by its name and docstring), a dict field's keys included."""
    config, groups = config_cls(), {}
    for s in settings(config_cls):
        section = s.dotted.split(".")[0] if "." in s.dotted else ""
        if section not in groups:
            doc = (type(getattr(config, section)).__doc__ or "").strip() if section else ""
            title = f"[{section}] {doc.splitlines()[0] if doc else ''}".strip()
            groups[section] = parser.add_argument_group(title) if section else parser
        for flag, kind in s.flags:
            add_flag(groups[section], flag, s.dotted, kind, s.help)
        for flag, kind in s.meta.get("keys", ()):
            key = flag.lstrip("-").replace("-", "_")
            add_flag(groups[section], flag, f"{s.dotted}.{key}", kind, f"sets {s.dotted}[{key!r}]")


def flag_of(config_cls: type) -> dict[str, str]:
    """The (first) flag that sets each field of ``config_cls`` ("section.field")."""
    return {s.dotted: s.flags[0][0] for s in settings(config_cls) if s.flags}


def add_run_flags(parser: argparse.ArgumentParser, presets: Path) -> None:
    """``--preset`` (a name among the ``presets`` folder's files, or a ``.toml`` path),
    ``--smoke`` and ``--resume``."""
    parser.add_argument(
        "--preset",
        type=preset_argument(presets),
        default=None,
        metavar="{" + ",".join(preset_names(presets)) + "} or FILE.toml",
        help="starting configuration (default cpu-default); a file may start from a preset "
        '(base = "<name>") and set only what differs',
    )
    parser.add_argument("--smoke", action="store_true", help="same as --preset smoke")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --run-dir (its config.json, then these flags)",
    )


def set_field(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``data["a"]["b"] = value`` for ``dotted`` ``"a.b"``."""
    *path, last = dotted.split(".")
    node = data
    for key in path:
        node = node[key]
    node[last] = value


def env_fields(config_cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields that environment variables set (a field's ``env``), for each variable that
    is set and not blank, converted as its flag (a switch: anything but 0 / false is on) or
    its default's type (for :func:`resolve_fields`'s ``defaults``).

    Raises:
        ValueError: a value the conversion rejects (the variable named).
    """
    fields = {}
    for s in settings(config_cls):
        var = s.meta.get("env")
        if not var or not environ.get(var, "").strip():
            continue
        kind = s.flags[0][1] if s.flags else type(s.default)
        if kind in (ON, OFF, BOOL, bool):
            fields[s.dotted] = environ[var].strip().lower() not in ("0", "false")
            continue
        try:
            fields[s.dotted] = kind(environ[var])
        except ValueError:
            raise ValueError(f"environment variable {var}={environ[var]!r} is not valid") from None
    return fields


def resolve_fields(
    args: dict[str, Any],
    preset: Callable[[str], Any],
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The config (as a dict) a parsed command line asks for.

    Args:
        args: ``vars(namespace)``: ``preset``, ``smoke``, ``resume`` and the given flags by
            dotted field (popped from it: what is left are the fields).
        preset: A preset's config by name (it has ``to_dict``).
        defaults: Fields set between a preset and the flags (e.g. from environment
            variables); a resumed run keeps its own.

    Raises:
        ValueError: ``--smoke`` with another preset, ``--preset`` / ``--smoke`` with
            ``--resume``, or no usable ``config.json`` to resume.
    """
    name, smoke, resume = args.pop("preset"), args.pop("smoke"), args.pop("resume")
    if smoke and name not in (None, "smoke"):
        raise ValueError(f"--smoke conflicts with --preset {name}")
    if resume:
        if name or smoke:
            raise ValueError("--resume continues a run with its own config; drop --preset/--smoke")
        data = read_run_config(args.get("run_dir"))
    else:
        data = preset("smoke" if smoke else name or "cpu-default").to_dict()
        for dotted, value in (defaults or {}).items():
            set_field(data, dotted, value)
    for dotted, value in args.items():
        set_field(data, dotted, value)
    return data
