"""Check the dependency direction between turnrl packages, and the namespace layout.

Rules (see DESIGN.md):
- npu-runtime and rewards import no other turnrl package;
- rollout-router imports only npu-runtime (which has no dependencies);
- tool-envs imports only npu-runtime, rollout-router (the engine records) and rewards (the
  tau-bench reward rule); grpo-core only npu-runtime and rollout-router;
- rewards and tool-envs never import torch;
- torch.cuda, torch.npu and torch_npu appear only in npu-runtime;
- no package imports an app; no src/turnrl/__init__.py (PEP 420 namespace).
Exits 1 listing every violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "npu_runtime": set(),
    "rewards": set(),
    "tool_envs": {"npu_runtime", "rollout_router", "rewards"},
    "rollout_router": {"npu_runtime"},
    "grpo_core": {"npu_runtime", "rollout_router"},
}
NO_TORCH = {"rewards", "tool_envs"}
DEVICE_NAMES = ("torch.cuda", "torch.npu", "torch_npu")


def imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def check_package(folder: Path, module: str) -> list[str]:
    errors = []
    src = folder / "src" / "turnrl"
    if (src / "__init__.py").exists():
        errors.append(f"{src / '__init__.py'}: turnrl must stay a namespace package")
    for path in sorted((src / module).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for name in imported_modules(tree):
            top = name.split(".")
            if top[0] == "turnrl" and len(top) > 1 and top[1] not in {module, *ALLOWED[module]}:
                errors.append(f"{rel}: imports {name}, not allowed for {module}")
            if top[0] == "apps" or top[0].startswith("turnrl_app"):
                errors.append(f"{rel}: imports the app module {name}")
            if module in NO_TORCH and top[0] == "torch":
                errors.append(f"{rel}: imports torch; {module} must not")
            if module != "npu_runtime" and name.startswith(DEVICE_NAMES):
                errors.append(f"{rel}: imports {name}; device code lives in npu_runtime")
        if module != "npu_runtime":
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and dotted(node).startswith(DEVICE_NAMES):
                    errors.append(f"{rel}:{node.lineno}: uses {dotted(node)}; use npu_runtime")
    return errors


def main() -> int:
    errors = []
    for module in ALLOWED:
        errors += check_package(ROOT / "packages" / module.replace("_", "-"), module)
    for line in errors:
        print(line)
    print(f"dependency check: {len(errors)} violation(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
