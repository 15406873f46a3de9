"""docs/map.md is true: its code names resolve, its paths to the loss are call chains.

- A code name is a backticked dotted name (``turnrl.grpo_core.loop.loop.GRPOLoop._train``,
  ``turnrl_app_tau.main.main``): the longest importable module prefix is imported and the
  rest looked up with ``getattr`` (a dataclass field or annotated attribute counts).
- A backticked repo path (``apps/tau/src/turnrl_app_tau/presets/*.toml``) must exist.
- A path section (a ``### `` heading saying ``N hops``) lists one code name per numbered line:
  N must be its number of hops, and each name must occur in the source of a name above it
  (its caller, or the function that made the coroutine it is awaited as).
- Links to map.md from the README and docs/ reach it.

It lives with the tau app, whose environment holds all five packages; the retool app is
imported from its sources when it is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
MAP = ROOT / "docs" / "map.md"
LOSS = "turnrl.grpo_core.algos.policy_loss.policy_loss"
APP_MAINS = ("turnrl_app_tau.main.main", "turnrl_app_retool.main.main")

CODE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
FILE_SUFFIXES = (".py", ".md", ".json", ".jsonl", ".toml", ".txt", ".png", ".yaml", ".lock")
HOPS = re.compile(r"\b(\d+) hops?\b")
ITEM = re.compile(r"^\d+\. `([^`]+)`")

pytestmark = pytest.mark.skipif(not MAP.exists(), reason="docs/map.md not next to the tests")


@pytest.fixture(autouse=True)
def _apps_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each app's sources on ``sys.path`` when the app is not installed here (and litellm,
    imported with the user simulator, kept off the network)."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    for src in sorted(ROOT.glob("apps/*/src")):
        for package in src.iterdir():
            if package.name.startswith("turnrl_app_") and not importlib.util.find_spec(
                package.name
            ):
                monkeypatch.syspath_prepend(str(src))


def _text() -> str:
    """map.md without its fenced blocks (diagrams, not names)."""
    return re.sub(r"^```.*?^```", "", MAP.read_text(), flags=re.DOTALL | re.MULTILINE)


def _spans() -> list[str]:
    return re.findall(r"`([^`\n]+)`", _text())


def _code_names() -> list[str]:
    names = [s for s in _spans() if CODE.fullmatch(s) and not s.endswith(FILE_SUFFIXES)]
    return list(dict.fromkeys(names))


def _member(obj: Any, attr: str) -> Any:
    if hasattr(obj, attr):
        return getattr(obj, attr)
    for klass in getattr(obj, "__mro__", ()):
        if attr in getattr(klass, "__dataclass_fields__", {}):
            return None  # a field without a class-level value
        if attr in inspect.get_annotations(klass):
            return None
    raise AttributeError(f"{getattr(obj, '__qualname__', obj)!s} has no {attr!r}")


def resolve(name: str) -> Any:
    """The object ``name`` names: the longest importable prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # this prefix (or a package above it) is no module
            raise  # the module exists but needs something missing here
        for attr in parts[i:]:
            obj = _member(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module in {name!r}")


def _unresolved(names: list[str]) -> list[str]:
    bad = []
    for name in names:
        try:
            resolve(name)
        except Exception as exc:
            bad.append(f"{name} ({type(exc).__name__}: {exc})")
    return bad


def paths() -> dict[str, list[str]]:
    """Each path section's heading -> its names, in order."""
    out: dict[str, list[str]] = {}
    heading = None
    for line in _text().splitlines():
        if line.startswith("#"):
            heading = line if line.startswith("### ") and HOPS.search(line) else None
            if heading is not None:
                out[heading] = []
        elif heading is not None and (item := ITEM.match(line)):
            out[heading].append(item.group(1))
    return out


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(inspect.unwrap(obj))
    except (TypeError, OSError):
        return ""


def test_every_code_name_in_the_map_resolves() -> None:
    names = _code_names()
    assert len(names) > 100, "the map names its code in backticks, fully qualified"
    bad = _unresolved(names)
    assert not bad, f"{len(bad)} code name(s) in docs/map.md do not resolve:\n" + "\n".join(bad)


def test_every_repo_path_in_the_map_exists() -> None:
    spans = [s for s in _spans() if "/" in s and " " not in s and "<" not in s]
    spans = [s for s in spans if not s.startswith(("http", "/"))]
    missing = [s for s in dict.fromkeys(spans) if not list(ROOT.glob(s.rstrip("/")))]
    assert not missing, f"paths in docs/map.md that do not exist: {missing}"


def test_each_app_has_a_path_from_main_to_the_loss() -> None:
    found = {names[0]: names for names in paths().values() if names}
    for main in APP_MAINS:
        assert main in found, f"docs/map.md has no path section starting at `{main}`"
        assert found[main][-1] == LOSS, f"the path from `{main}` ends at {found[main][-1]}"


def test_each_path_is_a_call_chain_with_its_hop_count() -> None:
    sections = paths()
    assert len(sections) >= 3
    errors = []
    for heading, names in sections.items():
        hops = HOPS.search(heading)
        assert hops is not None
        claimed = int(hops.group(1))
        if claimed != len(names) - 1:
            errors.append(f"{heading}: says {claimed} hops, lists {len(names) - 1}")
        if bad := _unresolved(names):
            errors.append(f"{heading}: {bad}")
            continue
        sources = [_source(resolve(name)) for name in names]
        for k in range(1, len(names)):
            short = names[k].rsplit(".", 1)[-1]
            if not any(re.search(rf"\b_*{short}\b", s) for s in sources[:k]):
                errors.append(f"{heading}: nothing above `{names[k]}` calls {short}")
    assert not errors, "\n".join(errors)


def test_links_to_the_map_reach_it() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    links = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s#]+)[^)]*\)", doc.read_text()):
            if target.endswith("map.md") or (doc == MAP and not target.startswith("http")):
                links.append((doc, target))
    assert any(doc.name == "README.md" for doc, _ in links), "the README links to docs/map.md"
    broken = [f"{d.relative_to(ROOT)}: {t}" for d, t in links if not (d.parent / t).exists()]
    assert not broken, f"links that do not reach their file: {broken}"
