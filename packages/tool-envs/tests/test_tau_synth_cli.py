"""The synthetic mini-retail generator and the turnrl-tau console command."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnrl.tool_envs.tau import TauDomain, load_tasks
from turnrl.tool_envs.tau.cli import main
from turnrl.tool_envs.tau.synth import generate, write

TAU_DIR = Path(
    os.environ.get("TURNRL_TAU_BENCH_DIR")
    or Path(__file__).resolve().parents[3] / ".." / "shared" / "tau-bench"
)
needs_tau = pytest.mark.skipif(not TAU_DIR.is_dir(), reason="tau-bench data not present")


def test_generation_is_deterministic_by_seed():
    a, b, c = generate(seed=7), generate(seed=7), generate(seed=8)
    assert json.dumps(a.tables) == json.dumps(b.tables) and a.tasks == b.tasks
    assert json.dumps(a.tables) != json.dumps(c.tables)


def test_tasks_are_solvable_and_varied():
    synthetic = generate(seed=1, num_users=15, num_tasks=25)
    domain = synthetic.domain()
    pristine = domain.new_database().data_hash()
    kinds = {t.actions[-1].name for t in synthetic.tasks}
    assert {
        "cancel_pending_order",
        "exchange_delivered_order_items",
        "get_order_details",
        "modify_pending_order_address",
        "return_delivered_order_items",
    } <= kinds
    for task in synthetic.tasks:
        replay = domain.replay(task.actions)
        assert replay.errors == []
        assert (replay.data_hash == pristine) == (task.actions[-1].name == "get_order_details")
        assert 2 <= len(task.actions) <= 4
        assert task.user_id in synthetic.tables["users"]


def test_generator_rejects_bad_sizes():
    with pytest.raises(ValueError, match=">= 1"):
        generate(seed=0, num_tasks=0)
    with pytest.raises(ValueError, match="num_users must be <="):
        generate(seed=0, num_users=10_000)


def test_written_folder_loads_as_a_retail_domain(tmp_path):
    write(generate(seed=4), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "orders.json",
        "products.json",
        "tasks.jsonl",
        "users.json",
        "wiki.md",
    ]
    domain = TauDomain.from_dir("retail", tmp_path)
    assert len(load_tasks(tmp_path / "tasks.jsonl")) == 20
    assert domain.schemas[0]["function"]["name"] == "calculate"  # built-in schemas, no tools.json


def test_cli_synth_then_replay(tmp_path, capsys):
    assert main(["synth", "--seed", "3", "--out", str(tmp_path), "--tasks", "6"]) == 0
    capsys.readouterr()
    code = main(
        [
            "replay",
            "--domain",
            "retail",
            "--data-dir",
            str(tmp_path),
            "--tasks",
            str(tmp_path / "tasks.jsonl"),
            "--limit",
            "4",
        ]
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert code == 0 and [x["index"] for x in lines] == [0, 1, 2, 3]
    assert all(x["reward"] == 1.0 and x["data_hash"] == x["gt_data_hash"] for x in lines)


def test_cli_errors_exit_with_status_2(tmp_path, capsys):
    code = main(
        [
            "replay",
            "--domain",
            "retail",
            "--data-dir",
            str(tmp_path / "none"),
            "--tasks",
            str(tmp_path / "t.jsonl"),
        ]
    )
    assert code == 2 and "does not exist" in capsys.readouterr().err
    write(generate(seed=4), tmp_path)
    (tmp_path / "bad.json").write_text("{}")
    code = main(
        [
            "replay",
            "--domain",
            "retail",
            "--data-dir",
            str(tmp_path),
            "--tasks",
            str(tmp_path / "tasks.jsonl"),
            "--gt-hashes",
            str(tmp_path / "bad.json"),
        ]
    )
    assert code == 2 and "not a gt_data_hashes file" in capsys.readouterr().err


def test_actions_unknown_to_the_domain_are_reported(tmp_path, capsys):
    write(generate(seed=4, num_tasks=1), tmp_path)
    airline_dir = tmp_path / "airline"
    airline_dir.mkdir()
    for table in ("flights", "reservations", "users"):
        (airline_dir / f"{table}.json").write_text("{}")
    (airline_dir / "wiki.md").write_text("policy")
    code = main(
        [
            "replay",
            "--domain",
            "airline",
            "--data-dir",
            str(airline_dir),
            "--tasks",
            str(tmp_path / "tasks.jsonl"),
        ]
    )
    line = json.loads(capsys.readouterr().out)
    assert code == 0 and "get_order_details" in line["unknown_actions"]


def test_gt_match_false_gives_exit_status_1(tmp_path, capsys):
    write(generate(seed=4, num_tasks=2), tmp_path)
    (tmp_path / "gt.json").write_text(
        json.dumps(
            {
                "tasks": [
                    {"task_index": 0, "gt_data_hash": "0" * 64},
                    {"task_index": 1, "gt_data_hash": "1" * 64},
                ]
            }
        )
    )
    code = main(
        [
            "replay",
            "--domain",
            "retail",
            "--data-dir",
            str(tmp_path),
            "--tasks",
            str(tmp_path / "tasks.jsonl"),
            "--gt-hashes",
            str(tmp_path / "gt.json"),
        ]
    )
    assert code == 1
    assert [json.loads(x)["gt_match"] for x in capsys.readouterr().out.splitlines()] == [
        False,
        False,
    ]


@needs_tau
def test_console_script_replays_training_tasks_against_recorded_hashes():
    retail = TAU_DIR / "retail"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "turnrl.tool_envs.tau.cli",
            "replay",
            "--domain",
            "retail",
            "--data-dir",
            str(retail),
            "--tasks",
            str(retail / "tasks_train.jsonl"),
            "--limit",
            "40",
            "--gt-hashes",
            str(retail / "gt_data_hashes_train.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(lines) == 40 and all(x["gt_match"] and x["reward"] == 1.0 for x in lines)
    assert lines[24]["replay_errors"]  # SPEC §11.1: task 24's gold payment change fails
