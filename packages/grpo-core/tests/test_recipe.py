"""The recipe layer's plain parts: run folders, progress, the accelerator of a device."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnrl.grpo_core.recipe import accelerator, claim_run_dir, load_progress, save_progress


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


@pytest.mark.parametrize(
    ("device", "resource"), [("cpu", "CPU"), ("gpu", "GPU"), ("cuda", "GPU"), ("npu", "NPU")]
)
def test_accelerator_of_each_device(device: str, resource: str) -> None:
    assert accelerator(device) == resource


def test_an_unknown_device_is_named() -> None:
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        accelerator("tpu")
