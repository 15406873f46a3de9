"""The app's glue without engines: datasets wiring, the sandbox choice, run folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from rich.console import Console
from turnrl_app_retool.cli import resolve
from turnrl_app_retool.data import Datasets
from turnrl_app_retool.stages import RetoolStages


def test_generated_datasets_keep_heldout_apart() -> None:
    config, _ = resolve(["--smoke"])
    data = Datasets(config, "Box it.")
    assert len(data.sft_chats) == config.data.num_sft_chats
    assert len(data.train) == config.data.num_train_problems
    assert list(data.val) == ["synth_arith"]
    heldout = {t.problem for t in data.val["synth_arith"]}
    assert len(heldout) == config.data.num_val_problems
    assert not heldout & {t.problem for t in data.train}
    assert data.sft_chats[0][0]["content"].endswith("Box it.")
    probe = {chat[0]["content"] for chat in data.probe_chats}
    assert len(probe) == config.sft.probe_size  # never an SFT, RL or held-out problem
    assert not probe & {chat[0]["content"] for chat in data.sft_chats}
    assert not {p.split("\n\n")[0] for p in probe} & (heldout | {t.problem for t in data.train})


def test_sft_stops_at_the_probe_target_or_the_time_bound(tmp_path: Path) -> None:
    from turnrl.grpo_core.recipe.driver import open_run
    from turnrl.grpo_core.recipe.model import policy_start
    from turnrl.grpo_core.recipe.stages import sft_stage

    flags = ["--sft-steps", "6", "--sft-probe-target", "1", "--sft-probe-interval", "2"]
    config, _ = resolve(["--smoke", *flags, "--run-dir", str(tmp_path)])
    data = Datasets(config, "Box it.")
    base = policy_start(config, tmp_path / "base")
    with open_run("retool", config, resume=False, console=Console()) as run:
        app = RetoolStages(run.config, data, run.logger)
        _, record = sft_stage(run, app, base)
        assert record is not None
        assert record["steps"] == 6 and record["stop"] == "all steps done"
        assert [step for step, _ in record["probes"]] == [2, 4, 6]
        run.config.sft.max_seconds = 1e-3
        _, record = sft_stage(run, app, base)  # trains again: a fresh run reuses nothing
        assert record is not None
        assert record["steps"] == 1 and record["stop"].startswith("time bound")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The untrained model reproduces no probe chat: all 6 steps, probed at 2, 4, 6; then the
    # time bound stops the second run after its first step.
    assert [r["step"] for r in rows if "sft/probe" in r] == [2, 4, 6]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 1]


def test_aime_files_replace_generated_validation(tmp_path: Path) -> None:
    a24 = tmp_path / "a24.jsonl"
    a24.write_text("".join(json.dumps({"Problem": f"P{i}", "Answer": i}) + "\n" for i in range(5)))
    a25 = tmp_path / "a25.jsonl"
    a25.write_text(json.dumps({"problem": "Q", "answer": "3"}) + "\n")
    config, _ = resolve(
        ["--smoke", "--val-data", str(a24), "--val-data", str(a25), "--max-val-problems", "2"]
    )
    data = Datasets(config, "x")
    assert {k: [t.answer for t in v] for k, v in data.val.items()} == {
        "aime_2024": ["0", "1"],
        "aime_2025": ["3"],
    }


def test_external_sandbox_url_starts_nothing() -> None:
    config, _ = resolve(["--smoke", "--sandbox-url", "http://127.0.0.1:9"])
    with config.sandbox.client() as client:
        assert client.config.url == "http://127.0.0.1:9"


@pytest.mark.slow
def test_embedded_sandbox_runs_for_the_block_only() -> None:
    """Where it can (root, namespaces) the sandbox contains runs; elsewhere it starts only
    with --sandbox-insecure."""
    from turnrl.tool_envs.sandbox.embedded import can_contain

    able = can_contain()
    config, _ = resolve(["--smoke", *([] if able else ["--sandbox-insecure"])])
    assert config.sandbox.insecure is not able
    with config.sandbox.client() as client:
        url = client.config.url
        assert requests.get(f"{url}/v1/ping", timeout=5).json()["contained"] is able
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/v1/ping", timeout=5)


def test_a_bad_sft_schedule_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        resolve(["--sft-lr-decay", "linear"])
    assert "--sft-lr-decay must be constant or cosine" in capsys.readouterr().err


def test_a_folder_holding_a_run_is_refused_and_left_alone(tmp_path: Path, capsys) -> None:
    from turnrl_app_retool.main import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.json").write_text("{}")
    assert main(["--smoke", "--run-dir", str(tmp_path)]) == 2
    assert "already holds a run (metrics.jsonl)" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "config.json").read_text() == "{}"


def test_resume_reads_the_run_config_then_flags(tmp_path: Path) -> None:
    config, _ = resolve(["--smoke", "--run-dir", str(tmp_path), "--lr", "0.003"])
    config.save(tmp_path)
    resumed, args = resolve(["--resume", "--run-dir", str(tmp_path), "--num-rollout", "5"])
    assert args.resume and resumed.preset == "smoke"
    assert (
        resumed.optimizer.lr == 0.003 and resumed.loop.num_rollout == 5
    )  # the run's, then the flag
    assert resumed.to_dict() == {
        **config.to_dict(),
        "loop": {**config.to_dict()["loop"], "num_rollout": 5},
    }
    assert not resolve(["--run-dir", str(tmp_path)])[1].resume


@pytest.mark.parametrize(
    ("argv", "config_text", "message"),
    [
        (["--resume"], None, "--resume needs --run-dir"),
        (["--resume", "--run-dir", "{dir}"], None, "config.json not found"),
        (["--resume", "--smoke", "--run-dir", "{dir}"], "{}", "drop --preset/--smoke"),
        (["--resume", "--run-dir", "{dir}"], "{not json", "is not valid JSON"),
        (["--resume", "--run-dir", "{dir}"], '{"rl": {"nope": 1}}', "unknown config keys"),
        (["--resume", "--run-dir", "{dir}"], '{"rl": 3}', "section 'rl' must be an object"),
    ],
)
def test_resume_refuses_bad_input(
    tmp_path: Path, capsys, argv: list[str], config_text: str | None, message: str
) -> None:
    if config_text is not None:
        (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(SystemExit) as exit_info:
        resolve([a.format(dir=tmp_path) for a in argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
