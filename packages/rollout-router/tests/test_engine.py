"""EngineSpec -> launch command and environment; supervised start of a server that dies."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from turnrl.npu_runtime.net import free_port
from turnrl.npu_runtime.supervise import ProcessDiedError
from turnrl.rollout_router.engine import (
    DEFAULT_HEALTH_TIMEOUT,
    HEALTH_TIMEOUT_ENV,
    SERVER_MODULE,
    EngineLogprobsError,
    EngineServer,
    EngineSpec,
    health_timeout,
    launch_command,
    launch_env,
)


def test_cpu_command_uses_server_module_and_scale_out_routes():
    spec = EngineSpec(model="/m/tiny", port=8011, max_model_len=2048, extra_args=["--seed", "1"])
    cmd = launch_command(spec, "/env/bin/python")
    assert cmd[:3] == ["/env/bin/python", "-m", SERVER_MODULE]
    assert cmd[cmd.index("--port") + 1] == "8011"
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert "--enable-scale-out" in cmd and cmd[-2:] == ["--seed", "1"]
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"  # the sampled dist.
    assert "--gpu-memory-utilization" not in cmd  # not a CPU setting
    env = launch_env(EngineSpec(model="m", cpu_kvcache_gib=2, cpu_threads_bind="1"))
    assert env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "1",
    }


def test_gpu_and_npu_commands_carry_parallelism_and_memory():
    spec = EngineSpec(model="m", device="gpu", tensor_parallel_size=2, gpu_memory_utilization=0.6)
    cmd = launch_command(spec, "python")
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.6"
    npu_env = launch_env(EngineSpec(model="m", device="npu", env={"HCCL_BUFFSIZE": "512"}))
    assert npu_env["VLLM_SERVER_DEV_MODE"] == "1" and npu_env["HCCL_BUFFSIZE"] == "512"
    assert "VLLM_CPU_KVCACHE_SPACE" not in npu_env


def test_sleep_mode_is_a_device_flag_and_needs_the_dev_routes():
    gpu = launch_command(EngineSpec(model="m", device="gpu", sleep_mode=True), "python")
    assert "--enable-sleep-mode" in gpu
    assert "--enable-sleep-mode" not in launch_command(
        EngineSpec(model="m", device="gpu"), "python"
    )
    # vLLM refuses the flag on CPU; the routes still answer there (and free nothing)
    assert "--enable-sleep-mode" not in launch_command(
        EngineSpec(model="m", sleep_mode=True), "python"
    )
    with pytest.raises(ValueError, match="sleep_mode needs dev_mode"):
        EngineSpec(model="m", device="gpu", sleep_mode=True, dev_mode=False)


def test_health_timeout_from_spec_variable_or_device_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(HEALTH_TIMEOUT_ENV, raising=False)
    assert health_timeout(EngineSpec(model="m", device="npu")) == DEFAULT_HEALTH_TIMEOUT["npu"]
    monkeypatch.setenv(HEALTH_TIMEOUT_ENV, "42")
    assert health_timeout(EngineSpec(model="m")) == 42.0
    assert health_timeout(EngineSpec(model="m", health_timeout=5)) == 5
    monkeypatch.setenv(HEALTH_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="not a number"):
        health_timeout(EngineSpec(model="m"))
    monkeypatch.setenv(HEALTH_TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match="> 0"):
        health_timeout(EngineSpec(model="m"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "tpu"}, "device"),
        ({"port": 0}, "port"),
        ({"tensor_parallel_size": 0}, "parallel"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory"),
        ({"cpu_kvcache_gib": 0}, "kvcache"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ],
)
def test_bad_specs_are_rejected(kwargs: dict[str, object], match: str):
    with pytest.raises(ValueError, match=match):
        EngineSpec(model="m", **kwargs)  # type: ignore[arg-type]


def test_server_that_exits_raises_with_its_log(tmp_path: Path):
    # The interpreter here has no vLLM, so the server process dies at import.
    spec = EngineSpec(model="m", port=18999, python=sys.executable, health_timeout=30)
    server = EngineServer(spec, log_dir=tmp_path)
    with pytest.raises(ProcessDiedError) as err:
        server.start()
    assert "vllm" in str(err.value)
    assert server.process is not None and not server.process.alive
    assert server.log_path.is_file()


# A stand-in for a vLLM server (the real one is in the engine-cpu session): an old vLLM
# whose argument parser has no --logprobs-mode, or one that serves another mode.
STAND_IN = """
import argparse, http.server, json, os
parser = argparse.ArgumentParser()
for flag in ("--model", "--served-model-name", "--host", "--port", "--dtype"):
    parser.add_argument(flag)
parser.add_argument("--enable-scale-out", action="store_true")
if os.environ["STAND_IN_MODE"] != "old":
    parser.add_argument("--logprobs-mode")
args = parser.parse_args()

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"vllm_config": {"model_config": {
            "logprobs_mode": os.environ["STAND_IN_MODE"]}}}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body if self.path.startswith("/server_info") else b"ok")
    def log_message(self, *a):
        pass

http.server.HTTPServer((args.host, int(args.port)), Handler).serve_forever()
"""


def _stand_in_server(tmp_path: Path, mode: str) -> EngineServer:
    module = tmp_path / "pkg" / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    for folder in (module.parent.parent, module.parent, module):
        (folder / "__init__.py").write_text("")
    (module / "api_server.py").write_text(STAND_IN)
    env = {"PYTHONPATH": str(tmp_path / "pkg"), "STAND_IN_MODE": mode}
    spec = EngineSpec(
        model="m", port=free_port(), python=sys.executable, env=env, health_timeout=30
    )
    return EngineServer(spec, log_dir=tmp_path)


def test_a_vllm_without_logprobs_mode_is_refused_at_start_with_the_reason(tmp_path: Path):
    server = _stand_in_server(tmp_path, "old")
    with pytest.raises(EngineLogprobsError, match="cannot return the log-probs of the sampled"):
        server.start()
    assert server.process is not None and not server.process.alive


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_served_logprobs_mode_is_checked_once_healthy(tmp_path: Path, mode: str):
    server = _stand_in_server(tmp_path, mode)
    if mode == "processed_logprobs":
        server.start()
        server.stop()
        return
    with pytest.raises(EngineLogprobsError, match="reports logprobs_mode='raw_logprobs'"):
        server.start()
    assert server.process is not None and not server.process.alive


def test_api_server_cores_are_parsed_and_refused_where_they_cannot_act() -> None:
    from turnrl.rollout_router.engine import parse_cores

    assert parse_cores("0") == {0} and parse_cores("0,2") == {0, 2}
    assert parse_cores("1-3") == {1, 2, 3}
    with pytest.raises(ValueError, match="cores must look like"):
        parse_cores("0-3|4-7")
    with pytest.raises(ValueError, match="api_server_cores needs device cpu and cpu_threads_bind"):
        EngineSpec(model="m", api_server_cores="1")
    with pytest.raises(ValueError, match="api_server_cores needs device cpu"):
        EngineSpec(model="m", device="gpu", cpu_threads_bind="0", api_server_cores="1")
    with pytest.raises(ValueError, match="cores must look like"):
        EngineSpec(model="m", cpu_threads_bind="0", api_server_cores="one")


def test_the_default_layout_gives_the_api_servers_a_core_and_splits_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from turnrl.rollout_router.engine import cpu_layout

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    spec = EngineSpec(model="m")
    assert spec.api_server_cores == "auto" and spec.cpu_slot == (0, 1)

    def layout(cores: object, **kw: object) -> tuple[str, str | None]:
        made, why = cpu_layout(replace(spec, **kw), cores=cores)  # type: ignore[arg-type]
        assert why == ""
        return made.api_server_cores, made.cpu_threads_bind

    assert layout([3, 1]) == ("1", "3")  # the 2-core machine: server on 1, engine on 3
    thirds = [layout(range(8), cpu_slot=(i, 3)) for i in range(3)]
    assert thirds == [("0", "1,2"), ("0", "3,4"), ("0", "5,6")]  # core 7 left over
    # More engines than cores: they share the workers' cores, the servers keep theirs.
    assert [layout([0, 1], cpu_slot=(i, 2)) for i in range(2)] == [("0", "1"), ("0", "1")]
    # The engine's cores given (the spec, else the exported variable): the server the rest.
    assert layout(range(4), cpu_threads_bind="0") == ("1,2,3", "0")
    assert layout(range(4), env={"VLLM_CPU_OMP_THREADS_BIND": "1-2"}) == ("0,3", "1-2")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    assert layout(range(8)) == ("4,5,6,7", "0-3")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    # Chosen by the caller, or off the CPU: left as they are.
    for given in (
        EngineSpec(model="m", api_server_cores="off"),
        EngineSpec(model="m", cpu_threads_bind="1", api_server_cores="0"),
        EngineSpec(model="m", device="gpu"),
    ):
        assert cpu_layout(given, cores=range(8)) == (given, "")
    with pytest.raises(ValueError, match=r"cpu_slot must be \(index, count\)"):
        EngineSpec(model="m", cpu_slot=(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "cores", "why"),
    [
        ({}, [5], "may run on 1 core(s) only (5)"),
        ({"tensor_parallel_size": 2}, range(8), "per-rank core lists"),
        ({"cpu_threads_bind": "0-1"}, [0, 1], "leave none of cores [0, 1] to the API server"),
        ({"env": {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}}, range(8), "not a plain list"),
    ],
)
def test_where_no_core_is_left_for_the_api_server_the_layout_says_why(
    kwargs: dict[str, object], cores: object, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from turnrl.rollout_router.engine import cpu_layout

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    made, reason = cpu_layout(EngineSpec(model="m", **kwargs), cores=cores)  # type: ignore[arg-type]
    assert made.api_server_cores == "off" and why in reason


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and 2 cores",
)
def test_pin_api_server_moves_the_server_and_everything_below_it() -> None:
    """A real process tree (a parent, its child and grandchild) stands in for vLLM's API
    server, engine core and worker."""
    import subprocess
    import time

    from turnrl.npu_runtime.supervise import descendants
    from turnrl.rollout_router.engine import pin_api_server

    grandchild = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)",
        ]
    )
    try:
        deadline = time.monotonic() + 20

        def threads(pid: int) -> list[int]:
            return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]

        while time.monotonic() < deadline and (
            len(descendants(parent.pid)) < 2 or len(threads(descendants(parent.pid)[-1])) < 2
        ):
            time.sleep(0.05)
        first, second = sorted(os.sched_getaffinity(0))[:2]
        assert pin_api_server(parent.pid, {second}, {first}) == 2
        assert os.sched_getaffinity(parent.pid) == {second}
        below = [tid for pid in descendants(parent.pid) for tid in threads(pid)]
        assert (
            len(below) == 3
        )  # the child, and the grandchild's two threads (affinity is per thread)
        assert all(os.sched_getaffinity(tid) == {first} for tid in below)
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


LINUX_2_CORES = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and 2 cores",
)


@LINUX_2_CORES
def test_an_engine_server_starts_with_its_api_server_on_a_core_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No layout given (what ``turnrl-router serve`` users, apps and fixtures start): the
    server (a stand-in for vLLM's API server) ends up on the first core this process may
    use, and the engine's worker cores go to it as ``VLLM_CPU_OMP_THREADS_BIND``."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    pool = sorted(os.sched_getaffinity(0))
    server = _stand_in_server(tmp_path, "processed_logprobs")
    server.start()
    try:
        assert server.process is not None
        rest = ",".join(map(str, pool[1:]))
        assert (server.spec.api_server_cores, server.spec.cpu_threads_bind) == (str(pool[0]), rest)
        assert os.sched_getaffinity(server.process.pid) == {pool[0]}
        environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
        assert f"VLLM_CPU_OMP_THREADS_BIND={rest}".encode() in environ
    finally:
        server.stop()


@LINUX_2_CORES
def test_an_engine_server_on_one_core_warns_at_start_and_off_silences_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """This process is really put on one core (and back) while the server starts."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    before = os.sched_getaffinity(0)
    server = _stand_in_server(tmp_path, "processed_logprobs")
    quiet = EngineServer(replace(server.spec, port=free_port(), api_server_cores="off"), tmp_path)
    os.sched_setaffinity(0, {min(before)})
    try:
        with caplog.at_level(logging.WARNING, logger="turnrl.rollout_router.engine"):
            server.start()
            warned = caplog.text
            caplog.clear()
            quiet.start()
    finally:
        os.sched_setaffinity(0, before)
        server.stop()
        quiet.stop()
    assert server.spec.api_server_cores == "off"
    assert "no core of its own for its API server" in warned
    assert "1 core(s) only" in warned and "at least 2 cores" in warned
    assert caplog.text == ""
