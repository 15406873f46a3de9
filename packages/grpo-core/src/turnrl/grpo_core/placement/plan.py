"""Where trainers and inference engines run: the placement config and a pure planner.

The plan follows slime's scheme. One Ray placement group holds one bundle per device
(a GPU, an NPU, or on a CPU-only machine a slice of CPUs that stands for one device).
Bundles are numbered in a stable order (grouped by node, then by device id, see
:mod:`turnrl.grpo_core.placement.actors`), and the planner says which bundles each
trainer rank and each engine gets:

- **disaggregated** (default): trainers take bundles ``0 .. T-1`` and engines the next
  ``R`` bundles, ``rollout_num_gpus_per_engine`` consecutive bundles per engine, so an
  engine's devices share a node whenever the node has room for them;
- **colocated** (slime ``--colocate``): engines reuse the trainers' bundles, engine ``e``
  on bundles ``e*k .. e*k+k-1``; each actor then takes only a share of its bundle
  (trainer 0.4, engine 0.2, as slime does) so both fit.

Nothing here imports Ray: the plan is plain data and is unit-tested without a cluster.

Example::

    plan = plan_placement(PlacementConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2))
    plan.trainer_bundles   # (0, 1)
    plan.engine_bundles    # ((2,), (3,))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ACCELERATORS",
    "COLOCATED_ENGINE_SHARE",
    "COLOCATED_TRAINER_SHARE",
    "STRATEGIES",
    "PlacementConfig",
    "PlacementPlan",
    "plan_placement",
    "resolve_accelerator",
]

Accelerator = Literal["auto", "GPU", "NPU", "CPU"]
ACCELERATORS = ("auto", "GPU", "NPU", "CPU")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
COLOCATED_TRAINER_SHARE = 0.4
"""Share of its bundle's device a trainer actor requests when colocated (slime's value)."""
COLOCATED_ENGINE_SHARE = 0.2
"""Share of its bundle's device an engine actor requests when colocated (slime's value)."""


@dataclass(frozen=True)
class PlacementConfig:
    """How many devices trainers and engines get, and whether they share them."""

    actor_num_nodes: int = 1
    """Nodes the trainers span [--actor-num-nodes]."""
    actor_num_gpus_per_node: int = 1
    """Trainer ranks (devices) per node [--actor-num-gpus-per-node]; the trainer world size
    is ``actor_num_nodes * actor_num_gpus_per_node``."""
    rollout_num_gpus: int = 1
    """Devices for all inference engines together [--rollout-num-gpus]; with ``colocate``
    at most the trainers' device count (engines reuse those devices)."""
    rollout_num_gpus_per_engine: int = 1
    """Devices per engine, i.e. its tensor-parallel size [--rollout-num-gpus-per-engine]."""
    colocate: bool = False
    """Engines share the trainers' devices instead of having their own [--colocate]."""
    accelerator: Accelerator = "auto"
    """Ray resource one device is: ``GPU``, ``NPU`` (Ray's name for Ascend), ``CPU`` (one
    device = one bundle of ``cpus_per_device`` CPUs), or ``auto`` (detected by
    :mod:`turnrl.npu_runtime`: NPU, else GPU, else CPU)."""
    cpus_per_device: float = 1.0
    """CPUs reserved in each device's bundle (all of the "device" when it is a CPU)."""
    strategy: str = "PACK"
    """Ray placement-group strategy: ``PACK`` (fill nodes one by one, as slime), ``SPREAD``,
    ``STRICT_PACK`` (all on one node) or ``STRICT_SPREAD`` (one bundle per node)."""

    def __post_init__(self) -> None:
        for name in (
            "actor_num_nodes",
            "actor_num_gpus_per_node",
            "rollout_num_gpus",
            "rollout_num_gpus_per_engine",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            raise ValueError(
                f"rollout_num_gpus ({self.rollout_num_gpus}) must be a multiple of "
                f"rollout_num_gpus_per_engine ({self.rollout_num_gpus_per_engine})"
            )
        if self.colocate and self.rollout_num_gpus > self.num_trainers:
            raise ValueError(
                f"with colocate the engines reuse the trainers' {self.num_trainers} device(s), "
                f"so rollout_num_gpus must be <= {self.num_trainers}, got {self.rollout_num_gpus}"
            )
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")
        if not self.cpus_per_device > 0:
            raise ValueError(f"cpus_per_device must be > 0, got {self.cpus_per_device}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")

    @property
    def num_trainers(self) -> int:
        """Trainer world size: ``actor_num_nodes * actor_num_gpus_per_node``."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        """Number of inference engines: ``rollout_num_gpus / rollout_num_gpus_per_engine``."""
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles to reserve and which bundles each trainer rank and engine uses.

    Bundle indices are positions in the *ordered* bundle list (grouped by node, then by
    device id); the Ray side maps them to the placement group's own indices.
    """

    accelerator: str
    """The resolved Ray resource of one device: ``GPU``, ``NPU`` or ``CPU``."""
    bundles: tuple[dict[str, float], ...]
    """Resources of every bundle of the placement group, in placement-group order."""
    strategy: str
    """Ray placement-group strategy."""
    trainer_bundles: tuple[int, ...]
    """Ordered bundle index of each trainer rank (rank ``r`` -> ``trainer_bundles[r]``)."""
    engine_bundles: tuple[tuple[int, ...], ...]
    """Ordered bundle indices of each engine; its actor sits on the first one."""
    trainer_share: float
    """Fraction of a bundle's device (and CPUs) one trainer actor requests."""
    engine_share: float
    """Fraction of a bundle's device (and CPUs) one engine actor requests."""
    colocate: bool
    """Whether engines share the trainers' bundles."""

    @property
    def num_bundles(self) -> int:
        """Number of bundles (devices) reserved."""
        return len(self.bundles)

    def actor_resources(self, share: float) -> dict[str, Any]:
        """Resources one actor taking ``share`` of a bundle requests (Ray ``.options`` form).

        Returns:
            ``num_cpus`` and, on an accelerator, ``num_gpus`` (GPU) or ``resources``
            (``{"NPU": share}``).
        """
        cpus = self.bundles[0].get("CPU", 0.0) * share
        if self.accelerator == "GPU":
            return {"num_cpus": cpus, "num_gpus": share}
        if self.accelerator == "NPU":
            return {"num_cpus": cpus, "resources": {"NPU": share}}
        return {"num_cpus": cpus}


def resolve_accelerator(accelerator: str) -> str:
    """``GPU`` / ``NPU`` / ``CPU`` for an explicit name; ``auto`` asks turnrl.npu_runtime."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    if accelerator != "auto":
        return accelerator
    from turnrl.npu_runtime.device import ray_resource_name

    return ray_resource_name() or "CPU"


def plan_placement(config: PlacementConfig, accelerator: str | None = None) -> PlacementPlan:
    """Map trainer ranks and engines to bundles of one placement group.

    Args:
        config: Device counts and colocation.
        accelerator: Override of ``config.accelerator`` (``GPU`` / ``NPU`` / ``CPU``).

    Returns:
        The :class:`PlacementPlan`.
    """
    resource = resolve_accelerator(accelerator or config.accelerator)
    trainers = config.num_trainers
    per_engine = config.rollout_num_gpus_per_engine
    if config.colocate:
        num_bundles = trainers
        first_engine_bundle = 0
        shares = (COLOCATED_TRAINER_SHARE, COLOCATED_ENGINE_SHARE)
    else:
        num_bundles = trainers + config.rollout_num_gpus
        first_engine_bundle = trainers
        shares = (1.0, 1.0)
    bundle: dict[str, float] = {"CPU": float(config.cpus_per_device)}
    if resource != "CPU":
        bundle[resource] = 1.0
    engines = tuple(
        tuple(
            range(first_engine_bundle + e * per_engine, first_engine_bundle + (e + 1) * per_engine)
        )
        for e in range(config.num_engines)
    )
    return PlacementPlan(
        accelerator=resource,
        bundles=tuple(dict(bundle) for _ in range(num_bundles)),
        strategy=config.strategy,
        trainer_bundles=tuple(range(trainers)),
        engine_bundles=engines,
        trainer_share=shares[0],
        engine_share=shares[1],
        colocate=config.colocate,
    )
