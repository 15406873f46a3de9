"""Experiment-tracker backends for :class:`~turnrl.grpo_core.observe.logger.StepLogger`.

A run names its trackers as verl's ``trainer.logger`` does (``["console", "tensorboard",
"wandb"]``); :func:`make_trackers` starts the external ones and ``StepLogger(trackers=...)``
sends every step's scalars to each of them and closes them with itself::

    names = ["console", "tensorboard", "wandb", "mlflow"]
    trackers = make_trackers(names, run_dir, project="tau", run_name="qwen3-8b-grpo", config=cfg)
    logger = StepLogger(
        run_dir,
        console="console" in names,
        tensorboard="tensorboard" in names,
        trackers=trackers,
    )

``console`` and ``tensorboard`` are written by :class:`StepLogger` itself (its ``console`` and
``tensorboard`` flags), so :func:`make_trackers` accepts those names and starts nothing for
them. The external ones run without a network by default and write under the run folder:

* ``wandb`` (:class:`WandbTracker`, extra ``wandb``): ``mode="offline"`` unless ``WANDB_MODE``
  says otherwise; files in ``run_dir/wandb/offline-run-*`` (upload later: ``wandb sync``).
* ``mlflow`` (:class:`MlflowTracker`, extra ``mlflow``: ``mlflow-skinny``): the tracking URI
  ``MLFLOW_TRACKING_URI`` when set, else a file store in ``run_dir/mlruns`` (``mlflow ui
  --backend-store-uri run_dir/mlruns``). For this default only, the tracker sets (when
  unset) ``MLFLOW_ALLOW_FILE_STORE=true`` (MLflow 3 refuses file stores otherwise) and
  ``MLFLOW_DISABLE_TELEMETRY=true`` (MLflow 3 sends usage telemetry otherwise).
* ``swanlab`` (:class:`SwanLabTracker`, extra ``swanlab``): ``mode="offline"`` unless
  ``SWANLAB_MODE`` says otherwise; files in ``run_dir/swanlog/run-*`` (upload later:
  ``swanlab sync``).

Metric names are passed on as they are (``rollout/reward_mean``, ``val-core/aime/acc/mean@30``):
W&B and SwanLab take them so, and group charts by the part before the first ``/``. Only
MLflow restricts names (alphanumerics, ``_ - . / space``, ``:`` except on Windows; no ``..``
or empty path parts): :func:`mlflow_metric_name` maps every other character, and ``:``, to
``_`` for MLflow alone (``mean@30`` -> ``mean_30``).

An app resumed in its run folder (``--resume``) continues that folder's MLflow run; W&B and
SwanLab start a new run each time (offline resume of a run id is not relied on).

Each library is imported when its tracker starts; a missing one is an :class:`ImportError`
naming the extra to install (``pip install "turnrl-grpo-core[wandb]"``).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

BUILTIN_LOGGERS = ("console", "tensorboard")
"""Names that :class:`~turnrl.grpo_core.observe.logger.StepLogger` handles itself."""

KNOWN_TRACKERS = ("console", "tensorboard", "wandb", "mlflow", "swanlab")
"""Every name :func:`make_trackers` accepts."""

_EXTRA = {"wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}
"""Tracker name -> the ``turnrl-grpo-core`` extra that installs its library."""


@runtime_checkable
class Tracker(Protocol):
    """What ``StepLogger`` needs of a tracker backend."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record one step's scalars (metric name -> float)."""
        ...

    def close(self) -> None:
        """Finish the run and flush everything (safe to call twice)."""
        ...


def _import(module: str, tracker: str) -> Any:
    """``import module``, or an ImportError naming the extra that installs it."""
    if tracker == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
        _mlflow_local_defaults()
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = _EXTRA[tracker]
        raise ImportError(
            f"tracker {tracker!r} needs the {module!r} package ({exc}); install it with "
            f"pip install 'turnrl-grpo-core[{extra}]'"
        ) from exc


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")


class WandbTracker:
    """Weights & Biases run; offline (``run_dir/wandb/offline-run-*``) unless ``WANDB_MODE``.

    The run's step is logged as the metric ``step``, every chart's x axis
    (``define_metric("*", step_metric="step")``), not as W&B's own ``_step``: W&B drops a
    ``_step`` lower than one already logged, and an app's stages each count from 1 (SFT
    steps, then evaluation at step 0, then RL steps).
    """

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_name: str, config: Mapping[str, Any]):
        wandb = _import("wandb", self.name)
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.mode = os.environ.get("WANDB_MODE") or "offline"
        self._run: Any = wandb.init(
            project=project,
            name=run_name,
            dir=str(run_dir),
            mode=self.mode,
            config=dict(config),
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self.dir = Path(self._run.dir).parent if self._run.dir else None
        """The run's own folder (``run_dir/wandb/offline-run-<time>-<id>`` when offline)."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        _check_step(step)
        if self._run is None:
            raise ValueError("wandb tracker is closed")
        self._run.log({**scalars, "step": step})

    def close(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()


_MLFLOW_BAD_CHARS = re.compile(r"[^\w.\- /]")


def _mlflow_local_defaults() -> None:
    """Environment for the default local store, where not set already: MLflow 3 keeps the
    file store in maintenance mode and raises unless ``MLFLOW_ALLOW_FILE_STORE=true``, and
    sends usage telemetry unless ``MLFLOW_DISABLE_TELEMETRY=true`` (read when mlflow is
    first imported, so set before the import)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


RUN_DIR_TAG = "turnrl.run_dir"
"""MLflow run tag holding the run folder's absolute path (and ``.sha256``, the first 32
hex digits of its hash, by which a resumed run finds its run)."""


def mlflow_metric_name(name: str) -> str:
    """``name`` as MLflow accepts it: characters other than alphanumerics, ``_ - . / space``
    become ``_`` (``:`` too, which MLflow refuses on Windows), empty and ``.`` path parts are
    dropped and ``..`` becomes ``__`` (MLflow stores a metric as a file under its name)."""
    parts = _MLFLOW_BAD_CHARS.sub("_", name).split("/")
    parts = ["__" if part == ".." else part for part in parts if part not in ("", ".")]
    return "/".join(parts) or "_"


class MlflowTracker:
    """MLflow run, logged through ``MlflowClient`` (no global active run).

    Tracking URI: ``MLFLOW_TRACKING_URI`` when set, else a file store in ``run_dir/mlruns``.
    The experiment is ``project`` (created if missing), the run is named ``run_name``, the
    config is flattened into params (``a.b.c``; values cut at MLflow's 6000 characters).
    One run folder is one MLflow run (tag :data:`RUN_DIR_TAG`): an app resumed in the same
    folder continues the run it started (``resumed``), whose params stay the first start's.
    """

    name = "mlflow"
    _MAX_METRICS_PER_BATCH = 1000
    _MAX_PARAMS_PER_BATCH = 100
    _MAX_PARAM_VALUE = 6000
    _MAX_KEY = 250

    def __init__(self, run_dir: Path, project: str, run_name: str, config: Mapping[str, Any]):
        _import("mlflow", self.name)
        from mlflow.entities import Metric, RunStatus
        from mlflow.tracking import MlflowClient

        self._metric_cls, self._finished = Metric, RunStatus.to_string(RunStatus.FINISHED)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            store = Path(run_dir).resolve() / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri = store.as_uri()
        self.tracking_uri = uri
        self.client: Any = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        self.experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(project)
        )
        self._names: dict[str, str] = {}
        self._owner: dict[str, str] = {}
        # One run folder is one MLflow run: a resumed app run (same folder) continues it.
        folder = str(Path(run_dir).resolve())
        digest = hashlib.sha256(folder.encode()).hexdigest()[:32]  # no quoting in the filter
        earlier = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{RUN_DIR_TAG}.sha256` = '{digest}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        self.resumed = bool(earlier)
        if earlier:  # its params stay those of the first start (MLflow's are immutable)
            self.run_id: str | None = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {RUN_DIR_TAG: folder, f"{RUN_DIR_TAG}.sha256": digest}
            self.run_id = self.client.create_run(
                self.experiment_id, run_name=run_name, tags=tags
            ).info.run_id
            self._log_params(config)

    def _log_params(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        assert self.run_id is not None
        flat: dict[str, str] = {}
        for key, value in _flatten(config):  # the first of names that map to one key wins
            flat.setdefault(
                mlflow_metric_name(key)[: self._MAX_KEY], value[: self._MAX_PARAM_VALUE]
            )
        params = [Param(key, value) for key, value in flat.items()]
        for start in range(0, len(params), self._MAX_PARAMS_PER_BATCH):
            chunk = params[start : start + self._MAX_PARAMS_PER_BATCH]
            self.client.log_batch(self.run_id, params=chunk)

    def _key(self, name: str) -> str:
        key = self._names.get(name)
        if key is None:
            key = self._names[name] = mlflow_metric_name(name)
            owner = self._owner.setdefault(key, name)
            if owner != name:
                warnings.warn(
                    f"MLflow metric names {owner!r} and {name!r} both become {key!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return key

    def log(self, step: int, scalars: dict[str, float]) -> None:
        _check_step(step)
        if self.run_id is None:
            raise ValueError("mlflow tracker is closed")
        now = int(time.time() * 1000)
        metrics = [
            self._metric_cls(self._key(name), float(value), now, step)
            for name, value in scalars.items()
        ]
        for start in range(0, len(metrics), self._MAX_METRICS_PER_BATCH):
            chunk = metrics[start : start + self._MAX_METRICS_PER_BATCH]
            self.client.log_batch(self.run_id, metrics=chunk)

    def close(self) -> None:
        if self.run_id is not None:
            run_id, self.run_id = self.run_id, None
            self.client.set_terminated(run_id, status=self._finished)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, str]]:
    """``(a.b.c, str(value))`` for every leaf of a nested mapping."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{name}.")
        else:
            yield name, str(value)


class SwanLabTracker:
    """SwanLab run; offline (``run_dir/swanlog/run-*``) unless ``SWANLAB_MODE`` says otherwise."""

    name = "swanlab"

    def __init__(self, run_dir: Path, project: str, run_name: str, config: Mapping[str, Any]):
        swanlab = _import("swanlab", self.name)
        self.log_dir = Path(run_dir) / "swanlog"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.mode = os.environ.get("SWANLAB_MODE") or "offline"
        self._run: Any = swanlab.init(
            project=project,
            name=run_name,
            config=dict(config),
            mode=self.mode,
            log_dir=str(self.log_dir),
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        _check_step(step)
        if self._run is None:
            raise ValueError("swanlab tracker is closed")
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()


TRACKER_TYPES: dict[str, Callable[..., Tracker]] = {
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "swanlab": SwanLabTracker,
}
"""Tracker name -> the class :func:`make_trackers` starts."""


def make_trackers(
    names: Iterable[str] | str,
    run_dir: Path,
    project: str,
    run_name: str,
    config: Mapping[str, Any] | None = None,
) -> list[Tracker]:
    """Start the trackers named in ``names`` (verl's ``trainer.logger`` list).

    ``console`` and ``tensorboard`` are accepted and start nothing (``StepLogger`` writes
    them itself); a name given twice counts once. Every library is imported before any
    run starts, and a tracker that fails to start closes those already started.

    Args:
        names: Tracker names, from :data:`KNOWN_TRACKERS` (a single string is one name).
        run_dir: The run folder; the offline/local files go under it.
        project: The W&B / SwanLab project, the MLflow experiment.
        run_name: The run's name in the tracker.
        config: The run's configuration (W&B / SwanLab config, MLflow params).

    Returns:
        The started trackers, in the order named.

    Raises:
        ValueError: a name is unknown (the message lists the known ones).
        ImportError: a tracker's library is missing (the message names the extra).
    """
    if isinstance(names, str):
        names = [names]
    wanted: list[str] = []
    for name in names:
        if name not in KNOWN_TRACKERS:
            raise ValueError(
                f"unknown tracker {name!r}; known trackers: {', '.join(KNOWN_TRACKERS)}"
            )
        if name not in wanted:
            wanted.append(name)
    external = [name for name in wanted if name not in BUILTIN_LOGGERS]
    for name in external:  # fail on a missing library before starting any run
        _import(name, name)
    started: list[Tracker] = []
    try:
        for name in external:
            started.append(TRACKER_TYPES[name](Path(run_dir), project, run_name, config or {}))
    except BaseException:
        close_trackers(started)
        raise
    return started


def close_trackers(trackers: Iterable[Tracker]) -> None:
    """Close every tracker, even when one fails; then raise the first failure."""
    first: BaseException | None = None
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as exc:  # close the rest before reporting
            if first is None:
                first = exc
    if first is not None:
        raise first
