"""Golden loss curve: a fresh seeded toy run matches the stored per-step numbers.

The golden file is per device kind (``tests/golden/loop_<device>.json``, as torchtitan
keeps them); a device without one is skipped with a message saying how to create it.
Tolerance: ``golden.RTOL`` (1e-4 relative) / ``golden.ATOL`` (1e-5) on loss, reward mean
and grad norm on the kind of CPU that wrote the file (bit-identical on the same machine),
``golden.CROSS_MACHINE_RTOL`` (1e-2) on another kind (``golden.cpu_kind``). A second run
with every weight perturbed by ``golden.KERNEL_NOISE`` must stay within the tight
tolerance, so a machine whose kernels sum in another order does not fail the test.
Update after an intended change: ``python -m turnrl.grpo_core.testing.golden --update``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from turnrl.grpo_core.testing import golden

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def test_golden_dir_is_where_the_update_command_writes() -> None:
    source = GOLDEN_DIR.parents[1] / "src"
    if not Path(golden.__file__).resolve().is_relative_to(source):
        pytest.skip("turnrl.grpo_core is installed from a wheel: no source tree to write to")
    assert golden.default_golden_dir() == GOLDEN_DIR


@pytest.mark.slow
def test_toy_run_matches_the_golden_curve(tmp_path: Path) -> None:
    kind = golden.device_kind()
    path = golden.golden_file(kind, GOLDEN_DIR)
    if not path.is_file():
        pytest.skip(
            f"no golden loss curve for device kind {kind!r} ({path.name}); create it on such "
            "a machine with `python -m turnrl.grpo_core.testing.golden --update`"
        )
    want = json.loads(path.read_text())
    threads = torch.get_num_threads()
    run = golden.run_golden(tmp_path)
    assert torch.get_num_threads() == threads  # the deterministic settings were restored
    assert not torch.are_deterministic_algorithms_enabled()
    rtol = golden.golden_rtol(want, run)
    problems = golden.compare_golden(want, run, rtol=rtol)
    assert not problems, (
        f"golden recorded with torch {want['torch']} on {want['device']} "
        f"({want.get('cpu')}), this run torch {run['torch']} ({run.get('cpu')}), rtol {rtol}: "
        f"{problems}; if intended, rerun with --update"
    )
    # The toy task is learnable: the curve is not flat noise.
    rewards = [s["rollout/reward_mean"] for s in run["steps"]]
    assert rewards[-1] > rewards[0]


@pytest.mark.slow
def test_toy_run_absorbs_kernel_level_noise(tmp_path: Path) -> None:
    clean = golden.run_golden(tmp_path / "clean")
    noisy = golden.run_golden(tmp_path / "noisy", weight_noise=golden.KERNEL_NOISE)
    assert noisy["steps"][0] != clean["steps"][0]  # the noise reached the run
    assert golden.compare_golden(clean, noisy) == []


def _record() -> dict:
    steps = [
        {"train/loss": 0.5, "rollout/reward_mean": 0.25, "train/grad_norm": 2.0},
        {"train/loss": -0.1, "rollout/reward_mean": 0.5, "train/grad_norm": 1.0},
    ]
    return {"config": {"steps": 2}, "steps": steps}


def test_compare_accepts_differences_within_tolerance() -> None:
    run = _record()
    run["steps"][0]["train/loss"] *= 1 + golden.RTOL / 2
    run["steps"][1]["train/grad_norm"] += golden.ATOL / 2
    assert golden.compare_golden(_record(), run) == []


def test_compare_reports_each_metric_out_of_tolerance() -> None:
    run = _record()
    run["steps"][0]["train/loss"] *= 1 + 3 * golden.RTOL
    run["steps"][1]["rollout/reward_mean"] = 0.5 + 1 / 64  # one token sampled differently
    problems = golden.compare_golden(_record(), run)
    assert len(problems) == 2
    assert problems[0].startswith("step 1 train/loss")
    assert problems[1].startswith("step 2 rollout/reward_mean")


def test_compare_reports_another_config_or_length() -> None:
    other = copy.deepcopy(_record())
    other["config"] = {"steps": 3}
    assert "config" in golden.compare_golden(_record(), other)[0]
    shorter = _record()
    shorter["steps"] = shorter["steps"][:1]
    assert "2 steps" in golden.compare_golden(_record(), shorter)[0]


def test_toy_run_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="steps must be >= 1"):
        golden.ToyRunConfig(steps=0)
    with pytest.raises(ValueError, match="response_len must be >= 1"):
        golden.ToyRunConfig(response_len=0)


def test_sampling_seed_depends_on_step_and_prompt() -> None:
    base = golden.sampling_seed(0, 3, [1, 2, 3])
    assert base == golden.sampling_seed(0, 3, [1, 2, 3])
    assert base != golden.sampling_seed(0, 4, [1, 2, 3])
    assert base != golden.sampling_seed(0, 3, [1, 2, 4])
    assert base != golden.sampling_seed(1, 3, [1, 2, 3])
