"""The trajectory audit on a tiny real Qwen3 model: behaviour log-probs the model computed
itself give a gap of ~0, perturbed ones the perturbation; boundaries and mismatches counted;
the run folder's weight versions found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from turnrl.grpo_core.recipe.audit import weights_of_version
from turnrl.grpo_core.training.audit import (
    AuditSequence,
    audit,
    quantiles,
    turn_boundaries,
)
from turnrl.grpo_core.training.batch import TrainBatch, pad_sequences
from turnrl.grpo_core.training.tiny_model import build_tiny_model
from turnrl.grpo_core.training.torch_engine import TorchEngine, TorchEngineConfig

MASKS = [[0] * 5 + [1] * 4 + [0] * 3 + [1] * 4, [0] * 3 + [1] * 6]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TorchEngine:
    tiny = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return TorchEngine(TorchEngineConfig(model_path=str(tiny), temperature=0.8))


def own_sequences(engine: TorchEngine) -> list[AuditSequence]:
    """Random ids whose behaviour log-probs are the model's own."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, 700, (len(m),), generator=g).tolist() for m in MASKS]
    batch = TrainBatch(*pad_sequences(ids, MASKS, 0))
    logp = engine.compute_logprobs(batch)
    return [
        AuditSequence(i, m, logp[row, : len(i)].tolist())
        for row, (i, m) in enumerate(zip(ids, MASKS, strict=True))
    ]


def test_the_models_own_logprobs_have_no_gap_and_a_perturbation_shows(
    engine: TorchEngine,
) -> None:
    sequences = own_sequences(engine)
    report = audit(engine, sequences).summary()
    assert report["sequences"] == 2 and report["tokens"] == 14
    assert report["gap"]["max"] < 1e-5 and report["boundary_gap"]["max"] < 1e-5
    assert report["boundaries"] == 3 + 1  # 0->1, 1->0, 0->1 and 0->1
    assert report["boundary_mismatches"] is None  # no retokenizer: not compared

    first = sequences[0]
    shifted = list(first.logprobs)
    shifted[5] -= 0.5  # the first sampled token of the first turn
    perturbed = AuditSequence(first.ids, first.loss_mask, shifted)
    report = audit(engine, [perturbed, sequences[1]]).summary()
    assert report["gap"]["max"] == pytest.approx(0.5, abs=1e-4)
    assert report["gap"]["p50"] < 1e-5 and report["boundary_gap"]["max"] == report["gap"]["max"]


def test_a_fresh_tokenisation_that_differs_at_a_boundary_is_a_mismatch(
    engine: TorchEngine,
) -> None:
    sequences = own_sequences(engine)

    def merge_at_first_turn(ids: list[int]) -> list[int]:  # a re-render that merges 2 ids
        return [*ids[:4], 9, *ids[6:]] if ids == sequences[0].ids else ids

    report = audit(engine, sequences, retokenize=merge_at_first_turn).summary()
    assert report["boundary_mismatches"] == 1 and report["token_mismatches"] == 2
    assert report["examples"] == [
        {"sequence": 0, "boundary": 5, "exported": sequences[0].ids[4:6], "fresh": [9]}
    ]
    clean = audit(engine, sequences, retokenize=list).summary()
    assert clean["boundary_mismatches"] == clean["token_mismatches"] == 0


def test_units() -> None:
    assert turn_boundaries([0, 0, 1, 1, 0, 1]) == [2, 4, 5]
    q = quantiles([float(x) for x in range(101)])
    assert q is not None and (q["p50"], q["p90"], q["p99"], q["max"]) == (50, 90, 99, 100)
    assert quantiles([]) is None
    with pytest.raises(ValueError, match="differ in length"):
        AuditSequence([1, 2], [0, 1], [0.0])
    with pytest.raises(ValueError, match=r"loss_mask\[0\]"):
        AuditSequence([1, 2], [1, 1], [0.0, 0.0])


def test_weight_versions_of_a_run_folder(tmp_path: Path) -> None:
    base = tmp_path / "model" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    assert weights_of_version(tmp_path, 0) == (base, None)
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({}))
    assert weights_of_version(tmp_path, 2) == (base, step)
    exported = tmp_path / "weights" / "v2"
    exported.mkdir(parents=True)
    (exported / "config.json").write_text("{}")
    assert weights_of_version(tmp_path, 2) == (exported, None)  # the export wins
    sft = tmp_path / "model" / "sft"
    sft.mkdir()
    (sft / "sft.json").write_text("{}")
    (sft / "config.json").write_text("{}")
    assert weights_of_version(tmp_path, 0) == (sft, None)
    with pytest.raises(FileNotFoundError, match=r"version 1 \(kept: step_2, v2\)"):
        weights_of_version(tmp_path, 1)
