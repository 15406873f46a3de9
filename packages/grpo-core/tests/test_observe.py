"""The per-step console line, StepLogger (metrics.jsonl + real TensorBoard events) and progress."""

from __future__ import annotations

import io
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from turnrl.grpo_core.observe import logger as observe
from turnrl.grpo_core.observe.logger import (
    StepLogger,
    format_step_line,
    progress,
    samples_markdown,
)

FULL = {
    "rollout/reward_mean": 0.51234,
    "train/loss": -0.012345,
    "train/kl_loss": 0.00123,
    "train/entropy": 1.23456,
    "train/clip_frac": 0.0456,
    "rollout/response_len_mean": 311.6,
    "rollout/num_turns_mean": 4.25,
    "rollout/tokens_per_s": 9512.4,
    "perf/rollout_s": 12.34,
    "perf/train_s": 4.56,
    "perf/sync_s": 0.213,
}


def _events(run_dir: Path) -> object:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_step_line_shows_each_metric_formatted_in_order() -> None:
    line = format_step_line(7, FULL, total=200)
    assert line == (
        "step 7/200 | reward 0.512 | loss -0.0123 | kl 0.0012 | entropy 1.235 | clip 0.046"
        " | resp_len 312 | turns 4.2 | tok/s 9512 | time rollout 12.3s train 4.6s sync 0.21s"
    )


def test_step_line_skips_absent_metrics_and_adds_validation() -> None:
    line = format_step_line(3, {"rollout/reward_mean": 0.5, "val-core/aime_2025/acc/mean@30": 0.29})
    assert line == "step 3 | reward 0.500 | aime_2025/acc/mean@30 0.290"
    assert format_step_line(0, {}) == "step 0"
    assert format_step_line(1, {"perf/sync_s": 150.0}) == "step 1 | time sync 150s"
    busy = {"perf/rollout_s": 2.0, "rollout/engine_busy_frac": 0.456, "rollout/episode_retries": 3}
    assert format_step_line(2, busy) == (
        "step 2 | time rollout 2.0s (engines busy 46%) | 3 episode(s) re-run (engine failures)"
    )
    assert "re-run" not in format_step_line(2, {**busy, "rollout/episode_retries": 0.0})
    line = format_step_line(2, {"train/mismatch_abs_diff": 0.00123})
    assert line == "step 2 | engine/trainer |dlogp| 0.0012"


def test_step_line_says_what_the_rollout_did_with_the_groups() -> None:
    plain = {"rollout/groups_uniform": 3, "rollout/groups_generated": 8, "rollout/groups_kept": 8}
    assert format_step_line(2, plain) == "step 2 | groups 3/8 equal-reward"
    exhausted = {
        **{"rollout/acc_mean_all": 0.25, "rollout/groups_generated": 21.0},
        **{"rollout/groups_uniform": 20.0, "rollout/groups_kept": 1.0},
        **{"rollout/groups_filtered": 6.0, "rollout/sampling_rounds": 3.0},
        "rollout/filter_exhausted": 1.0,
    }
    assert format_step_line(1, exhausted) == (
        "step 1 | acc 0.250 | groups 20/21 equal-reward, kept 1 / filtered 6 in 3 round(s), "
        "max rounds reached: short of informative groups"
    )


def test_step_line_accepts_numpy_and_torch_scalars() -> None:
    metrics = {"train/loss": np.float32(0.25), "train/entropy": torch.tensor(2.0)}
    assert format_step_line(1, metrics) == "step 1 | loss +0.2500 | entropy 2.000"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step", "total", "metrics", "match"),
    [
        (-1, None, {}, "step must be an int >= 0"),
        (True, None, {}, "step must be an int >= 0"),
        (1.5, None, {}, "step must be an int >= 0"),
        (1, 0, {}, "total must be a positive int"),
        (1, None, {"train/loss": "low"}, "metric 'train/loss' must be a number"),
        (1, None, {"val-core/x": None}, "metric 'val-core/x' must be a number"),
        (1, None, {"train/entropy": True}, "metric 'train/entropy' must be a number"),
        (1, None, {"train/loss": torch.ones(2)}, "metric 'train/loss' must be a number"),
    ],
)
def test_step_line_rejects_bad_input(
    step: object, total: object, metrics: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        format_step_line(step, metrics, total)  # type: ignore[arg-type]


def test_step_logger_writes_console_jsonl_and_tensorboard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    steps = {1: dict(FULL), 2: {**FULL, "rollout/reward_mean": 0.75, "train/loss": 0.5}}
    with StepLogger(run, total=2) as log:
        for step, metrics in steps.items():
            log(step, metrics)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [format_step_line(s, m, 2) for s, m in steps.items()]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record, metrics in zip(records, steps.values(), strict=True):
        assert {k: v for k, v in record.items() if k not in ("step", "time")} == metrics
    events = _events(run)
    assert sorted(events.Tags()["scalars"]) == sorted(FULL)
    rewards = [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")]
    assert rewards == [(1, pytest.approx(0.51234, rel=1e-6)), (2, 0.75)]


def test_step_logger_appends_on_resume_and_can_be_quiet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with StepLogger(tmp_path, console=False, tensorboard=False) as log:
        log(1, {"train/loss": 1.0})
    with StepLogger(tmp_path, console=False, tensorboard=False) as log:
        log(2, {"train/loss": 0.5})
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "tensorboard").exists()


def test_log_samples_writes_code_blocks_to_tensorboard_and_jsonl(tmp_path: Path) -> None:
    samples = ["<|im_start|>user\nhi<|im_end|>", "print(```)\n# **not bold**"]
    with StepLogger(tmp_path, console=False) as log:
        log.log_samples(4, samples)
    text = _events(tmp_path).Tensors("rollout/samples/text_summary")[0]
    body = text.tensor_proto.string_val[0].decode()
    assert text.step == 4 and body == samples_markdown(samples)
    assert "```\n<|im_start|>user\nhi<|im_end|>\n```" in body
    # A sample with ``` inside gets a longer fence so it cannot close the block early.
    assert "````\nprint(```)\n# **not bold**\n````" in body
    (record,) = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert record == {"step": 4, "tag": "rollout/samples", "samples": samples}


@pytest.mark.parametrize(
    ("step", "samples", "tag", "match"),
    [
        (1, "one string", "rollout/samples", "list of strings"),
        (1, ["ok", 3], "rollout/samples", "list of strings"),
        (1, ["ok"], "", "tag must be a non-empty string"),
        (-2, ["ok"], "rollout/samples", "step must be an int >= 0"),
    ],
)
def test_log_samples_rejects_bad_input(
    tmp_path: Path, step: int, samples: object, tag: str, match: str
) -> None:
    log = StepLogger(tmp_path, console=False, tensorboard=False)
    with log, pytest.raises(ValueError, match=match):
        log.log_samples(step, samples, tag=tag)  # type: ignore[arg-type]


def test_step_logger_rejects_bad_metrics_without_writing(tmp_path: Path) -> None:
    with StepLogger(tmp_path, console=False, tensorboard=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log(1, {"step": 3.0})
        with pytest.raises(ValueError, match="'perf/x' must be a number"):
            log(1, {"train/loss": 1.0, "perf/x": "fast"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="step must be an int"):
            log(-1, {"train/loss": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_step_logger_records_the_phase_and_the_report_skips_it(tmp_path: Path) -> None:
    from turnrl.grpo_core.observe.report import load_scalars

    with StepLogger(tmp_path, console=False, tensorboard=False) as log:
        log(1, {"sft/loss": 2.0}, phase="sft")
        log(1, {"rollout/reward_mean": 0.5}, phase="rl")
        log(2, {"rollout/reward_mean": 0.75})
        with pytest.raises(ValueError, match="reserved"):
            log(3, {"phase": 1.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("phase") for r in rows] == ["sft", "rl", None]
    scalars = load_scalars(tmp_path)
    assert "phase" not in scalars and scalars["rollout/reward_mean"] == [(1, 0.5), (2, 0.75)]


def test_step_logger_closed_and_bad_folder(tmp_path: Path) -> None:
    log = StepLogger(tmp_path / "run", console=False)
    log.close()
    log.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        log(1, {"train/loss": 1.0})
    with pytest.raises(ValueError, match="closed"):
        log.log_samples(1, ["x"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        StepLogger(tmp_path / "file")
    with pytest.raises(ValueError, match="total must be a positive int"):
        StepLogger(tmp_path / "run2", total=-5)
    assert not (tmp_path / "run2").exists()  # nothing created for a rejected config


def test_without_tensorboard_warns_once_and_keeps_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensorboard made unimportable (sys.modules entry None), as when it is not installed."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(observe, "_tensorboard_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("a", "b"):
            with StepLogger(tmp_path / name, console=False) as log:
                log(1, {"train/loss": 1.0})
                log.log_samples(1, ["x"])
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 1 and "turnrl-grpo-core[report]" in messages[0]
    assert not (tmp_path / "a" / "tensorboard").exists()
    assert json.loads((tmp_path / "b" / "metrics.jsonl").read_text())["train/loss"] == 1.0


def test_progress_draws_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with progress("rollout", total=5, console=console) as bar:
        bar.advance()
        bar.advance(2)
    assert bar.shown and bar.completed == 3
    assert "rollout" in out.getvalue() and "3/5" in out.getvalue()


def test_progress_is_silent_off_terminal_and_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    with progress("train", total=4, console=Console(file=out)) as bar:  # not a terminal
        bar.advance(4)
    assert not bar.shown and bar.completed == 4 and out.getvalue() == ""
    monkeypatch.setenv("TURNRL_NO_PROGRESS", "1")
    with progress("train", total=None, console=Console(file=out, force_terminal=True)) as bar:
        bar.advance()
    assert not bar.shown and bar.completed == 1 and out.getvalue() == ""


def test_progress_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="total must be >= 0"), progress("x", total=-1):
        pass
    quiet = Console(file=io.StringIO())
    with progress("x", total=2, console=quiet) as bar, pytest.raises(ValueError, match="n >= 0"):
        bar.advance(-1)
