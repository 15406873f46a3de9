"""The architecture contract ([tool.importlinter] in pyproject.toml) holds for the tree, and
breaks, naming the contract and the import, when a copy of the tree gains a back-import.

import-linter runs as ``python -S``: without site, the workspace's editable installs (.pth
files) do not put the real sources on the path, so the only turnrl it finds is the tree
handed to it (the site-packages folder is added back, without its .pth files, for
import-linter itself).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pyproject.toml"
SRC_ROOTS = sorted(
    p.relative_to(ROOT) for p in [*ROOT.glob("packages/*/src"), *ROOT.glob("apps/*/src")]
)
LINT = (
    "import sys; sys.path[:0] = sys.argv[1].split('|'); sys.path.append(sys.argv[2]); "
    "del sys.argv[1:3]; from importlinter.cli import lint_imports_command; "
    "sys.exit(lint_imports_command())"
)


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repo's contract over the sources under ``tree``."""
    path = "|".join(str(tree / src) for src in SRC_ROOTS)
    site = sysconfig.get_paths()["purelib"]
    command = [sys.executable, "-S", "-c", LINT, path, site, "--no-cache", "--no-logo"]
    return subprocess.run(
        [*command, str(CONFIG)], cwd=tree, capture_output=True, text=True, timeout=120
    )


def copy_sources(dest: Path) -> None:
    """The Python files of every package's and app's src/ folder, under ``dest``."""
    for src in SRC_ROOTS:
        for path in (ROOT / src).rglob("*.py"):
            target = dest / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def test_the_tree_keeps_the_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract", "reported"),
    [
        (
            "packages/rewards/src/turnrl/rewards/planted.py",
            "import turnrl.grpo_core\n",
            "rewards imports no other turnrl package, nor torch BROKEN",
            "turnrl.rewards.planted -> turnrl.grpo_core",
        ),
        (
            "packages/tool-envs/src/turnrl/tool_envs/planted.py",
            "import torch\n",
            "tool-envs imports only npu-runtime, rollout-router and rewards, and not torch BROKEN",
            "turnrl.tool_envs.planted -> torch",
        ),
        (
            "packages/grpo-core/src/turnrl/grpo_core/algos/planted.py",
            "from turnrl.grpo_core.recipe import driver\n",
            "grpo-core layers: the recipe drives the loop, the loop the trainers BROKEN",
            "turnrl.grpo_core.algos.planted -> turnrl.grpo_core.recipe",
        ),
        (
            "packages/npu-runtime/src/turnrl/npu_runtime/planted.py",
            "def late():\n    import turnrl_app_tau\n",
            "apps above the packages, neither app imports the other BROKEN",
            "turnrl.npu_runtime.planted -> turnrl_app_tau",
        ),
        (
            "packages/grpo-core/src/turnrl/grpo_core/planted.py",
            "NAME = 'a subpackage or module of grpo-core must be given a layer'\n",
            "grpo-core layers: the recipe drives the loop, the loop the trainers BROKEN",
            "- turnrl.grpo_core.planted",
        ),
    ],
    ids=[
        "package-direction",
        "no-torch",
        "grpo-core-layers",
        "function-level-app-import",
        "grpo-core-module-in-no-layer",
    ],
)
def test_a_planted_import_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str, reported: str
) -> None:
    copy_sources(tmp_path)
    (tmp_path / module).write_text(line)
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert contract in result.stdout
    assert reported in result.stdout


def test_a_cycle_between_sibling_modules_breaks_the_contract(tmp_path: Path) -> None:
    """Two rewards modules importing each other (each direction allowed by every other
    contract) break the acyclic one."""
    copy_sources(tmp_path)
    package = tmp_path / "packages/rewards/src/turnrl/rewards"
    (package / "planted_a.py").write_text("from turnrl.rewards import planted_b\n")
    (package / "planted_b.py").write_text("from turnrl.rewards import planted_a\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no import cycles between sibling modules, at any depth BROKEN" in result.stdout
    assert "No cycles are allowed in turnrl.rewards." in result.stdout
