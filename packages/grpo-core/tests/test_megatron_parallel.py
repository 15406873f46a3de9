"""The megatron train engine over several real ranks (gloo, CPU): tensor and data parallel.

The layout runs as real processes joined by ``torch.distributed`` from the launcher
variables (as torchrun or the Ray trainer group set them). Every rank builds a
``MegatronEngine`` and trains on its data-parallel share of the same GRPO batch (TP peers
get the same rows); the results must equal one rank training on the whole batch:
log-probs, loss, gradient norm (each TP shard and each replicated weight counted once; the
query / key norms' partial gradients summed over TP), and the updated weights gathered back
to Hugging Face names. A checkpoint of the parallel run resumes it exactly, and is refused
by an engine of another tensor-parallel size. Needs the
``megatron`` extra (nox session ``megatron``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: uv sync --extra megatron")

from safetensors.torch import load_file

from turnrl.grpo_core.megatron.config import MegatronParallelConfig
from turnrl.grpo_core.megatron.engine import MegatronEngine, MegatronEngineConfig
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.npu_runtime.net import free_port

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

GLOBAL_KEYS = ("loss", "pg_loss", "grad_norm", "num_tokens")


def engine_config(model_dir: Path, tp: int = 1, sp: bool = False) -> MegatronEngineConfig:
    from test_megatron_engine import settings

    parallel = MegatronParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    return MegatronEngineConfig(**settings(model_dir, parallel=parallel))  # type: ignore[arg-type]


def grpo_batches(model_dir: Path) -> list[TrainBatch]:
    """Two GRPO mini-batches with old log-probs off the current policy (ratios clip)."""
    from test_megatron_engine import make_batch

    engine = MegatronEngine(engine_config(model_dir))
    try:
        batches = [make_batch(seed=1), make_batch(seed=5)]
        for i, batch in enumerate(batches):
            noise = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(i))
            batch.old_logprobs = (engine.compute_logprobs(batch) + 0.3 * noise) * batch.loss_mask
    finally:
        engine.close()
    return batches


def run_ranks(
    world: int, tp: int, phase: str, model_dir: Path, folder: Path, sp: bool = False
) -> None:
    from rank_processes import run_rank_processes

    env = {
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(tp),
        str(sp),
        phase,
        str(model_dir),
        str(folder),
    ]
    envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]
    run_rank_processes([cmd] * world, timeout=300, envs=envs)


def worker(tp: int, sp: bool, phase: str, model_dir: Path, folder: Path) -> None:
    """One rank: ``train`` = score, step, export, checkpoint, step again; ``resume`` = load
    the checkpoint and take the second step again."""
    torch.set_num_threads(1)
    batches = torch.load(folder / "batches.pt", weights_only=False)
    engine = MegatronEngine(engine_config(model_dir, tp, sp))
    dp_rank = torch.distributed.get_rank() // tp  # Megatron's order: TP ranks adjacent
    rows = batches[0].num_sequences // engine.dp_size
    shares = [b.select(slice(dp_rank * rows, (dp_rank + 1) * rows)) for b in batches]
    out: dict[str, object] = {"dp_size": engine.dp_size, "tp": engine.model_parallel_size}
    try:
        if phase == "train":
            out["logprobs"] = engine.compute_logprobs(shares[0]).tolist()
            out["step1"] = engine.train_step(shares[0])
            engine.export_hf(folder / "exported")
            engine.save_checkpoint(folder / "ckpt", data_state={"next": 1})
        else:
            assert engine.load_checkpoint(folder / "ckpt") == {"next": 1}
        out["step2"] = engine.train_step(shares[1])
    finally:
        engine.close()
    rank = int(os.environ["RANK"])
    (folder / f"{phase}{rank}.json").write_text(json.dumps(out))


@dataclass
class OneRank:
    """The model, the batches, and one rank's results on the whole batches."""

    model_dir: Path
    batches: Path
    logprobs: torch.Tensor
    step1: dict[str, float]
    weights: dict[str, torch.Tensor]
    step2: dict[str, float]


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> OneRank:
    from test_megatron_engine import spread_model

    model_dir = spread_model(tmp_path_factory.mktemp("tiny"))
    batches = grpo_batches(model_dir)
    path = tmp_path_factory.mktemp("data") / "batches.pt"
    torch.save(batches, path)
    engine = MegatronEngine(engine_config(model_dir))
    try:
        logprobs = engine.compute_logprobs(batches[0])
        step1 = engine.train_step(batches[0])
        weights = {k: v.clone() for k, v in engine.hf_weights()}  # views on the CPU
        step2 = engine.train_step(batches[1])
    finally:
        engine.close()
    return OneRank(model_dir, path, logprobs, step1, weights, step2)


def assert_equals_one_rank(one: OneRank, folder: Path, world: int, tp: int) -> list[dict[str, Any]]:
    """Each rank's results in ``folder`` equal one rank's on its share of the batches."""
    ranks = [json.loads((folder / f"train{r}.json").read_text()) for r in range(world)]
    assert {(r["dp_size"], r["tp"]) for r in ranks} == {(world // tp, tp)}
    rows = one.logprobs.shape[0] // (world // tp)
    for rank, result in enumerate(ranks):
        # Log-probs: this rank's data-parallel share of rows, as one rank scores them.
        theirs = one.logprobs[(rank // tp) * rows : (rank // tp + 1) * rows]
        ours = torch.tensor(result["logprobs"])
        torch.testing.assert_close(ours, theirs[:, : ours.shape[1]], atol=1e-5, rtol=0)
        for key in GLOBAL_KEYS:  # every rank reports the step of the whole batch
            assert result["step1"][key] == pytest.approx(one.step1[key], rel=1e-5), key
            assert result["step2"][key] == pytest.approx(one.step2[key], rel=1e-5), key
    assert one.step1["clip_frac"] > 0  # the ratios were off 1: the clipped branch is tested
    exported = load_file(folder / "exported" / "model.safetensors")
    assert sorted(exported) == sorted(one.weights)
    for name, value in exported.items():
        torch.testing.assert_close(value, one.weights[name], atol=1e-5, rtol=0, msg=name)
    return ranks


def test_tp2_dp2_training_equals_one_rank_and_resumes_exactly(one: OneRank, tmp_path: Path) -> None:
    """Four ranks: two data-parallel copies, each split over a TP-2 group."""
    world, tp = 4, 2
    shutil.copy(one.batches, tmp_path / "batches.pt")
    run_ranks(world, tp, "train", one.model_dir, tmp_path)
    ranks = assert_equals_one_rank(one, tmp_path, world, tp)
    # Resume from the step-1 checkpoint: the second step again, exactly.
    run_ranks(world, tp, "resume", one.model_dir, tmp_path)
    for rank, result in enumerate(ranks):
        again = json.loads((tmp_path / f"resume{rank}.json").read_text())
        assert again["step2"]["loss"] == result["step2"]["loss"]
        assert again["step2"]["grad_norm"] == result["step2"]["grad_norm"]
    # Its shards fit no other layout: refused, named.
    engine = MegatronEngine(engine_config(one.model_dir))
    try:
        with pytest.raises(
            ValueError,
            match="world size 2 and 2 model-parallel shards, this run has world size 1 and 1",
        ):
            engine.load_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()


def test_tp2_with_sequence_parallel_equals_one_rank(one: OneRank, tmp_path: Path) -> None:
    """Two ranks, one TP-2 group with sequence parallelism: the sequence split over the
    ranks between the tensor-parallel layers, the norms' partial gradients summed."""
    shutil.copy(one.batches, tmp_path / "batches.pt")
    run_ranks(2, 2, "train", one.model_dir, tmp_path, sp=True)
    assert_equals_one_rank(one, tmp_path, world=2, tp=2)


def test_the_ray_trainer_group_runs_tensor_parallel_megatron(cluster: Any, tmp_path: Path) -> None:
    """The golden toy GRPO run through :class:`RayGRPORun` with two trainer ranks in one
    TP-2 group (fake engines, disk weight sync): the group gives both ranks the same rows,
    and the run equals the one-process megatron run step for step."""
    from test_loop_ray import ACTOR_ENV, LOSS_ATOL, LOSS_RTOL, PLACEMENT, TOY, ray_loop

    from turnrl.grpo_core.placement.actors import EngineLaunch
    from turnrl.grpo_core.placement.trainer_group import RayGRPORun
    from turnrl.grpo_core.testing import golden
    from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
    from turnrl.rollout_router.testing import ThreadedFakeEngine

    model = build_tiny_model(tmp_path / "tiny", TinyModelConfig(seed=TOY.model_seed))
    with golden.deterministic_torch():
        loop = golden.build_toy_loop(model, TOY, backend="megatron")
        try:
            one_process = asyncio.run(loop.run())
        finally:
            loop.trainer.close()
    tp2 = replace(
        TOY.trainer_config(model, "megatron"),
        parallel=MegatronParallelConfig(tensor_model_parallel_size=2),
    )
    run = RayGRPORun(PLACEMENT, tp2, EngineLaunch(server=ThreadedFakeEngine), env=ACTOR_ENV)
    try:
        run.start()
        assert run.trainers is not None and run.trainers.model_parallel_size == 2
        with golden.deterministic_torch():
            history = asyncio.run(ray_loop(run, model, tmp_path / "work", 0).run())
    finally:
        run.shutdown()
    assert len(history) == len(one_process) == TOY.steps
    for number, (got, want) in enumerate(zip(history, one_process, strict=True), 1):
        assert got["rollout/reward_mean"] == want["rollout/reward_mean"], number
        for key in ("train/loss", "train/grad_norm", "train/num_tokens"):
            assert got[key] == pytest.approx(want[key], abs=LOSS_ATOL, rel=LOSS_RTOL), (number, key)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.path.insert(0, str(Path(__file__).parent))
    _tp, _sp, _phase, _model, _folder = sys.argv[2:7]
    worker(int(_tp), _sp == "True", _phase, Path(_model), Path(_folder))
