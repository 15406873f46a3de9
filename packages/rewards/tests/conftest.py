"""Fixtures shared by the tests: where tau-bench's data lies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def tau_bench_dir() -> Path:
    """`../shared/tau-bench` beside the repository root (or $TURNRL_TAU_BENCH_DIR); skips if absent."""
    env = os.environ.get("TURNRL_TAU_BENCH_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / ".." / "shared" / "tau-bench"
    if not (path / "retail" / "tasks_train.jsonl").is_file():
        pytest.skip(f"tau-bench data not found at {path}")
    return path
