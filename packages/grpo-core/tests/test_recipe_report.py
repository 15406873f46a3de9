"""The evaluation record both apps build, its curve points, and the run's report (summary,
table, verdict, summary.json) from what ``run_stages`` did."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from turnrl.grpo_core.recipe.evaluation import (
    evaluation_record,
    record_scalars,
    rerun_engine_failures,
)
from turnrl.grpo_core.recipe.report import report_run, results_table, summary_of
from turnrl.grpo_core.recipe.stages import StagesResult


@dataclass
class Ep:
    """An episode as an evaluation reads it (the fields of tool-envs' ``Trajectory``)."""

    correct: float
    status: str = "completed"
    num_turns: int = 2
    num_tool_calls: int = 1
    num_invalid_tool_calls: int = 0
    num_generated_tokens: int = 10
    metadata: dict[str, Any] = field(default_factory=dict)


def score(e: Ep) -> dict[str, float]:
    return {"score": e.correct, "bonus": e.correct + 0.5}


def lost(error: str) -> Ep:
    return Ep(0.0, status="failed", num_turns=0, metadata={"error": error})


def test_a_record_scores_items_and_leaves_infrastructure_failures_out() -> None:
    items = [[Ep(1), Ep(1)], [Ep(0), lost("engine died")], [lost("x"), lost("y")], [Ep(0), Ep(1)]]
    record = evaluation_record({"d": items}, score, seconds=2.0)
    # 5 scored episodes (3 correct); the failed ones are out of every number, not wrong.
    assert record["score"] == pytest.approx(3 / 5)
    assert record["per_item"] == {"d": [1.0, 0.0, None, 0.5]}
    assert record["failed"] == 3 / 8 and record["error"] == "engine died"
    assert record["trials"] == 2
    metrics = record["metrics"]
    assert metrics["bonus"] == pytest.approx(3 / 5 + 0.5) and metrics["num_turns"] == 2.0
    # Every episode's tokens were generated, failed or not.
    assert metrics["generated_tokens"] == 80.0 and metrics["tokens_per_s"] == 40.0
    # pass^k over the items none of whose trials failed: [2, 1] successes of 2.
    assert metrics["pass^1"] == pytest.approx(0.75) and metrics["pass^2"] == pytest.approx(0.5)
    # The s.e. is over items (their means), not episodes.
    mean = 0.5
    spread = sum((m - mean) ** 2 for m in (1.0, 0.0, 0.5)) / 2 / 3
    assert record["score_se"] == pytest.approx(spread**0.5)
    points = record_scalars(record)
    assert points["val-core/d/acc/mean@2"] == record["score"]
    assert points["val-aux/pass^2"] == metrics["pass^2"] and points["val-aux/failed"] == 3 / 8


async def test_episodes_their_engine_failed_run_again_and_are_counted() -> None:
    """An engine's failure is re-run (up to max_retries rounds); the policy's own outcomes and
    other infrastructure failures (a user simulator's) are not."""
    first = [Ep(1), lost("PartialGenerationError: engine died after 7 tokens"), Ep(0)]
    first += [lost("UserSimulatorError: down"), lost("EngineUnavailableError: refused")]
    calls: list[int] = []

    async def rerun(i: int) -> Ep:
        calls.append(i)
        if i == 4 and calls.count(4) == 1:  # fails once more, then succeeds
            return lost("NoEngineAvailableError: none")
        return Ep(1)

    done, reruns = await rerun_engine_failures(first, rerun, backoff=0.0)
    assert sorted(calls) == [1, 4, 4] and reruns == 3
    assert [e.status for e in done] == ["completed"] * 3 + ["failed", "completed"]
    assert done[3].metadata["error"].startswith("UserSimulatorError")  # not an engine's
    record = evaluation_record({"d": [[e] for e in done]}, score, 1.0, reruns)
    assert record["metrics"]["engine_reruns"] == 3.0 and record["failed"] == 1 / 5

    async def dead(i: int) -> Ep:
        return lost("EngineUnavailableError: refused")

    done, reruns = await rerun_engine_failures(first, dead, max_retries=2, backoff=0.0)
    assert reruns == 4 and sum(e.status == "failed" for e in done) == 3  # counted, not scored


def test_several_datasets_weigh_alike_and_non_binary_scores_get_no_pass_k() -> None:
    record = evaluation_record(
        {"a": [[Ep(1)], [Ep(1)], [Ep(1)], [Ep(0)]], "b": [[Ep(0.5)], [Ep(0.5)]]}, score, 1.0
    )
    assert record["datasets"]["a"]["score"] == 0.75 and record["datasets"]["b"]["score"] == 0.5
    assert record["score"] == pytest.approx(0.625)  # the mean of the two, not of 6 episodes
    se_a = record["datasets"]["a"]["score_se"]
    assert record["score_se"] == pytest.approx(se_a / 2)  # b has no spread
    assert not any(key.startswith("pass^") for key in record["metrics"])


def test_a_record_of_nothing_or_of_failures_only_is_an_error() -> None:
    with pytest.raises(ValueError, match="no episodes"):
        evaluation_record({"a": [[]]}, score, 1.0)
    with pytest.raises(RuntimeError, match=r"every held-out episode failed, e\.g\. user down"):
        evaluation_record({"a": [[lost("user down")], [lost("z")]]}, score, 1.0)


class FakeRun:
    """The parts of ``recipe.driver.Run`` the report reads (no engines, no logger)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.config = SimpleNamespace(
            preset="smoke",
            loop=SimpleNamespace(algorithm="grpo"),
        )
        self.phases = SimpleNamespace(seconds={"sft": 1.0, "rl": 3.0})
        self.console = Console(record=True, width=140)

    def seconds(self) -> float:
        return 10.0

    def finish(self, summary: dict[str, Any]) -> list[Path]:
        paths = [self.folder / "curves" / "val-core.png"]
        summary["curves"] = [str(p) for p in paths]  # as Run.finish does
        (self.folder / "summary.json").write_text(json.dumps(summary, default=str))
        return paths


def test_the_report_says_what_rl_changed_with_its_noise(tmp_path: Path) -> None:
    before = evaluation_record({"d": [[Ep(0), Ep(0)], [Ep(1), Ep(0)], [Ep(0), Ep(0)]]}, score, 1)
    after = evaluation_record({"d": [[Ep(1), Ep(1)], [Ep(1), Ep(1)], [Ep(1), Ep(0)]]}, score, 1)
    history = [
        {"rollout/reward_mean": 0.2, "rollout/groups_filtered": 3.0, "rollout/sampling_rounds": 2},
        {"rollout/reward_mean": 0.6},
    ]
    result = StagesResult(tmp_path, ["http://e:1"], before, after, history, {"steps": 5})
    run = FakeRun(tmp_path)
    summary = report_run(run, result, title="held-out", score="accuracy", dynamic_sampling=True)  # type: ignore[arg-type]
    assert summary["score_before"] == pytest.approx(1 / 6)
    assert summary["score_after"] == pytest.approx(5 / 6)
    assert summary["score_delta"] == pytest.approx(4 / 6)
    assert "paired over 3 items" in summary["verdict"]
    assert summary["verdict"].startswith("RL raised (beyond 2 standard errors) the held-out acc")
    assert summary["train_reward_first"] == 0.2 and summary["train_reward_last"] == 0.6
    assert summary["groups_filtered_total"] == 3.0 and summary["sampling_rounds_total"] == 3.0
    assert summary["steps"] == 2 and summary["dynamic_sampling"] is True
    assert summary["phases_s"]["rl"] == 3.0 and summary["phases_s"]["app_cpu_s"] > 0
    assert summary["sft"] == {"steps": 5} and summary["engine_urls"] == ["http://e:1"]
    # summary.json names the curves.
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["curves"] == [str(tmp_path / "curves" / "val-core.png")]
    text = run.console.export_text()
    assert "after RL (2 steps)" in text and "+0.667 ±" in text and "pass^2" in text
    assert "RL algorithm: grpo" in text and "RL raised" in text
    assert "time: rl (s)" in text and "app CPU (s)" in text


def test_an_evaluation_only_run_has_one_column_and_no_verdict(tmp_path: Path) -> None:
    after = evaluation_record({"d": [[Ep(1)], [Ep(0)]]}, score, 1)
    result = StagesResult(tmp_path, [], after=after)
    summary = summary_of(FakeRun(tmp_path), result, "task reward")  # type: ignore[arg-type]
    assert summary["score_after"] == 0.5 and "verdict" not in summary
    assert "score_before" not in summary and summary["steps"] == 0
    console = Console(record=True, width=120)
    console.print(results_table("eval", summary))
    text = console.export_text()
    assert "evaluation" in text and "change" not in text and "0.500 ± 0.500" in text
    assert all(line.count("│") == 3 for line in text.splitlines() if "time: " in line)


def test_the_table_shows_pass_k_at_powers_of_two_and_the_last_k(tmp_path: Path) -> None:
    items = [[Ep(1)] * 6 + [Ep(0)] * 6 for _ in range(3)]
    after = evaluation_record({"d": items}, score, 1)
    assert sum(key.startswith("pass^") for key in after["metrics"]) == 12
    summary = summary_of(FakeRun(tmp_path), StagesResult(tmp_path, [], after=after), "s")  # type: ignore[arg-type]
    console = Console(record=True, width=120)
    console.print(results_table("eval", summary))
    text = console.export_text()
    shown = [k for k in range(1, 13) if f"pass^{k} " in text]
    assert shown == [1, 2, 4, 8, 12]
    assert " 360 " in text and "360.000" not in text  # a count of tokens: no decimals
