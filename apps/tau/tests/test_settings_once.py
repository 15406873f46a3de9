"""Each setting is defined once: on its config field (``turnrl.grpo_core.settings``).

For each app, the config tree is walked (every dataclass field reachable from the app's
config) and so is its parser: every flag is declared by exactly one field and parses into
that field, and no module-level table in the apps or in grpo-core's recipe names a flag or
keys a setting by its dotted path (the old flag tables, reverse maps and refusal tables).
The retool app is imported from its sources when it is not installed here.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from turnrl.grpo_core.settings import settings

ROOT = Path(__file__).resolve().parents[3]
APPS = ("turnrl_app_tau", "turnrl_app_retool")
RUN_OPTIONS = {"-h", "--help", "--preset", "--smoke", "--resume", "--print-config"}


@pytest.fixture(params=APPS)
def app(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name = str(request.param)
    if not importlib.util.find_spec(name):
        monkeypatch.syspath_prepend(str(ROOT / "apps" / name.removeprefix("turnrl_app_") / "src"))
    return name


def _config_and_parser(app: str) -> tuple[type, argparse.ArgumentParser]:
    config = importlib.import_module(f"{app}.config")
    cls = next(v for k, v in vars(config).items() if k.endswith("AppConfig") and k != "AppConfig")
    return cls, importlib.import_module(f"{app}.cli").build_parser()


def test_each_flag_is_declared_by_one_field_and_parses_into_it(app: str) -> None:
    cls, parser = _config_and_parser(app)
    found = settings(cls)
    declared = Counter(f for s in found for f, _ in [*s.flags, *s.meta.get("keys", ())])
    assert [f for f, n in declared.items() if n > 1] == []
    owner = {f: s.dotted for s in found for f, _ in s.flags}
    owner |= {f: s.dotted for s in found for f, _ in s.meta.get("keys", ())}
    options = [a for a in parser._actions if a.option_strings]
    for action in options:
        for option in action.option_strings:
            if option in RUN_OPTIONS:
                continue
            flag = option.replace("--no-", "--", 1) if option not in owner else option
            assert flag in owner, f"{option}: no field declares it"
            assert action.dest.startswith(owner[flag]), (option, action.dest, owner[flag])
    assert set(declared) <= {o for a in options for o in a.option_strings}
    assert len({s.dotted for s in found}) == len(found)


def test_no_table_outside_the_fields_names_a_setting(app: str) -> None:
    """Module-level literals (lists, tuples, sets, dicts) in the app's modules and in
    grpo-core's recipe hold no flag of the app and key nothing by a setting's path; the
    Megatron architecture flags (``ARCH_FLAGS``) are the keys ``model.arch`` declares."""
    cls, _ = _config_and_parser(app)
    found = settings(cls)
    flags = {f for s in found for f, _ in s.flags}
    dotted = {s.dotted for s in found}
    package = Path(importlib.import_module(app).__file__ or "").parent
    recipe = ROOT / "packages/grpo-core/src/turnrl/grpo_core/recipe"
    tables = []
    for path in [*package.glob("*.py"), *recipe.glob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(
                node.value, ast.List | ast.Tuple | ast.Set | ast.Dict
            ):
                strings = {
                    n.value
                    for n in ast.walk(node.value)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                }
                keys = node.value.keys if isinstance(node.value, ast.Dict) else []
                keyed = {k.value for k in keys if isinstance(k, ast.Constant)} & dotted
                if strings & flags or keyed:
                    tables.append(f"{path.name}:{node.lineno}")
    assert tables == []
