"""Presets as TOML files: an app's starting configurations, declared rather than coded.

A preset file sets only what differs from the config's defaults, one table per config
section (``[loop]``, ``[rollout]``, ...). ``base = "<name>"`` at its top starts from another
preset of the app's folder, or a file of it that only serves as a base (its name starts
with ``_``): the base's tables are merged key by key, this file's values winning (TOML has
no null: a field a base sets cannot be reset to None). ``--preset`` takes a preset's name or the path of a user's own ``.toml`` file,
which may name one of the app's presets as its base. The config's ``preset`` field is the
name (or the path) it came from; a file does not set it.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from turnrl.grpo_core.recipe.run_folder import config_from_dict

T = TypeVar("T")


def preset_names(folder: Path) -> list[str]:
    """The presets an app ships: the ``*.toml`` files of ``folder`` by stem, bases aside."""
    return sorted(p.stem for p in folder.glob("*.toml") if not p.stem.startswith("_"))


def _preset_path(folder: Path, name: str) -> Path:
    if name.endswith(".toml"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"preset file {name} not found")
        return path
    if not (name.startswith("_") and (folder / f"{name}.toml").is_file()) and (
        name not in preset_names(folder)
    ):
        raise ValueError(
            f"unknown preset {name!r}; choose one of {preset_names(folder)} or give a .toml file"
        )
    return folder / f"{name}.toml"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged


def read_preset(folder: Path, name: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields preset ``name`` sets (its bases' merged under its own), without ``preset``.

    Raises:
        ValueError: an unknown name or missing file, TOML that does not parse (file and
            line named), a file that sets ``preset``, or bases that loop.
    """
    path = _preset_path(folder, name)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"preset file {path}: {exc}") from None
    if "preset" in data:
        raise ValueError(f"preset file {path}: 'preset' is set from the file's name, not in it")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or base.endswith(".toml"):
        raise ValueError(f"preset file {path}: base must name a preset of {folder}")
    if base in _seen:
        raise ValueError(f"preset file {path}: bases loop ({' -> '.join((*_seen, base))})")
    return _merge(read_preset(folder, base, (*_seen, base)), data)


def load_preset(cls: type[T], folder: Path, name: str) -> T:
    """A fresh ``cls`` config of preset ``name`` (see the module).

    Raises:
        ValueError: as :func:`read_preset`, or a key or value the config rejects (the file
            named).
    """
    data = read_preset(folder, name, (name,))
    try:
        return config_from_dict(cls, {**data, "preset": name})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"preset {name}: {exc}") from None


def preset_argument(folder: Path) -> Any:
    """An argparse ``type`` for ``--preset``: a known name or a ``.toml`` path, else
    argparse's usage error (exit 2)."""

    def check(value: str) -> str:
        if value.endswith(".toml") or value in preset_names(folder):
            return value
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from {', '.join(preset_names(folder))}, "
            "or give a .toml file)"
        )

    return check
