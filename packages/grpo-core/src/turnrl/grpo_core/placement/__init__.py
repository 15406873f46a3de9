"""Where trainer ranks and engines run: the placement plan and its Ray actors.

- :mod:`~turnrl.grpo_core.placement.plan`: which devices of which node each trainer rank
  and engine gets, from slime's cluster flags (no Ray needed).
- :mod:`~turnrl.grpo_core.placement.actors`: Ray placement groups, one actor per trainer
  rank and per engine with its own visible devices.
- :mod:`~turnrl.grpo_core.placement.trainer_group`: :class:`RayTrainerGroup` (the trainer
  ranks as one engine for the loop) and :class:`RayGRPORun` (a whole run on Ray).

Ray is imported when an actor is started; without it the error names the extra
(``turnrl-grpo-core[ray]``).
"""

from turnrl.grpo_core.placement.plan import PlacementConfig, PlacementPlan, plan_placement
from turnrl.grpo_core.placement.trainer_group import (
    RayGRPORun,
    RayReference,
    RayTrainerGroup,
    TrainerGroupError,
)

__all__ = [
    "PlacementConfig",
    "PlacementPlan",
    "RayGRPORun",
    "RayReference",
    "RayTrainerGroup",
    "TrainerGroupError",
    "plan_placement",
]
