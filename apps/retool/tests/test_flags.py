"""Every flag of the retool app sets a field that the app (or grpo-core) reads, or is
refused at start."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import turnrl_app_retool
from turnrl_app_retool.cli import build_parser, resolve
from turnrl_app_retool.config import RetoolAppConfig

from turnrl.grpo_core.recipe.flags import flag_of
from turnrl.grpo_core.settings import settings

SETTINGS = {s.dotted: s for s in settings(RetoolAppConfig)}
FLAG_OF = flag_of(RetoolAppConfig)
NOT_HONOURED = {d: s.meta["refused"] for d, s in SETTINGS.items() if s.meta.get("refused")}


def _attributes_read() -> set[str]:
    """Attribute names loaded outside config.py / cli.py, in the app, in grpo-core and in the
    tool-envs modules whose settings the config holds (``SandboxSettings``, ``DapoConfig``)
    (a name check: a field nothing reads at all fails; one sharing its name passes)."""
    import turnrl.grpo_core
    import turnrl.tool_envs.retool.dapo
    import turnrl.tool_envs.sandbox.embedded

    root = Path(turnrl_app_retool.__file__).parent
    paths = [p for p in root.glob("*.py") if p.name not in ("config.py", "cli.py")]
    paths += [p for r in turnrl.grpo_core.__path__ for p in Path(r).rglob("*.py")]
    paths += [
        Path(m.__file__ or "")
        for m in (turnrl.tool_envs.retool.dapo, turnrl.tool_envs.sandbox.embedded)
    ]
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


def test_every_override_sets_a_field_something_reads() -> None:
    read = _attributes_read()
    silent = [
        flag
        for dest, flag in FLAG_OF.items()
        if dest.split(".")[-1] not in read and dest not in NOT_HONOURED
    ]
    assert not silent, f"flags whose field nothing reads: {silent}"


def test_every_config_field_is_read() -> None:
    read = _attributes_read()
    config = RetoolAppConfig()
    silent = []
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        names = (
            [f.name for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else []
        )
        silent += [f"{section.name}.{n}" for n in names if n not in read]
    silent = [dotted for dotted in silent if dotted not in NOT_HONOURED]
    assert not silent, f"config fields nothing reads and nothing refuses: {silent}"


@pytest.mark.parametrize("dotted", sorted(set(NOT_HONOURED) - {"model.arch"}))
def test_a_setting_the_run_does_not_act_on_is_refused_naming_its_flag(
    dotted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    kind = SETTINGS[dotted].flags[0][1]
    value = {int: ["3"], float: ["0.25"], str: ["other"]}.get(kind, [])
    with pytest.raises(SystemExit):
        resolve([FLAG_OF[dotted], *value])
    err = capsys.readouterr().err.split("error:")[-1]  # not the usage line
    assert FLAG_OF[dotted] in err and NOT_HONOURED[dotted] in err


def test_every_parser_option_is_a_known_flag() -> None:
    """A flag added to the parser by hand is one the tests above do not see: list them."""
    declared = {f for s in SETTINGS.values() for f, _ in [*s.flags, *s.meta.get("keys", ())]}
    by_hand = {
        a.option_strings[0]
        for a in build_parser()._actions
        if a.option_strings and a.option_strings[0] not in declared
    }
    assert by_hand == {"-h", "--preset", "--smoke", "--resume", "--print-config"}
