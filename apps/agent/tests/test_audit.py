"""``apps/agent audit`` on a run folder made here: a tiny model as version 0, a trainer
checkpoint one SFT step later as version 1, hand-made gateway rows whose behaviour log-probs
each version computed itself (gap ~0 only when the audit loads the recorded version), one
row perturbed (its gap reported) and one turn sampled as a non-canonical split of its text
(a boundary mismatch against the fresh tokenisation). No engine: the trainer scores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from turnrl_app_agent.audit import TRAJECTORY_DIR
from turnrl_app_agent.config import preset
from turnrl_app_agent.main import main

from turnrl.grpo_core.training.batch import TrainBatch, pad_sequences
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import OptimizerConfig, TorchEngine, TorchEngineConfig
from turnrl.tool_envs.chat import ChatTokenizer

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


def conversation(chat: ChatTokenizer, split_first_word: bool) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of two assistant turns as the gateway's ledger lays them out."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You help customers."},
        {"role": "user", "content": "where is my order"},
    ]
    ids = chat.render_ids(history, add_generation_prompt=True)
    mask = [0] * len(ids)
    for reply, user in (("pending order status", "thanks"), ("the refund is done", None)):
        first, rest = reply.split(" ", 1)
        head = [t for c in first for t in chat.encode(c)] if split_first_word else []
        sampled = head + chat.encode((" " + rest if head else reply) + chat.end_of_turn)
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        history.append({"role": "assistant", "content": reply})
        if user is not None:
            new = [{"role": "user", "content": user}]
            bridge = chat.encode(chat.render_delta(history, new))
            ids, mask = ids + bridge, mask + [0] * len(bridge)
            history += new
    return ids, mask


def behaviour(engine: TorchEngine, ids: list[int], mask: list[int]) -> list[float]:
    logp = engine.compute_logprobs(TrainBatch(*pad_sequences([ids], [mask], 0)))
    return [float(x) for x in logp[0]]


def line(version: int, ids: list[int], mask: list[int], logprobs: list[float]) -> str:
    row = {"chain": 0, "fork_reason": None, "prompt_ids": ids[:10], "ids": ids,
           "loss_mask": mask, "logprobs": logprobs, "versions": [None] * len(ids), "calls": 2}  # fmt: skip
    return json.dumps({"version": version, "sampling": SAMPLING, "status": "completed",
                       "reward": 1.0, "error": None, "rows": [row]})  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("run")
    base = build_tiny_model(run / "model" / "base")
    config = preset("smoke")
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    chat = ChatTokenizer.from_dir(base)
    plain, mask = conversation(chat, split_first_word=False)
    split, split_mask = conversation(chat, split_first_word=True)

    engine = TorchEngine(TorchEngineConfig(str(base), optimizer=OptimizerConfig(lr=1e-2)))
    v0 = behaviour(engine, plain, mask)
    perturbed = list(v0)
    perturbed[mask.index(1) + 1] += 0.3  # the second sampled token
    lines = [line(0, plain, mask, v0), line(0, plain, mask, perturbed)]
    (run / TRAJECTORY_DIR).mkdir()
    (run / TRAJECTORY_DIR / "step-1.jsonl").write_text("\n".join(lines) + "\n")

    batch = TrainBatch(*pad_sequences([plain], [mask], 0))
    engine.train_step(batch, objective="sft")  # version 1: one step later
    engine.save_checkpoint(run / "checkpoints" / "step_1")
    v1 = behaviour(engine, plain, mask)
    assert max(abs(a - b) for a, b in zip(v0, v1, strict=True)) > 0.05  # versions differ
    lines = [
        line(1, plain, mask, v1),
        line(1, split, split_mask, behaviour(engine, split, split_mask)),
    ]
    (run / TRAJECTORY_DIR / "step-2.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_the_audit_replays_each_version_and_reports_gaps_and_boundaries(run_dir: Path) -> None:
    assert main(["audit", "--run-dir", str(run_dir)]) == 0
    result = json.loads((run_dir / "audit.json").read_text())
    v0, v1 = result["versions"]["0"], result["versions"]["1"]
    assert v0["sequences"] == v1["sequences"] == 2 and result["sequences"] == 4
    assert v0["gap"]["max"] == pytest.approx(0.3, abs=1e-4) and v0["gap"]["p50"] < 1e-4
    assert v1["gap"]["max"] < 1e-4  # scored at version 1 (version 0 would be > 0.05 off)
    assert v0["boundaries"] == v1["boundaries"] == 2 * 3  # two turns: 0->1, 1->0, 0->1
    assert v0["boundary_mismatches"] == 0 and v0["token_mismatches"] == 0
    # The split turn's first word: both turns' starts differ from the fresh tokenisation.
    assert v1["boundary_mismatches"] == 2 and v1["token_mismatches"] > 0
    assert result["boundary_mismatches"] == 2 and result["tokens"] == v0["tokens"] + v1["tokens"]


def test_one_step_and_a_missing_step(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--run-dir", str(run_dir), "--step", "2"]) == 0
    result = json.loads((run_dir / "audit.json").read_text())
    assert list(result["versions"]) == ["1"] and result["step"] == 2
    assert "trajectory audit" in capsys.readouterr().out
    assert main(["audit", "--run-dir", str(run_dir), "--step", "7"]) == 2
    assert "no step 7's trajectories" in capsys.readouterr().err


def test_a_version_the_run_did_not_keep_is_named(run_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / TRAJECTORY_DIR).mkdir(parents=True)
    (run / "config.json").write_text((run_dir / "config.json").read_text())
    for name in ("model",):
        (run / name).symlink_to(run_dir / name)
    (run / TRAJECTORY_DIR / "step-4.jsonl").write_text(line(3, [1, 2, 3], [0, 1, 1], [0.0] * 3))
    assert main(["audit", "--run-dir", str(run)]) == 2


def test_saved_rollouts_hold_the_export_and_release_it(tmp_path: Path) -> None:
    from turnrl_app_agent.audit import read_rollouts, save_rollout

    from turnrl.tool_envs.protocol import SamplingParams
    from turnrl.tool_envs.trajectory import Trajectory

    rows = [{"ids": [1, 2], "loss_mask": [0, 1], "logprobs": [0.0, -1.0]}]
    traj = Trajectory([1], [2], [1], [-1.0], reward=1.0, metadata={"session": "s", "rows": rows})
    save_rollout(tmp_path, 2, SamplingParams(temperature=0.7), [traj])
    assert "rows" not in traj.metadata  # not carried through training
    (saved,) = read_rollouts(tmp_path, 3)
    assert saved["version"] == 2 and saved["rows"] == rows and saved["session"] == "s"
    assert saved["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": -1}
    assert torch.tensor(saved["rows"][0]["ids"]).tolist() == [1, 2]
