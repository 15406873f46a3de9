"""An app's command line (turnrl.grpo_core.recipe.flags): preset < defaults < given flags,
a resumed run's config.json < given flags, and the clear refusals."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from turnrl.grpo_core.recipe.flags import (
    BOOL,
    OFF,
    ON,
    add_flags,
    add_run_flags,
    env_fields,
    resolve_fields,
)
from turnrl.grpo_core.recipe.presets import load_preset


@dataclass
class _Loop:
    steps: int = 3
    shuffle: bool = False
    sft: bool = True
    filter: bool = True


@dataclass
class _Config:
    preset: str = ""
    loop: _Loop = field(default_factory=_Loop)
    run_dir: str | None = None
    seed: int = 0
    logger: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS = {"cpu-default": "", "smoke": "[loop]\nsteps = 1\n"}
FLAGS = [
    ("--num-rollout", "loop.steps", int, "steps"),
    ("--shuffle", "loop.shuffle", ON, ""),
    ("--no-sft", "loop.sft", OFF, ""),
    ("--filter", "loop.filter", BOOL, ""),
]  # --run-dir, --seed and --logger: add_run_flags' RUN_FLAGS


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
    add_flags(parser, FLAGS)
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
    table = [("X_TURNS", "loop.turns", int), ("X_NAME", "name", str)]
    assert env_fields(table, {"X_TURNS": "3", "X_NAME": "  ", "OTHER": "1"}) == {"loop.turns": 3}
    with pytest.raises(ValueError, match="environment variable X_TURNS='three' is not valid"):
        env_fields(table, {"X_TURNS": "three"})
