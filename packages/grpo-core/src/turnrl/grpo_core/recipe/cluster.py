"""One run's Ray cluster, placement and engines, from an app's settings.

Example::

    placement = PlacementConfig(rollout_num_gpus=1, accelerator=accelerator("cpu"))
    with ray_run(placement, EngineLaunch(spec=spec, log_dir="run/logs")) as job:
        job.start_trainers(TorchEngineConfig(model_path="run/model/sft"))
        loop = job.make_loop(loop_config, prompts, generate, reward, pad_id=0, sync_root="run/weights")
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from turnrl.grpo_core.placement.plan import PlacementConfig, plan_placement
from turnrl.grpo_core.placement.trainer_group import RayGRPORun
from turnrl.npu_runtime.device import resolve_device


def accelerator(device: str) -> Any:
    """The Ray resource one device of ``device`` (cpu, gpu/cuda, npu) is: CPU, GPU or NPU."""
    return resolve_device(device).ray_resource or "CPU"


@contextlib.contextmanager
def ray_run(
    placement: PlacementConfig,
    launch: Any = None,
    *,
    torch_threads: int = 0,
    ready_timeout_s: float = 60.0,
    cancel: threading.Event | None = None,
) -> Iterator[RayGRPORun]:
    """A :class:`RayGRPORun` with its engines started (``launch``: an ``EngineLaunch``, or
    None for no engines); the trainer ranks are started by the caller
    (``job.start_trainers``), e.g. once an SFT stage has written their model. Everything
    it started is stopped at exit.

    Connects to the cluster ``RAY_ADDRESS`` names, or starts a local Ray of its own sized to
    the placement (one CPU per bundle), whatever other Ray runs on the machine, and stops it
    after.

    Args:
        placement: Trainer ranks and engines, and whether they share devices.
        launch: What every engine serves.
        torch_threads: CPU threads of each trainer rank (0: one per core of the machine;
            Ray would otherwise give a 1-CPU actor a single OpenMP thread).
        ready_timeout_s: How long the cluster may take to grant the placement; past it the
            run stops with an error naming what it asked for.
        cancel: Set from another thread to stop the engines while they start
            (``StartCancelled``).
    """
    from turnrl.grpo_core.placement.actors import require_ray

    # Set before Ray is imported, which reads it: the actors reuse this environment as it is.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray = require_ray()
    started = not ray.is_initialized()
    if started:
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a cluster of this machine only
            # Ray runs its workers at niceness 15; here they are the trainer and the engines,
            # which would then lose every core to the app's own process (train steps +50%).
            os.environ.setdefault("RAY_worker_niceness", "0")
            bundles = plan_placement(placement).num_bundles
            # "local": a new Ray of its own even where another runs on this machine (a
            # `ray start`, or a test's cluster): without it ray.init connects to the latest
            # one started here, and refuses num_cpus there.
            ray.init(
                address="local", num_cpus=bundles, include_dashboard=False, log_to_driver=False
            )
    threads = torch_threads or os.cpu_count() or 1
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
    job = RayGRPORun(placement, None, launch, env=env, ready_timeout_s=ready_timeout_s)
    try:
        job.start_engines(cancel)
        yield job
    finally:
        job.shutdown()
        if started:
            ray.shutdown()
