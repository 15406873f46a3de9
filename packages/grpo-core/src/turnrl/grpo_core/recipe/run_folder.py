"""A run's folder: created once, never written over by another run, resumable.

An app's run writes its resolved config, ``metrics.jsonl``, TensorBoard events,
checkpoints and ``summary.json`` into one folder. :func:`claim_run_dir` gives a fresh run a
new folder, or refuses one that already holds a run (a second run would mix its metrics
into the first's and overwrite its summary); ``--resume`` continues such a folder, and
:func:`load_progress` / :func:`save_progress` carry the results of finished phases across.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

PROGRESS = "progress.json"
"""Results of finished phases in the run folder (read back on resume)."""
RUN_MARKERS = ("metrics.jsonl", "summary.json", "checkpoints")
"""What only a run writes: a folder holding one of them holds a run."""


def default_run_dir(app: str) -> str:
    """``runs/<app>-<timestamp>``: the folder of a run that names none."""
    return f"runs/{app}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def claim_run_dir(run_dir: str | Path | None, app: str, *, resume: bool = False) -> Path:
    """The run folder, created: ``run_dir``, or :func:`default_run_dir`.

    Raises:
        ValueError: a fresh run (not ``resume``) names a folder that already holds a run;
            the message says how to continue it or where else to go.
    """
    folder = Path(run_dir or default_run_dir(app))
    if not resume and (held := [m for m in RUN_MARKERS if (folder / m).exists()]):
        raise ValueError(
            f"{folder} already holds a run ({', '.join(held)}): continue it with --resume "
            "where the app supports it, or choose another --run-dir (nothing was written)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def read_run_config(run_dir: str | Path | None) -> dict[str, Any]:
    """The resolved config an earlier run wrote to ``run_dir/config.json`` (for ``--resume``).

    Raises:
        ValueError: no ``run_dir``, or its config is not a JSON object.
        FileNotFoundError: ``run_dir`` holds no config.json.
    """
    if not run_dir:
        raise ValueError("--resume needs --run-dir (the folder of the run to continue)")
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--resume: {path} not found (not a run folder of this app?)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--resume: {path} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"--resume: {path} holds no config object")
    return data


def config_from_dict(cls: type[T], data: dict[str, Any], base: T | None = None) -> T:
    """Rebuild the dataclass ``cls`` from its ``dataclasses.asdict`` output, or from part of
    it: a key left out keeps its value in ``base`` (default ``cls()``), and a field whose
    value is a dataclass (a config section) is rebuilt from its dict the same way, over the
    section ``base`` holds (so an app's own section defaults survive a partial preset).

    Raises:
        ValueError: a key ``cls`` or one of its sections does not have, or a section that
            is not an object.
    """
    defaults = copy.deepcopy(base) if base is not None else cls()
    names = {f.name for f in dataclasses.fields(defaults)}  # type: ignore[arg-type]
    if unknown := sorted(set(data) - names):
        raise ValueError(f"unknown config keys in {cls.__name__}: {unknown}")
    kwargs: dict[str, Any] = {name: getattr(defaults, name) for name in names}
    for key, value in data.items():
        section = getattr(defaults, key)
        if dataclasses.is_dataclass(section):
            if not isinstance(value, dict):
                raise ValueError(f"config section {key!r} must be an object, got {value!r}")
            value = config_from_dict(type(section), value, section)
        kwargs[key] = value
    return cls(**kwargs)


def load_progress(run_dir: Path) -> dict[str, Any]:
    """What an earlier (interrupted) run of this folder finished (``{}`` if nothing).

    Raises:
        ValueError: the progress file is not JSON (the message says how to redo it).
    """
    path = Path(run_dir) / PROGRESS
    if not path.is_file():
        return {}
    try:
        progress = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--resume: {path} is corrupt ({exc}); delete it to redo the phases"
        ) from exc
    return progress if isinstance(progress, dict) else {}


def save_progress(run_dir: Path, progress: dict[str, Any]) -> None:
    """Write ``progress`` (JSON) for a later resume; replaced atomically."""
    path = Path(run_dir) / PROGRESS
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(progress, indent=2) + "\n")
    tmp.replace(path)


def interrupted(app: str, run_dir: str | Path | None) -> int:
    """After Ctrl-C (the run's engines, sandbox and Ray already stopped on the way out):
    print how to continue the run and return the shell's exit code for SIGINT, 130."""
    where = f" --run-dir {run_dir}" if run_dir else ""
    print(f"interrupted; continue with: uv run apps/{app} --resume{where}", file=sys.stderr)
    return 130
