"""Test support: run one process per rank of a ``torch.distributed`` group to its end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence


def run_rank_processes(
    commands: Sequence[Sequence[str]],
    timeout: float,
    envs: Sequence[Mapping[str, str]] | None = None,
) -> None:
    """Start ``commands[r]`` for every rank at once (with this interpreter's import path and
    ``envs[r]`` over the environment), wait for all, and require every exit code to be 0.
    A rank still running at the end (timeout, failure elsewhere) is killed."""
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    extra = envs or [{}] * len(commands)
    procs = [
        subprocess.Popen(list(cmd), env={**base, **env})
        for cmd, env in zip(commands, extra, strict=True)
    ]
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes == [0] * len(commands), codes
