"""The ReTool app's data: SFT chats, RL prompts and validation sets, from files or generated
(``turnrl.tool_envs.retool.data``, ``retool.synth``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from turnrl.tool_envs.retool.data import MathTask, load_aime, load_dapo_math, load_retool_sft
from turnrl.tool_envs.retool.synth import (
    DATA_SOURCE,
    iter_sft_chats,
    make_problems,
    train_and_heldout,
)
from turnrl_app_retool.config import RetoolAppConfig


class Datasets:
    """The run's SFT chats, RL prompts and validation sets."""

    def __init__(self, config: RetoolAppConfig, instruction: str) -> None:
        d = config.data
        train, heldout = train_and_heldout(
            max(d.num_train_problems, d.num_sft_chats), d.num_val_problems, config.seed
        )
        # Probe chats for SFT's stop (SFTStop), never trained on: the file's last chats, or
        # generated problems of their own seed, in no other set.
        self.probe_chats: list[list[dict[str, Any]]] = []
        if d.sft_path:
            self.sft_chats = load_retool_sft(d.sft_path)
            if config.sft.probe_target:
                cut = len(self.sft_chats) - config.sft.probe_size
                self.sft_chats, self.probe_chats = self.sft_chats[:cut], self.sft_chats[cut:]
        else:  # SFT and RL share the generated training problems, never the held-out ones
            self.sft_chats = list(iter_sft_chats(train[: d.num_sft_chats], instruction))
            seen = {p.expression for p in train + heldout}
            probe = make_problems(config.sft.probe_size, config.seed * 2 + 3, exclude=seen)
            self.probe_chats = list(iter_sft_chats(probe, instruction))
        if d.train_path:
            self.train = load_dapo_math(d.train_path, d.max_train_prompts)
        else:
            self.train = [p.task(i) for i, p in enumerate(train[: d.num_train_problems])]
        self.val: dict[str, list[MathTask]] = {}
        for path in d.val_paths:
            tasks = load_aime(path)
            self.val.setdefault(tasks[0].data_source if tasks else Path(path).stem, []).extend(
                tasks
            )
        if not d.val_paths:
            self.val[DATA_SOURCE] = [p.task(i) for i, p in enumerate(heldout)]
        if config.eval.max_problems is not None:
            self.val = {k: v[: config.eval.max_problems] for k, v in self.val.items()}
