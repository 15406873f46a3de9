"""The megatron train engine with pipeline parallelism, over real ranks (gloo, CPU).

The tiny Qwen3 (two layers) is split into two pipeline stages, one layer each, run by
Megatron's own 1F1B schedule (``get_forward_backward_func``) with the CPU p2p transport of
``megatron.cpu``. Every rank of the group calls ``compute_logprobs`` and ``train_step`` as
the loop does, and every rank must get the same answer, equal to the torch backend's on
the same rows: log-probs within 1e-5, loss / policy loss / gradient norm within 1e-5
relative, and the updated weights, gathered from both stages to Hugging Face names
(``export_hf``), within 1e-5. A checkpoint of the pipeline run resumes the next step
bitwise. Pipeline x tensor parallel (4 ranks) and pipeline x data parallel with tied
embeddings (4 ranks) take the same step. Needs the ``megatron`` extra (nox session
``megatron``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: uv sync --extra megatron")

from safetensors.torch import load_file

from turnrl.grpo_core.megatron.config import MegatronParallelConfig
from turnrl.grpo_core.megatron.engine import MegatronEngine, MegatronEngineConfig
from turnrl.grpo_core.training.torch_engine import TorchEngine, TorchEngineConfig
from turnrl.npu_runtime.net import free_port

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

GLOBAL_KEYS = ("loss", "pg_loss", "grad_norm", "num_tokens")


def engine_config(model_dir: Path, tp: int = 1, pp: int = 1) -> MegatronEngineConfig:
    from test_megatron_engine import settings

    parallel = MegatronParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    return MegatronEngineConfig(**settings(model_dir, parallel=parallel))  # type: ignore[arg-type]


def run_ranks(world: int, tp: int, pp: int, model_dir: Path, folder: Path) -> None:
    from rank_processes import run_rank_processes

    env = {
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, __file__, "--worker", str(tp), str(pp), str(model_dir)]
    envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]
    run_rank_processes([[*cmd, str(folder)]] * world, timeout=300, envs=envs)


def worker(tp: int, pp: int, model_dir: Path, folder: Path) -> None:
    """One rank: score, step, export, checkpoint, step again; then load the checkpoint and
    take the second step again (in this process: a rank costs half a minute to start).
    Rows by the engine's own layout."""
    torch.set_num_threads(1)
    batches = torch.load(folder / "batches.pt", weights_only=False)
    engine = MegatronEngine(engine_config(model_dir, tp, pp))
    dp_size, replica = engine.parallel_layout()
    dp_rank = torch.distributed.get_rank() // replica  # one replica's ranks are adjacent
    rows = batches[0].num_sequences // dp_size
    shares = [b.select(slice(dp_rank * rows, (dp_rank + 1) * rows)) for b in batches]
    out: dict[str, object] = {"layout": [dp_size, replica], "dp_rank": dp_rank}
    try:
        out["logprobs"] = engine.compute_logprobs(shares[0]).tolist()
        out["step1"] = engine.train_step(shares[0])
        engine.export_hf(folder / "exported")
        engine.save_checkpoint(folder / "ckpt", data_state={"next": 1})
        out["step2"] = engine.train_step(shares[1])
        assert engine.load_checkpoint(folder / "ckpt") == {"next": 1} and engine.step == 1
        out["step2_resumed"] = engine.train_step(shares[1])
    finally:
        engine.close()
    (folder / f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))


@dataclass
class TorchRun:
    """The model, the batches, and the torch backend's results on the whole batches."""

    model_dir: Path
    batches: Path
    logprobs: torch.Tensor
    step1: dict[str, float]
    weights: dict[str, torch.Tensor]
    step2: dict[str, float]


def torch_run(folder: Path, tied: bool) -> TorchRun:
    from test_megatron_engine import make_batch, settings, spread_model

    model_dir = spread_model(folder / "tiny", tie_word_embeddings=tied)
    batches = [make_batch(seed=1), make_batch(seed=5)]
    engine = TorchEngine(TorchEngineConfig(**settings(model_dir)))  # type: ignore[arg-type]
    for i, batch in enumerate(batches):  # old log-probs off the policy: ratios clip
        noise = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(i))
        batch.old_logprobs = (engine.compute_logprobs(batch) + 0.3 * noise) * batch.loss_mask
    torch.save(batches, folder / "batches.pt")
    logprobs = engine.compute_logprobs(batches[0])
    step1 = engine.train_step(batches[0])
    weights = {k: v.detach().clone() for k, v in engine.hf_model.named_parameters()}
    step2 = engine.train_step(batches[1])
    return TorchRun(model_dir, folder / "batches.pt", logprobs, step1, weights, step2)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> TorchRun:
    return torch_run(tmp_path_factory.mktemp("untied"), tied=False)


def assert_equals_torch(
    ref: TorchRun, folder: Path, world: int, layout: tuple[int, int]
) -> list[dict]:
    """Every rank's results in ``folder`` equal the torch backend's on its share of rows."""
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    assert {tuple(r["layout"]) for r in ranks} == {layout}
    dp_size, replica = layout
    assert [r["dp_rank"] for r in ranks] == [r // replica for r in range(world)]
    rows = ref.logprobs.shape[0] // dp_size
    worst: dict[str, float] = {"logprobs": 0.0, "weights": 0.0}
    for result in ranks:  # every stage of the replica reports the same
        dp = result["dp_rank"]
        theirs = ref.logprobs[dp * rows : (dp + 1) * rows]
        ours = torch.tensor(result["logprobs"])
        torch.testing.assert_close(ours, theirs[:, : ours.shape[1]], atol=1e-5, rtol=0)
        worst["logprobs"] = max(
            worst["logprobs"], float((ours - theirs[:, : ours.shape[1]]).abs().max())
        )
        for key in GLOBAL_KEYS:
            assert result["step1"][key] == pytest.approx(ref.step1[key], rel=1e-5), key
            assert result["step2"][key] == pytest.approx(ref.step2[key], rel=1e-5), key
            for step in ("step1", "step2"):
                difference = abs(result[step][key] / getattr(ref, step)[key] - 1)
                worst[key] = max(worst.get(key, 0.0), difference)
        # The checkpoint taken after step 1, loaded: step 2 again, bitwise.
        resumed = {**result["step2_resumed"], "step_time_s": result["step2"]["step_time_s"]}
        assert resumed == result["step2"]
    assert ref.step1["clip_frac"] > 0  # the clipped branch of the loss is tested
    exported = load_file(folder / "exported" / "model.safetensors")
    assert sorted(exported) == sorted(ref.weights)
    for name, value in exported.items():
        torch.testing.assert_close(value, ref.weights[name], atol=1e-5, rtol=0, msg=name)
        worst["weights"] = max(worst["weights"], float((value - ref.weights[name]).abs().max()))
    print(f"max |difference| to the torch backend, {world} ranks {layout}: {worst}")
    return ranks


def test_pp2_trains_as_the_torch_backend_and_resumes_exactly(
    untied: TorchRun, tmp_path: Path
) -> None:
    """Two ranks, two stages of one layer: log-probs on both, the step, the weights
    gathered over the stages; the checkpoint (one set of keys per stage) resumes the
    second step bitwise and is refused by a one-stage engine."""
    shutil.copy(untied.batches, tmp_path / "batches.pt")
    run_ranks(2, 1, 2, untied.model_dir, tmp_path)
    assert_equals_torch(untied, tmp_path, world=2, layout=(1, 2))
    engine = MegatronEngine(engine_config(untied.model_dir))
    try:
        with pytest.raises(ValueError, match="world size 1 and 2 model-parallel shards"):
            engine.load_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()


def test_pp2_x_tp2_with_tied_embeddings_trains_as_the_torch_backend(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Four ranks: two stages, each split over a TP-2 group; the embedding is tied, so the
    last stage holds a copy of it (split over TP) as the output layer and the two copies
    sum their gradients."""
    tied = torch_run(tmp_path_factory.mktemp("tied"), tied=True)
    shutil.copy(tied.batches, tmp_path / "batches.pt")
    run_ranks(4, 2, 2, tied.model_dir, tmp_path)
    assert_equals_torch(tied, tmp_path, world=4, layout=(1, 4))


def test_pp2_x_dp2_trains_as_the_torch_backend(untied: TorchRun, tmp_path: Path) -> None:
    """Four ranks: two data-parallel replicas of two stages; a replica's ranks adjacent, so
    ranks 0-1 take the first half of the rows and ranks 2-3 the second."""
    shutil.copy(untied.batches, tmp_path / "batches.pt")
    run_ranks(4, 1, 2, untied.model_dir, tmp_path)
    assert_equals_torch(untied, tmp_path, world=4, layout=(2, 2))


def test_a_pipeline_the_layers_do_not_fill_is_refused(untied: TorchRun) -> None:
    """More stages than layers, or layers that do not split evenly: named, before any
    process group starts."""
    from transformers import AutoConfig

    from turnrl.grpo_core.megatron.config import QwenArchitecture

    with pytest.raises(
        ValueError,
        match=r"--pipeline-model-parallel-size \(4\) is larger than num_hidden_layers \(2\)",
    ):
        MegatronEngine(engine_config(untied.model_dir, pp=4))
    arch = QwenArchitecture.from_hf_config(AutoConfig.from_pretrained(untied.model_dir))
    with pytest.raises(
        ValueError,
        match=r"num_hidden_layers \(3\) is not divisible by --pipeline-model-parallel-size \(2\)",
    ):
        MegatronParallelConfig(pipeline_model_parallel_size=2).check_model(
            replace(arch, num_layers=3)
        )


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.path.insert(0, str(Path(__file__).parent))
    _tp, _pp, _model, _folder = sys.argv[2:6]
    worker(int(_tp), int(_pp), Path(_model), Path(_folder))
