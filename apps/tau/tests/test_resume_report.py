"""--resume (config, phases reused, refusals), task-kind mixes, the verdict and PNG curves.

No engine here: GRPO's own resume is grpo-core's (``GRPOLoop.resume``); the end-to-end
resume with a real engine is in ``test_smoke_run.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from turnrl_app_tau.cli import resolve
from turnrl_app_tau.config import preset
from turnrl_app_tau.main import main
from turnrl_app_tau.stages import TauStages, console

from turnrl.grpo_core.recipe import load_progress
from turnrl.grpo_core.recipe.sft import SFT_DONE
from turnrl.grpo_core.training.checkpoint import TRAINER_STATE
from turnrl.tool_envs.tau.data import load_tasks_and_domain, tool_schemas


def test_resume_reads_the_run_config_then_flags(tmp_path: Path) -> None:
    config = preset("smoke")
    config.run_dir = str(tmp_path)
    config.save(tmp_path)
    invocation = resolve(["--resume", "--run-dir", str(tmp_path), "--num-rollout", "5"], {})
    assert invocation.resume
    assert invocation.config.preset == "smoke"  # the run's own preset, not cpu-default
    assert invocation.config.loop.num_rollout == 5
    assert invocation.config.tau.synthetic_num_tasks == config.tau.synthetic_num_tasks
    assert not resolve(["--run-dir", str(tmp_path)], {}).resume


def test_resume_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs --run-dir"):
        resolve(["--resume"], {})
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve(["--resume", "--run-dir", str(tmp_path)], {})
    with pytest.raises(ValueError, match="drop --preset"):
        resolve(["--resume", "--smoke", "--run-dir", str(tmp_path)], {})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve(["--resume", "--run-dir", str(tmp_path)], {})
    (tmp_path / "progress.json").write_text("{broken")
    with pytest.raises(ValueError, match="corrupt"):
        load_progress(tmp_path)
    (tmp_path / "progress.json").write_text(json.dumps({"before": {"reward": 0.5}}))
    assert load_progress(tmp_path) == {"before": {"reward": 0.5}}


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path: Path) -> None:
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / TRAINER_STATE).write_text("{}")
    (tmp_path / "config.json").write_text('{"preset": "earlier"}')
    assert main(["--smoke", "--run-dir", str(tmp_path)]) == 2
    assert not (tmp_path / "summary.json").exists()
    assert (tmp_path / "config.json").read_text() == '{"preset": "earlier"}'  # not rewritten


def _sft_stage(config: Any, folder: Path, resume: bool = False) -> tuple[Path, Any]:
    """The shared SFT stage with the app's data (``recipe.stages.sft_stage``), in ``folder``."""
    from turnrl.grpo_core.recipe.driver import open_run
    from turnrl.grpo_core.recipe.model import policy_start
    from turnrl.grpo_core.recipe.stages import sft_stage

    config.run_dir = str(folder)
    data = load_tasks_and_domain(config.tau)
    tools = tool_schemas(data, config.rollout.short_tools, config.rollout.tools_in_prompt)
    with open_run("tau", config, resume=resume, console=console) as run:
        base = policy_start(config, folder / "model" / "base", reuse=resume)
        return sft_stage(run, TauStages(run.config, data, tools, run.logger), base)


def test_resume_reuses_base_and_sft_models(tmp_path: Path) -> None:
    from turnrl.grpo_core.recipe.model import policy_start

    config = preset("smoke")
    base = policy_start(config, tmp_path / "model" / "base")
    assert policy_start(config, tmp_path / "model" / "base", reuse=True) == base
    sft = tmp_path / "model" / "sft"
    sft.mkdir(parents=True)
    record = {"steps": 6, "loss_first": 7.0, "loss_last": 5.0}
    (sft / SFT_DONE).write_text(json.dumps(record))
    # No training happens: a resumed run reuses the complete SFT model.
    assert _sft_stage(config, tmp_path, resume=True) == (sft, record)


def test_synthetic_kinds_parse_as_a_comma_list() -> None:
    parsed = resolve(["--synthetic-kinds", "status, cancel,"], {}).config
    assert parsed.tau.synthetic_kinds == ["status", "cancel"]


def test_step_samples_are_written_as_text(tmp_path: Path) -> None:
    from turnrl.tool_envs.trajectory import Trajectory

    traj = Trajectory(
        [1],
        [],
        [],
        [],
        messages=[
            {"role": "user", "content": "Cancel order #W1."},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_order_details"}]},
        ],
        reward=1.0,
    )
    from turnrl.grpo_core.observe.logger import StepLogger

    with StepLogger(tmp_path, console=False, tensorboard=False) as logger:
        logger.log_samples(3, [traj.text()])  # as the RL stage's on_metrics does
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 3
    text = json.dumps(rows[0])
    assert "Cancel order #W1." in text and "get_order_details" in text and "reward=1.0" in text


@pytest.mark.parametrize(
    ("settings", "steps", "stop", "num_probes"),
    [
        # Target 1.0 is out of reach of the untrained model: every step runs, probed each 2.
        ({"probe_target": 1.0, "probe_interval": 2}, 2 + 6, "all steps done", 3),
        # Target 0.0 probes nothing; the time bound ends SFT after its first step.
        ({"max_seconds": 1e-3}, 1, "time bound", 0),
    ],
)
def test_sft_stops_on_its_probe_or_time_bound(
    tmp_path: Path, settings: dict[str, float], steps: int, stop: str, num_probes: int
) -> None:
    import dataclasses

    config = preset("smoke")
    config.sft = dataclasses.replace(config.sft, probe_size=4, **settings)
    folder, record = _sft_stage(config, tmp_path)
    assert json.loads((folder / SFT_DONE).read_text()) == record
    assert record["steps"] == steps and stop in record["stop"]
    assert [s for s, _ in record["probes"]] == [2 + 2 * k for k in range(1, num_probes + 1)]
    assert all(rate == 0.0 for _, rate in record["probes"])
