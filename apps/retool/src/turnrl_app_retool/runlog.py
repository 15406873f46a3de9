"""Run-folder logging: metrics.jsonl always, TensorBoard (verl's names) when installed.

Scalars keep verl's names so curves line up with a verl ReTool run:
`val-core/<dataset>/acc/mean@<n>`, `val-aux/num_turns/mean`, `critic/rewards/mean`,
`response_length/mean`; the loop's own `rollout/`, `train/`, `perf/` names are logged too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import TracebackType
from typing import Any

VERL_ALIASES = {
    "rollout/reward_mean": "critic/rewards/mean",
    "rollout/response_len_mean": "response_length/mean",
    "rollout/num_turns_mean": "num_turns/mean",
}
"""turnrl loop metric -> the verl name it is also logged under."""


class RunLogger:
    """Writes step metrics to ``metrics.jsonl`` and, if available, TensorBoard.

    Args:
        folder: The run folder.
        tensorboard: Try to write TensorBoard events to ``folder/tensorboard``.
    """

    def __init__(self, folder: str | Path, tensorboard: bool = True) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.folder / "metrics.jsonl").open("a", encoding="utf-8")
        self.writer: Any = None
        self.tensorboard_error = ""
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.folder / "tensorboard"))
            except ImportError as exc:  # the `tensorboard` extra is not installed
                self.tensorboard_error = (
                    f"TensorBoard logging off ({exc}); install turnrl-app-retool[tensorboard]"
                )

    def log(self, step: int, metrics: dict[str, float], phase: str) -> None:
        """Record one step's scalars (and their verl aliases)."""
        scalars = {k: float(v) for k, v in metrics.items()}
        for ours, verl in VERL_ALIASES.items():
            if ours in scalars:
                scalars[verl] = scalars[ours]
        line = {"step": step, "phase": phase, "time": time.time(), **scalars}
        self._jsonl.write(json.dumps(line) + "\n")
        self._jsonl.flush()
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)

    def text(self, tag: str, body: str, step: int) -> None:
        """Validation generations as text (TensorBoard text tab, and a markdown file)."""
        safe = tag.replace("/", "_")
        (self.folder / f"{safe}_step{step}.md").write_text(body, encoding="utf-8")
        if self.writer is not None:
            self.writer.add_text(tag, body, step)

    def close(self) -> None:
        """Flush and close the files."""
        self._jsonl.close()
        if self.writer is not None:
            self.writer.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
