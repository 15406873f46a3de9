"""What every app's run composes, written once: the parts of a job both apps share.

- :func:`~turnrl.grpo_core.recipe.cluster.ray_run`: a local (or ``RAY_ADDRESS``) Ray cluster
  with a :class:`~turnrl.grpo_core.placement.trainer_group.RayGRPORun` placed on it, engines
  started, all stopped at exit; :func:`~turnrl.grpo_core.recipe.cluster.accelerator` maps an
  app's ``--device`` to the Ray resource a device is.
- :func:`~turnrl.grpo_core.recipe.loop.build_loop`: the RL stage's GRPOLoop with its
  trainer, reference policy and weight sync, in this process or on the Ray run's ranks.
- :mod:`~turnrl.grpo_core.recipe.run_folder`: ``claim_run_dir`` (a new folder, or a clear
  refusal of one that holds a run), ``load_progress`` / ``save_progress`` for resume,
  ``read_run_config`` / ``config_from_dict`` for the interrupted run's config,
  ``interrupted`` (Ctrl-C's exit code and ``--resume`` hint).
- :mod:`~turnrl.grpo_core.recipe.evaluation`: held-out statistics (mean and standard error
  over items, pass^k, the paired change RL made, a verdict sentence), phase timing, the
  run's curves and ``summary.json``.
- :func:`~turnrl.grpo_core.recipe.sft.run_sft_stage`: the SFT stage before RL (phases of
  steps, a scheduled learning rate, an early stop on a probe or a time bound, a progress
  bar, every step's metrics to a callback).
- :mod:`~turnrl.grpo_core.recipe.driver`: how an app's ``main.py`` drives a run: the run
  folder, config, progress, logger and phases as one ``Run`` (``open_run``), the RL stage
  over a loop (``RLStage``), ``main``'s exit codes (``run_main``).
- :func:`~turnrl.grpo_core.recipe.fleet.engine_fleet`: the engines on either runner.

Apps keep their presets, data, environments and rewards; a run of either app on the Ray
runner goes through these same functions on a laptop CPU and on a cluster.
"""

import importlib
from typing import TYPE_CHECKING, Any

from turnrl.grpo_core.recipe.run_folder import (
    claim_run_dir,
    config_from_dict,
    default_run_dir,
    interrupted,
    load_progress,
    read_run_config,
    save_progress,
)

if TYPE_CHECKING:
    from turnrl.grpo_core.recipe.cluster import accelerator, ray_run
    from turnrl.grpo_core.recipe.loop import build_loop
    from turnrl.grpo_core.recipe.sft import SFTPhase, run_sft_stage

_LAZY = {
    "build_loop": "loop",
    "accelerator": "cluster",
    "ray_run": "cluster",
    "SFTPhase": "sft",
    "run_sft_stage": "sft",
}


def __getattr__(name: str) -> Any:
    """The loop and the Ray run are imported when first used: they pull in torch, which an
    app's ``--help``, config checks and report statistics do not need."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SFTPhase",
    "accelerator",
    "build_loop",
    "claim_run_dir",
    "config_from_dict",
    "default_run_dir",
    "interrupted",
    "load_progress",
    "ray_run",
    "read_run_config",
    "run_sft_stage",
    "save_progress",
]
