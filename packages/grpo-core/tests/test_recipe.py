"""The recipe layer's plain parts: run folders, progress, the accelerator of a device,
evaluation statistics and the run's report files."""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from turnrl.grpo_core.observe.logger import StepLogger
from turnrl.grpo_core.recipe import (
    accelerator,
    claim_run_dir,
    config_from_dict,
    load_progress,
    read_run_config,
    save_progress,
)
from turnrl.grpo_core.recipe.evaluation import (
    Phases,
    change,
    mean_and_stderr,
    pass_hat_k,
    render_run_curves,
    verdict,
    write_summary,
)


def test_a_fresh_run_gets_a_new_folder_and_never_one_holding_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    default = claim_run_dir(None, "retool")
    assert default.parent == Path("runs") and default.name.startswith("retool-")
    assert default.is_dir()
    named = claim_run_dir(tmp_path / "a" / "b", "tau")
    assert named == tmp_path / "a" / "b" and named.is_dir()
    assert claim_run_dir(named, "tau") == named  # an empty folder is free
    for marker in ("metrics.jsonl", "summary.json", "checkpoints"):
        held = tmp_path / marker.replace(".", "_")
        held.mkdir()
        if marker == "checkpoints":
            (held / marker).mkdir()
        else:
            (held / marker).write_text("x")
        with pytest.raises(ValueError, match=rf"already holds a run \({marker}\)"):
            claim_run_dir(held, "tau")
        assert claim_run_dir(held, "tau", resume=True) == held


def test_progress_round_trip_and_a_corrupt_file(tmp_path: Path) -> None:
    assert load_progress(tmp_path) == {}
    save_progress(tmp_path, {"before": {"reward": 0.25}})
    assert load_progress(tmp_path) == {"before": {"reward": 0.25}}
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "progress.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"corrupt.*delete it"):
        load_progress(tmp_path)


@dataclasses.dataclass
class _Section:
    lr: float = 1.0
    names: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Config:
    seed: int = 0
    rl: _Section = dataclasses.field(default_factory=_Section)


def test_a_run_config_round_trips_and_bad_ones_are_named(tmp_path: Path) -> None:
    config = _Config(seed=3, rl=_Section(lr=0.5, names=["a"]))
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
    assert config_from_dict(_Config, read_run_config(tmp_path)) == config
    assert config_from_dict(_Config, {"rl": {"lr": 2.0}}) == _Config(rl=_Section(lr=2.0))
    with pytest.raises(ValueError, match=r"unknown config keys in _Section: \['lr2'\]"):
        config_from_dict(_Config, {"rl": {"lr2": 2.0}})
    with pytest.raises(ValueError, match="section 'rl' must be an object"):
        config_from_dict(_Config, {"rl": [1]})
    with pytest.raises(ValueError, match="needs --run-dir"):
        read_run_config(None)
    with pytest.raises(FileNotFoundError, match="not found"):
        read_run_config(tmp_path / "elsewhere")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds no config object"):
        read_run_config(tmp_path)


@pytest.mark.parametrize(
    ("device", "resource"), [("cpu", "CPU"), ("gpu", "GPU"), ("cuda", "GPU"), ("npu", "NPU")]
)
def test_accelerator_of_each_device(device: str, resource: str) -> None:
    assert accelerator(device) == resource


def test_an_unknown_device_is_named() -> None:
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        accelerator("tpu")


def test_mean_and_stderr_and_pass_hat_k() -> None:
    assert mean_and_stderr([1.0, 0.0, 1.0, 0.0]) == (0.5, pytest.approx((1 / 3 / 4) ** 0.5))
    assert mean_and_stderr([0.25]) == (0.25, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        mean_and_stderr([])
    assert pass_hat_k([2, 0, 1], trials=2, k=1) == pytest.approx(0.5)
    assert pass_hat_k([2, 0, 1], trials=2, k=2) == pytest.approx(1 / 3)
    assert pass_hat_k([3, 2], trials=4, k=2) == pytest.approx((3 / 6 + 1 / 6) / 2)
    with pytest.raises(ValueError, match="k must be in"):
        pass_hat_k([1], trials=2, k=3)
    with pytest.raises(ValueError, match="no items"):
        pass_hat_k([], trials=1, k=1)


def _record(per_item: dict[str, list[float | None]]) -> dict[str, Any]:
    means = [mean_and_stderr([v for v in items if v is not None]) for items in per_item.values()]
    se = sum(e**2 for _, e in means) ** 0.5 / len(means)
    return {"score": sum(m for m, _ in means) / len(means), "score_se": se, "per_item": per_item}


def test_the_change_is_paired_over_items_when_both_sides_list_them() -> None:
    # Every item gains 0.25: the paired change has no spread, while the two evaluations'
    # own standard errors (items of very different difficulty) would call it noise.
    before, after = _record({"a": [0.0, 0.75, 0.0, 0.75]}), _record({"a": [0.25, 1.0, 0.25, 1.0]})
    assert change(before, after) == (0.0, "paired over 4 items")
    combined, how = change({**before, "per_item": None}, after)
    assert how == "combined"
    assert combined == pytest.approx((before["score_se"] ** 2 + after["score_se"] ** 2) ** 0.5)
    assert change(before, _record({"a": [0.25, 1.0, 0.25]}))[1] == "combined"
    # An item a failure left unscored on either side drops out of the pairing.
    dropped = _record({"a": [0.25, 1.0, None, 1.0]})
    assert change(before, dropped) == (0.0, "paired over 3 items")
    # Over two datasets the score is the mean of their means: s.e.s add in quadrature / 2.
    two_b, two_a = (
        _record({"a": [0.0, 1.0], "b": [0.0, 1.0]}),
        _record({"a": [1.0, 1.0], "b": [0.0, 1.0]}),
    )
    assert change(two_b, two_a) == (pytest.approx(0.5 / 2), "paired over 4 items")
    se_b, se_a = before["score_se"], after["score_se"]
    clear = verdict("accuracy", (0.375, se_b), (0.625, se_a), 0.0, "paired over 4 tasks")
    assert clear.startswith("RL raised (beyond 2 standard errors) the held-out accuracy: 0.375")
    assert "+0.250" in clear and "paired over 4 tasks" in clear
    assert "(within noise)" in verdict("accuracy", (0.375, se_b), (0.625, se_a), 0.2, "x")
    assert verdict("reward", (0.5, 0.1), (0.4, 0.1), 0.1, "x").startswith("RL did not raise")


def test_phases_add_up_and_summary_is_sorted_json(tmp_path: Path) -> None:
    console = Console(file=io.StringIO(), width=80)
    phases = Phases(console)
    for _ in range(2):
        with phases("eval"):
            pass
    with pytest.raises(RuntimeError), phases("rl"):
        raise RuntimeError("a failed phase is timed too")
    assert set(phases.seconds) == {"eval", "rl"} and phases.seconds["eval"] >= 0
    assert "eval" in console.file.getvalue()  # type: ignore[attr-defined]
    path = write_summary(tmp_path / "summary.json", {"b": Path("x"), "a": 1})
    assert path.read_text().startswith('{\n  "a": 1,\n  "b": "x"')


def test_curves_are_drawn_from_the_logged_scalars_or_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    console = Console(file=io.StringIO(), width=200)
    assert render_run_curves(tmp_path / "empty", console) == []  # nothing logged yet
    with StepLogger(tmp_path, console=False) as logger:
        for step in range(1, 4):
            logger(step, {"rollout/reward_mean": 0.1 * step, "train/loss": 1.0 / step})
        logger(3, {"val-core/tau/acc/mean@1": 0.5})
    paths = render_run_curves(tmp_path, console)
    assert sorted(p.name for p in paths) == ["rollout.png", "train.png", "val-core.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert render_run_curves(tmp_path, console) == []
    assert "matplotlib" in console.file.getvalue()  # type: ignore[attr-defined]


def test_the_report_statistics_do_not_pull_in_torch() -> None:
    code = "import sys, turnrl.grpo_core.recipe.evaluation; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_lazy_names_are_the_functions_in_any_order() -> None:
    code = (
        "from turnrl.grpo_core.recipe import accelerator, ray_run, build_loop\n"
        "import turnrl.grpo_core.recipe as r\n"
        "assert callable(ray_run) and callable(accelerator) and callable(build_loop)\n"
        "assert r.ray_run is ray_run and r.ray_run.__name__ == 'ray_run'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
