"""`report`: scalars back from metrics.jsonl or TensorBoard events, PNG curves, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from turnrl.grpo_core.observe.logger import StepLogger
from turnrl.grpo_core.observe.report import (
    load_scalars,
    main,
    read_metrics,
    render_curves,
    select_tags,
)

STEPS = 6


def _metrics(step: int) -> dict[str, float]:
    return {
        "rollout/reward_mean": 0.1 * step + 0.05 * math.sin(step),
        "rollout/response_len_mean": 200.0 + 13 * step,
        "train/loss": 0.3 / step,
        "train/kl_loss": 0.001 * step,
        "perf/rollout_s": 10.0 + step % 3,
        "val-core/aime_2025/acc/mean@30": 0.29 + 0.04 * step,
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A real run folder written by StepLogger (metrics.jsonl + TensorBoard events)."""
    run = tmp_path / "run"
    with StepLogger(run, console=False) as log:
        for step in range(1, STEPS + 1):
            log(step, _metrics(step))
    return run


def test_render_curves_writes_one_decodable_png_per_group(run_dir: Path) -> None:
    paths = render_curves(run_dir)
    assert [p.name for p in paths] == ["perf.png", "rollout.png", "train.png", "val-core.png"]
    assert all(p.parent == run_dir / "curves" for p in paths)
    for path in paths:
        image = imread(path)
        assert image.shape[0] >= 250 and image.shape[1] >= 350
        assert float(np.std(image[..., :3])) > 0.01  # something is drawn, not a blank canvas
    # Two panels side by side are wider than one.
    assert imread(run_dir / "curves" / "rollout.png").shape[1] > imread(paths[0]).shape[1]


def test_render_curves_selected_tags_into_out_dir(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "nested"
    paths = render_curves(run_dir, out, tags=["train/loss", "val-core/*"])
    assert paths == [out / "train.png", out / "val-core.png"]
    assert not (run_dir / "curves").exists()


def test_load_scalars_from_jsonl_equals_logged(run_dir: Path) -> None:
    scalars = load_scalars(run_dir)
    assert sorted(scalars) == sorted(_metrics(1))
    for tag, points in scalars.items():
        assert points == [(s, _metrics(s)[tag]) for s in range(1, STEPS + 1)]


def test_load_scalars_from_event_files_only_equals_logged(run_dir: Path) -> None:
    (run_dir / "metrics.jsonl").unlink()
    scalars = load_scalars(run_dir)
    assert sorted(scalars) == sorted(_metrics(1))
    for tag, points in scalars.items():
        # TensorBoard stores float32.
        expected = [(s, float(np.float32(_metrics(s)[tag]))) for s in range(1, STEPS + 1)]
        assert points == expected
    assert render_curves(run_dir, tags=["rollout"])[0].name == "rollout.png"


def test_load_scalars_later_step_wins_and_non_numbers_skipped(tmp_path: Path) -> None:
    lines = [
        {"step": 1, "time": 1.0, "phase": "train", "train/loss": 1.0, "ok": True},
        {"step": 2, "time": 2.0, "phase": "train", "train/loss": 0.8, "note": None},
        {"step": 2, "time": 3.0, "phase": "train", "train/loss": 0.7},  # resumed run
        {"step": 3, "time": 4.0, "phase": "val", "val-aux/num_turns/mean": 5},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n\n"
    (tmp_path / "metrics.jsonl").write_text(text)
    assert load_scalars(tmp_path) == {
        "train/loss": [(1, 1.0), (2, 0.7)],
        "val-aux/num_turns/mean": [(3, 5.0)],
    }


def test_select_tags() -> None:
    tags = ["perf/rollout_s", "train/kl_loss", "train/loss", "val-core/a/acc/mean@1"]
    assert select_tags(tags, None) == tags
    assert select_tags(tags, ["train"]) == ["train/kl_loss", "train/loss"]
    assert select_tags(tags, ["train/", "train/loss"]) == ["train/kl_loss", "train/loss"]
    assert select_tags(tags, ["*/acc/*", "perf/rollout_s"]) == tags[3:] + tags[:1]
    with pytest.raises(ValueError, match="'rollout' matches no metric; groups here: perf, train"):
        select_tags(tags, ["rollout"])


def test_missing_folder_file_or_metrics(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        load_scalars(tmp_path / "nope")
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        load_scalars(tmp_path / "f")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(FileNotFoundError, match="no metrics found"):
        load_scalars(tmp_path / "empty")


@pytest.mark.parametrize(
    ("bad_line", "match"),
    [
        ('{"step": 2, "train/loss": 0.5', r"line 2: corrupt JSON"),
        ("[1, 2]", r"line 2: expected a JSON object"),
        ('{"train/loss": 0.5}', r"line 2: 'step' must be an int, got None"),
        ('{"step": "2", "train/loss": 0.5}', r"line 2: 'step' must be an int"),
    ],
)
def test_corrupt_jsonl_names_the_line(tmp_path: Path, bad_line: str, match: str) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=match):
        load_scalars(tmp_path)


def test_a_line_being_written_is_left_out_of_a_live_run(tmp_path: Path) -> None:
    """A run still writing: its last line is cut (mid-JSON, even mid-character) until its
    newline lands; the lines before it are read, by the reader and by the curves."""
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(tmp_path) == []
    whole = '{"step": 1, "phase": "rl", "train/loss": 1.0}\n'
    cut = '{"step": 2, "phase": "rl", "note": "é", "train/loss": 0.5}'.encode()
    path.write_bytes(whole.encode() + cut[: cut.index("é".encode()) + 1])
    assert read_metrics(path) == [{"step": 1, "phase": "rl", "train/loss": 1.0}]
    assert load_scalars(tmp_path) == {"train/loss": [(1, 1.0)]}
    path.write_bytes(whole.encode() + cut + b"\n")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert load_scalars(tmp_path) == {"train/loss": [(1, 1.0), (2, 0.5)]}


def test_out_dir_is_a_file(run_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "png").write_text("")
    with pytest.raises(NotADirectoryError, match="output folder"):
        render_curves(run_dir, tmp_path / "png")


def test_without_matplotlib_names_the_extra(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib made unimportable (sys.modules entry None), as when it is not installed."""
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"install turnrl-grpo-core\[report\]"):
        render_curves(run_dir)


def test_events_without_tensorboard_names_the_extra(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensorboard made unimportable (sys.modules entry None), as when it is not installed."""
    (run_dir / "metrics.jsonl").unlink()
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_accumulator", None)
    with pytest.raises(ImportError, match=r"install turnrl-grpo-core\[report\]"):
        load_scalars(run_dir)


def test_cli_prints_written_paths(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_dir / "pngs"
    assert main(["report", str(run_dir), "--out", str(out), "--tags", "train", "perf"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "perf.png"), str(out / "train.png")]
    assert all(Path(p).stat().st_size > 1000 for p in printed)


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "turnrl-grpo report: error: no such run folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])  # no subcommand
    assert "required" in capsys.readouterr().err


def test_console_script_is_declared_and_runs(run_dir: Path) -> None:
    (script,) = entry_points(group="console_scripts", name="turnrl-grpo")
    assert script.value == "turnrl.grpo_core.observe.report:main" and script.load() is main
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "turnrl.grpo_core.observe.report",
            "report",
            str(run_dir),
            "--tags",
            "val-core",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(run_dir / "curves" / "val-core.png")]
