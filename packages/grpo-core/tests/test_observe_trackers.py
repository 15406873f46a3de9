"""Experiment trackers (observe/trackers.py): W&B, MLflow and SwanLab runs written offline
into the test's folder and read back, name checks, missing libraries, StepLogger wiring.

No test reaches the network: the backends run offline / on a local file store, every
tracker environment variable points into ``tmp_path``, and ``no_network`` fails a test whose
process opens a socket to anything but this machine.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from turnrl.grpo_core.observe import trackers as trackers_mod
from turnrl.grpo_core.observe.logger import StepLogger
from turnrl.grpo_core.observe.trackers import (
    KNOWN_TRACKERS,
    RUN_DIR_TAG,
    MlflowTracker,
    SwanLabTracker,
    Tracker,
    WandbTracker,
    make_trackers,
    mlflow_metric_name,
)

CONFIG = {"algo": {"adv_estimator": "grpo", "kl": {"coef": 0.001}}, "lr": 1e-6, "n": 8}
STEPS = {
    1: {"train/loss": 0.5, "rollout/reward_mean": 0.1, "val-core/aime/acc/mean@30": 0.25},
    2: {"train/loss": 0.25, "rollout/reward_mean": 0.2, "val-core/aime/acc/mean@30": 0.5},
    3: {"train/loss": 0.125, "rollout/reward_mean": 0.4, "val-core/aime/acc/mean@30": 0.75},
}


@pytest.fixture(autouse=True)
def offline_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every tracker offline, quiet, and keeping its caches and settings in ``tmp_path``."""
    home = tmp_path / "home"
    home.mkdir()
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_CACHE_DIR": str(home / "wandb-cache"),
        "WANDB_DATA_DIR": str(home / "wandb-data"),
        "SWANLAB_MODE": "offline",
        "SWANLAB_ROOT": str(home / "swanlab"),
        "SWANLAB_TERMINAL_PROXY_TYPE": "none",
        "SWANLAB_PROBE_MONITOR": "false",
        "SWANLAB_PROBE_REQUIREMENTS": "false",
        "SWANLAB_PROBE_GIT": "false",
    }.items():
        monkeypatch.setenv(key, value)
    for key in (
        "WANDB_API_KEY",
        "WANDB_DIR",
        "SWANLAB_API_KEY",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_ALLOW_FILE_STORE",
        "MLFLOW_DISABLE_TELEMETRY",
    ):
        monkeypatch.setenv(key, "")  # so that the test's end removes what a tracker set
        monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Refuse (and record) any connection from this process to a non-loopback address."""
    attempts: list[Any] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def local(address: Any) -> bool:
        if not isinstance(address, tuple):  # a unix socket path
            return True
        return address[0] in ("127.0.0.1", "::1", "localhost")

    def connect(self: socket.socket, address: Any) -> Any:
        if not local(address):
            attempts.append(address)
            raise OSError(f"test tried to reach the network: {address!r}")
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> Any:
        if not local(address):
            attempts.append(address)
            raise OSError(f"test tried to reach the network: {address!r}")
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield attempts
    assert attempts == [], f"network connections attempted: {attempts}"


def _log_three_steps(run_dir: Path, names: list[str]) -> list[Tracker]:
    started = make_trackers(names, run_dir, project="turnrl-test", run_name="t1", config=CONFIG)
    with StepLogger(run_dir, console=False, tensorboard=False, trackers=started) as logger:
        for step, metrics in STEPS.items():
            logger(step, metrics)
    return started


def _leveldb_log(path: Path, ident: bytes) -> list[bytes]:
    """The records of a LevelDB-style log file as W&B (``.wandb``) and SwanLab
    (``.swanlab``) write them: a 7-byte file header (ident, magic, version), then 32 KiB
    blocks of chunks with a 7-byte header (crc32, length, type: full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == ident, f"{path.name} starts with {data[:4]!r}, not {ident!r}"
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero fill at the end of a block or of the file
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            records.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            records.append(pending + chunk)
            pending = b""
        else:
            raise AssertionError(f"unknown chunk type {kind} at byte {pos} of {path}")
    return records


# ----------------------------------------------------------------------------- names


def test_unknown_name_is_refused_listing_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        make_trackers(["console", "neptune"], tmp_path / "run", "p", "r")
    message = str(info.value)
    assert "'neptune'" in message
    for name in KNOWN_TRACKERS:
        assert name in message
    assert not (tmp_path / "run").exists()  # nothing was started


def test_console_and_tensorboard_start_nothing_and_repeats_count_once(tmp_path: Path) -> None:
    assert make_trackers(["console", "tensorboard", "console"], tmp_path, "p", "r") == []
    assert make_trackers("tensorboard", tmp_path, "p", "r") == []  # one name as a string
    assert make_trackers([], tmp_path, "p", "r") == []


@pytest.mark.parametrize("name", ["wandb", "mlflow", "swanlab"])
def test_missing_library_names_the_extra_before_any_run_starts(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    others = [other for other in ("wandb", "mlflow", "swanlab") if other != name]
    opened: list[str] = []
    for other in others:
        monkeypatch.setitem(
            trackers_mod.TRACKER_TYPES, other, lambda *a, _o=other: opened.append(_o)
        )
    with pytest.raises(ImportError) as info:
        make_trackers([*others, name], tmp_path, "p", "r")
    assert f"turnrl-grpo-core[{name}]" in str(info.value)
    assert repr(name) in str(info.value)
    assert opened == []  # the trackers named before it were not started either


def test_mlflow_metric_name_changes_only_what_mlflow_refuses() -> None:
    assert mlflow_metric_name("rollout/reward_mean") == "rollout/reward_mean"
    assert mlflow_metric_name("perf/engine_busy_frac") == "perf/engine_busy_frac"
    assert mlflow_metric_name("val-core/aime_2025/acc/mean@30") == "val-core/aime_2025/acc/mean_30"
    assert mlflow_metric_name("rollout/failed/TimeoutError") == "rollout/failed/TimeoutError"
    assert mlflow_metric_name("a b.c-d") == "a b.c-d"
    assert mlflow_metric_name("x:y(z)") == "x_y_z_"
    assert mlflow_metric_name("/lead//x/./y/../z/") == "lead/x/y/__/z"
    assert mlflow_metric_name("") == "_"


# ----------------------------------------------------------------------------- StepLogger


class RecordingTracker:
    def __init__(self, fail_close: bool = False) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = 0
        self.fail_close = fail_close

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.logged.append((step, scalars))

    def close(self) -> None:
        self.closed += 1
        if self.fail_close:
            raise RuntimeError("close failed")


def test_step_logger_sends_every_scalar_to_each_tracker_and_closes_them(tmp_path: Path) -> None:
    first, second = RecordingTracker(), RecordingTracker()
    assert isinstance(first, Tracker)
    with StepLogger(tmp_path, console=False, tensorboard=False, trackers=[first, second]) as log:
        log(1, {"train/loss": 0.5, "rollout/n": 3})  # an int arrives as a float
        log(2, {"train/loss": 0.25}, phase="rl")
        log.log_samples(2, ["text"])  # samples stay in samples.jsonl / TensorBoard
        assert first.closed == 0
    expected = [(1, {"train/loss": 0.5, "rollout/n": 3.0}), (2, {"train/loss": 0.25})]
    assert first.logged == expected and second.logged == expected
    assert all(isinstance(v, float) for _, scalars in first.logged for v in scalars.values())
    assert first.logged[0][1] is not second.logged[0][1]  # each gets its own dict
    assert (first.closed, second.closed) == (1, 1)
    log.close()  # twice is fine: the trackers are not closed again
    assert (first.closed, second.closed) == (1, 1)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["train/loss"] for line in lines] == [0.5, 0.25]


def test_step_logger_refused_step_reaches_no_tracker(tmp_path: Path) -> None:
    tracker = RecordingTracker()
    with StepLogger(tmp_path, console=False, tensorboard=False, trackers=[tracker]) as log:
        with pytest.raises(ValueError):
            log(1, {"step": 1.0})  # reserved name
        with pytest.raises(ValueError):
            log(1, {"train/loss": "high"})  # type: ignore[dict-item]
    assert tracker.logged == []


def test_step_logger_closes_every_tracker_when_one_fails(tmp_path: Path) -> None:
    bad, good = RecordingTracker(fail_close=True), RecordingTracker()
    log = StepLogger(tmp_path, console=False, tensorboard=False, trackers=[bad, good])
    with pytest.raises(RuntimeError, match="close failed"):
        log.close()
    assert (bad.closed, good.closed) == (1, 1)
    with pytest.raises(ValueError, match="closed"):
        log(1, {"train/loss": 1.0})


def test_step_logger_refuses_an_object_that_is_not_a_tracker(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="log"):
        StepLogger(tmp_path, console=False, tensorboard=False, trackers=[object()])  # type: ignore[list-item]


def test_make_trackers_closes_the_started_ones_when_a_later_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = RecordingTracker()

    def broken(*args: Any) -> Tracker:
        raise RuntimeError("cannot start")

    monkeypatch.setattr(trackers_mod, "_import", lambda module, tracker: None)
    monkeypatch.setitem(trackers_mod.TRACKER_TYPES, "wandb", lambda *a: started)
    monkeypatch.setitem(trackers_mod.TRACKER_TYPES, "mlflow", broken)
    with pytest.raises(RuntimeError, match="cannot start"):
        make_trackers(["wandb", "mlflow"], tmp_path, "p", "r")
    assert started.closed == 1


# ----------------------------------------------------------------------------- modes


class FakeRun:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.logged, self.finished = kwargs, [], 0
        self.dir = str(Path(kwargs.get("dir", ".")) / "fake-run" / "files")

    def log(self, data: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, data))

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.kwargs.setdefault("axes", []).append((name, step_metric))

    def finish(self) -> None:
        self.finished += 1


@pytest.mark.parametrize(
    ("module", "cls", "env"),
    [("wandb", WandbTracker, "WANDB_MODE"), ("swanlab", SwanLabTracker, "SWANLAB_MODE")],
)
def test_offline_unless_the_mode_variable_says_otherwise(
    module: str, cls: Any, env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = types.ModuleType(module)
    fake.init = lambda **kwargs: FakeRun(**kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.delenv(env)
    tracker = cls(tmp_path / "run", "proj", "name", {"lr": 0.1})
    run = tracker._run
    assert run.kwargs["mode"] == "offline"
    assert run.kwargs["project"] == "proj" and run.kwargs["name"] == "name"
    assert run.kwargs["config"] == {"lr": 0.1}
    folder = Path(run.kwargs.get("dir") or run.kwargs["log_dir"])
    assert folder.is_relative_to(tmp_path / "run")
    tracker.log(4, {"a/b": 1.0})
    if module == "wandb":  # the step is a metric, every chart's x axis
        assert run.logged == [(None, {"a/b": 1.0, "step": 4})]
        assert ("*", "step") in run.kwargs["axes"]
    else:
        assert run.logged == [(4, {"a/b": 1.0})]
    tracker.close()
    tracker.close()
    assert run.finished == 1
    with pytest.raises(ValueError, match="closed"):
        tracker.log(5, {"a/b": 1.0})
    monkeypatch.setenv(env, "disabled")
    assert cls(tmp_path / "run", "proj", "name", {})._run.kwargs["mode"] == "disabled"


# ----------------------------------------------------------------------------- real backends


def _wandb_records(folder: Path, run_name: str) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """History (keyed by the logged ``step``) and config of an offline W&B run folder.

    ``run.finish()`` can return before W&B's writer process has written the last records
    (seen in CI: the file held no history yet, and all three steps plus the closing
    ``exit`` record a few milliseconds later), so this waits for the ``exit`` record.
    """
    from wandb.proto import wandb_internal_pb2

    (log_file,) = folder.glob("run-*.wandb")
    deadline = time.monotonic() + 60
    while True:
        records = []
        for raw in _leveldb_log(log_file, b":W&B"):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{log_file} got no exit record in 60 s"
        time.sleep(0.2)
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.setdefault(items["step"], {}).update(items)  # the x axis
        elif kind == "run":
            assert record.run.display_name == run_name
            assert record.run.project == "turnrl-test"
            config.update(
                {item.key: json.loads(item.value_json) for item in record.run.config.update}
            )
    return history, config


def test_wandb_offline_run_holds_the_three_steps(tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="needs turnrl-grpo-core[wandb]")
    run_dir = tmp_path / "run"
    (tracker,) = _log_three_steps(run_dir, ["console", "wandb"])
    assert isinstance(tracker, WandbTracker) and tracker.mode == "offline"
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    assert tracker.dir == folder
    history, config = _wandb_records(folder, "t1")
    assert sorted(history) == [1, 2, 3]
    for step, metrics in STEPS.items():
        for name, value in metrics.items():  # names kept as they are, '@' included
            assert history[step][name] == pytest.approx(value)
    assert config["lr"] == pytest.approx(1e-6)
    assert config["algo"] == {"adv_estimator": "grpo", "kl": {"coef": 0.001}}


def test_wandb_keeps_a_stage_whose_steps_start_again(tmp_path: Path) -> None:
    """SFT steps 1-5, then evaluation at step 0 and RL from step 1: nothing dropped."""
    pytest.importorskip("wandb", reason="needs turnrl-grpo-core[wandb]")
    run_dir = tmp_path / "run"
    (tracker,) = make_trackers(["wandb"], run_dir, project="turnrl-test", run_name="t2")
    with StepLogger(run_dir, console=False, tensorboard=False, trackers=[tracker]) as logger:
        for step in range(1, 6):
            logger(step, {"sft/loss": 1.0 / step}, phase="sft")
        logger(0, {"val-core/acc": 0.25}, phase="val")
        logger(1, {"rollout/reward_mean": 0.5}, phase="rl")
    assert tracker.dir is not None
    history, _ = _wandb_records(tracker.dir, "t2")
    assert history[5]["sft/loss"] == pytest.approx(0.2)
    assert history[0]["val-core/acc"] == pytest.approx(0.25)
    assert history[1]["rollout/reward_mean"] == pytest.approx(0.5)
    assert history[1]["sft/loss"] == pytest.approx(1.0)


def test_mlflow_file_store_holds_the_three_steps(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="needs turnrl-grpo-core[mlflow]")
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    (tracker,) = _log_three_steps(run_dir, ["mlflow"])
    assert isinstance(tracker, MlflowTracker)
    # the default local store opts in to MLflow 3's file store and out of its telemetry
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    store = run_dir / "mlruns"
    assert tracker.tracking_uri == store.resolve().as_uri()
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("turnrl-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "t1" and run.info.status == "FINISHED"
    for name in ("train/loss", "rollout/reward_mean", "val-core/aime/acc/mean@30"):
        history = client.get_metric_history(run.info.run_id, mlflow_metric_name(name))
        got = sorted((m.step, m.value) for m in history)
        assert got == [(step, pytest.approx(STEPS[step][name])) for step in (1, 2, 3)]
    assert run.data.params == {
        "algo.adv_estimator": "grpo",
        "algo.kl.coef": "0.001",
        "lr": "1e-06",
        "n": "8",
    }


def test_mlflow_run_of_a_resumed_folder_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An app resumed in its run folder logs into the MLflow run the folder started; another
    folder logging to the same store, under the same run name, gets its own run."""
    pytest.importorskip("mlflow", reason="needs turnrl-grpo-core[mlflow]")
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "store").resolve()
    store.mkdir()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    run_dir, other_dir = tmp_path / "it's run", tmp_path / "other"  # a quote, as filters quote
    (first,) = make_trackers(["mlflow"], run_dir, "p", "r", {"lr": 1})
    assert isinstance(first, MlflowTracker) and not first.resumed
    run_id = first.run_id
    first.log(1, {"x": 1.0})
    first.close()
    (other,) = make_trackers(["mlflow"], other_dir, "p", "r", {"lr": 3})
    other.log(1, {"x": 5.0})
    other.close()
    (again,) = make_trackers(["mlflow"], run_dir, "p", "r", {"lr": 2})
    assert isinstance(again, MlflowTracker) and again.resumed and again.run_id == run_id
    again.log(2, {"x": 2.0})
    again.close()
    client = MlflowClient(tracking_uri=store.as_uri())
    runs = {r.data.tags[RUN_DIR_TAG]: r for r in client.search_runs([again.experiment_id])}
    assert sorted(runs) == sorted([str(run_dir.resolve()), str(other_dir.resolve())])
    run = runs[str(run_dir.resolve())]
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "x")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0)]
    assert run.data.params == {"lr": "1"}  # the first start's


def test_mlflow_uses_the_tracking_uri_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="needs turnrl-grpo-core[mlflow]")
    from mlflow.tracking import MlflowClient

    elsewhere = (tmp_path / "elsewhere").resolve()
    elsewhere.mkdir()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere.as_uri())
    run_dir = tmp_path / "run"
    (tracker,) = make_trackers(["mlflow"], run_dir, "p", "r", {})
    tracker.log(7, {"x": math.pi})
    tracker.close()
    assert not (run_dir / "mlruns").exists()
    assert "MLFLOW_DISABLE_TELEMETRY" not in os.environ  # a user's server: their settings
    client = MlflowClient(tracking_uri=elsewhere.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "x")] == [
        (7, pytest.approx(math.pi))
    ]


def test_swanlab_offline_run_holds_the_three_steps(tmp_path: Path) -> None:
    pytest.importorskip("swanlab", reason="needs turnrl-grpo-core[swanlab]")
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    run_dir = tmp_path / "run"
    (tracker,) = _log_three_steps(run_dir, ["swanlab", "tensorboard"])
    assert isinstance(tracker, SwanLabTracker) and tracker.mode == "offline"
    (folder,) = (run_dir / "swanlog").glob("run-*")
    (log_file,) = folder.glob("*.swanlab")
    scalars: dict[int, dict[str, float]] = {}
    project = finished = None
    for raw in _leveldb_log(log_file, b":SWL"):
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("start"):
            project = (record.start.project, record.start.name)
        elif record.HasField("scalar"):
            scalar = record.scalar
            scalars.setdefault(scalar.step, {})[scalar.key] = scalar.value.number
        elif record.HasField("finish"):
            finished = record.finish.state
    assert project == ("turnrl-test", "t1")
    assert finished is not None
    assert sorted(scalars) == [1, 2, 3]
    for step, metrics in STEPS.items():
        assert scalars[step] == pytest.approx(metrics)  # names as they are, '@' included
