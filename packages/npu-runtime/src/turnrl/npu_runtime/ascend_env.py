"""Environment variables an Ascend (NPU) run needs, as documented, overridable defaults.

These are the settings today's tau-bench and ReTool NPU launch scripts export by hand
(see each entry's ``why``). :func:`apply_ascend_env` sets the ones the user has not set
already -- a value in the environment always wins unless ``force=True`` -- and returns
exactly what it changed, so it can be logged and saved with the run's config.

Example::

    from turnrl.npu_runtime.ascend_env import apply_ascend_env

    changed = apply_ascend_env({"HCCL_CONNECT_TIMEOUT": "3600", "DISABLE_L2_CACHE": None})
    # changed == {"HCCL_HOST_SOCKET_PORT_RANGE": "60000-60050", ...}  (only what was set)

Pass ``env=`` a dict instead of ``os.environ`` to build a child process's environment
(e.g. for :func:`turnrl.npu_runtime.supervise.start_process`) without touching your own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = [
    "ASCEND_ENV_DEFAULTS",
    "CONFLICTING_ENV_VARS",
    "EnvDefault",
    "apply_ascend_env",
    "ascend_env_defaults",
    "remove_conflicting_env",
]


@dataclass(frozen=True)
class EnvDefault:
    """One environment variable turnrl sets on Ascend machines."""

    value: str
    """The default value."""
    why: str
    """What it does and why turnrl sets it."""


ASCEND_ENV_DEFAULTS: Mapping[str, EnvDefault] = {
    "HCCL_HOST_SOCKET_PORT_RANGE": EnvDefault(
        "60000-60050",
        "host-side HCCL ports; a fixed range keeps several process groups (trainer, "
        "engines, weight sync) on one node from colliding and lets firewalls allow them",
    ),
    "HCCL_NPU_SOCKET_PORT_RANGE": EnvDefault(
        "61000-61050", "device-side HCCL ports, same reason as the host range"
    ),
    "HCCL_CONNECT_TIMEOUT": EnvDefault(
        "1200",
        "seconds HCCL waits for all ranks to connect (default 120): engines loading "
        "weights can keep peers waiting longer than that",
    ),
    "HCCL_OP_EXPANSION_MODE": EnvDefault(
        "AIV", "run HCCL collectives on the AI Vector cores (faster on A2/A3; ReTool recipe)"
    ),
    "TASK_QUEUE_ENABLE": EnvDefault(
        "1", "torch_npu's asynchronous task queue (operator dispatch pipelining)"
    ),
    "VLLM_ASCEND_ENABLE_NZ": EnvDefault(
        "0",
        "keep vllm-ascend weights in the ND format; the NZ format breaks in-place weight "
        "updates from the trainer",
    ),
    "VLLM_USE_AOT_COMPILE": EnvDefault(
        "0", "no ahead-of-time compilation in vLLM (as validated in the tau-bench example)"
    ),
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": EnvDefault(
        "1",
        "Ray must not rewrite ASCEND_RT_VISIBLE_DEVICES in its workers; turnrl assigns "
        "NPUs to trainers and engines itself",
    ),
    "CUDA_DEVICE_MAX_CONNECTIONS": EnvDefault(
        "1",
        "one device work queue, which Megatron-core expects so communication kernels are "
        "scheduled in order (set by the tau-bench example)",
    ),
    "DISABLE_L2_CACHE": EnvDefault("1", "as set by the validated tau-bench NPU example"),
}
"""The defaults, by variable name. Read-only; pass overrides to :func:`apply_ascend_env`."""

CONFLICTING_ENV_VARS: tuple[str, ...] = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Variables the NPU scripts unset: CUDA allocator settings that torch_npu rejects or
misreads (use ``PYTORCH_NPU_ALLOC_CONF`` on Ascend)."""


def ascend_env_defaults(overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The default variables with ``overrides`` applied.

    Args:
        overrides: Name -> value replacing a default or adding a variable; a value of
            None drops that variable from the defaults.

    Returns:
        Name -> value of every variable that would be set.

    Raises:
        ValueError: An override has an empty name, a name with ``=``, or a value that
            is not a string or None.
    """
    values = {name: default.value for name, default in ASCEND_ENV_DEFAULTS.items()}
    for name, value in (overrides or {}).items():
        if not isinstance(name, str) or not name or "=" in name:
            raise ValueError(f"invalid environment variable name {name!r}")
        if value is None:
            values.pop(name, None)
        elif isinstance(value, str):
            values[name] = value
        else:
            raise ValueError(
                f"override {name}={value!r} must be a string (or None to drop the default)"
            )
    return values


def apply_ascend_env(
    overrides: Mapping[str, str | None] | None = None,
    *,
    env: MutableMapping[str, str] | None = None,
    force: bool = False,
) -> dict[str, str]:
    """Set the Ascend defaults in ``env`` where not already set.

    Args:
        overrides: Changes to the defaults (see :func:`ascend_env_defaults`).
        env: The environment to change (default ``os.environ``).
        force: Also replace values already present in ``env``.

    Returns:
        Name -> value of the variables actually set (those already present with a
        different value are left alone and not listed, unless ``force``).
    """
    target: MutableMapping[str, str] = os.environ if env is None else env
    changed: dict[str, str] = {}
    for name, value in ascend_env_defaults(overrides).items():
        if name in target and not force:
            continue
        if target.get(name) != value:
            target[name] = value
            changed[name] = value
    return changed


def remove_conflicting_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Remove :data:`CONFLICTING_ENV_VARS` from ``env``; returns what was removed."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    return {name: target.pop(name) for name in CONFLICTING_ENV_VARS if name in target}
