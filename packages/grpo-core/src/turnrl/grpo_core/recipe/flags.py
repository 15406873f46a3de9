"""An app's command line: a preset, then flags that each set one config field.

Both apps resolve their configuration the same way: the preset (``--preset``, ``--smoke``;
``cpu-default`` when neither is given) or, with ``--resume``, the interrupted run's
``config.json``; then the flags the user gave, each setting one field by its dotted path
(``"loop.num_rollout"``). A flag left out keeps the value below it (its argparse default
is ``SUPPRESS``), so what a user did not type never overrides a preset.

A flag's ``kind`` is a type (its value is converted), :data:`ON` / :data:`OFF` (a switch
storing True / False), :data:`BOOL` (``--x`` / ``--no-x``), or a :class:`Switch` (``--x`` /
``--no-x`` storing two other values).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.grpo_core.recipe.presets import preset_argument, preset_names
from turnrl.grpo_core.recipe.run_folder import read_run_config

ON, OFF, BOOL = "on", "off", "bool"
"""Kinds of switch flags: store True, store False, ``--x`` / ``--no-x``."""


@dataclass(frozen=True)
class Switch:
    """The kind of a ``--x`` / ``--no-x`` flag that stores ``on`` / ``off`` (slime's
    ``--calculate-per-token-loss`` picks the loss aggregation)."""

    on: Any
    """What ``--x`` stores."""
    off: Any
    """What ``--no-x`` stores."""


class _SwitchAction(argparse.BooleanOptionalAction):
    def __init__(self, *args: Any, switch: Switch, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.switch = switch

    def __call__(
        self, parser: Any, namespace: Any, values: Any, option_string: str | None = None
    ) -> None:
        off = str(option_string).startswith("--no-")
        setattr(namespace, self.dest, self.switch.off if off else self.switch.on)


Flag = tuple[str, str, Any, str]
"""``(flag, "section.field", kind, help)``."""


def comma_list(text: str) -> list[str]:
    """A flag's comma-separated values (``"a, b"`` -> ``["a", "b"]``)."""
    return [part.strip() for part in text.split(",") if part.strip()]


RUN_FLAGS: list[Flag] = [
    ("--run-dir", "run_dir", str, "run folder (default runs/<app>-<timestamp>)"),
    ("--seed", "seed", int, "seed of data, model initialisation, sampling and prompt order"),
    (
        "--logger",
        "logger",
        comma_list,
        "experiment trackers besides TensorBoard, comma-separated: wandb,mlflow,swanlab",
    ),
]
"""The run's own flags, the same in every app (:func:`add_run_flags` adds them)."""


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Iterable[Flag]
) -> None:
    """Add each flag with ``dest`` its dotted field and no default (see the module)."""
    for flag, dest, kind, help_ in flags:
        common: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_}
        if kind in (ON, OFF):
            parser.add_argument(flag, action="store_const", const=kind == ON, **common)
        elif kind == BOOL:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif isinstance(kind, Switch):
            parser.add_argument(flag, action=_SwitchAction, switch=kind, **common)
        else:
            metavar = flag.lstrip("-").replace("-", "_").upper()
            parser.add_argument(flag, type=kind, metavar=metavar, **common)


def add_run_flags(parser: argparse.ArgumentParser, presets: Path) -> None:
    """``--preset`` (a name among the ``presets`` folder's files, or a ``.toml`` path),
    ``--smoke``, ``--resume`` and :data:`RUN_FLAGS`."""
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
    add_flags(parser, RUN_FLAGS)


def set_field(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``data["a"]["b"] = value`` for ``dotted`` ``"a.b"``."""
    *path, last = dotted.split(".")
    node = data
    for key in path:
        node = node[key]
    node[last] = value


def env_fields(
    table: Iterable[tuple[str, str, Callable[[str], Any]]], environ: Mapping[str, str]
) -> dict[str, Any]:
    """The fields that environment variables set: ``(variable, "section.field", convert)``
    for each one that is set and not blank (for :func:`resolve_fields`'s ``defaults``).

    Raises:
        ValueError: a value ``convert`` rejects (the variable named).
    """
    fields = {}
    for var, dotted, convert in table:
        if environ.get(var, "").strip():
            try:
                fields[dotted] = convert(environ[var])
            except ValueError:
                raise ValueError(
                    f"environment variable {var}={environ[var]!r} is not valid"
                ) from None
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
