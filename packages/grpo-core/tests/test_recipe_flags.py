"""An app's command line (turnrl.grpo_core.recipe.flags): the flags the config's fields
declare, preset < defaults < given flags, a resumed run's config.json < given flags, and the
clear refusals."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from turnrl.grpo_core.recipe.flags import (
    add_config_flags,
    add_run_flags,
    env_fields,
    flag_of,
    resolve_fields,
)
from turnrl.grpo_core.recipe.presets import load_preset
from turnrl.grpo_core.settings import LIST, OFF, ON, setting


@dataclass
class _Loop:
    steps: int = setting(3, "--num-rollout", env="X_TURNS")
    """RL steps."""
    shuffle: bool = setting(False, "--shuffle", kind=ON)
    sft: bool = setting(True, ("--no-sft", OFF), ("--sft", ON))
    filter: bool = setting(True, "--filter")


@dataclass
class _Config:
    preset: str = ""
    loop: _Loop = field(default_factory=_Loop)
    run_dir: str | None = setting(None, "--run-dir", kind=str)
    seed: int = setting(0, "--seed")
    logger: list[str] = setting("--logger", kind=LIST, default_factory=list)
    name: str = setting("", env="X_NAME")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS = {"cpu-default": "", "smoke": "[loop]\nsteps = 1\n"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("presets")
    for name, text in PRESETS.items():
        (folder / f"{name}.toml").write_text(text)
    return folder


def _resolve(
    folder: Path, argv: list[str], defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_run_flags(parser, folder)
    add_config_flags(parser, _Config)
    args = vars(parser.parse_args(argv))
    return resolve_fields(args, lambda name: load_preset(_Config, folder, name), defaults)


def test_flags_not_given_keep_the_preset_and_given_ones_win(folder: Path) -> None:
    assert _resolve(folder, []) == _Config(preset="cpu-default").to_dict()
    assert _resolve(folder, ["--smoke"])["loop"]["steps"] == 1
    data = _resolve(
        folder,
        [
            "--smoke",
            "--num-rollout",
            "7",
            "--shuffle",
            "--no-sft",
            "--no-filter",
            "--logger",
            "a, b",
            "--seed",
            "11",
        ],
    )
    assert data["loop"] == {"steps": 7, "shuffle": True, "sft": False, "filter": False}
    assert data["logger"] == ["a", "b"] and data["seed"] == 11
    # Defaults (e.g. environment variables) sit between the preset and the flags.
    assert _resolve(folder, [], {"loop.steps": 5})["loop"]["steps"] == 5
    assert _resolve(folder, ["--num-rollout", "9"], {"loop.steps": 5})["loop"]["steps"] == 9


def test_resume_reads_the_run_config_under_the_given_flags(folder: Path, tmp_path: Path) -> None:
    saved = _Config(loop=_Loop(steps=4, shuffle=True), run_dir=str(tmp_path)).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(saved))
    data = _resolve(
        folder, ["--resume", "--run-dir", str(tmp_path), "--num-rollout", "6"], {"loop.steps": 1}
    )
    assert data["loop"] == {"steps": 6, "shuffle": True, "sft": True, "filter": True}


@pytest.mark.parametrize(
    ("argv", "error", "message"),
    [
        (["--smoke", "--preset", "cpu-default"], ValueError, "--smoke conflicts with --preset"),
        (["--resume", "--smoke", "--run-dir", "x"], ValueError, "drop --preset/--smoke"),
        (["--resume"], ValueError, "--resume needs --run-dir"),
        (["--resume", "--run-dir", "nowhere"], FileNotFoundError, "not found"),
    ],
)
def test_contradictions_and_missing_runs_are_refused(
    folder: Path, argv: list[str], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _resolve(folder, argv)


def test_environment_variables_set_their_fields_and_a_bad_value_is_named() -> None:
    environ = {"X_TURNS": "3", "X_NAME": "  ", "OTHER": "1"}
    assert env_fields(_Config, environ) == {"loop.steps": 3}
    assert env_fields(_Config, {"X_NAME": "n"}) == {"name": "n"}
    with pytest.raises(ValueError, match="environment variable X_TURNS='three' is not valid"):
        env_fields(_Config, {"X_TURNS": "three"})


def test_each_field_declares_its_flags_once_and_the_parser_and_reverse_map_follow() -> None:
    """Two flags of one field both parse; the reverse map names the first; the help is the
    field's docstring (or says what the flag sets)."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser, _Config)
    assert vars(parser.parse_args(["--sft"])) == {"loop.sft": True}
    assert vars(parser.parse_args(["--no-sft"])) == {"loop.sft": False}
    assert flag_of(_Config) == {
        "loop.steps": "--num-rollout",
        "loop.shuffle": "--shuffle",
        "loop.sft": "--no-sft",
        "loop.filter": "--filter",
        "run_dir": "--run-dir",
        "seed": "--seed",
        "logger": "--logger",
    }
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--num-rollout"] == "RL steps." and helps["--filter"] == "sets loop.filter"
    with pytest.raises(TypeError, match="give its flag's kind"):
        setting(None, "--x")
