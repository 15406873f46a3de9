"""Ray actors for trainers and inference engines, placed by a :class:`PlacementPlan`.

:class:`RayPlacement` reserves one placement group for the plan (waiting at most
``ready_timeout_s``, then failing with the cluster's resources in the message), probes
each bundle for its node and device id, orders the bundles (by node, then device id),
and starts

- one :class:`TrainerActor` per trainer rank: it joins a ``torch.distributed`` group with
  the others through :func:`turnrl.npu_runtime.distributed.init_distributed` (gloo on CPU,
  nccl / hccl on devices; rank 0's node hosts the rendezvous) and builds a
  :class:`~turnrl.grpo_core.training.torch_engine.TorchEngine`;
- one :class:`EngineActor` per engine: it starts an inference server on its node -- a
  real vLLM :class:`~turnrl.rollout_router.engine.EngineServer` on the engine's devices, or
  whatever server ``EngineLaunch(server=...)`` starts (tests pass the loopback fake engine
  of :mod:`turnrl.rollout_router.testing`) -- and reports its URL.

Every actor reports its Ray node id. :meth:`RayPlacement.shutdown` stops the servers,
the process group and the actors, and removes the placement group.

Ray is optional: it is imported only when these functions run (``pip install
'turnrl-grpo-core[ray]'``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import Any, Protocol

from turnrl.grpo_core.placement.plan import PlacementConfig, PlacementPlan, plan_placement
from turnrl.npu_runtime.ascend_env import ascend_env_defaults
from turnrl.npu_runtime.device import DeviceType
from turnrl.npu_runtime.net import free_port
from turnrl.npu_runtime.supervise import StartCancelled

__all__ = [
    "RAY_INSTALL_HINT",
    "BundleInfo",
    "EngineActor",
    "EngineHandle",
    "EngineLaunch",
    "PlacementError",
    "RayPlacement",
    "TrainerActor",
    "node_slots",
    "require_ray",
    "trainer_device_env",
]

RAY_INSTALL_HINT = "pip install 'turnrl-grpo-core[ray]'"
_DEVICE_OF = {device.ray_resource or "CPU": device for device in DeviceType}
"""The device of each of the plan's Ray accelerator names (``CPU``, ``GPU``, ``NPU``)."""


def require_ray() -> ModuleType:
    """Import and return ``ray``, or raise an ImportError naming the extra to install."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            f"Ray placement needs ray: install turnrl-grpo-core[ray] ({RAY_INSTALL_HINT}); {error}"
        ) from error
    return ray


class PlacementError(RuntimeError):
    """The cluster cannot hold the placement, or an actor failed to start."""


@dataclass(frozen=True)
class BundleInfo:
    """Where one bundle of the placement group landed."""

    pg_index: int
    """The bundle's index in the placement group."""
    node_id: str
    """Ray node id (hex)."""
    node_ip: str
    """IP address of the node."""
    device_ids: tuple[str, ...]
    """Accelerator ids Ray assigned to the bundle (empty on CPU)."""


class EngineHandle(Protocol):
    """A started engine server as :class:`EngineActor` holds it."""

    url: str

    def stop(self) -> None: ...


@dataclass(frozen=True)
class EngineLaunch:
    """What each engine actor serves: a real vLLM server, or a server of the caller's."""

    spec: Any = None
    """A :class:`turnrl.rollout_router.engine.EngineSpec` for a real server. Each engine gets
    a free port on its node, ``tensor_parallel_size = rollout_num_gpus_per_engine`` and the
    visible-devices variable of its bundles' devices."""
    server: Callable[[], EngineHandle] | None = None
    """Instead of ``spec``: a picklable callable that starts a server inside the actor and
    returns it (``url``, ``stop()``), e.g. ``turnrl.rollout_router.testing.ThreadedFakeEngine``
    in tests."""
    log_dir: str | None = None
    """Folder of the real servers' logs on each node (default: the temp folder)."""

    def __post_init__(self) -> None:
        if (self.spec is None) == (self.server is None):
            raise ValueError("EngineLaunch needs exactly one of spec=EngineSpec(...) or server=")


def _node_info() -> dict[str, Any]:
    ray = require_ray()
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }


def trainer_device_env(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What a trainer rank on ``device`` needs in its environment that ``environ`` (default:
    this process's) leaves unset: turnrl-npu-runtime's Ascend defaults on ``npu`` (the
    tau-bench NPU script's values, ``CUDA_DEVICE_MAX_CONNECTIONS=1`` among them),
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` on ``cuda`` (megatron-core's requirement for its
    communication to overlap in order); nothing on the CPU."""
    environ = dict(os.environ) if environ is None else environ
    if device == "npu":
        defaults = ascend_env_defaults()
    elif device == "cuda":
        defaults = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    else:
        return {}
    return {name: value for name, value in defaults.items() if name not in environ}


class TrainerActor:
    """One trainer rank: a process-group member that owns a train engine (a ``Trainer``)."""

    def __init__(self, rank: int, world_size: int, device: str, env: dict[str, str]) -> None:
        """Remember this rank's place; nothing heavy starts until asked.

        Args:
            rank: Global rank.
            world_size: Number of trainer ranks.
            device: ``cpu``, ``cuda`` or ``npu``.
            env: Variables to set in this process; ``OMP_NUM_THREADS`` also sets torch's
                CPU threads (Ray starts a worker with it at the actor's CPU count, and torch
                is imported by the time the actor is built, so the variable alone does not).
        """
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        self.rank, self.world_size, self.device = rank, world_size, device
        self.engine: Any = None
        self.reference: Any = None
        self.weight_sync: Any = None

    def node_info(self) -> dict[str, Any]:
        """Node id, node IP, pid, rank and torch CPU threads of this actor."""
        import torch

        return {**_node_info(), "rank": self.rank, "torch_threads": torch.get_num_threads()}

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a port free on it, for rank 0 to host the process group."""
        return require_ray().util.get_node_ip_address(), free_port("")

    def init_process_group(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the trainers' ``torch.distributed`` group (blocks until all ranks join)."""
        from turnrl.npu_runtime.distributed import init_distributed

        # On a device Ray makes only this bundle's device visible, so it is local device 0.
        local = self.rank if self.device == "cpu" else 0
        ctx = init_distributed(
            rank=self.rank,
            world_size=self.world_size,
            local_rank=local,
            master_addr=master_addr,
            master_port=master_port,
            device=self.device,
        )
        return {k: str(v) for k, v in asdict(ctx).items()}

    def build_engine(self, config: Any) -> None:
        """Build the train engine ``config`` names (``make_engine``: the torch backend,
        FSDP2-sharded over the group when world size > 1, or the megatron backend)."""
        from turnrl.grpo_core.backends import make_engine

        self.engine = make_engine(config)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``Trainer.<method>`` (``train_step``, ``compute_logprobs``, ...)."""
        if self.engine is None:
            raise RuntimeError(f"trainer rank {self.rank}: build_engine() has not run")
        return getattr(self.engine, method)(*args, **kwargs)

    def build_reference(self, config: dict[str, Any]) -> None:
        """Load a frozen ``ReferencePolicy(**config)`` (FSDP2-sharded when world size > 1)."""
        from turnrl.grpo_core.training.reference import ReferencePolicy

        self.reference = ReferencePolicy(**config)

    def reference_logprobs(self, batch: Any) -> Any:
        """``ReferencePolicy.compute_logprobs(batch)`` on this rank's rows."""
        if self.reference is None:
            raise RuntimeError(f"trainer rank {self.rank}: build_reference() has not run")
        return self.reference.compute_logprobs(batch)

    def sync_weights(self, config: Any, version: int) -> dict[str, float]:
        """Send the weights to the engines as ``version`` over ``config``'s collective (a
        ``CollectiveSyncConfig``; its group is made on the first call and kept): every rank
        gathers its shards, rank 0 sends them. Its store listens on this node's address."""
        import asyncio

        from turnrl.grpo_core.weight_sync.collective import CollectiveWeightSync

        if self.engine is None:
            raise RuntimeError(f"trainer rank {self.rank}: build_engine() has not run")
        if self.weight_sync is None:
            if config.master_address == "127.0.0.1":  # engines on other nodes reach it here
                config = replace(config, master_address=require_ray().util.get_node_ip_address())
            self.weight_sync = CollectiveWeightSync(config, rank=self.rank)
        return asyncio.run(self.weight_sync.sync(self.engine, version))

    def close_weight_sync(self) -> None:
        """Leave the engines' transfer group (rank 0), if one was made."""
        import asyncio

        sync, self.weight_sync = self.weight_sync, None
        if sync is not None:
            asyncio.run(sync.close())

    def shutdown(self) -> None:
        """Drop the engine and leave the process group."""
        from turnrl.npu_runtime.distributed import destroy_distributed

        self.engine = None
        self.reference = None
        destroy_distributed()


class EngineActor:
    """One inference engine: starts a server on its node and reports the URL."""

    def __init__(self, index: int, env: dict[str, str]) -> None:
        """Args: index: the engine's index; env: variables to set in this process."""
        os.environ.update(env)
        self.index = index
        self.server: Any = None
        self.url: str | None = None

    def node_info(self) -> dict[str, Any]:
        """Node id, node IP, pid and engine index of this actor."""
        return {**_node_info(), "engine": self.index}

    def start(
        self,
        launch: EngineLaunch,
        accelerator: str,
        device_ids: list[str],
        slot: tuple[int, int] = (0, 1),
    ) -> str:
        """Start the server (blocks until it is healthy) and return its base URL.

        Args:
            launch: What to serve.
            accelerator: ``GPU`` / ``NPU`` / ``CPU`` (which visible-devices variable to set).
            device_ids: The engine's device ids on this node (empty on CPU).
            slot: This engine's index among the engines of its node, and their number: on
                the CPU each gets cores of its own (``EngineSpec.cpu_slot``).
        """
        if self.server is not None:
            raise RuntimeError(f"engine {self.index} is already started at {self.url}")
        if launch.server is not None:
            self.server = launch.server()
            self.url = self.server.url
            return self.url
        from turnrl.rollout_router.engine import EngineServer

        env = dict(launch.spec.env)
        visible = _DEVICE_OF[accelerator].visible_devices_env
        if visible and device_ids:
            env[visible] = ",".join(device_ids)
        spec = replace(
            launch.spec,
            port=free_port(""),
            tensor_parallel_size=max(1, len(device_ids)),
            env=env,
            cpu_slot=slot,  # the server splits the node's cores among its engines (CPU)
        )
        self.server = EngineServer(spec, log_dir=launch.log_dir).start()
        host = spec.host
        self.url = (
            f"http://{require_ray().util.get_node_ip_address()}:{spec.port}"
            if host in ("0.0.0.0", "")
            else spec.url
        )
        return self.url

    def restart(self) -> str:
        """Start the real server again on its port and devices (after it died or hung):
        what is left of it is stopped, then it starts as it first did, from the launch
        model, and this blocks until it is healthy. Returns its URL."""
        if self.server is None or not hasattr(self.server, "restart"):
            raise RuntimeError(f"engine {self.index} has no real server to restart")
        self.server.restart()
        assert self.url is not None
        return self.url

    def stop(self) -> None:
        """Stop the server (its whole process group for a real one); safe to call twice."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()


def node_slots(nodes: list[str]) -> list[tuple[int, int]]:
    """For each entry of ``nodes``: its index among the entries of the same node, and how
    many there are (``["a", "b", "a"]`` -> ``[(0, 2), (0, 1), (1, 2)]``)."""
    return [(nodes[:i].count(node), nodes.count(node)) for i, node in enumerate(nodes)]


def _probe_bundles(ray: ModuleType, pg: Any, plan: PlacementPlan) -> list[BundleInfo]:
    """Run a tiny task in every bundle to learn its node and device id."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def probe(resource: str) -> tuple[str, str, list[str]]:
        ids = ray.get_runtime_context().get_accelerator_ids().get(resource, [])
        node = ray.get_runtime_context().get_node_id()
        return node, ray.util.get_node_ip_address(), [str(i) for i in ids]

    remote = ray.remote(probe)
    small = plan.actor_resources(0.01)
    refs = [
        remote.options(
            **small,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            ),
        ).remote(plan.accelerator)
        for i in range(plan.num_bundles)
    ]
    found = ray.get(refs)
    return [BundleInfo(i, node, ip, tuple(ids)) for i, (node, ip, ids) in enumerate(found)]


def _order_key(info: BundleInfo) -> tuple[str, str, int, int]:
    device = int(info.device_ids[0]) if info.device_ids and info.device_ids[0].isdigit() else -1
    return info.node_ip, info.node_id, device, info.pg_index


class RayPlacement:
    """Trainers and engines placed on a Ray cluster by a :class:`PlacementConfig`.

    Example (needs a running Ray, e.g. after ``ray.init()``)::

        with RayPlacement(PlacementConfig(actor_num_gpus_per_node=2, accelerator="CPU")) as rp:
            trainers = rp.start_trainers(TorchEngineConfig(model_path="runs/tiny"))
            urls = rp.start_engines(EngineLaunch(server=ThreadedFakeEngine))  # tests' fake
            metrics = rp.trainer_call("train_step", [shard0, shard1], objective="sft")
    """

    def __init__(
        self,
        config: PlacementConfig,
        ready_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """Plan the placement; nothing is reserved until :meth:`start` (or ``with``).

        Args:
            config: Device counts and colocation.
            ready_timeout_s: How long to wait for the cluster to grant the placement group.
            env: Variables set in every actor (e.g. ``OMP_NUM_THREADS``).
        """
        if ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {ready_timeout_s}")
        self.config = config
        self.plan = plan_placement(config)
        self.ready_timeout_s = ready_timeout_s
        self.env = dict(env or {})
        self.pg: Any = None
        self.bundles: list[BundleInfo] = []
        """Bundles in plan order (by node, then device id)."""
        self.trainers: list[Any] = []
        self.trainer_nodes: list[str] = []
        """Ray node id of each trainer rank."""
        self.engines: list[Any] = []
        self.engine_nodes: list[str] = []
        """Ray node id of each engine."""
        self.engine_urls: list[str] = []
        """Base URL of each engine's server."""

    def __enter__(self) -> RayPlacement:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start(self) -> RayPlacement:
        """Reserve the placement group and probe its bundles.

        Raises:
            PlacementError: The cluster did not grant the bundles within the timeout.
        """
        ray = require_ray()
        from ray.util.placement_group import placement_group, remove_placement_group

        if self.pg is not None:
            raise RuntimeError("RayPlacement.start() was already called")
        plan = self.plan
        pg = placement_group([dict(b) for b in plan.bundles], strategy=plan.strategy)
        ready, _ = ray.wait([pg.ready()], timeout=self.ready_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise PlacementError(
                f"the cluster did not grant {plan.num_bundles} bundle(s) of {plan.bundles[0]} "
                f"(strategy {plan.strategy}) within {self.ready_timeout_s:g} s: it has "
                f"{_resources(ray.cluster_resources())} in total, "
                f"{_resources(ray.available_resources())} free"
            )
        self.pg = pg
        self.bundles = sorted(_probe_bundles(ray, pg, plan), key=_order_key)
        for e, group in enumerate(plan.engine_bundles):
            nodes = {self.bundles[b].node_id for b in group}
            if len(nodes) > 1:
                self.shutdown()
                raise PlacementError(
                    f"engine {e}'s {len(group)} devices landed on {len(nodes)} nodes; give each "
                    "node a multiple of rollout_num_gpus_per_engine devices"
                )
        return self

    def _options(self, ordered_bundle: int, share: float) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.pg is None:
            raise RuntimeError("call RayPlacement.start() first")
        return {
            **self.plan.actor_resources(share),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg,
                placement_group_bundle_index=self.bundles[ordered_bundle].pg_index,
            ),
        }

    def start_trainers(self, engine_config: Any = None) -> list[Any]:
        """Start one trainer actor per rank, join them in a process group, build the engines.

        Args:
            engine_config: The :class:`TorchEngineConfig` every rank builds; None starts
                the actors only (no process group, no engine), e.g. to inspect placement.

        Returns:
            The trainer actor handles, by rank.
        """
        ray = require_ray()
        if self.trainers:
            raise RuntimeError("trainers are already started")
        plan, world = self.plan, self.config.num_trainers
        device = _DEVICE_OF[plan.accelerator].value
        env = {"TURNRL_DEVICE": device, "LOCAL_WORLD_SIZE": "1" if device != "cpu" else str(world)}
        env = {**trainer_device_env(device), **self.env, **env}
        remote = ray.remote(TrainerActor)
        self.trainers = [
            remote.options(**self._options(b, plan.trainer_share)).remote(r, world, device, env)
            for r, b in enumerate(plan.trainer_bundles)
        ]
        infos = _get(ray, [a.node_info.remote() for a in self.trainers], "trainer actors start")
        self.trainer_nodes = [i["node_id"] for i in infos]
        if engine_config is None:
            return self.trainers
        addr, port = _get(ray, [self.trainers[0].rendezvous_address.remote()], "rendezvous")[0]
        refs = [a.init_process_group.remote(addr, port) for a in self.trainers]
        _get(ray, refs, "trainers join the process group")
        _get(ray, [a.build_engine.remote(engine_config) for a in self.trainers], "build engines")
        return self.trainers

    def trainer_call(
        self, method: str, per_rank_args: list[Any] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``Trainer.<method>`` on every rank at once; one result per rank.

        Args:
            method: Engine method name, e.g. ``train_step``.
            per_rank_args: The first positional argument of each rank (e.g. its batch
                shard); None calls without one.
            **kwargs: Keyword arguments passed to every rank.
        """
        ray = require_ray()
        if not self.trainers:
            raise RuntimeError("call start_trainers() first")
        if per_rank_args is not None and len(per_rank_args) != len(self.trainers):
            raise ValueError(
                f"per_rank_args has {len(per_rank_args)} entries for {len(self.trainers)} ranks"
            )
        refs = [
            a.call.remote(method, **kwargs)
            if per_rank_args is None
            else a.call.remote(method, per_rank_args[r], **kwargs)
            for r, a in enumerate(self.trainers)
        ]
        return list(ray.get(refs))

    def start_engines(
        self, launch: EngineLaunch, cancel: threading.Event | None = None
    ) -> list[str]:
        """Start one engine actor per engine, each serving on its node; return the URLs.

        Raises:
            StartCancelled: ``cancel`` was set (from another thread) before all were
                serving; :meth:`shutdown` with ``grace_s=0`` stops them at once.
        """
        ray = require_ray()
        if self.engines:
            raise RuntimeError("engines are already started")
        plan = self.plan
        if plan.colocate and launch.spec is not None:  # free the devices while ranks train
            launch = replace(launch, spec=replace(launch.spec, sleep_mode=True))
        remote = ray.remote(EngineActor)
        for e, group in enumerate(plan.engine_bundles):
            options = self._options(group[0], plan.engine_share)
            self.engines.append(remote.options(**options).remote(e, self.env))
        infos = _get(ray, [a.node_info.remote() for a in self.engines], "engine actors start")
        self.engine_nodes = [i["node_id"] for i in infos]
        refs = []
        slots = node_slots(self.engine_nodes)
        for actor, group, slot in zip(self.engines, plan.engine_bundles, slots, strict=True):
            ids = [d for b in group for d in self.bundles[b].device_ids]
            refs.append(actor.start.remote(launch, plan.accelerator, ids, slot))
        self.engine_urls = _get(ray, refs, "engine servers start", cancel)
        return self.engine_urls

    def restart_engine(self, index: int) -> str:
        """Start engine ``index`` again (:meth:`EngineActor.restart`); blocks until healthy."""
        ray = require_ray()
        return str(_get(ray, [self.engines[index].restart.remote()], "engine restart")[0])

    def shutdown(self, grace_s: float = 60.0) -> None:
        """Stop engine servers and the process group, kill the actors, free the bundles.

        Each actor gets ``grace_s`` to stop what it runs; an actor still busy (an engine
        still starting) is killed after it, and the guard of its engine's process group
        stops the engine."""
        ray = require_ray()
        from ray.util.placement_group import remove_placement_group

        # With Ray gone its actors went too, and a remote call would start a new Ray.
        if ray.is_initialized():
            calls = [a.stop.remote() for a in self.engines] + [
                a.shutdown.remote() for a in self.trainers
            ]
            if calls and grace_s > 0:
                ray.wait(calls, num_returns=len(calls), timeout=grace_s)
            for actor in self.engines + self.trainers:
                ray.kill(actor)
            if self.pg is not None:
                remove_placement_group(self.pg)
        self.engines, self.trainers, self.pg = [], [], None
        self.engine_urls, self.engine_nodes, self.trainer_nodes = [], [], []


def _get(
    ray: ModuleType, refs: list[Any], what: str, cancel: threading.Event | None = None
) -> list[Any]:
    """``ray.get`` that turns an actor's failure into a :class:`PlacementError`, and stops
    waiting (``StartCancelled``) once ``cancel`` is set."""
    if cancel is not None:
        while ray.wait(refs, num_returns=len(refs), timeout=0.5)[1]:
            if cancel.is_set():
                raise StartCancelled(f"stopped waiting for the {what}")
    try:
        return list(ray.get(refs))
    except ray.exceptions.RayError as error:
        raise PlacementError(f"{what} failed: {error}") from error


def _resources(resources: dict[str, float]) -> str:
    shown = {
        k: v
        for k, v in sorted(resources.items())
        if not k.startswith(("node:", "memory", "object_store"))
    }
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"
