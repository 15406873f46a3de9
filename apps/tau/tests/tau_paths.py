"""Shared test helpers: where the tau-bench data lives (skipped when absent)."""

from __future__ import annotations

import os
from pathlib import Path

TAU_BENCH_DIR = Path(
    os.environ.get("TURNRL_TAU_BENCH_DIR")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau-bench"
)
