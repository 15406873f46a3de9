"""GRPOLoop through Ray trainer actors (RayTrainerGroup / RayGRPORun) on two simulated nodes.

The toy task of ``testing/golden.py`` runs three GRPO steps twice: once with one in-process
TorchEngine (``golden.build_toy_loop``), once through :class:`RayGRPORun` (2 CPU trainer
ranks, FSDP2 over gloo, on one node; two fake engines on the other node, synced through
disk). Both sample with the same seeded sampler from the weights the engines would serve,
so the samples are identical and the per-step losses agree within ``LOSS_ATOL`` /
``LOSS_RTOL`` (the two runs differ only in float summation order). The group then
restores the step-2 checkpoint and reruns step 3 exactly; last, a trainer actor is killed
(a clear error within seconds, no hang). One run serves all (actor start-up is the cost).

The pure helpers (row shards, metric reduction) are tested without Ray at the end.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

from turnrl.grpo_core.loop.loop import GRPOLoop, latest_checkpoint
from turnrl.grpo_core.placement.plan import PlacementConfig
from turnrl.grpo_core.placement.trainer_group import (
    RayGRPORun,
    RayTrainerGroup,
    TrainerGroupError,
    reduce_train_metrics,
    shard_bounds,
)
from turnrl.grpo_core.testing import golden
from turnrl.grpo_core.training.batch import TrainBatch
from turnrl.grpo_core.training.policy import load_causal_lm
from turnrl.grpo_core.training.reference import ReferencePolicy
from turnrl.grpo_core.training.tiny_model import TinyModelConfig, build_tiny_model
from turnrl.rollout_router.testing import ThreadedFakeEngine

TOY = golden.ToyRunConfig(steps=3)
"""Three steps of the golden toy run (16 samples a step, two updates a step)."""
LOSS_ATOL, LOSS_RTOL = 1e-5, 1e-3
"""Per-step loss / grad-norm agreement between 2 Ray ranks and one process."""
ACTOR_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PLACEMENT = PlacementConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, accelerator="CPU")


class ServedPolicy:
    """The weights the engines serve: the newest folder the disk weight sync exported."""

    def __init__(self, initial: Path) -> None:
        self.initial = initial
        self.loop: GRPOLoop | None = None
        self._cache: tuple[Path, Any] | None = None

    def model(self) -> Any:
        assert self.loop is not None and self.loop.weight_sync is not None
        sync: Any = self.loop.weight_sync
        folder = sync.root / f"v{sync.versions[-1]}" if sync.versions else self.initial
        if self._cache is None or self._cache[0] != folder:
            self._cache = (folder, load_causal_lm(folder, torch.float32))
        return self._cache[1]


def toy_generate(policy: ServedPolicy) -> Callable[[list[list[int]], int], Any]:
    """``golden.build_toy_loop``'s sampler, drawing from the served weights."""

    async def generate(prompts: list[list[int]], n: int) -> list[golden.ToySample]:
        assert policy.loop is not None
        out = []
        for prompt in prompts:
            seed = golden.sampling_seed(TOY.seed, policy.loop.step, prompt)
            ids, logps = golden.sample_group(
                policy.model(), prompt, n, TOY.response_len, torch.Generator().manual_seed(seed)
            )
            for row, row_logps in zip(ids.tolist(), logps.tolist(), strict=True):
                out.append(golden.ToySample(prompt, row, [1] * len(row), row_logps, str(prompt)))
        return out

    return generate


def ray_loop(run: RayGRPORun, model: Path, work: Path, save_interval: int) -> GRPOLoop:
    policy = ServedPolicy(model)
    loop = run.make_loop(
        TOY.loop_config(save_interval),
        golden.toy_prompts(TOY.num_prompts),
        toy_generate(policy),
        golden.toy_reward,
        pad_id=0,
        sync_root=work / "sync",
        checkpoint_dir=work / "ckpt",
    )
    policy.loop = loop
    return loop


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("ray-loop") / "tiny", TinyModelConfig(seed=TOY.model_seed)
    )


@pytest.fixture(scope="module")
def one_process(tiny_model: Path) -> list[dict[str, float]]:
    """The three steps with one in-process TorchEngine."""
    with golden.deterministic_torch():
        return asyncio.run(golden.build_toy_loop(tiny_model, TOY).run())


@dataclass
class RayRunResult:
    run: RayGRPORun
    loop: GRPOLoop
    history: list[dict[str, float]]
    work: Path
    engine_versions: list[str | None]


@pytest.fixture(scope="module")
def ray_result(
    cluster: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RayRunResult]:
    """The three steps through 2 Ray trainer ranks and 2 fake engines, checkpoint at step 2."""
    from turnrl.grpo_core.placement.actors import EngineLaunch
    from turnrl.rollout_router.client import EngineClient

    work = tmp_path_factory.mktemp("ray-run")
    run = RayGRPORun(
        PLACEMENT,
        TOY.trainer_config(tiny_model),
        EngineLaunch(server=ThreadedFakeEngine),
        env=ACTOR_ENV,
    ).start()
    try:
        loop = ray_loop(run, tiny_model, work, save_interval=2)
        with golden.deterministic_torch():
            history = asyncio.run(loop.run())

        async def served_versions() -> list[str | None]:
            versions = []
            for url in run.engine_urls:
                async with EngineClient(url) as client:
                    versions.append(await client.weight_version())
            return versions

        versions = asyncio.run(served_versions())
        yield RayRunResult(run, loop, history, work, versions)
    finally:
        run.shutdown()


@pytest.mark.slow
def test_ray_loop_matches_one_process(
    ray_result: RayRunResult, one_process: list[dict[str, float]], cluster: Any
) -> None:
    """Same samples, same per-step loss and grad norm as one TorchEngine; placed as asked."""
    ray_steps, ref_steps = ray_result.history, one_process
    assert len(ray_steps) == len(ref_steps) == TOY.steps
    for number, (got, want) in enumerate(zip(ray_steps, ref_steps, strict=True), 1):
        # Identical samples: the sampler drew the same tokens from the same weights.
        assert got["rollout/reward_mean"] == want["rollout/reward_mean"], number
        for key in ("train/loss", "train/grad_norm", "train/pg_loss", "train/num_tokens"):
            assert got[key] == pytest.approx(want[key], abs=LOSS_ATOL, rel=LOSS_RTOL), (number, key)
        for key in ("train/clip_frac", "train/approx_kl"):
            if key in want:
                assert got[key] == pytest.approx(want[key], abs=1e-4, rel=1e-2), (number, key)
    # The policy learned something (not a flat run that any trainer would match).
    assert ray_steps[-1]["train/grad_norm"] > 0
    assert len({round(s["train/loss"], 6) for s in ray_steps}) == TOY.steps
    # Disaggregated over 2 nodes: both trainer ranks on one node, the engine on the other.
    placement = ray_result.run.placement
    assert len(set(placement.trainer_nodes)) == 1
    assert len(placement.engine_nodes) == 2 and len(set(placement.engine_nodes)) == 1
    assert placement.engine_nodes[0] not in placement.trainer_nodes
    # Both engines confirmed every step's weights; only the newest export stays on disk.
    assert ray_result.engine_versions == [str(TOY.steps)] * 2
    assert sorted(p.name for p in (ray_result.work / "sync").iterdir()) == [f"v{TOY.steps}"]
    assert latest_checkpoint(ray_result.work / "ckpt") == ray_result.work / "ckpt" / "step_2"


@pytest.mark.slow
def test_uneven_shards_and_reference_match_one_process(
    ray_result: RayRunResult, tiny_model: Path
) -> None:
    """3 rows over 2 ranks (2 + 1) and 1 row (a filler row on rank 1) give the log-probs
    one process computes; the reference policy on the ranks matches one in-process."""
    group = ray_result.run.trainers
    assert group is not None
    local = ReferencePolicy(tiny_model, micro_batch_size=8)
    current = ReferencePolicy(ray_result.work / "sync" / f"v{TOY.steps}", micro_batch_size=8)
    batch = ragged_batch(3)
    torch.testing.assert_close(group.compute_logprobs(batch), current.compute_logprobs(batch))
    one_row = batch.select(slice(1, 2))
    torch.testing.assert_close(group.compute_logprobs(one_row), current.compute_logprobs(one_row))
    reference = group.build_reference(tiny_model, micro_batch_size=8)
    attached = reference.attach(batch)
    assert attached.ref_logprobs is not None
    torch.testing.assert_close(attached.ref_logprobs, local.compute_logprobs(batch))
    # The trained policy moved away from the reference on the trained tokens.
    assert not torch.allclose(attached.ref_logprobs, current.compute_logprobs(batch))


def ragged_batch(rows: int) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 700, (rows, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[0, 7:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 4:] = 1
    return TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask * attn)


@pytest.mark.slow
def test_a_failed_call_names_the_rank_and_keeps_the_group(
    ray_result: RayRunResult, tmp_path: Path
) -> None:
    """An error raised on the ranks (before any collective) comes back as a
    TrainerGroupError with the rank, method and cause; the group stays usable."""
    group = ray_result.run.trainers
    assert group is not None
    with pytest.raises(
        TrainerGroupError, match=r"trainer rank [01] failed in load_checkpoint: FileNotFoundError"
    ):
        group.load_checkpoint(tmp_path / "no-such-checkpoint")
    assert group.broken is None
    assert group.compute_logprobs(ragged_batch(2)).shape == (2, 12)


@pytest.mark.slow
def test_resume_from_checkpoint_equals_the_uninterrupted_step(
    ray_result: RayRunResult, tiny_model: Path
) -> None:
    """The group, now past step 3, restores the step-2 checkpoint (weights, optimizer, RNG
    on every rank; loop position): the step it runs then is the uninterrupted step 3."""
    run = ray_result.run
    folder = latest_checkpoint(ray_result.work / "ckpt")
    assert folder is not None and folder.name == "step_2"
    loop = ray_loop(run, tiny_model, ray_result.work / "resumed", save_interval=0)
    assert run.trainers is not None
    probe = ragged_batch(2)
    before = run.trainers.compute_logprobs(probe)
    with golden.deterministic_torch():
        assert asyncio.run(loop.resume(folder)) == 2
        # Not a no-op: the group held the step-3 weights, now those of step 2.
        assert not torch.allclose(run.trainers.compute_logprobs(probe), before)
        step3 = asyncio.run(loop.run_step())
    want = ray_result.history[2]
    assert step3["rollout/reward_mean"] == want["rollout/reward_mean"]
    for key in ("train/loss", "train/grad_norm", "train/pg_loss"):
        assert step3[key] == pytest.approx(want[key], abs=1e-7, rel=1e-6), key
    assert loop.history[:2] == ray_result.history[:2]


@pytest.mark.slow
def test_the_ranks_collective_sync_delivers_the_groups_weights(
    ray_result: RayRunResult, tmp_path: Path
) -> None:
    """On GPUs and NPUs a Ray run's weights go from the ranks over NCCL / HCCL
    (``group_weight_sync``). The same :class:`RayCollectiveSync` here runs over gloo to a
    stand-in engine (``collective_receiver.py``: vLLM's routes, a torch receiver; no GPU
    here): both ranks gather their FSDP shards, rank 0 sends, and the engine holds exactly
    the weights the group exports, at the version sent."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from turnrl.grpo_core.placement.trainer_group import RayCollectiveSync
    from turnrl.grpo_core.weight_sync.collective import CollectiveSyncConfig
    from turnrl.rollout_router.client import EngineClient

    group = ray_result.run.trainers
    assert group is not None
    receiver = Path(__file__).with_name("collective_receiver.py")
    proc = subprocess.Popen([sys.executable, str(receiver), "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{proc.stdout.readline().split()[1]}"
        config = CollectiveSyncConfig(
            engine_urls=[url], backend="gloo", workers_per_engine=None, init_timeout_s=60.0
        )
        sync = RayCollectiveSync(group, config)

        async def send_and_dump(version: int) -> tuple[dict[str, float], str | None]:
            timings = await sync.sync(group, version)
            async with EngineClient(url) as client:
                await client._call("POST", "/dump", {"path": str(tmp_path / "got.safetensors")})
                return timings, await client.weight_version()

        timings, served = asyncio.run(send_and_dump(11))
        exported = load_file(str(group.export_hf(tmp_path / "export") / "model.safetensors"))
        got = load_file(str(tmp_path / "got.safetensors"))
        assert served == "11" and timings["bytes"] > 0 and timings["buckets"] >= 1
        assert got.keys() == exported.keys()
        for name, tensor in exported.items():
            assert torch.equal(got[name], tensor), name
        assert asyncio.run(send_and_dump(12))[1] == "12"  # the group is kept between syncs
        asyncio.run(sync.close())
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.slow
def test_killed_trainer_rank_is_a_clear_error(ray_result: RayRunResult) -> None:
    """A dead rank: the step fails within seconds naming rank and method; later calls too."""
    ray = pytest.importorskip("ray")
    group = ray_result.run.trainers
    assert group is not None
    ray.kill(group.actors[1])
    start = time.monotonic()
    with pytest.raises(TrainerGroupError, match=r"trainer rank 1 died during compute_logprobs"):
        asyncio.run(ray_result.loop.run_step())
    assert time.monotonic() - start < 60
    with pytest.raises(TrainerGroupError, match=r"stopped .*rank 1 died.*train_step cannot run"):
        group.train_step(ragged_batch(2))


# -- pure helpers (no Ray) ----------------------------------------------------------------


def test_shard_bounds_are_contiguous_and_nearly_even() -> None:
    assert shard_bounds(8, 2) == [(0, 4), (4, 8)]
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    with pytest.raises(ValueError, match="num_rows >= 1"):
        shard_bounds(0, 2)
    with pytest.raises(ValueError, match="world_size >= 1"):
        shard_bounds(3, 0)


def test_reduce_train_metrics_weights_local_means_by_tokens() -> None:
    ranks = [
        {"loss": 0.5, "grad_norm": 2.0, "num_tokens": 40.0, "clip_frac": 0.1, "step_time_s": 1.0},
        {"loss": 0.5, "grad_norm": 2.0, "num_tokens": 40.0, "clip_frac": 0.4, "step_time_s": 3.0},
        {
            "loss": 0.5,
            "grad_norm": 2.0,
            "num_tokens": 40.0,
            "clip_frac": float("nan"),
            "step_time_s": 2.0,
        },
    ]
    out = reduce_train_metrics(ranks, [30, 10, 0])  # rank 2 held only a filler row
    assert out["loss"] == 0.5 and out["grad_norm"] == 2.0 and out["num_tokens"] == 40.0
    assert out["clip_frac"] == pytest.approx((0.1 * 30 + 0.4 * 10) / 40)
    assert out["step_time_s"] == 3.0


def test_bad_group_and_run_inputs_are_clear_errors() -> None:
    """No Ray needed: the checks run before anything is started."""
    from turnrl.grpo_core.placement.actors import RayPlacement

    tiny_model_path = Path("not-loaded")  # nothing reads it before start()

    with pytest.raises(ValueError, match="no trainers: call start_trainers"):
        RayTrainerGroup(RayPlacement(PlacementConfig(accelerator="CPU")))
    run = RayGRPORun(PLACEMENT, TOY.trainer_config(tiny_model_path))
    with pytest.raises(RuntimeError, match=r"call RayGRPORun.start\(\) first"):
        run.make_loop(
            TOY.loop_config(0),
            [[1]],
            toy_generate(ServedPolicy(tiny_model_path)),
            golden.toy_reward,
            pad_id=0,
        )
