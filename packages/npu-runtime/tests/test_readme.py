"""The Python examples in the package README run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _examples() -> list[str]:
    if not README.exists():  # e.g. tests copied away from the source tree
        return []
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.mark.skipif(not README.exists(), reason="package README not next to the tests")
def test_readme_has_examples():
    assert len(_examples()) >= 5


@pytest.mark.parametrize("code", _examples(), ids=lambda c: c.splitlines()[0][:40])
def test_readme_example_runs(code, monkeypatch, capsys):
    if "init_distributed" in code:
        pytest.importorskip("torch")
    monkeypatch.delenv("TURNRL_DEVICE", raising=False)
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    assert capsys.readouterr().out.strip()  # every example prints something
