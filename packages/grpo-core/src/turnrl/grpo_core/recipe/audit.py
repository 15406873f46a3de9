"""The weights of a run's weight versions, for auditing its trajectories
(:func:`turnrl.grpo_core.training.audit.audit`).

Weight version ``v`` is what the engines served after ``v`` RL steps (the loop syncs
version ``step`` after each step), so the rollout of step ``v + 1`` was sampled by version
``v``. In a run folder, version 0 is the policy RL started from (``model/sft`` when SFT
finished, else ``--hf-checkpoint``, else the tiny ``model/base``); version ``v > 0`` is the
disk weight sync's export ``weights/v<v>`` while it is kept (the newest only), else the
trainer checkpoint ``checkpoints/step_<v>`` (every ``--save-interval`` steps, and the last).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from turnrl.grpo_core.recipe.sft import SFT_DONE
from turnrl.grpo_core.training.checkpoint import TRAINER_STATE


def start_policy(folder: Path, hf_checkpoint: str | None) -> Path:
    """Version 0 of the run in ``folder``: the policy its RL stage started from."""
    sft = folder / "model" / "sft"
    if (sft / SFT_DONE).is_file():
        return sft
    return Path(hf_checkpoint) if hf_checkpoint else folder / "model" / "base"


def weights_of_version(
    folder: Path, version: int, hf_checkpoint: str | None = None
) -> tuple[Path, Path | None]:
    """``(Hugging Face folder, trainer checkpoint to load over it or None)`` of ``version``.

    Raises:
        FileNotFoundError: the run kept no weights of that version (names what it kept).
    """
    if version < 0:
        raise ValueError(f"weight version must be >= 0, got {version}")
    start = start_policy(folder, hf_checkpoint)
    exported = folder / "weights" / f"v{version}"
    if version > 0 and (exported / "config.json").is_file():
        return exported, None
    checkpoint = folder / "checkpoints" / f"step_{version}"
    if version > 0 and (checkpoint / TRAINER_STATE).is_file():
        return start, checkpoint
    if version == 0 and (start / "config.json").is_file():
        return start, None
    kept = sorted(p.name for p in (folder / "checkpoints").glob("step_*")) + sorted(
        p.name for p in (folder / "weights").glob("v*")
    )
    raise FileNotFoundError(
        f"{folder} kept no weights of version {version} (kept: {', '.join(kept) or 'none'}); "
        "a run with --save-interval 1 keeps every version"
    )


def trainer_at_version(
    folder: Path, version: int, engine_config: Any, hf_checkpoint: str | None = None
) -> Any:
    """A trainer (``backends.make_engine(engine_config)``, its ``model_path`` replaced) holding
    the weights of ``version``.

    Raises:
        FileNotFoundError: no weights of that version (see :func:`weights_of_version`).
        ValueError: a checkpoint saved with another world size than this process's.
    """
    from dataclasses import replace

    from turnrl.grpo_core.backends import make_engine

    model, checkpoint = weights_of_version(folder, version, hf_checkpoint)
    trainer = make_engine(replace(engine_config, model_path=str(model)))
    if checkpoint is not None:
        trainer.load_checkpoint(checkpoint)
    return trainer
