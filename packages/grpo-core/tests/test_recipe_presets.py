"""Presets as TOML files (turnrl.grpo_core.recipe.presets): bases merged key by key, a
user's own file, and clear refusals of what cannot be a config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from turnrl.grpo_core.recipe.flags import add_run_flags
from turnrl.grpo_core.recipe.presets import load_preset, preset_names


@dataclass
class _Loop:
    steps: int = 3
    lr: float = 1e-3
    tags: list[str] = field(default_factory=list)


@dataclass
class _Config:
    preset: str = ""
    loop: _Loop = field(default_factory=_Loop)
    env: dict[str, str] = field(default_factory=dict)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    files = {
        "_shared.toml": '[loop]\nlr = 0.5\ntags = ["a"]\n[env]\nX = "1"\n',
        "big.toml": 'base = "_shared"\n[loop]\nsteps = 100\n[env]\nY = "2"\n',
        "small.toml": 'base = "big"\n[loop]\nsteps = 2  # only this differs\n',
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_bases_merge_key_by_key_and_files_name_the_preset(folder: Path) -> None:
    assert preset_names(folder) == ["big", "small"]  # _shared only serves as a base
    small = load_preset(_Config, folder, "small")
    assert small == _Config("small", _Loop(steps=2, lr=0.5, tags=["a"]), {"X": "1", "Y": "2"})
    assert load_preset(_Config, folder, "big").loop.steps == 100


def test_a_users_file_starts_from_a_preset(folder: Path, tmp_path_factory) -> None:
    mine = tmp_path_factory.mktemp("user") / "mine.toml"
    mine.write_text('base = "small"\n[loop]\nlr = 0.25\n')
    config = load_preset(_Config, folder, str(mine))
    assert config == _Config(str(mine), _Loop(steps=2, lr=0.25, tags=["a"]), {"X": "1", "Y": "2"})
    parser = argparse.ArgumentParser()
    add_run_flags(parser, folder)
    assert parser.parse_args(["--preset", str(mine)]).preset == str(mine)
    assert parser.parse_args(["--preset", "small"]).preset == "small"


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("nope", None, r"unknown preset 'nope'; choose one of \['big', 'small'\]"),
        ("gone.toml", None, "preset file gone.toml not found"),
        ("bad.toml", "[loop\nsteps = 1\n", r"bad.toml: .*line 1"),
        ("bad.toml", "[loop]\nspeed = 1\n", "preset bad.toml: unknown config keys in _Loop"),
        ("bad.toml", "loop = 3\n", "config section 'loop' must be an object"),
        ("bad.toml", 'preset = "x"\n', "'preset' is set from the file's name"),
        ("bad.toml", 'base = "bad"\n', r"bases loop \(bad.toml -> bad -> bad\)"),
        ("bad.toml", 'base = "other.toml"\n', "base must name a preset of"),
    ],
)
def test_what_cannot_be_a_config_is_refused(
    folder: Path, name: str, text: str | None, message: str, monkeypatch
) -> None:
    monkeypatch.chdir(folder)
    if text is not None:
        (folder / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        load_preset(_Config, folder, name)


def test_an_unknown_name_is_a_usage_error(folder: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_run_flags(parser, folder)
    for name in ("nope", "_shared"):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["--preset", name])
        assert exit_.value.code == 2
        assert "invalid choice" in capsys.readouterr().err
